"""Cross-compiling a Linux target on a Linux machine of another architecture (linux-aarch64
wheels built on x86_64), and running what was built under user-mode emulation.

A cross build runs the native build's code path with three things swapped, all chosen by the
target's flag profile and build config, never by editing sources:

1. the host compiler: ``<triple>-g++`` (Debian's ``g++-aarch64-linux-gnu``) for the
   torch-facing unit, the link, and as nvcc's ``-ccbin`` (nvcc's device code is the same on
   every host);
2. the link sysroot: the target machine's CUDA runtime headers and ``libcudart`` (PyPI's
   ``nvidia-cuda-runtime``/``-crt``/``-cccl`` wheels for that platform) and its torch (PyPI's
   torch wheel for that platform: ``torch/include`` and ``torch/lib``), unpacked into the cache;
3. the Python headers: the target machine's CPython (Debian's ``python3.11`` packages for that
   architecture, unpacked with ``dpkg-deb``, never installed into the system).

The same unpacked CPython, run by ``qemu-<machine>`` with the unpacked tree as its root, is the
interpreter of the emulated verify (``ci.stages.emulate``). Each piece is provisioned once into the
cache (``<cache>/cross/<machine>/...``), checked (compiler target and version, CUDA major.minor,
torch version and CUDA), and every failure says what to install.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from packaging.version import Version

from ci.toolchain.cross_spec import CROSS_SPECS, CrossSpec, host_machine, spec_for
from ci.runtime.pip_env import pip_environ
from ci.toolchain.tools import ToolchainError, cache_root

# The oldest cross g++ accepted: C++20 for torch >= 2.13's headers (Debian 12 ships 12.2).
CROSS_GCC_MIN = Version("11")
# The CUDA runtime wheels that make up a target machine's CUDA headers and libcudart.
CUDA_SYSROOT_PACKAGES = ("nvidia-cuda-runtime", "nvidia-cuda-crt", "nvidia-cuda-cccl")
# The Python the build and the emulated verify use on the target machine (Debian 12's).
TARGET_PYTHON = "3.11"
# Debian packages of an aarch64 CPython 3.11 that runs under qemu-user (its shared libraries
# included; the C runtime too, so no system package of that architecture is installed).
DEBIAN_PYTHON_PACKAGES = (
    "libc6", "libgcc-s1", "libstdc++6", "libpython3.11-minimal", "python3.11-minimal",
    "libpython3.11-stdlib", "libpython3.11-dev", "libexpat1", "zlib1g", "libssl3", "libffi8",
    "libbz2-1.0", "liblzma5", "libsqlite3-0", "libncursesw6", "libtinfo6", "libreadline8",
    "libuuid1", "libcrypt1", "libnsl2", "libtirpc3", "libgssapi-krb5-2", "libkrb5-3",
    "libk5crypto3", "libkrb5support0", "libcom-err2", "libkeyutils1", "libdb5.3", "libgdbm6",
)
# No ca-certificates: under ``qemu -L root`` a path missing from the root is the host's, so the
# host's certificate bundle (with any TLS proxy's certificates) is what pip sees.
DEBIAN_ARCH_INDEPENDENT = ("media-types",)


def _run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, **kw)


# -- the cross compiler ----------------------------------------------------------------

@dataclass(frozen=True)
class CrossCompiler:
    machine: str
    cxx: Path
    version: str  # "12.2.0"
    banner: str  # first line of --version, for the build record


def find_cross_compiler(machine: str) -> CrossCompiler:
    """``<triple>-g++`` on PATH, checked to target ``machine`` and to be new enough."""
    spec = spec_for(machine)
    exe = shutil.which(spec.cxx_name)
    install = f"install Debian's {spec.compiler_package} (apt-get install -y {spec.compiler_package})"
    if not exe:
        raise ToolchainError(f"no {machine} cross compiler ({spec.cxx_name}) on PATH: {install}")
    try:
        dumped = _run([exe, "-dumpmachine"], check=True).stdout.strip()
        version = _run([exe, "-dumpfullversion"], check=True).stdout.strip()
        banner = _run([exe, "--version"], check=True).stdout.splitlines()[0]
    except (OSError, subprocess.CalledProcessError) as e:
        raise ToolchainError(f"{exe} did not run ({e}): reinstall it ({install})") from e
    if not dumped.startswith(machine):
        raise ToolchainError(f"{exe} targets {dumped}, not {machine}: {install}")
    if Version(version) < CROSS_GCC_MIN:
        raise ToolchainError(f"{exe} is GCC {version}; torch's headers need GCC >= {CROSS_GCC_MIN}: {install}")
    return CrossCompiler(machine, Path(exe), version, banner)


def find_emulator(machine: str) -> Path:
    spec = spec_for(machine)
    exe = shutil.which(spec.emulator) or shutil.which(f"{spec.emulator}-static")
    if not exe:
        raise ToolchainError(f"no {spec.emulator} on PATH: install Debian's qemu-user (apt-get install -y qemu-user)")
    return Path(exe)


# -- PyPI wheels of the target machine -------------------------------------------------

def _pip_download(spec: CrossSpec, requirements: list[str], dest: Path, what: str) -> list[Path]:
    """``pip download`` of ``requirements`` as built for ``spec``'s machine (no dependencies)."""
    plats = [a for p in spec.wheel_platforms for a in ("--platform", p)]
    cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:", *plats,
           "--python-version", TARGET_PYTHON, "--implementation", "cp", "--dest", str(dest), *requirements]
    proc = _run(cmd, env=pip_environ())
    if proc.returncode != 0:
        last = (proc.stderr or proc.stdout).strip().splitlines()[-1:]
        raise ToolchainError(f"could not download {what} for linux-{spec.machine} from PyPI "
                             f"({' '.join(requirements)}; pip exited {proc.returncode}): {last}")
    return sorted(dest.glob("*.whl"))


