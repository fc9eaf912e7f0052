"""The kernels the SASS budget (:mod:`ci.checks.sass_budget`) is counted for: this project's
attention kernel (``sageattn3/csrc/attn``: compiled here, its steady-state regions read from the
source) and upstream's (thu-ml/SageAttention: compiled from a checkout, or its counts stored
below), and the calibration of the model by upstream's measured speed."""

from __future__ import annotations

import re
import subprocess
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from ci.checks.sass_budget import GPUS, Budget, Classifier, Gpu, Instr, block_lines, budget, disassemble, in_ranges
from ci.toolchain.flags import device_flags

# -- this project's kernel (sageattn3/csrc/attn) ------------------------------------------------

ROOT = Path(__file__).resolve().parents[2]
CSRC = ROOT / "sageattn3" / "csrc"
KERNEL = CSRC / "attn" / "attn_fwd_kernel.cuh"


def _line_of(path: Path, pattern: str) -> int:
    for i, line in enumerate(path.read_text().splitlines(), 1):
        if re.search(pattern, line):
            return i
    raise ValueError(f"{path.name}: no line matching {pattern!r}")


def ours_regions(kernel: Path = KERNEL) -> dict[str, list[tuple[int, int]]]:
    """Line ranges of attn_fwd_kernel.cuh that the steady state of a warp does not run, or
    runs only on the default path (per-block Q means)."""
    return {
        "producer (thread 0)": [block_lines(kernel, r"^struct Producer")],
        "mask (tail / causal diagonal)": [block_lines(kernel, r"if \(tail \|\| diag\) \{")],
        "residual": [block_lines(kernel, r"^struct ResidualHalf"), block_lines(kernel, r"float delta_s_part\("),
                     block_lines(kernel, r"if \(kInLoopResidual && has_residual\) \{"), block_lines(kernel, r"float2 e4m3x2_value\(")],
    }


def ours_classifier(with_residual: bool, kernel: Path = KERNEL) -> Classifier:
    regions = ours_regions(kernel)

    def classify(ins: Instr) -> str | None:
        for name, ranges in regions.items():
            if name == "residual" and with_residual:
                continue
            if in_ranges(ins, "attn/attn_fwd_kernel.cuh", ranges):
                return name
        return None

    return classify


def ours_tma_bytes(d: int) -> int:
    """K codes + V codes + K scales per stage (SmemLayout::kStageTx)."""
    return 128 * d // 2 * 2 + 128 * d // 16


def compile_ours(nvcc: Path, out_dir: Path, cuda: str | None = None) -> Path:
    """The attention kernel for sm_120a with line info; ``cuda``: the release of ``nvcc``."""
    cubin = out_dir / "attn_sm_120a.cubin"
    subprocess.run([str(nvcc), "-cubin", str(CSRC / "attn" / "attn_launch.cu"), "-o", str(cubin),
                    "-gencode=arch=compute_120a,code=sm_120a", *device_flags(False, cuda), "-lineinfo", f"-I{CSRC}"],
                   check=True, capture_output=True, text=True)
    return cubin


def _head_dim_of(name: str) -> int | None:
    m = re.search(r"fp4_attn_fwd_kernelILi(\d+)E", name)
    return int(m.group(1)) if m else None


def _qk8(name: str) -> bool:
    """The FP8 Q·Kᵀ instantiation (kQK8: MXFP8 Q and K, the heads qk_precision picks)."""
    return re.search(r"fp4_attn_fwd_kernelILi\d+ELb0ELb1E", name) is not None


def ours_tma_bytes_qk8(d: int) -> int:
    """K codes (one byte per element) + V codes + K's UE8M0 scales (one per 32) per stage."""
    return 128 * d + 128 * d // 2 + 128 * d // 32


def _in_loop_residual(name: str) -> bool:
    """The instantiation that corrects delta_s in its loop (kInLoopResidual, the bounded-memory mode)."""
    return re.search(r"fp4_attn_fwd_kernelILi\d+ELb1E", name) is not None


