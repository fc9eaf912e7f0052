"""A CUDA toolkit whose major.minor matches the target (installed, else 13.x from PyPI into the
cache), the CUDA binary tools the system toolkit may lack, and the pinned CUTLASS/CuTe headers."""

from __future__ import annotations

import glob
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from packaging.version import Version

from ci.runtime.env import FactoryEnv
from ci.toolchain.resolved import CUTLASS_VERSION
from ci.toolchain.resolved import EXE, WINDOWS, CudaToolkit
from ci.toolchain.tools.base import ToolchainError, _output, cache_root, run_pip

CUTLASS_PIN = f"nvidia-cutlass=={CUTLASS_VERSION}"
# CUDA 13.x toolkits provisioned from PyPI: the packages that make up nvcc + runtime headers.
CUDA_PYPI_PACKAGES = ("nvidia-cuda-nvcc", "nvidia-cuda-crt", "nvidia-nvvm", "nvidia-cuda-cccl", "nvidia-cuda-runtime")


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


# -- headers and binary tools ---------------------------------------------------------

def cutlass_include() -> Path:
    """The pinned CUTLASS/CuTe headers (PyPI nvidia-cutlass), from this environment or the cache."""
    try:
        import cutlass_library  # type: ignore

        inc = Path(cutlass_library.__file__).parent / "source" / "include"
        if (inc / "cute").is_dir():
            return inc
    except ImportError:
        pass
    dest = cache_root() / "cutlass" / CUTLASS_VERSION
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


CUOBJDUMP_PIN = "nvidia-cuda-cuobjdump==13.2.86"  # reads cubins of every CUDA 12.8+/13.x build


def cuda_tool(name: str, pin: str, from_path: bool = True) -> Path:
    """A CUDA binary tool the system toolkit here lacks (cuobjdump, nvdisasm; a given CUDA line's
    ptxas): from PATH (``from_path``), else its PyPI wheel (``pin``, a version or a ``X.Y.*``
    spec) installed once into the cache. The wheels keep it under nvidia/<cu13|cuda_nvcc...>/bin."""
    found = shutil.which(name) if from_path else None
    if found:
        return Path(found)
    dest = cache_root() / "tools" / pin.replace("==", "-").replace(".*", "")
    exe = next(iter(sorted(dest.glob(f"nvidia/*/bin/{name}"))), None)
    if exe is None:
        try:
            run_pip([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(dest), pin])
        except subprocess.CalledProcessError as e:
            raise ToolchainError(f"{name} is missing: `pip install {pin}` failed") from e
        exe = next(iter(sorted(dest.glob(f"nvidia/*/bin/{name}"))), None)
        if exe is None:
            raise ToolchainError(f"{pin} holds no bin/{name}")
        exe.chmod(exe.stat().st_mode | 0o111)
    return exe


def cuobjdump() -> Path:
    return cuda_tool("cuobjdump", CUOBJDUMP_PIN)