def _extract(wheel: Path, dest: Path, prefixes: tuple[str, ...]) -> None:
    with zipfile.ZipFile(wheel) as z:
        for info in z.infolist():
            if info.is_dir() or not info.filename.startswith(prefixes):
                continue
            out = dest / info.filename
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_bytes(z.read(info))


def cuda_sysroot(machine: str, major_minor: str) -> Path:
    """The target machine's CUDA runtime headers and ``lib/libcudart.so`` of CUDA
    ``major_minor`` (13.x: PyPI's wheels), unpacked into the cache; returns its root (``include``,
    ``lib``)."""
    if Version(major_minor).major < 13:
        raise ToolchainError(f"CUDA {major_minor} for linux-{machine} is not on PyPI (only CUDA 13.x runtime wheels "
                             f"are): cross builds here are CUDA 13.x; the release's arm runner builds the rest")
    spec = spec_for(machine)
    root = cache_root() / "cross" / machine / f"cuda-{major_minor}"
    if (root / ".complete").exists():
        return root
    shutil.rmtree(root, ignore_errors=True)
    with tempfile.TemporaryDirectory(prefix="sageattn3-cross-cuda-") as tmp:
        wheels = _pip_download(spec, [f"{p}=={major_minor}.*" for p in CUDA_SYSROOT_PACKAGES], Path(tmp),
                               f"the CUDA {major_minor} runtime")
        unpacked = Path(tmp) / "unpacked"
        for w in wheels:
            _extract(w, unpacked, ("nvidia/",))
        cu = unpacked / "nvidia" / f"cu{Version(major_minor).major}"
        real = sorted((cu / "lib").glob("libcudart.so.*"))
        if not (cu / "include" / "cuda_runtime.h").exists() or not real:
            raise ToolchainError(f"PyPI's CUDA {major_minor} wheels for linux-{machine} hold no cuda_runtime.h or "
                                 f"libcudart.so.*: {[w.name for w in wheels]}")
        root.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(str(cu), root)
    (root / "lib" / "libcudart.so").symlink_to(real[0].name)
    versions = {w.name.split("-")[0]: w.name.split("-")[1] for w in wheels}
    runtime = Version(versions["nvidia_cuda_runtime"])
    if f"{runtime.major}.{runtime.minor}" != major_minor:
        shutil.rmtree(root, ignore_errors=True)
        raise ToolchainError(f"PyPI gave nvidia-cuda-runtime {runtime} for CUDA {major_minor}")
    (root / ".complete").write_text(json.dumps(versions, sort_keys=True))
    return root


@dataclass(frozen=True)
class TorchSysroot:
    """A target machine's torch, unpacked: ``root/torch/{include,lib,version.py}``."""

    root: Path
    version: str  # "2.14.1+cu130"
    cuda: str | None  # "13.0"; None: a CPU build

    @property
    def torch_dir(self) -> Path:
        return self.root / "torch"


def _torch_version_py(text: str) -> tuple[str, str | None]:
    version = re.search(r"^__version__ = '([^']+)'", text, re.M)
    cuda = re.search(r"^cuda: Optional\[str\] = (?:'([^']+)'|None)", text, re.M)
    if not version or not cuda:
        raise ToolchainError(f"torch/version.py says neither __version__ nor cuda:\n{text}")
    return version.group(1), cuda.group(1)


