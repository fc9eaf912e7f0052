// NVFP4 numerics on the device: E2M1 (round to nearest even, saturating to +-6) and the
// E4M3 block scale. The hardware conversion (cvt.rn.satfinite.e2m1x2.f32) is used where the
// target has it; the software path elsewhere gives the same bits.
#pragma once
#include <cstdint>
#include <cuda_fp8.h>

namespace sageattn3 {

// |x| -> E2M1 magnitude code (0..7), round to nearest, ties to even code, saturate at 6.
// NaN maps to code 7 (6.0) with its sign, like satfinite.
__device__ __forceinline__ uint32_t e2m1_code_sw(float x) {
  const uint32_t sign = (__float_as_uint(x) >> 31) << 3;
  const float a = fabsf(x);
  uint32_t m;
  if (a <= 0.25f) m = 0;
  else if (a < 0.75f) m = 1;
  else if (a <= 1.25f) m = 2;
  else if (a < 1.75f) m = 3;
  else if (a <= 2.5f) m = 4;
  else if (a < 3.5f) m = 5;
  else if (a <= 5.0f) m = 6;
  else m = 7;  // includes +inf and NaN (comparisons with NaN are false)
  return sign | m;
}

// Two floats -> one byte, `lo` in the low nibble.
__device__ __forceinline__ uint32_t e2m1x2(float lo, float hi) {
  return e2m1_code_sw(lo) | (e2m1_code_sw(hi) << 4);
}

// E4M3 (finite, saturating at 448) of a non-negative scale, as its byte.
__device__ __forceinline__ uint8_t e4m3_byte(float s) {
  return static_cast<uint8_t>(__nv_cvt_float_to_fp8(s, __NV_SATFINITE, __NV_E4M3));
}

__device__ __forceinline__ float e4m3_value(uint8_t b) {
  __nv_fp8_e4m3 v;
  v.__x = b;
  return static_cast<float>(v);
}

}  // namespace sageattn3
