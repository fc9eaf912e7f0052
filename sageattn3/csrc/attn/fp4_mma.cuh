// The one tensor-core instruction of the attention kernel, and its software model.
//
//   mma.sync.aligned.kind::mxf4nvf4.block_scale.scale_vec::4X.m16n8k64.row.col.f32.e2m1.e2m1.f32.ue4m3
//
// D(16x8, f32) = (A(16x64, e2m1) * SF_A) x (B(64x8, e2m1) * SF_B) + C, where every row of A and
// every column of B has four UE4M3 scale factors, one per 16 consecutive k.
//
// Register fragments (PTX ISA, "Matrix Fragments for mma.m16n8k64", e2m1; lane = 4*g + t with
// g = groupID = lane >> 2 and t = threadID_in_group = lane & 3; element i of a register sits in
// bits [4i, 4i+4)):
//   A  a0: row g,   k  8t .. 8t+7        a1: row g+8, k  8t .. 8t+7
//      a2: row g,   k 32+8t .. 32+8t+7   a3: row g+8, k 32+8t .. 32+8t+7
//   B  b0: col g,   k  8t .. 8t+7        b1: col g,   k 32+8t .. 32+8t+7
//   C/D d0: (g, 2t)  d1: (g, 2t+1)  d2: (g+8, 2t)  d3: (g+8, 2t+1)
// Scale factors ("Block Scaling for mma.sync", scale_vec::4X with ue4m3: byte-id must be 0 and
// the four bytes of the 32-bit operand are the four k-chunks, byte s = k 16s .. 16s+15):
//   SF_A of row g   comes from lane 4g + 2*thread-id-a,  of row g+8 from lane 4g + 2*thread-id-a + 1
//   SF_B of col n   comes from lane 4n + thread-id-b
// (thread-id-a in {0,1}, thread-id-b in {0,1,2,3}; the operands of the other lanes are ignored).
//
// mma_fp4<TID_A, TID_B>(d, a, b, c, sfa, sfb) is the real instruction on the sm_120 family and,
// when SAGEATTN3_MMA_MODEL is defined (the test flavour, compiled for sm_90a), a model that
// gathers the same operands from the same lanes with warp shuffles and computes the same sums in
// fp32 (products of e2m1 values and the per-chunk sums are exact; the 4 chunk sums are scaled by
// SF_A*SF_B and added to C in order). All 32 lanes must call it together, as for mma.sync.
//
// SAGEATTN3_TIMING_STANDIN_MMA=N (test flavour only, never in a build: tests/bench/attention_standin.py)
// replaces the model by N fp16 mma.sync m16n8k16 per call on the same registers (A: 4, B: 2,
// C/D: 4 per lane, the same fragment sizes), so the sm_90 tensor cores do real work of
// comparable cost: N = 4 is the FP4 MMA's 8192 multiply-adds. (FP8 m16n8k32 would be the
// closer shape, but sm_90 has no FP8 mma.sync in hardware: ptxas turns it into conversions and
// HMMA.) The scale operands are inputs of the same asm statement, so everything that computes
// them stays. The values are WRONG (FP4 codes read as fp16): this is for timing only.
#pragma once
#include <cstdint>

#include "common/mma16.cuh"  // mma_m16n8k16<T>: the 16-bit Q.K^T

#if defined(SAGEATTN3_TIMING_STANDIN_MMA) && !defined(SAGEATTN3_MMA_MODEL)
#error "SAGEATTN3_TIMING_STANDIN_MMA gives wrong values: a timing experiment of the test flavour only"
#endif

#if defined(__CUDA_ARCH_FEAT_SM120_ALL) || defined(__CUDA_ARCH_FEAT_SM121_ALL) || \
    (defined(__CUDA_ARCH_SPECIFIC__) && (__CUDA_ARCH_SPECIFIC__ == 1200 || __CUDA_ARCH_SPECIFIC__ == 1210)) || \
    (defined(__CUDA_ARCH_FAMILY_SPECIFIC__) && (__CUDA_ARCH_FAMILY_SPECIFIC__ == 1200))
#define SAGEATTN3_HAS_FP4_MMA 1
#endif

