"""The number formats: NVFP4 (rows and transposed), K's float16 quantization residual and MXFP8.

NVFP4 quantization (bit-exact with the CUDA kernels)
-----------------------------------------------------
Along the quantized dimension, every 16 consecutive values form a block:

1. ``amax`` = max |x| over the block, in float32. NaN propagates: a block holding a NaN has a
   NaN amax.
2. The block scale is ``e4m3(amax / 6)``: float32 division, then conversion to unsigned E4M3
   with round-to-nearest-even and saturation at 448 (an infinite amax gives 448). A NaN amax
   gives the E4M3 NaN byte 0x7F. Scale bytes never have the sign bit set.
3. If the scale value is 0 or NaN, all 16 codes are 0 (so a block with a NaN dequantizes to
   NaN everywhere, and a block of tiny values to zeros).
4. Otherwise each value is multiplied by the correctly rounded float32 reciprocal ``1/scale``
   and converted to E2M1 (magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6): round to nearest, ties to
   the even code, saturate at 6 (so +-Inf become +-6). The sign is kept, also for zero: a
   negative value that rounds to 0 gives code 8 (-0).
5. Codes pack two per byte, the first (even-index) value in the low nibble.

The kernels compute exactly this: ``amax / 6.0f``, ``__nv_cvt_float_to_fp8(satfinite, e4m3)``,
``__frcp_rn``, one float32 multiply, then the hardware ``cvt.rn.satfinite.e2m1x2.f32`` (never
fed a NaN) or an equivalent software conversion.

Layouts
-------
- rows (``quantize_rows``): x (..., N), N % 16 == 0 -> packed uint8 (..., N/2), scales
  float8_e4m3fn (..., N/16); block j of a row covers elements 16j..16j+15.
- transposed (``quantize_transposed``): x (..., S, D) -> packed (..., D, S16/2), scales
  (..., D, S16/16), where S16 is S rounded up to a multiple of 16 (zero padding): the blocks
  run along the sequence.
- MXFP8 rows (``quantize_mxfp8_rows``): x (..., N), N % 32 == 0 -> codes float8_e4m3fn (..., N),
  UE8M0 scale bytes uint8 (..., N/32); MXFP8 transposed (``quantize_mxfp8_transposed``, V for
  the FP8 P·V path): x (..., S, D) -> codes (..., D, S32), scales (..., D, S32/32), S32 = S
  rounded up to a multiple of 32 (zero padding).
"""
# One exception to "the kernels compute exactly this" above: the attention kernel's P with FP4
# Q·Kᵀ reaches step 4 as exp2 of an exponent that already subtracts log2 of its block scale,
# within about 2.6e-6 relative of the multiply where the row's max is 100 in log2 units, growing
# with it (sageattn3/csrc/attn/softmax_pquant.cuh,
# p_chunk_nvfp4; reference.sageattn3 models it as the multiply).

from __future__ import annotations

import torch

BLOCK = 16  # values per NVFP4 scale block
FP4_MAX = 6.0
E4M3_MAX = 448.0

# E2M1 code -> value (codes 8..15 are the negatives of 0..7; code 8 is -0.0).
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def e2m1_encode(y: torch.Tensor) -> torch.Tensor:
    """float32 -> E2M1 code (uint8 0..15), round to nearest, ties to even code, saturating.

    Decision thresholds (|y|): <=0.25 -> 0, <0.75 -> 0.5, <=1.25 -> 1, <1.75 -> 1.5,
    <=2.5 -> 2, <3.5 -> 3, <=5 -> 4, else 6 (+Inf included). NaN gives code 7 with the NaN's
    sign (the quantizer never encodes a NaN: a NaN makes its block's scale NaN, codes 0)."""
    y = y.float()
    a = y.abs()
    m = (
        (a > 0.25).to(torch.uint8)
        + (a >= 0.75)
        + (a > 1.25)
        + (a >= 1.75)
        + (a > 2.5)
        + (a >= 3.5)
        + (a > 5.0)
    ).to(torch.uint8)
    m = torch.where(torch.isnan(a), torch.full_like(m, 7), m)
    sign = torch.signbit(y).to(torch.uint8) << 3
    return m | sign


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    """E2M1 codes (uint8 0..15) -> float32 values."""
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=codes.device)
    return table[codes.long()]


