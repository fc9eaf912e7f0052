// Partial column sums over fixed row chunks (the first stage of a deterministic mean).
#include "common/launch.cuh"
#include "common/nvfp4.cuh"
#include "preprocess/rowblock.cuh"
#include "sageattn3.h"

namespace sageattn3 {
namespace {

template <typename T>
__global__ void __launch_bounds__(kRowThreads) colsum_kernel(const T* __restrict__ x, int64_t S, int D,
                                                             int64_t chunk, int64_t n_chunks,
                                                             float* __restrict__ partial) {
  __shared__ float red[kRowThreads * 8];
  const int64_t g = blockIdx.x / n_chunks, c = blockIdx.x % n_chunks;
  const int64_t r0 = c * chunk, r1 = std::min<int64_t>(S, r0 + chunk);
  column_sums<T>(x + g * S * D, r0, r1, D, red);
  if (threadIdx.x < D) partial[(g * n_chunks + c) * D + threadIdx.x] = red[threadIdx.x];
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
