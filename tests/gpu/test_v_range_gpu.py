"""V's tile exponents on the GPU (docs/accuracy.md, "The range of V's values"): the preprocessing
kernels give the reference's codes, scales and exponents bit for bit; the attention kernels
(FP4 and FP8 Q·Kᵀ, the bounded-memory mode, FP4 and FP8 P·V) give the reference's output at any
scale of V; and where no block of V is out of range the output is the plain path's, bit for bit."""

from __future__ import annotations

import pytest
import torch

import attention_cases
from attn_common import attn_or_skip, cos_sim
from gpu_common import kernels_or_skip, same_bytes


def _v(b, hk, sk, d, dtype, seed):
    """V whose (128-key, 32-channel) tiles range over 2^-24 .. 2^24 in scale (so the exponents change
    from tile to tile in every group), one tile all zeros."""
    g = torch.Generator().manual_seed(seed)
    tiles = -(-sk // 128)
    f = torch.exp2(torch.randint(-24, 25, (b, hk, tiles, 1, d // 32, 1), generator=g).float())
    v = (torch.randn(b, hk, tiles, 128, d // 32, 32, generator=g) * f).reshape(b, hk, tiles * 128, d)[:, :, :sk]
    v = v.clone()
    v[0, 0, :min(sk, 128), :32] = 0.0
    return v.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("b,hk,sk,d,pad", [(1, 2, 300, 128, 128), (2, 1, 1000, 64, 128), (1, 3, 130, 64, 16),
                                           (1, 1, 1, 128, 16)])
def test_v_exponents_codes_and_scales_are_the_references(dtype, b, hk, sk, d, pad):
    """quant_fp4_cols with exponents (the preprocessing op's V launch) against
    reference.quantize_transposed_tiled: codes, scales and exponents bit for bit, for every input
    dtype, a last tile shorter than 128 keys and paddings that are not multiples of 128."""
    kernels_or_skip()
    from sageattn3 import _kernels, reference as ref

    v = _v(b, hk, sk, d, dtype, seed=sk + d).cuda()
    if dtype == torch.float16:
        v = v.clamp(-60000, 60000)
    vp, vsc, e = _kernels.quant_cols(v, pad, exps=True)
    rp, rs, re_ = ref.quantize_transposed_tiled(ref.pad_dim(v.cpu().float(), -2, vp.shape[-1] * 2))
    assert same_bytes(vp, rp) and same_bytes(vsc, rs)
    assert e.dtype == torch.int8 and torch.equal(e.cpu(), re_)


def test_v_exponents_clamp_and_nan_are_the_references():
    """Groups far outside +-40 (fp32 V at 1e+-30) take the clamped exponent, a group holding a NaN
    takes 0, and inf takes -40: the kernel's exponents are the reference's, and so are the codes and
    scales of the groups without NaN."""
    kernels_or_skip()
    from sageattn3 import _kernels, reference as ref

    g = torch.Generator().manual_seed(2)
    v = torch.randn(1, 1, 512, 128, generator=g)
    v[0, 0, :128, :32] *= 1e30
    v[0, 0, 128:256, 32:64] *= 1e-30
    v[0, 0, 300, 70] = float("nan")
    v[0, 0, 400, 100] = float("inf")
    vp, vsc, e = _kernels.quant_cols(v.cuda(), 128, exps=True)
    rp, rs, re_ = ref.quantize_transposed_tiled(v)
    assert torch.equal(e.cpu(), re_)
    assert [int(re_[0, 0, 0, 0]), int(re_[0, 0, 1, 1]), int(re_[0, 0, 2, 2]), int(re_[0, 0, 3, 3])] == [-40, 40, 0, -40]
    ok = torch.ones(128, dtype=torch.bool)
    ok[64:96] = False  # the NaN's group: its codes are whatever NaN makes of them
    assert same_bytes(vp[..., ok, :], rp[..., ok, :]) and same_bytes(vsc[..., ok, :], rs[..., ok, :])


@pytest.mark.parametrize("d", [64, 128])
def test_extreme_tiles_keep_the_output_finite(d):
    """Tiles 2^80 apart in one group (bf16 V of 1e16, then 1e-17): O in the later tile's units grows
    by 2^80 and stays finite; the kernel gives the reference's NVFP4 P·V output (D 64: 2^-e in the
    epilogue, D 128: in the last stage). (V of 1e16 is past what its tile exponent's clamp at 2^-40
    brings into NVFP4's range, so its blocks clip: the rule's estimate with V's share gives such
    heads FP8 P·V by default, as the reference's "auto" does here.)"""
    attn_or_skip()
    from sageattn3 import _attn, reference as ref

    q, k, v = attention_cases.make("randn", 1, 2, 1, 256, 256, d, seed=4, device="cuda")
    v = v.float()
    v[..., :128, :] *= 1e16
    v[..., 128:, :] *= 1e-17
    q, k, v = q.bfloat16(), k.bfloat16(), v.bfloat16()
    pre = ref.preprocess(q, k, v, pad=128)
    assert pre.v_exp[0, 0, :, 0].tolist() == [-40, 40]
    got = _attn.attention_from_preprocessed(pre)
    assert bool(torch.isfinite(got).all())
    assert cos_sim(got.float().cpu(), ref.sageattn3(q.cpu(), k.cpu(), v.cpu(), pv_precision="fp4")) >= 0.99999
    assert bool(ref.preprocess(q.cpu(), k.cpu(), v.cpu(), qk_precision="auto").pv_fp8.all())


def test_bad_v_exp_is_refused():
    """A v_exp of the wrong dtype, of fewer tiles than v, or of the wrong shape at the op: an error
    that names it."""
    attn_or_skip()
    from sageattn3 import _attn, reference as ref

    q, k, v = attention_cases.make("randn", 1, 2, 1, 300, 300, 64, seed=1, device="cuda")
    pre = ref.preprocess(q, k, v, pad=128)
    ops = (pre.q_packed, pre.q_scales, pre.k_packed, pre.k_scales, pre.v_packed, pre.v_scales, pre.mean_q)
    kw = dict(mean_q_global=pre.mean_q_global, delta_key=pre.delta_key, k_residual=pre.k_residual, seq_q=300,
              seq_k=300)
    with pytest.raises(TypeError, match="v_exp"):
        _attn.fp4_attention(*ops, v_exp=pre.v_exp.float(), **kw)
    with pytest.raises(ValueError, match="v_exp"):
        _attn.fp4_attention(*ops, v_exp=pre.v_exp[:, :, :2], **kw)
    out = torch.empty(1, 2, 300, 64, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(RuntimeError, match="v_exp"):
        torch.ops.sageattn3.blockscaled_fp4_attn(
            *(t.view(torch.uint8) for t in ops[:6]), pre.v_exp.view(torch.uint8)[:, :, :2].contiguous(), pre.mean_q,
            pre.mean_q_global, pre.delta_key, pre.k_residual, torch.empty(0, device="cuda"), out,
            300, 300, 0.125, False)
    x = torch.randn(2, 300, 64, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="exps"):
        torch.ops.sageattn3.quant_fp4_cols(x, torch.empty(2, 64, 152, dtype=torch.uint8, device="cuda"),
                                           torch.empty(2, 64, 19, dtype=torch.uint8, device="cuda"),
                                           torch.empty(2, 2, 2, dtype=torch.uint8, device="cuda"))


@pytest.mark.parametrize("scale", [1e-3, 3e-3, 1.0, 3e3, 1e4])
@pytest.mark.parametrize("d,causal", [(128, False), (64, True)])
def test_attention_at_any_scale_of_v_is_the_references(scale, d, causal):
    """The attention kernel on preprocessed tensors against the reference (same quantized inputs)
    with V scaled by `scale`: >= 0.99999, and against exact attention the unit-scale result."""
    attn_or_skip()
    from sageattn3 import _attn, reference as ref

    q, k, v = attention_cases.make("randn", 1, 4, 2, 700, 900, d, seed=3, device="cuda")
    q, k, v = q.half(), k.half(), (v.float() * scale).half()
    pre = ref.preprocess(q, k, v, pad=128)
    got = _attn.attention_from_preprocessed(pre, is_causal=causal, out_dtype=torch.float16).float().cpu()
    want = ref.sageattn3(q.cpu(), k.cpu(), v.cpu(), is_causal=causal)
    assert cos_sim(got, want) >= 0.99999
    exact = ref.exact_attention(q.cpu(), k.cpu(), v.cpu(), is_causal=causal)
    assert cos_sim(got, exact) >= 0.97


@pytest.mark.parametrize("mode", ["fp4", "fp8_qk", "bounded", "fp8_pv", "mixed"])
@pytest.mark.parametrize("d,causal", [(128, False), (64, True)])
def test_every_kernel_path_takes_v_of_wide_range(mode, d, causal, monkeypatch):
    """V whose tiles span 2^-24 .. 2^24 (and a tile of zeros) through each attention kernel path,
    per q head against the reference with that head's precisions (the same quantized inputs):
    >= 0.99999. "mixed": per head FP4 or FP8 Q·Kᵀ and FP4 (V's exponents) or FP8 P·V, one op."""
    attn_or_skip()
    from sageattn3 import _attn, _pv8, reference as ref

    q, k, _ = attention_cases.make("randn", 1, 4, 2, 520, 777, d, seed=11, device="cuda")
    v = _v(1, 2, 777, d, torch.bfloat16, seed=5).cuda()
    q, k = q.bfloat16(), k.bfloat16()
    if mode == "bounded":
        monkeypatch.setenv(_attn.WORKSPACE_ENV, "0")
    bits = {"fp4": [0] * 4, "bounded": [0] * 4, "fp8_qk": [1] * 4, "fp8_pv": [2] * 4, "mixed": [1, 2, 3, 0]}[mode]
    pre = ref.preprocess(q, k, v, pad=128, qk_precision="fp8", pv_precision="fp8")
    sel = torch.tensor([bits], dtype=torch.uint8, device="cuda")
    q8 = dict(q8=pre.q8, q8_scales=pre.q8_scales, k8=pre.k8, k8_scales=pre.k8_scales)
    if mode in ("fp4", "bounded"):
        got = _attn.attention_from_preprocessed(pre, is_causal=causal)
    elif mode == "fp8_qk":
        got = _attn.attention_qk8(pre, sel, is_causal=causal, **q8)
    elif mode == "fp8_pv":
        got = _pv8.attention_pv8(pre, pre.v8, pre.v8_scales, is_causal=causal)
    else:
        got = _pv8.attention_pv8(pre, pre.v8, pre.v8_scales, head_sel=sel, by_head=True, is_causal=causal, **q8)
    qc, kc, vc = q.cpu(), k.cpu(), v.cpu()
    for h, bit in enumerate(bits):
        want = ref.sageattn3(qc, kc, vc, qk_precision="fp8" if bit & 1 else "fp4",
                             pv_precision="fp8" if bit & 2 else "fp4", is_causal=causal)[:, h]
        assert cos_sim(got[:, h].float().cpu(), want) >= 0.99999, (mode, h)


@pytest.mark.parametrize("d", [64, 128])
def test_in_range_v_gives_the_plain_paths_bits(d):
    """V at unit scale: the exponents change no code (the scales are the plain ones times 2^e), and
    the kernel's output is the plain path's (no exponents) bit for bit: the rescale by
    2^(e_t - e_(t-1)) and 2^-e are exact. V times 8 gives 8 times the output, bit for bit."""
    attn_or_skip()
    from sageattn3 import _attn, reference as ref

    q, k, v = attention_cases.make("randn", 1, 4, 2, 640, 1100, d, seed=7, device="cuda")
    pre = ref.preprocess(q, k, v, pad=128)
    plain = ref.preprocess(q, k, v, pad=128, v_tile_exponent=False)
    assert same_bytes(pre.v_packed, plain.v_packed) and bool((pre.v_exp != 0).any())
    back = ref.dequantize_transposed_tiled(pre.v_packed.cpu(), pre.v_scales.cpu(), pre.v_exp.cpu(), 1100)
    assert torch.equal(back, ref.dequantize_transposed(plain.v_packed.cpu(), plain.v_scales.cpu(), 1100))
    a = _attn.attention_from_preprocessed(pre)
    assert torch.equal(a, _attn.attention_from_preprocessed(plain))
    pre8 = ref.preprocess(q, k, (v.float() * 8).to(v.dtype), pad=128)
    assert torch.equal(_attn.attention_from_preprocessed(pre8), a * 8)
