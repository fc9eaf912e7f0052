// NVFP4 along the sequence (the layout of V): x (G, S, D) -> packed (G, D, Sp/2), scales
// (G, D, Sp/16).
//
// A CTA transposes one tile of 256 tokens x 128 bytes of channels (64 channels of 16-bit
// input, 32 of fp32) through shared memory so that both sides are coalesced:
//   1. load: each token's 128-byte row segment is 8 16-byte loads by 8 consecutive threads;
//      every thread issues all 8 of its loads before storing any to shared memory;
//   2. convert: a thread reads one 32-bit word column (two 16-bit channels) over 16 tokens,
//      i.e. two whole 16-blocks, amax on the raw patterns two channels at a time;
//   3. store: codes and scales are staged in shared memory, then written as 8-byte words,
//      each channel's 128 bytes of codes by consecutive threads (streaming stores).
#include <type_traits>

#include "common/launch.cuh"
#include "common/nvfp4.cuh"
#include "sageattn3.h"

namespace sageattn3 {
namespace {

constexpr int kThreads = 256;
constexpr int kTS = 256;              // tokens per tile
constexpr int kRowBytes = 128;        // channel bytes per tile row
constexpr int kWords = kRowBytes / 4; // 32-bit words per tile row
constexpr int kSegs = kTS / 16;       // 16-token blocks per tile
constexpr int kPad = 4;               // words of padding per row (row stride 144 bytes)

template <typename T>
__global__ void __launch_bounds__(kThreads) quant_cols_kernel(const T* __restrict__ x, int64_t S, int64_t D,
                                                              int64_t Sp, int64_t s_tiles, int64_t d_tiles,
                                                              uint8_t* __restrict__ packed,
                                                              uint8_t* __restrict__ scales) {
  constexpr int kCh = kRowBytes / static_cast<int>(sizeof(T));  // channels per tile
  constexpr int kPerWord = 4 / static_cast<int>(sizeof(T));     // channels per word (2 or 1)
  __shared__ __align__(16) uint32_t tile[kTS][kWords + kPad];
  __shared__ uint2 out_codes[kCh][kSegs + 1];
  __shared__ uint8_t out_scales[kCh][kSegs];
  const int t = threadIdx.x;
  int64_t id = blockIdx.x;
  const int64_t st = id % s_tiles;
  id /= s_tiles;
  const int64_t dt = id % d_tiles;
  const int64_t g = id / d_tiles;
  const int64_t s0 = st * kTS, d0 = dt * kCh;
  const T* xg = x + g * S * D;

  // 1. load (16-byte chunks: 8 per row, 32 rows per pass, 8 passes)
  constexpr int kChunks = kRowBytes / 16;
  constexpr int kPasses = kTS * kChunks / kThreads;
  uint4 buf[kPasses];
  const int cc = t % kChunks, r0 = t / kChunks;
  const int64_t d = d0 + cc * (16 / static_cast<int>(sizeof(T)));
#pragma unroll
  for (int k = 0; k < kPasses; ++k) {
    const int64_t s = s0 + r0 + k * (kThreads / kChunks);
    buf[k] = make_uint4(0u, 0u, 0u, 0u);
    if (s < S && d < D) buf[k] = __ldcs(reinterpret_cast<const uint4*>(xg + s * D + d));
  }
#pragma unroll
  for (int k = 0; k < kPasses; ++k)
    *reinterpret_cast<uint4*>(&tile[r0 + k * (kThreads / kChunks)][cc * 4]) = buf[k];
  __syncthreads();

  // 2. convert: job = (word column, 16-token segment); lanes take consecutive words
#pragma unroll
  for (int k = 0; k < kWords * kSegs / kThreads; ++k) {
    const int j = t + k * kThreads;
    const int w = j % kWords, seg = j / kWords;
    uint32_t raw[16];
#pragma unroll
    for (int i = 0; i < 16; ++i) raw[i] = tile[seg * 16 + i][w];
    if constexpr (kPerWord == 2) {
      uint32_t m = 0;
#pragma unroll
      for (int i = 0; i < 16; ++i) m = __vmaxu2(m, raw[i] & 0x7FFF7FFFu);
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float v[16];
#pragma unroll
        for (int i = 0; i < 16; ++i) {
          const uint32_t b16 = h ? raw[i] >> 16 : raw[i] & 0xFFFFu;
          if constexpr (sizeof(T) == 2 && std::is_same_v<T, bf16_t>) v[i] = __uint_as_float(b16 << 16);
          else v[i] = __half2float(__ushort_as_half(static_cast<unsigned short>(b16)));
        }
        const uint32_t mh = h ? m >> 16 : m & 0xFFFFu;
        uint32_t amax;
        if constexpr (std::is_same_v<T, bf16_t>) amax = mh << 16;
        else amax = __float_as_uint(__half2float(__ushort_as_half(static_cast<unsigned short>(mh))));
        uint32_t sb;
        out_codes[2 * w + h][seg] = quant16_with_amax(v, amax, sb);
        out_scales[2 * w + h][seg] = static_cast<uint8_t>(sb);
      }
    } else {
      float v[16];
#pragma unroll
      for (int i = 0; i < 16; ++i) v[i] = __uint_as_float(raw[i]);
      uint32_t sb;
      out_codes[w][seg] = quant16(v, sb);
      out_scales[w][seg] = static_cast<uint8_t>(sb);
    }
  }
  __syncthreads();

  // 3. store: consecutive threads write one channel's consecutive 8-byte code words
  const int64_t nseg = std::min<int64_t>(kSegs, (Sp - s0) / 16);
#pragma unroll
  for (int k = 0; k < kCh * kSegs / kThreads; ++k) {
    const int j = t + k * kThreads;
    const int c = j / kSegs, seg = j % kSegs;
    if (d0 + c < D && seg < nseg) {
      const int64_t row = g * D + d0 + c;
      __stcs(reinterpret_cast<uint2*>(packed + row * (Sp / 2) + s0 / 2) + seg, out_codes[c][seg]);
      __stcs(reinterpret_cast<char*>(scales + row * (Sp / 16) + s0 / 16 + seg), static_cast<char>(out_scales[c][seg]));
    }
  }
}

template <typename T>
int launch(const void* x, int64_t G, int64_t S, int64_t D, int64_t Sp, uint8_t* packed, uint8_t* scales,
           cudaStream_t stream) {
  constexpr int kCh = kRowBytes / static_cast<int>(sizeof(T));
  const int64_t s_tiles = ceil_div(Sp, kTS), d_tiles = ceil_div(D, kCh);
  const int64_t grid = G * s_tiles * d_tiles;
  if (grid == 0) return cudaSuccess;
  if (grid > 0x7FFFFFFF) return cudaErrorInvalidValue;
  quant_cols_kernel<T><<<static_cast<unsigned>(grid), kThreads, 0, stream>>>(static_cast<const T*>(x), S, D, Sp,
                                                                             s_tiles, d_tiles, packed, scales);
  return cudaGetLastError();
}

}  // namespace

int quant_fp4_cols(const void* x, DType dtype, int64_t G, int64_t S, int64_t D, int64_t Sp, uint8_t* packed,
                   uint8_t* scales, cudaStream_t stream) {
  if (D % 16 || Sp % 16 || Sp < S) return cudaErrorInvalidValue;
  switch (dtype) {
    case DType::kFloat16: return launch<f16_t>(x, G, S, D, Sp, packed, scales, stream);
    case DType::kBFloat16: return launch<bf16_t>(x, G, S, D, Sp, packed, scales, stream);
    case DType::kFloat32: return launch<float>(x, G, S, D, Sp, packed, scales, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace sageattn3
