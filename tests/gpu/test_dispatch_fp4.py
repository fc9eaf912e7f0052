"""sageattn3_blackwell through the FP4 path, end to end, on the GPU at hand.

On an H100 this needs the MMA-model test flavour of the wheel (the FP4 MMA replaced by its
software model) and the opt-in SAGEATTN3_FORCE_FP4=1 (set here per test): then
sageattn3_blackwell preprocesses with the kernels and runs the attention kernel. Checked: the
output against the reference on the same quantization (the kernel's own preprocessed tensors,
cos-sim >= 0.999) and against exact attention (>= 0.99); dtype, shape, untouched inputs; the
self-check (once per device, skippable, and a forced mismatch = one warning, then SDPA). Without
the variable an H100 keeps the SDPA fallback. Skips without a GPU; the FP4 parts skip unless the
installed wheel is the test flavour (or the GPU is an sm_120/sm_121)."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

from attn_common import cos_sim, make_qkv, rel_l1
from gpu_common import FP4_CCS, fp4_path_or_skip, sageattn3_or_skip
from test_attn_fp4 import check_rows, exact_rows, ref_rows

FIGURES: list[str] = []


def _clean(sa):
    from sageattn3 import _selfcheck, api

    api._warned.clear()
    _selfcheck.reset()


@pytest.fixture
def fp4(monkeypatch):
    """sageattn3 with the FP4 path on (forced on sm_90 with the test flavour), fresh state."""
    sa = fp4_path_or_skip(monkeypatch)
    _clean(sa)
    yield sa
    _clean(sa)


def sdpa(q, k, v, causal):
    rep = q.shape[1] // k.shape[1]
    return F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), is_causal=causal)


def sa_warnings(fn, n=1):
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        outs = [fn() for _ in range(n)]
    return outs, [str(x.message) for x in w if "sageattn3" in str(x.message)]


SHAPES = [  # b, hq, hk, sq, sk
    (2, 8, 1, 1, 1),
    (2, 8, 1, 127, 127),
    (2, 8, 1, 128, 128),
    (2, 4, 2, 1000, 1000),
    (1, 6, 3, 300, 777),
    (1, 2, 1, 777, 129),
]


def run_case(sa, dtype, d, causal, shape, per_block_mean=True, seed=0):
    from sageattn3 import reference as ref

    b, hq, hk, sq, sk = shape
    q, k, v = make_qkv(b, hq, hk, sq, sk, d, dtype, seed=seed)
    copies = [t.clone() for t in (q, k, v)]
    # the defaults ("auto": every head FP4 on this data), but on 2 to 127 query rows "auto" gives
    # every head FP8 (reference.rule_limit): there FP4 is asked for, the path this compares
    kw = {"qk_precision": "fp4"} if 1 < sq < ref.AUTO_SHORT_QUERY_ROWS else {}
    (out,), msgs = sa_warnings(lambda: sa.sageattn3_blackwell(q, k, v, is_causal=causal, per_block_mean=per_block_mean,
                                                              **kw))
    torch.cuda.synchronize()
    assert msgs == [], msgs
    for t, c in zip((q, k, v), copies):
        assert torch.equal(t, c), "sageattn3_blackwell modified an input"
    assert out.shape == q.shape and out.dtype == dtype
    assert torch.isfinite(out).all()
    # the same quantization: the very tensors the call preprocessed (deterministic kernels)
    pre = sa.preprocess(q, k, v, per_block_mean=per_block_mean, pad=128)
    rows = check_rows(sq).to(q.device)
    got = out[..., rows, :].float()
    scale = d ** -0.5
    want_q = ref_rows(pre, rows, causal, scale)
    want_x = exact_rows(q, k, v, rows, causal, scale)
    cq, cx = cos_sim(got, want_q), cos_sim(got, want_x)
    fig = (f"{str(dtype)[6:]} D={d} causal={causal} B={b} Hq={hq} Hkv={hk} Sq={sq} Sk={sk}: vs same-quant ref "
           f"cos={cq:.6f} maxabs={float((got - want_q).abs().max()):.2e}; vs exact cos={cx:.6f} "
           f"relL1={rel_l1(got, want_x):.3e}")
    if sq * sk <= 1000 * 1000:  # and the oracle itself, preprocessing included
        full = ref.sageattn3(q, k, v, is_causal=causal, per_block_mean=per_block_mean, **kw)
        fig += f"; vs sageattn3.reference cos={cos_sim(got, full[..., rows, :]):.6f}"
    FIGURES.append(fig)
    print(fig)
    assert cq >= 0.999, fig
    assert cx >= 0.99, fig
    return out


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_forced_fp4_matches_reference(fp4, dtype, d, causal, shape):
    run_case(fp4, dtype, d, causal, shape)


def test_forced_fp4_long_gqa_and_one_mean(fp4):
    run_case(fp4, torch.bfloat16, 128, True, (2, 8, 1, 4096, 4096))
    run_case(fp4, torch.float16, 64, False, (1, 4, 4, 1000, 1000), per_block_mean=False)


def test_non_contiguous_inputs(fp4):
    q, k, v = make_qkv(1, 4, 2, 200, 200, 128, torch.bfloat16)
    qt, kt, vt = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))  # (B, S, H, D) storage
    assert not qt.is_contiguous()
    a = fp4.sageattn3_blackwell(q, k, v, is_causal=True)
    b = fp4.sageattn3_blackwell(qt, kt, vt, is_causal=True)
    assert torch.equal(a, b)


def test_backend_and_blockscaled_fp4_attn(fp4):
    cc = torch.cuda.get_device_capability()
    b = fp4.backend()
    assert b.startswith(f"fp4-sm{cc[0]}{cc[1]}" if cc in FP4_CCS else f"fp4-model-sm{cc[0]}{cc[1]}"), b
    assert fp4.is_available()
    q, k, v = make_qkv(1, 4, 1, 300, 300, 64, torch.float16)
    out = fp4.blockscaled_fp4_attn(q, k, v, is_causal=True)
    assert torch.equal(out, fp4.sageattn3_blackwell(q, k, v, is_causal=True))
    with pytest.raises(RuntimeError, match="head_dim 96"):
        fp4.blockscaled_fp4_attn(*make_qkv(1, 1, 1, 8, 8, 96, torch.float16))


def test_self_check_runs_once_per_device(fp4):
    from sageattn3 import _selfcheck, api

    # the kernels loaded once (lazy module loading of a fresh process would land in the GPU span
    # measured below), then the state reset
    _selfcheck.run(torch.device("cuda", torch.cuda.current_device()), api._fp4_attention)
    _clean(fp4)
    q, k, v = make_qkv(1, 2, 1, 256, 256, 128, torch.bfloat16)
    _, msgs = sa_warnings(lambda: fp4.sageattn3_blackwell(q, k, v), 3)
    # two groups on the first call: the default one, then FP8 P·V's (the rule may give a head FP8 P·V)
    assert msgs == [] and _selfcheck.run_count == 2
    assert "FP8 P·V self-check passed" in fp4.backend()
    r = _selfcheck.result(q.device)
    assert r.ok and len(r.figures) == len(_selfcheck.CASES)
    b = fp4.backend()
    assert "self-check passed" in b, b
    fig = (f"self-check on {r.device}: {r.summary()}; GPU span {r.gpu_ms * 1e3:.0f} us (events around the "
           f"kernel calls, Python gaps included), whole check {r.wall_ms:.1f} ms (CPU reference included)")
    FIGURES.append(fig)
    print(fig)
    assert all(f["cos"] >= 0.9999 for f in r.figures), fig  # the expected level, with headroom
    assert r.gpu_ms < 50, fig


def test_self_check_can_be_skipped(fp4, monkeypatch):
    from sageattn3 import _selfcheck

    monkeypatch.setenv(_selfcheck.SKIP_ENV, "1")
    q, k, v = make_qkv(1, 2, 1, 100, 100, 64, torch.float16)
    fp4.sageattn3_blackwell(q, k, v)
    assert _selfcheck.run_count == 0 and _selfcheck.result(q.device) is None
    assert "self-check skipped" in fp4.backend()


def test_forced_mismatch_warns_once_then_sdpa(fp4, monkeypatch):
    """A corrupted kernel (its output's channels reversed, as a wrong fragment layout would do),
    with FP4 and with FP8 Q·Kᵀ: the self-check catches it, warns once with the figures, and SDPA
    answers from then on."""
    from sageattn3 import _attn, _call, _selfcheck

    real, real8, real_call = _attn.attention_from_preprocessed, _attn.attention_qk8, _call.call
    calls = []

    def corrupted_call(q, *args, **kw):  # the one-op call (sageattn3._call), where it serves
        calls.append(q.shape[2])
        return real_call(q, *args, **kw).flip(-1)

    def corrupted(pre, **kw):
        calls.append(pre.seq_q)
        return real(pre, **kw).flip(-1)

    def corrupted8(pre, *args, **kw):
        calls.append(pre.seq_q)
        return real8(pre, *args, **kw).flip(-1)

    monkeypatch.setattr(_attn, "attention_from_preprocessed", corrupted)
    monkeypatch.setattr(_attn, "attention_qk8", corrupted8)
    monkeypatch.setattr(_call, "call", corrupted_call)
    q, k, v = make_qkv(2, 4, 2, 333, 333, 128, torch.float16)
    copies = [t.clone() for t in (q, k, v)]
    outs, msgs = sa_warnings(lambda: fp4.sageattn3_blackwell(q, k, v, is_causal=True), 3)
    assert len(msgs) == 1, msgs
    assert "FP4 SELF-CHECK FAILED" in msgs[0] and "cos-sim" in msgs[0] and "max abs error" in msgs[0]
    FIGURES.append(f"forced mismatch warning: {msgs[0]}")
    want = sdpa(q, k, v, True)
    for out in outs:
        assert torch.equal(out, want)
    assert len(calls) == len(_selfcheck.CASES)  # the check's own calls; no user call reached the kernel
    for t, c in zip((q, k, v), copies):
        assert torch.equal(t, c)
    assert fp4.backend().startswith("sdpa: the FP4 self-check failed on cuda:")
    assert not fp4.is_available()
    with pytest.raises(RuntimeError, match="self-check failed"):
        fp4.blockscaled_fp4_attn(q, k, v)


def test_sm90_without_opt_in_keeps_sdpa(monkeypatch):
    sa = sageattn3_or_skip()
    from sageattn3 import _kernels

    cc = torch.cuda.get_device_capability()
    if cc in FP4_CCS:
        pytest.skip("this GPU has the FP4 MMA")
    monkeypatch.delenv(_kernels.FORCE_FP4_ENV, raising=False)
    _clean(sa)
    want_reason = f"sm_{cc[0]}{cc[1]} has no FP4 MMA (the FP4 path needs sm_120/sm_121)"
    assert sa.backend() == f"sdpa: {want_reason}"
    q, k, v = make_qkv(2, 8, 2, 257, 257, 128, torch.bfloat16)
    outs, msgs = sa_warnings(lambda: sa.sageattn3_blackwell(q, k, v, is_causal=True), 2)
    assert len(msgs) == 1 and want_reason in msgs[0]
    assert torch.equal(outs[0], sdpa(q, k, v, True))
    if not _kernels.mma_model_build():
        monkeypatch.setenv(_kernels.FORCE_FP4_ENV, "1")
        assert "is ignored" in sa.backend()
    _clean(sa)


def test_zz_report_figures():
    sageattn3_or_skip()
    print("\n".join(FIGURES))
