"""The compilers around nvcc: the compiler cache (sccache, its server kept to this factory's
cache) and the host C++ compiler's banner for the build record."""

from __future__ import annotations

import contextlib
import hashlib
import shutil
import subprocess
import sys
from pathlib import Path

from ci.runtime.env import FactoryEnv, child_environ
from ci.runtime.log import default_log
from ci.toolchain.resolved import WINDOWS
from ci.toolchain.tools.base import ToolchainError, _output, cache_root


def compiler_launcher() -> list[str]:
    """sccache, when present (installed with the factory's requirements); keyed by content,
    so a Python-only change recompiles nothing. SAGEATTN3_NO_CCACHE=1 turns it off."""
    if FactoryEnv.from_environ().no_ccache:
        return []
    exe = shutil.which("sccache") or shutil.which("sccache", path=str(Path(sys.executable).parent))
    return [exe] if exe else []


def sccache_env(cache_dir: str | None = None) -> dict[str, str]:
    """The environment of our sccache server: its cache dir, and a port derived from that
    dir, so a server another process started with another cache is never reused."""
    d = cache_dir or FactoryEnv.from_environ().sccache_dir or str(cache_root() / "sccache")
    port = 20000 + int(hashlib.sha256(d.encode()).hexdigest(), 16) % 20000
    return {"SCCACHE_DIR": d, "SCCACHE_SERVER_PORT": str(port)}


def sccache_server_running(env: dict[str, str] | None = None) -> bool:
    """Does something listen on our sccache server's port (on loopback)?"""
    import socket

    port = int((env or sccache_env())["SCCACHE_SERVER_PORT"])
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(1.0)
        return s.connect_ex(("127.0.0.1", port)) == 0


def stop_sccache_server(env: dict[str, str] | None = None) -> bool:
    """Stop our sccache server if one runs (True: one was stopped)."""
    launcher = compiler_launcher()
    env = env or sccache_env()
    if not launcher or not sccache_server_running(env):
        return False
    subprocess.run([launcher[0], "--stop-server"], capture_output=True, env=child_environ(env), timeout=60)
    return True


@contextlib.contextmanager
def sccache_server_scope(log=default_log):
    """Builds inside this block may start our sccache server; if none ran before it, the one
    they started is stopped afterwards (a server someone else started is left alone)."""
    env = sccache_env()
    before = bool(compiler_launcher()) and sccache_server_running(env)
    try:
        yield
    finally:
        if not before and stop_sccache_server(env):
            log("[build] stopped the sccache server this build started (its cache stays on disk)")


def host_compiler_version(*, windows: bool = WINDOWS, cxx: str | None = None) -> str:
    """The host compiler's first banner line, for the build record: ``cl``'s on Windows (it
    prints its banner on stderr when run without arguments; nvcc uses the cl on PATH), else
    ``cxx --version`` (the profile's host compiler; default ``$CXX``, else ``c++``)."""
    if windows:
        cl = shutil.which("cl")
        if not cl:
            raise ToolchainError(
                "no MSVC compiler (cl.exe) on PATH: run from a VS 2022 x64 developer prompt (vcvars64.bat), "
                "or export its variables with `python -m ci.release.cibw msvc-env`"
            )
        try:
            proc = subprocess.run([cl], capture_output=True, text=True, timeout=60)
        except (OSError, subprocess.SubprocessError) as e:
            raise ToolchainError(f"{cl} did not run ({e}): repair the Visual Studio C++ toolset") from e
        banner = next((ln.strip() for ln in (proc.stderr + proc.stdout).splitlines() if "Compiler Version" in ln), None)
        if not banner:
            raise ToolchainError(f"{cl} printed no 'Compiler Version' banner: is it MSVC's cl.exe?")
        return banner
    given = FactoryEnv.from_environ().cxx
    cxx = cxx or (given if given is not None else "c++")
    try:
        return _output([cxx, "--version"]).splitlines()[0]
    except (OSError, subprocess.SubprocessError) as e:
        raise ToolchainError(f"no C++ compiler ({cxx}): install g++ (Debian: apt-get install g++)") from e
