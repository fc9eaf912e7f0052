"""The reference NVFP4 quantizer against hand-computed values."""

import math

import pytest
import torch

from sageattn3 import reference as ref

NAN, INF = float("nan"), float("inf")
POS = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def enc(values):
    return ref.e2m1_encode(torch.tensor(values, dtype=torch.float32)).tolist()


def test_every_code_point_round_trips():
    for code, value in enumerate(ref.E2M1_VALUES):
        assert enc([value]) == [code]
        assert ref.e2m1_decode(torch.tensor([code], dtype=torch.uint8)).item() == value
    assert math.copysign(1.0, ref.e2m1_decode(torch.tensor([8], dtype=torch.uint8)).item()) == -1.0


@pytest.mark.parametrize(
    "value,code",
    [
        (0.25, 0), (0.75, 2), (1.25, 2), (1.75, 4), (2.5, 4), (3.5, 6), (5.0, 6),  # ties -> even code
        (0.2500001, 1), (0.7499999, 1), (1.2500001, 3), (1.7499999, 3), (2.5000002, 5), (3.4999998, 5), (5.0000005, 7),
        (0.1, 0), (0.6, 1), (2.2, 4), (4.9, 6), (5.5, 7),
        (6.5, 7), (100.0, 7), (3.0e38, 7), (INF, 7),  # saturation
    ],
)
def test_rounding_ties_and_saturation(value, code):
    assert enc([value]) == [code]
    assert enc([-value]) == [code | 8]


def test_signed_zero_and_nan_encoding():
    assert enc([0.0, -0.0, -0.1]) == [0, 8, 8]
    assert enc([NAN]) == [7]
    assert enc([-NAN]) == [15]


def test_pack_low_nibble_first():
    x = torch.tensor([[0.5, 6.0] + [0.0] * 14], dtype=torch.float32)  # amax 6 -> scale 1
    packed, scales = ref.quantize_rows(x)
    assert packed[0, 0].item() == (7 << 4) | 1
    assert scales.view(torch.uint8).item() == 0x38  # E4M3 1.0


def block(*vals):
    vals = list(vals) + [0.0] * (16 - len(vals))
    return torch.tensor([vals], dtype=torch.float32)


def quant(x):
    packed, scales = ref.quantize_rows(x)
    codes = ref.unpack_codes(packed)[0].tolist()
    return codes, scales.view(torch.uint8)[0].tolist()


def test_scale_exact_power_of_two():
    codes, sb = quant(block(12.0, -3.0, 1.0, 0.5, 7.0))  # amax 12 -> scale 2.0 (0x40)
    assert sb == [0x40]
    # 6 -> 7; -1.5 -> 8|3; 0.5 -> 1; 0.25 (tie) -> 0; 3.5 (tie) -> 6 (4.0)
    assert codes[:5] == [7, 8 | 3, 1, 0, 6]


def test_hand_computed_block():
    # amax = 7: 7/6 = 1.1666.. -> E4M3 1.125 (0x39); 1/1.125 = 0.8888889 (fp32).
    x = block(7.0, -3.0, 1.0, 0.3, 2.0, -0.9, 4.5, 6.0)
    codes, sb = quant(x)
    assert sb == [0x39]
    inv = torch.tensor(1.0, dtype=torch.float32) / torch.tensor(1.125, dtype=torch.float32)
    scaled = (x[0, :8] * inv).tolist()  # 6.22, -2.67, 0.89, 0.27, 1.78, -0.8, 4.0, 5.33
    assert [round(v, 3) for v in scaled] == [6.222, -2.667, 0.889, 0.267, 1.778, -0.8, 4.0, 5.333]
    assert codes[:8] == [7, 8 | 5, 2, 1, 4, 8 | 2, 6, 7]


def test_scale_rounds_to_nearest_even():
    # amax/6 = 1.0625 lies halfway between E4M3 1.0 and 1.125 -> even mantissa (1.0).
    assert quant(block(6.375))[1] == [0x38]
    # amax/6 = 1.1875: halfway between 1.125 (odd) and 1.25 (even) -> 1.25 (0x3A)
    assert quant(block(7.125))[1] == [0x3A]


def test_scale_saturates_at_448():
    codes, sb = quant(block(1.0e6, 448.0, -2688.0))
    assert sb == [0x7E]  # 448
    assert codes[:3] == [7, 2, 8 | 7]  # 1e6/448 saturates; 448/448 = 1; -2688/448 = -6


def test_subnormal_scale():
    # amax = 6 * 2^-9 -> scale 2^-9, the smallest E4M3 subnormal (byte 0x01).
    codes, sb = quant(block(6 * 2.0**-9, -3 * 2.0**-9))
    assert sb == [0x01]
    assert codes[:2] == [7, 8 | 5]


