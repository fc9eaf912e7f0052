// NVFP4 numerics on the device, bit-exact with sageattn3/reference.py:
//   amax over 16 values (NaN propagates) -> scale byte = e4m3_satfinite(amax / 6) & 0x7F
//   scale 0 or NaN -> all 16 codes 0; else code = e2m1_rn_satfinite(x * rcp_rn(scale)).
// The hardware conversion (cvt.rn.satfinite.e2m1x2.f32) is used on targets that have it; the
// software conversion elsewhere gives the same bits. NaN never reaches either conversion (a NaN
// makes its block's scale NaN and its codes 0), so their differing NaN rules do not matter.
#pragma once
#include <cstdint>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

// cvt ... e2m1x2 exists on the family/arch-specific targets of sm_100 and later (100a/f,
// 103a/f, 110a/f, 120a/f, 121a/f); nvcc defines __CUDA_ARCH_FAMILY_SPECIFIC__ for those (and
// for sm_90a, hence the lower bound).
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FAMILY_SPECIFIC__) && (__CUDA_ARCH_FAMILY_SPECIFIC__ >= 1000)
#define SAGEATTN3_HW_E2M1 1
#else
#define SAGEATTN3_HW_E2M1 0
#endif

namespace sageattn3 {

// x (not NaN) -> E2M1 code (sign in bit 3), round to nearest, ties to the even code,
// saturating at 6. The E2M1 grid has spacing 0.5 below 2, 1 in [2, 4) and 2 from 4 on: adding
// 2^22, 2^23 or 2^24 in fp32 rounds |x| to that spacing (the adder's own round-to-nearest-even),
// and the difference of the bit patterns counts the steps. About 9 instructions instead of 7
// compare/select pairs; checked against the threshold definition for every fp32 in [0, 16]
// and a sweep up to +Inf.
__device__ __forceinline__ uint32_t e2m1_code_sw(float x) {
  const uint32_t sign = (__float_as_uint(x) >> 28) & 8u;
  const float a = fabsf(x);
  const bool r0 = a < 2.f, r1 = a < 4.f;
  const float magic = r0 ? 4194304.f : (r1 ? 8388608.f : 16777216.f);
  const int base = r0 ? 0x4A800000 : (r1 ? 0x4B000000 - 2 : 0x4B800000 - 4);
  const int m = min(__float_as_int(__fadd_rn(a, magic)) - base, 7);
  return sign | static_cast<uint32_t>(m);
}

// Two floats -> one byte, `lo` in the low nibble.
__device__ __forceinline__ uint32_t e2m1x2(float lo, float hi) {
#if SAGEATTN3_HW_E2M1
  uint16_t r;
  // cvt d, a, b puts a in the upper nibble and b in the lower one.
  asm("{\n .reg .b8 t;\n cvt.rn.satfinite.e2m1x2.f32 t, %1, %2;\n mov.b16 %0, {t, 0};\n}" : "=h"(r) : "f"(hi), "f"(lo));
  return r;
#else
  return e2m1_code_sw(lo) | (e2m1_code_sw(hi) << 4);
#endif
}

// 8 floats (already multiplied by 1/scale) -> 8 codes in one word, element 0 in the low nibble.
__device__ __forceinline__ uint32_t e2m1x8(const float (&y)[8]) {
  return e2m1x2(y[0], y[1]) | (e2m1x2(y[2], y[3]) << 8) | (e2m1x2(y[4], y[5]) << 16) | (e2m1x2(y[6], y[7]) << 24);
}

// E4M3 byte of a block amax (>= 0 or NaN): amax/6 in fp32, saturating RN conversion, no sign.
__device__ __forceinline__ uint32_t e4m3_scale_byte(float amax) {
  return static_cast<uint32_t>(__nv_cvt_float_to_fp8(amax / 6.0f, __NV_SATFINITE, __NV_E4M3)) & 0x7Fu;
}

__device__ __forceinline__ float e4m3_value(uint32_t b) {
  return __half2float(__half(__nv_cvt_fp8_to_halfraw(static_cast<__nv_fp8_storage_t>(b), __NV_E4M3)));
}

// max |v| as bits: for non-negative floats the integer order is the float order, and every NaN
// is above +Inf, so NaN propagates (fmaxf would drop it).
__device__ __forceinline__ uint32_t abs_bits_max(uint32_t acc, float v) {
  return max(acc, __float_as_uint(v) & 0x7FFFFFFFu);
}

// Quantize 8 values whose block amax (bits) is known: returns the packed codes, sets `sbyte`.
__device__ __forceinline__ uint32_t quant8_with_amax(const float (&v)[8], uint32_t amax_bits, uint32_t& sbyte) {
  sbyte = e4m3_scale_byte(__uint_as_float(amax_bits));
  const float s = e4m3_value(sbyte);
  const bool ok = s > 0.f;  // false for 0 and NaN
  const float inv = ok ? __frcp_rn(s) : 0.f;
  float y[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) y[i] = __fmul_rn(v[i], inv);
  const uint32_t w = e2m1x8(y);
  return ok ? w : 0u;
}

// A 16-block split over a lane pair (lane, lane ^ 1), 8 values each: every lane of the warp must
// call this together.
__device__ __forceinline__ uint32_t quant8_pair(const float (&v)[8], uint32_t& sbyte) {
  uint32_t a = 0;
#pragma unroll
  for (int i = 0; i < 8; ++i) a = abs_bits_max(a, v[i]);
  a = max(a, __shfl_xor_sync(0xFFFFFFFFu, a, 1));
  return quant8_with_amax(v, a, sbyte);
}

// ---- element types (storage only) and loads: 8 consecutive elements (16-byte aligned) ----

struct bf16_t { uint16_t bits; };
struct f16_t { uint16_t bits; };

__device__ __forceinline__ float bf16_lo(uint32_t w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float bf16_hi(uint32_t w) { return __uint_as_float(w & 0xFFFF0000u); }

template <typename T>
struct Load8;

template <>
struct Load8<bf16_t> {
  static __device__ __forceinline__ void run(const void* p, float (&v)[8]) {
    const uint4 r = __ldg(static_cast<const uint4*>(p));
    const uint32_t w[4] = {r.x, r.y, r.z, r.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) { v[2 * i] = bf16_lo(w[i]); v[2 * i + 1] = bf16_hi(w[i]); }
  }
};

template <>
struct Load8<f16_t> {
  static __device__ __forceinline__ void run(const void* p, float (&v)[8]) {
    const uint4 r = __ldg(static_cast<const uint4*>(p));
    const uint32_t w[4] = {r.x, r.y, r.z, r.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&w[i]));
      v[2 * i] = f.x;
      v[2 * i + 1] = f.y;
    }
  }
};

