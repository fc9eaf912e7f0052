"""The whole per-tile budget (ci.checks.sass_budget, ci.checks.sass_prepass, ci.checks.sass_kernels)
on listings and numbers written out here, no tools needed:

- the producer's share of a key tile (its per-stage work, its per-query-tile work over the key
  tiles): inline, on warp 0 and in the SM's issue; on warps of its own (the producer warpgroup,
  upstream's producer warp), counted from its own loops per warp that issues each line, in the
  SM's issue and not on top of a consumer warp;
- a pre-pass counted from its SASS (main loop x iterations, another loop, the rest once per CTA,
  nothing after the last EXIT) and converted per attention tile; its time added to the attention
  kernel's bound, not hidden under it;
- the memory term: compulsory DRAM bytes over each GPU's bandwidth, binding when the bytes are large;
- the kernel report's exit status rests on the compile test's spill allowance."""

from __future__ import annotations

import dataclasses

from collections import Counter

import pytest

from ci.checks import sass_budget as sb
from ci.checks import sass_kernels as sk
from ci.checks import sass_prepass as sp
from ci.checks.kernel_report import Kernel, spill_failures
from ci.checks.kernel_report.budget_table import table

# A key loop with 4 consumer instructions (one OMMA), 3 of the producer's per-stage lines
# (k.cuh 30) and 2 of its per-query-tile lines (k.cuh 40).
KEY_LOOP = """\
.text._Z6kernelv:
        /*0000*/                   S2R R0, SR_TID.X ;
.L_x_0:
	//## File "/src/k.cuh", line 10
        /*0010*/                   OMMA.SF.16864.F32.E2M1.E2M1.UE4M3.4X R8, R4, R6, R8, R1, R2, URZ ;
        /*0020*/                   FFMA R9, R9, R9, R9 ;
	//## File "/src/k.cuh", line 30
        /*0030*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR4], R3 ;
        /*0040*/                   SYNCS.ARRIVE.TRANS64 RZ, [UR4], R6 ;
        /*0050*/                   UTMALDG.2D [UR8], [UR4] ;
	//## File "/src/k.cuh", line 40
        /*0060*/                   IMAD R3, R3, R3, RZ ;
        /*0070*/                   UTMALDG.2D [UR8], [UR6] ;
	//## File "/src/k.cuh", line 10
        /*0080*/                   MUFU.EX2 R9, R9 ;
        /*0090*/               @P1 BRA `(.L_x_0) ;
        /*00a0*/                   EXIT ;
"""


def _producer_classifier(ins: sb.Instr) -> str | None:
    lines = {n for f, n in ins.frames if f.endswith("k.cuh")}
    return sk.PRODUCER_TILE if 40 in lines else sk.PRODUCER_STAGE if 30 in lines else None


def test_the_producer_is_warp_0s_and_the_sms():
    instrs = sb.parse_disassembly(KEY_LOOP)["_Z6kernelv"]
    b = sb.budget(instrs, label="t", head_dim=128, warps=8, tma_bytes=0, classify=_producer_classifier)
    assert b.instructions == 4 and b.counts["omma"] == 1  # the consumer: OMMA FFMA MUFU BRA
    assert b.set_aside == {sk.PRODUCER_STAGE: 3, sk.PRODUCER_TILE: 2}
    b.producer = sk.producer_share(b, sb.Ref(tokens=4 * 128))  # 4 key tiles per query tile
    assert b.producer == 3 + 2 / 4
    assert b.busiest_warp == 4 + 3.5
    assert b.sm_instructions == 8 * 4 + 3.5
    # the issue bound counts the producer: without it, 8 x 4 / 4 = 8 clk
    assert b.bounds(sb.GPUS[0])["issue"] == pytest.approx((8 * 4 + 3.5) / 4) != 8
    assert b.issue_all() == pytest.approx((8 * 4 + 3.5) / 4)


