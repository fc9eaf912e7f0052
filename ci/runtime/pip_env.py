"""The environment of every pip and venv call the factory makes.

The factory decides what goes into its environments: which torch, which build packages, with
or without dependencies. A caller's pip settings must not change that. cibuildwheel, for one,
runs the release's test command with ``PIP_NO_DEPS=1`` (``ci/cibuildwheel.toml``), and a torch
installed without its dependencies cannot be imported. So each call gets an environment built
here:

1. every ``PIP_*`` variable of the caller is dropped, except :data:`PASS_THROUGH` (where
   packages come from and how to reach it: a mirror, a proxy, a certificate bundle);
2. pip's configuration files are not read (``PIP_CONFIG_FILE`` is :data:`os.devnull`), but the
   same pass-through settings found in them (sections ``[global]``, then ``[install]``) are
   carried over as variables, so a mirror configured in ``pip.conf`` still serves;
3. Python variables that change what an interpreter sees (``PYTHONPATH`` and the like) are
   dropped.

``sources=False`` also drops the package sources (index URLs, find-links): for the installs
that must resolve against one index the factory names on the command line (verify).
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from collections.abc import Mapping

# Variables kept as the caller set them: where packages come from, and how to reach it.
SOURCES = frozenset({"PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL", "PIP_FIND_LINKS", "PIP_TRUSTED_HOST"})
NETWORK = frozenset({
    "PIP_CERT", "PIP_CLIENT_CERT", "PIP_PROXY", "PIP_DEFAULT_TIMEOUT", "PIP_TIMEOUT", "PIP_RETRIES",
    "PIP_CACHE_DIR", "PIP_NO_CACHE_DIR", "PIP_KEYRING_PROVIDER", "PIP_PROGRESS_BAR",
})
PASS_THROUGH = SOURCES | NETWORK

# Variables that change which packages an interpreter sees or where pip puts them.
PYTHON_DROPPED = ("PYTHONPATH", "PYTHONHOME", "PYTHONUSERBASE", "PYTHONSTARTUP", "PYTHONEXECUTABLE",
                  "__PYVENV_LAUNCHER__", "VIRTUAL_ENV")

# What the factory's calls always get.
FIXED = {"PIP_CONFIG_FILE": os.devnull, "PIP_DISABLE_PIP_VERSION_CHECK": "1", "PIP_NO_INPUT": "1",
         "PYTHONNOUSERSITE": "1"}


def _variable(config_key: str) -> str:
    return "PIP_" + config_key.upper().replace("-", "_")


@functools.cache
def configured_settings() -> tuple[tuple[str, str], ...]:
    """The pass-through settings of pip's configuration files, as ``(variable, value)``.

    Read once per process with ``pip config list`` (the running interpreter's pip), the caller's
    variables hidden (but ``PIP_CONFIG_FILE``, which names a file) so only the files speak."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_") or k == "PIP_CONFIG_FILE"}
    try:
        proc = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True,
                              text=True, env=env, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return ()
    by_section: dict[str, dict[str, str]] = {"global": {}, "install": {}}
    for line in proc.stdout.splitlines():
        key, sep, value = line.partition("=")
        section, dot, name = key.partition(".")
        if not (sep and dot) or section not in by_section:
            continue
        value = value.strip()
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        by_section[section][name] = value
    merged = {**by_section["global"], **by_section["install"]}
    out = {}
    for name, value in merged.items():
        var = "PIP_DEFAULT_TIMEOUT" if name == "timeout" else _variable(name)
        if var in PASS_THROUGH:
            # pip's variables take lists space-separated; config files may use newlines.
            out[var] = " ".join(value.split())
    return tuple(sorted(out.items()))


def pip_environ(base: Mapping[str, str] | None = None, *, sources: bool = True,
                extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment for a pip or venv subprocess (see the module docstring).

    ``base``: the environment to start from (default :data:`os.environ`); ``sources=False``:
    no index or find-links settings at all; ``extra``: variables the factory itself sets."""
    base = os.environ if base is None else base
    keep = PASS_THROUGH if sources else NETWORK
    env = {k: v for k, v in base.items()
           if not (k.startswith("PIP_") and k not in keep) and k not in PYTHON_DROPPED}
    for var, value in configured_settings():
        if var in keep:
            env.setdefault(var, value)
    env.update(FIXED)
    if extra:
        env.update(extra)
    return env


def dropped(base: Mapping[str, str] | None = None) -> list[str]:
    """The caller's variables :func:`pip_environ` leaves out (for logs: names only, never values)."""
    base = os.environ if base is None else base
    return sorted(k for k in base if (k.startswith("PIP_") and k not in PASS_THROUGH) or k in PYTHON_DROPPED)
