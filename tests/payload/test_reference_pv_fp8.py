"""MXFP8 P·V in the reference (``pv_precision="fp8"``, every head): V's MXFP8 quantizer along the
sequence bit for bit against an independent E4M3 grid, the attention's definition against a
float64 emulation of it, and its accuracy against float64 exact attention on the cases of
tests/attention_cases.py (at least FP4 P·V's everywhere). The default (``pv_precision="auto"``)
stays bit for bit the NVFP4 path where no head needs FP8 P·V (the rule: test_reference_pv_rule.py)."""

import pytest
import torch

from sageattn3 import reference as ref

import attention_cases as ac
from e4m3_oracle import e4m3_grid as _e4m3_grid
from e4m3_oracle import nearest_e4m3 as _nearest_e4m3


def _mx_oracle(x: torch.Tensor) -> torch.Tensor:
    """MXFP8 along the last dim (a multiple of 32) in float64: per 32-block, the scale 2^e with e
    the smallest integer such that amax <= 448 * 2^e (at least 2^-126), each value / 2^e rounded
    to E4M3, times 2^e."""
    xb = x.double().reshape(*x.shape[:-1], -1, 32)
    s = _mx_oracle_scale(xb)
    return (_nearest_e4m3(xb / s) * s).reshape(x.shape)


def _mx_oracle_scale(xb: torch.Tensor) -> torch.Tensor:
    """_mx_oracle's scale 2^e per 32-block (xb: (..., blocks, 32), float64)."""
    amax = xb.abs().amax(dim=-1, keepdim=True)
    e = torch.ceil(torch.log2(amax.clamp_min(1e-300) / 448.0)).clamp(-126, 126)
    return torch.exp2(torch.where(amax > 0, e, torch.full_like(e, -126.0)))


def _mx_p_oracle(p: torch.Tensor) -> torch.Tensor:
    """P as FP8 P·V multiplies it (reference.mxfp8_p's definition), from _mx_oracle: the first term,
    and where a 32-key block's first term holds a value below E4M3's normal range once scaled
    (|value| / 2^e < 2^-6: a subnormal or zero code) the MXFP8 of the residual as well."""
    hi = _mx_oracle(p)
    pb, hb = p.double().reshape(*p.shape[:-1], -1, 32), hi.reshape(*p.shape[:-1], -1, 32)
    small = ((hb / _mx_oracle_scale(pb)).abs() < 2.0**-6).any(dim=-1, keepdim=True)
    r = torch.where(small, pb - hb, torch.zeros_like(pb)).reshape(p.shape)
    return hi + _mx_oracle(r)


# ---------------------------------------------------------------------------------------------
# V's quantizer: MXFP8 along the sequence
# ---------------------------------------------------------------------------------------------


def test_transposed_layout_is_rows_of_the_padded_transpose():
    g = torch.Generator().manual_seed(3)
    v = torch.randn(2, 3, 77, 64, generator=g) * torch.exp2(torch.randint(-8, 8, (1, 1, 1, 64), generator=g).float())
    codes, scales = ref.quantize_mxfp8_transposed(v)
    assert codes.dtype == torch.float8_e4m3fn and scales.dtype == torch.uint8
    assert codes.shape == (2, 3, 64, 96) and scales.shape == (2, 3, 64, 3)  # 77 keys -> 96, 3 blocks of 32
    rows_c, rows_s = ref.quantize_mxfp8_rows(ref.pad_dim(v.transpose(-1, -2), -1, 32))
    assert torch.equal(codes.view(torch.uint8), rows_c.view(torch.uint8)) and torch.equal(scales, rows_s)
    assert bool((codes.view(torch.uint8)[..., 77:] == 0).all())  # zero padding: codes 0
    back = ref.dequantize_mxfp8_transposed(codes, scales, 77)
    assert back.shape == v.shape
    # bit for bit the independent rounding, block by block along the sequence
    want = _mx_oracle(ref.pad_dim(v.transpose(-1, -2), -1, 32))[..., :77].transpose(-1, -2)
    assert torch.equal(back.double(), want)