def test_the_last_warps_own_lines_count_once_per_sm():
    """Lines only one consumer warp runs (V's exponent factors, by the last warp's D/32 threads)
    count once per SM, like the producer, and make that warp the busiest where they outweigh it."""
    instrs = sb.parse_disassembly(KEY_LOOP)["_Z6kernelv"]
    classify = lambda ins: sk.LAST_WARP if 30 in {n for f, n in ins.frames if f.endswith("k.cuh")} else None  # noqa: E731
    b = sb.budget(instrs, label="t", head_dim=128, warps=8, tma_bytes=0, classify=classify, once_per_cta=(sk.LAST_WARP,))
    assert b.instructions == 6 and b.set_aside == {sk.LAST_WARP: 3} and b.last_warp == 3
    assert sb.budget(instrs, label="t", head_dim=128, warps=8, tma_bytes=0, classify=classify).last_warp == 0
    b.producer = 2.0
    assert b.sm_instructions == 8 * 6 + 2 + 3 and b.busiest_warp == 6 + 3
    assert b.bounds(sb.GPUS[0])["issue"] == pytest.approx((8 * 6 + 2 + 3) / 4)
    row = next(r for r in table([b]).splitlines() if r.startswith("| last warp's own"))
    assert "| 3 " in row


# A producer warpgroup (lines of PRODUCER_SOURCE): its tile loop (0x10-0x110) around its key loop
# (0x50-0x100). The key loop: 6 lines every warp runs, 3 of the leader's (warp 0), 2 of the delta_s
# vector's (warps 0 and 1), 1 of V's exponents' (warp 3); the rest of the tile loop: 4 every warp
# runs (the leader block's reconvergence, BSYNC, included), 1 of the leader's (a tile's Q).
PRODUCER_SOURCE = """\
// the producer warpgroup
void producer_warpgroup(int tid) {
  const bool leader = tid == 0;
  for (int tile = 0; tile < n; ++tile) {
    if (leader) {
      load_q();
    }
    for (int kb = 0; kb < m; ++kb) {
      wait_empty();
      if (leader) {
        load_k();
        load_v();
      }
      if (tid < kBlockN / 2) {
        store_delta();
      }
      if (tid >= kProducerThreads - kVGroups) {
        store_v_exponents();
      }
      mbar_arrive(&full[st]);
    }
  }
}
"""
_AT = '\t//## File "/src/attn/attn_fwd_kernel.cuh", line {}\n'
PRODUCER_LOOPS = f"""\
.text._Z2wsv:
        /*0000*/                   S2R R0, SR_TID.X ;
.L_x_0:
{_AT.format(4)}        /*0010*/                   IMAD R1, R1, R1, RZ ;
{_AT.format(5)}        /*0020*/               @P0 BRA `(.L_x_2) ;
{_AT.format(6)}        /*0030*/                   UTMALDG.2D [UR8], [UR4] ;
.L_x_2:
        /*0040*/                   BSYNC B0 ;
.L_x_1:
{_AT.format(9)}        /*0050*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR4], R3 ;
{_AT.format(10)}        /*0060*/               @P0 BRA `(.L_x_3) ;
{_AT.format(11)}        /*0070*/                   SYNCS.ARRIVE.TRANS64 RZ, [UR4], R6 ;
        /*0080*/                   UTMALDG.2D [UR8], [UR4] ;
{_AT.format(12)}        /*0090*/                   UTMALDG.2D [UR8], [UR6] ;
.L_x_3:
{_AT.format(14)}        /*00a0*/               @P1 BRA `(.L_x_4) ;
{_AT.format(15)}        /*00b0*/                   LDG.E.64 R4, desc[UR4][R2.64] ;
        /*00c0*/                   STS.128 [R5], R4 ;
.L_x_4:
{_AT.format(17)}        /*00d0*/               @P2 BRA `(.L_x_5) ;
{_AT.format(18)}        /*00e0*/                   STS [R5], R4 ;
.L_x_5:
{_AT.format(20)}        /*00f0*/                   SYNCS.ARRIVE.TRANS64.A1T0 RZ, [UR4], RZ ;
{_AT.format(8)}        /*0100*/               @P3 BRA `(.L_x_1) ;
{_AT.format(4)}        /*0110*/               @P4 BRA `(.L_x_0) ;
        /*0120*/                   EXIT ;
"""


# D 64's reads before the stage's wait: a one-statement test that ptxas predicates instead of
# branching over it (on the wait's line here, so that no line moves)
PREDICATED_SOURCE = PRODUCER_SOURCE.replace("      wait_empty();\n",
                                            "      if (tid < kBlockN / 2) d = ldg_delta(); wait_empty();\n")
