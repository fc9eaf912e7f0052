// NVFP4 along the sequence (the layout of V): x (G, S, D) -> packed (G, D, Sp/2), scales
// (G, D, Sp/16).
//
// A CTA transposes one tile of 256 tokens x 128 bytes of channels (64 channels of 16-bit
// input, 32 of fp32) through shared memory so that both sides are coalesced. On an H100 the
// E2M1 conversion is software (about 10 instructions an element), so the kernel is about as
// much instruction-bound as memory-bound: every instruction outside the conversion counts.
//   0. the grid is (s tiles, d tiles, groups): no 64-bit division per tile (a launch per
//      65535 groups);
//   1. load: each token's 128-byte row segment is 8 16-byte streaming loads by 8 consecutive
//      threads; every thread issues all of its loads before storing any to shared memory (a
//      quarter warp stores one whole 128-byte row: no bank conflicts, no padding needed);
//   2. convert: warp w takes 16-token blocks w and w+8; lane l reads 32-bit word column l (two
//      16-bit channels) over the block's 16 tokens (a warp reads whole rows: conflict-free),
//      amax on the raw patterns two channels at a time, fp16 widened with the half selectors
//      (no unpacking); codes staged in shared memory in 16-byte slots with an XOR swizzle;
//   3. store: each channel's 128 bytes of codes by 8 consecutive threads as 16-byte streaming
//      stores (8-byte ones where the output rows are not 16-byte aligned), each channel's 16
//      scale bytes as one 16-byte store (8-byte or single ones where unaligned or at the end).
// With V's tile exponents (kExp, preprocess_qkv): before 2., each 128-token half of the tile and
// 32-channel group gets e, the largest with amax · 2^e <= 2688 (v_tile_exponent; the amax from
// the same raw patterns, reduced over the group's lanes and the half's 8 warps through shared
// memory), and 2. quantizes x · 2^e (exact: a power of two) with the block amax times 2^e. The
// two halves of a tile are the attention's 128-key tiles; 32 channels are one warp's 16 lanes
// (16-bit input) or all 32 (fp32), so every group lies inside one CTA.
#include <type_traits>

#include "common/launch.cuh"
#include "common/nvfp4.cuh"
#include "common/tile_rows.cuh"
#include "sageattn3.h"

