"""FP8 Q·Kᵀ and the per-head choice of the Q·Kᵀ precision in the reference (CPU): the MXFP8
quantizer against an independent E4M3 grid, the rule's decisions on the cases of
tests/attention_cases.py, the accuracy targets against float64 exact attention, and K's per-block
means (measured, reference only)."""

import pytest
import torch

from sageattn3 import reference as ref

import attention_cases as ac
from e4m3_oracle import e4m3_grid as _e4m3_grid
from e4m3_oracle import nearest_e4m3 as _nearest_e4m3

SEQ = 256


def test_ue8m0_scale_is_the_smallest_power_of_two_that_fits():
    e = torch.arange(-30, 30, dtype=torch.float64)
    for frac in (1.0, 1.25, 1.75, 1.7500001, 1.9999999):
        amax = (frac * torch.exp2(e)).float()
        b = ref.ue8m0_scale_byte(amax).long()
        s = torch.exp2((b - 127).double())
        assert bool((amax.double() <= 448 * s).all()), frac
        assert bool((amax.double() > 448 * s / 2).all()), frac
    assert int(ref.ue8m0_scale_byte(torch.tensor([448.0]))) == 127
    assert int(ref.ue8m0_scale_byte(torch.tensor([448.00003]))) == 128
    assert int(ref.ue8m0_scale_byte(torch.tensor([0.0]))) == 1  # zero block: codes 0
    assert int(ref.ue8m0_scale_byte(torch.tensor([1e-40]))) == 1  # subnormal amax: clamped to 2^-126


def test_mxfp8_matches_an_independent_rounding():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 128, generator=g) * torch.exp2(torch.randint(-12, 12, (64, 1), generator=g).float())
    x[3, :32] = 0.0
    x[4, 5] = 1000.0  # one large value: the rest of its block lands low
    codes, scales = ref.quantize_mxfp8_rows(x)
    assert codes.dtype == torch.float8_e4m3fn and scales.dtype == torch.uint8 and scales.shape == (64, 4)
    s = torch.exp2(scales.double() - 127).repeat_interleave(32, dim=-1)
    expect = _nearest_e4m3(x.double() / s) * s
    assert torch.equal(ref.dequantize_mxfp8_rows(codes, scales).double(), expect)
    # ties go to the even code: 1 + 1/16 lies halfway between 1 and 1.125
    c, sc = ref.quantize_mxfp8_rows(torch.tensor([[448.0] + [1.0625, 1.1875] + [0.0] * 29]))
    assert ref.dequantize_mxfp8_rows(c, sc)[0, 1:3].tolist() == [1.0, 1.25]
    with pytest.raises(ValueError, match="multiple of 32"):
        ref.quantize_mxfp8_rows(torch.zeros(2, 48))


def test_mxfp8_special_values():
    x = torch.zeros(2, 32)
    x[0, 0], x[0, 1] = float("inf"), -3.0
    x[1, 0] = float("nan")
    codes, scales = ref.quantize_mxfp8_rows(x)
    deq = ref.dequantize_mxfp8_rows(codes, scales)
    assert deq[0, 0] == 448 * 2.0 ** (int(scales[0, 0]) - 127) and deq[0, 1] == 0.0  # Inf saturates
    assert bool(deq[1, 0].isnan())


@pytest.mark.parametrize("case", ac.EASY_CASES)
def test_auto_keeps_fp4_where_no_head_needs_help(case):
    """The rule picks no head on these cases: the default output is bit for bit FP4's."""
    for d, causal in ((128, False), (64, True)):
        q, k, v = ac.make(case, 1, 4, 2, SEQ, SEQ, d, seed=7)
        pre = ref.preprocess(q, k, v, qk_precision="auto")
        assert not bool(pre.qk_fp8.any()), (d, pre.qk_error)
        assert torch.equal(ref.sageattn3(q, k, v, is_causal=causal),
                           ref.sageattn3(q, k, v, is_causal=causal, qk_precision="fp4"))