PREDICATED_LOOPS = PRODUCER_LOOPS.replace(
    f"{_AT.format(9)}        /*0050*/",
    f"{_AT.format(9)}        /*0048*/               @!P5 LDG.E.64 R8, desc[UR4][R2.64] ;\n{_AT.format(9)}        /*0050*/")


def _producer_lines(d, source):
    d.mkdir()
    (d / "attn_fwd_kernel.cuh").write_text(source)
    (d / "attn_params.h").write_text("constexpr int kBlockN = 128;\nconstexpr int kProducerThreads = 128;\n")
    return sk.producer_warp_lines(d / "attn_fwd_kernel.cuh")


def test_a_predicated_read_counts_in_every_warp_and_its_bytes_in_its_own(tmp_path):
    lines = _producer_lines(tmp_path / "predicated", PREDICATED_SOURCE)
    assert lines.predicated == (([(9, 9)], frozenset({0, 1})),)
    assert lines.blocks == _producer_lines(tmp_path / "braced", PRODUCER_SOURCE).blocks
    ref = sb.Ref(tokens=4 * 128)
    base = sk.ws_producer(sb.parse_disassembly(PRODUCER_LOOPS)["_Z2wsv"], _producer_lines(tmp_path / "plain", PRODUCER_SOURCE), ref)
    instrs = sb.parse_disassembly(PREDICATED_LOOPS)["_Z2wsv"]
    counted = sk.ws_producer(instrs, lines, ref)
    # every warp issues the LDG (predicated off in warps 2 and 3); warps 0 and 1 read 32 x 8 bytes each
    assert counted.instructions == base.instructions + 4 and counted.busiest == base.busiest + 1
    assert counted.global_bytes == base.global_bytes + 2 * 32 * 8
    # without the one-statement test known, all four warps would be taken to read
    assert sk.ws_producer(instrs, lines._replace(predicated=()), ref).global_bytes == base.global_bytes + 4 * 32 * 8


def test_a_producer_of_its_own_counts_per_warp_and_not_on_a_consumer_warp(tmp_path):
    lines = _producer_lines(tmp_path / "src", PRODUCER_SOURCE)
    assert lines.warps == 4 and lines.arrive == 20
    assert lines.blocks == [([(6, 7), (11, 13)], {0}), ([(15, 16)], {0, 1}), ([(18, 19)], {3})]
    assert lines.predicated == ()
    instrs = sb.parse_disassembly(PRODUCER_LOOPS)["_Z2wsv"]
    ref = sb.Ref(tokens=4 * 128)  # 4 key tiles per query tile
    # per warp: key loop 11, 8, 6, 7; the rest of the tile loop 5, 4, 4, 4 over the 4 key tiles
    counted = sk.ws_producer(instrs, lines, ref)
    total, own = counted.instructions, counted.busiest
    assert (total, own) == (11 + 8 + 6 + 7 + 17 / 4, 11 + 5 / 4)
    # its bytes per stage: the delta_s rows (8-byte loads, 16-byte stores) in warps 0 and 1, V's exponents' store in warp 3
    assert counted.global_bytes == 2 * 32 * 8 and counted.smem_bytes == 2 * 32 * 16 + 32 * 4
    # not 4 x every line: the leader's lines once, the delta_s vector's twice, V's exponents' once
    assert total < 4 * (12 + 5 / 4)
    # two stages an iteration (ptxas unrolled the loop): each stage half the loop
    two = PRODUCER_LOOPS.replace("SYNCS.ARRIVE.TRANS64.A1T0 RZ, [UR4], RZ ;", "SYNCS.ARRIVE.TRANS64.A1T0 RZ, [UR4], RZ ;\n"
                                 "        /*00f8*/                   SYNCS.ARRIVE.TRANS64.A1T0 RZ, [UR6], RZ ;")
    assert sk.ws_producer(sb.parse_disassembly(two)["_Z2wsv"], lines, ref) == ((12 + 9 + 7 + 8) / 2 + 17 / 4, 12 / 2 + 5 / 4,
                                                                             (2 * 32 * 16 + 32 * 4) / 2, 2 * 32 * 8 / 2)

    # the busiest warp: a consumer warp (164 warp-instructions), not a consumer warp + the producer;
    # the SM issues all 8 consumer warps and all the producer's warps
    gpu = sb.GPUS[0]
    b = _tensor_bound_budget(producer=total, producer_warps=4, producer_warp=own)
    assert b.producer_own == own and b.busiest_warp == 164
    assert b.sm_instructions == 8 * 164 + total
    assert b.bounds(gpu)["issue"] == pytest.approx((8 * 164 + total) / 4) and b.issue_all() == b.bounds(gpu)["issue"]
    # a producer warp busier than the consumer warps (10 each, the last 12 with its own share of 2) is the busiest
    small = dict(counts=Counter({"omma": 1, "fp32": 9}), producer=total, producer_warps=4, producer_warp=own)
    assert sb.Budget("t", 128, 8, **small).busiest_warp == own
    assert sb.Budget("t", 128, 8, last_warp=2, **small).busiest_warp == own
    assert sb.Budget("t", 128, 8, last_warp=4, **small).busiest_warp == 14
    # no busiest warp given: an even split of the producer
    assert sb.Budget("t", 128, 8, counts=Counter({"fp32": 5}), producer=36.0, producer_warps=4).busiest_warp == 9
    # inline (producer_warps 0, the bounded mode): warp 0 runs a consumer's work and the producer's
    inline = sb.Budget("t", 128, 8, counts=Counter({"omma": 1, "fp32": 9}), producer=total)
    assert inline.busiest_warp == 10 + total and inline.sm_instructions == 8 * 10 + total
    rows = table([b, sb.Budget("t", 128, 8, **small), inline]).splitlines()
    busiest = next(r for r in rows if r.startswith("| busiest warp"))
    assert "164 (a consumer warp)" in busiest and "12 (a producer warp)" in busiest
    assert f"{10 + total:,.0f} (warp 0: consumer + producer)" in busiest
    producer = next(r for r in rows if r.startswith("| producer"))
    assert f"{total:,.0f} (4 warps, the busiest 12)" in producer and f"{total:,.0f} (inline, warp 0)" in producer


