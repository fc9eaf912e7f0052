"""The reference SageAttention3 algorithm against exact attention, and its building blocks."""

import math

import pytest
import torch
import torch.nn.functional as F

from sageattn3 import reference as ref

from payload_data import qkv


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seq", [1, 17, 128, 1000])
def test_cos_sim_against_exact(d, causal, seq):
    q, k, v = qkv(1, 2, 2, seq, seq, d, seed=seq + d)
    out = ref.sageattn3(q, k, v, is_causal=causal)
    assert out.shape == q.shape and out.dtype == torch.float32
    assert ref.cosine_similarity(out, ref.exact_attention(q, k, v, is_causal=causal)) >= 0.99


@pytest.mark.parametrize("hq,hk", [(4, 2), (6, 1)])
@pytest.mark.parametrize("causal", [False, True])
def test_gqa_and_mqa(hq, hk, causal):
    q, k, v = qkv(2, hq, hk, 200, 200, 64, seed=hq)
    out = ref.sageattn3(q, k, v, is_causal=causal)
    assert ref.cosine_similarity(out, ref.exact_attention(q, k, v, is_causal=causal)) >= 0.99


@pytest.mark.parametrize("sq,sk", [(50, 300), (300, 50)])
def test_different_q_and_kv_lengths(sq, sk):
    q, k, v = qkv(1, 2, 2, sq, sk, 64, seed=5)
    for causal in (False, True):
        out = ref.sageattn3(q, k, v, is_causal=causal)
        assert ref.cosine_similarity(out, ref.exact_attention(q, k, v, is_causal=causal)) >= 0.99


def test_whole_sequence_q_mean_and_fp16():
    q, k, v = qkv(1, 2, 2, 300, 300, 128, dtype=torch.float16, seed=7)
    out = ref.sageattn3(q, k, v, per_block_mean=False)
    assert ref.cosine_similarity(out, ref.exact_attention(q, k, v)) >= 0.99


def test_exact_attention_matches_sdpa():
    q, k, v = qkv(1, 4, 2, 33, 45, 64, dtype=torch.float32, seed=8)
    kk, vv = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    for causal in (False, True):
        want = F.scaled_dot_product_attention(q, kk, vv, is_causal=causal)
        assert torch.allclose(ref.exact_attention(q, k, v, is_causal=causal), want, atol=1e-5)


@pytest.mark.parametrize("rotation", [False, True])
def test_preprocess_layout_and_smoothing(rotation):
    q, k, v = qkv(2, 4, 2, 300, 200, 64, seed=9)
    pre = ref.preprocess(q, k, v, per_block_mean=True, pad=128, qk_rotation=rotation)
    assert pre.qk_rotation is rotation
    turn = ref.rotate if rotation else (lambda x: x.float())
    assert pre.q_packed.shape == (2, 4, 384, 32) and pre.q_scales.shape == (2, 4, 384, 4)
    assert pre.k_packed.shape == (2, 2, 256, 32) and pre.k_scales.shape == (2, 2, 256, 4)
    assert pre.v_packed.shape == (2, 2, 64, 128) and pre.v_scales.shape == (2, 2, 64, 16)
    assert pre.delta_s.shape == (2, 4, 3, 256) and pre.delta_s.dtype == torch.float32
    assert pre.mean_q.shape == (2, 4, 3, 64) and pre.mean_k.shape == (2, 2, 1, 64)
    assert pre.mean_q_global.shape == (2, 4, 1, 64) and pre.delta_key.shape == (2, 4, 256)
    # the means are the (rotated) means; the last Q block averages only its 44 real tokens
    assert torch.allclose(pre.mean_q[:, :, 2], turn(q[:, :, 256:].float()).mean(-2), atol=1e-5)
    assert torch.allclose(pre.mean_k[:, :, 0], turn(k.float()).mean(-2), atol=1e-5)
    assert torch.allclose(pre.mean_q_global[:, :, 0], turn(q.float()).mean(-2), atol=1e-5)
    # padding rows/columns are zero codes and zero scales; delta_s padding is 0
    assert (pre.q_packed[:, :, 300:] == 0).all() and (pre.q_scales.view(torch.uint8)[:, :, 300:] == 0).all()
    assert (pre.k_packed[:, :, 200:] == 0).all()
    assert (ref.unpack_codes(pre.v_packed)[..., 200:] == 0).all()
    assert (pre.delta_s[..., 200:] == 0).all() and (pre.delta_key[..., 200:] == 0).all()
    # delta_s = delta_key + (mean_q - mean_q_global) . K^T, kv head h // 2 for q head h, with
    # delta_key = mean_q_global . K_s^T of the unquantized smoothed (rotated) K and K^ the dequantized
    # K plus its quantization residual (float16, zero in padding rows)
    assert pre.k_residual.shape == (2, 2, 256, 64) and pre.k_residual.dtype == torch.float16
    assert (pre.k_residual.view(torch.int16)[:, :, 200:] == 0).all()
    kdq = ref.dequantize_rows(pre.k_packed, pre.k_scales, pre.k_residual)[:, :, :200]
    dkey = pre.mean_q_global[:, 3] @ (turn(k.float()) - pre.mean_k)[:, 1].transpose(-1, -2)
    assert torch.allclose(pre.delta_key[:, 3, :200], dkey[:, 0], rtol=1e-5, atol=1e-4)
    want = dkey + (pre.mean_q[:, 3] - pre.mean_q_global[:, 3]) @ kdq[:, 1].transpose(-1, -2)
    assert torch.allclose(pre.delta_s[:, 3, :, :200], want, rtol=1e-5, atol=1e-4)
    # ... which is mean_q . (K - mean_k)^T (the unquantized correction) up to a constant per row
    ks = turn(k.float()) - pre.mean_k
    loose = pre.mean_q[:, 3] @ ks[:, 1].transpose(-1, -2)
    assert ref.cosine_similarity(pre.delta_s[:, 3, :, :200] - pre.delta_s[:, 3, :, :200].mean(-1, keepdim=True),
                                 loose - loose.mean(-1, keepdim=True)) > 0.99
    # dequantized smoothed K has ~zero mean; dequantized Q + mean ~ Q (rotated)
    kd = ref.dequantize_rows(pre.k_packed, pre.k_scales)[:, :, :200]
    assert kd.mean(-2).abs().max() < 0.2
    qd = ref.dequantize_rows(pre.q_packed, pre.q_scales)[:, :, :300] + pre.mean_q[:, :, ref.q_block_index(300, 3)]
    assert ref.cosine_similarity(qd, turn(q.float())) > 0.99


