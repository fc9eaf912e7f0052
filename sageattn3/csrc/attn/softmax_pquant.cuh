// Online softmax (fp32, exp2 domain) and the two-level quantization of P, in registers.
//
// Level 1: P is produced already multiplied by 448*6 = 2688 relative to the running row max m:
//   P2 = exp2(S*scale*log2(e) - m + log2(2688)),  so a row's largest P2 is 2688 in the block that
//   holds the row max and <= 2688 elsewhere (the per-row fp32 factor is folded into the exponent).
//   Row sums l are accumulated from the same P2 (fp32, before level 2), so O/l cancels the factor.
// Level 2: NVFP4 of P2 along the keys: per 16 keys an E4M3 scale s = amax/6 (<= 448), values
//   P2 / s rounded to E2M1 (nearest even, saturating), like the input quantizer. The division is
//   folded into the exponent too: P2 / s = exp2(S*scale*log2(e) - m + log2(2688) - log2(s)), the
//   block's amax (exp2 of its largest exponent) and s coming first (p_chunk_nvfp4).
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
// range, so this takes it always, with the compiler's own sequence (docs/performance.md: ideas
// tried).
__device__ __forceinline__ float rcp_scale(float s) {
  float r;
  asm("rcp.approx.ftz.f32 %0, %1;\n" : "=f"(r) : "f"(s));
  return fmaf(r, fmaf(-s, r, 1.f), r);
}

// P's block scale for a block amax (>= 0, at most 2688, no denormal after ex2.approx.ftz):
// RN(amax / 6) through the compiler's own fast path of the IEEE division (the reciprocal of 6
// refined once, the quotient and one correction step), without the FCHK range test whose slow
// path (a call, its branches and reconvergence, 8 per tile) only operands outside that range take.
// p_scale_bytes then rounds two of them to E4M3 (e4m3_scale_byte's byte, as the reference).
__device__ __forceinline__ float p_scale_quot(float amax) {
  const float y0 = 0x1.555556p-3f;  // RN(1/6), the compiler's starting reciprocal
  const float y = __fmaf_rn(__fmaf_rn(y0, -6.f, 1.f), y0, y0);
  const float q0 = __fmaf_rn(amax, y, 0.f);
  return __fmaf_rn(y, __fmaf_rn(q0, -6.f, amax), q0);
}

// Two scales to E4M3 bytes in one conversion (the instruction __nv_cvt_float_to_fp8 issues for
// one, satfinite): lo in bits 0-7, hi in bits 8-15, bits 16-31 zero. A NaN converts to a NaN
// byte of either sign; the caller clears the sign bits (p_chunk_nvfp4).
__device__ __forceinline__ uint32_t p_scale_bytes(float lo, float hi) {
  uint32_t w;
  asm("{\n .reg .b16 h;\n cvt.rn.satfinite.e4m3x2.f32 h, %1, %2;\n cvt.u32.u16 %0, h;\n}\n" : "=r"(w) : "f"(hi), "f"(lo));
  return w;
}

