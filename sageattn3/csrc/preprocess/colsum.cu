// Partial column sums over fixed row chunks (the first stage of a deterministic mean). Each
// thread sums whole 16-channel blocks of rows rl, rl + rpp, ... with kUnroll rows of loads in
// flight; the row slots are then reduced in a fixed order.
#include "common/launch.cuh"
#include "common/nvfp4.cuh"
#include "preprocess/rowblock.cuh"
#include "sageattn3.h"

namespace sageattn3 {
namespace {

constexpr int kUnroll = 4;

template <typename T>
__global__ void __launch_bounds__(kRowThreads) colsum_kernel(const T* __restrict__ x, int64_t S, int D,
                                                             int64_t chunk, int64_t n_chunks,
                                                             float* __restrict__ partial) {
  __shared__ __align__(16) float red[kRowThreads * 16];
  const RowMap m(D);
  const int64_t g = blockIdx.x / n_chunks, c = blockIdx.x % n_chunks;
  const int64_t r0 = c * chunk, r1 = std::min<int64_t>(S, r0 + chunk);
  const T* xg = x + g * S * D + m.cb * 16;
  float acc[16];
#pragma unroll
  for (int i = 0; i < 16; ++i) acc[i] = 0.f;
  if (m.active) {
    for (int64_t r = r0 + m.rl; r < r1; r += static_cast<int64_t>(m.rpp) * kUnroll) {
      Raw16<T> raw[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t row = r + static_cast<int64_t>(u) * m.rpp;
        if (row < r1) raw[u].load(xg + row * D);
        else raw[u].zero();
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        float v[16];
        raw[u].to_float(v);
#pragma unroll
        for (int i = 0; i < 16; ++i) acc[i] += v[i];
      }
    }
  }
  reduce_columns(m, D, acc, red);
  if (static_cast<int>(threadIdx.x) < D) partial[(g * n_chunks + c) * D + threadIdx.x] = red[threadIdx.x];
}

template <typename T>
int launch(const void* x, int64_t G, int64_t S, int64_t D, int64_t chunk, float* partial, cudaStream_t stream) {
  const int64_t n_chunks = ceil_div(S, chunk);
  const int64_t grid = G * n_chunks;
  if (grid == 0) return cudaSuccess;
  if (grid > 0x7FFFFFFF) return cudaErrorInvalidValue;
  colsum_kernel<T><<<static_cast<unsigned>(grid), kRowThreads, 0, stream>>>(static_cast<const T*>(x), S,
                                                                            static_cast<int>(D), chunk, n_chunks,
                                                                            partial);
  return cudaGetLastError();
}

}  // namespace

int colsum(const void* x, DType dtype, int64_t G, int64_t S, int64_t D, int64_t chunk, float* partial,
           cudaStream_t stream) {
  if (D % 16 || D > kMaxD || chunk <= 0) return cudaErrorInvalidValue;
  switch (dtype) {
    case DType::kFloat16: return launch<f16_t>(x, G, S, D, chunk, partial, stream);
    case DType::kBFloat16: return launch<bf16_t>(x, G, S, D, chunk, partial, stream);
    case DType::kFloat32: return launch<float>(x, G, S, D, chunk, partial, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace sageattn3
