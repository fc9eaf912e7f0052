"""The FP8 P·V path (``pv_precision="fp8"``, opt-in) on the GPU:

- V's MXFP8 quantizer (``quant_mxfp8_cols``) bit for bit against
  ``reference.quantize_mxfp8_transposed`` of V padded with zero keys (ragged lengths, D 64/128 and
  other multiples of 16, GQA's Hkv heads, bf16/fp16, zero/tiny/huge/inf/NaN blocks), and its
  argument checks;
- the attention kernel with P·V in MXFP8 (``blockscaled_attn_pv8``, FP4 or FP8 Q·Kᵀ) on the
  reference's own preprocessing against ``reference.sageattn3(..., pv_precision="fp8")``
  (cos-sim >= 0.99999, as tests/gpu/test_qk_precision_gpu.py for FP8 Q·Kᵀ), on the cases of
  tests/attention_cases.py: causal and not, D 64/128, ragged lengths, GQA; and with V quantized by
  the kernel instead of the reference (the same bytes: the same output bit for bit).
"""

import dataclasses

import pytest
import torch

import attention_cases as ac
from attn_common import reference_selection
from gpu_common import kernels_or_skip, same_bytes
from test_dispatch_fp4 import fp4  # noqa: F401  (the fixture)

DTYPES = [torch.bfloat16, torch.float16]


def _quantizer_or_skip():
    kernels_or_skip()
    if not hasattr(torch.ops.sageattn3, "quant_mxfp8_cols"):
        pytest.skip("this wheel has no quant_mxfp8_cols op")
    from sageattn3 import _pv8

    return _pv8


def _special_v(shape, dtype, seed):
    """Random V over many magnitudes per channel, plus special 32-key blocks along the sequence:
    zeros, tiny values (subnormal after scaling), the format's largest, +-inf and NaN, and -0."""
    g = torch.Generator().manual_seed(seed)
    *lead, s, d = shape
    big = 60000.0 if dtype == torch.float16 else 3.0e38
    x = torch.randn(shape, generator=g) * torch.exp2(torch.randint(-12, 10, (*lead, 1, d), generator=g).float())
    if s >= 160 and d >= 8:
        x[..., 0:32, 0] = 0.0
        x[..., 32:64, 1] = 1e-7
        x[..., 64:96, 2] = big
        x[..., 70, 3] = float("inf")
        x[..., 100, 4] = float("-inf")
        x[..., 130, 5] = float("nan")
        x[..., 140:150, 6] = -0.0
        x[..., 96:128, 7] = torch.tensor([448.0, 416.0, 464.0, 480.0] * 8)  # ties at the top binade
    return x.to(dtype)


def _same_codes(a, b):
    """E4M3 bytes equal, a NaN's sign bit aside: 0x7f and 0xff both decode to NaN, and which one the
    CPU reference gives depends on the host (one host's torch gave 0xff for a bf16 NaN that the
    kernel, like another host's torch, encodes as 0x7f)."""
    a, b = (x.contiguous().view(torch.uint8).cpu() for x in (a, b))
    canon = lambda x: torch.where((x & 0x7F) == 0x7F, torch.full_like(x, 0x7F), x)  # noqa: E731
    return a.shape == b.shape and torch.equal(canon(a), canon(b))


def _check(pv8, v, seq_pad=128):
    from sageattn3 import reference as ref

    v0 = v.clone()
    codes, scales = pv8.quant_mxfp8_cols(v, seq_pad)
    want_c, want_s = ref.quantize_mxfp8_transposed(ref.pad_dim(v.float().cpu(), -2, seq_pad))
    assert codes.shape == want_c.shape and scales.shape == want_s.shape, (codes.shape, want_c.shape)
    assert codes.dtype == torch.float8_e4m3fn and scales.dtype == torch.uint8
    assert same_bytes(scales, want_s), "scale bytes differ"
    assert _same_codes(codes, want_c), "codes differ"
    nan = torch.isnan(ref.pad_dim(v.float().cpu(), -2, seq_pad)).transpose(-1, -2)
    assert torch.equal((codes.view(torch.uint8).cpu() & 0x7F) == 0x7F, nan)  # a code is NaN where V is
    assert same_bytes(v, v0)  # the input is unchanged


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 1, 1, 64), (2, 3, 77, 64), (1, 2, 129, 128), (2, 1, 1000, 128),
                                   (1, 2, 333, 80), (3, 4, 256, 64), (1, 1, 4097, 128)])
def test_v_mxfp8_is_bit_exact(dtype, shape):
    pv8 = _quantizer_or_skip()
    _check(pv8, _special_v(shape, dtype, seed=sum(shape)).cuda())


