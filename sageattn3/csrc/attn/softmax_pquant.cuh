// Online softmax (fp32, exp2 domain) and the two-level quantization of P, in registers.
//
// Level 1: P is produced already multiplied by 448*6 = 2688 relative to the running row max m:
//   P2 = exp2(S*scale*log2(e) - m + log2(2688)),  so a row's largest P2 is 2688 in the block that
//   holds the row max and <= 2688 elsewhere (the per-row fp32 factor is folded into the exponent).
//   Row sums l are accumulated from the same P2 (fp32, before level 2), so O/l cancels the factor.
// Level 2: NVFP4 of P2 along the keys: per 16 keys an E4M3 scale amax/6 (<= 448), values
//   multiplied by 1/scale and rounded to E2M1 (nearest even, saturating), like the input quantizer.
#pragma once
#include <cstdint>
#include <cuda_fp8.h>

#include <cuda_fp16.h>

#include "attn/fp4_mma.cuh"
#include "common/nvfp4.cuh"

namespace sageattn3::attn {

constexpr float kLog2P2Max = 11.392317422778761f;  // log2(448 * 6)

__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// 1 / s for a block scale s of P (an E4M3 value in [2^-9, 448]), bit-identical to __frcp_rn(s):
// __frcp_rn compiles to a fast path (the hardware approximation and one fma refinement) guarded by
// an exponent test that branches to an out-of-line slow path for operands where that path could
// round wrongly (denormals, huge values, Inf, NaN). Every E4M3 value is inside the fast path's
// range, so this takes it always, with the compiler's own sequence: 8 branches per tile, their
// reconvergence and the slow-path calls leave the loop (docs/performance.md: ideas tried).
__device__ __forceinline__ float rcp_scale(float s) {
  float r;
  asm("rcp.approx.ftz.f32 %0, %1;\n" : "=f"(r) : "f"(s));
  return fmaf(r, fmaf(-s, r, 1.f), r);
}

// e4m3_scale_byte(amax) for P's block amax (>= 0, at most 2688, no denormal after
// ex2.approx.ftz), bit-identical: amax / 6 through the compiler's own fast path of the IEEE
// division (the reciprocal of 6 refined once, the quotient and one correction step), without
// the FCHK range test whose slow path (a call, its branches and reconvergence, 8 per tile) only
// operands outside that range take.
__device__ __forceinline__ uint32_t p_scale_byte(float amax) {
  const float y0 = 0x1.555556p-3f;  // RN(1/6), the compiler's starting reciprocal
  const float y = __fmaf_rn(__fmaf_rn(y0, -6.f, 1.f), y0, y0);
  const float q0 = __fmaf_rn(amax, y, 0.f);
  const float q = __fmaf_rn(y, __fmaf_rn(q0, -6.f, amax), q0);
  return static_cast<uint32_t>(__nv_cvt_float_to_fp8(q, __NV_SATFINITE, __NV_E4M3)) & 0x7Fu;
}

// NVFP4 numerics of P, the same rules as sageattn3.reference.quantize_rows (the hardware
// conversion is common/nvfp4.cuh's; the software one below is this kernel's own):
// |x| -> E2M1 code, round to nearest, ties to the even code, saturating at 6.
__device__ __forceinline__ uint32_t p_e2m1_code(float x) {
  const float a = fabsf(x);
  const uint32_t m = (a > 0.25f) + (a >= 0.75f) + (a > 1.25f) + (a >= 1.75f) + (a > 2.5f) + (a >= 3.5f) + (a > 5.0f);
  return ((__float_as_uint(x) >> 31) << 3) | m;
}

// Eight non-negative floats (already divided by their block scale) -> eight E2M1 codes, element i
// in bits [4i, 4i+4).
__device__ __forceinline__ uint32_t e2m1x8(const float (&v)[8], float inv) {
  float y[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) y[i] = __fmul_rn(v[i], inv);
#if defined(SAGEATTN3_TIMING_STANDIN_E2M1)
  // timing stand-in (test flavour only, see common/nvfp4.cuh): the issue cost of sm_120's
  // hardware conversion, wrong codes
  return e2m1x8_sw<false>(y);
#elif SAGEATTN3_HW_E2M1 && !defined(SAGEATTN3_MMA_MODEL) && !defined(SAGEATTN3_SOFTWARE_E2M1)
  return e2m1x8_hw(y);
#else
  uint32_t r = 0;
#pragma unroll
  for (int i = 0; i < 8; ++i) r |= p_e2m1_code(y[i]) << (4 * i);
  return r;
#endif
}

// One 64-key chunk of P for one warp: the A fragment (a0..a3) and the scale operand.
// p[h][r][i]: row g + 8r, keys 32h + 8t + i of the chunk (lane = 4g + t).
// The scale register of lane 4g + t holds the 4 block scales of row g + 8(t&1), so it serves as
// SF_A with thread-id-a 0 (and 1).
// amax[h][r]: the largest value of the 16-key block 32h + 16(t>>1) of row g + 8r (lanes t and t^1
// share it), computed by the caller.
__device__ __forceinline__ void quantize_p_chunk(const float (&p)[2][2][8], const float (&amax)[2][2], uint32_t (&a)[4],
                                                 uint32_t& sf) {
  const int t = threadIdx.x & 3;
  uint32_t byte[2][2];  // [h][r]
#pragma unroll
  for (int h = 0; h < 2; ++h) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const uint32_t sb = p_scale_byte(amax[h][r]);
      const float s = e4m3_value(sb);
      const float inv = s > 0.f ? rcp_scale(s) : 0.f;
      a[2 * h + r] = e2m1x8(p[h][r], inv);
      byte[h][r] = sb;
    }
  }
  // Lane t owns blocks (t>>1) and 2 + (t>>1) of row g + 8(t&1); lane t^2 owns the other two.
  const uint32_t r = t & 1;
  const uint32_t mine = r ? (byte[0][1] | (byte[1][1] << 8)) : (byte[0][0] | (byte[1][0] << 8));
  const uint32_t other = __shfl_xor_sync(0xffffffffu, mine, 2);
  const uint32_t lo = (t >> 1) ? other : mine, hi = (t >> 1) ? mine : other;
  sf = (lo & 0xffu) | ((hi & 0xffu) << 8) | ((lo >> 8) << 16) | ((hi >> 8) << 24);
}

}  // namespace sageattn3::attn
