"""Flag profiles per target: the payload's ``build_profile`` (one code path for Linux and
Windows, shared with standalone builds) applied to a :class:`~ci.toolchain.targets.Target`."""

from __future__ import annotations

from packaging.version import Version

from ci.payload.interface import build_profile
from ci.toolchain.targets import Matrix, Target, TorchLine


def measured_line(matrix: Matrix, cuda: str | None = None) -> tuple[TorchLine, str]:
    """The torch line whose build the kernels are measured as, and the CUDA of that build: the
    newest line of ``matrix`` with a variant that a ``cuda`` toolkit compiles (one of that CUDA or
    older), built with ``cuda``; without ``cuda``, the newest line with its newest variant."""
    if cuda is None:
        line = max(matrix.torch, key=lambda t: Version(t.build_version))
        return line, max(line.cuda, key=Version)
    lines = [t for t in matrix.torch if any(Version(c) <= Version(cuda) for c in t.cuda)]
    if not lines:
        raise ValueError(f"CUDA {cuda} builds no torch line of the matrix (the oldest variant it lists is "
                         f"{min((c for t in matrix.torch for c in t.cuda), key=Version)}): use a newer toolkit")
    return max(lines, key=lambda t: Version(t.build_version)), cuda


def device_flags(mma_model: bool, cuda: str | None = None) -> list[str]:
    """The device-side flags of a real build (sageattn3/build_profile.py): optimisation, C++
    standard, --expt-relaxed-constexpr, the defines that matter to device code. ``cuda``: the
    major.minor of the toolkit that compiles; the build is that of the newest torch line it
    compiles (:func:`measured_line`), whose torch decides the C++ standard."""
    line, cuda = measured_line(Matrix.load(), cuda)
    prof = build_profile().profile(platform="linux", cuda=cuda, archs=[], torch_version=line.build_version,
                                    stable_abi_floor=None, mma_model=mma_model)
    flags = [f for f in prof["nvcc_flags"] if not f.startswith(("-Xcompiler", "-gencode", "--compress-mode"))]
    defines = [d for d in prof["defines"] if not d.startswith(("Py_LIMITED_API", "TORCH_TARGET_VERSION"))]
    return [*flags, *(f"-D{d}" for d in defines)]


def compiler_for(target: Target) -> str:
    return "msvc" if target.os.platform == "windows" else "gcc"


# The test flavour adds Hopper machine code so an H100 can run everything but the FP4 MMA.
MMA_MODEL_ARCH = "sm_90a"


def profile_for(target: Target, stable_abi_floor: str, *, mma_model: bool = False, cuda: str | None = None,
                static_cudart: bool = False, cross: bool | None = None) -> dict:
    """``cuda``: the toolkit that compiles, when it is not the target's (the proof flavour).
    A Linux target of another machine than this one is cross-compiled (``ci.toolchain.cross``): its
    profile names the cross g++ as host compiler (``cross``: True/False instead of asking this
    machine, e.g. False for the profile on the target's own release runner). With CUDA 12.x on
    Linux, nvcc's host compiler is the gcc-toolset the release installs
    (cuda_host_compiler), by path."""
    from ci.toolchain.cross_spec import is_cross, spec_for

    spec = spec_for(target.os.machine) if (is_cross(target.os) if cross is None else cross) else None
    return build_profile().profile(
        platform=target.os.platform,
        cuda=cuda or target.cuda,
        archs=[*target.archs, *([MMA_MODEL_ARCH] if mma_model else [])],
        mma_model=mma_model,
        torch_version=target.build_torch,
        stable_abi_floor=stable_abi_floor if target.variant.stable else None,
        limited_api_python=target.floor_python,  # the wheel is <python_tag>-abi3
        compiler=compiler_for(target),
        static_cudart=static_cudart,
        cross_compiler=spec.cxx_name if spec else None,
        machine=spec.machine if spec else None,
        host_compiler=None if spec else cuda_host_compiler(target, cuda),
    )

# nvcc's host compiler for CUDA 12.x on Linux, installed by before-all and named with -ccbin
# (ci.toolchain.flags), so the image's default g++ never is: manylinux_2_28's default gcc-toolset moves
# (14 today, 15 planned) and CUDA 12.8/12.9 refuse GCC newer than 14 (crt/host_config.h:
# `#if __GNUC__ > 14 #error`). gcc-toolset-13: supported by every CUDA from 12.4 on, so inside
# both releases' range with a major to spare, and below the GCC 14 + CUDA 12.8 pair that torch's
# cpp_extension refused for a while (pytorch/pytorch#173366). AlmaLinux 8's AppStream ships it.
# Only the toolset's major is pinned: AppStream keeps only its newest build of gcc-toolset-13, so
# an exact version would vanish from the mirrors; the major is checked after the install.
CUDA12_GCC_TOOLSET = 13


def toolset_cxx(n: int) -> str:
    """The g++ of gcc-toolset-``n``, found at run time in the installed package's file list
    (``rpm -ql gcc-toolset-<n>-gcc-c++``: the image decides where the toolset lives). Where the
    package is not installed (before before-all, or on a machine without rpm) the name
    ``gcc-toolset-<n>-g++``, which no machine has: the checks that run it then say to install it."""
    import shutil
    import subprocess

    rpm = shutil.which("rpm")
    if rpm:
        proc = subprocess.run([rpm, "-ql", f"gcc-toolset-{n}-gcc-c++"], capture_output=True, text=True)
        found = [ln.strip() for ln in proc.stdout.splitlines() if ln.strip().endswith("/bin/g++")]
        if proc.returncode == 0 and found:
            return found[0]
    return f"gcc-toolset-{n}-g++"


def cuda_host_compiler(target: Target, cuda: str | None = None) -> str | None:
    """The g++ nvcc must use for ``target`` compiled with CUDA ``cuda`` (default: the target's)
    (``-ccbin``): gcc-toolset-CUDA12_GCC_TOOLSET's with CUDA 12.x on Linux, None elsewhere (13.x
    accepts the image's default GCC; Windows: cl)."""
    if target.os.platform == "linux" and int((cuda or target.cuda).split(".")[0]) < 13:
        return toolset_cxx(CUDA12_GCC_TOOLSET)
    return None