@pytest.mark.parametrize("seq_pad", [32, 64, 256])
def test_other_key_paddings(seq_pad):
    pv8 = _quantizer_or_skip()
    _check(pv8, _special_v((2, 2, 300, 128), torch.bfloat16, seed=seq_pad).cuda(), seq_pad)


@pytest.mark.parametrize("dtype", DTYPES)
def test_matches_the_reference_preprocessing_with_gqa(dtype):
    """With GQA (8 q heads, 2 kv heads) the quantizer gives reference.preprocess's v8/v8_scales."""
    pv8 = _quantizer_or_skip()
    from sageattn3 import reference as ref

    g = torch.Generator().manual_seed(11)
    q = torch.randn(2, 8, 200, 128, generator=g).to(dtype)
    k = torch.randn(2, 2, 333, 128, generator=g).to(dtype)
    v = (torch.randn(2, 2, 333, 128, generator=g) * 4).to(dtype)
    pre = ref.preprocess(q, k, v, pv_precision="fp8")
    codes, scales = pv8.quant_mxfp8_cols(v.cuda(), 128)
    assert same_bytes(codes, pre.v8) and same_bytes(scales, pre.v8_scales)


def test_non_contiguous_v_is_quantized_as_its_values():
    pv8 = _quantizer_or_skip()
    v = _special_v((2, 300, 3, 64), torch.float16, seed=4).cuda().transpose(1, 2)  # (B, S, H, D) viewed
    assert not v.is_contiguous()
    _check(pv8, v)


@pytest.mark.parametrize("bad, exc, match", [
    (lambda: torch.zeros(1, 1, 64, 64, device="cuda"), TypeError, "float16 or bfloat16"),
    (lambda: torch.zeros(64, dtype=torch.bfloat16, device="cuda"), ValueError, "at least 2 dims"),
    (lambda: torch.zeros(1, 1, 64, 40, dtype=torch.bfloat16, device="cuda"), ValueError, "multiple of 16"),
    (lambda: torch.zeros(1, 1, 64, 64, dtype=torch.bfloat16), ValueError, "CUDA tensor"),
])
def test_bad_v_is_refused_with_a_message(bad, exc, match):
    pv8 = _quantizer_or_skip()
    with pytest.raises(exc, match=match):
        pv8.quant_mxfp8_cols(bad(), 128)
    with pytest.raises(ValueError, match="multiple of 32"):
        pv8.quant_mxfp8_cols(torch.zeros(1, 1, 64, 64, dtype=torch.bfloat16, device="cuda"), 48)


def test_the_op_refuses_bad_outputs():
    """A direct torch.ops call never reaches the kernel with outputs of the wrong size."""
    _quantizer_or_skip()
    v = torch.zeros(1, 1, 100, 64, dtype=torch.bfloat16, device="cuda")
    none = torch.empty(0, device="cuda")
    codes = torch.empty(1, 1, 64, 96, dtype=torch.uint8, device="cuda")  # 96 < S = 100
    scales = torch.empty(1, 1, 64, 3, dtype=torch.uint8, device="cuda")
    with pytest.raises(RuntimeError, match="padded to a multiple of 32"):
        torch.ops.sageattn3.quant_mxfp8_cols(v, none, codes, scales)
    codes = torch.empty(1, 1, 64, 128, dtype=torch.uint8, device="cuda")
    with pytest.raises(RuntimeError, match="output sizes"):
        torch.ops.sageattn3.quant_mxfp8_cols(v, none, codes, scales)
    with pytest.raises(RuntimeError, match="float16 or bfloat16"):
        torch.ops.sageattn3.quant_mxfp8_cols(v.float(), none, codes, torch.empty(1, 1, 64, 4, dtype=torch.uint8,
                                                                           device="cuda"))


# ---------------------------------------------------------------------------------------------
# The attention with P·V in MXFP8
# ---------------------------------------------------------------------------------------------

FIGURES: list[str] = []


def _pre_to(pre, device):
    return dataclasses.replace(pre, **{f.name: getattr(pre, f.name).to(device) for f in dataclasses.fields(pre)
                                       if isinstance(getattr(pre, f.name), torch.Tensor)})


def _pv8_or_skip():
    if not hasattr(torch.ops.sageattn3, "blockscaled_attn_pv8"):
        pytest.skip("this wheel has no blockscaled_attn_pv8 op")
    from sageattn3 import _pv8

    return _pv8


