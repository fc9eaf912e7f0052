// NVFP4 numerics on the device, bit-exact with sageattn3/reference/formats.py:
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

#if defined(SAGEATTN3_TIMING_STANDIN_E2M1) && !defined(SAGEATTN3_MMA_MODEL)
#error "SAGEATTN3_TIMING_STANDIN_E2M1 gives wrong codes: a timing experiment of the test flavour only"
#endif

namespace sageattn3 {

// Software E2M1, exact (round to nearest, ties to the even code, saturating at 6), arranged for
// sm_90's pipes: integer/logic instructions issue at half the rate of fp32 ones, so the rounding
// is fp32 arithmetic and the integer work is a few instructions per 8 values.
// The values come pre-scaled: y = x * 2^-14 (folded into 1/scale; exact while y is normal, and
// smaller values give code 0 either way), which maps the E2M1 grid {0, 0.5, ..., 6} onto fp16
// {0, 2^-15, ..., 1.5 * 2^-12}: exponents aligned, E2M1's subnormal onto fp16's, so the fp16 bit
// pattern of a grid value is its code << 9. For a = |y| in [2^e, 2^(e+1)) the grid spacing there
// is 2^(e-1) (2^-15 below 2^-14): adding M = 2^(max(e, -14) + 22) puts a + M in a binade whose
// ulp is that spacing, so the adder's own round-to-nearest-even rounds a onto the grid (even
// multiples are the even codes) and h = (a + M) - M is exact; one cvt.rn.f16x2 turns two h into
// their codes. Every fp32 |x| < 7 gives the code of the 7 compare/select definition (checked
// exhaustively), and every fp32 up to +Inf with kClamp (a clamped to 6 * 2^-14 first). Without
// it a block needs |x| < 7, i.e. a normal E4M3 scale below 448 (amax/6 rounds by < 1/16:
// |x| <= 6.4); NaN never gets here.
constexpr float kE2M1Prescale = 0x1p-14f;

template <bool kClamp>
__device__ __forceinline__ float e2m1_grid_sw(float y) {
  const float a = kClamp ? fminf(fabsf(y), 6.f * kE2M1Prescale) : fabsf(y);
  const float m = __uint_as_float(max((__float_as_uint(a) & 0x7F800000u) + (22u << 23), (127u - 14u + 22u) << 23));
  return __fsub_rn(__fadd_rn(a, m), m);
}

// prmt.b32 in its default mode: a selector nibble with bit 3 set replicates the selected byte's
// sign bit (__byte_perm ignores that bit).
__device__ __forceinline__ uint32_t prmt(uint32_t a, uint32_t b, uint32_t sel) {
  uint32_t r;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(sel));
  return r;
}

// K's quantization residual (reference.quantize_residual) of two values y whose signed E2M1 grid
// values are g (y = x * (1/scale), both times 2^-14 where the software conversion takes them
// pre-scaled): two float16s, a's in the low half, fp16_rn((y - g) * 64) saturated at +-65504 (the
// subtraction is exact: y and its grid value are within a factor of 2, or the value is 0; y - g
// is never NaN: a NaN value makes the scale NaN, and its block's residual 0); the attention kernel
// adds it back to the E2M1 values for its correction delta_s.
constexpr float kResidualUnit = 64.0f;
// One residual unit on the grid of the values times 2^-14 (e2m1x2_scaled's): 2^-14 / 64 = 2^-20.
constexpr float kResidualStep = kE2M1Prescale / kResidualUnit;

__device__ __forceinline__ uint32_t residual_pair(float ya, float ga, float yb, float gb) {
  constexpr float kUnit = SAGEATTN3_HW_E2M1 ? kResidualUnit : kResidualUnit * 0x1p14f;
  constexpr float kMax = 65504.f;
  const auto sat = [](float r) { return fminf(fmaxf(r, -kMax), kMax); };
  const float2 r = make_float2(sat(__fmul_rn(__fsub_rn(ya, ga), kUnit)), sat(__fmul_rn(__fsub_rn(yb, gb), kUnit)));
  const __half2 h = __float22half2_rn(r);  // r.x in the low half
  return *reinterpret_cast<const uint32_t*>(&h);
}

// The residual of one 16-element block: elements 0-7 in lo (element i in half i: 0-1 in lo.x),
// 8-15 in hi; 32 bytes, stored in element order.
struct Residual16 {
  uint4 lo, hi;
};

// |g| with y's sign. y - that is +0 where y sits on the grid, as y - E2M1(code) is (the code
// carries y's sign, zero included).
__device__ __forceinline__ float with_sign_of(float g, float y) {
  return __uint_as_float(__float_as_uint(g) | (__float_as_uint(y) & 0x80000000u));
}

