"""wine on this Linux machine: Debian's ``wine64`` package (the loader, ``wine64``), its prefix
(the Windows side's ``C:``) made once in the factory's cache (``<cache>/windows/``), and the paths
its programs see: the toolchain folder on :data:`TOOLS_DRIVE`, anything else on ``Z:`` (wine maps
``Z:`` to ``/``). What runs under it (MSVC, CUDA's nvcc.exe, torch's headers and libraries, the
Windows CPython headers) is provisioned by :mod:`ci.toolchain.windows_toolchain`.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path, PureWindowsPath

from ci.toolchain.tools import ToolchainError, cache_root
from ci.runtime.env import FactoryEnv, child_environ

WINE_PACKAGE = "wine64"
WINE_ENV = {"WINEDEBUG": "-all", "WINEDLLOVERRIDES": "mscoree,mshtml=d"}


def windows_root() -> Path:
    return cache_root() / "windows"


# The drive letter under which wine's programs see the toolchain folder (``<cache>/windows``).
# Not ``Z:``: cl.exe started from a path with a dot-folder (``Z:\\root\\.cache\\...``) takes
# its own executable for the source file (seen with MSVC 14.44 under wine 8.0), and the
# factory's cache is under ``~/.cache`` by default.
TOOLS_DRIVE = "t:"


def z_path(path: str | os.PathLike) -> PureWindowsPath:
    """The path wine's programs see for a file of this machine: under the toolchain folder, on
    :data:`TOOLS_DRIVE`; anywhere else, on ``Z:`` (wine's ``/``)."""
    p = Path(path).resolve()
    tools = windows_root().resolve()
    if p == tools or tools in p.parents:
        return PureWindowsPath(TOOLS_DRIVE.upper() + "\\", *p.relative_to(tools).parts)
    return PureWindowsPath("Z:\\", *p.parts[1:])


def run_captured(cmd: list, **kw) -> subprocess.CompletedProcess:
    """``cmd`` (paths as strings) run with its output captured as text (undecodable bytes replaced)."""
    return subprocess.run([str(c) for c in cmd], capture_output=True, text=True, errors="replace", **kw)


def error_lines(text: str) -> list[str]:
    """A compiler's error lines in ``text`` (MSVC's and nvcc's: those with the word error), at most 10."""
    return [ln.strip() for ln in text.splitlines() if re.search(r"\berror\b", ln)][:10]


def rerun_if_silent(run: Callable[[], subprocess.CompletedProcess]) -> tuple[subprocess.CompletedProcess, str]:
    """``run()``, a compile under wine, and once more when it fails without a compiler error line:
    under load, wine's cmd.exe has been seen to fail to start nvcc.exe's own steps ("Can't
    recognize 'ptxas ...' as an internal or external command", the same for 'cl.exe ...'), which
    says nothing about the unit. The second result stands, with a note of the first; a failure with
    error lines is never rerun."""
    proc = run()
    out = proc.stdout + proc.stderr
    if proc.returncode == 0 or error_lines(out):
        return proc, ""
    tail = [ln.strip() for ln in out.splitlines() if ln.strip()][-3:]
    return run(), f"rerun once: the first run exited {proc.returncode} with no error line ({' | '.join(tail)[:300]})"


# -- wine --------------------------------------------------------------------------------

@dataclass(frozen=True)
class Wine:
    loader: Path
    version: str  # "wine-8.0 (Debian 8.0~repack-4)"
    prefix: Path

    def environ(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        return child_environ(WINE_ENV, {"WINEPREFIX": str(self.prefix)}, extra)

    def run(self, exe, args: list, *, env: dict[str, str] | None = None, cwd=None,
            timeout: float | None = None) -> subprocess.CompletedProcess:
        return run_captured([self.loader, exe, *args], env=self.environ(env), cwd=cwd, timeout=timeout)

    def run_compile(self, exe, args: list, *, env: dict[str, str] | None = None,
                    cwd=None) -> tuple[subprocess.CompletedProcess, str]:
        """A compile (nvcc.exe or cl.exe) under wine: ``run``, through :func:`rerun_if_silent`."""
        return rerun_if_silent(lambda: self.run(exe, args, env=env, cwd=cwd))


# Where Debian's wine64 package puts its loader when the `wine` package (which adds it to PATH)
# is not installed.
WINE_LOADER_PLACES = ("/usr/lib/wine/wine64", "/usr/bin/wine64")


def find_wine_loader() -> str:
    """The wine64 loader; ToolchainError naming the package to install when there is none.
    ``SAGEATTN3_WINE`` names another."""
    given = FactoryEnv.from_environ().wine
    loader = given or shutil.which("wine64") or next((p for p in WINE_LOADER_PLACES if os.path.exists(p)), None)
    if given and not os.access(given, os.X_OK):
        raise ToolchainError(f"SAGEATTN3_WINE={given} is not an executable wine64 loader: fix it or unset it (then "
                             f"Debian's {WINE_PACKAGE} is used: apt-get update && apt-get install -y {WINE_PACKAGE})")
    if not loader or not os.access(loader, os.X_OK):
        raise ToolchainError(f"Windows targets are built here under wine, and there is no wine64: install Debian's "
                             f"{WINE_PACKAGE} package (apt-get update && apt-get install -y {WINE_PACKAGE})")
    return loader


def find_wine() -> Wine:
    """Debian's wine64 loader (on PATH, or where the package puts it), its prefix made once in
    the cache. Raises ToolchainError naming the package when there is none."""
    loader = find_wine_loader()
    proc = run_captured([loader, "--version"])
    if proc.returncode != 0 or not proc.stdout.startswith("wine-"):
        raise ToolchainError(f"{loader} --version failed ({proc.stderr.strip()[-300:]}): reinstall {WINE_PACKAGE}")
    prefix = windows_root() / "wineprefix"
    wine = Wine(Path(loader), proc.stdout.strip(), prefix)
    if not (prefix / ".complete").exists():
        prefix.mkdir(parents=True, exist_ok=True)
        boot = run_captured([loader, "wineboot", "--init"], env=wine.environ())
        if boot.returncode != 0 or not (prefix / "system.reg").exists():
            raise ToolchainError(f"wine could not make its prefix in {prefix} (wineboot exited {boot.returncode}): "
                                 f"{boot.stderr.strip()[-500:]}")
        (prefix / ".complete").write_text(wine.version)
    drive = prefix / "dosdevices" / TOOLS_DRIVE
    if not drive.is_symlink() or drive.resolve() != windows_root().resolve():
        drive.unlink(missing_ok=True)
        drive.symlink_to(windows_root().resolve(), target_is_directory=True)
    return wine
