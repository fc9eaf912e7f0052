"""A per-tile budget of an attention kernel from its sm_120a SASS, and the speed it implies.

No GPU is involved: the kernel is compiled (or read from a cubin), disassembled with nvdisasm
(line info kept), and the steady key-tile loop is found and counted. This module is the model;
the kernels it is counted for, this project's and upstream's, are in :mod:`ci.checks.sass_kernels`.

1. The key-tile loop is the innermost loop that holds block-scaled FP4 MMAs (OMMA): the shortest
   range of a backward branch with an OMMA in it. Ranges that hold an EXIT are branches back from
   out-of-line code (a wait's retry), not loops; the tile loop around the key loop, and iterations
   a compiler peeled off it (upstream's first and masked ones), are longer.
2. Each instruction of that range is put in one pipe (OMMA, FP32, MUFU, conversion, integer,
   uniform, shared/LDSM, global, TMA, barrier, shuffle, control, NOP). Instructions whose source
   line lies in a region that the steady state skips (thread 0's TMA issue, the tail/causal mask;
   the block-residual correction for the path without it) are set aside by a classifier that
   reads the line info, never by guessing at branches.
3. Bytes: shared memory read and written per warp from the SASS widths (LDS/STS/LDSM x 32
   lanes); L2 bytes per CTA = the tile's TMA bytes (from the kernel's layout) + global loads
   x warps (loads that every warp makes of the same bytes count once).
4. A bound per SM per tile, in clocks, is the largest of: issue (warp-instructions x warps / 4
   schedulers), tensor (OMMAs x warps x 4 clk: 16384 FLOP at 4096 FLOP/clk/SM), MUFU and
   conversions (16 lanes/clk/SM), shuffles (32 lanes/clk/SM), shared memory (128 B/clk/SM) and
   L2 (bytes / the L2 bandwidth per SM). The ceiling in TOPS is the tile's nominal attention
   FLOPs (4 x 128 x 128 x D) x SMs x clock / bound: one CTA per SM, every pipe overlapped
   perfectly, no latency, no tail effects. It is an upper bound; calibrate it with a measured
   kernel (`calibrate`).
"""

from __future__ import annotations

import re
import subprocess
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

NVDISASM_PIN = "nvidia-cuda-nvdisasm==13.2.86"

# Published per-SM rates (sources in docs/performance.md, "The SASS budget"). FP4 dense tensor
# rate = published dense FP4 TFLOPS / (SMs x boost clock): 4096 FLOP/clk/SM on all three.
@dataclass(frozen=True)
class Gpu:
    name: str
    sms: int
    clock_ghz: float          # boost clock
    fp4_dense_tflops: float   # published, dense (half the sparse figure)
    l2_bytes_per_clk_sm: float

    @property
    def fp4_flop_per_clk_sm(self) -> float:
        return self.fp4_dense_tflops * 1e12 / (self.sms * self.clock_ghz * 1e9)


# L2: 8.7 TB/s measured on an RTX PRO 6000 Blackwell (188 SMs, 2.617 GHz) = 17.7 B/clk/SM; the
# same per-SM figure is assumed for the other two (no published L2 bandwidth).
L2_B_PER_CLK_SM = 8.7e12 / (188 * 2.617e9)
GPUS = (
    Gpu("RTX 5090", 170, 2.407, 1676.0, L2_B_PER_CLK_SM),
    Gpu("RTX PRO 6000", 188, 2.617, 2000.0, L2_B_PER_CLK_SM),
    # GB10: no published GPU clock; the one at which 48 SMs give the published 500 dense FP4 TFLOPS
    # at 4096 FLOP/clk/SM
    Gpu("GB10 (DGX Spark)", 48, 2.543, 500.0, L2_B_PER_CLK_SM),
)
ISSUE_PER_CLK_SM = 4        # one warp-instruction per clock per scheduler, 4 schedulers
MUFU_LANES_PER_CLK = 16
CVT_LANES_PER_CLK = 16
SHFL_LANES_PER_CLK = 32
SMEM_B_PER_CLK = 128
OMMA_FLOP = 16 * 8 * 64 * 2

PIPES = ("omma", "fp32", "mufu", "cvt", "int", "uniform", "smem", "global", "tma", "barrier", "shfl", "control",
         "nop", "other")