def torch_sysroot(machine: str, version: str) -> TorchSysroot:
    """PyPI's torch ``version`` for linux-``machine`` (headers, libraries, version.py), unpacked
    into the cache once; its version and CUDA are read from its own version.py."""
    spec = spec_for(machine)
    root = cache_root() / "cross" / machine / f"torch-{version}"
    marker = root / ".complete"
    if not marker.exists():
        shutil.rmtree(root, ignore_errors=True)
        with tempfile.TemporaryDirectory(prefix="sageattn3-cross-torch-") as tmp:
            wheels = _pip_download(spec, [f"torch=={version}"], Path(tmp), f"torch {version}")
            _extract(wheels[0], root, ("torch/include/", "torch/lib/", "torch/version.py"))
        marker.write_text(json.dumps(_torch_version_py((root / "torch" / "version.py").read_text())))
    got, cuda = json.loads(marker.read_text())
    return TorchSysroot(root, got, cuda)


# -- the target machine's Python (Debian packages, unpacked) ----------------------------

@dataclass(frozen=True)
class PythonRoot:
    """An unpacked Debian CPython of the target machine: ``root`` is the file-system root
    qemu-user runs it in (``-L root``)."""

    machine: str
    root: Path
    version: str  # "3.11.2"

    @property
    def python(self) -> Path:
        return self.root / "usr" / "bin" / f"python{TARGET_PYTHON}"

    @property
    def include(self) -> Path:
        """Headers with the target machine's own pyconfig.h (Debian keeps it per triple)."""
        return self.root / "sageattn3-include" / f"python{TARGET_PYTHON}"


def python_root(machine: str) -> PythonRoot:
    """Debian's CPython 3.11 for ``machine`` (with its shared libraries and C runtime),
    downloaded with ``apt-get download`` and unpacked with ``dpkg-deb -x`` into the cache: no
    package of that architecture is installed into the system."""
    spec = spec_for(machine)
    root = cache_root() / "cross" / machine / f"python{TARGET_PYTHON}-root"
    marker = root / ".complete"
    if marker.exists():
        return PythonRoot(machine, root, marker.read_text().strip())
    for tool in ("apt-get", "dpkg-deb"):
        if not shutil.which(tool):
            raise ToolchainError(f"unpacking Debian's {machine} Python needs {tool} (a Debian or Ubuntu machine)")
    shutil.rmtree(root, ignore_errors=True)
    with tempfile.TemporaryDirectory(prefix="sageattn3-cross-debs-") as tmp:
        pkgs = [f"{p}:{spec.debian_arch}" for p in DEBIAN_PYTHON_PACKAGES] + list(DEBIAN_ARCH_INDEPENDENT)
        proc = _run(["apt-get", "download", "-q", *pkgs], cwd=tmp)
        if proc.returncode != 0:
            raise ToolchainError(
                f"apt-get download of Debian's {spec.debian_arch} Python packages failed "
                f"({(proc.stderr or proc.stdout).strip().splitlines()[-1:]}): enable the architecture once with "
                f"`dpkg --add-architecture {spec.debian_arch} && apt-get update`")
        root.mkdir(parents=True)
        for deb in sorted(Path(tmp).glob("*.deb")):
            subprocess.run(["dpkg-deb", "-x", str(deb), str(root)], check=True)
        minimal = next(Path(tmp).glob(f"python{TARGET_PYTHON}-minimal_*.deb"))
        version = _run(["dpkg-deb", "-f", str(minimal), "Version"], check=True).stdout.strip()
    src = root / "usr" / "include" / f"python{TARGET_PYTHON}"
    inc = PythonRoot(machine, root, "").include
    shutil.copytree(src, inc)
    # Debian's pyconfig.h picks the per-triple one by the compiler's macros; put that one in place.
    shutil.copy2(root / "usr" / "include" / spec.triple / f"python{TARGET_PYTHON}" / "pyconfig.h", inc / "pyconfig.h")
    upstream = version.split("-")[0]
    marker.write_text(upstream)
    return PythonRoot(machine, root, upstream)


# -- everything a cross build uses --------------------------------------------------------

@dataclass(frozen=True)
class CrossToolchain:
    """Resolved once per cross build (``ci.stages.build.resolve_toolchain``)."""

    machine: str
    compiler: CrossCompiler
    cuda_root: Path
    torch: TorchSysroot
    python: PythonRoot

    def config(self) -> dict:
        """The build config's ``cross`` block (what setup.py reads instead of the running
        machine's torch, CUDA runtime and Python headers)."""
        return {"machine": self.machine, "torch_dir": str(self.torch.torch_dir), "cuda_root": str(self.cuda_root),
                "python_include": str(self.python.include), "plat_name": f"linux_{self.machine}"}

    def record(self) -> dict:
        """The build record's ``toolchain.cross`` entry: how the wheel was cross-built."""
        cuda_versions = json.loads((self.cuda_root / ".complete").read_text())
        return {"machine": self.machine, "compiler": self.compiler.banner, "torch": self.torch.version,
                "cuda_runtime": cuda_versions.get("nvidia_cuda_runtime"),
                "python_headers": f"Debian python{TARGET_PYTHON} {self.python.version}",
                "built_on": f"linux-{host_machine()}"}


