"""The kernels the SASS budget (:mod:`ci.checks.sass_budget`) is counted for: this project's
attention kernel (``sageattn3/csrc/attn``: compiled here, its steady-state regions read from the
source; its pre-passes from :mod:`ci.checks.sass_prepass`) and upstream's (thu-ml/SageAttention:
compiled from a checkout, or its counts stored below), and the calibration of the model by
upstream's measured speed."""

from __future__ import annotations

import re
import subprocess
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, NamedTuple

from ci.checks.sass_budget import (GPUS, REF, Budget, Classifier, Gpu, Instr, PerTile, Ref, block_lines, blocks_lines,
                                   budget, disassemble, in_ranges, innermost_loop, loops)
from ci.checks.sass_prepass import constant
from ci.toolchain.flags import device_flags

# -- this project's kernel (sageattn3/csrc/attn) ------------------------------------------------

ROOT = Path(__file__).resolve().parents[2]
CSRC = ROOT / "sageattn3" / "csrc"
KERNEL = CSRC / "attn" / "attn_fwd_kernel.cuh"
PRODUCER_STAGE, PRODUCER_TILE = "producer, per stage", "producer, per query tile"
LAST_STAGE = "a query tile's last stage (V's exponents)"
LAST_WARP = "the last warp's V exponent factors"
# The pre-passes each instantiation takes with the default arguments (qk_precision 'auto': the rule
# runs wherever the FP8 path can, FP4 heads included; the bounded mode cannot take FP8, so no rule)
TAKES = {"defaults": ("delta_s", "rule"), "one Q mean": ("rule",), "FP8": ("delta_s", "rule", "MXFP8"), "bounded": (),
         "FP8 P·V": ("delta_s", "rule", "MXFP8 V"), "FP8 Q·Kᵀ and P·V": ("delta_s", "rule", "MXFP8", "MXFP8 V"),
         # the raw 16-bit rows (D 128): delta_s unused, but the pre-pass fills their rows and the
         # producer copies them
         "raw 16-bit": ("delta_s", "rule"), "raw 16-bit and FP8 P·V": ("delta_s", "rule", "MXFP8 V")}


def _line_of(path: Path, pattern: str) -> int:
    for i, line in enumerate(path.read_text().splitlines(), 1):
        if re.search(pattern, line):
            return i
    raise ValueError(f"{path.name}: no line matching {pattern!r}")


def ours_regions(kernel: Path = KERNEL) -> dict[str, list[tuple[int, int]]]:
    """Line ranges of attn_fwd_kernel.cuh that the steady state of a consumer warp does not run,
    or runs only on the default path (per-block Q means). P's second term of the FP8 P·V path is
    counted (the static rule: its worst case, every 32-key block taking it; on peaky data most do).
    The bounded mode's producer (thread 0's, in warp 0: Producer) is counted as its own: what it
    does per stage, and what it does once per query tile (issue Q; step to the next tile), the
    bodies of those two blocks of Producer::run. Earlier entries win: the per-query-tile blocks lie
    inside Producer. (The other instantiations' producer warpgroup runs no line of the consumer's
    loop: ``ws_producer`` counts it from its own.)"""
    q_issue, advance = block_lines(kernel, r"if \(kb == 0\) \{"), block_lines(kernel, r"if \(\+\+kb == c\.num_kb\) \{")
    writer = block_lines(kernel, r"if \(threadIdx\.x >= kThreads - kVGroups\) \{")
    return {
        PRODUCER_TILE: [(q_issue[0] + 1, q_issue[1]), (advance[0] + 1, advance[1])],
        PRODUCER_STAGE: [block_lines(kernel, r"^struct Producer")],
        "mask (tail / causal diagonal)": [block_lines(kernel, r"if \(tail \|\| diag\) \{")],
        # once per query tile (its last key tile): O back from V's exponents, 64 or 32 multiplies
        LAST_STAGE: [block_lines(kernel, r"if \(kb \+ 1 == c\.num_kb\) \{")],
        # per stage, by D/32 threads of the last warp only (every warp runs the test, not the body):
        # counted once per SM, as the producer is (Budget.last_warp)
        LAST_WARP: [(writer[0] + 1, writer[1])],
        "residual": [block_lines(kernel, r"^struct ResidualHalf"), block_lines(kernel, r"float delta_s_part\("),
                     block_lines(kernel, r"if \(has_residual\) \{"), block_lines(kernel, r"float2 f16x2_value\("),
                     block_lines(kernel, r"^struct KHat4"), block_lines(kernel, r"float khat_scale\(")],
    }


