"""Locate or provision what a build needs: a Python interpreter, a CUDA toolkit whose
major.minor matches the target, the pinned CUTLASS/CuTe headers, a compiler cache, and an
isolated build environment holding the target's torch.

Nothing here looks at a GPU. Every failure is a :class:`ToolchainError` that says what to
install or set.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from packaging.version import Version

CUTLASS_PIN = "nvidia-cutlass==4.2.0.0"
# CUDA 13.x toolkits provisioned from PyPI: the packages that make up nvcc + runtime headers.
CUDA_PYPI_PACKAGES = ("nvidia-cuda-nvcc", "nvidia-cuda-crt", "nvidia-nvvm", "nvidia-cuda-cccl", "nvidia-cuda-runtime")
BUILD_ENV_PACKAGES = ("setuptools>=70", "wheel", "packaging")


class ToolchainError(RuntimeError):
    """A build tool is missing or wrong; the message says what to install or set."""


WINDOWS = os.name == "nt"
EXE = ".exe" if WINDOWS else ""


def venv_python(root: Path) -> Path:
    """The interpreter of a virtual environment, on either OS."""
    return root / ("Scripts" if WINDOWS else "bin") / f"python{EXE}"


def cache_root() -> Path:
    root = os.environ.get("SAGEATTN3_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "sageattn3-factory"
    )
    p = Path(root)
    p.mkdir(parents=True, exist_ok=True)
    return p


def run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, check=True, text=True, **kw)


def _output(cmd: list[str], **kw) -> str:
    return subprocess.run(cmd, check=True, text=True, capture_output=True, **kw).stdout


# -- Python ---------------------------------------------------------------------------

def _python_version(exe: str | Path) -> str | None:
    try:
        out = _output([str(exe), "-c", "import sys; print('%d.%d' % sys.version_info[:2])"], timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.strip()


def find_python(version: str) -> Path:
    """An interpreter for ``version`` ("3.12"), found explicitly: the running one, pyenv's
    installs (whose shims fail unless enabled), then ``python3.X`` on PATH."""
    if "%d.%d" % sys.version_info[:2] == version:
        return Path(sys.executable)
    candidates: list[str] = []
    env_override = os.environ.get(f"SAGEATTN3_PYTHON_{version.replace('.', '_')}")
    if env_override:
        candidates.append(env_override)
    pyenv_root = os.environ.get("PYENV_ROOT") or os.path.expanduser("~/.pyenv")
    installs = sorted(
        glob.glob(os.path.join(pyenv_root, "versions", f"{version}.*", "bin", "python3")),
        key=lambda p: Version(Path(p).parent.parent.name.split("-")[0]),
        reverse=True,
    )
    candidates += installs
    on_path = shutil.which(f"python{version}")
    if on_path:
        candidates.append(on_path)
    for c in candidates:
        if _python_version(c) == version:
            return Path(c)
    raise ToolchainError(
        f"Python {version} not found (looked at the running interpreter, pyenv's versions/ and "
        f"python{version} on PATH). Install it (e.g. `pyenv install {version}`) or point "
        f"SAGEATTN3_PYTHON_{version.replace('.', '_')} at an interpreter."
    )


# -- CUDA -----------------------------------------------------------------------------

@dataclass(frozen=True)
class CudaToolkit:
    version: str  # full, "13.0.88"
    home: Path
    source: str  # "system" | "pypi" | "env"

    @property
    def major_minor(self) -> str:
        v = Version(self.version)
        return f"{v.major}.{v.minor}"

    @property
    def nvcc(self) -> Path:
        return self.home / "bin" / f"nvcc{EXE}"

    @property
    def include_dirs(self) -> list[Path]:
        dirs = [self.home / "include"]
        tgt = self.home / "targets" / "x86_64-linux" / "include"
        if tgt.is_dir():
            dirs.append(tgt)
        return dirs

    @property
    def lib_dir(self) -> Path:
        for cand in (self.home / "lib64", self.home / "lib", self.home / "targets" / "x86_64-linux" / "lib"):
            if (cand / "libcudart.so").exists() or list(cand.glob("libcudart.so.*")):
                return cand
        return self.home / "lib64"


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
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            homes.append((Path(os.environ[var]), "env"))
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
        run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(site), *pins])
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
            run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(dest), CUTLASS_PIN])
        except subprocess.CalledProcessError as e:
            raise ToolchainError(f"could not install {CUTLASS_PIN} (CUTLASS/CuTe headers): `pip install {CUTLASS_PIN}`") from e
        (dest / ".complete").write_text(CUTLASS_PIN)
    if not (inc / "cute").is_dir():
        raise ToolchainError(f"{CUTLASS_PIN} has no cute headers under {inc}")
    return inc


def compiler_launcher() -> list[str]:
    """sccache, when present (installed with the factory's requirements); keyed by content,
    so a Python-only change recompiles nothing. SAGEATTN3_NO_CCACHE=1 turns it off."""
    if os.environ.get("SAGEATTN3_NO_CCACHE"):
        return []
    exe = shutil.which("sccache") or shutil.which("sccache", path=str(Path(sys.executable).parent))
    return [exe] if exe else []


def sccache_env(cache_dir: str | None = None) -> dict[str, str]:
    """The environment of our sccache server: its cache dir, and a port derived from that
    dir, so a server another process started with another cache is never reused."""
    d = cache_dir or os.environ.get("SCCACHE_DIR") or str(cache_root() / "sccache")
    port = 20000 + int(hashlib.sha256(d.encode()).hexdigest(), 16) % 20000
    return {"SCCACHE_DIR": d, "SCCACHE_SERVER_PORT": str(port)}


def host_compiler_version() -> str:
    cxx = os.environ.get("CXX", "c++")
    try:
        return _output([cxx, "--version"]).splitlines()[0]
    except (OSError, subprocess.SubprocessError) as e:
        raise ToolchainError(f"no C++ compiler ({cxx}): install g++ (Debian: apt-get install g++)") from e


# -- build environment ----------------------------------------------------------------

@dataclass(frozen=True)
class TorchEnv:
    """A virtual environment holding one torch release, cached and reused."""

    root: Path
    python_version: str
    torch_version: str  # as installed, "2.14.1+cu130"
    torch_cuda: str | None

    @property
    def python(self) -> Path:
        return venv_python(self.root)

    @property
    def site_packages(self) -> Path:
        return Path(_output([str(self.python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).strip())


def torch_env(python_version: str, torch_spec: str, extra: tuple[str, ...] = BUILD_ENV_PACKAGES,
              index_args: tuple[str, ...] = ()) -> TorchEnv:
    """A cached venv with ``torch_spec`` (e.g. "torch==2.14.1") for that Python. With
    ``index_args`` (e.g. PyTorch's ``--index-url``) torch comes from there and ``extra`` from
    pip's default index, in a second install."""
    # A loopback stand-in index (the release rehearsal) gets a new port each run; what it
    # serves does not change, so the port is not part of the key.
    where = [re.sub(r"^(https?://127\.0\.0\.1):\d+", r"\1", a) for a in index_args]
    what = [python_version, torch_spec, list(extra)] + ([where] if where else [])
    key = hashlib.sha256(json.dumps(what).encode()).hexdigest()[:10]
    root = cache_root() / "envs" / f"py{python_version}-{torch_spec.replace('==', '-').replace('+', '_')}-{key}"
    marker = root / ".complete"
    if not marker.exists():
        if root.exists():
            shutil.rmtree(root)
        py = find_python(python_version)
        run([str(py), "-m", "venv", str(root)])
        try:
            if index_args:
                run([str(venv_python(root)), "-m", "pip", "install", "--quiet", torch_spec, *index_args])
                if extra:
                    run([str(venv_python(root)), "-m", "pip", "install", "--quiet", *extra])
            else:
                run([str(venv_python(root)), "-m", "pip", "install", "--quiet", torch_spec, *extra])
        except subprocess.CalledProcessError as e:
            shutil.rmtree(root, ignore_errors=True)
            raise ToolchainError(
                f"could not install {torch_spec} for Python {python_version} (pip exited {e.returncode}); "
                f"is that torch published for Python {python_version}?"
            ) from e
        info = _output([str(venv_python(root)), "-c", "import torch, json; print(json.dumps([torch.__version__, torch.version.cuda]))"])
        marker.write_text(info)
    version, cuda = json.loads(marker.read_text())
    return TorchEnv(root, python_version, version, cuda)


CUOBJDUMP_PIN = "nvidia-cuda-cuobjdump==13.2.86"  # reads cubins of every CUDA 12.8+/13.x build


def cuobjdump() -> Path:
    """cuobjdump (not in the system toolkit here): from PATH, else PyPI into the cache."""
    found = shutil.which("cuobjdump")
    if found:
        return Path(found)
    dest = cache_root() / "tools" / CUOBJDUMP_PIN.replace("==", "-")
    exe = dest / "nvidia" / "cu13" / "bin" / "cuobjdump"
    if not exe.exists():
        try:
            run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(dest), CUOBJDUMP_PIN])
        except subprocess.CalledProcessError as e:
            raise ToolchainError(f"cuobjdump is missing: `pip install {CUOBJDUMP_PIN}` failed") from e
        exe.chmod(exe.stat().st_mode | 0o111)
    return exe
