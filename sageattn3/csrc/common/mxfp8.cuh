// MXFP8 numerics on the device, bit-exact with sageattn3/reference/formats.py
// (ue8m0_scale_byte, quantize_mxfp8_rows): per block of 32 values,
//   amax (NaN propagates: the kernels pass the canonical quiet NaN, 0x7FC00000, for a block
//   holding one) -> UE8M0 byte b = E(amax) - 8 + (frac(amax) > 0.75), clamped to [1, 253]
//   (the smallest 2^(b-127) with amax <= 448 * 2^(b-127));
//   each value times 2^(127 - b) (exact: a power of two, normal for b in [1, 253]), converted to
//   E4M3 with round to nearest even, saturating at +-448 (only Inf reaches it; NaN stays NaN).
// Used by the Q/K MXFP8 quantizer (quant/quant_mxfp8.cu), V's (quant/mxfp8_cols.cuh) and the
// attention kernel's FP8 P (attn/attn_fwd_kernel.cuh, kPV8).
#pragma once
#include <cstdint>
#include <cuda_fp8.h>

namespace sageattn3 {

// amax (>= 0 or NaN) -> the UE8M0 scale byte.
__device__ __forceinline__ uint32_t ue8m0_byte(float amax) {
  const uint32_t bits = __float_as_uint(amax);
  const int e = static_cast<int>((bits >> 23) & 0xFFu);
  const int b = e - 8 + ((bits & 0x7FFFFFu) > 0x600000u ? 1 : 0);
  return static_cast<uint32_t>(min(max(b, 1), 253));
}

// The scale byte of a block whose amax is `amax` and which holds a NaN where `nan`: the
// reference's amax propagates NaN (the canonical quiet NaN: byte 247).
__device__ __forceinline__ uint32_t ue8m0_byte(float amax, bool nan) {
  return ue8m0_byte(nan ? __uint_as_float(0x7FC00000u) : amax);
}

// 2^(127 - b): what a block's values are multiplied by before the E4M3 conversion.
__device__ __forceinline__ float ue8m0_inverse(uint32_t b) { return __uint_as_float((254u - b) << 23); }

// Four values times `inv` to E4M3 codes, the first in the low byte.
__device__ __forceinline__ uint32_t e4m3x4(float v0, float v1, float v2, float v3, float inv) {
  const float v[4] = {v0, v1, v2, v3};
  uint32_t word = 0;
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    const uint32_t c = __nv_cvt_float_to_fp8(__fmul_rn(v[e], inv), __NV_SATFINITE, __NV_E4M3);
    word |= (c & 0xFFu) << (8 * e);
  }
  return word;
}

// e4m3x4 with two values per conversion (cvt.rn.satfinite.e4m3x2.f32): the same bytes.
__device__ __forceinline__ uint32_t e4m3x4_rn(float v0, float v1, float v2, float v3, float inv) {
  const uint32_t lo = __nv_cvt_float2_to_fp8x2(make_float2(__fmul_rn(v0, inv), __fmul_rn(v1, inv)), __NV_SATFINITE,
                                               __NV_E4M3);
  const uint32_t hi = __nv_cvt_float2_to_fp8x2(make_float2(__fmul_rn(v2, inv), __fmul_rn(v3, inv)), __NV_SATFINITE,
                                               __NV_E4M3);
  return (lo & 0xFFFFu) | (hi << 16);
}

// 16 values to E4M3 codes times `inv`, four to a word.
__device__ __forceinline__ uint4 e4m3_codes16(const float (&v)[16], float inv) {
  uint32_t w[4];
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    uint32_t word = 0;
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const uint32_t c = __nv_cvt_float_to_fp8(__fmul_rn(v[4 * j + e], inv), __NV_SATFINITE, __NV_E4M3);
      word |= (c & 0xFFu) << (8 * e);
    }
    w[j] = word;
  }
  return make_uint4(w[0], w[1], w[2], w[3]);
}

}  // namespace sageattn3