def ours_budgets(cubin: Path, bounded: bool = True) -> list[Budget]:
    """Per head dim: the defaults (delta_s precomputed per query block and key, read per tile),
    one Q mean (the same loop), and with ``bounded`` the in-loop correction of the bounded-memory
    mode."""
    funcs = disassemble(cubin)
    # loads that every warp makes of the same bytes (none today: the V scales are copied once per
    # CTA into the stage; before that, each warp loaded them from global memory)
    shared_lines = [i for i, line in enumerate(KERNEL.read_text().splitlines(), 1)
                    if re.search(r"const uint32_t v_sf = __ldg\(", line)]
    shared = lambda ins: any(f.endswith("attn/attn_fwd_kernel.cuh") and n in shared_lines for f, n in ins.frames)
    out = []
    kernels = [(name, instrs) for name, instrs in funcs.items() if _head_dim_of(name) is not None]
    for name, instrs in sorted(kernels, key=lambda kv: (-_head_dim_of(kv[0]), _in_loop_residual(kv[0]), _qk8(kv[0]))):
        d = _head_dim_of(name)
        if _qk8(name):
            out.append(budget(instrs, label=f"ours D{d}, FP8 Q·Kᵀ (heads qk_precision picks)", head_dim=d, warps=8,
                              tma_bytes=ours_tma_bytes_qk8(d), classify=ours_classifier(False), cta_shared=shared))
            continue
        if _in_loop_residual(name):
            runs = ((True, f"ours D{d}, bounded mode (in-loop correction)"),) if bounded else ()
        else:
            runs = ((False, f"ours D{d}, defaults (delta_s precomputed)"), (False, f"ours D{d}, one Q mean"))
        for res, label in runs:
            out.append(budget(instrs, label=label, head_dim=d, warps=8, tma_bytes=ours_tma_bytes(d),
                              classify=ours_classifier(res), cta_shared=shared))
    return out


# -- upstream's kernel (thu-ml/SageAttention) ---------------------------------------------------

# Upstream's forward kernel, instantiated without torch for inspection: its headers compile with
# cute/cutlass alone once the few ATen names params.h mentions exist.
UPSTREAM_DRIVER = """\
#include "cute/tensor.hpp"
#include "cutlass/cluster_launch.hpp"
#include "params.h"
#include "tile_scheduler.h"
#include "kernel_ws.h"
#include "kernel_traits.h"
template <int D, bool Causal, bool PerBlock>
void* kernel_address() {
  using KT = Flash_fwd_kernel_traits<D, 128, 128, 3, 1, PerBlock, cutlass::nv_float4_t<cutlass::float_e2m1_t>,
                                     cutlass::bfloat16_t>;
  return (void*)flash::compute_attn_ws<KT, Causal, flash::StaticPersistentTileScheduler>;
}
void* kernel_addresses[] = {kernel_address<128, false, true>(), kernel_address<64, false, true>()};
"""
UPSTREAM_ATEN_STUB = "namespace at { struct PhiloxCudaState { unsigned long long seed, offset, intragraph; bool captured; }; }\n"
# Upstream's setup.py flags (sageattention3_blackwell), arch sm_120a.
UPSTREAM_FLAGS = ("-O3", "-std=c++17", "-U__CUDA_NO_HALF_OPERATORS__", "-U__CUDA_NO_HALF_CONVERSIONS__",
                  "-U__CUDA_NO_BFLOAT16_OPERATORS__", "-U__CUDA_NO_BFLOAT16_CONVERSIONS__",
                  "-U__CUDA_NO_BFLOAT162_OPERATORS__", "-U__CUDA_NO_BFLOAT162_CONVERSIONS__", "--expt-relaxed-constexpr",
                  "--expt-extended-lambda", "--use_fast_math", "-lineinfo", "-DCUTLASS_DEBUG_TRACE_LEVEL=0", "-DNDEBUG",
                  "-DQBLKSIZE=128", "-DKBLKSIZE=128", "-DCTA256", "-DDQINRMEM", "-DEXECMODE=0")