def _kernel_and_reference(pv8, q, k, v, causal, qk, **out):
    """The FP8 P·V kernel on the reference's own preprocessing (FP8 Q·Kᵀ heads where ``qk`` says)
    and the reference's output: (kernel output, reference output, the preprocessing on the GPU)."""
    from sageattn3 import reference as ref

    kw = {"pv_precision": "fp8", "qk_precision": qk}
    pre = ref.preprocess(q, k, v, **kw)
    want = ref.sageattn3(q, k, v, is_causal=causal, **kw)
    g = _pre_to(pre, "cuda")
    sel = {} if qk == "fp4" else {"q8": g.q8, "q8_scales": g.q8_scales, "k8": g.k8, "k8_scales": g.k8_scales,
                                  **reference_selection(g)}
    return pv8.attention_pv8(g, g.v8, g.v8_scales, is_causal=causal, **sel, **out), want, g, sel


@pytest.mark.parametrize("qk", ["fp4", "fp8"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("case, sq, sk", [("randn", 700, 333), ("q_outliers", 129, 1000), ("k_sink", 1000, 1000),
                                          ("zero_mean_v", 300, 300)])
def test_kernel_matches_the_reference(fp4, case, sq, sk, d, causal, qk):  # noqa: F811
    pv8 = _pv8_or_skip()
    from sageattn3 import reference as ref

    q, k, v = ac.make(case, 2, 4, 2, sq, sk, d, seed=sq + d)  # GQA: 2 q heads per kv head
    got, want, g, sel = _kernel_and_reference(pv8, q, k, v, causal, qk)
    c = ac.cos_sim(got.float().cpu(), want)
    exact = ref.exact_attention(q, k, v, is_causal=causal)
    c_exact = ac.cos_sim(got.float().cpu(), exact)
    c_fp4 = ac.cos_sim(ref.sageattn3(q, k, v, is_causal=causal, qk_precision=qk), exact)
    fig = (f"{case} Sq={sq} Sk={sk} D={d} causal={causal} qk={qk}: FP8 P·V kernel vs reference cos={c:.7f}; "
           f"vs exact {c_exact:.5f} (the reference with FP4 P·V: {c_fp4:.5f})")
    FIGURES.append(fig)
    assert c >= 0.99999, fig
    # V quantized by the kernel: the same bytes, the same output
    codes, scales = pv8.quant_mxfp8_cols(v.cuda(), 128)
    assert same_bytes(codes, g.v8) and same_bytes(scales, g.v8_scales)
    again = pv8.attention_pv8(g, codes, scales, is_causal=causal, **sel)
    assert same_bytes(again, got)


@pytest.mark.parametrize("qk", ["fp4", "fp8"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [64, 128])
def test_second_term_of_p_where_a_sink_flushes_its_block(fp4, d, causal, qk, monkeypatch):  # noqa: F811
    """Large logits against sink keys (512 tokens, seed 2025: where one MXFP8 term of P left heads
    at 0.93-0.98): the sink's 32-key block takes P's second term (reference.mxfp8_p), and the
    kernel follows it (>= 0.9999999 against the reference with fp16 output, closer than to the
    one-term reference,
    which at D 64 differs from it by 0.02-0.04), with every head at or above 0.98 against exact
    attention when Q·Kᵀ is FP8 too."""
    pv8 = _pv8_or_skip()
    from sageattn3 import reference as ref
    from sageattn3.reference import attention as ref_attention

    q, k, v = ac.make("large_logits", 1, 4, 2, 512, 512, d, seed=2025)
    kw = {"pv_precision": "fp8", "qk_precision": qk}
    # fp16 output: bf16's rounding alone would put the kernel at cos 0.9999986 against the reference,
    # where a kernel that got the second term's rows wrong lands too
    got, want, _, _ = _kernel_and_reference(pv8, q, k, v, causal, qk, out_dtype=torch.float16)
    got = got.float().cpu()
    monkeypatch.setattr(ref_attention, "mxfp8_p", lambda p: ref.dequantize_mxfp8_rows(*ref.quantize_mxfp8_rows(p)))
    one_term = ref.sageattn3(q, k, v, is_causal=causal, **kw)
    exact = ref.exact_attention(q, k, v, is_causal=causal)
    c, c1, c_terms = ac.cos_sim(got, want), ac.cos_sim(got, one_term), ac.cos_sim(want, one_term)
    heads = [ac.cos_sim(got[:, h], exact[:, h]) for h in range(4)]
    fig = (f"large_logits S=512 D={d} causal={causal} qk={qk}: kernel vs reference cos={c:.9f}, vs one-term "
           f"reference {c1:.5f}; per head vs exact {min(heads):.4f}-{max(heads):.4f}")
    FIGURES.append(fig)
    # (at D 128 the sink's block holds less of each row's output: the one-term reference is within
    # 0.00006 of the two-term one there, against 0.02-0.04 at D 64)
    assert c >= 0.9999999 and c1 < c - 1e-5 and (d == 128 or c_terms < 0.999), fig
    if qk == "fp8":
        assert min(heads) >= 0.98, fig


@pytest.mark.parametrize("qk", ["fp4", "fp8", "auto"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [64, 128])
def test_public_api_takes_pv_precision(fp4, d, causal, qk):  # noqa: F811
    """sageattn3_blackwell(..., pv_precision="fp8") end to end against the reference (>= 0.9999: the
    means are summed in another order), with each qk_precision; the default stays FP4 P·V."""
    _pv8_or_skip()
    from sageattn3 import reference as ref

    q, k, v = ac.make("mixed_heads", 1, 8, 4, 700, 500, d, seed=3)
    want = ref.sageattn3(q, k, v, is_causal=causal, qk_precision=qk, pv_precision="fp8")
    out = fp4.sageattn3_blackwell(q.cuda(), k.cuda(), v.cuda(), is_causal=causal, qk_precision=qk,
                                  pv_precision="fp8")
    c = ac.cos_sim(out.float().cpu(), want)
    fp4_out = fp4.sageattn3_blackwell(q.cuda(), k.cuda(), v.cuda(), is_causal=causal, qk_precision=qk)
    FIGURES.append(f"mixed_heads D={d} causal={causal} qk={qk}: sageattn3_blackwell FP8 P·V vs reference "
                   f"cos={c:.6f}")
    assert c >= 0.9999 and not torch.equal(out, fp4_out)
    with pytest.raises(ValueError, match="pv_precision"):
        fp4.sageattn3_blackwell(q.cuda(), k.cuda(), v.cuda(), pv_precision="bf16")


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [64, 128])
def test_large_logits_in_fp16_end_to_end(fp4, d, causal):  # noqa: F811
    """What FP8 P·V is for: large logits in fp16 (the accuracy table's inputs), where NVFP4 P·V
    stays below 0.98 at D 128. sageattn3_blackwell(..., pv_precision="fp8") equals
    the reference (>= 0.9999) and reaches >= 0.99 against exact attention."""
    _pv8_or_skip()
    from sageattn3 import reference as ref

    q, k, v = ac.make("large_logits", 1, 4, 2, 1024, 1024, d, seed=2025)
    assert q.dtype == torch.float16
    out = fp4.sageattn3_blackwell(q.cuda(), k.cuda(), v.cuda(), is_causal=causal, pv_precision="fp8").float().cpu()
    c_ref = ac.cos_sim(out, ref.sageattn3(q, k, v, is_causal=causal, pv_precision="fp8"))
    exact = ref.exact_attention(q, k, v, is_causal=causal)
    c_exact = ac.cos_sim(out, exact)
    c_default = ac.cos_sim(ref.sageattn3(q, k, v, is_causal=causal), exact)
    FIGURES.append(f"large_logits fp16 D={d} causal={causal}: FP8 P·V kernel vs reference cos={c_ref:.6f}, vs exact "
                   f"{c_exact:.5f} (the defaults' reference: {c_default:.5f})")
    assert c_ref >= 0.9999 and c_exact >= 0.99


def test_fp8_pv_without_a_workspace_is_refused(fp4, monkeypatch):  # noqa: F811
    _pv8_or_skip()
    from sageattn3 import _attn

    monkeypatch.setenv(_attn.WORKSPACE_ENV, "0")  # the bounded-memory mode: no FP8 P·V kernel
    q = torch.randn(1, 2, 300, 64, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="delta_s workspace"):
        fp4.sageattn3_blackwell(q, q, q, pv_precision="fp8")


def test_fp8_pv_self_check_passes_on_this_gpu(fp4):  # noqa: F811
    """The FP8 P·V self-check's own cases (``_selfcheck.PV8_CASES``, run on a device's first
    pv_precision="fp8" call) pass on this GPU's kernels."""
    _pv8_or_skip()
    from sageattn3 import _selfcheck, api

    r = _selfcheck.run(torch.device("cuda", torch.cuda.current_device()), api._fp4_attention, _selfcheck.PV8_CASES)
    assert r.ok and len(r.figures) == len(_selfcheck.PV8_CASES) and not r.left_out, r.summary()
    FIGURES.append(f"FP8 P·V self-check: {r.summary()}")


def test_figures(capsys):
    with capsys.disabled():
        for f in FIGURES:
            print(f)
