"""Helpers of the FP4 attention GPU tests: whether the installed wheel's attention kernel can run
on this GPU (sm_120/121 with a normal wheel; sm_90 with the SAGEATTN3_MMA_MODEL test flavour),
inputs, and figures."""

from __future__ import annotations

import pytest
import torch

from gpu_common import sageattn3_or_skip


def attn_or_skip():
    sageattn3 = sageattn3_or_skip()
    from sageattn3 import _attn, _kernels

    if not _attn.has_kernel():
        pytest.skip("this wheel has no blockscaled_fp4_attn op")
    cc = torch.cuda.get_device_capability()
    model = _kernels.mma_model_build()  # standalone or factory-built record
    if model and cc[0] != 9:
        pytest.skip(f"MMA-model flavour runs on sm_90 only, this is sm_{cc[0]}{cc[1]}")
    if not model and cc not in ((12, 0), (12, 1)):
        pytest.skip(f"FP4 MMA needs sm_120/sm_121 (or the MMA-model test flavour on sm_90), this is sm_{cc[0]}{cc[1]}")
    return sageattn3


def make_qkv(b, hq, hk, sq, sk, d, dtype, seed=0, device="cuda"):
    """Random q, k, v with per-channel offsets (what smoothing is for)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    q = torch.randn(b, hq, sq, d, generator=g) + torch.randn(d, generator=g)
    k = torch.randn(b, hk, sk, d, generator=g) + 3 * torch.randn(d, generator=g)
    v = torch.randn(b, hk, sk, d, generator=g) + 2 * torch.randn(d, generator=g)
    return q.to(dtype).to(device), k.to(dtype).to(device), v.to(dtype).to(device)


def cos_sim(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().flatten(), b.double().flatten()
    return float((a @ b) / (a.norm() * b.norm()).clamp_min(1e-300))


def rel_l1(a: torch.Tensor, b: torch.Tensor) -> float:
    """sum |a - b| / sum |b|."""
    a, b = a.double(), b.double()
    return float((a - b).abs().sum() / b.abs().sum().clamp_min(1e-300))


def reference_selection(pre) -> dict:
    """The attention ops' per-head selection from a reference ``Preprocessed`` on the GPU (its
    qk_fp8, and at D 128 qk16 as bit 2 with the raw rows it multiplies: q16, k16), as keywords of
    ``_attn.attention_qk8`` / ``_pv8.attention_pv8`` (head_sel, raw)."""
    sel = pre.qk_fp8.to(torch.uint8)
    raw = None
    if pre.qk16 is not None:
        sel = sel | (pre.qk16.to(torch.uint8) << 2)
        raw = (pre.q16.contiguous(), pre.k16.contiguous())
    return {"head_sel": sel.contiguous(), "raw": raw}
