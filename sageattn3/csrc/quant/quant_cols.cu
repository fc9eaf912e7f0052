// NVFP4 along the sequence (the layout of V): x (G, S, D) -> packed (G, D, Sp/2), scales
// (G, D, Sp/16). A CTA stages a 128-token x 64-channel tile in shared memory (coalesced 16-byte
// loads), converts one 16-token column segment per job, stages the codes and writes them back
// as 8-byte row segments.
#include "common/launch.cuh"
#include "common/nvfp4.cuh"
#include "sageattn3.h"

namespace sageattn3 {
namespace {

constexpr int kThreads = 256;
constexpr int kTS = 128;  // tokens per tile
constexpr int kTD = 64;   // channels per tile
constexpr int kSegs = kTS / 16;

template <typename T>
__global__ void __launch_bounds__(kThreads) quant_cols_kernel(const T* __restrict__ x, int64_t S, int64_t D,
                                                              int64_t Sp, int64_t s_tiles, int64_t d_tiles,
                                                              uint8_t* __restrict__ packed,
                                                              uint8_t* __restrict__ scales) {
  __shared__ float tile[kTS][kTD + 1];
  __shared__ uint2 out_codes[kTD][kSegs];
  __shared__ uint8_t out_scales[kTD][kSegs];
  const int t = threadIdx.x;
  int64_t id = blockIdx.x;
  const int64_t st = id % s_tiles;
  id /= s_tiles;
  const int64_t dt = id % d_tiles;
  const int64_t g = id / d_tiles;
  const int64_t s0 = st * kTS, d0 = dt * kTD;
  const T* xg = x + g * S * D;

  // 1. load: 128 rows x 8 chunks of 8 channels
#pragma unroll
  for (int k = 0; k < kTS * (kTD / 8) / kThreads; ++k) {
    const int j = t + k * kThreads;
    const int row = j / (kTD / 8), cc = j % (kTD / 8);
    const int64_t s = s0 + row, d = d0 + cc * 8;
    float v[8];
    if (s < S && d < D) {
      Load8<T>::run(xg + s * D + d, v);
    } else {
#pragma unroll
      for (int i = 0; i < 8; ++i) v[i] = 0.f;
    }
#pragma unroll
    for (int i = 0; i < 8; ++i) tile[row][cc * 8 + i] = v[i];
  }
  __syncthreads();

  // 2. convert: job = (channel, 16-token segment); lanes take consecutive channels
#pragma unroll
  for (int k = 0; k < kTD * kSegs / kThreads; ++k) {
    const int j = t + k * kThreads;
    const int d = j % kTD, seg = j / kTD;
    float lo[8], hi[8];
    uint32_t a = 0;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      lo[i] = tile[seg * 16 + i][d];
      hi[i] = tile[seg * 16 + 8 + i][d];
      a = abs_bits_max(abs_bits_max(a, lo[i]), hi[i]);
    }
    uint32_t sb;
    const uint32_t w0 = quant8_with_amax(lo, a, sb);
    const uint32_t w1 = quant8_with_amax(hi, a, sb);
    out_codes[d][seg] = make_uint2(w0, w1);
    out_scales[d][seg] = static_cast<uint8_t>(sb);
  }
  __syncthreads();

  // 3. store: 8 consecutive threads write one channel's 64 bytes
  const int64_t nseg = std::min<int64_t>(kSegs, (Sp - s0) / 16);
#pragma unroll
  for (int k = 0; k < kTD * kSegs / kThreads; ++k) {
    const int j = t + k * kThreads;
    const int d = j / kSegs, seg = j % kSegs;
    if (d0 + d < D && seg < nseg) {
      const int64_t row = g * D + d0 + d;
      *reinterpret_cast<uint2*>(packed + row * (Sp / 2) + s0 / 2 + seg * 8) = out_codes[d][seg];
      scales[row * (Sp / 16) + s0 / 16 + seg] = out_scales[d][seg];
    }
  }
}

template <typename T>
int launch(const void* x, int64_t G, int64_t S, int64_t D, int64_t Sp, uint8_t* packed, uint8_t* scales,
           cudaStream_t stream) {
  const int64_t s_tiles = ceil_div(Sp, kTS), d_tiles = ceil_div(D, kTD);
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