def test_round_trip_of_representable_values_is_exact():
    """Values on the E4M3 grid times a block's power of two, the block max in E4M3's top binade,
    come back unchanged (any sign, subnormals of the scaled grid included)."""
    grid, _ = _e4m3_grid()
    g = torch.Generator().manual_seed(5)
    blocks = []
    for e in (-20, -3, 0, 7, 30):
        vals = grid[torch.randint(len(grid), (32,), generator=g)].clone()
        vals[0] = 448.0  # the top of the grid: the scale is exactly 2^e
        blocks.append(vals * 2.0 ** e)
    x = torch.stack(blocks, dim=0).reshape(1, -1).T.float()  # (160, 1): one channel, 5 blocks along S
    codes, scales = ref.quantize_mxfp8_transposed(x)
    assert scales.flatten().tolist() == [127 - 20, 127 - 3, 127, 127 + 7, 127 + 30]
    assert torch.equal(ref.dequantize_mxfp8_transposed(codes, scales, 160), x)


def test_scale_choice_per_32_keys():
    """Each channel's 32-key block gets the smallest power of two that fits its own max under
    448; a large token only coarsens its own block (where the FP4 path's 16-key blocks
    flush the small neighbours of a large token, E4M3 keeps them to 2^-4 relative)."""
    v = torch.ones(96, 2)
    v[5, 0] = 448.0  # block 0 of channel 0: 448 -> byte 127
    v[40, 0] = 448.00003  # block 1: just past 448 -> byte 128
    v[64:, 0] = 0.75  # block 2: amax 0.75 -> 2^-9 (0.75 / 2^-9 = 384)
    codes, scales = ref.quantize_mxfp8_transposed(v)
    assert scales[0].tolist() == [127, 128, 118] and scales[1].tolist() == [119, 119, 119]
    back = ref.dequantize_mxfp8_transposed(codes, scales, 96)
    assert back[0, 0] == 1.0 and back[6, 0] == 1.0  # ones beside 448 stay exact
    assert torch.equal(back[64:, 0], torch.full((32,), 0.75))
    # the FP4 path flushes the ones beside 448 (448 / 6 -> scale 72 or 80: 1 / 80 rounds to 0)
    fp4 = ref.dequantize_transposed(*ref.quantize_transposed(v), 96)
    assert fp4[6, 0] == 0.0


def test_no_saturation_zeros_inf_and_nan():
    """Finite values never saturate (the scale puts the block max at or below 448); an all-zero
    block gets byte 1 and codes 0 (exact zeros); +-Inf become +-448 times the block's scale; a
    NaN stays NaN and its block gets byte 247 (the MXFP8 Q·Kᵀ path's policy: the block's finite
    values then quantize to 0)."""
    v = torch.zeros(128, 3)
    g = torch.Generator().manual_seed(9)
    v[:, 0] = torch.randn(128, generator=g) * 1e30
    v[32:64, 1] = 0.0
    v[:32, 1] = 1.0
    v[3, 1] = float("inf")
    v[64:96, 1] = 2.0
    v[70, 1] = float("nan")
    v[96:, 2] = -(2.0 ** -140)  # subnormal float32 inputs
    codes, scales = ref.quantize_mxfp8_transposed(v)
    back = ref.dequantize_mxfp8_transposed(codes, scales, 128)
    assert bool(torch.isfinite(back[:, 0]).all()) and float(back[:, 0].abs().max()) <= float(v[:, 0].abs().max())
    assert torch.equal(back[:, 0].double(), _mx_oracle(v[:, 0][None])[0])
    assert int(scales[1, 1]) == 1 and bool((back[32:64, 1] == 0).all())
    assert int(scales[2, 0]) == 1 and bool((back[:96, 2] == 0).all())  # zero blocks: byte 1, zeros
    assert back[3, 1] == 448.0 * 2.0 ** (int(scales[1, 0]) - 127) and int(scales[1, 0]) in (247, 248)
    assert bool(back[70, 1].isnan()) and int(scales[1, 2]) == 247
    assert bool((back[64:96, 1][torch.arange(32) != 6] == 0).all())
    # subnormal inputs: the smallest scale 2^-126, -2^-140 / 2^-126 = -2^-14 is below E4M3's
    # smallest subnormal (2^-9): it rounds to -0
    assert int(scales[2, 3]) == 1 and bool((back[96:, 2] == 0).all())


# ---------------------------------------------------------------------------------------------
# The attention with MXFP8 P·V
# ---------------------------------------------------------------------------------------------