namespace sageattn3::attn {

// E2M1 code (4 bits) -> value, exact.
__device__ __forceinline__ float e2m1_value(uint32_t code) {
  const uint32_t m = code & 7u;
  // magnitudes {0, .5, 1, 1.5, 2, 3, 4, 6}
  const float mag = m < 4u ? 0.5f * static_cast<float>(m) : static_cast<float>((m & 1u) ? (m == 5u ? 3 : 6) : (m == 4u ? 2 : 4));
  return (code & 8u) ? -mag : mag;
}

// UE4M3 byte -> value (bias 7, subnormals, 0x7f = NaN).
__device__ __forceinline__ float ue4m3_value(uint32_t byte) {
  byte &= 0x7fu;
  if (byte == 0x7fu) return __int_as_float(0x7fffffff);
  const uint32_t e = byte >> 3, m = byte & 7u;
  if (e == 0) return static_cast<float>(m) * 0.001953125f;  // m * 2^-9
  return __uint_as_float(((e + 120u) << 23) | (m << 20));     // (1 + m/8) * 2^(e-7)
}

#if defined(SAGEATTN3_MMA_MODEL)
namespace model {

// Dot product of 8 e2m1 pairs, times 4 (an exact integer: every e2m1 value is a multiple of .5).
__device__ __forceinline__ int dot8_x4(uint32_t x, uint32_t y) {
  int s = 0;
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const float p = e2m1_value((x >> (4 * i)) & 15u) * e2m1_value((y >> (4 * i)) & 15u);
    s += static_cast<int>(p * 4.f);
  }
  return s;
}

struct Acc {
  float d0, d1, d2, d3;
};

// Not inlined: the kernel has dozens of MMA sites, and one out-of-line model keeps the test
// flavour's compile time and code size small (its speed does not matter).
static __device__ __noinline__ Acc mma(uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0, uint32_t b1,
                                float c0, float c1, float c2, float c3, uint32_t sfa, uint32_t sfb, int tid_a,
                                int tid_b) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const uint32_t a[4] = {a0, a1, a2, a3}, b[2] = {b0, b1};
  float acc[4] = {c0, c1, c2, c3};
  // Scale operands of the rows this lane produces (g, g+8) and of its columns (2t, 2t+1).
  const uint32_t sa_lo = __shfl_sync(0xffffffffu, sfa, 4 * g + 2 * tid_a);
  const uint32_t sa_hi = __shfl_sync(0xffffffffu, sfa, 4 * g + 2 * tid_a + 1);
  const uint32_t sb_0 = __shfl_sync(0xffffffffu, sfb, 4 * (2 * t) + tid_b);
  const uint32_t sb_1 = __shfl_sync(0xffffffffu, sfb, 4 * (2 * t + 1) + tid_b);
  // k-chunk s (k 16s .. 16s+15): k 16s + 8h + i sits in element i of register a[2(s>>1)] (row g)
  // / a[2(s>>1)+1] (row g+8) of lane 4g + 2(s&1) + h, and of b[s>>1] of lane 4n + 2(s&1) + h.
#pragma unroll 1
  for (int s = 0; s < 4; ++s) {
    int sum[4] = {0, 0, 0, 0};
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int src_t = 2 * (s & 1) + h;
      const uint32_t ar_lo = (s >> 1) ? a[2] : a[0], ar_hi = (s >> 1) ? a[3] : a[1], br = (s >> 1) ? b[1] : b[0];
      const uint32_t x_lo = __shfl_sync(0xffffffffu, ar_lo, 4 * g + src_t);
      const uint32_t x_hi = __shfl_sync(0xffffffffu, ar_hi, 4 * g + src_t);
      const uint32_t y_0 = __shfl_sync(0xffffffffu, br, 4 * (2 * t) + src_t);
      const uint32_t y_1 = __shfl_sync(0xffffffffu, br, 4 * (2 * t + 1) + src_t);
      sum[0] += dot8_x4(x_lo, y_0);
      sum[1] += dot8_x4(x_lo, y_1);
      sum[2] += dot8_x4(x_hi, y_0);
      sum[3] += dot8_x4(x_hi, y_1);
    }
    const float fa_lo = ue4m3_value((sa_lo >> (8 * s)) & 0xffu), fa_hi = ue4m3_value((sa_hi >> (8 * s)) & 0xffu);
    const float fb_0 = ue4m3_value((sb_0 >> (8 * s)) & 0xffu), fb_1 = ue4m3_value((sb_1 >> (8 * s)) & 0xffu);
    acc[0] += (static_cast<float>(sum[0]) * 0.25f) * (fa_lo * fb_0);
    acc[1] += (static_cast<float>(sum[1]) * 0.25f) * (fa_lo * fb_1);
    acc[2] += (static_cast<float>(sum[2]) * 0.25f) * (fa_hi * fb_0);
    acc[3] += (static_cast<float>(sum[3]) * 0.25f) * (fa_hi * fb_1);
  }
  return Acc{acc[0], acc[1], acc[2], acc[3]};
}

}  // namespace model
#endif

