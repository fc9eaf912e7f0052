"""Test inputs with the structure real attention activations have: per-channel offsets in Q,
K (the outliers smoothing removes) and V. Plain i.i.d. Gaussians are FP4's worst case (flat
softmax, zero-mean output) and are not what the cos-sim targets are about."""

import torch


def qkv(b, hq, hk, sq, sk, d, dtype=torch.bfloat16, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, sq, d, generator=g) + torch.randn(d, generator=g)
    k = torch.randn(b, hk, sk, d, generator=g) + 3 * torch.randn(d, generator=g)
    v = torch.randn(b, hk, sk, d, generator=g) + 2 * torch.randn(d, generator=g)
    return q.to(dtype).to(device), k.to(dtype).to(device), v.to(dtype).to(device)