// P's block scales by E4M3 byte b, a table in shared memory for p_chunk_nvfp4, 8 bytes an
// entry: {s, log2(s)} for s = e4m3_value(b & 0x7F) > 0; {1, 0} where s is 0 or NaN (b & 0x7F = 0,
// 0x7F). Where s is 0 the values stay P2 and the row sum still gets P2: such a block holds
// P2 <= 2^-10 * 6, whose codes round to 0, and the MMA's scale byte 0 drops it anyway. (Where s
// is NaN, P2 is too: the output is NaN, as before the table.)
constexpr int kPScaleBytes = 256;
constexpr int kPScaleEntry = 8;
__device__ __forceinline__ void p_scale_table(uint8_t* table, int b) {
  const float s = e4m3_value(static_cast<uint32_t>(b) & 0x7Fu);
  reinterpret_cast<float2*>(table)[b] = s > 0.f ? make_float2(s, log2f(s)) : make_float2(1.f, 0.f);
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
__device__ __forceinline__ uint32_t e2m1x8(const float (&y)[8]) {
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

// One 64-key chunk of P for one warp, from its scores (the FP4 Q.K^T instantiations): the A
// fragment (a0..a3) and the scale operand, P / s computed in the exponent, and the chunk's P2
// added to row_sum (in key order per row, as the exponentials before: each value's P2 as y * s).
// y differs from RN(P2 * RN(1 / s)) by the rounding of bias - log2(s): half an ulp of |bias| in
// the exponent, about 2.6e-6 relative where |m| = 100 in log2 units (docs/performance.md).
// sc[h][r][i]: S of row g + 8r, keys 32h + 8t + i of the chunk (lane = 4g + t); bias[r]: row
// g + 8r's exponent offset (log2(2688) - m); amax[h][r]: the P2 of the largest S in the 16-key
// block 32h + 16(t>>1) of row g + 8r (lanes t and t^1 share it), computed by the caller; p_tab:
// the shared address of p_scale_table's table.
// The scale register of lane 4g + t holds the 4 block scales of row g + 8(t&1), so it serves as
// SF_A with thread-id-a 0 (and 1).
__device__ __forceinline__ void p_chunk_nvfp4(const float (&sc)[2][2][8], const float (&amax)[2][2], const float (&bias)[2],
                                              float scale_log2, uint32_t p_tab, float (&row_sum)[2], uint32_t (&a)[4],
                                              uint32_t& sf) {
  const int t = threadIdx.x & 3;
  // bytes[r]: the scale bytes of row g + 8r's blocks h = 0 (bits 0-7) and h = 1 (bits 8-15)
  uint32_t bytes[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) bytes[r] = p_scale_bytes(p_scale_quot(amax[0][r]), p_scale_quot(amax[1][r]));
#pragma unroll
  for (int h = 0; h < 2; ++h) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const uint32_t sb = (bytes[r] >> (8 * h)) & 0xFFu;
      float2 e;  // {s, log2 s}; the table is fixed: not volatile
      asm("ld.shared.v2.f32 {%0, %1}, [%2];\n" : "=f"(e.x), "=f"(e.y) : "r"(p_tab + kPScaleEntry * sb));
      const float b = __fsub_rn(bias[r], e.y);
      float y[8];
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        y[i] = fast_exp2(fmaf(sc[h][r][i], scale_log2, b));
        row_sum[r] = fmaf(y[i], e.x, row_sum[r]);
      }
      a[2 * h + r] = e2m1x8(y);
    }
  }
  // Lane t owns blocks (t>>1) and 2 + (t>>1) of row g + 8(t&1) (bytes 0, 1 of `mine`); lane t^2
  // owns the other two. sf's bytes: blocks 0, 1, 2, 3 of the row, i.e. {lo.0, hi.0, lo.1, hi.1}
  // with lo the lane of t>>1 = 0 (byte_perm selectors: 0-3 the first word's bytes, 4-7 the
  // second's), each byte's sign bit cleared.
  const uint32_t mine = (t & 1) ? bytes[1] : bytes[0];
  const uint32_t other = __shfl_xor_sync(0xffffffffu, mine, 2);
  sf = __byte_perm(mine, other, (t >> 1) ? 0x1504 : 0x5140) & 0x7F7F7F7Fu;
}

// The same chunk from its P2 (the FP8 / 16-bit Q.K^T instantiations, whose row sums the caller
// took from P2): the values are P2 x (1 / s), 1 / s in registers, each block's scale byte
// converted alone and the scale word packed with shifts, the code as before the table: the
// timing stand-in measured these kernels 2-3% slower with the folded path and with the table's
// reciprocals (docs/performance.md). p[h][r][i]: P2 of row g + 8r, keys 32h + 8t + i.
__device__ __forceinline__ void quantize_p_chunk(const float (&p)[2][2][8], const float (&amax)[2][2], uint32_t (&a)[4],
                                                 uint32_t& sf) {
  const int t = threadIdx.x & 3;
  uint32_t byte[2][2];  // [h][r]
#pragma unroll
  for (int h = 0; h < 2; ++h) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const uint32_t sb = static_cast<uint32_t>(__nv_cvt_float_to_fp8(p_scale_quot(amax[h][r]), __NV_SATFINITE, __NV_E4M3)) & 0x7Fu;
      const float s = e4m3_value(sb);
      const float inv = s > 0.f ? rcp_scale(s) : 0.f;
      float y[8];
#pragma unroll
      for (int i = 0; i < 8; ++i) y[i] = __fmul_rn(p[h][r][i], inv);
      a[2 * h + r] = e2m1x8(y);
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