# issue targets with the defaults, against exact attention
TARGET = {"rope_bias": 0.98, "q_outliers": 0.98, "k_outliers": 0.98, "k_sink": 0.98, "peaky": 0.97,
          "mixed_heads": 0.98, "randn": 0.981}


@pytest.mark.parametrize("case", ac.HARD_CASES)
def test_auto_picks_fp8_for_hard_heads_and_meets_the_targets(case):
    for d, causal in ((128, False), (64, True)):
        q, k, v = ac.make(case, 1, 4, 2, SEQ, SEQ, d, seed=7)
        pre = ref.preprocess(q, k, v, qk_precision="auto")
        want = [False, True, True, True] if case == "mixed_heads" else [True] * 4
        assert pre.qk_fp8.flatten().tolist() == want, (d, pre.qk_error)
        exact = ref.exact_attention(q, k, v, is_causal=causal)
        auto = ac.cos_sim(ref.sageattn3(q, k, v, is_causal=causal), exact)
        fp4 = ac.cos_sim(ref.sageattn3(q, k, v, is_causal=causal, qk_precision="fp4"), exact)
        if case in TARGET:
            assert auto > fp4 + 0.01, (d, causal, auto, fp4)
            assert auto >= TARGET[case], (d, causal, auto)
        else:  # outliers Q and K share: FP8 helps a little, the target is not met (docs/accuracy-auto-details.md)
            assert auto >= fp4 and auto >= 0.945, (d, causal, auto, fp4)


def test_zero_mean_data_no_worse_than_today():
    q, k, v = ac.make("randn", 1, 4, 2, SEQ, SEQ, 128, seed=7)
    exact = ref.exact_attention(q, k, v)
    assert ac.cos_sim(ref.sageattn3(q, k, v), exact) >= TARGET["randn"]


def test_fp8_everywhere_and_arguments():
    q, k, v = ac.make("q_offset_x3", 1, 2, 1, 200, 200, 128, seed=3)
    pre = ref.preprocess(q, k, v, qk_precision="fp8")
    assert pre.qk_fp8.all() and pre.q8.shape == (1, 2, 256, 128) and pre.k8_scales.shape == (1, 1, 256, 4)
    # the FP8 operands are the MXFP8 of the rows the FP4 operands quantize, rotated (Q's times
    # 64/D: here 1/2); with qk_fp8_rotated=False of exactly those rows
    qs, _ = ref.fp8_rows(q.float(), pre.mean_q, k.float(), pre.mean_k)
    c, s = ref.quantize_mxfp8_rows(ref.pad_dim(qs, -2, 128))
    assert torch.equal(c.view(torch.uint8), pre.q8.view(torch.uint8)) and torch.equal(s, pre.q8_scales)
    plain = ref.preprocess(q, k, v, qk_precision="fp8", qk_fp8_rotated=False)
    c, s = ref.quantize_mxfp8_rows(ref.pad_dim(ref.smooth_q(q.float(), pre.mean_q), -2, 128))
    assert torch.equal(c.view(torch.uint8), plain.q8.view(torch.uint8)) and torch.equal(s, plain.q8_scales)
    # at D 64 the heads that leave FP4 take the same rows in bf16 (the 16-bit Q·Kᵀ), no scales
    q, k, v = ac.make("q_offset_x3", 1, 2, 1, 200, 200, 64, seed=3)
    pre = ref.preprocess(q, k, v, qk_precision="fp8")
    qs, ks = ref.fp8_rows(q.float(), pre.mean_q, k.float(), pre.mean_k)
    assert pre.qk_fp8.all() and pre.q8_scales is None and pre.k8_scales is None
    assert pre.q8.dtype == torch.bfloat16 and pre.q8.shape == (1, 2, 256, 64) and pre.k8.shape == (1, 1, 256, 64)
    assert torch.equal(pre.q8, ref.qk16_rows(ref.pad_dim(qs, -2, 128)))
    assert torch.equal(pre.k8, ref.qk16_rows(ref.pad_dim(ks, -2, 128)))
    assert ref.preprocess(q, k, v).qk_fp8 is None  # preprocess alone: FP4 unless asked
    with pytest.raises(ValueError, match="qk_precision must be one of"):
        ref.sageattn3(q, k, v, qk_precision="FP8")
    # "fp8" with the rotation: FP8 on the rotated rows (what qk_fp8_rotated asked for before)
    assert torch.equal(ref.sageattn3(q, k, v, qk_precision="fp8", qk_rotation=True),
                       ref.sageattn3(q, k, v, qk_precision="fp8", qk_rotation=True, qk_fp8_rotated=True))
    # auto with the rotation: the rule runs on the rotated rows (test_auto_on_rotated_rows)
    assert ref.preprocess(q, k, v, qk_precision="auto", qk_rotation=True).qk_error is not None
    q80, k80, v80 = ac.make("randn", 1, 1, 1, 64, 64, 80, seed=3)
    with pytest.raises(ValueError, match="head_dim 64 or 128"):
        ref.sageattn3(q80, k80, v80, qk_precision="fp8")
    assert ref.preprocess(q80, k80, v80, qk_precision="auto").qk_fp8 is None


