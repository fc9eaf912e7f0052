"""The range of V's values the NVFP4 path handles (docs/accuracy.md, "The range of V's values").

V's 16-value blocks take an E4M3 scale each; alone, the attention is the same at any scale of V
only while the blocks' scales stay in E4M3's normal range. With V's power-of-two factor per tile
of 128 keys and 32 channels (the default, as the kernels do) it is the same at any scale. These
tests hold that on the CPU reference (the kernels compute the same bits: tests/gpu), and keep the
plain path's gap (v_tile_exponent=False) measured."""

from __future__ import annotations

import pytest
import torch

from sageattn3 import reference as ref

import attention_cases as ac

TOLERANCE = 0.005  # cos-sim against V at unit scale (the spread of the range measured: 0.001)


def _cos(v_scale: float, q_scale: float = 1.0, v_tile_exponent: bool = True) -> float:
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 512, 128, generator=g) for _ in range(3))
    q, k, v = (q * q_scale).half(), (k / q_scale).half(), (v * v_scale).half()
    # NVFP4 P·V pinned: these tests are about NVFP4 V's range ("auto" moves a head whose V the range
    # clips to MXFP8 P·V: test_the_default_takes_fp8_pv_where_nvfp4_v_loses)
    out = ref.sageattn3(q, k, v, v_tile_exponent=v_tile_exponent, pv_precision="fp4")
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


@pytest.mark.parametrize("scale", [0.001, 0.003, 3000.0, 10000.0])
def test_v_outside_the_range_gives_the_unit_scale_result(unit, scale):
    """The scales the plain NVFP4 of V loses come back to the unit-scale result with the defaults."""
    assert _cos(scale) >= unit - TOLERANCE, (scale, unit)


@pytest.mark.parametrize("scale", [0.001, 0.003, 3000.0, 10000.0])
def test_the_plain_path_loses_v_outside_the_range(unit, scale):
    """Without the factor (v_tile_exponent=False) those scales lose accuracy: what the factor is for."""
    assert _cos(scale, v_tile_exponent=False) < unit - 0.05, (scale, unit)


def test_v_with_tiny_and_huge_channel_groups_in_one_tile():
    """A tile whose 32-channel groups differ by 2^33 in scale: each group keeps its own range."""
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 2, 384, 128, generator=g) for _ in range(3))
    v = v * torch.tensor([1e-5, 1.0, 1e5, 1.0]).repeat_interleave(32)
    q, k, v = q.half(), k.half(), v.float()
    out, exact = ref.sageattn3(q, k, v), ref.exact_attention(q, k, v)
    for grp in range(4):
        sl = slice(32 * grp, 32 * grp + 32)
        assert ac.cos_sim(out[..., sl], exact[..., sl]) > 0.97, grp


@pytest.mark.parametrize("case", ["randn", "large_logits", "mixed_heads"])
def test_v_tile_exponent_leaves_in_range_data_bit_for_bit(case):
    """Where every block of V has a normal E4M3 scale both ways, the factor changes no code: the
    output is the default's, bit for bit (so the table's cases keep their figures)."""
    q, k, v = ac.make(case, 1, 4, 2, 384, 384, 64, seed=5)
    assert torch.equal(ref.sageattn3(q, k, v), ref.sageattn3(q, k, v, v_tile_exponent=False))


def test_v_tile_exponents_put_each_tile_at_the_top_of_nvfp4():
    """amax · 2^e <= 2688 < amax · 2^(e+1) per tile of 128 rows and 32 channels (from the bits,
    checked in float64), 0 for zeros and NaN, clamped at +-40; rows past a multiple of 128 form a last,
    shorter tile; the dequantized tiles keep V's scale."""
    g = torch.Generator().manual_seed(9)
    f = torch.exp2(torch.randint(-20, 21, (2, 3, 4, 1, 2, 1), generator=g).float())
    x = (torch.randn(2, 3, 4, 128, 2, 32, generator=g) * f).reshape(2, 3, 512, 64)[:, :, :500].contiguous()
    x[0, 0, :128, :32] = 0.0
    e = ref.v_tile_exponents(x)
    assert e.shape == (2, 3, 4, 2) and e.dtype == torch.int8
    padded = torch.nn.functional.pad(x, (0, 0, 0, 12))
    amax = padded.abs().unflatten(-1, (2, 32)).unflatten(-3, (4, 128)).amax(dim=(-1, -3)).double()
    live = amax > 0
    top = amax * torch.exp2(e.double())
    assert bool((top[live] <= 2688).all() and (2 * top[live] > 2688).all()) and int(e[0, 0, 0, 0]) == 0
    assert int(ref.v_tile_exponents(torch.full((1, 128, 32), 1e-30))[0, 0, 0]) == ref.V_TILE_EXP_MAX == 40
    assert int(ref.v_tile_exponents(torch.full((1, 128, 32), 1e30))[0, 0, 0]) == -40
    assert int(ref.v_tile_exponents(torch.full((1, 128, 32), float("nan")))[0, 0, 0]) == 0
    p, s, ee = ref.quantize_transposed_tiled(x)
    back = ref.dequantize_transposed_tiled(p, s, ee, 500)
    assert float((back - x).norm() / x.norm()) < 0.15
    with pytest.raises(ValueError, match="multiple of 32"):
        ref.v_tile_exponents(x[..., :48])


def test_a_group_shares_its_exponent():
    """The price of one exponent per 32 channels: a channel 2^18 above the other 31 of its group
    keeps its values (plain NVFP4 clips it), and those 31 fall to E4M3 subnormal or zero scales (the
    plain path keeps them). The other groups are untouched, and the whole output gains."""
    g = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(1, 2, 384, 64, generator=g) for _ in range(3))
    v[..., 0] *= 2.0 ** 18
    q, k, v = q.bfloat16(), k.bfloat16(), v.bfloat16()
    exact = ref.exact_attention(q, k, v)
    tiled = ref.sageattn3(q, k, v, pv_precision="fp4")
    plain = ref.sageattn3(q, k, v, v_tile_exponent=False, pv_precision="fp4")
    big, rest, other = slice(0, 1), slice(1, 32), slice(32, 64)
    assert ac.cos_sim(tiled[..., big], exact[..., big]) > 0.97 > ac.cos_sim(plain[..., big], exact[..., big])
    assert ac.cos_sim(tiled[..., rest], exact[..., rest]) < 0.9 < ac.cos_sim(plain[..., rest], exact[..., rest])
    assert torch.equal(tiled[..., other], plain[..., other])
    assert ac.cos_sim(tiled, exact) > ac.cos_sim(plain, exact) + 0.1


@pytest.mark.parametrize("scale", [0.001, 3000.0])
def test_the_default_takes_fp8_pv_where_nvfp4_v_loses(unit, scale):
    """Plain NVFP4 V (v_tile_exponent=False) at scales it cannot hold: the P·V rule's V share moves
    every head to MXFP8 P·V, at or above the unit-scale result."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 512, 128, generator=g) for _ in range(3))
    q, k, v = q.half(), k.half(), (v * scale).half()
    pre = ref.preprocess(q, k, v, qk_precision="auto", v_tile_exponent=False)
    assert bool(pre.pv_fp8.all()), pre.pv_error
    out = ref.sageattn3(q, k, v, v_tile_exponent=False)
    assert ac.cos_sim(out, ref.exact_attention(q, k, v)) >= unit - TOLERANCE
