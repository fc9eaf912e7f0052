"""The eager call as one op (``sageattn3._call``, ``attention_call``): the same output as the multi-op
path, bit for bit, on every path the call can take; one host call and two allocations per call; the
same refusals.

The multi-op path is what ``api._fp4_attention`` runs when it is asked for the debug return (a
``choice`` list), so both run on the same inputs here.
"""

from __future__ import annotations

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

import attention_cases as ac
from gpu_common import same_bytes
from test_dispatch_fp4 import fp4  # noqa: F401  (the fixture)

# (case, B, Hq, Hkv, Sq, Sk, D, dtype, causal): data where the rule takes some heads off FP4
# ("mixed_heads": one zero-mean head, one near-one-hot, two RoPE'd; large logits in fp16 for P·V),
# data where it takes none, short and long calls, GQA, ragged lengths
CASES = [
    ("mixed_heads", 1, 4, 2, 300, 300, 128, torch.bfloat16, False),
    ("mixed_heads", 1, 4, 2, 1000, 777, 64, torch.float16, True),
    ("large_logits", 1, 4, 2, 520, 520, 128, torch.float16, True),
    ("large_logits", 2, 2, 1, 256, 400, 64, torch.float16, False),
    ("randn", 1, 6, 3, 129, 1100, 128, torch.bfloat16, False),
    ("q_outliers", 1, 2, 2, 700, 700, 64, torch.bfloat16, True),
    ("q_outliers", 1, 8, 1, 300, 300, 128, torch.bfloat16, False),  # 8 q heads per kv head
]
MODES = [  # (qk_precision, pv_precision)
    ("auto", "auto"), ("fp4", "fp4"), ("fp8", "fp4"), ("auto", "fp8"), ("fp4", "fp8"), ("auto", "fp4"),
    ("fp4", "auto"), ("fp8", "auto"), ("fp8", "fp8"),
]
OPTIONS = [{}, {"qk_rotation": True}, {"qk_balance": True, "qk_scale_search": True},
           {"qk_balance": True, "qk_rotation": True, "qk_scale_search": True}, {"per_block_mean": False}]


def _inputs(case, b, hq, hk, sq, sk, d, dtype):
    return ac.make(case, b, hq, hk, sq, sk, d, seed=7, dtype=dtype, device="cuda")


def _both(fp4, q, k, v, causal, qk, pv, opts, sm_scale=None):  # noqa: F811
    """The one-op call (checked to have run) and the multi-op path's, on the same inputs."""
    from sageattn3 import _call, api

    kw = {"qk_rotation": False, "qk_balance": False, "qk_scale_search": False, "per_block_mean": True, **opts}
    pbm = kw.pop("per_block_mean")
    real, ran = _call.call, []
    _call.call = lambda *a, **k_: ran.append(1) or real(*a, **k_)
    try:
        one = api._fp4_attention(q, k, v, causal, pbm, sm_scale, qk_precision=qk, pv_precision=pv, **kw)
    finally:
        _call.call = real
    assert ran == [1], "the one-op call did not serve this call"
    choice: list = []
    ops = api._fp4_attention(q, k, v, causal, pbm, sm_scale, qk_precision=qk, pv_precision=pv, choice=choice, **kw)
    return one, ops, choice[0]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{c[6]}-{c[4]}x{c[5]}-{'causal' if c[8] else 'full'}")
@pytest.mark.parametrize("mode", MODES, ids=lambda m: f"qk_{m[0]}-pv_{m[1]}")
def test_one_op_gives_the_multi_op_output_bit_for_bit(fp4, case, mode):  # noqa: F811
    name, b, hq, hk, sq, sk, d, dtype, causal = case
    q, k, v = _inputs(name, b, hq, hk, sq, sk, d, dtype)
    fp4.sageattn3_blackwell(q, k, v)  # the self-check, once
    for opts in OPTIONS:
        one, ops, choice = _both(fp4, q, k, v, causal, *mode, opts)
        assert one.shape == (b, hq, sq, d) and one.dtype == dtype and one.is_contiguous()
        assert same_bytes(one, ops), (f"{name} {mode} {opts}: the one op differs from the ops "
                                      f"(max |diff| {(one.float() - ops.float()).abs().max().item()}; {choice.describe()})")