def _emulate_fp8_pv(q, k, v, is_causal, block_n, qk_precision="auto"):
    """sageattn3(pv_precision="fp8") from the reference's own Q·Kᵀ operands and correction: the
    scores, the running max and P = exp2(t - m) in float32 as the reference computes them, then P
    and V quantized by the independent oracle (``_mx_oracle``) and P̂·V̂ and the sums in float64."""
    pre = ref.preprocess(q, k, v, pad=block_n, qk_precision=qk_precision)
    hq, sq, d = q.shape[1], q.shape[2], q.shape[3]
    qd, kd, _ = ref._dequantized(pre, hq)
    sk_p = kd.shape[-2]
    vd = ref.expand_kv(_mx_oracle(ref.pad_dim(v.double().transpose(-1, -2), -1, block_n)).transpose(-1, -2), hq)
    delta = pre.delta_s[..., ref.q_block_index(sq, pre.delta_s.shape[-2]), :]
    c = d ** -0.5 * ref.LOG2E
    rows = torch.arange(sq).unsqueeze(-1)
    m = torch.full((*q.shape[:3], 1), float("-inf"))
    l = torch.zeros_like(m, dtype=torch.float64)
    acc = torch.zeros(*q.shape[:3], d, dtype=torch.float64)
    for j0 in range(0, sk_p, block_n):
        cols = torch.arange(j0, j0 + block_n).unsqueeze(0)
        t = (qd @ kd[..., j0:j0 + block_n, :].transpose(-1, -2) + delta[..., j0:j0 + block_n]) * c
        mask = (cols >= k.shape[2]) | ((cols > rows) if is_causal else torch.zeros_like(cols > rows))
        t = t.masked_fill(mask, float("-inf"))
        m_new = torch.maximum(m, t.amax(dim=-1, keepdim=True))  # every row sees key 0 in tile 0
        alpha = torch.exp2(m - m_new).double()
        p = torch.exp2(t - m_new)
        acc = acc * alpha + _mx_p_oracle(p) @ vd[..., j0:j0 + block_n, :]
        l = l * alpha + p.double().sum(dim=-1, keepdim=True)
        m = m_new
    return acc / l


@pytest.mark.parametrize("causal", [False, True])
def test_definition_against_a_float64_emulation(causal):
    """GQA 4 over 2, 300 keys in tiles of 128 (a partial last tile), causal or not: the
    reference's FP8 P·V equals the emulation of its definition (P and V quantized bit for bit
    alike: what is left is the float32 accumulation of P̂·V̂ and of the row sums)."""
    q, k, v = ac.make("q_offset_x3", 1, 4, 2, 300, 300, 64, seed=4)
    got = ref.sageattn3(q, k, v, is_causal=causal, pv_precision="fp8").double()
    want = _emulate_fp8_pv(q, k, v, causal, 128)
    assert float((got - want).abs().max() / want.abs().max()) < 1e-5
    assert ac.cos_sim(got, want) > 0.99999999
    # and not the FP4 path's result
    fp4 = ref.sageattn3(q, k, v, is_causal=causal).double()
    assert float((fp4 - want).abs().max() / want.abs().max()) > 1e-3


def test_default_is_todays_path_bit_for_bit_where_no_head_needs_fp8_pv():
    q, k, v = ac.make("mixed_heads", 1, 4, 2, 200, 200, 128, seed=2)
    assert ref.PV_PRECISION_DEFAULT == "auto"
    base = ref.sageattn3(q, k, v)
    assert not bool(ref.preprocess(q, k, v, qk_precision="auto").pv_fp8.any())
    assert torch.equal(base, ref.sageattn3(q, k, v, pv_precision="fp4"))
    assert ref.preprocess(q, k, v).v8 is None
    pre = ref.preprocess(q, k, v, pv_precision="fp8")
    assert pre.v8.shape == (1, 2, 128, 256) and pre.v8_scales.shape == (1, 2, 128, 8)
    # the FP8 P·V call leaves every FP4 operand as it was
    plain = ref.preprocess(q, k, v)
    for name in ("q_packed", "k_packed", "v_packed"):
        assert torch.equal(getattr(pre, name), getattr(plain, name))


