"""The whole per-tile budget (ci.checks.sass_budget, ci.checks.sass_prepass, ci.checks.sass_kernels)
on listings and numbers written out here, no tools needed:

- the producer's share of a key tile (its per-stage work, its per-query-tile work over the key
  tiles) on warp 0 and in the SM's issue;
- a pre-pass counted from its SASS (main loop x iterations, another loop, the rest once per CTA,
  nothing after the last EXIT) and converted per attention tile; its time added to the attention
  kernel's bound, not hidden under it;
- the memory term: compulsory DRAM bytes over each GPU's bandwidth, binding when the bytes are large;
- the kernel report's exit status rests on the compile test's spill allowance."""

from __future__ import annotations

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
    assert up.producer == 102 + 146 / 256 and up.busiest_warp == 850 + up.producer
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