// 8 pre-scaled values -> 8 codes in one word, element 0 in the low nibble. kRes: also their
// residual (residual_pair) into res, element i in half i (halves 0-1 in res.x), from the
// conversion's own grid values (no decoding of the codes).
template <bool kClamp, bool kRes = false>
__device__ __forceinline__ uint32_t e2m1x8_sw(const float (&y)[8], uint4* res = nullptr) {
#if defined(SAGEATTN3_TIMING_STANDIN_E2M1)
  // Timing experiment only (tests/bench/conversion_standin.py; no build defines it): WRONG codes
  // at the issue cost of a hardware conversion, one instruction per two values (sm_90 has the
  // E4M3 one), to measure what the software conversion costs the launches on an H100.
  uint32_t e[4];
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    uint16_t h;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(h) : "f"(y[2 * j + 1]), "f"(y[2 * j]));
    e[j] = h;
  }
  if constexpr (kRes) *res = make_uint4(e[0] | (e[1] << 16), e[2] | (e[3] << 16), 0u, 0u);
  return prmt(e[0] | (e[1] << 16), e[2] | (e[3] << 16), 0x6420);
#else
  // Elements j and j + 4 share an fp16 pair: codes at bits 9-11 and 25-27, shifted into
  // nibbles j and j + 4. Signs: prmt copies the sign bits of y[j] and y[j + 4] into whole
  // bytes, masked onto bit 3 of those nibbles.
  uint32_t r[4], e[4];
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const float ga = e2m1_grid_sw<kClamp>(y[j]), gb = e2m1_grid_sw<kClamp>(y[j + 4]);
    const __half2 p = __floats2half2_rn(ga, gb);
    r[j] = *reinterpret_cast<const uint32_t*>(&p);
    // elements j (low half) and j + 4
    if constexpr (kRes) e[j] = residual_pair(y[j], with_sign_of(ga, y[j]), y[j + 4], with_sign_of(gb, y[j + 4]));
  }
  if constexpr (kRes)  // halves j0 j4 | j1 j5 | j2 j6 | j3 j7 -> j0 j1 | j2 j3 | j4 j5 | j6 j7
    *res = make_uint4(prmt(e[0], e[1], 0x5410), prmt(e[2], e[3], 0x5410), prmt(e[0], e[1], 0x7632),
                      prmt(e[2], e[3], 0x7632));
  uint32_t w = (r[0] >> 9) | (r[1] >> 5) | (r[2] >> 1) | (r[3] << 3);
  w |= prmt(__float_as_uint(y[0]), __float_as_uint(y[4]), 0x0F0B) & 0x00080008u;
  w |= prmt(__float_as_uint(y[1]), __float_as_uint(y[5]), 0x0F0B) & 0x00800080u;
  w |= prmt(__float_as_uint(y[2]), __float_as_uint(y[6]), 0xF0B0) & 0x08000800u;
  w |= prmt(__float_as_uint(y[3]), __float_as_uint(y[7]), 0xF0B0) & 0x80008000u;
  return w;
#endif
}

#if SAGEATTN3_HW_E2M1
// Hardware E2M1: 8 values (already multiplied by 1/scale) -> 8 codes, element 0 in the low nibble.
__device__ __forceinline__ uint32_t e2m1x8_hw(const float (&y)[8]) {
  uint32_t r;
  // cvt d, a, b puts a in the upper nibble and b in the lower one.
  asm("{\n"
      ".reg .b8 b0, b1, b2, b3;\n"
      "cvt.rn.satfinite.e2m1x2.f32 b0, %2, %1;\n"
      "cvt.rn.satfinite.e2m1x2.f32 b1, %4, %3;\n"
      "cvt.rn.satfinite.e2m1x2.f32 b2, %6, %5;\n"
      "cvt.rn.satfinite.e2m1x2.f32 b3, %8, %7;\n"
      "mov.b32 %0, {b0, b1, b2, b3};\n"
      "}\n"
      : "=r"(r)
      : "f"(y[0]), "f"(y[1]), "f"(y[2]), "f"(y[3]), "f"(y[4]), "f"(y[5]), "f"(y[6]), "f"(y[7]));
  return r;
}
#endif

// E4M3 byte of a block amax (>= 0 or NaN): amax/top in fp32 (top 6, E2M1's largest magnitude;
// the scale search also tries 4), saturating RN conversion, no sign.
__device__ __forceinline__ uint32_t e4m3_scale_byte(float amax, float top = 6.0f) {
  return static_cast<uint32_t>(__nv_cvt_float_to_fp8(amax / top, __NV_SATFINITE, __NV_E4M3)) & 0x7Fu;
}

