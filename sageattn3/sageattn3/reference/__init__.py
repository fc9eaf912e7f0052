"""Pure-PyTorch reference of everything sageattn3 computes: the oracle of the kernel tests.

Runs on any device (CPU included); everything is computed in float32.

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

The quantized attention (``sageattn3``)
----------------------------------------
See ``rotate``, ``preprocess`` / ``Preprocessed`` and ``sageattn3`` below for the exact
definition of the Q/K rotation, the smoothing, the correction ``delta_s`` and the two-level
quantization of P; ``sageattn3_paper`` is the published algorithm, for comparison.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

BLOCK = 16  # values per NVFP4 scale block
FP4_MAX = 6.0
E4M3_MAX = 448.0
P_SCALE = E4M3_MAX * FP4_MAX  # 2688: where the row max of P is mapped (two-level quantization)
Q_MEAN_BLOCK = 128  # tokens per Q mean block (per_block_mean=True)
# K's mean and Q's mean over the whole sequence (mean_q_global, and Q's only mean without
# per_block_mean) come from up to this many evenly spaced 128-token blocks (``sample_blocks``).
# The attention does not depend on them: any vector subtracted from K changes every score of a
# query row by the same amount (the softmax ignores it), and mean_q_global only splits the
# correction delta_s (exact for any value). They decide how well a channel bias is removed before
# the quantization; a sample does that as well as the whole sequence on data whose bias is a
# property of the channel, and it lets the kernels know the means before they read Q and K, so
# each is read once.
MEAN_SAMPLE_BLOCKS = 8
LOG2E = 1.4426950408889634

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


# K's quantization residual (``quantize_residual``) is stored as E4M3 in units of the block's
# scale / RESIDUAL_UNIT: |x / scale - E2M1(code)| <= 1 where the scale is a normal E4M3 number below
# 448 (half an E2M1 step, or 0.4 past 6), and <= 3 where amax / 6 rounds to the smallest subnormal,
# so the stored values stay below 192 and their relative precision (2^-4) reaches down to 2^-12 of
# the scale. A block whose scale byte is 0 (amax / 6 below 2^-10: codes all 0) keeps its values in
# the residual, in units of E4M3's smallest subnormal 2^-9 / 64 (``residual_scales``): |x| <= 6 *
# 2^-10 there, so those bytes stay below 192 too.
RESIDUAL_UNIT = 64.0


def residual_scales(scales: torch.Tensor) -> torch.Tensor:
    """The scale bytes (uint8) K's quantization residual is in units of: each block's own, and
    byte 1 (2^-9, E4M3's smallest subnormal) where the scale byte is 0."""
    b = scales if scales.dtype == torch.uint8 else scales.view(torch.uint8)
    return torch.where(b == 0, torch.ones_like(b), b)


def dequantize_rows(packed: torch.Tensor, scales: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
    """Inverse of ``quantize_rows`` (float32). With ``residual`` (``quantize_residual``), each
    value is (E2M1(code) + residual / 64) * scale (the scale of ``residual_scales``): the quantized
    x to within E4M3 rounding (2^-4 relative) of its quantization error, and of the rounding of
    x * (1/scale); E2M1(code) + residual / 64 is exact in float32 (at most 19 significant bits),
    as is its product with the scale."""
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
    (``quantize_rows``) -> float8_e4m3fn (..., N), per element e4m3((y - E2M1(code)) * 64) with
    y = x * (1/scale) the float32 value the E2M1 conversion rounded (the subtraction is exact: y
    and its grid value are within a factor of two, or the grid value is 0; times 64 is exact),
    round to nearest even, saturating at +-448; in a block whose scale byte is 0 (codes 0) the scale
    is 2^-9 (``residual_scales``), so y = x * 2^9 keeps its values; 0 in blocks whose scale is NaN.
    ``dequantize_rows(packed, scales, residual)`` adds it back."""
    n = x.shape[-1]
    xf = x.float().reshape(*x.shape[:-1], n // BLOCK, BLOCK)
    codes = unpack_codes(packed).reshape(xf.shape)
    ok, inv = _reciprocal(residual_scales(scales).unsqueeze(-1))
    r = (xf * inv - e2m1_decode(codes)) * RESIDUAL_UNIT
    r = torch.where(ok, r.clamp(-E4M3_MAX, E4M3_MAX), torch.zeros_like(r))
    return r.reshape(x.shape).to(torch.float8_e4m3fn)


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


# ---------------------------------------------------------------------------------------------
# Q/K rotation
# ---------------------------------------------------------------------------------------------

ROTATION_HEAD_DIMS = (64, 128)  # head dims the rotation applies to (the FP4 kernel's)
# Sign vector of the rotation: bit d set -> channel d is negated (the first D bits for head dim
# D). Drawn once: random.Random(3).getrandbits(128). csrc/preprocess/rotation.cuh holds the same
# bits (a CPU test compares them).
ROTATION_SIGN_BITS = 0x216363698B529B4A97B750923CEB3FFD
ROTATION_SCALE = 0.125  # 2^-3: exact in float32
# What sageattn3_blackwell / preprocess do unless told otherwise: off. Measured on an H100 (the
# MMA-model test flavour, 24 heads x 32k tokens, D 128, back to back) the rotation makes Q's and
# K's launch 0.252 -> 0.407 ms, about +45% of the whole preprocessing (3 shuffle stages of 16
# values per row block, on top of the software E2M1), far over the 5% it could cost to be on by
# default; alone it helps with Q outlier channels at D 128 and with outliers Q and K share, hurts
# with K outlier channels, and is within noise elsewhere (after the channel balance it helps
# wherever outliers are: README, "Accuracy"). qk_rotation=True turns it on.
QK_ROTATION_DEFAULT = False


def rotation_applies(head_dim: int) -> bool:
    return head_dim in ROTATION_HEAD_DIMS


def rotation_signs(head_dim: int, device=None) -> torch.Tensor:
    """(D,) float32: -ROTATION_SCALE where bit d of ROTATION_SIGN_BITS is set, else +ROTATION_SCALE."""
    bits = torch.tensor([(ROTATION_SIGN_BITS >> d) & 1 for d in range(head_dim)], dtype=torch.float32, device=device)
    return ROTATION_SCALE * (1.0 - 2.0 * bits)


def rotate(x: torch.Tensor) -> torch.Tensor:
    """The randomized Hadamard rotation of the last dim (D 64 or 128), float32, bit-exact with
    the preprocessing kernels: y = x * s (s_d = +-1/8, ``rotation_signs``; exact), then the
    Walsh-Hadamard butterflies in float32, stages h = 1, 2, 4, ..., D/2 in that order: for each
    i with (i & h) == 0, (y_i, y_{i+h}) <- (y_i + y_{i+h}, y_i - y_{i+h}).

    As a matrix, x -> x S H / 8 with S = diag(+-1) and H the Sylvester Hadamard matrix
    (H Hᵀ = D I), so rotate(q) · rotate(k)ᵀ = (D / 64) · q · kᵀ (``rotation_score_factor``):
    attention is unchanged once the softmax scale is divided by that factor. The rotation spreads
    an outlier channel over all D channels before the 16-channel NVFP4 blocks are formed."""
    d = x.shape[-1]
    if not rotation_applies(d):
        raise ValueError(f"the rotation is defined for head_dim {'/'.join(map(str, ROTATION_HEAD_DIMS))}, got {d}")
    shape = x.shape
    y = x.float() * rotation_signs(d, x.device)
    h = 1
    while h < d:
        y = y.reshape(*shape[:-1], d // (2 * h), 2, h)
        a, b = y[..., 0, :], y[..., 1, :]
        y = torch.stack((a + b, a - b), dim=-2)
        h *= 2
    return y.reshape(shape)


def rotation_score_factor(head_dim: int, rotated: bool) -> float:
    """rotate(q)·rotate(k)ᵀ / (q·kᵀ): D/64 (1 for D 64, 2 for D 128), or 1 without rotation."""
    return head_dim / 64.0 if rotated else 1.0


# ---------------------------------------------------------------------------------------------
# Q/K channel balance
# ---------------------------------------------------------------------------------------------

# A Q channel much larger than the others (an outlier channel) multiplies K's FP4 error in that
# channel into every score, and a large K channel Q's. The balance evens the ratio of Q's to K's
# channel RMS out: per KV head, Q's channel d is multiplied by 2^-e_d and K's by 2^e_d after
# smoothing, which leaves every score Q·Kᵀ unchanged (powers of two: exact in float32).
# e_d from Q's and K's channel RMS over their sampled blocks (``balance_exponents``).
BALANCE_HEAD_DIMS = (64, 128)
# Whether the preprocessing quantizes Q and K (head dims 64/128) with the scale search
# (``quantize_rows``) where a call does not say (``qk_scale_search=None``, the default of
# ``preprocess`` / ``sageattn3_blackwell`` here and in the package): read on every such call, by
# the kernels and this reference alike. Off by default: measured on an H100 (the MMA-model test
# flavour, 24 heads x 32k tokens, D 128, bf16, back to back) it makes the whole preprocessing
# 0.382-0.383 -> 0.705-0.710 ms (+85%: every block is converted twice, in software on that GPU) for a
# cos-sim gain of about 0.002 on random data and 0.005-0.01 with Q outlier channels (README,
# "Accuracy"). Set it to True (or pass qk_scale_search=True) for the most accurate quantization
# of Q and K.
QK_SCALE_SEARCH = False
BALANCE_MAX_EXP = 2  # |e_d| <= 2: channels scaled by 1/4 .. 4
# Off unless asked for (qk_balance=True): measured on an H100 (24 heads x 32k tokens, D 128, bf16,
# back to back) the whole preprocessing takes 0.400-0.402 ms with it against 0.382-0.383 ms without (+5%: the
# sampled blocks' sums of squares and one multiply per element; +7% in earlier runs), about the 5%
# a default may cost.
QK_BALANCE_DEFAULT = False


def scale_search_applies(qk_scale_search: bool | None, head_dim: int) -> bool:
    """Whether Q and K are quantized with the scale search: ``qk_scale_search`` (None:
    ``QK_SCALE_SEARCH``, as a bool) at head dims 64/128, never at others."""
    on = QK_SCALE_SEARCH if qk_scale_search is None else qk_scale_search
    return flag(on, "qk_scale_search") and head_dim in BALANCE_HEAD_DIMS


def flag(value, name: str) -> bool:
    """``value`` as a bool: True, False, or 0/1; anything else (a string, None, a tensor) is a
    TypeError naming ``name``, so that ``"False"`` never silently means True."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if type(value).__name__ == "bool_":  # numpy.bool_
        return bool(value)
    raise TypeError(f"{name} must be True or False, got {value!r}")


def balance_applies(head_dim: int) -> bool:
    """The balance applies at head dims 64/128, with or without the rotation (balanced first,
    then rotated: the rotation spreads what is left of an outlier channel), and with per-block Q
    means (``preprocess`` leaves it off with per_block_mean=False, where the kernels would need
    a second pass over Q and K)."""
    return head_dim in BALANCE_HEAD_DIMS


def sample_blocks(seq: int) -> list[int]:
    """The 128-token blocks the sampled means (``sample_mean``) and the balance statistics come
    from: (i * n) // m for i < m, with n = ceil(seq / 128) blocks and m = min(MEAN_SAMPLE_BLOCKS,
    n): every block up to 1024 tokens, then 8 evenly spaced ones."""
    n = -(-seq // Q_MEAN_BLOCK)
    m = min(MEAN_SAMPLE_BLOCKS, n)
    return [(i * n) // m for i in range(m)]


def sample_mean(x: torch.Tensor) -> torch.Tensor:
    """(..., 1, D) float32: the mean of x (..., S, D) over the real rows of its sampled blocks
    (``sample_blocks``): float32 sum / their row count (the kernels sum in their own order)."""
    s = x.shape[-2]
    parts = [x[..., t * Q_MEAN_BLOCK : min(s, (t + 1) * Q_MEAN_BLOCK), :].float() for t in sample_blocks(s)]
    rows = sum(p.shape[-2] for p in parts)
    return torch.cat(parts, dim=-2).sum(dim=-2, keepdim=True) / float(rows)


def _sampled_square_sums(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(B, H, D) float32: for each head, the sum over its sampled blocks (``sample_blocks``, in
    order) of each block's sum over its real rows of (x - the block's own mean)² (the block mean
    as float32 sum / count); and the rows counted."""
    s = x.shape[-2]
    xf = x.float()
    ss = torch.zeros(*x.shape[:-2], x.shape[-1], dtype=torch.float32, device=x.device)
    count = 0
    for t in sample_blocks(s):
        blk = xf[..., t * Q_MEAN_BLOCK : min(s, (t + 1) * Q_MEAN_BLOCK), :]
        mu = blk.sum(dim=-2, keepdim=True) / float(blk.shape[-2])
        ss = ss + ((blk - mu) ** 2).sum(dim=-2)
        count += blk.shape[-2]
    return ss, count


def _pairwise_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum over the last dim (a power of two) as a pairwise tree: d = 2i with 2i + 1 first."""
    while x.shape[-1] > 1:
        x = x[..., 0::2] + x[..., 1::2]
    return x


def balance_exponents(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """(B, Hkv, 1, D) float32 e_d in {-2, ..., 2} (as float), per KV head, from q (B, Hq, Sq, D)
    and k (B, Hkv, Sk, D):

    1. per channel, Q's mean square a_d² over the sampled blocks (``sample_blocks``) of every q
       head of the group, each block about its own mean (``_sampled_square_sums``: the summed
       squares / (rows x q heads)), and K's b_d² likewise over K's sampled blocks;
    2. a_d = sqrt(a_d²), b_d = sqrt(b_d²), r_d = a_d / b_d (float32); a channel is valid when
       a_d > 0, b_d > 0 and r_d is finite;
    3. m = (pairwise sum of r_d over the valid channels, 0 elsewhere) / (pairwise sum of the
       valid flags), the sums as trees (d = 2i with 2i + 1 first);
    4. e_d = [r_d >= 2m] + [r_d >= 8m] - [r_d < m/2] - [r_d < m/8] on valid channels, i.e.
       round(log2(r_d / m) / 2) clamped to +-2, and 0 on the others; 0 everywhere when m is not
       a positive finite number.

    Q's channel d is then scaled by 2^-e_d and K's by 2^e_d: the ratio of Q's to K's channel RMS
    is pulled towards the typical ratio (the product of the two RMS is unchanged), which is what
    minimises the FP4 error of Q·Kᵀ for independent errors. A channel large in Q only moves into
    K, one large in K only moves into Q, and one large in both (where scaling would only move
    error around) stays. The kernels compute the same in their own summation order (float32):
    the exponents agree except where r_d lies within rounding of a threshold; tests feed the
    kernels' exponents to ``preprocess`` (``balance=``) to compare the quantized tensors bit for
    bit."""
    if not isinstance(k, torch.Tensor) or q.dim() != 4 or k.dim() != 4:
        raise TypeError("balance_exponents(q, k): q (B, Hq, Sq, D) and k (B, Hkv, Sk, D) tensors")
    b, hq, _, d = q.shape
    hk = k.shape[1]
    if k.shape[0] != b or k.shape[3] != d or hk == 0 or hq % hk:
        raise ValueError(f"balance_exponents: q {tuple(q.shape)} and k {tuple(k.shape)} need the same batch and "
                         f"head dim, and Hq a multiple of Hkv")
    rep = hq // hk
    ssq, nq = _sampled_square_sums(q)
    ssk, nk = _sampled_square_sums(k)
    msq = ssq.reshape(b, hk, rep, d).sum(dim=2) / float(nq * rep)
    msk = ssk / float(nk)
    a, bk = torch.sqrt(msq), torch.sqrt(msk)
    r = a / bk
    valid = (a > 0) & (bk > 0) & torch.isfinite(r)
    rs = _pairwise_sum(torch.where(valid, r, torch.zeros_like(r)))
    n = _pairwise_sum(valid.float())
    m = rs / n
    e = ((r >= 2 * m).float() + (r >= 8 * m).float() - (r < m / 2).float() - (r < m / 8).float())
    ok = valid & torch.isfinite(m) & (m > 0)
    return torch.where(ok, e, torch.zeros_like(e)).unsqueeze(-2)


# ---------------------------------------------------------------------------------------------
# Smoothing and preprocessing
# ---------------------------------------------------------------------------------------------


def k_mean(k: torch.Tensor) -> torch.Tensor:
    """The mean K is smoothed by, per (batch, head): (B, H, 1, D) float32, ``sample_mean``."""
    return sample_mean(k)


def q_mean(q: torch.Tensor, per_block_mean: bool = True) -> torch.Tensor:
    """Q means, (B, H, nblk, D) float32: per 128-token block (the last block averages only its
    real tokens), or one mean for the whole sequence (nblk = 1, ``sample_mean``)."""
    qf = q.float()
    if not per_block_mean:
        return sample_mean(qf)
    s = q.shape[-2]
    nblk = -(-s // Q_MEAN_BLOCK)
    qp = pad_dim(qf, -2, Q_MEAN_BLOCK).reshape(*q.shape[:-2], nblk, Q_MEAN_BLOCK, q.shape[-1])
    counts = torch.clamp(s - torch.arange(nblk, device=q.device) * Q_MEAN_BLOCK, max=Q_MEAN_BLOCK)
    return qp.sum(dim=-2) / counts.to(torch.float32).unsqueeze(-1)


def expand_kv(x: torch.Tensor, q_heads: int) -> torch.Tensor:
    """(B, Hkv, ...) -> (B, Hq, ...): q head h reads kv head h // (Hq / Hkv)."""
    rep = q_heads // x.shape[1]
    return x if rep == 1 else x.repeat_interleave(rep, dim=1)


def q_block_index(seq_q: int, n_means: int, device=None) -> torch.Tensor:
    """For each query row, which Q mean (and delta_s row) it uses."""
    idx = torch.arange(seq_q, device=device) // Q_MEAN_BLOCK
    return idx if n_means > 1 else torch.zeros_like(idx)


@dataclass
class Preprocessed:
    """What the attention kernel consumes (all sequence dims padded with zeros to ``pad``).

    With ``qk_rotation`` (head dims 64 and 128) Q and K are rotated first (``rotate``) and
    everything below lives in the rotated space; means are rotated means (the rotation is
    linear: mean(rotate(x)) = rotate(mean(x))).

    - q_packed (B, Hq, Sq_p, D/2) uint8, q_scales (B, Hq, Sq_p, D/16) e4m3: Q - mean_q, rows.
    - k_packed (B, Hkv, Sk_p, D/2), k_scales (B, Hkv, Sk_p, D/16): K - mean_k, rows.
    - v_packed (B, Hkv, D, Sk_p/2), v_scales (B, Hkv, D, Sk_p/16): V along the sequence.
    - mean_q (B, Hq, nblk, D) float32: the Q means removed from Q (nblk = ceil(Sq/128) with
      per_block_mean, else 1 (``sample_mean``); query row i uses mean i // 128, or 0); mean_k
      (B, Hkv, 1, D) (``sample_mean``).
    - mean_q_global (B, Hq, 1, D) float32: Q's mean for the whole sequence, ``sample_mean`` (=
      mean_q without per_block_mean).
    - delta_key (B, Hq, Sk_p) float32: mean_q_global · K_sᵀ per key with K_s the UNQUANTIZED
      smoothed K, exactly the float32 values the quantizer takes (balanced and/or rotated, in that
      order; float64 products; 0 in padded columns).
    - balance (B, Hkv, 1, D) float32 or None: the channel balance exponents e
      (``balance_exponents``) when the balance applies. Q and K then live in the balanced space:
      q_packed holds Q·2^-e - mean_q and k_packed K·2^e - mean_k, and mean_q, mean_q_global and
      mean_k are the means times 2^-e (Q) or 2^e (K), all exact float32 products; scores and
      delta_key are unchanged by it. With the rotation too, Q and K are balanced first and then
      rotated (the means likewise).
    - qk_scale_search: whether q_packed/k_packed were quantized with the scale search.
    - k_residual (B, Hkv, Sk_p, D) float8_e4m3fn, with per_block_mean (else None): K's quantization
      residual (``quantize_residual`` of the smoothed K rows k_packed holds; 0 in padded rows).
    - delta_s (a property; the kernel never materialises it) (B, Hq, nblk, Sk_p): the correction
      added to Qd·Kdᵀ, delta_s[i, j] = delta_key[j] + r_i · K̂_j with r_i = mean_q[i] -
      mean_q_global (float32 subtraction) and K̂ = ``dequantize_rows``(k_packed, k_scales,
      k_residual), the dequantized smoothed K plus its quantization residual (Kd alone where
      k_residual is None: then r = 0). SageAttention2/3 add mean_q · K_sᵀ (K_s = K - mean_k,
      unquantized) = delta_key + r_i · K_s: the two differ by r_i · (K̂ - K_s), the E4M3 rounding
      of K's quantization error (at most 1/16 of it) times the block residual. Without
      per_block_mean r = 0: the paper's correction exactly. The attention kernel adds delta_key
      per key and computes r_i · K̂_j per 128-key tile from the K tile it holds and the residual
      bytes (skipped where r_i is zero). Why this form: materialising mean_q · K_sᵀ costs
      (B, Hq, Sq/128, Sk) fp32 (~800 MB at 24 heads x 32k tokens); delta_key is (B, Hq, Sk) (3 MB
      there) and costs K's quantization one dot product per key and q head over the row it
      already holds, the residual one byte per element of K (100 MB there) written from the same
      registers. Through Kd alone (no residual) r_i · (Kd - K_s) is the whole of K's quantization
      error times r_i, which is large where Q's block means drift along the sequence: there it
      lost up to 0.06 cos-sim against the paper; with the residual the two agree to 0.0001 on
      every case of tests/bench/accuracy.py (README, "Accuracy").
    - qk_fp8 (B, Hq) bool or None: the q heads whose Q·Kᵀ runs in FP8 (``qk_precision``; None:
      every head in FP4, today's path). q8/q8_scales (B, Hq, Sq_p, D) float8_e4m3fn + (B, Hq, Sq_p,
      D/32) uint8 and k8/k8_scales (B, Hkv, Sk_p, D) + (B, Hkv, Sk_p, D/32): the same smoothed Q and
      K rows as q_packed/k_packed in MXFP8 (``quantize_mxfp8_rows``); the reference fills every
      head, the kernels only the heads that use them (a kv head when any of its q heads does).
    - qk_error (B, Hq) float32 or None: the rule's estimate of the relative output error FP4
      Q·Kᵀ causes (``qk_fp4_error``; with qk_precision "auto").
    - k_block_corr (B, Hq, Sq, Sk_p/128) float32 or None (``k_block_mean``, reference only): K is
      smoothed by its mean per 128-key block mu_b instead of one mean, and the scores of key block
      b get Q_i · (mu_b - mean_k) back (float64 products from the unquantized, balanced Q).
    """

    q_packed: torch.Tensor
    q_scales: torch.Tensor
    k_packed: torch.Tensor
    k_scales: torch.Tensor
    v_packed: torch.Tensor
    v_scales: torch.Tensor
    mean_q: torch.Tensor
    mean_k: torch.Tensor
    seq_q: int
    seq_k: int
    mean_q_global: torch.Tensor
    delta_key: torch.Tensor
    qk_rotation: bool
    balance: torch.Tensor | None = None
    qk_scale_search: bool = False
    k_residual: torch.Tensor | None = None
    qk_fp8: torch.Tensor | None = None
    q8: torch.Tensor | None = None
    q8_scales: torch.Tensor | None = None
    k8: torch.Tensor | None = None
    k8_scales: torch.Tensor | None = None
    qk_error: torch.Tensor | None = None
    k_block_corr: torch.Tensor | None = None

    @property
    def q_mean_residual(self) -> torch.Tensor:
        """(B, Hq, nblk, D) float32: mean_q - mean_q_global, what the kernel multiplies with Kd."""
        return self.mean_q - self.mean_q_global

    @property
    def delta_s(self) -> torch.Tensor:
        kd = expand_kv(dequantize_rows(self.k_packed, self.k_scales, self.k_residual), self.mean_q.shape[1])
        part = torch.matmul(self.q_mean_residual.double(), kd.double().transpose(-1, -2))
        return (self.delta_key.double().unsqueeze(-2) + part).float()


def smooth_q(q: torch.Tensor, mean_q: torch.Tensor) -> torch.Tensor:
    """Q - its mean(s), float32 (one float32 subtraction per element)."""
    idx = q_block_index(q.shape[-2], mean_q.shape[-2], q.device)
    return q.float() - mean_q[..., idx, :]


def delta_s(mean_q: torch.Tensor, k_smoothed: torch.Tensor) -> torch.Tensor:
    """mean_q · K_smoothedᵀ (float64 products, float32 result; GQA: K expanded to the q heads):
    (B, Hq, nblk, Sk). With the unquantized smoothed K this is SageAttention2/3's correction;
    ``Preprocessed.delta_s`` is what the kernel adds (the same up to E4M3 rounding of K's
    quantization error)."""
    ks = expand_kv(k_smoothed.float(), mean_q.shape[1])
    return torch.matmul(mean_q.double(), ks.double().transpose(-1, -2)).float()


def preprocess(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    per_block_mean: bool = True,
    pad: int = 128,
    mean_q: torch.Tensor | None = None,
    mean_k: torch.Tensor | None = None,
    mean_q_global: torch.Tensor | None = None,
    qk_rotation: bool = QK_ROTATION_DEFAULT,
    qk_balance: bool = QK_BALANCE_DEFAULT,
    balance: torch.Tensor | None = None,
    qk_scale_search: bool | None = None,
    qk_precision: str = "fp4",
    sm_scale: float | None = None,
    k_block_mean: bool = False,
) -> Preprocessed:
    """The reference of the preprocessing kernels. ``qk_rotation``: rotate Q and K (head dims 64
    and 128; other head dims are never rotated). The means are computed on the raw inputs, then
    balanced and rotated (as the kernels do). ``mean_q`` / ``mean_k`` / ``mean_q_global`` let a
    test feed the means a kernel computed (float32 sums depend on the summation order), so that
    the quantized tensors can be compared bit for bit; without per_block_mean, mean_q_global
    defaults to mean_q. Given means are balanced and rotated already (as the kernels write
    them). ``qk_balance``: the channel balance where it applies (``balance_applies``),
    with the exponents ``balance`` (B, Hkv, 1, D) when given (a kernel's), else
    ``balance_exponents``; Q and K are balanced first and then rotated when both are asked for.
    ``qk_scale_search``: Q and K quantized with ``quantize_rows(..., scale_search=True)`` at head
    dims 64/128 (None: ``QK_SCALE_SEARCH``; ``scale_search_applies``). ``qk_precision``
    ("fp4", "fp8", "auto"; ``choose_qk_precision``) and ``sm_scale`` (the rule's softmax scale,
    default 1/sqrt(D)) fill qk_fp8, q8, k8 and qk_error; ``k_block_mean`` (reference only, no
    rotation) smooths K per 128-key block (``Preprocessed.k_block_corr``)."""
    sq, sk, d = q.shape[-2], k.shape[-2], q.shape[-1]
    precision = qk_precision_arg(qk_precision)
    k_block_mean = flag(k_block_mean, "k_block_mean")
    if k_block_mean and precision != "fp4":
        raise ValueError("k_block_mean is measured with FP4 Q·Kᵀ only: pass qk_precision='fp4' with it")
    per_block_mean, qk_rotation, qk_balance = (flag(per_block_mean, "per_block_mean"), flag(qk_rotation, "qk_rotation"),
                                               flag(qk_balance, "qk_balance"))
    search = scale_search_applies(qk_scale_search, d)
    rot = qk_rotation and rotation_applies(d)
    turn = rotate if rot else (lambda x: x.float())
    bal = None
    cq = ck = 1.0
    if qk_balance and per_block_mean and balance_applies(d):
        bal = balance_exponents(q, k) if balance is None else balance.float()
        ck = torch.exp2(bal)
        cq = expand_kv(torch.exp2(-bal), q.shape[1])
    # balanced (exact float32 products) and then rotated
    mq = turn(q_mean(q, per_block_mean) * cq) if mean_q is None else mean_q.float()
    mk = turn(k_mean(k) * ck) if mean_k is None else mean_k.float()
    if mean_q_global is not None:
        mg = mean_q_global.float()
    elif not per_block_mean:
        mg = mq
    else:
        mg = turn(q_mean(q, False) * cq)
    qs = smooth_q(turn(q.float() * cq), mq)
    corr = None
    if k_block_mean:
        if rot:
            raise ValueError("k_block_mean does not combine with qk_rotation")
        mkb = k_block_means(k.float() * ck)
        ks = k.float() * ck - mkb[..., torch.arange(sk, device=k.device) // Q_MEAN_BLOCK, :]
        corr = k_block_correction(q.float() * cq, mkb - mk, pad)
    else:
        ks = turn(k.float() * ck) - mk
    qp, qsc = quantize_rows(pad_dim(qs, -2, pad), search)
    kp, ksc = quantize_rows(pad_dim(ks, -2, pad), search)
    vp, vsc = quantize_transposed(pad_dim(v.float(), -2, pad))
    dk = pad_dim(delta_s(mg, ks).squeeze(-2), -1, pad)
    kr = quantize_residual(pad_dim(ks, -2, pad), kp, ksc) if per_block_mean else None
    pre = Preprocessed(qp, qsc, kp, ksc, vp, vsc, mq, mk, sq, sk, mg, dk, rot, bal, search, kr, k_block_corr=corr)
    if precision != "fp4":
        if not fp8_applies(rot, d):
            if precision == "fp8":
                raise ValueError(fp8_unavailable(rot, d))
            return pre
        pre.qk_error = qk_fp4_error(q, k, v, pre, sm_scale)
        pre.qk_fp8 = choose_qk_precision(precision, pre.qk_error)
        pre.q8, pre.q8_scales = quantize_mxfp8_rows(pad_dim(qs, -2, pad))
        pre.k8, pre.k8_scales = quantize_mxfp8_rows(pad_dim(ks, -2, pad))
    return pre


# ---------------------------------------------------------------------------------------------
# The Q·Kᵀ precision per head ("auto": the rule) and K's per-block means
# ---------------------------------------------------------------------------------------------

QK_PRECISIONS = ("fp4", "fp8", "auto")
QK_PRECISION_DEFAULT = "auto"
FP8_HEAD_DIMS = (64, 128)
# The rule reads every AUTO_QUERY_STRIDE-th query row of Q's sampled blocks (``sample_blocks``:
# up to 8 x 16 rows) against every key of K's sampled blocks (up to 1024 keys).
AUTO_QUERY_STRIDE = 8
# A head takes FP8 Q·Kᵀ when the rule's estimate of the relative output error FP4 Q·Kᵀ causes
# (``qk_fp4_error``) exceeds this. Calibrated on tests/attention_cases.py (docs/accuracy-auto.md;
# 4 heads, 512 tokens, D 128 and 64, seed 2025): the heads of zero-mean data, channel offsets, K
# biases and drifting offsets estimate 0.005-0.16 (FP4 Q·Kᵀ costs them little: the FP4 error of P
# and V dominates there), those of outlier channels, near-one-hot rows, RoPE'd biased keys and a
# huge K channel 0.25-0.71.
AUTO_ERROR_LIMIT = 0.2


def qk_precision_arg(value) -> str:
    """Checks a ``qk_precision`` argument: one of "fp4", "fp8", "auto"."""
    if not isinstance(value, str) or value not in QK_PRECISIONS:
        raise ValueError(f"qk_precision must be one of {', '.join(map(repr, QK_PRECISIONS))}, got {value!r}")
    return value


def fp8_applies(rotated: bool, head_dim: int) -> bool:
    """The FP8 Q·Kᵀ path exists at head dims 64/128 without the Q/K rotation."""
    return head_dim in FP8_HEAD_DIMS and not rotated


def fp8_unavailable(rotated: bool, head_dim: int) -> str:
    if head_dim not in FP8_HEAD_DIMS:
        return f"qk_precision='fp8' needs head_dim 64 or 128, got {head_dim}; use qk_precision='fp4' or 'auto'"
    return ("qk_precision='fp8' does not combine with qk_rotation=True; drop one of them (with the rotation, "
            "qk_precision='auto' keeps FP4 on every head)")


def _sampled_rows(x: torch.Tensor, seq: int, stride: int) -> list[torch.Tensor]:
    """Every ``stride``-th real row of each sampled 128-row block of x (..., S_or_padded, D), as
    views, block by block (no host data reaches the device: slicing only)."""
    return [x[..., t * Q_MEAN_BLOCK : min(seq, (t + 1) * Q_MEAN_BLOCK) : stride, :] for t in sample_blocks(seq)]


def _e2m1_values(codes: torch.Tensor) -> torch.Tensor:
    """E2M1 codes -> float32 by arithmetic (no table: nothing copied from the host)."""
    m = (codes & 7).to(torch.float32)
    big = torch.exp2(torch.floor(m * 0.5) - 1.0) * (1.0 + 0.5 * (codes & 1).to(torch.float32))
    mag = torch.where(m < 4, m * 0.5, big)
    return torch.where((codes & 8) != 0, -mag, mag)


def _dequantize_fp4_rows(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    vals = _e2m1_values(unpack_codes(packed))
    n = vals.shape[-1]
    s = e4m3_decode(scales)
    return (vals.reshape(*vals.shape[:-1], n // BLOCK, BLOCK) * s.unsqueeze(-1)).reshape(vals.shape)


def qk_fp4_error(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pre: "Preprocessed",
                 sm_scale: float | None = None) -> torch.Tensor:
    """The rule's estimate, per q head, of the relative output error FP4 Q·Kᵀ causes: (B, Hq)
    float32, computed with torch ops on q's device (no host synchronisation, no host data).

    1. Query rows: every ``AUTO_QUERY_STRIDE``-th row of Q's sampled 128-row blocks
       (``sample_blocks``), smoothed as the preprocessing smoothed them (balanced, minus their
       block's mean: Q_s), and the same rows of the FP4 Q the kernel reads (Qd, dequantized).
    2. Keys: every row of K's sampled blocks, K_s (balanced, minus mean_k) and Kd likewise; V's
       same rows.
    3. L = c · Q_s K_sᵀ and L4 = c · Qd Kdᵀ with c the softmax scale (default 1/sqrt(D)); O =
       softmax(L) V and O4 = softmax(L4) V (no mask: a statistic of the head).
    4. error = ||O4 - O|| / ||O|| over the head's sampled rows (Frobenius norms).

    Only Q·Kᵀ's FP4 error enters (the correction delta_s is the same in both and cancels); the
    error of P·V, which FP8 Q·Kᵀ would not change, does not. Heads whose scores span a wide
    range (near-one-hot rows), whose keys keep a large component after smoothing (biases that
    rotary embeddings turn with the position) or whose channels have outliers come out large."""
    b, hq, sq, d = q.shape
    hk, sk = k.shape[1], k.shape[2]
    scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(d)
    cq = 1.0 if pre.balance is None else expand_kv(torch.exp2(-pre.balance), hq)
    ck = 1.0 if pre.balance is None else torch.exp2(pre.balance)
    if pre.k_block_corr is not None:
        raise ValueError("qk_fp4_error: K's per-block means (k_block_mean) are not part of the rule")
    cat = lambda views: torch.cat(views, dim=-2)  # noqa: E731  (one gather per operand)
    nm = pre.mean_q.shape[-2]
    q_rows = _sampled_rows(q, sq, AUTO_QUERY_STRIDE)
    means = cat([pre.mean_q[..., (t if nm > 1 else 0):(t if nm > 1 else 0) + 1, :].expand(b, hq, blk.shape[-2], d)
                 for t, blk in zip(sample_blocks(sq), q_rows)])
    qs = cat(q_rows).float() * cq - means
    qd = _dequantize_fp4_rows(cat(_sampled_rows(pre.q_packed, sq, AUTO_QUERY_STRIDE)),
                              cat(_sampled_rows(pre.q_scales, sq, AUTO_QUERY_STRIDE)))
    ks = cat(_sampled_rows(k, sk, 1)).float() * ck - pre.mean_k
    kd = _dequantize_fp4_rows(cat(_sampled_rows(pre.k_packed, sk, 1)), cat(_sampled_rows(pre.k_scales, sk, 1)))
    vs = cat(_sampled_rows(v, sk, 1)).float()
    ks, kd, vs = expand_kv(ks, hq), expand_kv(kd, hq), expand_kv(vs, hq)
    o = torch.matmul(torch.softmax(torch.matmul(qs, ks.transpose(-1, -2)) * scale, dim=-1), vs)
    o4 = torch.matmul(torch.softmax(torch.matmul(qd, kd.transpose(-1, -2)) * scale, dim=-1), vs)
    num = (o4 - o).square().sum(dim=(-1, -2))
    den = o.square().sum(dim=(-1, -2)).clamp_min(1e-30)
    return torch.sqrt(num / den)


def choose_qk_precision(precision: str, error: torch.Tensor) -> torch.Tensor:
    """(B, Hq) bool, True where a q head's Q·Kᵀ runs in FP8: "fp8" every head, "fp4" none,
    "auto" the heads whose ``qk_fp4_error`` exceeds ``AUTO_ERROR_LIMIT`` (a NaN estimate, from
    NaN inputs, keeps FP4)."""
    precision = qk_precision_arg(precision)
    if precision == "auto":
        return error > AUTO_ERROR_LIMIT
    return torch.full_like(error, precision == "fp8", dtype=torch.bool)


def k_block_means(k: torch.Tensor) -> torch.Tensor:
    """(B, H, ceil(Sk/128), D) float32: K's mean per 128-key block (the last over its real keys)."""
    return q_mean(k, True)


def k_block_correction(qb: torch.Tensor, dmu: torch.Tensor, pad: int) -> torch.Tensor:
    """Q_i · (mu_b - mean_k) for every query row and key block: (B, Hq, Sq, Sk_p/128) float32
    (float64 products), 0 for padded key blocks. qb: the balanced (unrotated) Q; dmu (B, Hkv,
    nkb, D)."""
    corr = torch.matmul(qb.double(), expand_kv(dmu, qb.shape[1]).double().transpose(-1, -2)).float()
    return pad_dim(corr, -1, pad // Q_MEAN_BLOCK) if pad >= Q_MEAN_BLOCK else corr


# ---------------------------------------------------------------------------------------------
# Attention
# ---------------------------------------------------------------------------------------------


def exact_attention(q, k, v, is_causal: bool = False, sm_scale: float | None = None) -> torch.Tensor:
    """Plain float64 softmax attention, float32 result; GQA by expanding kv heads; causal =
    top-left aligned (key j visible to query i iff j <= i), like torch SDPA's ``is_causal``."""
    hq = q.shape[1]
    qd, kd, vd = q.double(), expand_kv(k.double(), hq), expand_kv(v.double(), hq)
    scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    s = torch.matmul(qd, kd.transpose(-1, -2)) * scale
    if is_causal:
        sq, sk = s.shape[-2:]
        mask = torch.ones(sq, sk, dtype=torch.bool, device=q.device).tril()
        s = s.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(s, dim=-1), vd).float()


def _tiled_attention(qd, kd, vd, delta_rows, seq_k: int, is_causal: bool, c: float, block_n: int) -> torch.Tensor:
    """The kernel's loop over key tiles (see ``sageattn3``): qd (B, Hq, Sq, D), kd/vd
    (B, Hq, Sk_p, D), delta_rows (B, Hq, Sq, Sk_p), c = softmax scale · log2(e)."""
    b, hq, sq, d = qd.shape
    sk_p = kd.shape[-2]
    dev = qd.device
    rows = torch.arange(sq, device=dev).unsqueeze(-1)
    m = torch.full((b, hq, sq, 1), float("-inf"), device=dev)
    l = torch.zeros((b, hq, sq, 1), device=dev)
    acc = torch.zeros((b, hq, sq, d), device=dev)
    for j0 in range(0, sk_p, block_n):
        cols = torch.arange(j0, j0 + block_n, device=dev).unsqueeze(0)
        s = torch.matmul(qd, kd[..., j0 : j0 + block_n, :].transpose(-1, -2)) + delta_rows[..., j0 : j0 + block_n]
        t = s * c
        mask = cols >= seq_k
        if is_causal:
            mask = mask | (cols > rows)
        t = t.masked_fill(mask, float("-inf"))
        m_new = torch.maximum(m, t.amax(dim=-1, keepdim=True))
        live = torch.isfinite(m_new)  # rows with no visible key so far contribute nothing
        m_safe = torch.where(live, m_new, torch.zeros_like(m_new))
        alpha = torch.where(live, torch.exp2(m - m_safe), torch.zeros_like(m))
        p = torch.exp2(t - m_safe) * P_SCALE
        p = torch.where(live, p, torch.zeros_like(p))
        pp, psc = quantize_rows(p)
        ph = dequantize_rows(pp, psc)
        l = l * alpha + p.sum(dim=-1, keepdim=True)
        acc = acc * alpha + torch.matmul(ph, vd[..., j0 : j0 + block_n, :])
        m = m_new
    return acc / l


def _dequantized(pre: Preprocessed, hq: int):
    """Qd, Kd, Vd as the kernel multiplies them: per q head, Q and K in FP4, or in MXFP8 where
    pre.qk_fp8 says so."""
    sq = pre.seq_q
    qd = dequantize_rows(pre.q_packed, pre.q_scales)[..., :sq, :]
    kd = expand_kv(dequantize_rows(pre.k_packed, pre.k_scales), hq)
    if pre.qk_fp8 is not None:
        sel = pre.qk_fp8[:, :, None, None]
        qd = torch.where(sel, dequantize_mxfp8_rows(pre.q8, pre.q8_scales)[..., :sq, :], qd)
        kd = torch.where(sel, expand_kv(dequantize_mxfp8_rows(pre.k8, pre.k8_scales), hq), kd)
    vd = expand_kv(dequantize_transposed(pre.v_packed, pre.v_scales, pre.v_packed.shape[-1] * 2), hq)
    return qd, kd, vd


def _delta_rows(pre: Preprocessed, sq: int) -> torch.Tensor:
    """delta_s per query row and key (B, Hq, Sq, Sk_p), with K's block correction when present."""
    delta = pre.delta_s
    rows = delta[..., q_block_index(sq, delta.shape[-2], delta.device), :]
    if pre.k_block_corr is not None:
        keys = torch.arange(rows.shape[-1], device=rows.device) // Q_MEAN_BLOCK
        rows = rows + pre.k_block_corr[..., keys.clamp(max=pre.k_block_corr.shape[-1] - 1)]
    return rows


def sageattn3(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    is_causal: bool = False,
    per_block_mean: bool = True,
    sm_scale: float | None = None,
    block_n: int = 128,
    qk_rotation: bool = QK_ROTATION_DEFAULT,
    qk_balance: bool = QK_BALANCE_DEFAULT,
    qk_scale_search: bool | None = None,
    qk_precision: str = QK_PRECISION_DEFAULT,
    k_block_mean: bool = False,
) -> torch.Tensor:
    """The quantized attention sageattn3 computes, float32 output (B, Hq, Sq, D).

    ``qk_precision``: "auto" (the default) multiplies Q·Kᵀ of the heads the rule picks
    (``choose_qk_precision``, ``qk_fp4_error``) with MXFP8 operands (``quantize_mxfp8_rows`` of the
    same smoothed rows), the others in FP4; "fp4" every head in FP4 (the rule never runs), "fp8"
    every head in MXFP8. P·V stays NVFP4. FP8 needs head dim 64/128 without ``qk_rotation`` ("auto"
    keeps FP4 elsewhere). ``k_block_mean`` (reference only): K smoothed per 128-key block with the
    exact correction (``Preprocessed.k_block_corr``).

    With Qd, Kd, Vd the dequantized NVFP4 tensors of ``preprocess`` (rotated Q and K with
    ``qk_rotation`` at head dims 64/128; Q and K in the balanced space with ``qk_balance``,
    which leaves every score unchanged but moves FP4 error away from Q's and K's outlier channels; Q and
    K quantized with the scale search with ``qk_scale_search`` (None: ``QK_SCALE_SEARCH``)) and
    c = sm_scale / rotation_score_factor · log2(e):

    - scores, per query row i and key j: t_ij = c · (Qd_i · Kd_j + delta_s[i // 128 or 0, j])
      with delta_s = ``Preprocessed.delta_s`` (delta_key_j + r_i · K̂_j) (float32; masked
      entries, j >= Sk or causal j > i, are -inf).
    - keys are processed in tiles of ``block_n`` (the kernel's tile, default 128). For tile t,
      the running row max m_t = max(m_{t-1}, max_{j in t} t_ij), and
      P_ij = exp2(t_ij - m_t) · 2688   (row max mapped to 448·6: the per-row factor exp2(-m_t)
      and the constant 2688, both folded into the exponent in the kernel),
      P̂ = NVFP4(P) along the keys (16-key blocks, the same quantizer as everything else),
      l_t = l_{t-1} · exp2(m_{t-1} - m_t) + Σ_j P_ij   (row sums of the unquantized P, in the
      same scaled domain),
      acc_t = acc_{t-1} · exp2(m_{t-1} - m_t) + P̂ · Vd_t.
    - O_i = acc / l.
    """
    b, hq, sq, d = q.shape
    is_causal = flag(is_causal, "is_causal")
    if block_n % BLOCK:
        raise ValueError("block_n must be a multiple of 16")
    pre = preprocess(q, k, v, per_block_mean, pad=block_n, qk_rotation=qk_rotation, qk_balance=qk_balance,
                     qk_scale_search=qk_scale_search, qk_precision=qk_precision, sm_scale=sm_scale,
                     k_block_mean=k_block_mean)
    qd, kd, vd = _dequantized(pre, hq)
    ds_rows = _delta_rows(pre, sq)  # (B, Hq, Sq, Sk_p)
    scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(d)
    c = scale / rotation_score_factor(d, pre.qk_rotation) * LOG2E
    return _tiled_attention(qd, kd, vd, ds_rows, k.shape[-2], is_causal, c, block_n)


def sageattn3_paper(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    is_causal: bool = False,
    per_block_mean: bool = True,
    sm_scale: float | None = None,
    block_n: int = 128,
) -> torch.Tensor:
    """SageAttention3 as published, for comparison (the accuracy table): no rotation, no balance,
    K's mean (and Q's without per_block_mean) over the whole sequence, and the correction
    delta_s = mean_q · K_sᵀ with the unquantized smoothed K materialised for every (Q block, key)
    pair; otherwise the same quantizers and online softmax as ``sageattn3``."""
    b, hq, sq, d = q.shape
    is_causal, per_block_mean = flag(is_causal, "is_causal"), flag(per_block_mean, "per_block_mean")
    full_q = None if per_block_mean else q.float().mean(dim=-2, keepdim=True)
    pre = preprocess(q, k, v, per_block_mean, pad=block_n, mean_q=full_q, mean_k=k.float().mean(dim=-2, keepdim=True),
                     qk_rotation=False, qk_balance=False, qk_scale_search=False)
    qd, kd, vd = _dequantized(pre, hq)
    ks = pad_dim(k.float() - pre.mean_k, -2, block_n)
    delta = delta_s(pre.mean_q, ks)
    ds_rows = delta[..., q_block_index(sq, delta.shape[-2], q.device), :]
    scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(d)
    return _tiled_attention(qd, kd, vd, ds_rows, k.shape[-2], is_causal, scale * LOG2E, block_n)


def cosine_similarity(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().flatten(), b.double().flatten()
    return float((a @ b) / (a.norm() * b.norm()).clamp_min(1e-300))
