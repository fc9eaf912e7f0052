"""The range of V's values the NVFP4 path handles (docs/accuracy.md, "The range of V's values").

V's 16-value blocks take an E4M3 scale each and nothing above it, so the attention is the same
at any scale of V only while the blocks' scales stay in E4M3's normal range. These tests hold
that range on the CPU reference (the kernels compute the same bits), and hold the gap outside it
as strict xfails: they flag themselves once V gets a factor of its own."""

from __future__ import annotations

import pytest
import torch

from sageattn3 import reference as ref

import attention_cases as ac

TOLERANCE = 0.005  # cos-sim against V at unit scale (the spread of the range measured: 0.001)


def _cos(v_scale: float, q_scale: float = 1.0, v_tile_exponent: bool = False) -> float:
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 512, 128, generator=g) for _ in range(3))
    q, k, v = (q * q_scale).half(), (k / q_scale).half(), (v * v_scale).half()
    out = ref.sageattn3(q, k, v, v_tile_exponent=v_tile_exponent)
    return ac.cos_sim(out, ref.exact_attention(q, k, v)) if bool(out.abs().sum() > 0) else 0.0


@pytest.fixture(scope="module")
def unit() -> float:
    return _cos(1.0)


@pytest.mark.parametrize("scale", [0.03, 0.1, 100.0, 1000.0])
def test_v_inside_the_range_gives_the_unit_scale_result(unit, scale):
    assert _cos(scale) >= unit - TOLERANCE, (scale, unit)


@pytest.mark.parametrize("scale", [0.01, 100.0, 1000.0])
def test_q_and_k_scaled_against_each_other_keep_the_result(unit, scale):
    """Q times s and K times 1/s: the same exact attention; tiny or huge Q or K blocks lose little."""
    assert _cos(1.0, q_scale=scale) >= unit - TOLERANCE, (scale, unit)


@pytest.mark.xfail(strict=True, reason="V has no factor above its E4M3 block scales: tiny blocks become zeros, "
                                       "huge ones are clipped")
@pytest.mark.parametrize("scale", [0.001, 0.003, 3000.0, 10000.0])
def test_v_outside_the_range_is_still_lost(unit, scale):
    assert _cos(scale) >= unit - TOLERANCE, (scale, unit)


@pytest.mark.parametrize("scale", [0.001, 0.003, 3000.0, 10000.0])
def test_v_tile_exponent_gives_the_unit_scale_result_outside_the_range(unit, scale):
    """V's power-of-two factor per 128-key tile (reference only, v_tile_exponent=True): the scales
    the plain NVFP4 of V loses come back to the unit-scale result."""
    assert _cos(scale, v_tile_exponent=True) >= unit - TOLERANCE, (scale, unit)


@pytest.mark.parametrize("case", ["randn", "large_logits", "mixed_heads"])
def test_v_tile_exponent_leaves_in_range_data_bit_for_bit(case):
    """Where every block of V has a normal E4M3 scale both ways, the factor changes no code: the
    output is the default's, bit for bit (so the table's cases keep their figures)."""
    q, k, v = ac.make(case, 1, 4, 2, 384, 384, 64, seed=5)
    assert torch.equal(ref.sageattn3(q, k, v, v_tile_exponent=True), ref.sageattn3(q, k, v))


def test_v_tile_exponents_put_each_tile_at_the_top_of_nvfp4():
    """amax · 2^e <= 2688 < amax · 2^(e+1) per 128-row tile (from the bits, checked in float64),
    0 for zeros, clamped at +-64; the dequantized tiles keep V's scale."""
    g = torch.Generator().manual_seed(9)
    x = torch.randn(2, 3, 512, 64, generator=g) * torch.exp2(torch.randint(-20, 21, (2, 3, 4, 1), generator=g)
                                                               .float()).repeat_interleave(128, dim=-2)
    x[0, 0, :128] = 0.0
    e = ref.v_tile_exponents(x)
    amax = x.abs().unflatten(-2, (4, 128)).amax(dim=(-1, -2)).double()
    live = amax > 0
    top = amax * torch.exp2(e.double())
    assert bool((top[live] <= 2688).all() and (2 * top[live] > 2688).all()) and int(e[0, 0, 0]) == 0
    assert int(ref.v_tile_exponents(torch.full((1, 128, 16), 1e-30))[0, 0]) == 64
    p, s, ee = ref.quantize_transposed_tiled(x)
    back = ref.dequantize_transposed_tiled(p, s, ee, 512)
    assert float((back - x).norm() / x.norm()) < 0.15
    with pytest.raises(ValueError, match="multiple of 128"):
        ref.quantize_transposed_tiled(x[..., :100, :])