__device__ __forceinline__ float e4m3_value(uint32_t b) {
  return __half2float(__half(__nv_cvt_fp8_to_halfraw(static_cast<__nv_fp8_storage_t>(b), __NV_E4M3)));
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

// Byte x (two E2M1 codes, element 0 in the low nibble) -> the two values times 2^-14, exactly:
// the code's 3 magnitude bits placed at fp16 bits 9..11 (exponent 0..3, mantissa bit 9) give
// 2^-14 x E2M1 (normal and subnormal alike, see kE2M1Prescale), the sign bit at bit 15.
__device__ __forceinline__ float2 e2m1x2_scaled(uint32_t x) {
  const uint32_t h = ((x & 0x7u) << 9) | ((x & 0x8u) << 12) | ((x & 0x70u) << 21) | ((x & 0x80u) << 24);
  return __half22float2(*reinterpret_cast<const __half2*>(&h));
}

// The residual (residual_pair) of 8 values y against the codes `word` (decoded; codes 0 for a
// zero scale): element i in half i.
__device__ __forceinline__ uint4 residual8(const float (&y)[8], uint32_t word) {
  // grid values come as E2M1 x 2^-14; y too without the hardware conversion
  constexpr float kGrid = SAGEATTN3_HW_E2M1 ? 0x1p14f : 1.0f;
  uint32_t out[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = e2m1x2_scaled(word >> (8 * i));  // elements 2i (low nibble), 2i + 1
    out[i] = residual_pair(y[2 * i], __fmul_rn(f.x, kGrid), y[2 * i + 1], __fmul_rn(f.y, kGrid));
  }
  return make_uint4(out[0], out[1], out[2], out[3]);
}

// 16 values (fp32) of one block -> codes of elements 0-7 (x) and 8-15 (y) for the scale byte
// `sbyte` (codes 0 when the scale is 0 or NaN); with want_res, also the block's quantization
// residual into res (residual8: elements 0-7 in res.lo, 8-15 in res.hi; zeros when the scale
// is NaN). A zero scale byte stands for 2^-9 (E4M3's smallest subnormal) in the residual
// (reference.residual_scales): its values are kept there, against codes 0.
__device__ __forceinline__ uint2 codes16(const float (&v)[16], uint32_t sbyte, Residual16& res, bool want_res) {
  const float s = e4m3_value(sbyte);
  const bool ok = s > 0.f;  // false for 0 and NaN
  const bool zero = sbyte == 0u;
  const float inv = ok ? __frcp_rn(s) : (zero ? 512.f : 0.f);  // 1 / 2^-9 for the residual alone
  // the software conversion takes its values pre-scaled (exact: a power-of-two scaling)
  const float mul = SAGEATTN3_HW_E2M1 ? inv : inv * kE2M1Prescale;
  float y0[8], y1[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    y0[i] = __fmul_rn(v[i], mul);
    y1[i] = __fmul_rn(v[8 + i], mul);
  }
  uint2 w;
  bool decoded = true;  // false: the residual came with the codes
#if SAGEATTN3_HW_E2M1
  w = make_uint2(e2m1x8_hw(y0), e2m1x8_hw(y1));
#else
  if (sbyte >= 8u && sbyte < 0x7Eu) {  // normal scale below 448: |v * inv| <= 6.4 (not NaN: 0x7F)
    if (want_res) {
      w = make_uint2(e2m1x8_sw<false, true>(y0, &res.lo), e2m1x8_sw<false, true>(y1, &res.hi));
      decoded = false;
    } else {
      w = make_uint2(e2m1x8_sw<false>(y0), e2m1x8_sw<false>(y1));
    }
  } else {  // subnormal, zero, saturated or NaN scale (rare): clamp to 6 first
    w = make_uint2(e2m1x8_sw<true>(y0), e2m1x8_sw<true>(y1));
  }
#endif
  if (want_res && decoded) {  // against the codes kept, unclamped y
    const uint4 none = make_uint4(0u, 0u, 0u, 0u);
    res.lo = ok || zero ? residual8(y0, ok ? w.x : 0u) : none;
    res.hi = ok || zero ? residual8(y1, ok ? w.y : 0u) : none;
  }
  return ok ? w : make_uint2(0u, 0u);
}

__device__ __forceinline__ uint2 codes16(const float (&v)[16], uint32_t sbyte) {
  Residual16 unused;
  return codes16(v, sbyte, unused, false);
}

// 16 values (already smoothed, fp32) of one block whose amax bits are known -> codes of
// elements 0-7 (x) and 8-15 (y), scale byte in `sbyte`.
__device__ __forceinline__ uint2 quant16_with_amax(const float (&v)[16], uint32_t amax_bits, uint32_t& sbyte) {
  sbyte = e4m3_scale_byte(__uint_as_float(amax_bits));
  return codes16(v, sbyte);
}

// The squared error of a block's codes w under scale value s: sum over i = 0..15, in that order,
// of (E2M1(code_i) * s - v_i)^2, each operation rounded in fp32 (no fused multiply-add). The
// dequantized value is exact: code c's fp16 bit pattern ((c & 7) << 9) | ((c & 8) << 12) is
// its E2M1 value times 2^-14 (see kE2M1Prescale), times s * 2^14.
__device__ __forceinline__ float block_sq_error(const float (&v)[16], uint2 w, float s) {
  const float s14 = __fmul_rn(s, 0x1p14f);
  float acc = 0.f;
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const uint32_t word = i < 4 ? w.x : w.y;
    const float2 f = e2m1x2_scaled(word >> (8 * (i % 4)));      // elements 2i (low nibble), 2i + 1
    const float d0 = __fsub_rn(__fmul_rn(f.x, s14), v[2 * i]);
    const float d1 = __fsub_rn(__fmul_rn(f.y, s14), v[2 * i + 1]);
    acc = __fadd_rn(acc, __fmul_rn(d0, d0));
    acc = __fadd_rn(acc, __fmul_rn(d1, d1));
  }
  return acc;
}

