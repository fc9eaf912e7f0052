"""Compiler and linker flags for sageattn3, as data: one function per concern, the same code
for every OS. Used by ``setup.py`` (standalone builds) and by the factory (``ci.toolchain.flags``),
which records the effective profile in each wheel's build record.

Standard library only: it runs before anything is installed.
"""

from __future__ import annotations

import re

# Torch >= 2.13 headers require C++20 (older ones compile as C++17 and 20 alike).
CXX20_FROM_TORCH = (2, 13)
# /MD: the DLL C runtime torch and Python use (cl defaults to the static /MT).
MSVC_HOST_FLAGS = ("/Zc:__cplusplus", "/Zc:preprocessor", "/bigobj", "/permissive-", "/EHsc", "/MD")
# Torch's own libraries and the CUDA runtime: never bundled, torch loads them first.
TORCH_LINK_LIBS = ("c10", "torch_cpu", "torch_cuda")
# The torch-facing translation unit (the only one that includes torch headers): the LibTorch
# stable ABI from the floor on, the classic dispatcher API (one build per torch line) below it.
STABLE_UNIT = "csrc/torch/stable.cpp"
CLASSIC_UNIT = "csrc/torch/classic.cpp"
# The classic unit also takes the current stream from c10's CUDA library.
CLASSIC_LINK_LIBS = ("c10", "c10_cuda", "torch_cpu", "torch_cuda")


def torch_unit(stable_abi_floor: str | None) -> str:
    """The torch-facing unit a build compiles: stable when it targets a stable-ABI floor."""
    return STABLE_UNIT if stable_abi_floor else CLASSIC_UNIT


def _mm(version: str) -> tuple[int, int]:
    m = re.match(r"(\d+)\.(\d+)", version)
    if not m:
        raise ValueError(f"not a version: {version!r}")
    return int(m.group(1)), int(m.group(2))


def gencode(arch: str) -> str:
    """'sm_120a' -> '-gencode=arch=compute_120a,code=sm_120a' (real machine code only: the
    a/f targets have no forward-compatible PTX worth shipping)."""
    m = re.fullmatch(r"sm_(\d+[af]?)", arch)
    if not m:
        raise ValueError(f"not a GPU arch: {arch!r} (expected e.g. 'sm_120a')")
    return f"-gencode=arch=compute_{m.group(1)},code=sm_{m.group(1)}"


def default_archs(cuda: str) -> list[str]:
    """What a CUDA release can compile of the sm_120 family (12.8: 120a; 12.9+: 120a, 121a)."""
    if _mm(cuda) >= (12, 9):
        return ["sm_120a", "sm_121a"]
    if _mm(cuda) >= (12, 8):
        return ["sm_120a"]
    raise ValueError(f"CUDA {cuda} cannot compile the sm_120 family (needs >= 12.8)")


def cxx_standard(torch_version: str) -> str:
    return "c++20" if _mm(torch_version) >= CXX20_FROM_TORCH else "c++17"


def torch_target_version(floor: str) -> str:
    """The TORCH_TARGET_VERSION define for a stable-ABI floor: '2.10' -> 0x020A000000000000."""
    major, minor = _mm(floor)
    return f"0x{major:02X}{minor:02X}000000000000"