def compile_upstream(nvcc: Path, checkout: Path, cutlass_include: Path, out_dir: Path) -> Path:
    src = checkout / "sageattention3_blackwell" / "sageattn3" / "blackwell"
    if not (src / "kernel_ws.h").exists():
        raise FileNotFoundError(f"{checkout}: not a thu-ml/SageAttention checkout (no {src.relative_to(checkout)}/kernel_ws.h)")
    stubs = out_dir / "stubs" / "ATen" / "cuda"
    stubs.mkdir(parents=True, exist_ok=True)
    (stubs / "CUDAGeneratorImpl.h").write_text(UPSTREAM_ATEN_STUB)
    (stubs / "CUDAGraphsUtils.cuh").write_text("")
    (stubs.parent / "CUDAGeneratorImpl.h").write_text(UPSTREAM_ATEN_STUB)
    driver = out_dir / "upstream_driver.cu"
    driver.write_text(UPSTREAM_DRIVER)
    cubin = out_dir / "upstream_sm_120a.cubin"
    r = subprocess.run([str(nvcc), "-cubin", str(driver), "-o", str(cubin), "-gencode=arch=compute_120a,code=sm_120a",
                        *UPSTREAM_FLAGS, f"-I{src}", f"-I{cutlass_include}", f"-I{out_dir / 'stubs'}"],
                       capture_output=True, text=True)
    if r.returncode:
        raise RuntimeError(f"building upstream's kernel failed:\n{r.stderr[-3000:]}")
    return cubin


def upstream_tma_bytes(d: int) -> int:
    """K + V codes, their scales, and 128 floats of delta_s per stage."""
    return 128 * d + 2 * 128 * d // 16 + 128 * 4


def _upstream_head_dim(name: str) -> int | None:
    m = re.search(r"Flash_fwd_kernel_traitsILi(\d+)ELi128ELi128E", name)
    return int(m.group(1)) if m else None


def upstream_budgets(cubin: Path) -> list[Budget]:
    """Upstream's consumer loop: 8 MMA warps (a separate producer warpgroup issues the TMA)."""
    out = []
    funcs = disassemble(cubin)
    for name, instrs in sorted(funcs.items(), key=lambda kv: -(_upstream_head_dim(kv[0]) or 0)):
        d = _upstream_head_dim(name)
        if d is None:
            continue
        out.append(budget(instrs, label=f"upstream D{d}", head_dim=d, warps=8, tma_bytes=upstream_tma_bytes(d)))
    return out


# Upstream's budget as counted from thu-ml/SageAttention d1a57a5 built here for sm_120a (flags of
# its setup.py, CUTLASS 4.2.0 headers): `python -m ci.checks.kernel_report --upstream CHECKOUT --cutlass
# INCLUDE` counts it again. Kept as data so that the report and the calibration need no checkout.
UPSTREAM_COMMIT = "d1a57a546c3d395b1ffcbeecc66d81db76f3b4b5"
UPSTREAM_STORED = {
    128: {"counts": {"omma": 64, "fp32": 360, "mufu": 82, "cvt": 36, "int": 181, "uniform": 48, "smem": 56,
                     "barrier": 6, "shfl": 12, "control": 5}, "smem_bytes": 22528},
    64: {"counts": {"omma": 32, "fp32": 328, "mufu": 82, "cvt": 36, "int": 130, "uniform": 39, "smem": 32,
                    "barrier": 6, "shfl": 12, "control": 5}, "smem_bytes": 13312},
}


def stored_upstream_budgets() -> list[Budget]:
    return [Budget(f"upstream D{d} ({UPSTREAM_COMMIT[:7]})", d, 8, counts=Counter(v["counts"]),
                   smem_bytes=v["smem_bytes"], tma_bytes=upstream_tma_bytes(d)) for d, v in UPSTREAM_STORED.items()]


@dataclass(frozen=True)
class Calibration:
    measured_tops: float
    gpu: Gpu
    source: str

    @property
    def predicted_tops(self) -> float:
        return stored_upstream_budgets()[0].ceiling_tops(self.gpu)

    @property
    def ratio(self) -> float:
        return self.measured_tops / self.predicted_tops


# Upstream's kernel as users measured it: 778 TOPS on an RTX 5090 at 32k tokens, D 128,
# non-causal (thu-ml/SageAttention#342), against this model's ceiling for it.
UPSTREAM_CALIBRATION = Calibration(778.0, GPUS[0], "thu-ml/SageAttention#342")