def resolve_cross(machine: str, cuda: str, torch_version: str) -> CrossToolchain:
    compiler = find_cross_compiler(machine)
    cuda_root = cuda_sysroot(machine, cuda)
    torch = torch_sysroot(machine, torch_version)
    if torch.cuda != cuda:
        raise ToolchainError(
            f"PyPI's torch {torch_version} for linux-{machine} is {torch.version} "
            f"({'CUDA ' + torch.cuda if torch.cuda else 'a CPU build'}), not a CUDA {cuda} build: this target's "
            f"torch comes only from PyTorch's index (the release's arm runner builds it)")
    return CrossToolchain(machine, compiler, cuda_root, torch, python_root(machine))


# PyPI's torch for linux-aarch64 is a CUDA build (of the line's PyPI-default CUDA) from this
# line on; before it a CPU build (seen: 2.9.1 and 2.10.0 are CPU builds, 2.14.1 the CUDA 13.0 one;
# lines between are treated as CPU builds until one is seen).
PYPI_CUDA_TORCH_FROM = {"aarch64": Version("2.14")}


def cross_blockers(target) -> list[str]:
    """Why ``target`` (a Linux target of another machine) cannot be cross-built here; empty:
    it can. Cheap: nothing is downloaded (``resolve_cross`` checks the real files)."""
    machine = target.os.machine
    if machine not in CROSS_SPECS:
        return [f"needs a {target.os.key} machine (no cross toolchain is known for {machine}); the release pipeline builds it"]
    spec, reasons = CROSS_SPECS[machine], []
    if not shutil.which(spec.cxx_name):
        reasons.append(f"cross-building needs {spec.cxx_name} (apt-get install -y {spec.compiler_package})")
    if Version(target.cuda).major < 13:
        reasons.append(f"CUDA {target.cuda} for {target.os.key} is not on PyPI (only 13.x runtime wheels are); "
                       f"the release's arm runner builds it")
    torch = Version(target.build_torch)
    if Version(f"{torch.major}.{torch.minor}") < PYPI_CUDA_TORCH_FROM.get(machine, Version("999")):
        reasons.append(f"PyPI's torch {target.build_torch} for {target.os.key} is a CPU build (its CUDA build comes "
                       f"only from PyTorch's index)" + ("" if target.variant.stable else
                                                        "; `python -m ci.checks.classic_link link-classic` links the classic unit instead"))
    elif target.cuda != target.build_torch_pypi_cuda:
        reasons.append(f"PyPI's torch {target.build_torch} for {target.os.key} is the CUDA "
                       f"{target.build_torch_pypi_cuda} build, not {target.cuda} (PyTorch's index has that one)")
    return reasons


def build_env(python_version: str, cross: CrossToolchain):
    """The environment that runs the cross build's setup.py: this machine's Python with the build
    packages and no torch (the target machine's torch is read from its sysroot, never imported).
    Returned as a ``TorchEnv`` naming the sysroot's torch, which is what the build compiles against."""
    from ci.toolchain.resolved import TorchEnv, venv_python
    from ci.toolchain.tools import BUILD_ENV_PACKAGES, ensure_packages, find_python, run_pip

    root = cache_root() / "envs" / f"py{python_version}-cross-build"
    if not (root / ".complete").exists():
        shutil.rmtree(root, ignore_errors=True)
        run_pip([str(find_python(python_version)), "-m", "venv", str(root)])
        try:
            run_pip([str(venv_python(root)), "-m", "pip", "install", "--quiet", *BUILD_ENV_PACKAGES])
        except subprocess.CalledProcessError as e:
            shutil.rmtree(root, ignore_errors=True)
            raise ToolchainError(f"could not install {' '.join(BUILD_ENV_PACKAGES)} for the cross build "
                                 f"(pip exited {e.returncode})") from e
        (root / ".extra.json").write_text(json.dumps(list(BUILD_ENV_PACKAGES)))
        (root / ".complete").write_text("build packages only")
    else:
        ensure_packages(root, BUILD_ENV_PACKAGES)
    return TorchEnv(root, python_version, cross.torch.version, cross.torch.cuda)


ELF_MACHINES = {62: "x86_64", 183: "aarch64"}


def elf_machine(path: Path) -> str:
    """The machine an ELF file is for, from its header's e_machine (little-endian ELF64)."""
    head = path.read_bytes()[:20]
    if head[:4] != b"\x7fELF":
        raise ToolchainError(f"{path} is not an ELF file")
    code = int.from_bytes(head[18:20], "little")
    return ELF_MACHINES.get(code, f"e_machine {code}")