def test_the_cases_take_every_path(fp4):  # noqa: F811
    """The grid above reaches FP8 Q·Kᵀ heads and FP8 P·V heads chosen per head, beside FP4 ones."""
    seen_qk, seen_pv = set(), set()
    for name, b, hq, hk, sq, sk, d, dtype, causal in CASES:
        q, k, v = _inputs(name, b, hq, hk, sq, sk, d, dtype)
        _, _, choice = _both(fp4, q, k, v, causal, "auto", "auto", {})
        seen_qk.update(choice.fp8.flatten().tolist())
        seen_pv.update(choice.pv_fp8.flatten().tolist())
    assert seen_qk == {True, False} and seen_pv == {True, False}, (seen_qk, seen_pv)


def test_sm_scale_and_grad_inputs(fp4):  # noqa: F811
    q, k, v = _inputs("mixed_heads", 1, 4, 2, 300, 300, 128, torch.bfloat16)
    one, ops, _ = _both(fp4, q, k, v, False, "auto", "auto", {}, sm_scale=0.05)
    assert same_bytes(one, ops)
    qg = q.clone().requires_grad_(True)
    out = fp4.sageattn3_blackwell(qg, k, v)
    assert out.grad_fn is None and same_bytes(out, fp4.sageattn3_blackwell(q, k, v))


def _events(fn) -> list[str]:
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return [e.name for e in prof.events()]


@pytest.mark.parametrize("precision", ["fp4", "auto", "fp8"])
def test_a_call_is_one_op_and_two_allocations(fp4, precision):  # noqa: F811
    from sageattn3 import api

    q, k, v = _inputs("mixed_heads", 1, 4, 2, 300, 300, 128, torch.bfloat16)
    fp4.sageattn3_blackwell(q, k, v)
    names = _events(lambda: fp4.sageattn3_blackwell(q, k, v, qk_precision=precision))
    allocs = [n for n in names if n in ("aten::empty", "aten::empty_strided")]
    assert names.count("sageattn3::attention_call") == 1, names
    assert not [n for n in names if n.startswith("sageattn3::") and n != "sageattn3::attention_call"], names
    assert len(allocs) == 2, f"expected the output and one buffer, got {len(allocs)} allocations: {names}"
    # the probe: the multi-op path's allocations are seen the same way
    many = _events(lambda: api._fp4_attention(q, k, v, False, True, qk_precision=precision, choice=[]))
    assert len([n for n in many if n in ("aten::empty", "aten::empty_strided")]) >= 13, many


@pytest.mark.parametrize("precision", ["fp4", "auto", "fp8"])
@pytest.mark.parametrize("per_block_mean", [True, False])
def test_a_call_makes_no_memset_and_one_fp8_operand_launch(fp4, precision, per_block_mean):  # noqa: F811
    """The host calls the launch count sets: the rule's zeros come with the preprocessing's means
    launch (no memset), Q's and K's MXFP8 rows are one launch with V's MXFP8 (P·V "auto": no
    launch of its own), the rule one (the means: one, or Q's and K's with one Q mean)."""
    q, k, v = _inputs("mixed_heads", 1, 4, 2, 300, 300, 128, torch.bfloat16)
    call = lambda: fp4.sageattn3_blackwell(q, k, v, qk_precision=precision, per_block_mean=per_block_mean)  # noqa: E731
    call()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        call()
        torch.cuda.synchronize()
    names = [e.name for e in prof.events()]
    kernels = [n for n in names if "sageattn3::" in n and "kernel" in n]
    assert not [n for n in names if n.startswith("cudaMemset")], names
    assert len([n for n in kernels if "sample_means_kernel" in n]) == (1 if per_block_mean else 2), kernels
    rule = 0 if precision == "fp4" else 1
    assert len([n for n in kernels if "qk_rule_kernel" in n]) == rule, kernels
    assert len([n for n in kernels if "mxfp8_kernel" in n or "mxfp8_rotated_kernel" in n]) == rule, kernels
    assert not [n for n in kernels if "quant_mxfp8_cols_kernel" in n], kernels