def test_fp8_with_the_balance_quantizes_the_balanced_rows():
    q, k, v = ac.make("k_outliers", 1, 2, 1, 256, 256, 128, seed=3)
    pre = ref.preprocess(q, k, v, qk_precision="fp8", qk_balance=True)
    assert pre.balance is not None and bool((pre.balance != 0).any())
    qs, ks = ref.fp8_rows(q.float() * ref.expand_kv(torch.exp2(-pre.balance), 2), pre.mean_q,
                          k.float() * torch.exp2(pre.balance), pre.mean_k)
    c, s = ref.quantize_mxfp8_rows(ks)
    assert torch.equal(c.view(torch.uint8), pre.k8.view(torch.uint8)) and torch.equal(s, pre.k8_scales)
    c, s = ref.quantize_mxfp8_rows(qs)  # Q's rows times 64/D = 1/2: K's exponent bytes one lower, same codes
    assert torch.equal(c.view(torch.uint8), pre.q8.view(torch.uint8)) and torch.equal(s, pre.q8_scales)
    unscaled, _ = ref.quantize_mxfp8_rows(qs * 2)
    assert torch.equal(unscaled.view(torch.uint8), c.view(torch.uint8))
    ks = k.float() * torch.exp2(pre.balance) - pre.mean_k  # unrotated, with qk_fp8_rotated=False
    pre = ref.preprocess(q, k, v, qk_precision="fp8", qk_balance=True, qk_fp8_rotated=False)
    c, s = ref.quantize_mxfp8_rows(ks)
    assert torch.equal(c.view(torch.uint8), pre.k8.view(torch.uint8)) and torch.equal(s, pre.k8_scales)


def test_rule_reads_only_sampled_rows_and_is_per_head():
    q, k, v = ac.make("randn", 2, 4, 2, 1200, 1200, 64, seed=5)
    pre = ref.preprocess(q, k, v, qk_precision="auto")
    assert pre.qk_error.shape == (2, 4) and not bool(pre.qk_fp8.any())
    # rows outside the sampled blocks (10 blocks, 8 sampled) do not matter
    left_out = [t for t in range(10) if t not in ref.sample_blocks(1200)]
    q3 = q.clone()
    for t in left_out:
        q3[..., t * 128:(t + 1) * 128, :] *= 8
    assert torch.equal(ref.preprocess(q3, k, v, qk_precision="auto").qk_error, pre.qk_error)
    # one head made near-one-hot: only that head changes its choice
    q4 = q.clone()
    q4[1, 2] *= 4
    sel = ref.preprocess(q4, k, v, qk_precision="auto").qk_fp8
    assert sel.flatten().tolist() == [False] * 6 + [True, False]


