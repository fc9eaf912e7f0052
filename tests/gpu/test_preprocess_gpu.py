"""Fused preprocessing on the GPU against the reference (means compared with a tolerance, the
quantized tensors bit for bit given the kernel's means, delta_s with a tolerance)."""

import pytest
import torch

from gpu_common import kernels_or_skip, same_bytes


def qkv(b, hq, hk, sq, sk, d, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, sq, d, generator=g) + torch.randn(d, generator=g)
    k = torch.randn(b, hk, sk, d, generator=g) + 3 * torch.randn(d, generator=g)
    v = torch.randn(b, hk, sk, d, generator=g) + 2 * torch.randn(d, generator=g)
    return (t.to(dtype).cuda() for t in (q, k, v))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("per_block_mean", [True, False])
@pytest.mark.parametrize("b,hq,hk,sq,sk,d", [(1, 2, 2, 128, 128, 64), (2, 4, 2, 300, 1000, 128),
                                             (1, 3, 1, 17, 5, 64), (1, 2, 1, 1, 1, 128), (1, 2, 2, 2000, 700, 48)])
def test_preprocess_matches_reference(dtype, per_block_mean, b, hq, hk, sq, sk, d):
    sa = kernels_or_skip()
    from sageattn3 import reference as ref

    q, k, v = qkv(b, hq, hk, sq, sk, d, dtype, seed=sq + sk)
    copies = [t.clone() for t in (q, k, v)]
    pre = sa.preprocess(q, k, v, per_block_mean=per_block_mean)
    for t, c in zip((q, k, v), copies):
        assert torch.equal(t, c)
    want = ref.preprocess(q.cpu(), k.cpu(), v.cpu(), per_block_mean=per_block_mean)
    assert torch.allclose(pre.mean_q.cpu(), want.mean_q, rtol=1e-5, atol=1e-5)
    assert torch.allclose(pre.mean_k.cpu(), want.mean_k, rtol=1e-5, atol=1e-5)
    # bit-exact quantization given the kernel's own means
    exact = ref.preprocess(q.cpu(), k.cpu(), v.cpu(), per_block_mean=per_block_mean,
                           mean_q=pre.mean_q.cpu(), mean_k=pre.mean_k.cpu())
    for name in ("q_packed", "q_scales", "k_packed", "k_scales", "v_packed", "v_scales"):
        got, ref_t = getattr(pre, name), getattr(exact, name)
        assert got.shape == ref_t.shape, name
        assert same_bytes(got, ref_t), name
    assert pre.delta_s.shape == want.delta_s.shape
    scale = want.delta_s.abs().max().clamp_min(1.0)
    assert (pre.delta_s.cpu() - exact.delta_s).abs().max() <= 2e-5 * scale
