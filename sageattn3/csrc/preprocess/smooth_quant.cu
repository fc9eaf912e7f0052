// Smoothing + NVFP4 along D for Q and K: a CTA owns 128 rows of one group. For Q with
// per-block means it first computes the block's mean (column sums of the same 128 rows; the
// second read of those rows comes from L1/L2), so Q crosses DRAM once.
#include "common/launch.cuh"
#include "common/nvfp4.cuh"
#include "preprocess/rowblock.cuh"
#include "sageattn3.h"

namespace sageattn3 {
namespace {

constexpr int kRows = 128;

template <typename T>
__global__ void __launch_bounds__(kRowThreads) smooth_quant_kernel(const T* __restrict__ x, int64_t S, int D,
                                                                   float* __restrict__ mean, bool compute_mean,
                                                                   int mean_block, int64_t Sp, int64_t tiles,
                                                                   uint32_t* __restrict__ packed,
                                                                   uint8_t* __restrict__ scales) {
  __shared__ float red[kRowThreads * 8];
  const int t = threadIdx.x;
  const int64_t g = blockIdx.x / tiles, tile = blockIdx.x % tiles;
  const int64_t row0 = tile * kRows;
  const T* xg = x + g * S * D;
  const int64_t nm = mean_block ? ceil_div(S, kRows) : 1;
  const int64_t m = mean_block ? tile : 0;
  const bool has_rows = row0 < S;

  if (compute_mean) {
    if (has_rows) {
      const int64_t r1 = std::min<int64_t>(S, row0 + kRows);
      column_sums<T>(xg, row0, r1, D, red);  // red[0..D) = sums
      if (t < D) {
        const float mu = red[t] / static_cast<float>(r1 - row0);
        mean[(g * nm + m) * D + t] = mu;
        red[t] = mu;
      }
    }
  } else if (has_rows && t < D) {
    red[t] = mean[(g * nm + m) * D + t];
  }
  __syncthreads();

  const int CG = D / 8, R = kRowThreads / CG;
  const int cg = t % CG, rl = t / CG;
  float mu[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) mu[i] = has_rows ? red[cg * 8 + i] : 0.f;
  const int iters = (kRows + R - 1) / R;
  for (int it = 0; it < iters; ++it) {
    const int r = rl + it * R;
    const int64_t row = row0 + r;
    const bool active = rl < R && r < kRows && row < Sp;
    float v[8];
    if (active && row < S) {
      Load8<T>::run(xg + row * D + cg * 8, v);
#pragma unroll
      for (int i = 0; i < 8; ++i) v[i] = __fsub_rn(v[i], mu[i]);
    } else {
#pragma unroll
      for (int i = 0; i < 8; ++i) v[i] = 0.f;
    }
    uint32_t sb;
    const uint32_t w = quant8_pair(v, sb);
    if (active) {
      const int64_t out_row = g * Sp + row;
      packed[out_row * CG + cg] = w;
      if (!(cg & 1)) scales[out_row * (D / 16) + cg / 2] = static_cast<uint8_t>(sb);
    }
  }
}

template <typename T>
int launch(const void* x, int64_t G, int64_t S, int64_t D, float* mean, bool compute_mean, int mean_block,
           int64_t Sp, uint8_t* packed, uint8_t* scales, cudaStream_t stream) {
  const int64_t tiles = ceil_div(Sp, kRows);
  const int64_t grid = G * tiles;
  if (grid == 0) return cudaSuccess;
  if (grid > 0x7FFFFFFF) return cudaErrorInvalidValue;
  smooth_quant_kernel<T><<<static_cast<unsigned>(grid), kRowThreads, 0, stream>>>(
      static_cast<const T*>(x), S, static_cast<int>(D), mean, compute_mean, mean_block, Sp, tiles,
      reinterpret_cast<uint32_t*>(packed), scales);
  return cudaGetLastError();
}

}  // namespace

int smooth_quant_rows(const void* x, DType dtype, int64_t G, int64_t S, int64_t D, float* mean, bool compute_mean,
                      int mean_block, int64_t Sp, uint8_t* packed, uint8_t* scales, cudaStream_t stream) {
  if (D % 16 || D > kMaxD || Sp < S || (mean_block != 0 && mean_block != kRows) ||
      (compute_mean && mean_block != kRows))
    return cudaErrorInvalidValue;
  switch (dtype) {
    case DType::kFloat16: return launch<f16_t>(x, G, S, D, mean, compute_mean, mean_block, Sp, packed, scales, stream);
    case DType::kBFloat16: return launch<bf16_t>(x, G, S, D, mean, compute_mean, mean_block, Sp, packed, scales, stream);
    case DType::kFloat32: return launch<float>(x, G, S, D, mean, compute_mean, mean_block, Sp, packed, scales, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace sageattn3
