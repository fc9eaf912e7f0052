// MXFP8 along the sequence, one tile per CTA (V of the FP8 P.V path;
// reference.quantize_mxfp8_transposed of V padded with zero keys): x (G, S, D) bf16/fp16 -> codes (G, D, Sp) E4M3 bytes and scales
// (G, D, Sp/32) UE8M0 bytes, Sp >= S a multiple of 32; channel c's 32 consecutive tokens share
// one scale (common/mxfp8.cuh: the byte rule, NaN handling and the E4M3 conversion, the same as
// the Q/K MXFP8 quantizer's). Tokens S..Sp-1 are zeros (a block of them: zero codes, byte 1).
//
// A CTA transposes one tile of 128 tokens x 64 channels (128 bytes of each token's row) through
// shared memory:
//   1. load: each token's 128-byte row segment is 8 16-byte streaming loads by 8 consecutive
//      threads (a quarter warp stores one whole row to shared memory: no bank conflicts);
//   2. convert: warp w takes the tile's 32-token block w / 2 and channels 32 (w % 2) + lane; a
//      lane reads its channel's 16-bit half of a word over the block's 32 tokens (a warp reads
//      16 consecutive words of a row: conflict-free), amax, scale byte, 32 codes;
//   3. store: each lane writes its channel's 32 codes (two 16-byte stores: whole sectors) and
//      its scale byte.
// The tile's device code is shared by quant_mxfp8_cols' kernel (quant/quant_mxfp8_cols.cu) and
// the MXFP8 rows' pair launch, which can take V's tiles as well (quant/quant_mxfp8.cu).
#pragma once

#include <type_traits>

#include "common/launch.cuh"
#include "common/mxfp8.cuh"
#include "common/nvfp4.cuh"
#include "common/tile_rows.cuh"
#include "sageattn3.h"

namespace sageattn3::mxfp8_cols {

constexpr int kThreads = 256;
constexpr int kTS = 128;                           // tokens per tile
constexpr int kTC = 64;                            // channels per tile (16-bit: 128 bytes a token)
constexpr int kWords = kTC / 2;                    // 32-bit words per tile row
constexpr int kChunks = kTC * 2 / 16;              // 16-byte chunks per tile row
constexpr int kRowsPerPass = kThreads / kChunks;   // tile rows one pass of loads covers
constexpr int kPasses = kTS / kRowsPerPass;
static_assert(kThreads / 32 == 2 * (kTS / 32), "a warp per 32-token block and half of the channels");

// The arguments quant_mxfp8_cols takes (and the pair launch with V's tiles): G, S >= 0, D a
// positive multiple of 16, Sp >= S a multiple of 32.
inline bool args_fit(int64_t G, int64_t S, int64_t D, int64_t Sp) {
  return G >= 0 && S >= 0 && D > 0 && D % 16 == 0 && Sp % 32 == 0 && Sp >= S;
}

// Channel `half` (0: low 16 bits) of a word of two 16-bit values, widened to fp32 (exact).
template <typename T>
__device__ __forceinline__ float widen(uint32_t word, int half) {
  if constexpr (std::is_same_v<T, bf16_t>) {
    return __uint_as_float(half ? word & 0xFFFF0000u : word << 16);
  } else {
    return __half2float(__ushort_as_half(static_cast<unsigned short>(half ? word >> 16 : word & 0xFFFFu)));
  }
}

// One CTA's tile: tokens s_tile * kTS.., channels d_tile * kTC.. of group g, through `tile` (the
// caller's shared memory); every thread of the block calls it (it synchronises the block once).
template <typename T>
__device__ __forceinline__ void cols_tile(const T* __restrict__ x, int64_t S, int64_t D, int64_t Sp,
                                          uint8_t* __restrict__ codes, uint8_t* __restrict__ scales,
                                          const uint8_t* __restrict__ sel, int64_t s_tile, int64_t d_tile, int64_t g,
                                          uint32_t (*tile)[kWords]) {
  const int t = threadIdx.x, lane = t & 31, warp = t >> 5;
  if (sel != nullptr && sel[g] == 0) return;  // a group no head reads in FP8 (left as it was)
  const int64_t s0 = s_tile * kTS, d0 = d_tile * kTC;

  // 1. load (tokens >= S and channels >= D as zeros)
  const int cc = t % kChunks, r0 = t / kChunks;
  const int64_t d = d0 + cc * 8;
  stage_rows<T, kPasses, kRowsPerPass, kWords>(x, S, D, g, s0, r0, cc, d, tile);

  // 2. convert: 32-token block `blk` of the tile, channel d0 + c
  const int blk = warp >> 1, c = (warp & 1) * 32 + lane;
  const int64_t s = s0 + blk * 32;
  if (s >= Sp || d0 + c >= D) return;
  float v[32];
  float amax = 0.f;
  bool nan = false;
#pragma unroll
  for (int i = 0; i < 32; ++i) {
    v[i] = widen<T>(tile[blk * 32 + i][c >> 1], c & 1);
    amax = fmaxf(amax, fabsf(v[i]));
    nan |= v[i] != v[i];
  }
  const uint32_t b = ue8m0_byte(amax, nan);
  const float inv = ue8m0_inverse(b);
  uint32_t w[8];
#pragma unroll
  for (int j = 0; j < 8; ++j) w[j] = e4m3x4(v[4 * j], v[4 * j + 1], v[4 * j + 2], v[4 * j + 3], inv);

  // 3. store
  const int64_t row = g * D + d0 + c;
  uint4* out = reinterpret_cast<uint4*>(codes + row * Sp + s);
  __stcs(out, make_uint4(w[0], w[1], w[2], w[3]));
  __stcs(out + 1, make_uint4(w[4], w[5], w[6], w[7]));
  scales[row * (Sp / 32) + s / 32] = static_cast<uint8_t>(b);
}

}  // namespace sageattn3::mxfp8_cols