#if defined(SAGEATTN3_TIMING_STANDIN_MMA)
static_assert(SAGEATTN3_TIMING_STANDIN_MMA >= 1 && SAGEATTN3_TIMING_STANDIN_MMA <= 8, "1 to 8 fp16 MMAs per FP4/FP8 MMA");
// The timing stand-in of a block-scaled MMA: N fp16 mma.sync m16n8k16 on the same registers,
// the scale operands kept live, so the kernel around it keeps its shape on Hopper.
__device__ __forceinline__ void standin_mma(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2],
                                            const float (&c)[4], uint32_t sfa, uint32_t sfb) {
  float acc[4] = {c[0], c[1], c[2], c[3]};
#pragma unroll
  for (int i = 0; i < SAGEATTN3_TIMING_STANDIN_MMA; ++i) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        "// scale operands (kept live, unused): %10 %11\n"
        : "+f"(acc[0]), "+f"(acc[1]), "+f"(acc[2]), "+f"(acc[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "r"(sfa), "r"(sfb));
  }
  d[0] = acc[0]; d[1] = acc[1]; d[2] = acc[2]; d[3] = acc[3];
}
#endif

template <int TID_A, int TID_B>
__device__ __forceinline__ void mma_fp4(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2],
                                        const float (&c)[4], uint32_t sfa, uint32_t sfb) {
  static_assert(TID_A >= 0 && TID_A < 2 && TID_B >= 0 && TID_B < 4, "scale selectors out of range");
#if defined(SAGEATTN3_TIMING_STANDIN_MMA)
  standin_mma(d, a, b, c, sfa, sfb);
#elif defined(SAGEATTN3_MMA_MODEL)
  const model::Acc r = model::mma(a[0], a[1], a[2], a[3], b[0], b[1], c[0], c[1], c[2], c[3], sfa, sfb, TID_A, TID_B);
  d[0] = r.d0; d[1] = r.d1; d[2] = r.d2; d[3] = r.d3;
#elif defined(SAGEATTN3_HAS_FP4_MMA)
  asm volatile(
      "mma.sync.aligned.kind::mxf4nvf4.block_scale.scale_vec::4X.m16n8k64.row.col.f32.e2m1.e2m1.f32.ue4m3 "
      "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%10, %11, %12, %13}, "
      "{%14}, {0, %16}, {%15}, {0, %17};\n"
      : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]),
        "f"(c[0]), "f"(c[1]), "f"(c[2]), "f"(c[3]), "r"(sfa), "r"(sfb), "n"(TID_A), "n"(TID_B));
#else
  // No FP4 tensor cores on this target and no model requested: the kernels are never launched
  // here (the host refuses), this only keeps the code compilable for other archs.
  (void)a; (void)b; (void)sfa; (void)sfb;
  d[0] = c[0]; d[1] = c[1]; d[2] = c[2]; d[3] = c[3];
  __trap();
#endif
}

