"""What the toolchain modules share: their error, the factory's cache folder, and how they run
a child command (pip in the factory's own environment; a failure with the tail of its stderr)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from ci.runtime.env import FactoryEnv
from ci.runtime.errors import FactoryError, InputError
from ci.runtime.pip_env import pip_environ


class ToolchainError(InputError, RuntimeError):
    """A build tool is missing or wrong; the message says what to install or set."""


# Written into the cache folder by the factory: `nox -s clean` removes only a folder that holds it.
CACHE_MARKER = ".sageattn3-factory-cache"


def cache_path() -> Path:
    """Where the factory's cache is (``$SAGEATTN3_CACHE``, else the XDG cache folder), unmade."""
    env = FactoryEnv.from_environ()
    root = env.cache or os.path.join(
        env.xdg_cache_home or os.path.expanduser("~/.cache"), "sageattn3-factory"
    )
    return Path(root)


def cache_root() -> Path:
    p = cache_path()
    p.mkdir(parents=True, exist_ok=True)
    marker = p / CACHE_MARKER
    if not marker.exists():
        marker.write_text("sageattn3 wheel factory cache: `nox -s clean` may remove this folder\n")
    return p


def run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, check=True, text=True, **kw)


def run_pip(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    """A pip or venv command in the factory's own environment (ci.runtime.pip_env): no caller setting
    changes what it installs."""
    return run(cmd, env=pip_environ(), **kw)


class CommandFailed(subprocess.CalledProcessError, FactoryError):
    """A child command that failed, its message ending with the last lines of its stderr (a
    broken torch environment says why, not only which command). A failure of the factory
    (exit status 1 through ``run_main``) that code catching ``CalledProcessError`` still catches."""

    TAIL_LINES = 20

    def __str__(self) -> str:
        tail = [ln for ln in (self.stderr or "").strip().splitlines() if ln.strip()][-self.TAIL_LINES:]
        return super().__str__() + (":\n  " + "\n  ".join(tail) if tail else " (nothing on stderr)")


def _output(cmd: list[str], **kw) -> str:
    p = subprocess.run(cmd, text=True, capture_output=True, **kw)
    if p.returncode != 0:
        raise CommandFailed(p.returncode, cmd, p.stdout, p.stderr)
    return p.stdout
