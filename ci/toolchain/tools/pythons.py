"""A Python interpreter of a given X.Y: found where the OS or a runner keeps one, checked by
asking it its version, else provisioned (uv, else pyenv)."""

from __future__ import annotations

import glob
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from packaging.version import Version

from ci.runtime.env import FactoryEnv, child_environ, python_override_var
from ci.runtime.log import default_log
from ci.toolchain.resolved import WINDOWS
from ci.toolchain.tools.base import ToolchainError, _output, cache_root


def _python_version(exe: str | Path) -> str | None:
    try:
        out = _output([str(exe), "-c", "import sys; print('%d.%d' % sys.version_info[:2])"], timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.strip()


def _env_var(version: str) -> str:
    return python_override_var(version)


def _newest_first(paths: list[str], version_of) -> list[str]:
    def key(p: str) -> Version:
        try:
            return Version(version_of(p))
        except Exception:  # noqa: BLE001 - an odd directory name sorts last
            return Version("0")

    return sorted(paths, key=key, reverse=True)


def _py_launcher(version: str) -> str | None:
    """What the Windows ``py`` launcher runs for ``-3.X`` (it prints that interpreter's
    sys.executable), or None without a launcher or that version."""
    py = shutil.which("py")
    if not py:
        return None
    try:
        out = _output([py, f"-{version}", "-c", "import sys; print(sys.executable)"], timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    lines = out.strip().splitlines()
    return lines[-1].strip() if lines else None


def _windows_pythons(version: str) -> list[str]:
    """Where Windows keeps a Python 3.X, in the order tried: the ``py -3.X`` launcher, the
    per-user and all-users python.org installs, ``C:\\Python3X``, then the hosted tool cache
    of GitHub runners (``$RUNNER_TOOL_CACHE\\Python\\3.X.Y\\x64``, newest patch first)."""
    tag = version.replace(".", "")
    found = [p for p in [_py_launcher(version)] if p]
    env = FactoryEnv.from_environ()
    for base in (os.path.join(env.localappdata, "Programs", "Python"),
                 env.program_files, "C:\\"):
        if base and os.path.isdir(base):
            found.append(os.path.join(base, f"Python{tag}", "python.exe"))
    cache = env.runner_tool_cache or env.agent_toolsdirectory or "C:\\hostedtoolcache\\windows"
    found += _newest_first(glob.glob(os.path.join(cache, "Python", f"{version}.*", "x64", "python.exe")),
                           lambda p: Path(p).parent.parent.name)
    return found


def _pyenv_pythons(version: str) -> list[str]:
    pyenv_root = FactoryEnv.from_environ().pyenv_root or os.path.expanduser("~/.pyenv")
    return _newest_first(glob.glob(os.path.join(pyenv_root, "versions", f"{version}.*", "bin", "python3")),
                         lambda p: Path(p).parent.parent.name.split("-")[0])


def _search_python(version: str, windows: bool) -> Path | None:
    candidates: list[str] = []
    override = FactoryEnv.from_environ().python_override(version)
    if override:
        candidates.append(override)
    candidates += _windows_pythons(version) if windows else _pyenv_pythons(version) + _uv_pythons(version)
    for name in (f"python{version}", "python3", "python"):
        on_path = shutil.which(name)
        if on_path:
            candidates.append(on_path)
    seen: set[str] = set()
    for c in candidates:
        if c in seen or not os.path.isfile(c):
            continue
        seen.add(c)
        if _python_version(c) == version:
            return Path(c)
    return None


def find_python(version: str, *, windows: bool = WINDOWS, provision: bool = True, log=default_log) -> Path:
    """An interpreter for ``version`` ("3.12"), found explicitly and checked by asking it its
    version: the running one, ``$SAGEATTN3_PYTHON_3_X``, then where the OS keeps one (Windows:
    the ``py`` launcher, python.org's install dirs, the runners' hosted tool cache; elsewhere
    pyenv's installs, whose shims fail unless enabled, and those this factory provisioned), then
    ``python3.X``/``python3``/``python`` on PATH. Not found: provisioned (:func:`provision_python`)
    unless ``provision`` is off or ``$SAGEATTN3_NO_PROVISION_PYTHON`` is set."""
    if "%d.%d" % sys.version_info[:2] == version:
        return Path(sys.executable)
    found = _search_python(version, windows)
    if found:
        return found
    env = FactoryEnv.from_environ()
    override = env.python_override(version)
    if override:
        raise ToolchainError(f"{_env_var(version)}={override} is not a Python {version} interpreter: point it at "
                             f"the python executable of a Python {version} install")
    tried = []
    if provision and not windows and not env.no_provision_python:
        got, tried = provision_python(version, log=log)
        if got:
            return got
    where = ("the py launcher (py -{v}), %LOCALAPPDATA%\\Programs\\Python\\Python{t}, "
             "%ProgramFiles%\\Python{t}, C:\\Python{t}, the hosted tool cache ($RUNNER_TOOL_CACHE)"
             if windows else "pyenv's versions/, the factory's uv Pythons").format(v=version, t=version.replace(".", ""))
    install = (f"install Python {version} (python.org, or actions/setup-python on a runner)" if windows
               else f"install Python {version} another way (your OS's packages, python.org's installer)" if tried
               else f"install it (e.g. `uv python install {version}` or `pyenv install {version}`)")
    could_not = f" Provisioning failed: {'; '.join(tried)}." if tried else ""
    raise ToolchainError(
        f"Python {version} not found (looked at the running interpreter, ${_env_var(version)}, {where} and "
        f"python{version}/python3/python on PATH).{could_not} {install[0].upper() + install[1:]} or set "
        f"{_env_var(version)} to its python executable."
    )


def _uv_dir() -> Path:
    return cache_root() / "pythons"


def _uv_pythons(version: str) -> list[str]:
    """Interpreters ``uv python install`` put into the factory's cache (newest patch first)."""
    return _newest_first(glob.glob(str(_uv_dir() / f"cpython-{version}.*" / "bin" / "python3")),
                         lambda p: Path(p).parent.parent.name.split("-")[1])


def _uv() -> str | None:
    """uv on PATH, or the one in the running environment (``pip install uv``)."""
    found = shutil.which("uv")
    if found:
        return found
    try:
        from uv import find_uv_bin  # type: ignore

        return find_uv_bin()
    except (ImportError, FileNotFoundError):
        return None


def _one_line(text: str) -> str:
    """A tool's failure in one line: its first line and, where it gives one, its last cause
    (uv: "Caused by: ... dns error ...")."""
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    if not lines:
        return "no output"
    causes = [ln for ln in lines[1:] if re.match(r"(caused by|cause)\b", ln, re.I)]
    return lines[0][:200] + (f" ({causes[-1][:200]})" if causes else "")


def provision_python(version: str, log=default_log) -> tuple[Path | None, list[str]]:
    """Install CPython ``version``: with uv (python-build-standalone, into the factory's cache,
    nothing put on PATH) when uv is there, else with pyenv when it is installed (builds from
    source). Returns the interpreter, or None and what each way said."""
    tried: list[str] = []
    ways = []  # (the command, as shown, its environment, its time limit, what the log adds)
    uv = _uv()
    if uv:
        ways.append(([uv, "python", "install", version], f"`uv python install {version}`",
                     child_environ(UV_PYTHON_INSTALL_DIR=str(_uv_dir()), UV_PYTHON_INSTALL_BIN="0"),
                     1800, f"into {_uv_dir()}"))
    pyenv = shutil.which("pyenv")
    if pyenv:
        ways.append(([pyenv, "install", "--skip-existing", version], f"`pyenv install {version}`", None, 3600,
                     "(builds CPython from source, minutes)"))
    for cmd, shown, env, timeout, what in ways:
        log(f"[python] Python {version} not found: {shown} {what} ...")
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
        except (OSError, subprocess.SubprocessError) as e:
            tried.append(f"{shown}: {e}")
            continue
        found = _search_python(version, WINDOWS) if proc.returncode == 0 else None
        if found:
            log(f"[python] Python {version}: {found}")
            return found, tried
        tried.append(f"{shown}: {_one_line(proc.stderr + proc.stdout)}")
    if not tried:
        tried.append("neither uv nor pyenv is installed (`pip install uv` lets the factory provision Pythons)")
    return None, tried
