"""The attention's pre-passes in the per-tile budget (:mod:`ci.checks.sass_budget`): kernels that
run before the attention kernel on the same stream, counted from their sm_120a SASS per unit of
their work and converted to warp-instructions and compulsory DRAM bytes per attention tile (one
128-key tile of one query block and head) at the reference shape (``REF``: 32k tokens, non-causal,
one query head per kv head).

- delta_s (``delta_s_blocks_kernel<D>``, ``attn/delta_s_blocks.cuh``, built in
  ``attn/attn_launch.cu``): per-block Q means with a workspace (the defaults; the FP8 heads too).
  A CTA (``kDeltaThreads<D>``: 2 warps at D 64, 4 at D 128) owns 128 keys of one head for
  ``kDeltaMGroup`` query blocks, ``kDeltaKeys`` keys per thread; its loop over the query blocks
  does ``kMUnroll`` of them an iteration (a second loop the rows left over one at a time), within
  a loop over chunks of ``kDeltaRRows`` rows of r, which it stages in shared memory.
- rule (``qk_rule_kernel<bf16, D>``, ``preprocess/qk_rule.cu``): with qk_precision 'auto' (the
  default) or 'fp8', wherever the FP8 path can run (D 64/128, the delta_s workspace holds a row).
  One CTA of ``2 * kPairs`` warps per ``kPairs`` row groups (16 sampled query rows each: one per
  sampled 128-row Q block at the long calls' stride ``kStride``), head and estimate; its loop goes
  over the sampled keys ``kChunk`` at a time. The defaults make ``RULE_ESTIMATES`` estimates in its
  one launch: Q·Kᵀ's and P's (pv_precision 'auto'). Every warp's loop body is counted whole: it
  holds the exact scores' MMAs, the FP4 ones and P's quantization, of which each warp runs its
  kind's (an overcount).
- MXFP8 (``mxfp8_rotated_kernel<bf16, D>``, ``quant/quant_mxfp8.cu``): the FP8 heads' Q and K
  rows (at D 64 their bf16 rows instead: the 16-bit Q·Kᵀ, the same loop with a bf16 store), rotated (FP8 Q·Kᵀ always multiplies rotated rows; without qk_rotation the kernel also
  rotates the means), a lane per 16 values; one iteration of its grid-stride loop (8 warps)
  quantizes 8 x 512 / D rows. The loop without the balance exponents is counted (qk_balance is
  off by default).
- MXFP8 V (``quant_mxfp8_cols_kernel<bf16>``, ``quant/quant_mxfp8_cols.cu``): for the kv heads
  that take FP8 P·V (the rule's, or every head with pv_precision 'fp8'), V along the sequence; a
  CTA per 128 keys x 64 channels, no loop (counted whole). For the other heads of an "auto" call its
  CTAs read one byte and exit: not counted. With the rule its tiles run in the MXFP8 launch
  (``mxfp8_rotated_kernel<bf16, D, true>``: the same tile code behind a 64-bit tile index, about
  100 instructions a CTA more, not counted here); the separate kernel is the one counted.

Counting: the main loop's instructions per iteration and any other named loop's, each times its
trip count (a named loop that holds others: its own instructions, those of the named loops directly
inside it left to them), plus the rest of the function up to its last EXIT once per CTA (loops in
that rest once); out-of-line code after the last EXIT (retry stubs, slow 64-bit divisions) is not
counted.
"""

from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ci.checks.sass_budget import REF, Instr, PerTile, Ref, disassemble, end_of_body, innermost_loop
from ci.toolchain.flags import device_flags

CSRC = Path(__file__).resolve().parents[2] / "sageattn3" / "csrc"
WARPS = 8  # 256 threads per CTA: the MXFP8 pre-passes (PrePass.warps; the rule's and delta_s's are their own)


def constant(path: Path, name: str) -> int:
    """The value of ``constexpr int name = N;`` in ``path``."""
    m = re.search(rf"constexpr int {name} = (\d+);", path.read_text())
    if not m:
        raise ValueError(f"{path.name}: no constexpr int {name}")
    return int(m.group(1))