template <>
struct Load8<float> {
  static __device__ __forceinline__ void run(const void* p, float (&v)[8]) {
    const float4 a = __ldg(static_cast<const float4*>(p));
    const float4 b = __ldg(static_cast<const float4*>(p) + 1);
    v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w; v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
  }
};


// ---- whole 16-blocks per thread (the bandwidth kernels) ----

// 16 values (already smoothed, fp32) of one block whose amax bits are known -> codes of
// elements 0-7 (x) and 8-15 (y), scale byte in `sbyte`. Same arithmetic as quant8_with_amax.
__device__ __forceinline__ uint2 quant16_with_amax(const float (&v)[16], uint32_t amax_bits, uint32_t& sbyte) {
  sbyte = e4m3_scale_byte(__uint_as_float(amax_bits));
  const float s = e4m3_value(sbyte);
  const bool ok = s > 0.f;  // false for 0 and NaN
  const float inv = ok ? __frcp_rn(s) : 0.f;
  float y0[8], y1[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    y0[i] = __fmul_rn(v[i], inv);
    y1[i] = __fmul_rn(v[8 + i], inv);
  }
  const uint2 w = make_uint2(e2m1x8(y0), e2m1x8(y1));
  return ok ? w : make_uint2(0u, 0u);
}

// max(acc, |v|), NaN if either is NaN (max.NaN: one instruction, |v| an operand modifier; the
// bit-pattern max above takes two).
__device__ __forceinline__ float abs_max_nan(float acc, float v) {
  float r;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(acc), "f"(fabsf(v)));
  return r;
}