// max(acc, |v|), NaN if either is NaN (max.NaN: one instruction, |v| an operand modifier;
// fmaxf would drop a NaN).
__device__ __forceinline__ float abs_max_nan(float acc, float v) {
  float r;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(acc), "f"(fabsf(v)));
  return r;
}

// max |v_i| of a block, NaN if any is NaN.
__device__ __forceinline__ float amax16(const float (&v)[16]) {
  float a = 0.f;
#pragma unroll
  for (int i = 0; i < 16; ++i) a = abs_max_nan(a, v[i]);
  return a;
}

// With want_res: the block's quantization residual into res (codes16).
__device__ __forceinline__ uint2 quant16(const float (&v)[16], uint32_t& sbyte, Residual16& res, bool want_res) {
  sbyte = e4m3_scale_byte(amax16(v));
  return codes16(v, sbyte, res, want_res);
}

__device__ __forceinline__ uint2 quant16(const float (&v)[16], uint32_t& sbyte) {
  Residual16 unused;
  return quant16(v, sbyte, unused, false);
}

// The scale search (reference.quantize_rows(..., scale_search=True)): the block is quantized
// with the scale of amax / 6 and with that of amax / 4, and keeps the second only where its
// squared error (block_sq_error) is strictly smaller. A block whose values sit near 5/6 of its
// max (between E2M1's 4 and 6) loses less with the max mapped onto 4.
// With want_res: the kept codes' quantization residual into res (codes16).
__device__ __forceinline__ uint2 quant16_search(const float (&v)[16], uint32_t& sbyte, Residual16& res, bool want_res) {
  const float a = amax16(v);
  const uint32_t b6 = e4m3_scale_byte(a), b4 = e4m3_scale_byte(a, 4.0f);
  Residual16 r6{make_uint4(0u, 0u, 0u, 0u), make_uint4(0u, 0u, 0u, 0u)}, r4 = r6;
  const uint2 w6 = codes16(v, b6, r6, want_res);
  if (b4 == b6) {
    sbyte = b6;
    res = r6;
    return w6;
  }
  const uint2 w4 = codes16(v, b4, r4, want_res);
  const bool four = block_sq_error(v, w4, e4m3_value(b4)) < block_sq_error(v, w6, e4m3_value(b6));
  sbyte = four ? b4 : b6;
  res = four ? r4 : r6;
  return four ? w4 : w6;
}

__device__ __forceinline__ uint2 quant16_search(const float (&v)[16], uint32_t& sbyte) {
  Residual16 unused;
  return quant16_search(v, sbyte, unused, false);
}

// Raw storage of 16 consecutive elements (one NVFP4 block): loaded with 16-byte vector loads,
// converted to fp32 only when needed.
template <typename T>
struct Raw16 {
  static constexpr int kWords = 16 * static_cast<int>(sizeof(T)) / 4;  // 8 (16-bit) or 16 (fp32)
  uint32_t w[kWords];

  // p: 16-byte aligned. kLastUse: streaming (evict-first) loads, the bytes are not read again;
  // else read-only loads with the default cache policy.
  template <bool kLastUse = true>
  __device__ __forceinline__ void load(const T* p) {
#pragma unroll
    for (int i = 0; i < kWords / 4; ++i) {
      const uint4* a = reinterpret_cast<const uint4*>(p) + i;
      const uint4 r = kLastUse ? __ldcs(a) : __ldg(a);
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