def test_zero_and_underflowing_blocks_give_zero_codes():
    assert quant(block()) == ([0] * 16, [0])
    # amax/6 below half the smallest subnormal: scale 0 -> all codes 0 (no -0 codes either).
    assert quant(block(-1e-5, 1e-5, -0.0)) == ([0] * 16, [0])


def test_inf_in_block():
    codes, sb = quant(block(INF, 448.0, -INF, 2.0))
    assert sb == [0x7E]  # inf/6 saturates to 448
    assert codes[:4] == [7, 2, 15, 0]  # +-inf -> +-6; 2/448 -> 0


def test_nan_in_block_poisons_the_block():
    x = torch.cat((block(NAN, 1.0, 2.0), block(1.0, 2.0)), dim=1)
    packed, scales = ref.quantize_rows(x)
    assert scales.view(torch.uint8)[0, 1].item() == quant(block(1.0, 2.0))[1][0] == 0x2B  # 2/6 -> 0.34375
    assert scales.view(torch.uint8)[0, 0].item() == 0x7F  # E4M3 NaN
    assert ref.unpack_codes(packed)[0, :16].tolist() == [0] * 16
    deq = ref.dequantize_rows(packed, scales)
    assert torch.isnan(deq[0, :16]).all()
    assert torch.isfinite(deq[0, 16:]).all()
    x2 = block(-NAN, 1.0)
    assert quant(x2)[1] == [0x7F]


def test_input_dtypes_agree():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(8, 64, generator=g).to(torch.bfloat16)
    p32, s32 = ref.quantize_rows(x.float())
    p16, s16 = ref.quantize_rows(x)
    assert torch.equal(p32, p16) and torch.equal(s32.view(torch.uint8), s16.view(torch.uint8))
    xh = x.to(torch.float16)
    ph, sh = ref.quantize_rows(xh)
    assert torch.equal(ph, p32) and torch.equal(sh.view(torch.uint8), s32.view(torch.uint8))


def test_quantize_is_idempotent_on_representable_values():
    g = torch.Generator().manual_seed(2)
    codes = torch.randint(0, 16, (32, 128), generator=g, dtype=torch.uint8)
    codes[:, ::16] = 7  # every block holds a +6, so amax = 6 * scale exactly
    sbytes = torch.randint(1, 0x7F, (32, 8), generator=g, dtype=torch.uint8)  # finite, > 0
    packed, scales = ref.pack_codes(codes), sbytes.view(torch.float8_e4m3fn)
    x = ref.dequantize_rows(packed, scales)
    p2, s2 = ref.quantize_rows(x)
    assert torch.equal(s2.view(torch.uint8), sbytes)
    # -0 codes (8) come back as 8 only where the value is -0.0 exactly: compare values.
    assert torch.equal(ref.dequantize_rows(p2, s2), x)


def test_round_trip_error_is_bounded():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(64, 256, generator=g) * torch.logspace(-1, 2, 64).unsqueeze(1)  # normal scales, no saturation
    p, s = ref.quantize_rows(x)
    xh = ref.dequantize_rows(p, s)
    blocks = x.reshape(64, 16, 16)
    amax = blocks.abs().amax(-1, keepdim=True)
    err = (xh.reshape(64, 16, 16) - blocks).abs()
    # half the largest E2M1 gap (2 -> 1) times a scale that is at most 1/16 above amax/6
    assert (err <= amax / 6 * (1 + 1 / 16) + 1e-30).all()
    assert ref.cosine_similarity(xh, x) > 0.99


def test_transposed_layout():
    g = torch.Generator().manual_seed(4)
    x = torch.randn(2, 3, 17, 32, generator=g).to(torch.bfloat16)
    p, s = ref.quantize_transposed(x)
    assert p.shape == (2, 3, 32, 16) and s.shape == (2, 3, 32, 2)
    xt = torch.cat((x.float().transpose(-1, -2), torch.zeros(2, 3, 32, 15)), dim=-1)
    p2, s2 = ref.quantize_rows(xt)
    assert torch.equal(p, p2) and torch.equal(s.view(torch.uint8), s2.view(torch.uint8))
    back = ref.dequantize_transposed(p, s, 17)
    assert back.shape == x.shape
    assert ref.cosine_similarity(back, x.float()) > 0.99
    # the padded tokens (17..31) are zero codes
    assert (ref.unpack_codes(p)[..., 17:] == 0).all()


def test_last_dim_must_be_multiple_of_16():
    with pytest.raises(ValueError, match="multiple of 16"):
        ref.quantize_rows(torch.zeros(3, 24))


# ---- the scale search (the preprocessing's quantizer for Q and K) ----


def _search(values):
    x = torch.tensor(values, dtype=torch.float32).reshape(1, -1)
    p, s = ref.quantize_rows(x, scale_search=True)
    return ref.dequantize_rows(p, s)[0].tolist(), s.view(torch.uint8)[0].tolist()