_PIPE_OF = {
    "omma": {"OMMA", "HMMA", "QMMA", "IMMA", "UTCMMA"},
    "fp32": {"FFMA", "FMUL", "FADD", "FMNMX", "FSEL", "FSETP", "FSET", "FCHK", "FSWZADD", "FFMA2", "FMUL2", "FADD2",
             "HADD2", "HFMA2", "HMUL2", "HMNMX2", "HSETP2", "FMNMX3", "FADD32I", "FMUL32I", "FFMA32I"},
    "mufu": {"MUFU"},
    "cvt": {"F2F", "F2I", "I2F", "F2FP", "I2FP", "F2IP", "FRND", "I2I"},
    "int": {"IADD3", "IMAD", "LOP3", "SHF", "ISETP", "LEA", "SEL", "IABS", "VIMNMX", "IMNMX", "IADD", "PRMT", "POPC",
            "FLO", "BREV", "BMSK", "SGXT", "PLOP3", "P2R", "R2P", "IDP", "VIADD", "VIADDMNMX", "IMUL", "MOV", "CS2R",
            "S2R", "IMAD32I", "IADD32I", "LOP32I", "VABSDIFF", "VOTE", "LDC"},
    "smem": {"LDS", "STS", "LDSM", "STSM", "ATOMS"},
    "global": {"LDG", "STG", "LD", "ST", "RED", "ATOM", "ATOMG", "CCTL", "LDGSTS", "LDL", "STL"},
    "tma": {"UTMALDG", "UTMASTG", "UTMACCTL", "UTMAPF", "UBLKCP", "UTMAREDG"},
    "barrier": {"BAR", "SYNCS", "WARPSYNC", "MEMBAR", "FENCE", "DEPBAR", "ERRBAR", "ELECT", "ENDCOLLECTIVE", "ARRIVES"},
    "shfl": {"SHFL"},
    "control": {"BRA", "BSSY", "BSYNC", "CALL", "RET", "EXIT", "BREAK", "YIELD", "BMOV", "JMP", "LEPC", "JMX", "BRX",
                "WARPGROUP", "ACQBULK", "KILL"},
    "nop": {"NOP"},
}
_PIPE = {op: pipe for pipe, ops in _PIPE_OF.items() for op in ops}


def pipe_of(opcode: str) -> str:
    base = opcode.split(".")[0]
    if base in _PIPE:
        return _PIPE[base]
    if base.startswith("U") or base in ("R2UR", "S2UR", "LDCU", "REDUX"):
        return "uniform"
    return "other"


@dataclass(frozen=True)
class Instr:
    addr: int
    opcode: str          # with modifiers, without the predicate
    text: str
    frames: tuple[tuple[str, int], ...]  # (file, line), innermost first
    labels: tuple[str, ...] = ()         # labels nvdisasm puts on this instruction

    @property
    def pipe(self) -> str:
        return pipe_of(self.opcode)

    def smem_bytes(self) -> int:
        """Bytes a warp moves through shared memory with this instruction (0 if none)."""
        op = self.opcode
        if op.startswith("LDSM") or op.startswith("STSM"):
            n = 4 if ".4" in op.split("M88")[-1] else 2 if ".2" in op.split("M88")[-1] else 1
            return 128 * n
        if op.startswith(("LDS", "STS", "ATOMS")):
            return 32 * _width(op)
        return 0

    def global_bytes(self) -> int:
        if self.opcode.startswith(("LDG", "LD.", "LDL")) or self.opcode == "LD":
            return 32 * _width(self.opcode)
        return 0


def _width(op: str) -> int:
    m = re.search(r"\.(8|16|32|64|128)(?:\.|$)", op)
    if m:
        return int(m.group(1)) // 8
    if re.search(r"\.(U8|S8)\b", op):
        return 1
    if re.search(r"\.(U16|S16)\b", op):
        return 2
    return 4


def nvdisasm() -> Path:
    from ci.toolchain.tools import cuda_tool

    return cuda_tool("nvdisasm", NVDISASM_PIN)


_LINE = re.compile(r'//## File "([^"]+)", line (\d+)(.*)')
_INLINED = re.compile(r'inlined at "([^"]+)", line (\d+)')
_INSTR = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?);")


