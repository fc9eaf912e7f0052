"""The block-scaled FP4 MMA (m16n8k64, e2m1 x e2m1, ue4m3 scale_vec::4X) through the probe op:
operands placed by the PTX ISA's fragment formulas, D compared with a float64 matmul of the
dequantized operands, for every scale selector (thread-id-a 0/1, thread-id-b 0..3). In the test
flavour this checks the software model; on sm_120/121 the real instruction."""

from __future__ import annotations

import pytest
import torch

from attn_common import attn_or_skip

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
                    dtype=torch.float64)


def ue4m3(b: torch.Tensor) -> torch.Tensor:
    return b.view(torch.float8_e4m3fn).double()


def unpack(packed: torch.Tensor) -> torch.Tensor:
    """(..., 32) bytes -> (..., 64) codes, low nibble first."""
    return torch.stack((packed & 15, packed >> 4), dim=-1).flatten(-2)


def expected(a, b, sfa, sfb, c):
    av = E2M1[unpack(a).long()] * ue4m3(sfa).repeat_interleave(16, dim=-1)  # (n,16,64)
    bv = E2M1[unpack(b).long()] * ue4m3(sfb).repeat_interleave(16, dim=-1)  # (n,8,64) = B^T
    prod = av @ bv.transpose(-1, -2)
    mag = av.abs() @ bv.abs().transpose(-1, -2) + c.double().abs()
    return prod + c.double(), mag


def random_problem(n, seed, scale_lo=0x18, scale_hi=0x58):
    g = torch.Generator().manual_seed(seed)
    a = torch.randint(0, 256, (n, 16, 32), generator=g, dtype=torch.uint8)
    b = torch.randint(0, 256, (n, 8, 32), generator=g, dtype=torch.uint8)
    sfa = torch.randint(scale_lo, scale_hi, (n, 16, 4), generator=g, dtype=torch.uint8)
    sfb = torch.randint(scale_lo, scale_hi, (n, 8, 4), generator=g, dtype=torch.uint8)
    c = torch.randn(n, 16, 8, generator=g, dtype=torch.float32) * 4
    return a, b, sfa, sfb, c


@pytest.mark.parametrize("tid_a", [0, 1])
@pytest.mark.parametrize("tid_b", [0, 1, 2, 3])
def test_mma_matches_dequantized_matmul(tid_a, tid_b):
    attn_or_skip()
    from sageattn3 import _attn

    a, b, sfa, sfb, c = random_problem(64, seed=100 + 4 * tid_a + tid_b)
    d = _attn.mma_probe(a.cuda(), b.cuda(), sfa.cuda(), sfb.cuda(), c.cuda(), tid_a, tid_b).cpu()
    ref, mag = expected(a, b, sfa, sfb, c)
    assert torch.isfinite(d).all(), f"non-finite D (a wrong scale selector reads the NaN scales): {d[~torch.isfinite(d)][:8]}"
    err = (d.double() - ref).abs() / mag.clamp_min(1e-30)
    worst = int(err.flatten().argmax())
    p, rest = divmod(worst, 128)
    assert float(err.max()) < 2e-6, (
        f"tid_a={tid_a} tid_b={tid_b}: max |D - ref| / sum|terms| = {float(err.max()):.3e} at problem {p} "
        f"row {rest // 8} col {rest % 8}: got {float(d.flatten()[worst])}, want {float(ref.flatten()[worst])}"
    )


def test_mma_extreme_scales():
    """Subnormal, zero and the largest UE4M3 scales, all-zero and saturated (+-6) codes."""
    attn_or_skip()
    from sageattn3 import _attn

    a, b, sfa, sfb, c = random_problem(32, seed=7, scale_lo=0x00, scale_hi=0x7F)  # 0x7f (NaN) excluded
    a[0] = 0x77  # all +6
    b[0] = 0xFF  # all -6
    sfa[1] = 0x7E  # 448
    sfb[2] = 0x01  # 2^-9
    d = _attn.mma_probe(a.cuda(), b.cuda(), sfa.cuda(), sfb.cuda(), c.cuda(), 0, 0).cpu()
    ref, mag = expected(a, b, sfa, sfb, c)
    err = (d.double() - ref).abs() / mag.clamp_min(1e-30)
    assert float(err.max()) < 2e-6, f"max relative error {float(err.max()):.3e}"


def test_mma_lane_placement_unit_vectors():
    """A single non-zero element at every (row, k) of A: D must be exactly that row of B^T scaled,
    which pins the A fragment layout element by element (a wrong nibble/register shows as a
    moved entry, not just a small error)."""
    attn_or_skip()
    from sageattn3 import _attn

    n = 16 * 64
    a = torch.zeros(n, 16, 32, dtype=torch.uint8)
    for idx in range(n):
        r, k = divmod(idx, 64)
        a[idx, r, k // 2] = 0x02 if k % 2 == 0 else 0x20  # value 1.0 at (r, k)
    g = torch.Generator().manual_seed(3)
    b = torch.randint(0, 256, (1, 8, 32), generator=g, dtype=torch.uint8).expand(n, 8, 32).contiguous()
    sfa = torch.full((n, 16, 4), 0x38, dtype=torch.uint8)  # 1.0
    sfb = torch.randint(0x30, 0x40, (1, 8, 4), generator=g, dtype=torch.uint8).expand(n, 8, 4).contiguous()
    c = torch.zeros(n, 16, 8)
    d = _attn.mma_probe(a.cuda(), b.cuda(), sfa.cuda(), sfb.cuda(), c.cuda(), 1, 3).cpu()
    ref, _ = expected(a, b, sfa, sfb, c)
    bad = (d.double() != ref).nonzero()
    assert bad.numel() == 0, f"{bad.shape[0]} mismatching entries, first (problem,row,col) {bad[:4].tolist()}"