def _line(path: Path, pattern: str) -> int:
    for i, line in enumerate(path.read_text().splitlines(), 1):
        if re.search(pattern, line):
            return i
    raise ValueError(f"{path.name}: no line matching {pattern!r}")


@dataclass(frozen=True)
class Loop:
    marker: str               # regex of a source line the loop holds
    without: str | None = None  # regex of a line it must not hold (another copy of the same loop)


@dataclass(frozen=True)
class PrePass:
    name: str
    source: str               # the .cu under csrc whose cubin holds the kernel
    lines: str                # the file under csrc the loop markers are lines of
    kernel: str               # regex of the mangled name; {d}: the head dim
    loops: tuple[Loop, ...]   # the counted loops, the main one first
    unit: str                 # what one iteration of the main loop does
    # per attention tile at a shape: (CTAs, i.e. runs of the code outside the loops), then each
    # loop's iterations (each run by every warp of the CTA); and the compulsory DRAM bytes
    per_tile: Callable[[int, Ref], tuple[float, ...]]
    dram: Callable[[int, Ref], float]
    rest_note: str = ""
    warps: int | Callable[[int], int] = WARPS  # warps per CTA (or per head dim)

    def warps_of(self, d: int) -> int:
        return self.warps(d) if callable(self.warps) else self.warps


def _delta_s_threads(d: int) -> int:
    """Threads per CTA of delta_s_blocks_kernel<d> (kDeltaThreads): kDeltaKeys keys each, both halves
    of a key's row up to kDeltaFullRowD, one half above."""
    path = CSRC / "attn" / "delta_s_blocks.cuh"
    halves = 2 if d <= constant(path, "kDeltaFullRowD") else 1
    return 128 // constant(path, "kDeltaKeys") * 2 // halves