def producer_share(b: Budget, ref: Ref = REF) -> float:
    """The producer's warp-instructions per key tile: its per-stage work, and its per-query-tile
    work amortized over the key tiles of a query tile at the reference shape."""
    return b.set_aside[PRODUCER_STAGE] + b.set_aside[PRODUCER_TILE] / ref.blocks


# -- the producer warpgroup (every instantiation but the bounded mode's: producer_warpgroup) -----

class ProducerLines(NamedTuple):
    """Where a producer of its own runs what, by source line (``producer_warp_lines``)."""
    blocks: list[tuple[list[tuple[int, int]], frozenset[int]]]  # a block's body lines, the warps that run it
    arrive: int                                                   # the line of its arrival on a stage's full barrier
    warps: int                                                    # its warps
    # single-statement tests (`if (tid < kBlockN / 2) x = ...;`) that ptxas predicates: every warp
    # issues the statement's instructions, only these warps move its bytes
    predicated: tuple[tuple[list[tuple[int, int]], frozenset[int]], ...] = ()


def producer_warp_lines(kernel: Path = KERNEL) -> ProducerLines:
    """The producer warpgroup's (kProducerThreads / 32 warps) code that only some of its warps
    run, by the test that guards it, with the warps (0-3 of the group) whose threads pass it: its
    first thread's (``leader``: a tile's Q, each stage's expect_tx and TMA loads) warp 0; the
    delta_s vector's (threads below kBlockN / 2) warps 0 and 1; V's exponent factors' (the last
    D/32 threads) warp 3. A braced body of such a test (``if (test) {``) is a block: a warp none
    of whose threads pass the test branches over it (the SASS branches, not predicates, these
    bodies), so it counts in those warps only. A one-statement test (``if (test) x = ...;``, D
    64's reads before the stage's wait) ptxas predicates: every warp issues it, only those warps
    move its bytes (``predicated``). Every other line every warp runs. And the line of its arrival
    on a stage's ``full`` barrier: one per stage (how many stages an iteration of its key loop
    holds, where ptxas unrolled it)."""
    body = block_lines(kernel, r"void producer_warpgroup\(")
    params = kernel.parent / "attn_params.h"
    threads, block_n = constant(params, "kProducerThreads"), constant(params, "kBlockN")
    tests = ((r"leader", frozenset({0})),
             (r"tid < kBlockN / 2", frozenset(range((block_n // 2 - 1) // 32 + 1))),
             (r"tid >= kProducerThreads - kVGroups", frozenset({(threads - 1) // 32})))
    text = kernel.read_text().splitlines()
    blocks = [([(a + 1, b) for a, b in blocks_lines(kernel, rf"if \({test}\) \{{", body)], who) for test, who in tests]
    one = [([(n, n) for n in range(body[0], body[1] + 1) if re.search(rf"^\s*if \({test}\) [^{{]*;\s*$", text[n - 1])], who)
           for test, who in tests]
    arrive = next(n for n in range(body[0], body[1] + 1) if re.search(r"mbar_arrive\(&full\[st\]\);", text[n - 1]))
    return ProducerLines(blocks, arrive, threads // 32, tuple((lines, who) for lines, who in one if lines))


def producer_loops(instrs: list[Instr]) -> tuple[tuple[int, int], tuple[int, int]]:
    """A producer of its own's key loop, the shortest loop issuing two TMA loads or more (the loads
    of a stage; an elected thread's retry loop around one load is shorter but issues one), and its
    tile loop, the shortest loop around that one: index ranges [lo, hi]."""
    lo, hi = innermost_loop(instrs, lambda body: sum(x.opcode.startswith("UTMALDG") for x in body) >= 2,
                            "issuing two TMA loads")
    around = [(a, b) for a, b in loops(instrs) if a <= lo and b >= hi and (a, b) != (lo, hi)]
    return (lo, hi), min(around, key=lambda r: r[1] - r[0])


class OwnProducer(NamedTuple):
    """A producer of its own per key tile (``ws_producer``)."""
    instructions: float  # its warp-instructions, all its warps
    busiest: float       # its busiest warp's
    smem_bytes: int      # shared memory bytes its key loop moves per stage, all its warps
    global_bytes: int    # bytes its key loop loads from global memory (L2) per stage, all its warps


def ws_producer(instrs: list[Instr], lines: ProducerLines, ref: Ref = REF,
                file: str = "attn/attn_fwd_kernel.cuh") -> OwnProducer:
    """The producer warpgroup per key tile. Static, as the consumer's count: every instruction of
    its key loop (``producer_loops``) counts, per stage (the loop's count / the stages it holds, by
    its arrivals on ``full``), and the rest of its tile loop once per query tile, over the key tiles
    of ``ref``; each in every warp that issues it: the blocks of ``lines`` in their warps only (the
    leader's TMA issue once, not in all four), the rest in all (a block's reconvergence, BSYNC,
    every warp passes). Its bytes (the delta_s rows, V's scales and exponents it copies into the
    stage), as the consumer's, from its key loop alone, a predicated one-statement test's
    (``lines.predicated``) in its warps only."""
    (lo, hi), (a, b) = producer_loops(instrs)

    def runs(ins: Instr, moves: bool) -> frozenset[int] | range:
        if not ins.opcode.startswith("BSYNC"):
            for ranges, who in lines.blocks + list(lines.predicated if moves else ()):
                if in_ranges(ins, file, ranges):
                    return who
        return range(lines.warps)

    def per_warp(part: list[Instr], weight: Callable[[Instr], int] = lambda ins: 1, moves: bool = False) -> list[int]:
        """``weight`` over the warps that issue each instruction, or (``moves``: bytes) that move its bytes"""
        n = [0] * lines.warps
        for ins in part:
            for w in runs(ins, moves):
                n[w] += weight(ins)
        return n

    at = [(lines.arrive, lines.arrive)]
    loop = instrs[lo:hi + 1]
    stages = sum(x.opcode.startswith("SYNCS.ARRIVE") and in_ranges(x, file, at) for x in loop)
    if not stages:
        raise ValueError("the producer's key loop holds no arrival on a stage's full barrier")
    own = [n / stages + t / ref.blocks for n, t in zip(per_warp(loop), per_warp(instrs[a:lo] + instrs[hi + 1:b + 1]))]
    return OwnProducer(sum(own), max(own), round(sum(per_warp(loop, Instr.smem_bytes, True)) / stages),
                       round(sum(per_warp(loop, Instr.global_bytes, True)) / stages))


def ours_dram_bytes(d: int, kind: str, ref: Ref = REF) -> float:
    """The attention kernel's compulsory DRAM bytes per tile at ``ref``: K and V of a key tile
    (codes and scales; K's residual, float16, in the bounded mode) once per head, so over the query blocks;
    Q of a query block and its output (bf16) over the key tiles; delta_s rows per query block and
    key (the defaults and the FP8 heads: read for every tile) or ds_key per key (one Q mean, the
    bounded mode: once per head). ``kind``: a key of ``TAKES``."""
    fp8, pv8 = kind in ("FP8", "FP8 Q·Kᵀ and P·V"), kind.endswith("P·V")
    raw = kind.startswith("raw")
    k_bytes = 128 * 2 * d if raw else _k_bytes(d, fp8)  # the raw rows: the inputs' 16-bit values
    kv = k_bytes + 128 * (d if pv8 else d // 2) + 128 * (d // 32 if pv8 else d // 16)
    q = k_bytes  # Q's 128 rows, as K's
    if kind == "bounded":
        kv += 128 * d * 2
        q += 2 * d * 4  # mean_q and qbar rows
    # (the raw rows' producer copies the delta_s row too, unused: one code for every kernel)
    ds = 128 * 4 if kind not in ("one Q mean", "bounded") else 128 * 4 / ref.blocks
    return kv / ref.blocks + (q + 128 * d * 2) / ref.blocks + ds


def ours_classifier(with_residual: bool, kernel: Path = KERNEL) -> Classifier:
    regions = ours_regions(kernel)

    def classify(ins: Instr) -> str | None:
        for name, ranges in regions.items():
            if name == "residual" and with_residual:
                continue
            # the reconvergence after the last warp's block carries the block's closing line, but
            # every warp passes it
            if name == LAST_WARP and ins.opcode.startswith("BSYNC"):
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


def _k_bytes(d: int, qk8: bool) -> int:
    """K's bytes per 128-key stage: FP4 codes and E4M3 scales; the precise Q·Kᵀ's E4M3 codes and
    UE8M0 scales (D 128) or bf16 rows without scales (D 64, the 16-bit Q·Kᵀ)."""
    if not qk8:
        return 128 * d // 2 + 128 * d // 16
    return 128 * 2 * d if d == 64 else 128 * d + 128 * d // 32


def ours_tma_bytes_qk8(d: int) -> int:
    """The precise Q·Kᵀ's K (``_k_bytes``) + V codes per stage."""
    return _k_bytes(d, True) + 128 * d // 2


def ours_tma_bytes_pv8(d: int, qk8: bool) -> int:
    """K (FP4, or the precise Q·Kᵀ's: ``_k_bytes``) + V's E4M3 codes per stage (V's scales are
    copied by the consumer threads, as in every instantiation)."""
    return _k_bytes(d, qk8) + 128 * d


def _raw16(name: str) -> int:
    """The raw 16-bit rows' instantiations (kQK16 at D 128: 1 bf16, 2 fp16; 0 for any other)."""
    m = re.search(r"fp4_attn_fwd_kernelILi128ELb0ELb1ELb[01]ELi([12])E", name)
    return int(m.group(1)) if m else 0


def _pv8(name: str) -> bool:
    """An FP8 P·V instantiation (kPV8, pv_precision "fp8", opt-in)."""
    return re.search(r"fp4_attn_fwd_kernelILi\d+ELb[01]ELb[01]ELb1E", name) is not None


def _in_loop_residual(name: str) -> bool:
    """The instantiation that corrects delta_s in its loop (kInLoopResidual, the bounded-memory mode)."""
    return re.search(r"fp4_attn_fwd_kernelILi\d+ELb1E", name) is not None


def ours_budgets(cubin: Path, prepass_cubins: dict[str, Path], bounded: bool = True, ref: Ref = REF) -> list[Budget]:
    """Per head dim: the defaults (delta_s precomputed per query block and key, read per tile),
    one Q mean (the same loop), the FP8 Q·Kᵀ heads, FP8 P·V (opt-in, with FP4 or FP8 Q·Kᵀ), and
    with ``bounded`` the in-loop correction of
    the bounded-memory mode; each with its producer (the bounded mode: thread 0's inline share,
    ``producer_share``; the others: the producer warpgroup, ``ws_producer``), compulsory DRAM bytes and the
    pre-passes it takes (``TAKES``; ``prepass_cubins``: ci.checks.sass_prepass.compile_prepasses)."""
    from ci.checks.sass_prepass import prepass_costs

    funcs = disassemble(cubin)
    # loads that every warp makes of the same bytes (none today: the V scales are copied once per
    # CTA into the stage; before that, each warp loaded them from global memory)
    shared_lines = [i for i, line in enumerate(KERNEL.read_text().splitlines(), 1)
                    if re.search(r"const uint32_t v_sf = __ldg\(", line)]
    shared = lambda ins: any(f.endswith("attn/attn_fwd_kernel.cuh") and n in shared_lines for f, n in ins.frames)
    cubins = {**prepass_cubins, "attn/attn_launch.cu": cubin}
    pre = {d: prepass_costs(cubins, d, ref) for d in {_head_dim_of(n) for n in funcs} - {None}}
    out, warp_lines = [], producer_warp_lines()
    kernels = [(name, instrs) for name, instrs in funcs.items() if _head_dim_of(name) is not None]
    order = lambda kv: (-_head_dim_of(kv[0]), _pv8(kv[0]), _in_loop_residual(kv[0]), _qk8(kv[0]),  # noqa: E731
                        _raw16(kv[0]))
    for name, instrs in sorted(kernels, key=order):
        d = _head_dim_of(name)
        # the heads that leave FP4: MXFP8 Q·Kᵀ at D 128, the 16-bit Q·Kᵀ (bf16 rows) at D 64
        precise = "16-bit" if d == 64 else "FP8"
        if _raw16(name) == 2:  # the fp16 rows' copy: the bf16 one's code but for the MMA's type
            continue
        if _raw16(name):  # D 128's raw 16-bit rows (the heads the second statistic picks), one stage
            kind = "raw 16-bit and FP8 P·V" if _pv8(name) else "raw 16-bit"
            tma = 128 * 2 * d + 128 * (d if _pv8(name) else d // 2)
            runs = ((kind, False, f"ours D{d}, raw 16-bit Q·Kᵀ{' and FP8 P·V' if _pv8(name) else ''} (heads the "
                     "second statistic picks)", tma),)
        elif _pv8(name):  # opt-in pv_precision "fp8", FP4 or the precise Q·Kᵀ
            kind = "FP8 Q·Kᵀ and P·V" if _qk8(name) else "FP8 P·V"
            label = f"{precise} Q·Kᵀ and FP8 P·V" if _qk8(name) else kind
            runs = ((kind, False, f"ours D{d}, {label} (pv_precision fp8)", ours_tma_bytes_pv8(d, _qk8(name))),)
        elif _qk8(name):
            runs = (("FP8", False, f"ours D{d}, {precise} Q·Kᵀ (heads qk_precision picks)", ours_tma_bytes_qk8(d)),)
        elif _in_loop_residual(name):
            runs = (("bounded", True, f"ours D{d}, bounded mode (in-loop correction)", ours_tma_bytes(d)),) if bounded else ()
        else:
            runs = (("defaults", False, f"ours D{d}, defaults (delta_s precomputed)", ours_tma_bytes(d)),
                    ("one Q mean", False, f"ours D{d}, one Q mean", ours_tma_bytes(d)))
        for kind, res, label, tma in runs:
            b = budget(instrs, label=label, head_dim=d, warps=8, tma_bytes=tma, classify=ours_classifier(res),
                       cta_shared=shared, once_per_cta=(LAST_WARP,))
            if kind == "bounded":  # thread 0 of warp 0, inline
                b.producer = producer_share(b, ref)
            else:  # the producer warpgroup, its bytes once per CTA
                own = ws_producer(instrs, warp_lines, ref)
                b.producer, b.producer_warp, b.producer_warps = own.instructions, own.busiest, warp_lines.warps
                b.smem_bytes_cta += own.smem_bytes
                b.global_bytes_cta += own.global_bytes
            b.dram_bytes = ours_dram_bytes(d, kind, ref)
            b.prepasses = {n: pre[d][n] for n in TAKES[kind]}
            out.append(b)
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


def upstream_producer(instrs: list[Instr]) -> tuple[int, int]:
    """Upstream's producer warp (its mainloop producer, one elected thread issuing the TMA loads):
    (the warp-instructions of its key loop, ``producer_loops``: one per key tile; the rest of the
    tile loop around it: once per query tile, the first key tile's loads included)."""
    (lo, hi), (a, b) = producer_loops(instrs)
    return hi - lo + 1, (b - a + 1) - (hi - lo + 1)


def upstream_dram_bytes(d: int, ref: Ref = REF) -> float:
    """Compulsory DRAM bytes per tile of upstream's kernel at ``ref``, as ``ours_dram_bytes``: K and V
    (codes and scales) over the query blocks, Q and the output over the key tiles, delta_s (fp32 per
    query block and key) every tile."""
    return 128 * d * 9 / 8 / ref.blocks + (128 * d * 9 // 16 + 128 * d * 2) / ref.blocks + 128 * 4


def upstream_prepass(d: int, ref: Ref = REF) -> dict[str, PerTile]:
    """Upstream's delta_s pre-pass (its api.py: torch.matmul(qm, kᵀ) in bf16, then .to(float32)):
    cuBLAS's and torch's kernels, whose instructions are not counted here; their compulsory DRAM
    bytes per tile: the bf16 product written and read back, the fp32 copy written, K (bf16) read
    once per head."""
    return {"delta_s": PerTile(None, 128 * (2 + 2 + 4) + 128 * d * 2 / ref.blocks,
                               "delta_s (upstream: torch.matmul + .to(float32)): instructions not counted "
                               "(cuBLAS and torch kernels), DRAM bytes only")}


def upstream_budgets(cubin: Path, ref: Ref = REF) -> list[Budget]:
    """Upstream's consumer loop: 8 MMA warps; its producer warp (a separate warpgroup) per key tile,
    a warp of its own (``producer_warps`` 1: the busiest warp is a consumer or it, not their sum)."""
    out = []
    funcs = disassemble(cubin)
    for name, instrs in sorted(funcs.items(), key=lambda kv: -(_upstream_head_dim(kv[0]) or 0)):
        d = _upstream_head_dim(name)
        if d is None:
            continue
        b = budget(instrs, label=f"upstream D{d}", head_dim=d, warps=8, tma_bytes=upstream_tma_bytes(d))
        per_stage, per_tile = upstream_producer(instrs)
        b.producer, b.producer_warps = per_stage + per_tile / ref.blocks, 1
        b.dram_bytes = upstream_dram_bytes(d, ref)
        b.prepasses = upstream_prepass(d, ref)
        out.append(b)
    return out


# Upstream's budget as counted from thu-ml/SageAttention d1a57a5 built here for sm_120a (flags of
# its setup.py, CUTLASS 4.2.0 headers): `python -m ci.checks.kernel_report --upstream CHECKOUT --cutlass
# INCLUDE` counts it again. Kept as data so that the report and the calibration need no checkout.
# "producer": upstream_producer's (per key tile, per query tile).
UPSTREAM_COMMIT = "d1a57a546c3d395b1ffcbeecc66d81db76f3b4b5"
UPSTREAM_STORED = {
    128: {"counts": {"omma": 64, "fp32": 360, "mufu": 82, "cvt": 36, "int": 181, "uniform": 48, "smem": 56,
                     "barrier": 6, "shfl": 12, "control": 5}, "smem_bytes": 22528, "producer": (102, 146)},
    64: {"counts": {"omma": 32, "fp32": 328, "mufu": 82, "cvt": 36, "int": 130, "uniform": 39, "smem": 32,
                    "barrier": 6, "shfl": 12, "control": 5}, "smem_bytes": 13312, "producer": (97, 137)},
}


def stored_upstream_budgets(ref: Ref = REF) -> list[Budget]:
    return [Budget(f"upstream D{d} ({UPSTREAM_COMMIT[:7]})", d, 8, counts=Counter(v["counts"]),
                   smem_bytes=v["smem_bytes"], tma_bytes=upstream_tma_bytes(d),
                   producer=v["producer"][0] + v["producer"][1] / ref.blocks, producer_warps=1,
                   dram_bytes=upstream_dram_bytes(d, ref),
                   prepasses=upstream_prepass(d, ref))
            for d, v in UPSTREAM_STORED.items()]


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