// ---------------------------------------------------------------------------------------------
// The FP8 Q.K^T instruction (the "fp8" / "auto" qk_precision), and its software model.
//
//   mma.sync.aligned.kind::mxf8f6f4.block_scale.scale_vec::1X.m16n8k32.row.col.f32.e4m3.e4m3.f32.ue8m0
//
// D(16x8, f32) = (A(16x32, e4m3) * SF_A) x (B(32x8, e4m3) * SF_B) + C, one UE8M0 scale (2^(b-127))
// per row of A and per column of B. Fragments (PTX ISA, m16n8k32 with 8-bit elements; byte i of a
// register is element i): A a0: row g, k 4t..4t+3; a1: row g+8, k 4t..; a2: row g, k 16+4t..;
// a3: row g+8, k 16+4t..; B b0: col g, k 4t..4t+3; b1: col g, k 16+4t... In bytes this is the FP4
// instruction's layout, so the same ldmatrix loads feed it (32 bytes = one k-chunk of either).
// Scale factors (scale_vec::1X: byte-id picks one byte of the 32-bit operand): SF_A of row g from
// lane 4g + 2*thread-id-a, of row g+8 from lane 4g + 2*thread-id-a + 1; SF_B of col n from lane
// 4n + thread-id-b; the kernel passes thread-id 0 and byte-id = the k-chunk, so one 32-bit word per
// row holds all its chunks' scales. (This selector reading follows the 4X layout above; the model
// implements it and has not been checked against sm_120 hardware.)
//
// The model: each product of two E4M3 values is an exact multiple of 2^-18 below 2^36 of it, so
// the 32 products are summed exactly in 64-bit integers, converted to fp32 once, scaled by
// SF_A * SF_B (a power of two) and added to C. The timing stand-in issues the same number of fp16
// MMAs as for the FP4 instruction: the FP8 one does half the multiply-adds at half the rate.
#if defined(SAGEATTN3_MMA_MODEL)
namespace model {

// E4M3 byte -> value * 2^9, an exact integer (|.| <= 448 * 512); NaN bytes (0x7f/0xff) give 0.
__device__ __forceinline__ int e4m3_x512(uint32_t byte) {
  const uint32_t e = (byte >> 3) & 15u, m = byte & 7u;
  if ((byte & 0x7fu) == 0x7fu) return 0;
  const int mag = e == 0 ? static_cast<int>(m) : static_cast<int>((8u + m) << (e - 1));
  return (byte & 0x80u) ? -mag : mag;
}

__device__ __forceinline__ long long dot4_x2e18(uint32_t x, uint32_t y) {
  long long s = 0;
#pragma unroll
  for (int i = 0; i < 4; ++i) s += static_cast<long long>(e4m3_x512((x >> (8 * i)) & 255u)) * e4m3_x512((y >> (8 * i)) & 255u);
  return s;
}

__device__ __forceinline__ float ue8m0_value(uint32_t byte) {
  byte &= 0xffu;
  if (byte == 0xffu) return __int_as_float(0x7fffffff);
  if (byte == 0u) return 0x1p-127f;
  return __uint_as_float(byte << 23);
}

static __device__ __noinline__ Acc mma8(uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0, uint32_t b1,
                                        float c0, float c1, float c2, float c3, uint32_t sfa, uint32_t sfb,
                                        int byte_a, int byte_b) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const uint32_t a[4] = {a0, a1, a2, a3}, b[2] = {b0, b1};
  const uint32_t sa_lo = __shfl_sync(0xffffffffu, sfa, 4 * g), sa_hi = __shfl_sync(0xffffffffu, sfa, 4 * g + 1);
  const uint32_t sb_0 = __shfl_sync(0xffffffffu, sfb, 4 * (2 * t)), sb_1 = __shfl_sync(0xffffffffu, sfb, 4 * (2 * t + 1));
  long long sum[4] = {0, 0, 0, 0};
#pragma unroll 1
  for (int h = 0; h < 2; ++h) {
#pragma unroll 1
    for (int src_t = 0; src_t < 4; ++src_t) {
      const uint32_t x_lo = __shfl_sync(0xffffffffu, a[2 * h], 4 * g + src_t);
      const uint32_t x_hi = __shfl_sync(0xffffffffu, a[2 * h + 1], 4 * g + src_t);
      const uint32_t y_0 = __shfl_sync(0xffffffffu, b[h], 4 * (2 * t) + src_t);
      const uint32_t y_1 = __shfl_sync(0xffffffffu, b[h], 4 * (2 * t + 1) + src_t);
      sum[0] += dot4_x2e18(x_lo, y_0);
      sum[1] += dot4_x2e18(x_lo, y_1);
      sum[2] += dot4_x2e18(x_hi, y_0);
      sum[3] += dot4_x2e18(x_hi, y_1);
    }
  }
  const float fa_lo = ue8m0_value(sa_lo >> (8 * byte_a)), fa_hi = ue8m0_value(sa_hi >> (8 * byte_a));
  const float fb_0 = ue8m0_value(sb_0 >> (8 * byte_b)), fb_1 = ue8m0_value(sb_1 >> (8 * byte_b));
  const float k = 0x1p-18f;
  return Acc{c0 + (static_cast<float>(sum[0]) * k) * (fa_lo * fb_0), c1 + (static_cast<float>(sum[1]) * k) * (fa_lo * fb_1),
             c2 + (static_cast<float>(sum[2]) * k) * (fa_hi * fb_0), c3 + (static_cast<float>(sum[3]) * k) * (fa_hi * fb_1)};
}

}  // namespace model
#endif