def _delta_s_per_tile(d: int, ref: Ref) -> tuple[float, ...]:
    path = CSRC / "attn" / "delta_s_blocks.cuh"
    group = min(constant(path, "kDeltaMGroup"), ref.blocks)
    unroll, r_rows = constant(path, "kMUnroll"), constant(path, "kDeltaRRows")
    chunks = [min(r_rows, group - c) for c in range(0, group, r_rows)]
    steps = sum(rows // unroll for rows in chunks)
    singles = sum(rows % unroll for rows in chunks)  # a chunk's rows left over go one at a time
    return 1 / group, steps / group, singles / group, len(chunks) / group


def _delta_s_dram(d: int, ref: Ref) -> float:
    # delta_s written (fp32 per query block and key); K's codes, scales and residual (float16),
    # ds_key of the key tile and mean_q of the query block read once per head
    return 128 * 4 + (128 * (d // 2 + d // 16 + 2 * d) + 128 * 4) / ref.blocks + d * 4 / ref.blocks


def _rule_shape(ref: Ref) -> tuple[int, int, int, int, int]:
    path = CSRC / "preprocess" / "qk_rule.cu"
    sampled = min(constant(path, "kSampled"), ref.blocks)
    return (sampled, constant(path, "kRows"), constant(path, "kChunk"), constant(path, "kPairs"),
            constant(path, "kStride"))


RULE_ESTIMATES = 2  # Q·Kᵀ's and P's, one launch: blockIdx.z (csrc/preprocess/qk_rule.cu, kPv)


def _rule_per_tile(d: int, ref: Ref) -> tuple[float, ...]:
    sampled, rows, chunk, pairs, stride = _rule_shape(ref)
    ctas = sampled * (128 // stride // rows) / pairs  # per head and estimate
    tiles = ref.blocks * ref.blocks / RULE_ESTIMATES  # per head, per estimate
    return ctas / tiles, ctas * sampled * 128 / chunk / tiles


def _rule_dram(d: int, ref: Ref) -> float:
    # the sampled rows, each read from DRAM once: Q (bf16, packed FP4 + scales) and K, V (bf16) + K
    # packed; P's blocks read the same bf16 rows in the same launch (no FP4 codes: nothing more)
    sampled, rows, *_ = _rule_shape(ref)
    fp4_row = d // 2 + d // 16
    once = sampled * rows * (2 * d + fp4_row) + sampled * 128 * (4 * d + fp4_row)
    return once / (ref.blocks * ref.blocks)


def _mxfp8_rows(ref: Ref) -> float:
    """Rows quantized per attention tile: the query block's 128 Q rows over its key tiles, the key
    tile's 128 K rows over the query blocks."""
    return 128 / ref.blocks + 128 / ref.blocks


def _mxfp8_per_tile(d: int, ref: Ref) -> tuple[float, ...]:
    return 0.0, _mxfp8_rows(ref) * (d // 16) / (WARPS * 32)


def _mxfp8_dram(d: int, ref: Ref) -> float:
    # a row read (bf16) and written (E4M3 + one scale per 32; at D 64 the 16-bit Q·Kᵀ's bf16 row,
    # no scales); the mean row per 128 rows
    written = 2 * d if d == 64 else d + d // 32
    return _mxfp8_rows(ref) * (2 * d + written + d * 4 / 128)


def _v_mxfp8_per_tile(d: int, ref: Ref) -> tuple[float, ...]:
    # a CTA quantizes 128 keys x 64 channels of V once per head: a key tile over the query blocks
    return (d / 64 / ref.blocks,)


def _v_mxfp8_dram(d: int, ref: Ref) -> float:
    # the key tile's V read (bf16) and written (E4M3 + one scale per 32 keys) once per head
    return 128 * (2 * d + d + d / 32) / ref.blocks


PREPASSES = {
    "delta_s": PrePass(
        "delta_s", "attn/attn_launch.cu", "attn/delta_s_blocks.cuh", r"delta_s_blocks_kernelILi{d}ELb1E",
        (Loop(r"for \(; m \+ kMUnroll <= rows; m \+= kMUnroll\) delta_s_rows"), Loop(r"for \(; m < rows; \+\+m\) delta_s_rows"),
         Loop(r"__syncthreads\(\);  // every thread is done with the previous rows")),
        "loop over query blocks (kMUnroll query blocks x 128 keys)", _delta_s_per_tile, _delta_s_dram,
        warps=lambda d: _delta_s_threads(d) // 32),
    "rule": PrePass(
        "rule", "preprocess/qk_rule.cu", "preprocess/qk_rule.cu", r"qk_rule_kernelINS_6bf16_tELi{d}E",
        (Loop(r"else chunk_scores<T, 3, D>\(sm16 \+ L::kK, tiles, s, lane\);"),),
        "key loop (kChunk sampled keys x kPairs row groups)", _rule_per_tile, _rule_dram,
        warps=2 * constant(CSRC / "preprocess" / "qk_rule.cu", "kPairs")),
    "MXFP8": PrePass(
        "MXFP8", "quant/quant_mxfp8.cu", "quant/quant_mxfp8.cu", r"mxfp8_rotated_kernelINS_6bf16_tELi{d}ELb0E",
        (Loop(r"e4m3_codes16\(v, inv\);", without=r"ldexpf\(1\.f, a\.balance_sign"),),
        "grid-stride loop (256 lanes x 16 values)", _mxfp8_per_tile, _mxfp8_dram,
        rest_note="the code outside its loop, once per CTA, not counted (its CTAs per head follow the SM "
                  "count and the number of heads: about 1 warp-instruction per tile)"),
    # the FP8 P·V heads (the rule's, or every head with pv_precision "fp8"): V along the sequence, bf16
    # (the fp16 copy is the same code)
    "MXFP8 V": PrePass(
        "MXFP8 V", "quant/quant_mxfp8_cols.cu", "quant/quant_mxfp8_cols.cu", r"quant_mxfp8_cols_kernelINS_6bf16_tEEEv",
        (), "CTA (128 keys x 64 channels, no loop)", _v_mxfp8_per_tile, _v_mxfp8_dram),
}


def _holds(path_suffix: str, line: int) -> Callable[[list[Instr]], bool]:
    return lambda body: any(f.endswith(path_suffix) and n == line for ins in body for f, n in ins.frames)


def _inside(inner: tuple[int, int], outer: tuple[int, int]) -> bool:
    return inner != outer and outer[0] <= inner[0] and inner[1] <= outer[1]


def _children(ranges: list[tuple[int, int]], outer: tuple[int, int]) -> list[tuple[int, int]]:
    """The ranges directly inside ``outer``: inside it and inside no other range that is."""
    inner = [r for r in ranges if _inside(r, outer)]
    return [r for r in inner if not any(_inside(r, o) for o in inner)]


def count(pre: PrePass, instrs: list[Instr], d: int, ref: Ref = REF, root: Path = CSRC) -> PerTile:
    """The pre-pass ``pre`` of head dim ``d`` from its function's instructions, per attention tile:
    its warps x (the rest x CTAs per tile + each loop's own body x its iterations per tile; the
    named loops directly inside a named loop are theirs). ``root``: where ``pre.lines`` lies (csrc)."""
    path = root / pre.lines
    ranges = []
    for loop in pre.loops:
        has = _holds(pre.lines, _line(path, loop.marker))
        hasnt = _holds(pre.lines, _line(path, loop.without)) if loop.without else (lambda body: False)
        ranges.append(innermost_loop(instrs, lambda body: has(body) and not hasnt(body), f"holding {loop.marker!r}"))
    end = end_of_body(instrs)
    rest = sum(1 for i in range(end + 1) if not any(lo <= i <= hi for lo, hi in ranges))
    if len(set(ranges)) != len(ranges):
        raise ValueError(f"{pre.name}: two loop markers name the same loop ({ranges})")
    bodies = [hi - lo + 1 - sum(h - l + 1 for l, h in _children(ranges, (lo, hi))) for lo, hi in ranges]
    ctas, *iters = pre.per_tile(d, ref)
    warps = pre.warps_of(d)
    total = warps * (rest * ctas + sum(b * n for b, n in zip(bodies, iters)))
    parts = [f"{bodies[0]:,} warp-instructions per warp per iteration of its {pre.unit}, "
             f"x {iters[0] * warps:.4g} warp-iterations per tile"] if bodies else []
    parts += [f"another loop's {b:,} x {n * warps:.4g}" for b, n in zip(bodies[1:], iters[1:])]
    what = "the rest of the kernel" if bodies else f"the whole kernel (one {pre.unit})"
    parts.append(pre.rest_note or f"{what}, {rest:,} per warp once per CTA, x {ctas * warps:.4g}")
    note = f"{pre.name} ({pre.source}): " + "; ".join(parts) + f" = {total:,.0f} per tile"
    return PerTile(total, pre.dram(d, ref), note)


def kernel_of(funcs: dict[str, list[Instr]], pre: PrePass, d: int) -> list[Instr]:
    pattern = pre.kernel.format(d=d)
    found = [instrs for name, instrs in funcs.items() if re.search(pattern, name)]
    if len(found) != 1:
        raise ValueError(f"{len(found)} functions match {pattern!r}, not one")
    return found[0]


def prepass_costs(cubins: dict[str, Path], d: int, ref: Ref = REF) -> dict[str, PerTile]:
    """Every pre-pass of head dim ``d`` from ``cubins`` (source under csrc -> its sm_120a cubin)."""
    funcs = {src: disassemble(path) for src, path in cubins.items()}
    return {name: count(pre, kernel_of(funcs[pre.source], pre, d), d, ref) for name, pre in PREPASSES.items()}


def compile_prepasses(nvcc: Path, out_dir: Path, cuda: str | None = None) -> dict[str, Path]:
    """The pre-passes' sources (but attn_launch.cu, which ci.checks.sass_kernels.compile_ours builds)
    for sm_120a with line info: source under csrc -> cubin."""
    out = {}
    for src in sorted({p.source for p in PREPASSES.values()} - {"attn/attn_launch.cu"}):
        cubin = out_dir / (src.replace("/", "_").removesuffix(".cu") + "_sm_120a.cubin")
        subprocess.run([str(nvcc), "-cubin", str(CSRC / src), "-o", str(cubin), "-gencode=arch=compute_120a,code=sm_120a",
                        *device_flags(False, cuda), "-lineinfo", f"-I{CSRC}"], check=True, capture_output=True, text=True)
        out[src] = cubin
    return out
