"""The values a target's toolchain resolves to, frozen: the CUDA toolkit, the torch build
environment, and ``ResolvedToolchain``, everything one build uses. ci.stages.resolve makes them (finding
or provisioning what is missing, once per target); the build, repair, tag and verify stages
receive them and look nothing up themselves. Nothing here finds or installs anything."""

from __future__ import annotations

import os
import platform
import subprocess
from dataclasses import dataclass, field
from pathlib import Path, PurePath
from typing import TYPE_CHECKING

from packaging.version import Version

from ci.runtime.env import FactoryEnv
from ci.toolchain.targets import Target

# The CUTLASS/CuTe headers every build compiles against (nvidia-cutlass from PyPI, pinned).
CUTLASS_VERSION = "4.2.0.0"

if TYPE_CHECKING:
    from ci.toolchain import cross as crossmod
    from ci.toolchain import patches as patchmod

WINDOWS = os.name == "nt"


EXE = ".exe" if WINDOWS else ""


def venv_python(root: Path) -> Path:
    """The interpreter of a virtual environment, on either OS."""
    return root / ("Scripts" if WINDOWS else "bin") / f"python{EXE}"


# Where NVIDIA's Linux layout keeps per-target headers and libraries, by machine.
LINUX_CUDA_TARGET_DIR = {"x86_64": "x86_64-linux", "aarch64": "sbsa-linux", "arm64": "sbsa-linux"}


def _linux_target_dir() -> str:
    machine = platform.machine().lower()
    return LINUX_CUDA_TARGET_DIR.get(machine, f"{machine}-linux")


@dataclass(frozen=True)
class CudaToolkit:
    version: str  # full, "13.0.88"
    home: PurePath
    source: str  # "system" | "pypi" | "env"
    platform: str = "windows" if WINDOWS else "linux"

    @property
    def major_minor(self) -> str:
        v = Version(self.version)
        return f"{v.major}.{v.minor}"

    @property
    def nvcc(self) -> PurePath:
        return self.home / "bin" / ("nvcc.exe" if self.platform == "windows" else "nvcc")

    @property
    def include_dirs(self) -> list[PurePath]:
        dirs = [self.home / "include"]
        if self.platform != "windows":
            tgt = Path(self.home) / "targets" / _linux_target_dir() / "include"
            if tgt.is_dir():
                dirs.append(tgt)
        return dirs

    @property
    def lib_dir(self) -> PurePath:
        """Where the CUDA runtime's link library is: ``lib\\x64`` (cudart.lib) on Windows; on
        Linux the first of lib64, lib, targets/<arch>-linux/lib holding libcudart.so."""
        if self.platform == "windows":
            return self.home / "lib" / "x64"
        for cand in (self.home / "lib64", self.home / "lib", self.home / "targets" / _linux_target_dir() / "lib"):
            cand = Path(cand)
            if (cand / "libcudart.so").exists() or list(cand.glob("libcudart.so.*")):
                return cand
        return self.home / "lib64"


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
        return Path(subprocess.run([str(self.python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                   check=True, text=True, capture_output=True).stdout.strip())


# -- a target's build, resolved --------------------------------------------------------

TEST_FLAVOUR_LABEL = "mmamodel"


PROOF_FLAVOUR_LABEL = "proof"


# The proof flavour compiles a per-torch target with the CUDA 13 toolkit available here (its own
# 12.x comes only from NVIDIA's installer) and links the CUDA runtime statically, so the module
# loads next to that torch's CUDA 12 runtime. It proves the per-torch path (classic unit, that
# torch's headers and libraries, repair, tag, import, ABI guard); it is never indexed or published.
PROOF_CUDA = "13.0"


@dataclass(frozen=True)
class ResolvedToolchain:
    """Everything a target's build uses, resolved once before anything compiles (the build
    stage and the build record read only this, never the process environment: the settings
    it reads, such as the index its record names and the PATH it compiles with, are frozen
    here in ``settings`` when the toolchain is resolved)."""

    target: Target
    profile: dict
    patches: tuple[patchmod.Patch, ...]
    cuda: CudaToolkit
    env: TorchEnv
    host_compiler: str
    launcher: tuple[str, ...]
    cutlass: Path
    flavour: str  # "release" | TEST_FLAVOUR_LABEL | PROOF_FLAVOUR_LABEL
    cross: crossmod.CrossToolchain | None = None  # a Linux target of another machine (ci.toolchain.cross)
    compiler_env: tuple[tuple[str, str], ...] = ()  # the compiler cache's variables (sccache), for the compile
    settings: FactoryEnv = field(default_factory=FactoryEnv)  # the environment's settings, read at resolve time

    @property
    def torch_include(self) -> Path:
        """The torch headers compiled against (patches apply to copies of these)."""
        root = self.cross.torch.torch_dir if self.cross else self.env.site_packages / "torch"
        return root / "include"

    @property
    def local_label(self) -> str:
        return self.target.variant.label + ("" if self.flavour == "release" else f".{self.flavour}")


@dataclass(frozen=True)
class VerifyEnvs:
    """The torch environments the verify stage installs a wheel into, resolved before it runs
    (ci.stages.resolve.verify_envs): one per Python, holding the build's torch, and the ABI guard's
    foreign torch, or why the guard cannot be checked here."""

    source: str  # where the verify torch comes from, described
    bases: tuple[tuple[str, TorchEnv], ...]  # (Python X.Y, its environment)
    foreign: TorchEnv | None = None
    foreign_unchecked: str = ""  # no CPU torch reachable here: the guard is reported NOT CHECKED