def e4m3_scale_byte(amax: torch.Tensor, top: float = FP4_MAX) -> torch.Tensor:
    """Block amax (float32, >= 0 or NaN) -> unsigned E4M3 scale byte (uint8) of amax / top (top
    6, E2M1's largest magnitude; the scale search also tries 4), clamped to 448."""
    s = amax.float() / top
    s = torch.where(torch.isnan(s), s, s.clamp(max=E4M3_MAX))
    return s.to(torch.float8_e4m3fn).view(torch.uint8) & 0x7F


def e4m3_decode(b: torch.Tensor) -> torch.Tensor:
    """E4M3 bytes (uint8 or float8_e4m3fn) -> float32."""
    if b.dtype == torch.uint8:
        b = b.view(torch.float8_e4m3fn)
    return b.float()


def pack_codes(codes: torch.Tensor) -> torch.Tensor:
    """(..., 2n) codes -> (..., n) bytes, element 2i in the low nibble."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_codes(packed: torch.Tensor) -> torch.Tensor:
    lo = packed & 0x0F
    hi = packed >> 4
    return torch.stack((lo, hi), dim=-1).flatten(-2)


def _reciprocal(sbyte: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(ok, 1/scale) of scale bytes: ok False where the scale is 0 or NaN (1/scale 0 there), the
    correctly rounded float32 reciprocal elsewhere."""
    s = e4m3_decode(sbyte)
    ok = s > 0  # False for 0 and NaN
    return ok, torch.where(ok, torch.div(1.0, torch.where(ok, s, torch.ones_like(s))), torch.zeros_like(s))


def _block_codes(xf: torch.Tensor, sbyte: torch.Tensor) -> torch.Tensor:
    """E2M1 codes of blocks xf (..., 16) under scale bytes sbyte (..., 1): x * (1/scale) (float32
    reciprocal, one multiply), all 0 where the scale is 0 or NaN."""
    ok, inv = _reciprocal(sbyte)
    codes = e2m1_encode(xf * inv)
    return torch.where(ok, codes, torch.zeros_like(codes))


def block_sq_error(xf: torch.Tensor, codes: torch.Tensor, sbyte: torch.Tensor) -> torch.Tensor:
    """(..., 1) float32: sum over i = 0..15, in that order, of (E2M1(code_i) * scale - x_i)²,
    every operation rounded to float32 (the kernels' order; E2M1 value * scale is exact)."""
    d = e2m1_decode(codes) * e4m3_decode(sbyte) - xf
    sq = d * d
    acc = torch.zeros_like(sq[..., :1])
    for i in range(BLOCK):
        acc = acc + sq[..., i : i + 1]
    return acc