# A pre-pass: 2 instructions before its loops, a main loop of 3 (source line 3), a second loop of
# 3 (line 5), the EXIT, then an out-of-line stub after it (not counted).
PREPASS = """\
.text._Z3prev:
	//## File "/src/pre.cu", line 1
        /*0000*/                   S2R R0, SR_TID.X ;
        /*0010*/                   MOV R1, RZ ;
.L_x_0:
	//## File "/src/pre.cu", line 3
        /*0020*/                   FFMA R2, R2, R2, R2 ;
        /*0030*/                   FFMA R2, R2, R2, R2 ;
        /*0040*/               @P0 BRA `(.L_x_0) ;
.L_x_1:
	//## File "/src/pre.cu", line 5
        /*0050*/                   LDG.E R3, desc[UR4][R4.64] ;
        /*0060*/                   STG.E desc[UR4][R4.64], R3 ;
        /*0070*/               @P1 BRA `(.L_x_1) ;
	//## File "/src/pre.cu", line 1
        /*0080*/                   EXIT ;
.L_x_2:
        /*0090*/                   IMAD R3, R3, R3, RZ ;
        /*00a0*/                   BRA `(.L_x_1) ;
"""
PREPASS_SOURCE = "int i;\nint j;\nwork_a();\nint k;\nwork_b();\n"


def _prepass(rest_ctas: float, main_iters: float, other_iters: float, dram: float = 100.0) -> sp.PrePass:
    return sp.PrePass("p", "pre.cu", "pre.cu", r"_Z3prev", (sp.Loop(r"work_a"), sp.Loop(r"work_b")), "loop",
                      lambda d, ref: (rest_ctas, main_iters, other_iters), lambda d, ref: dram)


def test_a_prepass_per_attention_tile(tmp_path):
    (tmp_path / "pre.cu").write_text(PREPASS_SOURCE)
    instrs = sb.parse_disassembly(PREPASS)["_Z3prev"]
    cost = sp.count(_prepass(0.5, 2.0, 0.25), instrs, 128, root=tmp_path)
    # 8 warps x (rest 3 (S2R MOV EXIT) x 0.5 CTA + main 3 x 2 + other 3 x 0.25); the stub after EXIT not counted
    assert cost.instructions == 8 * (3 * 0.5 + 3 * 2.0 + 3 * 0.25) == 66
    assert cost.dram_bytes == 100.0 and "= 66 per tile" in cost.note
    # each part counts: leave out the main loop's iterations, and the figure drops
    assert sp.count(_prepass(0.5, 0.0, 0.25), instrs, 128, root=tmp_path).instructions == 66 - 8 * 6