__device__ __forceinline__ uint2 quant16(const float (&v)[16], uint32_t& sbyte) {
  float a = 0.f;
#pragma unroll
  for (int i = 0; i < 16; ++i) a = abs_max_nan(a, v[i]);
  return quant16_with_amax(v, __float_as_uint(a), sbyte);
}

// Raw storage of 16 consecutive elements (one NVFP4 block): loaded with 16-byte vector loads,
// converted to fp32 only when needed.
template <typename T>
struct Raw16 {
  static constexpr int kWords = 16 * static_cast<int>(sizeof(T)) / 4;  // 8 (16-bit) or 16 (fp32)
  uint32_t w[kWords];

  // p: 16-byte aligned. Streaming (evict-first) loads: every byte is read once.
  __device__ __forceinline__ void load(const T* p) {
#pragma unroll
    for (int i = 0; i < kWords / 4; ++i) {
      const uint4 r = __ldcs(reinterpret_cast<const uint4*>(p) + i);
      w[4 * i] = r.x; w[4 * i + 1] = r.y; w[4 * i + 2] = r.z; w[4 * i + 3] = r.w;
    }
  }
  __device__ __forceinline__ void zero() {
#pragma unroll
    for (int i = 0; i < kWords; ++i) w[i] = 0u;
  }
  __device__ __forceinline__ void to_float(float (&v)[16]) const;
  // max |x| as fp32 bits (NaN propagates), computed on the raw 16-bit patterns two at a time.
  __device__ __forceinline__ uint32_t amax_bits() const;
};

template <>
__device__ __forceinline__ void Raw16<bf16_t>::to_float(float (&v)[16]) const {
#pragma unroll
  for (int i = 0; i < 8; ++i) { v[2 * i] = bf16_lo(w[i]); v[2 * i + 1] = bf16_hi(w[i]); }
}
template <>
__device__ __forceinline__ void Raw16<f16_t>::to_float(float (&v)[16]) const {
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&w[i]));
    v[2 * i] = f.x;
    v[2 * i + 1] = f.y;
  }
}
template <>
__device__ __forceinline__ void Raw16<float>::to_float(float (&v)[16]) const {
#pragma unroll
  for (int i = 0; i < 16; ++i) v[i] = __uint_as_float(w[i]);
}

// For 16-bit floats |x| orders like its bit pattern and NaN sits above Inf, so an unsigned
// 16-bit max of the patterns with the sign cleared is amax (NaN-propagating) in the input type.
__device__ __forceinline__ uint32_t max_abs_halves(const uint32_t (&w)[8]) {
  uint32_t m = 0;
#pragma unroll
  for (int i = 0; i < 8; ++i) m = __vmaxu2(m, w[i] & 0x7FFF7FFFu);
  return max(m & 0xFFFFu, m >> 16);
}
template <>
__device__ __forceinline__ uint32_t Raw16<bf16_t>::amax_bits() const {
  return max_abs_halves(w) << 16;
}
template <>
__device__ __forceinline__ uint32_t Raw16<f16_t>::amax_bits() const {
  return __float_as_uint(__half2float(__ushort_as_half(static_cast<unsigned short>(max_abs_halves(w)))));
}
template <>
__device__ __forceinline__ uint32_t Raw16<float>::amax_bits() const {
  uint32_t a = 0;
#pragma unroll
  for (int i = 0; i < 16; ++i) a = max(a, w[i] & 0x7FFFFFFFu);
  return a;
}

}  // namespace sageattn3