def test_short_calls_read_more_rows():
    """query_stride: every row while the rows times the keys stay within 1.5 x a long call's
    128 x 1024, then every 2nd, 4th, and every 8th (AUTO_QUERY_STRIDE) from there on, every call
    of more than 1024 tokens included; cross-attention to a short K reads every row of Q's sampled
    blocks."""
    sizes = (1, 300, 443, 444, 600, 626, 627, 885, 886, 1024, 1025, 4096, 32768)
    assert [ref.query_stride(s, s) for s in sizes] == [1, 1, 1, 2, 2, 2, 4, 4, 8, 8, 8, 8, 8]
    assert ref.query_stride(4096, 77) == 1 and ref.query_stride(77, 4096) == 1
    assert ref.query_stride(9000, 300) == 2 and ref.query_stride(4096, 512) == 4
    assert all(ref.query_stride(sq, sk) == 8 for sq in (1025, 2000, 9000) for sk in (1025, 2000, 9000))


@pytest.mark.parametrize("d, sq, seed, head, bound_catches", [(64, 300, 3, 2, False), (128, 256, 2, 1, True)])
def test_short_calls_catch_the_rows_that_flip(monkeypatch, d, sq, seed, head, bound_catches):
    """Massive shared outliers on a short call: a head whose FP4 error sits on the 2 of its 300
    rows whose top two scores are close (D 64) estimated 0.0 at every 8th row and kept FP4 (cos
    0.925); read every row, the rule gives it the precise Q·Kᵀ and it meets the target. At every
    8th row the plain ratio misses both heads; the ratio's standard error (``precision.AUTO_ERROR_SPREAD``)
    catches the D 128 one, whose sample holds some of its rows, not the D 64 one, whose sample
    holds none (estimate 1e-7)."""
    from sageattn3.reference import precision

    q, k, v = ac.make("qk_massive", 1, 4, 2, sq, sq, d, seed=seed)
    exact = ref.exact_attention(q, k, v)
    assert ref.query_stride(sq, sq) == 1
    pre = ref.preprocess(q, k, v, qk_precision="auto")
    assert bool(pre.qk_fp8[0, head]), pre.qk_error
    assert ac.cos_sim(ref.sageattn3(q, k, v)[:, head], exact[:, head]) > 0.98
    monkeypatch.setattr(precision, "query_stride", lambda sq, sk: 8)  # the stride of long calls
    pre8 = ref.preprocess(q, k, v, qk_precision="auto")  # the spread of the rows: where the sample holds them
    assert bool(pre8.qk_fp8[0, head]) == bound_catches, pre8.qk_error
    monkeypatch.setattr(precision, "AUTO_ERROR_SPREAD", 0.0)  # the plain ratio misses it
    pre8 = ref.preprocess(q, k, v, qk_precision="auto")
    assert not bool(pre8.qk_fp8[0, head]) and float(pre8.qk_error[0, head]) < 0.2
    assert ac.cos_sim(ref.sageattn3(q, k, v)[:, head], exact[:, head]) < 0.95