# An outer loop (line 6) around the inner one (line 3), the inner one's body counted once
PREPASS_NESTED = """
.text._Z3prev:
        /*0000*/                   S2R R0, SR_TID.X ;
.L_x_0:
	//## File "/src/pre.cu", line 6
        /*0010*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;
.L_x_1:
	//## File "/src/pre.cu", line 3
        /*0020*/                   FFMA R2, R2, R2, R2 ;
        /*0030*/                   FFMA R2, R2, R2, R2 ;
        /*0040*/               @P0 BRA `(.L_x_1) ;
	//## File "/src/pre.cu", line 6
        /*0050*/                   IADD3 R1, PT, PT, R1, 0x1, RZ ;
        /*0060*/               @P1 BRA `(.L_x_0) ;
	//## File "/src/pre.cu", line 1
        /*0070*/                   EXIT ;
"""


def test_a_prepass_loop_counts_its_own_instructions_and_warps_per_head_dim(tmp_path):
    """A counted loop nested in another is counted as itself alone: the outer one's body is its own
    3 instructions (BAR, IADD3, BRA), not the inner one's too; ``warps`` may depend on the head dim."""
    (tmp_path / "pre.cu").write_text(PREPASS_SOURCE + "outer();\n")
    instrs = sb.parse_disassembly(PREPASS_NESTED)["_Z3prev"]
    pre = sp.PrePass("p", "pre.cu", "pre.cu", r"_Z3prev", (sp.Loop(r"work_a"), sp.Loop(r"outer")), "loop",
                     lambda d, ref: (1.0, 4.0, 0.5), lambda d, ref: 0.0, warps=lambda d: d // 32)
    # rest 2 (S2R EXIT) x 1 + inner 3 x 4 + outer's own 3 x 0.5 = 15.5 per warp
    assert sp.count(pre, instrs, 64, root=tmp_path).instructions == 2 * 15.5
    assert sp.count(pre, instrs, 128, root=tmp_path).instructions == 4 * 15.5
    # two markers of one loop: refused, not counted twice
    twice = dataclasses.replace(pre, loops=(sp.Loop(r"work_a"), sp.Loop(r"work_a")))
    with pytest.raises(ValueError, match="same loop"):
        sp.count(twice, instrs, 64, root=tmp_path)


def test_nested_loops_count_each_instruction_once():
    """Three named loops A > B > C: A's own body leaves out B (with C in it) once, not C twice."""
    a, b, c = (0, 99), (10, 59), (20, 29)
    assert sp._children([a, b, c], a) == [b] and sp._children([a, b, c], b) == [c]
    assert sp._children([a, b, c], c) == [] and sp._children([b, c, (70, 79)], a) == [b, (70, 79)]


def test_the_delta_s_prepass_model_reads_its_kernel():
    """The delta_s pre-pass's figures come from its header: its threads (kDeltaThreads: two keys
    a thread, both halves of a row at D 64, one at D 128), and at the reference shape (256 query
    blocks, a CTA's group) one step of kMUnroll query blocks per 4 tiles, no one-row steps, 4 chunks
    of r; every loop marker names a line of the header."""
    assert sp._delta_s_threads(64) == 64 and sp._delta_s_threads(128) == 128
    assert sp.PREPASSES["delta_s"].warps_of(64) == 2 and sp.PREPASSES["delta_s"].warps_of(128) == 4
    assert sp._delta_s_per_tile(128, sb.REF) == (1 / 256, 0.25, 0.0, 4 / 256)
    # 66 query blocks: a chunk of 64 (16 steps) and one of 2 (2 one-row steps)
    assert sp._delta_s_per_tile(128, sb.Ref(tokens=66 * 128)) == (1 / 66, 16 / 66, 2 / 66, 2 / 66)
    for pre in sp.PREPASSES.values():
        for loop in pre.loops:
            sp._line(sp.CSRC / pre.lines, loop.marker)


def _tensor_bound_budget(**kw) -> sb.Budget:
    """64 OMMAs and 100 other warp-instructions per warp: 2,048 clk of tensor work on an RTX 5090."""
    return sb.Budget("t", 128, 8, counts=Counter({"omma": 64, "fp32": 100}), **kw)


def test_prepass_time_adds_to_the_attention_kernels():
    gpu = sb.GPUS[0]
    alone = _tensor_bound_budget()
    kind, tensor = alone.bound(gpu)
    assert kind == "tensor" and tensor == pytest.approx(2048, rel=1e-4)
    b = _tensor_bound_budget(prepasses={"p": sb.PerTile(4000.0, 0.0), "q": sb.PerTile(None, 10.0)})
    # 4,000 warp-instructions per tile before the attention kernel: 1,000 clk of issue on top of its 2,048
    assert b.pre_instructions == 4000 and b.issue_all() == pytest.approx((8 * 164 + 4000) / 4)
    kind, clk = b.bound(gpu)
    assert kind == "tensor + pre-passes' issue" and clk == pytest.approx(tensor + 1000)
    assert b.ceiling_tops(gpu) == pytest.approx(alone.ceiling_tops(gpu) * tensor / (tensor + 1000))
    row = next(r for r in table([b]).splitlines() if r.startswith("| pre-pass q"))
    assert "not counted (10 B)" in row


def test_the_memory_bound_binds_when_bytes_are_large():
    for gpu in sb.GPUS:
        b = _tensor_bound_budget(dram_bytes=1e6)
        assert b.bound(gpu) == ("memory", pytest.approx(1e6 / gpu.dram_bytes_per_clk_sm))
        pre = _tensor_bound_budget(prepasses={"p": sb.PerTile(10.0, 1e6)})
        assert pre.bound(gpu) == ("tensor + pre-passes' memory",
                                  pytest.approx(64 * 8 * 16384 / gpu.fp4_flop_per_clk_sm + 1e6 / gpu.dram_bytes_per_clk_sm))
    # and a few hundred bytes per tile do not
    assert _tensor_bound_budget(dram_bytes=748).bound(sb.GPUS[2])[0] == "tensor"


def test_published_memory_bandwidths():
    bw = {g.name: g.dram_gb_s for g in sb.GPUS}
    assert bw == {"RTX 5090": 1792.0, "RTX PRO 6000": 1792.0, "GB10 (DGX Spark)": 273.0}
    assert sb.GPUS[0].dram_bytes_per_clk_sm == pytest.approx(1792e9 / (170 * 2.407e9))


def test_compulsory_dram_bytes_at_the_reference_shape():
    ref = sb.Ref(32768)
    assert ref.blocks == 256
    # K, V (codes + scales) 144 D over the query blocks, Q 72 D + the bf16 output 256 D over the key
    # tiles, delta_s rows every tile (the defaults) or once per head (one Q mean)
    assert sk.ours_dram_bytes(128, "defaults", ref) == 144 * 128 / 256 + (72 + 256) * 128 / 256 + 512 == 748
    assert sk.ours_dram_bytes(128, "one Q mean", ref) == 748 - 512 + 2
    assert sk.upstream_dram_bytes(128, ref) == 748
    assert sk.ours_dram_bytes(128, "bounded", ref) > sk.ours_dram_bytes(128, "one Q mean", ref)


def test_the_stored_upstream_counts_its_producer_warp():
    up = sk.stored_upstream_budgets(sb.Ref(32768))[0]
    # a warp of its own: in the SM's issue, not on top of a consumer warp (850 warp-instructions)
    assert up.producer == 102 + 146 / 256 and up.producer_warps == 1
    assert up.busiest_warp == 850 and up.sm_instructions == 8 * 850 + up.producer
    assert up.prepasses["delta_s"].instructions is None  # torch's matmul: bytes only
    row = next(r for r in table([up]).splitlines() if r.startswith("| producer"))
    assert "103" in row


def test_the_report_fails_exactly_where_the_compile_test_would():
    base = "_ZN9sageattn34attn19fp4_attn_fwd_kernelILi128E{}EEvNS0_10AttnParamsE"
    kernels = [Kernel(base.format("Lb0ELb0E"), "sm_120a", spill_stores=0, spill_loads=0),
               Kernel(base.format("Lb1ELb0E"), "sm_120a", spill_stores=32, spill_loads=32),   # at the allowance
               Kernel(base.format("Lb0ELb1E"), "sm_120a", spill_stores=72, spill_loads=73),   # one byte over
               Kernel("_ZN9sageattn312other_kernelEv", "sm_120a", spill_stores=100, spill_loads=100)]
    assert [k.name for k in spill_failures(kernels)] == [base.format("Lb0ELb1E")]