def _poison_the_allocator() -> None:
    """The caching allocator's free blocks filled with 0xFF bytes, as far as it lets us: first new
    blocks of each pool's sizes, then every free block it lists, each allocated back at its size
    (largest first), filled and freed. The one op's allocation is then carved from poisoned memory,
    so a piece it reads before writing holds garbage rather than a lucky zero."""
    torch.cuda.synchronize()
    blocks = [torch.full((n,), 255, dtype=torch.uint8, device="cuda") for n in (1 << 19, 1 << 20, 8 << 20, 64 << 20)]
    del blocks
    free = sorted((b["size"] for seg in torch.cuda.memory_snapshot() for b in seg["blocks"] if b["state"] == "inactive"),
                  reverse=True)
    blocks = [torch.full((n,), 255, dtype=torch.uint8, device="cuda") for n in free]
    torch.cuda.synchronize()
    del blocks


@pytest.mark.parametrize("case", [CASES[0], CASES[5]], ids=["many-heads", "few-heads"])
@pytest.mark.parametrize("precision", ["auto", "fp8"])
@pytest.mark.parametrize("per_block_mean", [True, False])
def test_the_rule_zeros_hold_on_a_poisoned_allocator(fp4, case, precision, per_block_mean):  # noqa: F811
    """The rule's counters and selections get their zeros from the preprocessing's means launch:
    on memory full of 0xFF the one op still gives the multi-op path's output (whose rule op
    zeroes them with memsets). A counter left at 0xFFFFFFFF would keep every head from being
    finished: its selection byte would stay 0xFF (FP8 Q·Kᵀ and P·V). The second case has few heads
    (a small grid)."""
    q, k, v = _inputs(*case[:8])
    for _ in range(2):  # the second call after the first's blocks went back to the poisoned cache
        _poison_the_allocator()
        one, ops, choice = _both(fp4, q, k, v, case[8], precision, "auto", {"per_block_mean": per_block_mean})
        assert same_bytes(one, ops), (precision, per_block_mean)
    if case is CASES[0] and precision == "auto" and per_block_mean:  # the data tells the heads apart
        assert bool(choice.fp8.any()) and not bool(choice.fp8.all()), choice


def test_the_same_refusals(fp4, monkeypatch):  # noqa: F811
    """Where the delta_s workspace cannot hold one row, "fp8" Q·Kᵀ and FP8 P·V refuse as before, and
    "auto" keeps every head FP4 (the FP4 path's output)."""
    from sageattn3 import api

    q, k, v = _inputs("mixed_heads", 1, 4, 2, 1000, 1000, 128, torch.bfloat16)
    fp4.sageattn3_blackwell(q, k, v)
    monkeypatch.setenv("SAGEATTN3_DELTA_S_WORKSPACE_MIB", "0")
    with pytest.raises(ValueError, match="delta_s workspace"):
        fp4.sageattn3_blackwell(q, k, v, qk_precision="fp8")
    with pytest.raises(ValueError, match="delta_s workspace"):
        fp4.sageattn3_blackwell(q, k, v, qk_precision="fp4", pv_precision="fp8")
    auto = api._fp4_attention(q, k, v, False, True, qk_precision="auto", pv_precision="auto")
    assert same_bytes(auto, api._fp4_attention(q, k, v, False, True, qk_precision="fp4", pv_precision="fp4"))


@pytest.mark.parametrize("mib", ["1", "0"])
def test_a_partial_or_no_workspace_gives_the_multi_op_output(fp4, monkeypatch, mib):  # noqa: F811
    """SAGEATTN3_DELTA_S_WORKSPACE_MIB=1 holds 2 of the 4 heads' delta_s rows at 4,096 tokens (512 KiB
    each: the kernels take the heads in chunks); 0 holds none (the bounded mode: FP4 only, "auto"
    keeps every head FP4)."""
    q, k, v = _inputs("mixed_heads", 1, 4, 2, 4096, 4096, 128, torch.bfloat16)
    fp4.sageattn3_blackwell(q[:, :, :256], k[:, :, :256], v[:, :, :256])
    monkeypatch.setenv("SAGEATTN3_DELTA_S_WORKSPACE_MIB", mib)
    modes = [("auto", "auto"), ("fp8", "fp4"), ("fp4", "fp8"), ("fp4", "fp4")] if mib == "1" else \
        [("auto", "auto"), ("fp4", "fp4"), ("auto", "fp4")]
    for qk, pv in modes:
        one, ops, choice = _both(fp4, q, k, v, False, qk, pv, {})
        assert same_bytes(one, ops), (mib, qk, pv, choice.describe())