def test_scale_search_maps_the_max_onto_4_where_that_loses_less():
    # amax 6: the plain scale 1 puts 5 on a tie (-> 4, error 1 each); scale 1.5 puts it on
    # 3 * 1.5 = 4.5 (error 0.25) and 6 on 4 * 1.5 exactly
    values, scale = _search([5.0] * 15 + [6.0])
    assert values == [4.5] * 15 + [6.0]
    assert scale == [ref.e4m3_scale_byte(torch.tensor(6.0 / 4 * 6)).item()]  # the byte of 1.5
    plain = ref.dequantize_rows(*ref.quantize_rows(torch.tensor([[5.0] * 15 + [6.0]])))[0].tolist()
    assert plain == [4.0] * 15 + [6.0]


def test_scale_search_keeps_the_plain_scale_on_ties_and_special_blocks():
    # exact either way (error 0 both): the plain scale stays
    x = torch.tensor([[6.0] + [0.0] * 15, [0.0] * 16, [NAN] + [1.0] * 15, [INF] + [1.0] * 15,
                      [-3.0e38] + [2.0] * 15])
    p0, s0 = ref.quantize_rows(x)
    p1, s1 = ref.quantize_rows(x, scale_search=True)
    assert torch.equal(p0, p1) and torch.equal(s0.view(torch.uint8), s1.view(torch.uint8))


def test_scale_search_never_loses_and_wins_often():
    g = torch.Generator().manual_seed(3)
    x = torch.cat([torch.randn(4096, 16, generator=g) * torch.exp(2 * torch.randn(4096, 1, generator=g)),
                   torch.rand(1024, 16, generator=g), torch.randn(1024, 16, generator=g) ** 3])
    p0, s0 = ref.quantize_rows(x)
    p1, s1 = ref.quantize_rows(x, scale_search=True)
    e0 = ref.block_sq_error(x.reshape(-1, 1, 16), ref.unpack_codes(p0).reshape(-1, 1, 16), s0.view(torch.uint8).reshape(-1, 1, 1))
    e1 = ref.block_sq_error(x.reshape(-1, 1, 16), ref.unpack_codes(p1).reshape(-1, 1, 16), s1.view(torch.uint8).reshape(-1, 1, 1))
    changed = (s0.view(torch.uint8) != s1.view(torch.uint8)).reshape(-1)
    assert (e1 <= e0).all()
    assert (e1.reshape(-1)[changed] < e0.reshape(-1)[changed]).all()
    # the other candidate is always the byte of amax / 4
    amax = x.abs().amax(dim=-1)
    byte4 = (amax / 4).to(torch.float8_e4m3fn).view(torch.uint8)
    assert torch.equal(s1.view(torch.uint8).reshape(-1)[changed], byte4[changed])
    assert 0.2 < changed.float().mean() < 0.8
    # an independent check in float64: each block's result is the better of the two candidates,
    # each quantized on its own (value = E2M1 grid point nearest x / scale, saturating at 6)
    def candidate(div):
        amax = x.abs().amax(dim=-1, keepdim=True).double()
        s = (amax / div).clamp(max=448.0).float().to(torch.float8_e4m3fn).double()
        grid = torch.tensor(POS, dtype=torch.float64)
        y = (x.double() / torch.where(s > 0, s, torch.ones_like(s))).abs().clamp(max=6.0)
        near = grid[(y.unsqueeze(-1) - grid).abs().argmin(dim=-1)] * torch.sign(x.double())
        return (((near * s) - x.double()) ** 2).sum(dim=-1)
    best = torch.minimum(candidate(6.0), candidate(4.0))
    got = ((ref.dequantize_rows(p1, s1).double() - x.double()) ** 2).sum(dim=-1)
    assert bool((got <= best * (1 + 1e-6) + 1e-30).all())
    # relative to each block's own error, the search removes a good share of it
    ratio = (e1 / e0.clamp_min(1e-30)).reshape(-1)[e0.reshape(-1) > 0]
    assert ratio.mean() < 0.9


def test_block_sq_error_sums_in_order_in_float32():
    # (E2M1(code) * scale - x)² summed left to right in float32: 2^24 + 1 rounds back to 2^24
    # (twice), where the reverse order (1 + 1 + 2^24) or float64 would give 2^24 + 2
    x = torch.tensor([[[4096.0, 1.0, 1.0] + [0.0] * 13]])
    codes = torch.zeros(1, 1, 16, dtype=torch.uint8)
    sbyte = torch.tensor([[[0x38]]], dtype=torch.uint8)  # scale 1.0
    assert ref.block_sq_error(x, codes, sbyte).item() == 2.0 ** 24
    assert ref.block_sq_error(x.flip(-1), codes, sbyte).item() == 2.0 ** 24 + 2
