"""The fused "auto" rule kernel (``_kernels.qk_rule_error``, one launch) against its oracle,
``reference.qk_fp4_error`` run on the CPU on the same preprocessed tensors: the estimate per head
to a relative 1e-3 and the same FP8/FP4 decision on every case of tests/attention_cases.py
(hard and easy), at D 64 and 128, bf16 and fp16, with and without the channel balance, the
rotation and per-block Q means, GQA, ragged lengths and sequences long enough that 8 blocks are
sampled. Also:
the same bits on a second launch (no floating-point atomics), the API's choice comes from
the kernel on CUDA, and a head's estimates are the same bits whether it is launched alone or
among others."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import attention_cases as ac
from test_dispatch_fp4 import fp4  # noqa: F401  (the fixture)

FIGURES: list[str] = []


def _cpu(pre):
    return dataclasses.replace(pre, **{f.name: getattr(pre, f.name).cpu() for f in dataclasses.fields(pre)
                                       if isinstance(getattr(pre, f.name), torch.Tensor)})


def _compare(sa, case, b, hq, hk, sq, sk, d, *, dtype=torch.bfloat16, seed=2025, balance=None, pbm=True,
             sm_scale=None, rotation=False):
    from sageattn3 import _kernels, reference as ref

    q, k, v = ac.make(case, b, hq, hk, sq, sk, d, seed=seed, dtype=dtype)
    qc, kc, vc = q.cuda(), k.cuda(), v.cuda()
    kw = {} if balance is None else {"qk_balance": balance}
    pre = sa.preprocess(qc, kc, vc, per_block_mean=pbm, qk_rotation=rotation, **kw)
    assert pre.qk_rotation == rotation
    scale = sm_scale if sm_scale is not None else d ** -0.5
    got = _kernels.qk_rule_error(qc, kc, vc, pre, scale)
    again = _kernels.qk_rule_error(qc, kc, vc, pre, scale)
    want = ref.qk_fp4_error(q, k, v, _cpu(pre), sm_scale)
    _check_select(qc, kc, vc, pre, scale, got)
    got = got.cpu()
    assert torch.equal(got, again.cpu()), f"{case}: two launches differ"
    rel = ((got - want).abs() / want.abs().clamp_min(1e-12)).max().item()
    fig = (f"{case} b={b} hq={hq} hk={hk} sq={sq} sk={sk} D={d} {str(dtype)[6:]} balance={pre.balance is not None} "
           f"rotation={rotation} pbm={pbm}: est {want.min():.4f}-{want.max():.4f}, max rel diff {rel:.2e}, "
           f"fp8 heads {int((want > ref.AUTO_ERROR_LIMIT).sum())}/{want.numel()}")
    FIGURES.append(fig)
    assert rel < 1e-3, fig
    assert torch.equal(got > ref.AUTO_ERROR_LIMIT, want > ref.AUTO_ERROR_LIMIT), fig
    if d == 128:  # the second statistic (the raw 16-bit rows' choice) against the reference's
        stat = _kernels.qk_rule_select(qc, kc, vc, pre, scale, ref.AUTO_ERROR_LIMIT, False)[5].cpu()
        stat_want = ref.qk16_stat(q, k, _cpu(pre), sm_scale)
        srel = ((stat - stat_want).abs() / stat_want.abs().clamp_min(1e-12)).max().item()
        FIGURES.append(f"{fig}; qk16_stat {stat_want.min():.2f}-{stat_want.max():.2f}, max rel diff {srel:.2e}")
        assert srel < 1e-4, (fig, stat, stat_want)
    return got, want


def _check_select(q, k, v, pre, scale, error):
    """qk_rule_select (the estimate and the selection in one op): the same estimate bit for bit on
    every launch, whatever the limit (qk_rule_error is its estimate alone), sel_q = error > limit (or every head with select_all), sel_k = any over each kv
    head's q heads; at the default limit and at limits that split the heads, twice each (the
    counters and sel_k are zeroed by every launch)."""
    from sageattn3 import _kernels, reference as ref

    b, hq, hk = q.shape[0], q.shape[1], k.shape[1]
    limits = [ref.AUTO_ERROR_LIMIT, float(error.median()), float(error.min()) - 1.0, float(error.max())]
    for limit in limits:
        for select_all in (False, True):
            for _ in range(2):
                out = _kernels.qk_rule_select(q, k, v, pre, scale, limit, select_all)
                err, sel_q, sel_k, err_pv, sel_v, stat = out
                fake = _kernels._qk_rule_select_fake(q, k, v, *[None] * 14, select_all, -1.0)
                assert [(t.shape, t.dtype) for t in fake] == [(t.shape, t.dtype) for t in out]
                assert bool(err_pv.isnan().all()) and not bool(sel_v.any()), "no P estimate was asked"
                assert sel_q.dtype == torch.uint8 and sel_k.dtype == torch.uint8
                assert torch.equal(err, error), "qk_rule_select's estimate differs between launches"
                want = torch.ones_like(error, dtype=torch.bool) if select_all else error > limit
                assert torch.equal(sel_q & 3, want.to(torch.uint8)), (limit, select_all, sel_q, error)
                # bit 2 (D 128): the raw 16-bit rows where a selected head's second statistic exceeds its limit
                raw = want & (stat > ref.QK16_STAT_LIMIT) if q.shape[3] == 128 else torch.zeros_like(want)
                assert torch.equal(sel_q >> 2, raw.to(torch.uint8)), (limit, select_all, sel_q, stat)
                assert q.shape[3] == 128 or bool(stat.isnan().all()), "no second statistic at D 64"
                assert torch.equal(sel_k, want.view(b, hk, hq // hk).any(-1).to(torch.uint8)), (limit, sel_k)


@pytest.mark.parametrize("case", ac.CASES)
@pytest.mark.parametrize("d", [64, 128])
def test_rule_kernel_matches_reference_on_every_case(fp4, case, d):  # noqa: F811
    """The calibration shape (4 heads, 512 tokens, seed 2025) and a GQA, ragged, long one."""
    _compare(fp4, case, 1, 4, 4, 512, 512, d)
    _compare(fp4, case, 2, 4, 2, 1500, 2333, d, seed=7)


@pytest.mark.parametrize("case", ac.CASES)
@pytest.mark.parametrize("d", [64, 128])
def test_rule_kernel_on_rotated_rows(fp4, case, d):  # noqa: F811
    """qk_rotation=True: the rule on the rotated rows (the scale divided by D/64), alone and with
    the balance (balanced, then rotated), against the reference on the same tensors."""
    _compare(fp4, case, 1, 4, 4, 512, 512, d, rotation=True)
    _compare(fp4, case, 2, 4, 2, 1500, 2333, d, seed=7, rotation=True, balance=True)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("balance", [False, True])
def test_rule_kernel_options(fp4, dtype, balance):  # noqa: F811
    """fp16 and bf16, the balance on and off, one Q mean (per_block_mean=False), an sm_scale."""
    _compare(fp4, "mixed_heads", 1, 8, 2, 1000, 1000, 128, dtype=dtype, balance=balance)
    _compare(fp4, "q_outliers", 1, 4, 1, 129, 77, 64, dtype=dtype, balance=balance, sm_scale=0.05)
    _compare(fp4, "rope_bias", 1, 4, 2, 9000, 300, 128, dtype=dtype, pbm=False, balance=False)
    _compare(fp4, "q_outliers", 1, 4, 1, 129, 77, 64, dtype=dtype, balance=balance, sm_scale=0.05, rotation=True)


def test_short_sequences(fp4):  # noqa: F811
    for sq, sk in ((1, 1), (7, 5), (8, 9), (127, 128), (128, 129)):
        _compare(fp4, "randn", 1, 2, 1, sq, sk, 128)


@pytest.mark.parametrize("d, sq, seed, head", [(64, 300, 3, 2), (128, 256, 2, 1)])
def test_short_calls_read_every_row(fp4, d, sq, seed, head):  # noqa: F811
    """A short call's rule reads every row (reference.query_stride 1: 8 row groups of 16 per
    sampled block, the last block's partly empty), and finds the head whose FP4 error sits on 2
    of its 300 rows (every 8th row estimated 0.0), as the reference does; every 2nd and 4th row
    (600 and 700 tokens) likewise."""
    from sageattn3 import reference as ref

    _, want = _compare(fp4, "qk_massive", 1, 4, 2, sq, sq, d, seed=seed)
    assert float(want[0, head]) > ref.AUTO_ERROR_LIMIT, want
    for n, stride in ((600, 2), (700, 4)):
        assert ref.query_stride(n, n) == stride
        _compare(fp4, "qk_massive", 1, 4, 2, n, n, d, seed=seed)


def test_many_heads(fp4):  # noqa: F811
    """16 heads x 8 sampled Q blocks, two row groups to a block."""
    _compare(fp4, "mixed_heads", 2, 8, 2, 1024, 1024, 128)
    _compare(fp4, "k_outliers", 2, 8, 4, 1100, 1500, 64, dtype=torch.float16, balance=True)


@pytest.mark.parametrize("d", [64, 128])
def test_an_odd_number_of_row_groups(fp4, d):  # noqa: F811
    """890 tokens: 7 sampled blocks of one row group each, so a head's last block holds one group
    and its second pair of warps has none (it stages, waits at the barriers and reports nothing):
    the Q·Kᵀ estimate and P's (causal) against the reference."""
    from sageattn3 import _kernels, reference as ref

    assert ref.query_stride(890, 890) == 8  # 7 row groups a head
    _compare(fp4, "qk_massive", 1, 4, 2, 890, 890, d)
    q, k, v = ac.make("large_logits", 1, 4, 2, 890, 890, d, seed=4)
    pre = fp4.preprocess(q.cuda(), k.cuda(), v.cuda())
    err_pv = _kernels.qk_rule_select(q.cuda(), k.cuda(), v.cuda(), pre, d ** -0.5, 0.2, False, 0.105, True)[3]
    want = ref.pv_p_error(q, k, v, _cpu(pre), is_causal=True)
    rel = float(((err_pv.cpu() - want).abs() / want.abs()).max())
    FIGURES.append(f"odd row groups D={d}: P estimate vs reference max rel {rel:.1e}")
    assert rel < 2e-3, (err_pv, want)


