"""Locate or provision what a build needs: a Python interpreter, a CUDA toolkit whose
major.minor matches the target, the pinned CUTLASS/CuTe headers, a compiler cache, and an
isolated build environment holding the target's torch.

Nothing here looks at a GPU. Every failure is a :class:`ToolchainError` that says what to
install or set.
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from packaging.version import Version

from ci.runtime.pip_env import pip_environ
from ci.toolchain.resolved import EXE, WINDOWS, CudaToolkit, TorchEnv, venv_python
from ci.runtime.errors import InputError
from ci.runtime.env import FactoryEnv, child_environ, python_override_var

CUTLASS_PIN = "nvidia-cutlass==4.2.0.0"
# CUDA 13.x toolkits provisioned from PyPI: the packages that make up nvcc + runtime headers.
CUDA_PYPI_PACKAGES = ("nvidia-cuda-nvcc", "nvidia-cuda-crt", "nvidia-nvvm", "nvidia-cuda-cccl", "nvidia-cuda-runtime")
# What a build environment holds besides torch. setuptools >= 77: the payload's SPDX `license`
# and `license-files` (its pyproject's build-system.requires says the same).
BUILD_ENV_PACKAGES = ("setuptools>=77", "wheel", "packaging")


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


class CommandFailed(subprocess.CalledProcessError):
    """A child command that failed, its message ending with the last lines of its stderr (a
    broken torch environment says why, not only which command)."""

    TAIL_LINES = 20

    def __str__(self) -> str:
        tail = [ln for ln in (self.stderr or "").strip().splitlines() if ln.strip()][-self.TAIL_LINES:]
        return super().__str__() + (":\n  " + "\n  ".join(tail) if tail else " (nothing on stderr)")


def _output(cmd: list[str], **kw) -> str:
    p = subprocess.run(cmd, text=True, capture_output=True, **kw)
    if p.returncode != 0:
        raise CommandFailed(p.returncode, cmd, p.stdout, p.stderr)
    return p.stdout


# -- Python ---------------------------------------------------------------------------

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


def find_python(version: str, *, windows: bool = WINDOWS, provision: bool = True, log=print) -> Path:
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


def provision_python(version: str, log=print) -> tuple[Path | None, list[str]]:
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


# -- CUDA -----------------------------------------------------------------------------


def nvcc_version(nvcc: Path) -> str:
    out = _output([str(nvcc), "--version"])
    m = re.search(r"release \d+\.\d+, V(\d+\.\d+\.\d+)", out)
    if not m:
        raise ToolchainError(f"{nvcc} --version printed no version:\n{out}")
    return m.group(1)


def _nvcc_home(nvcc: str) -> Path:
    """The toolkit root of an nvcc, even behind a wrapper script (nvcc reports its TOP)."""
    try:
        out = subprocess.run([nvcc, "-dryrun", "--version"], text=True, capture_output=True, timeout=60)
        m = re.search(r"^#\$ _HERE_=(.+)$", out.stdout + out.stderr, re.M)
        if m:
            return Path(m.group(1).strip()).parent.resolve()
    except (OSError, subprocess.SubprocessError):
        pass
    return Path(nvcc).resolve().parent.parent


def _candidate_homes() -> list[tuple[Path, str]]:
    homes: list[tuple[Path, str]] = []
    env = FactoryEnv.from_environ()
    for value in (env.cuda_home, env.cuda_path):
        if value:
            homes.append((Path(value), "env"))
    if WINDOWS:  # NVIDIA's installer sets CUDA_PATH_V13_0 etc. and installs under Program Files
        homes += [(Path(v), "env") for v in env.cuda_path_versions]
        toolkits = os.path.join(env.program_files, "NVIDIA GPU Computing Toolkit", "CUDA")
        homes += [(Path(p), "system") for p in sorted(glob.glob(os.path.join(toolkits, "v*")), reverse=True)]
    else:
        homes += [(Path(p), "system") for p in sorted(glob.glob("/usr/local/cuda-*"), reverse=True)]
        homes.append((Path("/usr/local/cuda"), "system"))
    nv = shutil.which("nvcc")
    if nv:
        homes.append((_nvcc_home(nv), "system"))
    return homes


def find_cuda(major_minor: str, provision: bool = True) -> CudaToolkit:
    """A CUDA toolkit whose version is ``major_minor``: a matching system/env install first,
    else (13.x) one provisioned from PyPI into the cache."""
    seen: set[Path] = set()
    for home, source in _candidate_homes():
        home = home.resolve()
        nvcc = home / "bin" / f"nvcc{EXE}"
        if home in seen or not nvcc.exists():
            continue
        seen.add(home)
        try:
            ver = nvcc_version(nvcc)
        except (OSError, subprocess.SubprocessError, ToolchainError):
            continue
        tk = CudaToolkit(ver, home, source)
        if tk.major_minor == major_minor:
            return tk
    cached = _pypi_cuda_dir(major_minor)
    if (cached / ".complete").exists():
        return CudaToolkit(nvcc_version(cached / "bin" / "nvcc"), cached, "pypi")
    if Version(major_minor).major >= 13 and provision:
        return provision_cuda_from_pypi(major_minor)
    raise ToolchainError(
        f"CUDA {major_minor} toolkit not found (looked at CUDA_HOME, CUDA_PATH, /usr/local/cuda-*, "
        f"nvcc on PATH). "
        + (
            f"CUDA {major_minor} cannot be provisioned from PyPI (its nvcc wheel holds only ptxas): "
            f"install it from NVIDIA's installer and set CUDA_HOME to it."
            if Version(major_minor).major < 13
            else f"Provisioning from PyPI is disabled; install CUDA {major_minor} and set CUDA_HOME."
        )
    )


def _pypi_cuda_dir(major_minor: str) -> Path:
    return cache_root() / "cuda" / major_minor


def provision_cuda_from_pypi(major_minor: str) -> CudaToolkit:
    """Install nvcc + headers + runtime of CUDA ``major_minor`` from PyPI into the cache and
    mend the layout (unversioned libcudart symlink; nvcc and runtime of one major.minor)."""
    dest = _pypi_cuda_dir(major_minor)
    if dest.exists():
        shutil.rmtree(dest)
    site = dest / "site"
    pins = [f"{p}=={major_minor}.*" for p in CUDA_PYPI_PACKAGES]
    try:
        run_pip([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(site), *pins])
    except subprocess.CalledProcessError as e:
        shutil.rmtree(dest, ignore_errors=True)
        raise ToolchainError(
            f"could not install CUDA {major_minor} from PyPI ({' '.join(pins)}): pip exited {e.returncode}. "
            f"Install CUDA {major_minor} yourself and set CUDA_HOME."
        ) from e
    root = site / "nvidia" / f"cu{Version(major_minor).major}"
    if not (root / "bin" / "nvcc").exists():
        shutil.rmtree(dest, ignore_errors=True)
        raise ToolchainError(f"the PyPI CUDA {major_minor} packages have no bin/nvcc under {root}")
    for d in ("bin", "include", "lib", "nvvm"):
        if (root / d).exists():
            (dest / d).symlink_to(root / d)
    libdir = root / "lib"
    real = sorted(libdir.glob("libcudart.so.*"))
    if real and not (libdir / "libcudart.so").exists():
        (libdir / "libcudart.so").symlink_to(real[0].name)
    for exe in (root / "bin").iterdir():
        if exe.is_file():
            exe.chmod(exe.stat().st_mode | 0o111)
    for exe in (root / "nvvm" / "bin").glob("*"):
        exe.chmod(exe.stat().st_mode | 0o111)
    ver = nvcc_version(dest / "bin" / "nvcc")
    tk = CudaToolkit(ver, dest, "pypi")
    if tk.major_minor != major_minor:
        raise ToolchainError(f"PyPI gave nvcc {ver} for CUDA {major_minor}")
    (dest / ".complete").write_text(ver)
    return tk


# -- headers and tools ----------------------------------------------------------------

def cutlass_include() -> Path:
    """The pinned CUTLASS/CuTe headers (PyPI nvidia-cutlass), from this environment or the cache."""
    try:
        import cutlass_library  # type: ignore

        inc = Path(cutlass_library.__file__).parent / "source" / "include"
        if (inc / "cute").is_dir():
            return inc
    except ImportError:
        pass
    dest = cache_root() / "cutlass" / CUTLASS_PIN.split("==")[1]
    inc = dest / "cutlass_library" / "source" / "include"
    if not (dest / ".complete").exists():
        shutil.rmtree(dest, ignore_errors=True)
        try:
            run_pip([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(dest), CUTLASS_PIN])
        except subprocess.CalledProcessError as e:
            raise ToolchainError(f"could not install {CUTLASS_PIN} (CUTLASS/CuTe headers): `pip install {CUTLASS_PIN}`") from e
        (dest / ".complete").write_text(CUTLASS_PIN)
    if not (inc / "cute").is_dir():
        raise ToolchainError(f"{CUTLASS_PIN} has no cute headers under {inc}")
    return inc


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
def sccache_server_scope(log=print):
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


# -- build environment ----------------------------------------------------------------


def torch_env(python_version: str, torch_spec: str, extra: tuple[str, ...] = BUILD_ENV_PACKAGES,
              index_args: tuple[str, ...] = ()) -> TorchEnv:
    """A cached venv with ``torch_spec`` (e.g. "torch==2.14.1") for that Python. With
    ``index_args`` (e.g. PyTorch's ``--index-url``) torch comes from there and ``extra`` from
    pip's default index, in a second install."""
    # A loopback stand-in index (the release rehearsal) gets a new port each run; what it
    # serves does not change, so the port is not part of the key.
    where = [re.sub(r"^(https?://127\.0\.0\.1):\d+", r"\1", a) for a in index_args]
    # The key is the torch (Python, requirement, index): the build packages beside it are
    # brought to ``extra`` in place (ensure_packages), so raising their floor re-creates nothing.
    what = [python_version, torch_spec] + ([where] if where else [])
    key = hashlib.sha256(json.dumps(what).encode()).hexdigest()[:10]
    root = cache_root() / "envs" / f"py{python_version}-{torch_spec.replace('==', '-').replace('+', '_')}-{key}"
    marker = root / ".complete"
    if not marker.exists():
        if root.exists():
            shutil.rmtree(root)
        py = find_python(python_version)
        run_pip([str(py), "-m", "venv", str(root)])
        try:
            if index_args:
                run_pip([str(venv_python(root)), "-m", "pip", "install", "--quiet", torch_spec, *index_args])
                if extra:
                    run_pip([str(venv_python(root)), "-m", "pip", "install", "--quiet", *extra])
            else:
                run_pip([str(venv_python(root)), "-m", "pip", "install", "--quiet", torch_spec, *extra])
        except subprocess.CalledProcessError as e:
            shutil.rmtree(root, ignore_errors=True)
            raise ToolchainError(
                f"could not install {torch_spec} for Python {python_version} (pip exited {e.returncode}); "
                f"is that torch published for Python {python_version}?"
            ) from e
        info = _output([str(venv_python(root)), "-c", "import torch, json; print(json.dumps([torch.__version__, torch.version.cuda]))"])
        (root / EXTRA_MARKER).write_text(json.dumps(list(extra)))
        marker.write_text(info)
    else:
        ensure_packages(root, extra)
    version, cuda = json.loads(marker.read_text())
    return TorchEnv(root, python_version, version, cuda)


# Beside an environment's .complete: the requirements its build packages were last installed for.
EXTRA_MARKER = ".extra.json"


def ensure_packages(root: Path, extra: tuple[str, ...]) -> None:
    """A cached environment holds ``extra`` as asked now (e.g. after a floor was raised): when
    it was last made or checked for other requirements, ``pip install`` them in place (a no-op
    for those already satisfied) and remember it."""
    if not extra:
        return
    stamp = root / EXTRA_MARKER
    try:
        if json.loads(stamp.read_text()) == list(extra):
            return
    except (OSError, ValueError):
        pass
    try:
        run_pip([str(venv_python(root)), "-m", "pip", "install", "--quiet", *extra])
    except subprocess.CalledProcessError as e:
        raise ToolchainError(f"could not install {' '.join(extra)} into the cached environment {root} "
                             f"(pip exited {e.returncode}); remove it to start it afresh") from e
    stamp.write_text(json.dumps(list(extra)))


CUOBJDUMP_PIN = "nvidia-cuda-cuobjdump==13.2.86"  # reads cubins of every CUDA 12.8+/13.x build


def cuda_tool(name: str, pin: str) -> Path:
    """A CUDA binary tool the system toolkit here lacks (cuobjdump, nvdisasm): from PATH, else
    its PyPI wheel (``pin``) installed once into the cache."""
    found = shutil.which(name)
    if found:
        return Path(found)
    dest = cache_root() / "tools" / pin.replace("==", "-")
    exe = dest / "nvidia" / "cu13" / "bin" / name
    if not exe.exists():
        try:
            run_pip([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(dest), pin])
        except subprocess.CalledProcessError as e:
            raise ToolchainError(f"{name} is missing: `pip install {pin}` failed") from e
        exe.chmod(exe.stat().st_mode | 0o111)
    return exe


def cuobjdump() -> Path:
    return cuda_tool("cuobjdump", CUOBJDUMP_PIN)