def quantize_rows(x: torch.Tensor, scale_search: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """NVFP4 along the last dim (a multiple of 16). Returns (packed uint8 (..., N/2),
    scales float8_e4m3fn (..., N/16)).

    ``scale_search``: each block is also quantized with the scale byte of amax / 4 (clamped to
    448, saturating E4M3 as above: the block max lands on E2M1's 4 instead of 6), and keeps that
    one where its squared error (``block_sq_error``) is strictly smaller than the plain scale's.
    Values between 4/6 and 6/6 of the block max fall between E2M1's two largest magnitudes;
    mapping the max onto 4 puts them on the finer part of the grid. The preprocessing quantizes
    Q and K this way when ``QK_SCALE_SEARCH`` is set; measured on the cases of
    tests/bench/accuracy.py it lowers their quantization error enough to raise the attention's
    cos-sim by about 0.002 on random data and up to 0.01 where Q has outlier channels."""
    n = x.shape[-1]
    if n % BLOCK:
        raise ValueError(f"the last dim ({n}) must be a multiple of {BLOCK}")
    xf = x.float().reshape(*x.shape[:-1], n // BLOCK, BLOCK)
    amax = xf.abs().amax(dim=-1, keepdim=True)  # propagates NaN
    sbyte = e4m3_scale_byte(amax)
    codes = _block_codes(xf, sbyte)
    if scale_search:
        byte4 = e4m3_scale_byte(amax, 4.0)
        codes4 = _block_codes(xf, byte4)
        four = block_sq_error(xf, codes4, byte4) < block_sq_error(xf, codes, sbyte)
        sbyte = torch.where(four, byte4, sbyte)
        codes = torch.where(four, codes4, codes)
    packed = pack_codes(codes.reshape(*x.shape[:-1], n))
    return packed, sbyte.reshape(*x.shape[:-1], n // BLOCK).view(torch.float8_e4m3fn)


# K's quantization residual (``quantize_residual``) is stored as float16 in units of the block's
# scale / RESIDUAL_UNIT: |x / scale - E2M1(code)| <= 1 where the scale is a normal E4M3 number below
# 448 (half an E2M1 step, or 0.4 past 6), and <= 3 where amax / 6 rounds to the smallest subnormal,
# so the stored values stay below 192 and keep float16's 11 significant bits (2^-11 relative) down
# to 2^-14 of the unit; below that float16's subnormals resolve 2^-24 of the unit (2^-30 of the
# scale). A block whose scale byte is 0 (amax / 6 below 2^-10:
# codes all 0) keeps its values in the residual, in units of E4M3's smallest subnormal 2^-9 / 64
# (``residual_scales``): |x| <= 6 * 2^-10 there, so those values stay below 192 too. (It was E4M3,
# one byte, until the options' rounding showed through it: docs/accuracy-auto-details.md, "K's residual
# in float16".)
RESIDUAL_UNIT = 64.0
F16_MAX = 65504.0


def residual_scales(scales: torch.Tensor) -> torch.Tensor:
    """The scale bytes (uint8) K's quantization residual is in units of: each block's own, and
    byte 1 (2^-9, E4M3's smallest subnormal) where the scale byte is 0."""
    b = scales if scales.dtype == torch.uint8 else scales.view(torch.uint8)
    return torch.where(b == 0, torch.ones_like(b), b)


def dequantize_rows(packed: torch.Tensor, scales: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
    """Inverse of ``quantize_rows`` (float32). With ``residual`` (``quantize_residual``), each
    value is (E2M1(code) + residual / 64) * scale (the scale of ``residual_scales``): the quantized
    x to within float16 rounding (2^-11 relative) of its quantization error, and of the rounding of
    x * (1/scale); E2M1(code) + residual / 64 is rounded once to float32 (the kernels' fma); its
    product with the scale rounds again where that sum has more than 20 significant bits (the
    kernels multiply per-block sums by the scale instead, so they do not form this product)."""
    vals = e2m1_decode(unpack_codes(packed))
    if residual is not None:
        vals = vals + residual.float() / RESIDUAL_UNIT
        scales = residual_scales(scales)
    s = e4m3_decode(scales)
    n = vals.shape[-1]
    out = vals.reshape(*vals.shape[:-1], n // BLOCK, BLOCK) * s.unsqueeze(-1)
    return out.reshape(*vals.shape[:-1], n)


def quantize_residual(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """K's NVFP4 quantization residual, what the FP4 codes miss of the smoothed K that the
    correction delta_s multiplies: x (..., N) float32 as it was quantized into (packed, scales)
    (``quantize_rows``) -> float16 (..., N), per element fp16((y - E2M1(code)) * 64) with y = x *
    (1/scale) the float32 value the E2M1 conversion rounded (the subtraction is exact: y and its
    grid value are within a factor of two, or the grid value is 0; times 64 is exact), round to
    nearest even, saturating at +-65504 (float16's largest finite value: a block whose scale saturates at 448 keeps
    its values' excess up to 1023 scales); in a block whose scale byte is 0 (codes 0) the scale is 2^-9
    (``residual_scales``), so y = x * 2^9 keeps its values; 0 in blocks whose scale is NaN.
    ``dequantize_rows(packed, scales, residual)`` adds it back."""
    n = x.shape[-1]
    xf = x.float().reshape(*x.shape[:-1], n // BLOCK, BLOCK)
    codes = unpack_codes(packed).reshape(xf.shape)
    ok, inv = _reciprocal(residual_scales(scales).unsqueeze(-1))
    r = (xf * inv - e2m1_decode(codes)) * RESIDUAL_UNIT
    r = torch.where(ok, r.clamp(-F16_MAX, F16_MAX), torch.zeros_like(r))
    return r.reshape(x.shape).to(torch.float16)


def pad_dim(x: torch.Tensor, dim: int, multiple: int) -> torch.Tensor:
    """Zero-pad ``dim`` up to a multiple of ``multiple``."""
    size = x.shape[dim]
    target = -(-size // multiple) * multiple
    if target == size:
        return x
    shape = list(x.shape)
    shape[dim] = target - size
    return torch.cat((x, torch.zeros(shape, dtype=x.dtype, device=x.device)), dim=dim)


def quantize_transposed(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """NVFP4 along the sequence: x (..., S, D) -> packed (..., D, S16/2), scales
    (..., D, S16/16), S16 = S rounded up to a multiple of 16 (zero padded)."""
    xt = pad_dim(x.float().transpose(-1, -2), -1, BLOCK)
    return quantize_rows(xt)


def dequantize_transposed(packed: torch.Tensor, scales: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Inverse of ``quantize_transposed``: back to (..., S, D) float32."""
    return dequantize_rows(packed, scales)[..., :seq_len].transpose(-1, -2)


V_TILE = 128  # keys per tile of V's power-of-two factor (the attention's key tile)
V_GROUP = 32  # channels per group of V's power-of-two factor (a group's exponent is local to V's quantization CTA)
# |e| at most. The attention keeps O in the current tile's units, so a tile 2^80 below the one
# before it scales O up by at most 2^80: with P's 2688 per key and V's 2688 per value, O stays
# finite in float32 up to about a million keys (2^±40 also covers every fp16 V: e in -5 .. 35).
V_TILE_EXP_MAX = 40


def _v_tiles(x: torch.Tensor) -> torch.Tensor:
    """x (..., S, D) -> (..., T, V_TILE, D / V_GROUP, V_GROUP) with zero rows up to T · V_TILE."""
    s = x.shape[-2]
    x = torch.nn.functional.pad(x, (0, 0, 0, -s % V_TILE))
    return x.unflatten(-1, (-1, V_GROUP)).unflatten(-3, (-1, V_TILE))


def v_tile_exponents(x: torch.Tensor) -> torch.Tensor:
    """x (..., S, D) float32, D a multiple of V_GROUP -> (..., ceil(S / V_TILE), D / V_GROUP) int8:
    per tile of V_TILE rows and V_GROUP channels, the largest e with amax · 2^e <= 2688 (448 · 6,
    the top of an NVFP4 block), amax the group's largest |value|; 0 for a group of zeros; clamped
    to +-V_TILE_EXP_MAX (0 for a NaN amax). From amax's bits (2688 = 1.3125 · 2^11): amax = 1.f ·
    2^(E - 127) gives e = 11 - (E - 127), one less where 1.f > 1.3125. Then every block scale of
    x · 2^e is at most 448 and the group's largest sits in E4M3's top binade. The group shares e:
    where its values span more than about 2^15, its smallest blocks get E4M3 subnormal or zero
    scales (the price of not clipping its largest)."""
    if x.shape[-1] % V_GROUP:
        raise ValueError(f"V's tile exponents need the head dim to be a multiple of {V_GROUP}, got {x.shape[-1]}")
    amax = _v_tiles(x.abs()).amax(dim=(-3, -1)).float().contiguous()
    bits = amax.view(torch.int32)
    e = 138 - ((bits >> 23) & 0xFF) - ((bits & 0x7FFFFF) > 0x280000).to(torch.int32)
    e = torch.where(amax > 0, e, torch.zeros_like(e)).clamp(-V_TILE_EXP_MAX, V_TILE_EXP_MAX)
    return e.to(torch.int8)


def _tile_factor(e: torch.Tensor, sign: int, rows: int) -> torch.Tensor:
    """(..., T, D / V_GROUP) exponents -> (..., rows, D) float32 factors 2^(sign · e)."""
    f = torch.exp2(sign * e.to(torch.float32)).repeat_interleave(V_TILE, dim=-2).repeat_interleave(V_GROUP, dim=-1)
    return f[..., :rows, :]


def quantize_transposed_tiled(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``quantize_transposed`` of x · 2^e per tile of V_TILE rows and V_GROUP channels
    (``v_tile_exponents``), and e: the NVFP4 of V whose blocks neither vanish (a block of V below
    about 0.006 gets scale 0 without it) nor clip (above 2688). x (..., S, D). Powers of two are
    exact: where every block's scale is an E4M3 normal both ways, the codes are
    ``quantize_transposed``'s."""
    e = v_tile_exponents(x.float())
    return (*quantize_transposed(x.float() * _tile_factor(e, 1, x.shape[-2])), e)


def dequantize_transposed_tiled(packed: torch.Tensor, scales: torch.Tensor, e: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Inverse of ``quantize_transposed_tiled``: back to (..., seq_len, D) float32."""
    rows = dequantize_transposed(packed, scales, seq_len)
    return rows * _tile_factor(e, -1, seq_len)


# ---------------------------------------------------------------------------------------------
# MXFP8 (the operands of the FP8 Q·Kᵀ path)
# ---------------------------------------------------------------------------------------------

MX_BLOCK = 32  # values per UE8M0 scale (what the block-scaled FP8 MMA takes: scale_vec::1X)
UE8M0_BIAS = 127
UE8M0_MIN_BYTE, UE8M0_MAX_BYTE = 1, 253  # 2^-126 .. 2^126: both the scale and 1/scale are normal


def ue8m0_scale_byte(amax: torch.Tensor) -> torch.Tensor:
    """Block amax (float32, >= 0) -> UE8M0 byte b (uint8): the smallest power of two 2^(b - 127)
    with amax <= 448 · 2^(b - 127), so the block's largest value lands in E4M3's top binade without
    saturating; at least 1. Exact, from amax's bits: with amax = 1.f · 2^(E - 127) (biased
    exponent E, fraction f), b = E - 8, plus 1 where 1.f > 1.75 (448 = 1.75 · 2^8). amax 0 (and
    subnormal amax) gives 1; finite amax at most 247; a NaN or infinite amax 247 or 248 (values
    then NaN / +-448)."""
    bits = amax.float().contiguous().view(torch.int32)
    e = (bits >> 23) & 0xFF
    frac = bits & 0x7FFFFF
    b = e - 8 + (frac > 0x600000).to(torch.int32)
    return b.clamp(UE8M0_MIN_BYTE, UE8M0_MAX_BYTE).to(torch.uint8)


def ue8m0_value(b: torch.Tensor) -> torch.Tensor:
    """UE8M0 bytes -> float32 2^(b - 127) (exact for the bytes ``ue8m0_scale_byte`` gives)."""
    return torch.exp2(b.to(torch.float32) - UE8M0_BIAS)


def quantize_mxfp8_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP8 along the last dim (a multiple of 32): x (..., N) -> (codes float8_e4m3fn (..., N),
    scales uint8 (..., N/32) UE8M0). Per block of 32 consecutive values: amax = max |x| (float32),
    b = ``ue8m0_scale_byte``(amax), each value times 2^(127 - b) (exact: a power of two), clamped to
    +-448 (only Inf reaches it) and converted to E4M3 with round-to-nearest-even (NaN stays NaN).
    The FP8 quantization kernel computes exactly this (bit for bit)."""
    n = x.shape[-1]
    if n % MX_BLOCK:
        raise ValueError(f"the last dim ({n}) must be a multiple of {MX_BLOCK}")
    xf = x.float().reshape(*x.shape[:-1], n // MX_BLOCK, MX_BLOCK)
    sbyte = ue8m0_scale_byte(xf.abs().amax(dim=-1, keepdim=True))
    y = (xf * torch.exp2(UE8M0_BIAS - sbyte.to(torch.float32))).clamp(-E4M3_MAX, E4M3_MAX)
    return y.to(torch.float8_e4m3fn).reshape(x.shape), sbyte.reshape(*x.shape[:-1], n // MX_BLOCK)


def dequantize_mxfp8_rows(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Inverse of ``quantize_mxfp8_rows`` (float32, exact)."""
    n = codes.shape[-1]
    vals = e4m3_decode(codes).reshape(*codes.shape[:-1], n // MX_BLOCK, MX_BLOCK)
    return (vals * ue8m0_value(scales).unsqueeze(-1)).reshape(codes.shape)


QK16_HEAD_DIM = 64  # the head dim whose precise Q·Kᵀ rung is 16-bit (``qk16_rows``), not MXFP8
# the head dim where the rule may give a head that leaves FP4 the raw 16-bit rows instead of MXFP8
# (``choose_qk16``, ``Preprocessed.qk16``)
QK16_RAW_HEAD_DIM = 128


def qk16_rows(x: torch.Tensor) -> torch.Tensor:
    """The 16-bit Q·Kᵀ operand (D 64 heads that leave FP4): x (float32) rounded to bfloat16 (to
    nearest even), as the kernels write it (``mxfp8_smooth_quant_qk`` at D 64) and multiply it
    (``mma.sync m16n8k16`` bf16, fp32 accumulation): bit for bit on finite values, infinities and
    zeros (a NaN stays a NaN, its bits may differ). Products of two bf16 values are exact in
    float32 (short of overflow and underflow); the operand keeps 8 significant bits against
    MXFP8's 4."""
    return x.to(torch.bfloat16)


def dequantize_qk_rows(codes: torch.Tensor, scales: torch.Tensor | None) -> torch.Tensor:
    """The precise Q·Kᵀ rung's operand as float32: ``qk16_rows`` (scales None, or the kernels'
    form: bf16 rows as uint8 bytes (..., 2D) with empty scales) or MXFP8 rows."""
    if scales is None or scales.numel() == 0:
        return (codes.view(torch.bfloat16) if codes.dtype == torch.uint8 else codes).float()
    return dequantize_mxfp8_rows(codes, scales)


def mxfp8_p(p: torch.Tensor) -> torch.Tensor:
    """P as the FP8 P·V kernels multiply it, dequantized (float32, same shape): P >= 0 along the
    keys (the last dim, a multiple of 32). Per row and 32-key block: hi = MXFP8 of P
    (``quantize_mxfp8_rows``); where hi holds a zero or subnormal code (exponent bits 0: a P that
    the block's scale leaves below E4M3's normal range, 2^-6, or rounds to zero), also lo = MXFP8
    of the residual P - hi (float32) with its own scale, and P̂ = hi + lo (the kernel: one more MMA
    of the block with the same V). The block's largest value sits at 256-448 once scaled, so such
    a P is more than about e^10 below it: E4M3 keeps it in a few steps of 2^-9 or as zero. A row
    whose max is an attention sink loses the other keys of the sink's block that way (28 of 32
    keys in the large-logit case), which left FP8 P·V below cos 0.98 there."""
    n = p.shape[-1]
    codes, scales = quantize_mxfp8_rows(p)
    hi = dequantize_mxfp8_rows(codes, scales)
    bits = codes.view(torch.uint8).reshape(*p.shape[:-1], n // MX_BLOCK, MX_BLOCK)
    small = ((bits & 0x78) == 0).any(dim=-1, keepdim=True)
    r = (p.float() - hi).reshape(bits.shape)
    r = torch.where(small, r, torch.zeros_like(r)).reshape(p.shape)
    return hi + dequantize_mxfp8_rows(*quantize_mxfp8_rows(r))


def quantize_mxfp8_transposed(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP8 along the sequence (V of the FP8 P·V path): x (..., S, D) -> (codes float8_e4m3fn
    (..., D, S32), scales uint8 (..., D, S32/32) UE8M0), S32 = S rounded up to a multiple of 32
    (zero padded): ``quantize_mxfp8_rows`` of xᵀ, so each channel's 32 consecutive tokens share
    one scale. This is the K-major B operand of the block-scaled FP8 MMA
    (``kind::mxf8f6f4 ... scale_vec::1X``): for P·V the contraction runs over the keys, and every
    column of V (a channel) needs its keys contiguous with one scale per 32 of them."""
    xt = pad_dim(x.float().transpose(-1, -2), -1, MX_BLOCK)
    return quantize_mxfp8_rows(xt)


def dequantize_mxfp8_transposed(codes: torch.Tensor, scales: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Inverse of ``quantize_mxfp8_transposed``: back to (..., S, D) float32 (exact)."""
    return dequantize_mxfp8_rows(codes, scales)[..., :seq_len].transpose(-1, -2)