@pytest.mark.parametrize("seq", [2048, 300])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [64, 128])
def test_a_heads_estimates_do_not_depend_on_the_others(fp4, d, causal, seq):  # noqa: F811
    """Heads are independent: a head launched alone and the same head among 16 give the same
    Q·Kᵀ and P estimates, bit for bit, causal (P's masked) or not, and the same selection. At 300
    tokens the rule reads every row (24 row groups a head, 12 blocks)."""
    from sageattn3 import _kernels

    q, k, v = (t.cuda() for t in ac.make("large_logits", 2, 8, 2, seq, seq, d, seed=5))
    scale = d ** -0.5

    def rule(q, k, v):
        pre = fp4.preprocess(q, k, v)
        return _kernels.qk_rule_select(q, k, v, pre, scale, 0.2, False, 0.105, causal)

    err, sel_q, _, err_pv, _, _ = rule(q, k, v)
    assert not bool(err.isnan().any() or err_pv.isnan().any())
    for b, h in ((0, 0), (1, 5), (1, 7)):
        kv = h // 4
        one = rule(*(t[b:b + 1, i:i + 1].contiguous() for t, i in ((q, h), (k, kv), (v, kv))))
        for name, whole, alone in (("Q·Kᵀ", err[b, h], one[0][0, 0]), ("P", err_pv[b, h], one[3][0, 0])):
            FIGURES.append(f"alone S={seq} D={d} causal={causal} head ({b}, {h}) {name}: {float(whole):.6f} among 16, "
                           f"{float(alone):.6f} alone")
            assert float(whole) == float(alone), FIGURES[-1]
        assert int(one[1][0, 0]) == int(sel_q[b, h])