template <int BYTE_A, int BYTE_B>
__device__ __forceinline__ void mma_fp8(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2],
                                        const float (&c)[4], uint32_t sfa, uint32_t sfb) {
  static_assert(BYTE_A >= 0 && BYTE_A < 4 && BYTE_B >= 0 && BYTE_B < 4, "scale byte selectors out of range");
#if defined(SAGEATTN3_TIMING_STANDIN_MMA)
  standin_mma(d, a, b, c, sfa, sfb);
#elif defined(SAGEATTN3_MMA_MODEL)
  const model::Acc r = model::mma8(a[0], a[1], a[2], a[3], b[0], b[1], c[0], c[1], c[2], c[3], sfa, sfb, BYTE_A, BYTE_B);
  d[0] = r.d0; d[1] = r.d1; d[2] = r.d2; d[3] = r.d3;
#elif defined(SAGEATTN3_HAS_FP4_MMA)
  asm volatile(
      "mma.sync.aligned.kind::mxf8f6f4.block_scale.scale_vec::1X.m16n8k32.row.col.f32.e4m3.e4m3.f32.ue8m0 "
      "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%10, %11, %12, %13}, "
      "{%14}, {%16, 0}, {%15}, {%17, 0};\n"
      : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]),
        "f"(c[0]), "f"(c[1]), "f"(c[2]), "f"(c[3]), "r"(sfa), "r"(sfb), "n"(BYTE_A), "n"(BYTE_B));
#else
  (void)a; (void)b; (void)sfa; (void)sfb;
  d[0] = c[0]; d[1] = c[1]; d[2] = c[2]; d[3] = c[3];
  __trap();
#endif
}

// ---------------------------------------------------------------------------------------------
// The 16-bit Q.K^T (D 64 heads the rule gives more than FP4: bf16 rows of the same smoothed,
// rotated values the FP8 path quantizes, reference.qk16_rows; at D 128 the raw 16-bit rows, bf16
// or fp16) is common/mma16.cuh's mma_m16n8k16<T>:
//
//   mma.sync.aligned.m16n8k16.row.col.f32.{bf16,f16}.{bf16,f16}.f32
//
// Fragments (PTX ISA, m16n8k16 with 16-bit elements; the low half of a register is the lower k):
// A a0: row g, k 2t, 2t+1; a1: row g+8, k 2t..; a2: row g, k 8+2t..; a3: row g+8, k 8+2t..; B b0:
// col g, k 2t, 2t+1; b1: col g, k 8+2t... In bytes (32 per k16 chunk) this is the FP8
// instruction's layout above, so the FP8 path's ldmatrix loads feed it unchanged. No scales. The
// products of two 16-bit values are exact in fp32; the instruction is native on sm_90 and sm_120,
// so the test flavour runs it too (no model).

}  // namespace sageattn3::attn