@pytest.mark.parametrize("d", [32, 64])
def test_preprocess_with_given_means_is_the_quantizer(d):
    q, k, v = qkv(1, 2, 1, 130, 40, d, seed=10)
    mq = torch.randn(1, 2, 2, d)
    mk = torch.randn(1, 1, 1, d)
    pre = ref.preprocess(q, k, v, mean_q=mq, mean_k=mk, pad=16, qk_rotation=True)
    assert pre.qk_rotation is (d == 64)  # where it applies
    turn = ref.rotate if d == 64 else (lambda x: x.float())
    qs = turn(q) - mq[:, :, ref.q_block_index(130, 2)]
    p, s = ref.quantize_rows(ref.pad_dim(qs, -2, 16), scale_search=pre.qk_scale_search)  # on with the rotation
    assert torch.equal(p, pre.q_packed) and torch.equal(s.view(torch.uint8), pre.q_scales.view(torch.uint8))
    p, s = ref.quantize_rows(ref.pad_dim(turn(k) - mk, -2, 16), scale_search=pre.qk_scale_search)
    assert torch.equal(p, pre.k_packed)


def test_smoothing_matters_for_k_outliers():
    # a large per-channel K offset: without smoothing FP4 would drown the signal; with it the
    # result stays close (softmax is invariant to K's mean).
    q, k, v = qkv(1, 2, 2, 256, 256, 64, seed=11)
    k = (k.float() + 40 * torch.randn(64)).to(k.dtype)
    out = ref.sageattn3(q, k, v)
    assert ref.cosine_similarity(out, ref.exact_attention(q, k, v)) >= 0.99


def test_p_quantization_maps_row_max_to_2688():
    # One key tile: the row max of P is exactly 2688 = 448 * 6, whose block scale is 448.
    t = torch.tensor([[0.0, -1.0, -2.0] + [-30.0] * 13])
    p = torch.exp2(t - t.amax(-1, keepdim=True)) * ref.P_SCALE
    packed, scales = ref.quantize_rows(p)
    assert p.max().item() == 2688.0
    assert scales.view(torch.uint8).item() == 0x7E
    assert ref.dequantize_rows(packed, scales)[0, :3].tolist() == [2688.0, 1344.0, 448.0 * 1.5]


def test_sm_scale_and_block_n():
    q, k, v = qkv(1, 1, 1, 100, 300, 64, seed=12)
    out = ref.sageattn3(q, k, v, sm_scale=0.05, block_n=64)
    assert ref.cosine_similarity(out, ref.exact_attention(q, k, v, sm_scale=0.05)) >= 0.99
    with pytest.raises(ValueError):
        ref.sageattn3(q, k, v, block_n=40)


def test_sampled_means_on_long_sequences():
    """Past 1024 tokens K's mean and mean_q_global come from 8 evenly spaced 128-token blocks:
    exactly the mean of those rows, not of the whole sequence."""
    q, k, v = qkv(1, 2, 1, 2000, 3000, 64, seed=4)
    assert ref.sample_blocks(3000) == [0, 3, 6, 9, 12, 15, 18, 21] and ref.sample_blocks(2000) == [0, 2, 4, 6, 8, 10, 12, 14]
    rows = torch.cat([torch.arange(t * 128, min(3000, t * 128 + 128)) for t in ref.sample_blocks(3000)])
    pre = ref.preprocess(q, k, v, per_block_mean=True)
    assert torch.allclose(pre.mean_k[:, :, 0], k[:, :, rows].float().mean(-2), atol=1e-6)
    assert not torch.allclose(pre.mean_k[:, :, 0], k.float().mean(-2), atol=1e-3)
    qrows = torch.cat([torch.arange(t * 128, t * 128 + 128) for t in ref.sample_blocks(2000)])
    assert torch.allclose(pre.mean_q_global[:, :, 0], q[:, :, qrows].float().mean(-2), atol=1e-6)
    one = ref.preprocess(q, k, v, per_block_mean=False)
    assert torch.equal(one.mean_q, pre.mean_q_global)
    assert one.k_residual is None  # one Q mean: no block residuals, delta_s = delta_key
    # the attention does not depend on the smoothing vectors: against exact attention the
    # output is as close as with the whole-sequence means (the paper's)
    exact = ref.exact_attention(q, k, v)
    ours = ref.cosine_similarity(ref.sageattn3(q, k, v), exact)
    paper = ref.cosine_similarity(ref.sageattn3_paper(q, k, v), exact)
    assert ours > 0.99 and abs(ours - paper) < 2e-3