def test_api_choice_comes_from_the_kernel(fp4):  # noqa: F811
    from sageattn3 import _kernels

    q, k, v = (t.cuda() for t in ac.make("mixed_heads", 1, 8, 2, 1000, 1000, 128, seed=21))
    choice = fp4.qk_choice(q, k, v)
    pre = fp4.preprocess(q, k, v)
    assert torch.equal(choice.error, _kernels.qk_rule_error(q, k, v, pre, 128 ** -0.5))
    assert choice.fp8.any() and not choice.fp8.all()


def test_the_rows_spread_sends_a_huge_norm_keys_head_to_fp8(fp4):  # noqa: F811
    """tests/bench/rule_spread.py's key_norm_x60 (key 0 of each kv head 60 times the others' norm;
    D 128, 2048 tokens: every 8th row): the kernel's estimate, the rows' spread included, against
    the reference's (1e-3); head 3, whose plain ratio (about 0.13) would keep FP4 (0.954 against
    exact attention), takes FP8 Q·Kᵀ, and with the defaults every head is >= 0.98."""
    import sys
    from pathlib import Path

    from sageattn3 import _kernels, reference as ref

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    import rule_spread

    q, k, v = rule_spread.make("key_norm_x60", 2048, 128, 0)
    qc, kc, vc = q.cuda(), k.cuda(), v.cuda()
    pre = fp4.preprocess(qc, kc, vc)
    got = _kernels.qk_rule_error(qc, kc, vc, pre, 128 ** -0.5).cpu()
    want = ref.qk_fp4_error(q, k, v, _cpu(pre))
    rel = ((got - want).abs() / want.abs()).max().item()
    out, choice = fp4.sageattn3_blackwell(qc, kc, vc, return_qk_choice=True)
    exact = ref.exact_attention(qc, kc, vc)
    heads = [ac.cos_sim(out[0, h].float(), exact[0, h]) for h in range(4)]
    fig = (f"key_norm_x60 D 128 2048: kernel estimates {[round(float(x), 4) for x in got[0]]}, max rel diff "
           f"{rel:.1e}; heads vs exact {min(heads):.4f}-{max(heads):.4f}; {choice.describe()[:120]}")
    FIGURES.append(fig)
    assert rel < 1e-3 and float(got[0, 3]) > ref.AUTO_ERROR_LIMIT and bool(choice.fp8[0, 3]), fig
    assert min(heads) >= 0.98, fig