def disassemble(cubin: Path) -> dict[str, list[Instr]]:
    """Every function of a cubin (mangled name -> instructions in address order)."""
    out = subprocess.run([str(nvdisasm()), "-gi", "-c", str(cubin)], capture_output=True, text=True, check=True).stdout
    return parse_disassembly(out)


def parse_disassembly(text: str) -> dict[str, list[Instr]]:
    funcs: dict[str, list[Instr]] = {}
    cur: list[Instr] | None = None
    frames: tuple[tuple[str, int], ...] = ()
    labels: list[str] = []
    in_location = False
    for line in text.splitlines():
        m = re.match(r"\s*\.text\.(\S+):", line)
        if m:
            cur = funcs.setdefault(m.group(1), [])
            frames, labels = (), []
            continue
        m = re.match(r"\s*(\.L_x_\d+):", line)
        if m:
            labels.append(m.group(1))
            continue
        m = _LINE.search(line)
        if m:
            # consecutive //## lines are one location: the innermost first, then its callers
            here = ((m.group(1), int(m.group(2))), *((f, int(n)) for f, n in _INLINED.findall(m.group(3))))
            frames = (*frames, *(f for f in here if f not in frames)) if in_location else here
            in_location = True
            continue
        in_location = False
        m = _INSTR.search(line)
        if m and cur is not None:
            body = re.sub(r"^\{?\s*", "", m.group(2)).strip()
            parts = body.split()
            if parts and parts[0].startswith("@"):
                parts = parts[1:]
            if parts:
                cur.append(Instr(int(m.group(1), 16), parts[0], body, frames, tuple(labels)))
                labels = []
    return funcs


def _branch_target(ins: Instr) -> str | None:
    if not ins.opcode.startswith("BRA") or ".DIV" in ins.opcode:
        return None
    m = re.search(r"`\((\.L_x_\d+)\)", ins.text)
    return m.group(1) if m else None


def key_loop(instrs: list[Instr]) -> tuple[int, int]:
    """Index range [lo, hi] of the steady key-tile loop (see the module docstring, step 1)."""
    index = {label: i for i, ins in enumerate(instrs) for label in ins.labels}
    omma = [i for i, ins in enumerate(instrs) if ins.pipe == "omma"]
    best = None
    for i, ins in enumerate(instrs):
        t = _branch_target(ins)
        if t is None or t not in index or index[t] >= i:
            continue
        lo = index[t]
        # a branch back from an out-of-line stub (a wait's retry, a divergent path) placed after
        # the kernel's EXIT is no loop of the source
        if any(x.opcode in ("EXIT", "RET") or x.opcode.startswith(("EXIT.", "RET.")) for x in instrs[lo:i]):
            continue
        n = sum(lo <= j <= i for j in omma)
        if n and (best is None or i - lo < best[2] - best[1]):
            best = (n, lo, i)
    if best is None:
        raise ValueError("no loop with a block-scaled MMA in this function")
    return best[1], best[2]


# A classifier names the region an instruction belongs to (None: the steady path of every warp).
Classifier = Callable[[Instr], "str | None"]


@dataclass
class Budget:
    """Per warp per key tile, and per SM per tile (one CTA of `warps` warps per SM)."""
    label: str
    head_dim: int
    warps: int
    counts: Counter = field(default_factory=Counter)      # pipe -> warp-instructions
    set_aside: Counter = field(default_factory=Counter)   # region -> warp-instructions (not counted)
    smem_bytes: int = 0            # per warp
    global_bytes_warp: int = 0     # per warp, loads distinct per warp
    global_bytes_cta: int = 0      # per CTA, loads every warp makes of the same bytes
    tma_bytes: int = 0             # per CTA

    @property
    def instructions(self) -> int:
        return sum(self.counts.values())

    @property
    def l2_bytes(self) -> int:
        return self.tma_bytes + self.global_bytes_warp * self.warps + self.global_bytes_cta

    @property
    def tile_flop(self) -> int:
        return 4 * 128 * 128 * self.head_dim

    def bounds(self, gpu: Gpu) -> dict[str, float]:
        w, c = self.warps, self.counts
        return {
            "issue": self.instructions * w / ISSUE_PER_CLK_SM,
            "tensor": c["omma"] * w * OMMA_FLOP / gpu.fp4_flop_per_clk_sm,
            "mufu": c["mufu"] * w * 32 / MUFU_LANES_PER_CLK,
            "cvt": c["cvt"] * w * 32 / CVT_LANES_PER_CLK,
            "shfl": c["shfl"] * w * 32 / SHFL_LANES_PER_CLK,
            "smem": self.smem_bytes * w / SMEM_B_PER_CLK,
            "l2": self.l2_bytes / gpu.l2_bytes_per_clk_sm,
        }

    def bound(self, gpu: Gpu) -> tuple[str, float]:
        b = self.bounds(gpu)
        k = max(b, key=b.get)
        return k, b[k]

    def ceiling_tops(self, gpu: Gpu) -> float:
        return self.tile_flop * gpu.sms * gpu.clock_ghz * 1e9 / self.bound(gpu)[1] / 1e12


