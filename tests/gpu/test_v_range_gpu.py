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
    """V whose (128-key, 32-channel) tiles range over 2^-24 .. 2^24 in scale, one tile all zeros."""
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
def test_every_kernel_path_takes_v_of_wide_range(mode, monkeypatch):
    """V whose tiles span 2^-24 .. 2^24 (and a tile of zeros) through each attention kernel path,
    per q head against the reference with that head's precisions (the same quantized inputs):
    >= 0.99999. "mixed": per head FP4 or FP8 Q·Kᵀ and FP4 (V's exponents) or FP8 P·V, one op."""
    attn_or_skip()
    from sageattn3 import _attn, _pv8, reference as ref

    q, k, _ = attention_cases.make("randn", 1, 4, 2, 520, 777, 128, seed=11, device="cuda")
    v = _v(1, 2, 777, 128, torch.bfloat16, seed=5).cuda()
    q, k = q.bfloat16(), k.bfloat16()
    if mode == "bounded":
        monkeypatch.setenv(_attn.WORKSPACE_ENV, "0")
    bits = {"fp4": [0] * 4, "bounded": [0] * 4, "fp8_qk": [1] * 4, "fp8_pv": [2] * 4, "mixed": [1, 2, 3, 0]}[mode]
    pre = ref.preprocess(q, k, v, pad=128, qk_precision="fp8", pv_precision="fp8")
    sel = torch.tensor([bits], dtype=torch.uint8, device="cuda")
    q8 = dict(q8=pre.q8, q8_scales=pre.q8_scales, k8=pre.k8, k8_scales=pre.k8_scales)
    if mode in ("fp4", "bounded"):
        got = _attn.attention_from_preprocessed(pre)
    elif mode == "fp8_qk":
        got = _attn.attention_qk8(pre, sel, **q8)
    elif mode == "fp8_pv":
        got = _pv8.attention_pv8(pre, pre.v8, pre.v8_scales)
    else:
        got = _pv8.attention_pv8(pre, pre.v8, pre.v8_scales, head_sel=sel, by_head=True, **q8)
    qc, kc, vc = q.cpu(), k.cpu(), v.cpu()
    for h, bit in enumerate(bits):
        want = ref.sageattn3(qc, kc, vc, qk_precision="fp8" if bit & 1 else "fp4",
                             pv_precision="fp8" if bit & 2 else "fp4")[:, h]
        assert cos_sim(got[:, h].float().cpu(), want) >= 0.99999, (mode, h)


@pytest.mark.parametrize("d", [64, 128])
def test_in_range_v_gives_the_plain_paths_bits(d):
    """V at unit scale: the exponents change no code (the scales are the plain ones times 2^e), and
    the kernel's output is the plain path's (no exponents) bit for bit: the rescale by
    2^(e_t - e_(t-1)) and 2^-e are exact. V times 8 gives 8 times the output, bit for bit."""
    attn_or_skip()
    from sageattn3 import _attn, _kernels, reference as ref

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