@pytest.mark.parametrize("d", [64, 128])
def test_the_spread_does_not_depend_on_vs_scale(fp4, d):  # noqa: F811
    """V times 2^-40 (about 1e-12) and 2^30 (about 1e9), bf16: the rule reads V as it is, so its
    outputs and each row's n_r, d_r scale by powers of two exactly, and the estimate, the rows'
    spread included (its squares summed in double), is the same bits as at V's own scale, and the
    reference's (1e-3). In float32 those squares fall below its range at 2^-40 and past it at
    2^30. 2048 tokens: every 8th row is read, so the spread counts."""
    from sageattn3 import _kernels, reference as ref

    q, k, v = ac.make("k_sink", 1, 4, 2, 2048, 2048, d, seed=3, dtype=torch.bfloat16)
    qc, kc = q.cuda(), k.cuda()
    pre = fp4.preprocess(qc, kc, v.cuda())
    base = _kernels.qk_rule_error(qc, kc, v.cuda(), pre, d ** -0.5).cpu()
    for e in (-40, 30):
        vs = v * 2.0 ** e
        got = _kernels.qk_rule_error(qc, kc, vs.cuda(), fp4.preprocess(qc, kc, vs.cuda()), d ** -0.5).cpu()
        want = ref.qk_fp4_error(q, k, vs, _cpu(pre))
        rel = ((got - want).abs() / want.abs()).max().item()
        FIGURES.append(f"V x 2^{e}, D {d}: kernel estimates {[round(float(x), 4) for x in got[0]]} "
                       f"(at V's scale {[round(float(x), 4) for x in base[0]]}), max rel diff to the reference {rel:.1e}")
        assert torch.equal(got, base), (e, got, base)
        assert rel < 1e-3, FIGURES[-1]


def test_zz_report_figures():
    print("\n".join(FIGURES))
