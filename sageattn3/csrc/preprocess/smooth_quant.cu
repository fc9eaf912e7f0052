// Smoothing + NVFP4 along D for Q (and K on the fallback path): a CTA owns 128 rows of one
// group and holds them in registers: every thread loads its P row blocks (whole 16-channel
// blocks, all loads in flight at once), so with per-block means the block's column sums, the
// mean and the quantization all come from one read of Q from DRAM.
#include "common/launch.cuh"
#include "common/nvfp4.cuh"
#include "preprocess/rowblock.cuh"
#include "sageattn3.h"

namespace sageattn3 {
namespace {

constexpr int kRows = 128;

template <typename T, int P>
__global__ void __launch_bounds__(kRowThreads) smooth_quant_kernel(const T* __restrict__ x, int64_t S, int D,
                                                                   float* __restrict__ mean, bool compute_mean,
                                                                   int mean_block, int64_t Sp, int64_t tiles,
                                                                   uint2* __restrict__ packed,
                                                                   uint8_t* __restrict__ scales) {
  __shared__ float red[kRowThreads * 16];
  const RowMap m(D);
  const int64_t g = blockIdx.x / tiles, tile = blockIdx.x % tiles;
  const int64_t row0 = tile * kRows;
  const int64_t r1 = std::min<int64_t>(S, row0 + kRows);  // real rows of this tile: [row0, r1)
  const T* xg = x + g * S * D + m.cb * 16;
  const int64_t nm = mean_block ? ceil_div(S, kRows) : 1;
  const int64_t mi = mean_block ? tile : 0;
  const bool has_rows = row0 < S;

  Raw16<T> raw[P];
#pragma unroll
  for (int p = 0; p < P; ++p) {
    const int r = m.rl + p * m.rpp;
    const int64_t row = row0 + r;
    if (m.active && r < kRows && row < r1) raw[p].load(xg + row * D);
    else raw[p].zero();
  }

  if (compute_mean) {
    float acc[16];
#pragma unroll
    for (int i = 0; i < 16; ++i) acc[i] = 0.f;
#pragma unroll
    for (int p = 0; p < P; ++p) {
      float v[16];
      raw[p].to_float(v);
#pragma unroll
      for (int i = 0; i < 16; ++i) acc[i] += v[i];
    }
    reduce_columns(m, D, acc, red);  // red[0..D) = column sums
    if (has_rows && static_cast<int>(threadIdx.x) < D) {
      const float mu = red[threadIdx.x] / static_cast<float>(r1 - row0);
      mean[(g * nm + mi) * D + threadIdx.x] = mu;
      red[threadIdx.x] = mu;
    }
  } else if (has_rows && static_cast<int>(threadIdx.x) < D) {
    red[threadIdx.x] = mean[(g * nm + mi) * D + threadIdx.x];
  }
  __syncthreads();
  if (!m.active) return;

  float mu[16];
#pragma unroll
  for (int i = 0; i < 16; ++i) mu[i] = has_rows ? red[m.cb * 16 + i] : 0.f;
  const int bpr = m.bpr;
#pragma unroll
  for (int p = 0; p < P; ++p) {
    const int r = m.rl + p * m.rpp;
    const int64_t row = row0 + r;
    if (r >= kRows || row >= Sp) continue;
    float v[16];
    raw[p].to_float(v);
    const bool real = row < r1;  // padding rows are zeros after smoothing
#pragma unroll
    for (int i = 0; i < 16; ++i) v[i] = real ? __fsub_rn(v[i], mu[i]) : 0.f;
    uint32_t sb;
    const uint2 w = quant16(v, sb);
    const int64_t ob = (g * Sp + row) * bpr + m.cb;  // output block index
    __stcs(packed + ob, w);
    __stcs(reinterpret_cast<char*>(scales + ob), static_cast<char>(sb));
  }
}

template <typename T, int P>
int launch_p(const void* x, int64_t G, int64_t S, int64_t D, float* mean, bool compute_mean, int mean_block,
             int64_t Sp, uint8_t* packed, uint8_t* scales, cudaStream_t stream) {
  const int64_t tiles = ceil_div(Sp, kRows);
  const int64_t grid = G * tiles;
  if (grid == 0) return cudaSuccess;
  if (grid > 0x7FFFFFFF) return cudaErrorInvalidValue;
  smooth_quant_kernel<T, P><<<static_cast<unsigned>(grid), kRowThreads, 0, stream>>>(
      static_cast<const T*>(x), S, static_cast<int>(D), mean, compute_mean, mean_block, Sp, tiles,
      reinterpret_cast<uint2*>(packed), scales);
  return cudaGetLastError();
}

template <typename T>
int launch(const void* x, int64_t G, int64_t S, int64_t D, float* mean, bool compute_mean, int mean_block,
           int64_t Sp, uint8_t* packed, uint8_t* scales, cudaStream_t stream) {
  const int64_t rpp = kRowThreads / (D / 16);
  const int64_t passes = ceil_div(kRows, rpp);
  if (passes <= 1) return launch_p<T, 1>(x, G, S, D, mean, compute_mean, mean_block, Sp, packed, scales, stream);
  if (passes <= 2) return launch_p<T, 2>(x, G, S, D, mean, compute_mean, mean_block, Sp, packed, scales, stream);
  if (passes <= 4) return launch_p<T, 4>(x, G, S, D, mean, compute_mean, mean_block, Sp, packed, scales, stream);
  return launch_p<T, 8>(x, G, S, D, mean, compute_mean, mean_block, Sp, packed, scales, stream);
}

}  // namespace

int smooth_quant_rows(const void* x, DType dtype, int64_t G, int64_t S, int64_t D, float* mean, bool compute_mean,
                      int mean_block, int64_t Sp, uint8_t* packed, uint8_t* scales, cudaStream_t stream) {
  if (D % 16 || D <= 0 || D > kMaxD || Sp < S || (mean_block != 0 && mean_block != kRows) ||
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