def test_arguments():
    q, k, v = ac.make("randn", 1, 2, 1, 64, 64, 64, seed=1)
    for bad in ("FP8", "AUTO", None):
        with pytest.raises(ValueError, match="pv_precision must be one of"):
            ref.sageattn3(q, k, v, pv_precision=bad)
    with pytest.raises(ValueError, match="multiple of 32"):
        ref.sageattn3(q, k, v, pv_precision="fp8", block_n=48)
    with pytest.raises(ValueError, match="multiple of 32"):
        ref.preprocess(q, k, v, pad=80, pv_precision="fp8")
    # any head dim (the FP8 MMA's N is the head dim): 96 works (Q·Kᵀ in FP4 there)
    q, k, v = ac.make("randn", 1, 2, 1, 100, 100, 96, seed=1)
    exact = ref.exact_attention(q, k, v)
    fp8 = ac.cos_sim(ref.sageattn3(q, k, v, pv_precision="fp8"), exact)
    assert fp8 > ac.cos_sim(ref.sageattn3(q, k, v), exact) and fp8 > 0.985


def test_nan_in_v_poisons_its_channel_as_on_the_fp4_path():
    q, k, v = ac.make("randn", 1, 2, 1, 200, 200, 64, seed=3)
    v = v.clone()
    v[0, 0, 37, 5] = float("nan")
    for pv in ("fp4", "fp8"):
        out = ref.sageattn3(q, k, v, pv_precision=pv)
        assert bool(out[..., 5].isnan().all()), pv
        assert bool(torch.isfinite(out[..., torch.arange(64) != 5]).all()), pv


# cases x (D, causal): FP8 P·V against FP4 P·V, both with the default Q·Kᵀ ("auto")
@pytest.mark.parametrize("case", ac.CASES)
def test_at_least_as_accurate_as_fp4_pv(case):
    """On every case (ordinary and hard), D 128 non-causal and D 64 causal, 256 tokens, GQA 4:2:
    cos-sim and rel-L1 against float64 exact attention at least FP4 P·V's, with the default
    Q·Kᵀ and with FP8 Q·Kᵀ."""
    for d, causal in ((128, False), (64, True)):
        q, k, v = ac.make(case, 1, 4, 2, 256, 256, d, seed=5)
        exact = ref.exact_attention(q, k, v, is_causal=causal)
        for qk in ("auto", "fp8"):
            fp4 = ref.sageattn3(q, k, v, is_causal=causal, qk_precision=qk)
            fp8 = ref.sageattn3(q, k, v, is_causal=causal, qk_precision=qk, pv_precision="fp8")
            c4, c8 = ac.cos_sim(fp4, exact), ac.cos_sim(fp8, exact)
            l4, l8 = ac.rel_l1(fp4, exact), ac.rel_l1(fp8, exact)
            assert c8 >= c4 and l8 <= l4, (d, causal, qk, c4, c8, l4, l8)


def test_fp8_pv_and_qk_lift_ordinary_and_hard_data():
    """Zero-mean data: FP4 P·V's error is most of what is left (0.981 -> 0.99 with FP8 P·V,
    0.998 with FP8 Q·Kᵀ too); near-one-hot rows and a huge K channel, where the default takes FP8
    Q·Kᵀ (0.99): FP8 P·V on top gives 0.996."""
    q, k, v = ac.make("randn", 1, 4, 2, 512, 512, 128, seed=2025)
    exact = ref.exact_attention(q, k, v)
    pv = ac.cos_sim(ref.sageattn3(q, k, v, qk_precision="fp4", pv_precision="fp8"), exact)
    both = ac.cos_sim(ref.sageattn3(q, k, v, qk_precision="fp8", pv_precision="fp8"), exact)
    assert pv >= 0.987 and both >= 0.997, (pv, both)
    for case in ("peaky", "k_sink"):
        q, k, v = ac.make(case, 1, 4, 2, 512, 512, 128, seed=2025)
        exact = ref.exact_attention(q, k, v)
        qk8 = ac.cos_sim(ref.sageattn3(q, k, v, qk_precision="fp8"), exact)
        both = ac.cos_sim(ref.sageattn3(q, k, v, qk_precision="fp8", pv_precision="fp8"), exact)
        assert both >= 0.994 and both >= qk8 + 0.003, (case, qk8, both)