namespace sageattn3 {
namespace {

constexpr int kThreads = 256;
constexpr int kTS = 256;              // tokens per tile
constexpr int kRowBytes = 128;        // channel bytes per tile row
constexpr int kWords = kRowBytes / 4; // 32-bit words per tile row
constexpr int kSegs = kTS / 16;       // 16-token blocks per tile
constexpr int kPairs = kSegs / 2;     // 16-byte code chunks per channel per tile
static_assert(kWords == 32 && kPairs == 8, "one lane per word column, 8 chunks per channel");

template <typename T>
__host__ __device__ constexpr int channels() { return kRowBytes / static_cast<int>(sizeof(T)); }

// Slot of 16-byte code chunk `pair` of the channel whose word column is `w`: the converting
// lanes of a quarter warp (consecutive w) hit distinct banks, and so do the reads of one
// channel's 8 chunks by 8 consecutive threads.
__device__ __forceinline__ int chunk_slot(int w, int pair) { return pair ^ (w & 7); }

// The exponent of a V tile whose largest |value| has float bits a (reference.v_tile_exponents):
// 2688 = 1.3125 · 2^11, so amax = 1.f · 2^(E - 127) gives 11 - (E - 127), one less where
// 1.f > 1.3125; 0 for zeros and NaN; clamped to +-kVExpMax.
constexpr int kVExpMax = 40;
__device__ __forceinline__ int v_tile_exponent(uint32_t a) {
  if (a == 0u || a > 0x7F800000u) return 0;
  const int e = 138 - static_cast<int>(a >> 23) - ((a & 0x7FFFFFu) > 0x280000u ? 1 : 0);
  return e < -kVExpMax ? -kVExpMax : (e > kVExpMax ? kVExpMax : e);
}

// amax bits (as float bits) of word column `lane` over the 16 rows of block `seg`: for 16-bit
// input the larger of the word's two channels.
template <typename T>
__device__ __forceinline__ uint32_t block_amax_bits(const uint32_t (*tile)[kWords], int seg, int lane) {
  uint32_t m = 0;
#pragma unroll
  for (int i = 0; i < 16; ++i) m = sizeof(T) == 2 ? __vmaxu2(m, tile[seg * 16 + i][lane] & 0x7FFF7FFFu)
                                                   : max(m, tile[seg * 16 + i][lane] & 0x7FFFFFFFu);
  if constexpr (std::is_same_v<T, bf16_t>) return max(m << 16, m & 0xFFFF0000u);
  if constexpr (std::is_same_v<T, f16_t>) {
    const uint32_t lo = __float_as_uint(__half2float(__ushort_as_half(static_cast<unsigned short>(m & 0xFFFFu))));
    const uint32_t hi = __float_as_uint(__half2float(__ushort_as_half(static_cast<unsigned short>(m >> 16))));
    return max(lo, hi);
  }
  return m;
}

// 1b of the kernel (kExp): per 128-token half k of the tile and 32-channel group, the group's
// amax (this lane's two channels or one, the group's lanes by shuffles, the half's 8 warps through
// shared memory), its exponent e into exps (one lane per half and group) and 2^e into fac[k].
template <typename T, int kGroups>
__device__ __forceinline__ void tile_exponents(const uint32_t (*tile)[kWords], uint32_t (*group_amax)[kGroups][kThreads / 32],
                                               int warp, int lane, int64_t s0, int64_t d0, int64_t Sp, int64_t D,
                                               int8_t* __restrict__ exps, float (&fac)[2]) {
  constexpr int kGroupLanes = 32 / kGroups;  // lanes per group (a lane holds 2 channels or 1)
#pragma unroll
  for (int k = 0; k < 2; ++k) {
    uint32_t m = block_amax_bits<T>(tile, warp + k * (kThreads / 32), lane);
#pragma unroll
    for (int off = 1; off < kGroupLanes; off *= 2) m = max(m, __shfl_xor_sync(0xffffffffu, m, off));
    if (lane % kGroupLanes == 0) group_amax[k][lane / kGroupLanes][warp] = m;
  }
  __syncthreads();
#pragma unroll
  for (int k = 0; k < 2; ++k) {
    uint32_t m = 0;
#pragma unroll
    for (int w = 0; w < kThreads / 32; ++w) m = max(m, group_amax[k][lane / kGroupLanes][w]);
    const int e = v_tile_exponent(m);
    fac[k] = __int_as_float((e + 127) << 23);
    // one lane per (half, group) stores e: (g, tile s0/128 + k, group d0/32 + lane/kGroupLanes)
    const int64_t tile128 = s0 / 128 + k, grp = d0 / 32 + lane / kGroupLanes;
    if (warp == 0 && lane % kGroupLanes == 0 && tile128 * 128 < Sp && grp * 32 < D)
      exps[(blockIdx.z * ((Sp + 127) / 128) + tile128) * (D / 32) + grp] = static_cast<int8_t>(e);
  }
}

// 3b of the kernel: each channel's scale bytes of the tile, as one 16-byte store (8-byte or single
// ones where unaligned or at the end).
template <int kCh>
__device__ __forceinline__ void store_scales(const uint8_t (*out_scales)[kSegs], int t, int nseg, int scales_align,
                                             int64_t d0, int64_t D, int64_t row0, int64_t Sp, int64_t s0,
                                             uint8_t* __restrict__ scales) {
  if (nseg == kSegs && scales_align == 16) {
    if (t < kCh && d0 + t < D)
      __stcs(reinterpret_cast<uint4*>(scales + (row0 + t) * (Sp / 16) + s0 / 16),
             *reinterpret_cast<const uint4*>(out_scales[t]));
  } else if (nseg == kSegs && scales_align == 8) {
    if (t < 2 * kCh && d0 + t / 2 < D)
      __stcs(reinterpret_cast<uint2*>(scales + (row0 + t / 2) * (Sp / 16) + s0 / 16) + t % 2,
             reinterpret_cast<const uint2*>(out_scales[t / 2])[t % 2]);
  } else {
#pragma unroll
    for (int k = 0; k < kCh * kSegs / kThreads; ++k) {
      const int j = t + k * kThreads;
      const int c = j / kSegs, seg = j % kSegs;
      if (d0 + c < D && seg < nseg)
        __stcs(reinterpret_cast<char*>(scales + (row0 + c) * (Sp / 16) + s0 / 16 + seg),
               static_cast<char>(out_scales[c][seg]));
    }
  }
}

template <typename T, int kMinBlocks, bool kExp>
__global__ void __launch_bounds__(kThreads, kMinBlocks)
    quant_cols_kernel(const T* __restrict__ x, int64_t S, int64_t D, int64_t Sp, int codes16,
                      int scales_align, uint8_t* __restrict__ packed, uint8_t* __restrict__ scales,
                      int8_t* __restrict__ exps) {
  constexpr int kCh = channels<T>();
  constexpr int kPerWord = 4 / static_cast<int>(sizeof(T));  // channels per word (2 or 1)
  constexpr int kChunks = kRowBytes / 16;                    // 16-byte chunks per tile row
  constexpr int kRowsPerPass = kThreads / kChunks;
  constexpr int kPasses = kTS / kRowsPerPass;
  __shared__ __align__(16) uint32_t tile[kTS][kWords];
  __shared__ __align__(16) uint2 out_codes[kCh][kSegs];
  __shared__ __align__(16) uint8_t out_scales[kCh][kSegs];
  constexpr int kGroups = kCh / 32;  // 32-channel groups of the exponent
  __shared__ uint32_t group_amax[2][kGroups][kThreads / 32];

  const int t = threadIdx.x;
  const int lane = t & 31, warp = t >> 5;
  const int cc = t % kChunks, r0 = t / kChunks;
  const int64_t s0 = static_cast<int64_t>(blockIdx.x) * kTS;
  const int64_t d0 = static_cast<int64_t>(blockIdx.y) * kCh;
  const int64_t d = d0 + cc * (16 / static_cast<int>(sizeof(T)));
  const int64_t left = (Sp - s0) / 16;
  const int nseg = left < kSegs ? static_cast<int>(left) : kSegs;

  {
    const int64_t g = blockIdx.z;
    // 1. load
    stage_rows<T, kPasses, kRowsPerPass, kWords>(x, S, D, g, s0, r0, cc, d, tile);

    // 1b. (kExp) the exponent of each 128-token half k (job k below) and group; fac[k]: 2^e
    static_assert(kWords * kSegs / kThreads == 2 && kSegs == 16, "job k of a warp is 16-token block warp + 8k, half k");
    float fac[2] = {1.f, 1.f};
    if constexpr (kExp) tile_exponents<T>(tile, group_amax, warp, lane, s0, d0, Sp, D, exps, fac);

    // 2. convert: job = (16-token block `seg`, word column `lane`)
#pragma unroll
    for (int k = 0; k < kWords * kSegs / kThreads; ++k) {
      const int seg = warp + k * (kThreads / 32);
      uint32_t raw[16];
#pragma unroll
      for (int i = 0; i < 16; ++i) raw[i] = tile[seg * 16 + i][lane];
      if constexpr (kPerWord == 2) {
        uint32_t m = 0;
#pragma unroll
        for (int i = 0; i < 16; ++i) m = __vmaxu2(m, raw[i] & 0x7FFF7FFFu);
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          float v[16];
#pragma unroll
          for (int i = 0; i < 16; ++i) {
            if constexpr (std::is_same_v<T, bf16_t>) {
              v[i] = __uint_as_float(h ? raw[i] & 0xFFFF0000u : raw[i] << 16);
            } else {
              const __half2 p = *reinterpret_cast<const __half2*>(&raw[i]);
              v[i] = h ? __high2float(p) : __low2float(p);
            }
          }
          const uint32_t mh = h ? m >> 16 : m & 0xFFFFu;
          uint32_t amax;
          if constexpr (std::is_same_v<T, bf16_t>) amax = mh << 16;
          else amax = __float_as_uint(__half2float(__ushort_as_half(static_cast<unsigned short>(mh))));
          if constexpr (kExp) {
#pragma unroll
            for (int i = 0; i < 16; ++i) v[i] = __fmul_rn(v[i], fac[k]);
            amax = __float_as_uint(__fmul_rn(__uint_as_float(amax), fac[k]));
          }
          uint32_t sb;
          const uint2 c = quant16_with_amax(v, amax, sb);
          out_codes[2 * lane + h][2 * chunk_slot(lane, seg / 2) + seg % 2] = c;
          out_scales[2 * lane + h][seg] = static_cast<uint8_t>(sb);
        }
      } else {
        float v[16];
#pragma unroll
        for (int i = 0; i < 16; ++i) v[i] = kExp ? __fmul_rn(__uint_as_float(raw[i]), fac[k]) : __uint_as_float(raw[i]);
        uint32_t sb;
        const uint2 c = quant16(v, sb);
        out_codes[lane][2 * chunk_slot(lane, seg / 2) + seg % 2] = c;
        out_scales[lane][seg] = static_cast<uint8_t>(sb);
      }
    }
    __syncthreads();

    // 3. store
    const int64_t row0 = g * D + d0;
#pragma unroll
    for (int k = 0; k < kCh * kPairs / kThreads; ++k) {
      const int j = t + k * kThreads;
      const int c = j / kPairs, p = j % kPairs;
      if (d0 + c < D) {
        const uint4 w = *reinterpret_cast<const uint4*>(&out_codes[c][2 * chunk_slot(c / kPerWord, p)]);
        uint8_t* dst = packed + (row0 + c) * (Sp / 2) + s0 / 2 + 16 * p;
        if (codes16 && 2 * p + 1 < nseg) {
          __stcs(reinterpret_cast<uint4*>(dst), w);
        } else {
          if (2 * p < nseg) __stcs(reinterpret_cast<uint2*>(dst), make_uint2(w.x, w.y));
          if (2 * p + 1 < nseg) __stcs(reinterpret_cast<uint2*>(dst + 8), make_uint2(w.z, w.w));
        }
      }
    }
    store_scales<kCh>(out_scales, t, nseg, scales_align, d0, D, row0, Sp, s0, scales);
  }
}

template <typename T, bool kExp, int kMinBlocks = 4>
int launch(const void* x, int64_t G, int64_t S, int64_t D, int64_t Sp, uint8_t* packed, uint8_t* scales,
           int8_t* exps, cudaStream_t stream) {
  const int64_t s_tiles = ceil_div(Sp, kTS), d_tiles = ceil_div(D, channels<T>());
  if (G == 0 || s_tiles == 0) return cudaSuccess;
  if (s_tiles > 0x7FFFFFFF || d_tiles > 65535) return cudaErrorInvalidValue;
  // grid z holds at most 65535 groups: more go in further launches (a loop over groups inside
  // the kernel would cost registers, i.e. occupancy, on the common path)
  for (int64_t g0 = 0; g0 < G; g0 += 65535) {
    const int64_t ng = G - g0 < 65535 ? G - g0 : 65535;
    const T* xg = static_cast<const T*>(x) + g0 * S * D;
    uint8_t* pg = packed + g0 * D * (Sp / 2);
    uint8_t* sg = scales + g0 * D * (Sp / 16);
    int8_t* eg = kExp ? exps + g0 * ((Sp + 127) / 128) * (D / 32) : nullptr;
    const int codes16 = (Sp % 32 == 0 && reinterpret_cast<uintptr_t>(pg) % 16 == 0) ? 1 : 0;
    const int scales_align = (Sp % 256 == 0 && reinterpret_cast<uintptr_t>(sg) % 16 == 0)  ? 16
                             : (Sp % 128 == 0 && reinterpret_cast<uintptr_t>(sg) % 8 == 0) ? 8
                                                                                            : 1;
    const dim3 grid(static_cast<unsigned>(s_tiles), static_cast<unsigned>(d_tiles), static_cast<unsigned>(ng));
    quant_cols_kernel<T, kMinBlocks, kExp><<<grid, kThreads, 0, stream>>>(xg, S, D, Sp, codes16, scales_align, pg, sg, eg);
    const cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) return e;
  }
  return cudaSuccess;
}

}  // namespace

int quant_fp4_cols(const void* x, DType dtype, int64_t G, int64_t S, int64_t D, int64_t Sp, uint8_t* packed,
                   uint8_t* scales, int8_t* exps, cudaStream_t stream) {
  if (D % 16 || Sp % 16 || Sp < S || (exps != nullptr && D % 32)) return cudaErrorInvalidValue;
  switch (dtype) {
    case DType::kFloat16:
      return exps ? launch<f16_t, true>(x, G, S, D, Sp, packed, scales, exps, stream)
                  : launch<f16_t, false>(x, G, S, D, Sp, packed, scales, nullptr, stream);
    case DType::kBFloat16:
      return exps ? launch<bf16_t, true>(x, G, S, D, Sp, packed, scales, exps, stream)
                  : launch<bf16_t, false>(x, G, S, D, Sp, packed, scales, nullptr, stream);
    case DType::kFloat32:
      return exps ? launch<float, true>(x, G, S, D, Sp, packed, scales, exps, stream)
                  : launch<float, false>(x, G, S, D, Sp, packed, scales, nullptr, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace sageattn3