def budget(instrs: list[Instr], *, label: str, head_dim: int, warps: int, tma_bytes: int,
           classify: Classifier = lambda ins: None, cta_shared: Callable[[Instr], bool] = lambda ins: False) -> Budget:
    lo, hi = key_loop(instrs)
    b = Budget(label, head_dim, warps, tma_bytes=tma_bytes)
    for ins in instrs[lo:hi + 1]:
        region = classify(ins)
        if region is not None:
            b.set_aside[region] += 1
            continue
        b.counts[ins.pipe] += 1
        b.smem_bytes += ins.smem_bytes()
        if cta_shared(ins):
            b.global_bytes_cta += ins.global_bytes()
        else:
            b.global_bytes_warp += ins.global_bytes()
    return b


def calibrate(budget_: Budget, gpu: Gpu, measured_tops: float) -> float:
    """measured / predicted: the share of the model's ceiling a real kernel reaches."""
    return measured_tops / budget_.ceiling_tops(gpu)


# ---------------------------------------------------------------------------------------------
# Source regions by line: the line ranges of named blocks of a source file.

def block_lines(path: Path, start: str) -> tuple[int, int]:
    """1-based line range of the first block whose opening line matches the regex `start`,
    through its matching closing brace."""
    lines = path.read_text().splitlines()
    for i, line in enumerate(lines):
        if re.search(start, line):
            depth, seen = 0, False
            for j in range(i, len(lines)):
                depth += lines[j].count("{") - lines[j].count("}")
                seen = seen or "{" in lines[j]
                if seen and depth <= 0:
                    return i + 1, j + 1
            break
    raise ValueError(f"{path.name}: no block matching {start!r}")


def in_ranges(ins: Instr, file_suffix: str, ranges: list[tuple[int, int]]) -> bool:
    return any(f.endswith(file_suffix) and any(a <= n <= b for a, b in ranges) for f, n in ins.frames)


# ---------------------------------------------------------------------------------------------
# Printing

def table(budgets: list[Budget], gpus=GPUS, calibration: float | None = None) -> str:
    rows = [("per warp per key tile", *(b.label for b in budgets))]
    rows.append(("warp-instructions", *(f"{b.instructions:,}" for b in budgets)))
    for p in PIPES:
        if any(b.counts[p] for b in budgets):
            rows.append((f"  {p}", *(f"{b.counts[p]:,}" for b in budgets)))
    rows.append(("shared memory bytes / warp", *(f"{b.smem_bytes:,}" for b in budgets)))
    rows.append(("L2 bytes / CTA (TMA + loads)", *(f"{b.l2_bytes:,}" for b in budgets)))
    for g in gpus:
        rows.append((f"bound per SM per tile, {g.name}",
                     *(f"{b.bound(g)[1]:,.0f} clk ({b.bound(g)[0]})" for b in budgets)))
    for g in gpus:
        rows.append((f"ceiling, {g.name} ({g.sms} SMs, {g.clock_ghz} GHz)",
                     *(f"{b.ceiling_tops(g):,.0f} TOPS" for b in budgets)))
    if calibration is not None:
        for g in gpus:
            rows.append((f"x {calibration:.3f} (calibrated), {g.name}",
                         *(f"{b.ceiling_tops(g) * calibration:,.0f} TOPS" for b in budgets)))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    out = []
    for k, r in enumerate(rows):
        out.append("| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |")
        if k == 0:
            out.append("| " + " | ".join("-" * w for w in widths) + " |")
    return "\n".join(out)