def test_k_block_means_restore_the_scores():
    """K smoothed per 128-key block: Q_s·K_sᵀ + delta + the block correction equals Q·Kᵀ up to a
    constant per query row (float64 check of the definition)."""
    q, k, v = ac.make("rope_bias", 1, 2, 1, 300, 300, 64, seed=2)
    pre = ref.preprocess(q, k, v, k_block_mean=True)
    mkb = ref.k_block_means(k.float())
    ks = k.double() - mkb.double()[..., torch.arange(300) // 128, :]
    s = torch.matmul(q.double(), ref.expand_kv(ks, 2).transpose(-1, -2))
    s = s + pre.k_block_corr.double()[..., torch.arange(300) // 128]
    diff = s - torch.matmul(q.double(), ref.expand_kv(k.double(), 2).transpose(-1, -2))
    assert float((diff - diff[..., :1]).abs().max()) < 1e-3
    # measured: it barely helps RoPE'd keys (docs/accuracy-auto-details.md)
    exact = ref.exact_attention(q, k, v)
    kbm = ac.cos_sim(ref.sageattn3(q, k, v, qk_precision="fp4", k_block_mean=True), exact)
    assert kbm > 0.88
    with pytest.raises(ValueError, match="qk_precision='fp4'"):
        ref.sageattn3(q, k, v, k_block_mean=True)


def test_auto_on_rotated_rows():
    """qk_rotation=True with "auto": the rule estimates on the rotated rows (the scale divided by
    D/64) and its FP8 heads multiply the MXFP8 of those rows. The estimate is the FP4 error of the
    rotated rows' codes: it equals the unrotated rule's on a preprocessing whose codes are those
    same rows turned back, and RoPE'd heads, which the rotation does not help, still take FP8."""
    q, k, v = ac.make("rope_bias", 1, 4, 2, 384, 384, 128, seed=5)
    pre = ref.preprocess(q, k, v, qk_rotation=True, qk_precision="auto")
    assert pre.qk_rotation and pre.qk_error is not None and pre.qk_error.shape == (1, 4)
    assert torch.equal(pre.qk_fp8, pre.qk_error > ref.AUTO_ERROR_LIMIT) and pre.qk_fp8.all(), pre.qk_error
    ks = ref.rotate(k.float()) - pre.mean_k
    c, s = ref.quantize_mxfp8_rows(ref.pad_dim(ks, -2, 128))
    assert torch.equal(c.view(torch.uint8), pre.k8.view(torch.uint8)) and torch.equal(s, pre.k8_scales)
    # the scale: rotate(q)·rotate(k) = 2 q·k at D 128; an estimate made with the rotated rows but
    # the unrotated scale would see twice the logits, and a larger error
    doubled = ref.qk_fp4_error(q, k, v, pre, 2 * 128 ** -0.5)
    assert torch.equal(ref.qk_fp4_error(q, k, v, pre, 128 ** -0.5), pre.qk_error)
    assert bool((doubled > pre.qk_error).all()), (doubled, pre.qk_error)
    # zero-mean data keeps FP4 with the rotation, as without it
    q0, k0, v0 = ac.make("randn", 1, 4, 2, 384, 384, 128, seed=5)
    easy = ref.preprocess(q0, k0, v0, qk_rotation=True, qk_precision="auto")
    assert not easy.qk_fp8.any(), easy.qk_error
    # every accuracy option on: no longer below the defaults on the heads FP8 serves
    exact = ref.exact_attention(q, k, v)
    dflt = ac.cos_sim(ref.sageattn3(q, k, v), exact)
    every = ac.cos_sim(ref.sageattn3(q, k, v, qk_rotation=True, qk_balance=True, qk_scale_search=True), exact)
    assert every >= 0.98 and every >= dflt - 0.002, (every, dflt)


def test_unrotate_inverts_the_rotation():
    x = torch.randn(3, 5, 128, generator=torch.Generator().manual_seed(1)) * 10
    for d in (64, 128):
        back = ref.unrotate(ref.rotate(x[..., :d]))
        assert torch.allclose(back, x[..., :d], rtol=0, atol=1e-5), (back - x[..., :d]).abs().max()
    with pytest.raises(ValueError, match="head_dim 64/128"):
        ref.unrotate(x[..., :96])


@pytest.mark.parametrize("d", [64, 128])
def test_options_are_floors_for_the_rule(d):
    """With the balance, the rotation or the scale search, the estimate is the larger of the
    options' and the defaults' (step 5 of qk_fp4_error): the defaults' one is the estimate of a
    preprocessing without options, up to the means' rounding, and where the options alone would
    keep FP4 (outliers in Q alone, balanced and rotated), the head keeps the defaults' FP8."""
    q, k, v = ac.make("q_outliers", 1, 4, 2, 512, 512, d, seed=2025)
    plain = ref.preprocess(q, k, v, qk_precision="auto")
    opts = ref.preprocess(q, k, v, qk_precision="auto", qk_rotation=True, qk_balance=True)
    assert ref.rule_has_options(opts) and not ref.rule_has_options(plain)
    mq, mk = ref.options_free_means(opts)
    assert torch.allclose(mq, plain.mean_q, rtol=1e-5, atol=1e-5) and torch.allclose(mk, plain.mean_k, atol=1e-5)
    from sageattn3.reference import precision

    options_only = precision._fp4_error(q, k, v, opts, None, plain=False)
    floor = precision._fp4_error(q, k, v, opts, None, plain=True)
    assert torch.equal(opts.qk_error, torch.maximum(options_only, floor))
    assert torch.allclose(floor, plain.qk_error, rtol=1e-3), (floor, plain.qk_error)
    assert bool((options_only <= ref.AUTO_ERROR_LIMIT).any()), options_only  # the options alone would keep FP4
    assert opts.qk_fp8.all() and plain.qk_fp8.all(), (opts.qk_error, plain.qk_error)


OPTION_SETS = ({"qk_balance": True}, {"qk_rotation": True}, {"qk_balance": True, "qk_rotation": True},
               {"qk_scale_search": True}, {"qk_balance": True, "qk_scale_search": True},
               {"qk_rotation": True, "qk_scale_search": True},
               {"qk_balance": True, "qk_rotation": True, "qk_scale_search": True})
# Distinct calls among OPTION_SETS: the rotation brings the scale search (reference.scale_search_on).
DISTINCT_OPTION_SETS = tuple(kw for kw in OPTION_SETS if not (kw.get("qk_rotation") and "qk_scale_search" in kw)) + (
    {"qk_precision": "fp8"}, {"qk_precision": "fp8", "qk_balance": True})
# How far an option may land below the defaults: an option changes K's FP4 codes, and with them
# FP4's rounding of every head, and K^ (codes plus residual), from which delta_s corrects the scores
# of every head. With K's residual in float16 (one E4M3 byte before) K^'s part is gone to a few
# millionths; what is left at 512 tokens, seed 2025, is FP4's own rounding: the balance 0.00013 on
# drifting Q means (D 64, causal) and 0.00009 on the huge K channel (D 128), and large logits at
# D 64, causal, whose heads' P·V error P's second term took away, 0.00047 below with the rotation
# (its scale search included).
K_HAT_ROUNDING = 5e-4


def test_rotation_brings_the_scale_search(monkeypatch):
    """qk_rotation=True quantizes with the scale search unless the call says qk_scale_search=False
    (the reference, sageattn3.preprocess and the kernels' argument alike: reference.scale_search_on);
    qk_balance=True does not bring it (where no channel stands out the balance changes nothing)."""
    import sageattn3
    from sageattn3._validate import _search

    q, k, v = ac.make("randn", 1, 2, 1, 300, 300, 64, seed=3)
    assert ref.preprocess(q, k, v, qk_rotation=True).qk_scale_search is True
    assert sageattn3.preprocess(q, k, v, qk_rotation=True).qk_scale_search is True
    assert ref.preprocess(q, k, v, qk_rotation=True, qk_scale_search=False).qk_scale_search is False
    assert ref.preprocess(q, k, v).qk_scale_search is False
    assert ref.preprocess(q, k, v, qk_balance=True).qk_scale_search is False
    assert torch.equal(ref.sageattn3(q, k, v, qk_rotation=True),
                       ref.sageattn3(q, k, v, qk_rotation=True, qk_scale_search=True))
    assert [_search(*a) for a in ((None, True), (None, False), (False, True), (True, False))] == [True, False, False,
                                                                                                   True]
    with pytest.raises(TypeError, match="qk_rotation"):
        _search(None, "yes")
    monkeypatch.setattr(ref, "QK_SCALE_SEARCH", True)
    assert _search(None, False) is True


@pytest.mark.parametrize("case", ac.CASES)
def test_no_option_is_worse_than_the_defaults(case):
    """Every combination of the accuracy options lands at or above the defaults, D 64 and 128,
    causal or not, on every input of the accuracy table (512 tokens here, seed 2025; the table
    itself, at 1024 tokens, prints each column's smallest difference under it), within
    K_HAT_ROUNDING; qk_precision="fp8" (with and without the balance) too. The rotation with
    qk_scale_search=False said explicitly may not: up to 0.0003 below at 1024 tokens and 0.0017 at
    512 (large logits, D 64, causal), which is why it brings the scale search."""
    for d in (64, 128):
        for causal in (False, True):
            q, k, v = ac.make(case, 1, 4, 2, 512, 512, d, seed=2025)
            exact = ref.exact_attention(q, k, v, is_causal=causal)
            dflt = ac.cos_sim(ref.sageattn3(q, k, v, is_causal=causal), exact)
            for kw in DISTINCT_OPTION_SETS:
                cos = ac.cos_sim(ref.sageattn3(q, k, v, is_causal=causal, **kw), exact)
                assert cos >= dflt - K_HAT_ROUNDING, (case, d, causal, kw, cos, dflt)


@pytest.mark.xfail(strict=True, reason="rotated FP8 loses to unrotated FP8 on a huge K channel (no per-head choice)")
def test_the_known_price_of_rotated_fp8_is_still_there():
    """The defaults' FP8 heads multiply rotated rows; on a huge constant K channel (k_sink) the
    unrotated rows do better (D 128: 0.9905 against 0.9873; both above 0.98, checked first).
    Fails (xfail strict: the suite then flags it) once the defaults reach the unrotated figure,
    as a per-head choice between the two would. (At D 64 the 16-bit rows leave no such price:
    0.9941 rotated or not.)"""
    q, k, v = ac.make("k_sink", 1, 4, 2, 1024, 1024, 128, seed=2025)
    exact = ref.exact_attention(q, k, v)
    dflt = ac.cos_sim(ref.sageattn3(q, k, v), exact)
    unrotated = ac.cos_sim(ref.sageattn3(q, k, v, qk_fp8_rotated=False), exact)
    if dflt < 0.98:
        pytest.fail(f"the defaults fell below 0.98 on k_sink: {dflt:.4f}")  # not the expected failure
    assert dflt >= unrotated - 0.001, (dflt, unrotated)


def _rule_spread():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    import rule_spread

    return rule_spread


def test_spread_bound_is_the_ratio_plus_its_standard_error(monkeypatch):
    """``spread_bound`` against the same statistic written from the residuals in float64:
    sqrt(r + z · sqrt(Σ (n_r - r d_r)² / (rows - 1) / rows · (1 - rows / seq)) / mean d), r =
    Σ n / Σ d, z = 3; never below the ratio; the plain ratio with one row, with every row read
    (rows = seq: nothing left to sample), and with z = 0. Scale-invariant where the row terms'
    squares leave float32's range (they are summed in float64): n_r, d_r times 1e20 or 1e-25 give
    the same bound."""
    from sageattn3.reference import precision

    g = torch.Generator().manual_seed(7)
    num, den = torch.rand(3, 5, 40, generator=g) ** 3, torch.rand(3, 5, 40, generator=g) + 0.5
    n, d = num.double(), den.double()
    r = n.sum(-1) / d.sum(-1)
    for seq in (320, 4096, 10**9):
        se = ((n - r[..., None] * d).square().sum(-1) / 39 / 40 * (1 - 40 / seq)).sqrt() / d.mean(-1)
        want = (r + 3.0 * se).sqrt()
        got = ref.spread_bound(num, den, seq)
        assert got.dtype == torch.float32 and torch.allclose(got.double(), want, rtol=1e-5), (seq, got, want)
        assert bool((got >= r.sqrt().float()).all()) and bool((got > r.sqrt().float() * 1.001).any())
    assert precision.AUTO_ERROR_SPREAD == 3.0
    plain = (num.sum(-1) / den.sum(-1)).sqrt()
    assert torch.allclose(ref.spread_bound(num, den, 40), plain)  # every row read
    assert torch.allclose(ref.spread_bound(num[..., :1], den[..., :1], 100), (num[..., 0] / den[..., 0]).sqrt())
    bound = ref.spread_bound(num, den, 4096)
    assert bool((bound > plain * 1.001).any())
    for f in (1e20, 1e-25):  # n_r² past float32's range, above and below
        scaled = ref.spread_bound(num * f, den * f, 4096)
        assert torch.isfinite(scaled).all() and torch.allclose(scaled, bound, rtol=1e-5), (f, scaled, bound)
    monkeypatch.setattr(precision, "AUTO_ERROR_SPREAD", 0.0)
    assert torch.allclose(ref.spread_bound(num, den, 4096).double(), r.sqrt(), rtol=1e-6)


def test_the_spread_of_the_rows_catches_a_key_of_huge_norm():
    """Key 0 of each kv head 60 times the others' norm (tests/bench/rule_spread.py's key_norm_x60,
    D 128, 2048 tokens: every 8th row): head 3's FP4 error sits on the few rows whose score on
    that key is near their others'. The plain ratio keeps it in FP4 (about 0.13), where it lands
    at 0.954 against exact attention; the bound (about 0.23) sends it to FP8 Q·Kᵀ: >= 0.98."""
    rows = _rule_spread().heads("key_norm_x60", 2048, 128, 0)
    h = rows[3]
    assert h["plain"] < ref.AUTO_ERROR_LIMIT - 0.05 and h["fp4"] < 0.96, h
    assert h["bound"] > ref.AUTO_ERROR_LIMIT + 0.02 and h["fp8"] > 0.98, h


def test_the_huge_norm_keys_head_takes_fp8_whatever_vs_scale():
    """The same head with V times 2^30 or 2^-40 (bf16): the estimate is the same bits (its rows'
    squares summed in float64), so the head still takes FP8 Q·Kᵀ. With those squares in float32 the
    spread was lost past 1e8 (the plain ratio, FP4) and changed below 1e-11."""
    q, k, v = _rule_spread().make("key_norm_x60", 2048, 128, 0)
    base = ref.qk_fp4_error(q, k, v, ref.preprocess(q, k, v))
    assert float(base[0, 3]) > ref.AUTO_ERROR_LIMIT, base
    for e in (30, -40):
        vs = v * 2.0 ** e
        assert torch.equal(ref.qk_fp4_error(q, k, vs, ref.preprocess(q, k, vs)), base), e


@pytest.mark.parametrize("d", [64, 128])
def test_zero_mean_heads_stay_fp4_with_the_spread(d):
    """The data that needs no help keeps FP4 under the bound: zero-mean Gaussian heads, 300 to
    2048 tokens (every row to every 8th), seeds 0-3, stay below the limit (at most about 0.19);
    short queries (2 to 64 rows, against as many keys or 2048) read every row, where the bound is
    the plain ratio."""
    estimates = _rule_spread().estimates
    worst = 0.0
    for seq in (300, 512, 700, 1024, 2048):
        for seed in range(4):
            q, k, v = ac.make("randn", 1, 4, 2, seq, seq, d, seed=seed)
            pre = ref.preprocess(q, k, v, qk_precision="auto")
            worst = max(worst, float(pre.qk_error.max()))
            assert not bool(pre.qk_fp8.any()), (seq, seed, pre.qk_error)
    assert worst < ref.AUTO_ERROR_LIMIT, worst
    for sq, sk in ((2, 2), (8, 8), (8, 2048), (16, 2048), (64, 64), (64, 2048)):
        q, k, v = ac.make("randn", 1, 4, 2, sq, sk, d, seed=1)
        bound, plain = estimates(q, k, v, ref.preprocess(q, k, v, qk_precision="fp4"))
        assert torch.equal(bound, plain), (sq, sk)
