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
   x warps (loads that every warp makes of the same bytes count once; a producer of its own's
   loads, and its shared-memory stores, once per CTA, in each of its warps that makes them).
4. The producer (``Budget.producer``: its warp-instructions per key tile, all its warps; the
   work it does once per query tile amortized over the key tiles of the reference shape, `REF`).
   Inline (``producer_warps`` 0: the bounded mode's thread 0 of warp 0 issuing the TMA loads
   between its MMA work): its source lines, set aside from the consumer's count, are warp 0's
   extra work, and warp 0 is the busiest warp. On warps of its own (``producer_warps`` > 0: this
   project's producer warpgroup, upstream's producer warp): counted from its own key loop (the
   innermost loop issuing two TMA loads or more, :mod:`ci.checks.sass_kernels`); the busiest warp
   is the larger of a consumer warp and its busiest warp (``producer_warp``). Either way the SM
   issues the consumer warps + the producer per tile. Likewise the lines only the last consumer
   warp runs (the bounded mode's V exponent factors of each stage, by D/32 of its threads) count
   once per SM, not in every consumer warp.
5. Pre-passes (:mod:`ci.checks.sass_prepass`): kernels that run before the attention kernel on
   the same stream (delta_s per query block and key, the Q·Kᵀ precision rule, MXFP8), counted
   from their SASS per unit of their work and converted to warp-instructions and DRAM bytes per
   attention tile at `REF`.
6. A bound per SM per tile, in clocks: for the attention kernel the largest of issue (all its
   warp-instructions / 4 schedulers), tensor (OMMAs x warps x 4 clk: 16384 FLOP at 4096
   FLOP/clk/SM), MUFU and conversions (16 lanes/clk/SM), shuffles (32 lanes/clk/SM), shared memory
   (128 B/clk/SM), L2 (bytes / the L2 bandwidth per SM) and memory (the compulsory DRAM bytes per
   tile at `REF` / the DRAM bandwidth per SM); plus, for the pre-passes, the larger of their issue
   and memory time (separate kernels, stream-ordered before the attention kernel: their time adds,
   it does not hide under the attention kernel's tensor work). The ceiling in TOPS is the tile's
   nominal attention FLOPs (4 x 128 x 128 x D) x SMs x clock / bound: one CTA per SM, every pipe
   overlapped perfectly, no latency, no tail effects. It is an upper bound; calibrate it with a
   measured kernel (`calibrate`).
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
    dram_gb_s: float          # published memory bandwidth

    @property
    def fp4_flop_per_clk_sm(self) -> float:
        return self.fp4_dense_tflops * 1e12 / (self.sms * self.clock_ghz * 1e9)

    @property
    def dram_bytes_per_clk_sm(self) -> float:
        return self.dram_gb_s * 1e9 / (self.sms * self.clock_ghz * 1e9)


# L2: 8.7 TB/s measured on an RTX PRO 6000 Blackwell (188 SMs, 2.617 GHz) = 17.7 B/clk/SM; the
# same per-SM figure is assumed for the other two (no published L2 bandwidth). Memory bandwidth as
# published: RTX 5090 1,792 GB/s (GDDR7, NVIDIA's product page and RTX Blackwell whitepaper); RTX
# PRO 6000 Blackwell 1,792 GB/s (GDDR7 ECC, NVIDIA's product page); GB10 273 GB/s (LPDDR5x shared
# with the CPU, NVIDIA's DGX Spark page).
L2_B_PER_CLK_SM = 8.7e12 / (188 * 2.617e9)
GPUS = (
    Gpu("RTX 5090", 170, 2.407, 1676.0, L2_B_PER_CLK_SM, 1792.0),
    Gpu("RTX PRO 6000", 188, 2.617, 2000.0, L2_B_PER_CLK_SM, 1792.0),
    # GB10: no published GPU clock; the one at which 48 SMs give the published 500 dense FP4 TFLOPS
    # at 4096 FLOP/clk/SM
    Gpu("GB10 (DGX Spark)", 48, 2.543, 500.0, L2_B_PER_CLK_SM, 273.0),
)


@dataclass(frozen=True)
class Ref:
    """The reference shape of the amortized figures (the producer's once-per-query-tile work, the
    pre-passes, the compulsory DRAM bytes): ``tokens`` queries and keys, non-causal, one query
    head per kv head, batch 1: ``blocks`` query blocks and as many 128-key tiles per head."""
    tokens: int = 32768

    @property
    def blocks(self) -> int:
        return -(-self.tokens // 128)


REF = Ref()
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


def loops(instrs: list[Instr]) -> list[tuple[int, int]]:
    """Every loop of a function as an index range [lo, hi], in the order of their backward
    branches. A branch back from an out-of-line stub (a wait's retry, a divergent path) placed
    after the kernel's EXIT is no loop of the source: ranges that hold an EXIT or RET are left out."""
    index = {label: i for i, ins in enumerate(instrs) for label in ins.labels}
    out = []
    for i, ins in enumerate(instrs):
        t = _branch_target(ins)
        if t is None or t not in index or index[t] >= i:
            continue
        lo = index[t]
        if any(x.opcode in ("EXIT", "RET") or x.opcode.startswith(("EXIT.", "RET.")) for x in instrs[lo:i]):
            continue
        out.append((lo, i))
    return out


def innermost_loop(instrs: list[Instr], holds: Callable[[list[Instr]], bool], what: str) -> tuple[int, int]:
    """The shortest loop whose instructions satisfy ``holds`` (the first of equal length)."""
    best = None
    for lo, hi in loops(instrs):
        if holds(instrs[lo:hi + 1]) and (best is None or hi - lo < best[1] - best[0]):
            best = (lo, hi)
    if best is None:
        raise ValueError(f"no loop {what} in this function")
    return best


def key_loop(instrs: list[Instr]) -> tuple[int, int]:
    """Index range [lo, hi] of the steady key-tile loop (see the module docstring, step 1)."""
    return innermost_loop(instrs, lambda body: any(x.pipe == "omma" for x in body), "with a block-scaled MMA")


def end_of_body(instrs: list[Instr]) -> int:
    """Index of a function's last EXIT: what follows it is out-of-line code (retry stubs,
    divergent-path fallbacks, slow subroutines) that a steady run does not reach."""
    exits = [i for i, ins in enumerate(instrs) if ins.opcode == "EXIT" or ins.opcode.startswith("EXIT.")]
    return exits[-1] if exits else len(instrs) - 1


# A classifier names the region an instruction belongs to (None: the steady path of every warp).
Classifier = Callable[[Instr], "str | None"]


@dataclass(frozen=True)
class PerTile:
    """A pre-pass's cost per attention tile (one 128-key tile of one query block and head) at
    `REF`: warp-instructions (None: not counted, e.g. a library kernel) and compulsory DRAM bytes."""
    instructions: float | None
    dram_bytes: float
    note: str = ""


@dataclass
class Budget:
    """Per warp per key tile, and per SM per tile (one CTA of `warps` consumer warps per SM)."""
    label: str
    head_dim: int
    warps: int
    counts: Counter = field(default_factory=Counter)      # pipe -> warp-instructions
    set_aside: Counter = field(default_factory=Counter)   # region -> warp-instructions (not counted)
    smem_bytes: int = 0            # per warp
    smem_bytes_cta: int = 0        # per CTA, what not every consumer warp moves (the last warp's own lines, a producer's)
    global_bytes_warp: int = 0     # per warp, loads distinct per warp
    global_bytes_cta: int = 0      # per CTA, loads every warp makes of the same bytes, and a producer of its own's
    tma_bytes: int = 0             # per CTA
    producer: float | None = 0.0   # the producer's warp-instructions per key tile, all its warps (None: not counted)
    producer_warps: int = 0        # the warps of its own the producer runs on (0: inline, on warp 0)
    producer_warp: float = 0.0     # the busiest of those warps' own per key tile (0: producer / producer_warps)
    last_warp: float = 0.0         # what one consumer warp (not warp 0) alone runs per key tile, on top
    dram_bytes: float = 0.0        # the attention kernel's compulsory DRAM bytes per tile at REF
    prepasses: dict = field(default_factory=dict)          # name -> PerTile

    @property
    def instructions(self) -> int:
        return sum(self.counts.values())

    @property
    def producer_own(self) -> float:
        """The busiest producer warp's own warp-instructions per key tile (inline: the producer's)."""
        if self.producer_warps and self.producer_warp:
            return self.producer_warp
        return (self.producer or 0.0) / max(self.producer_warps, 1)

    @property
    def busiest_warp(self) -> float:
        """Inline producer: warp 0, a consumer warp plus the producer, or the last warp with its own
        share, if larger. A producer on warps of its own: the larger of a consumer warp (the last,
        with its own share) and the busiest producer warp."""
        if not self.producer_warps:
            return self.instructions + max(self.producer or 0.0, self.last_warp)
        return max(self.instructions + self.last_warp, self.producer_own)

    @property
    def sm_instructions(self) -> float:
        """The attention kernel's warp-instructions per SM per tile: every consumer warp, the
        producer (all its warps), and the last warp's share."""
        return self.instructions * self.warps + (self.producer or 0.0) + self.last_warp

    @property
    def pre_instructions(self) -> float:
        return sum(p.instructions or 0.0 for p in self.prepasses.values())

    @property
    def pre_dram_bytes(self) -> float:
        return sum(p.dram_bytes for p in self.prepasses.values())

    @property
    def l2_bytes(self) -> int:
        return self.tma_bytes + self.global_bytes_warp * self.warps + self.global_bytes_cta

    @property
    def tile_flop(self) -> int:
        return 4 * 128 * 128 * self.head_dim

    def issue_all(self) -> float:
        """Issue time per SM per tile of everything counted: all warps of the attention kernel and
        the pre-passes' warp-instructions, / 4 schedulers."""
        return (self.sm_instructions + self.pre_instructions) / ISSUE_PER_CLK_SM

    def bounds(self, gpu: Gpu) -> dict[str, float]:
        """The attention kernel's terms, clocks per SM per tile."""
        w, c = self.warps, self.counts
        return {
            "issue": self.sm_instructions / ISSUE_PER_CLK_SM,
            "tensor": c["omma"] * w * OMMA_FLOP / gpu.fp4_flop_per_clk_sm,
            "mufu": c["mufu"] * w * 32 / MUFU_LANES_PER_CLK,
            "cvt": c["cvt"] * w * 32 / CVT_LANES_PER_CLK,
            "shfl": c["shfl"] * w * 32 / SHFL_LANES_PER_CLK,
            "smem": (self.smem_bytes * w + self.smem_bytes_cta) / SMEM_B_PER_CLK,
            "l2": self.l2_bytes / gpu.l2_bytes_per_clk_sm,
            "memory": self.dram_bytes / gpu.dram_bytes_per_clk_sm,
        }

    def prepass_bounds(self, gpu: Gpu) -> dict[str, float]:
        """The pre-passes' terms (separate kernels before the attention kernel), clocks per SM per tile."""
        return {"issue": self.pre_instructions / ISSUE_PER_CLK_SM,
                "memory": self.pre_dram_bytes / gpu.dram_bytes_per_clk_sm}

    def bound_parts(self, gpu: Gpu) -> tuple[tuple[str, float], tuple[str, float] | None]:
        """(the attention kernel's binding term, clocks), (the pre-passes' binding term, clocks) or None."""
        b = self.bounds(gpu)
        k = max(b, key=b.get)
        if not self.prepasses:
            return (k, b[k]), None
        pb = self.prepass_bounds(gpu)
        pk = max(pb, key=pb.get)
        return (k, b[k]), (pk, pb[pk])

    def bound(self, gpu: Gpu) -> tuple[str, float]:
        """(what binds, clocks per SM per tile): the attention kernel's largest term plus the
        pre-passes' largest (their kernels run before it, stream-ordered: the times add)."""
        (k, clk), pre = self.bound_parts(gpu)
        if pre is None or pre[1] == 0:
            return k, clk
        return f"{k} + pre-passes' {pre[0]}", clk + pre[1]

    def ceiling_tops(self, gpu: Gpu) -> float:
        return self.tile_flop * gpu.sms * gpu.clock_ghz * 1e9 / self.bound(gpu)[1] / 1e12


def budget(instrs: list[Instr], *, label: str, head_dim: int, warps: int, tma_bytes: int,
           classify: Classifier = lambda ins: None, cta_shared: Callable[[Instr], bool] = lambda ins: False,
           once_per_cta: tuple[str, ...] = ()) -> Budget:
    """``once_per_cta``: set-aside regions that one consumer warp of the CTA runs (the last
    warp's own lines): their instructions are ``Budget.last_warp`` (counted once per SM) and their
    bytes count once per CTA."""
    lo, hi = key_loop(instrs)
    b = Budget(label, head_dim, warps, tma_bytes=tma_bytes)
    for ins in instrs[lo:hi + 1]:
        region = classify(ins)
        if region is not None:
            b.set_aside[region] += 1
            if region in once_per_cta:
                b.smem_bytes_cta += ins.smem_bytes()
                b.global_bytes_cta += ins.global_bytes()
            continue
        b.counts[ins.pipe] += 1
        b.smem_bytes += ins.smem_bytes()
        if cta_shared(ins):
            b.global_bytes_cta += ins.global_bytes()
        else:
            b.global_bytes_warp += ins.global_bytes()
    b.last_warp = sum(b.set_aside[r] for r in once_per_cta)
    return b


def calibrate(budget_: Budget, gpu: Gpu, measured_tops: float) -> float:
    """measured / predicted: the share of the model's ceiling a real kernel reaches."""
    return measured_tops / budget_.ceiling_tops(gpu)


# ---------------------------------------------------------------------------------------------
# Source regions by line: the line ranges of named blocks of a source file.

def block_lines(path: Path, start: str) -> tuple[int, int]:
    """1-based line range of the first block whose opening line matches the regex `start`,
    through its matching closing brace."""
    return blocks_lines(path, start)[0]


def blocks_lines(path: Path, start: str, within: tuple[int, int] | None = None) -> list[tuple[int, int]]:
    """1-based line ranges of every block whose opening line matches the regex `start` (and lies
    in the line range ``within``, when given), each through its matching closing brace."""
    lines = path.read_text().splitlines()
    lo, hi = within or (1, len(lines))
    out = []
    for i in range(lo - 1, hi):
        if re.search(start, lines[i]):
            depth, seen = 0, False
            for j in range(i, len(lines)):
                depth += lines[j].count("{") - lines[j].count("}")
                seen = seen or "{" in lines[j]
                if seen and depth <= 0:
                    out.append((i + 1, j + 1))
                    break
    if not out:
        raise ValueError(f"{path.name}: no block matching {start!r}")
    return out


def in_ranges(ins: Instr, file_suffix: str, ranges: list[tuple[int, int]]) -> bool:
    return any(f.endswith(file_suffix) and any(a <= n <= b for a, b in ranges) for f, n in ins.frames)