def profile(
    *,
    platform: str,
    cuda: str,
    archs: list[str],
    torch_version: str,
    stable_abi_floor: str | None,
    limited_api_python: str = "3.10",
    compiler: str | None = None,
    mma_model: bool = False,
    static_cudart: bool = False,
    cross_compiler: str | None = None,
    machine: str | None = None,
    host_compiler: str | None = None,
) -> dict:
    """The full flag profile for one build. ``platform`` is 'linux' or 'windows'.

    ``mma_model``: the test-only flavour in which the block-scaled FP4 MMA instruction is
    replaced by its software model (``SAGEATTN3_MMA_MODEL``), so the rest of the sm_120
    kernel runs on sm_90a. Never shipped: the factory refuses to publish such wheels.

    ``cross_compiler`` (with ``machine``): a cross build, e.g. ``aarch64-linux-gnu-g++`` for
    ``aarch64`` on an x86_64 machine: it compiles the torch-facing unit, links, and is nvcc's
    host compiler (``-ccbin``); the device code is the same as a native build's.

    ``host_compiler``: a native build's g++ by path, e.g. a gcc-toolset's that the CUDA release
    supports: nvcc's host compiler (``-ccbin``), and what compiles the torch-facing unit and links,
    instead of whatever g++ comes first on PATH."""
    if platform not in ("linux", "windows"):
        raise ValueError(f"unknown platform {platform!r}: expected 'linux' or 'windows'")
    compiler = compiler or ("msvc" if platform == "windows" else "gcc")
    std = cxx_standard(torch_version)
    py_major, py_minor = _mm(limited_api_python)
    # USE_CUDA: declares torch's CUDA shim functions (current stream) in the stable C API.
    defines = ["NDEBUG", "USE_CUDA", f"Py_LIMITED_API=0x{py_major:02X}{py_minor:02X}0000"]
    if mma_model:
        defines.append("SAGEATTN3_MMA_MODEL=1")
    if stable_abi_floor:
        defines.append(f"TORCH_TARGET_VERSION={torch_target_version(stable_abi_floor)}")
    # No --use_fast_math: the quantizer must be bit-exact with the reference (IEEE division).
    # -lineinfo only in the test flavour (profiling on the H100): its file table holds absolute
    # source paths (cicc joins its cwd to every file, relative -I or not), which would put
    # build-machine paths into shipped cubins and make wheels differ by checkout path.
    nvcc = ["-O3", f"-std={std}", *(["-lineinfo"] if mma_model else []), "--expt-relaxed-constexpr"]
    if _mm(cuda) >= (12, 8):
        nvcc.append("--compress-mode=size")
    nvcc += [gencode(a) for a in archs]
    env: dict[str, str] = {}
    if cross_compiler:
        if compiler != "gcc" or not machine:
            raise ValueError(f"a cross compiler ({cross_compiler}) needs the gcc style and a target machine")
    if host_compiler and (cross_compiler or compiler != "gcc"):
        raise ValueError(f"a host compiler ({host_compiler}) is for native gcc-style builds only")
    if cross_compiler or host_compiler:
        nvcc.append(f"-ccbin={cross_compiler or host_compiler}")
    if compiler == "msvc":
        defines += ["NOMINMAX", "WIN32_LEAN_AND_MEAN"]
        host = ["/O2", f"/std:{std}", *MSVC_HOST_FLAGS]
        cxx = list(host)
        nvcc += [f"-Xcompiler={f}" for f in host]
        ldflags: list[str] = []
        env["DISTUTILS_USE_SDK"] = "1"
    else:
        host = ["-O3", "-fPIC", "-fvisibility=hidden"]
        cxx = [*host, f"-std={std}"]
        nvcc += ["-Xcompiler=" + ",".join(host)]
        ldflags = ["-shared", "-Wl,--as-needed", "-Wl,-O1", "-s"]  # -s: shipped stripped
    cross = ({"machine": machine, "host_compiler": cross_compiler} if cross_compiler
             else {"host_compiler": host_compiler} if host_compiler else {})
    return {
        "platform": platform,
        "compiler": compiler,
        **cross,
        "cxx_std": std,
        "archs": list(archs),
        "defines": defines,
        "nvcc_flags": nvcc,
        "cxx_flags": cxx,
        "ldflags": ldflags,
        "torch_unit": torch_unit(stable_abi_floor),
        "torch_include_subdirs": ["include"],
        # static_cudart: the CUDA runtime linked in (the proof flavour, compiled with another
        # CUDA major than its torch's runtime); normally torch's own libcudart is used.
        "link_libs": [*(TORCH_LINK_LIBS if stable_abi_floor else CLASSIC_LINK_LIBS),
                      *(("cudart_static", "dl", "rt", "pthread") if static_cudart else ("cudart",))],
        "env": env,
    }
