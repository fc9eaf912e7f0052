// NVFP4 along rows for contiguous tensors. The row layout is the flat layout: chunk c (8
// elements) becomes packed word c and, with its pair c^1, scale byte c/2. Each lane loads 16
// bytes per chunk; a lane pair shares one 16-block (amax by one shuffle); a warp keeps U
// 16-byte loads in flight per lane before converting.
#include "common/launch.cuh"
#include "common/nvfp4.cuh"
#include "sageattn3.h"

namespace sageattn3 {
namespace {

constexpr int kThreads = 256;
constexpr int kUnroll = 4;

template <typename T>
__global__ void __launch_bounds__(kThreads) quant_rows_kernel(const T* __restrict__ x, int64_t n_chunks,
                                                              uint32_t* __restrict__ packed,
                                                              uint8_t* __restrict__ scales) {
  const int lane = threadIdx.x & 31;
  const int64_t warp = (static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x) >> 5;
  const int64_t nwarps = (static_cast<int64_t>(gridDim.x) * kThreads) >> 5;
  for (int64_t base = warp * 32 * kUnroll; base < n_chunks; base += nwarps * 32 * kUnroll) {
    float v[kUnroll][8];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t c = base + u * 32 + lane;
      if (c < n_chunks) {
        Load8<T>::run(x + c * 8, v[u]);
      } else {
#pragma unroll
        for (int i = 0; i < 8; ++i) v[u][i] = 0.f;
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t c = base + u * 32 + lane;
      uint32_t sb;
      const uint32_t w = quant8_pair(v[u], sb);
      if (c < n_chunks) {
        packed[c] = w;
        if (!(lane & 1)) scales[c >> 1] = static_cast<uint8_t>(sb);
      }
    }
  }
}

template <typename T>
int launch(const void* x, int64_t n, uint8_t* packed, uint8_t* scales, cudaStream_t stream) {
  const int64_t n_chunks = n / 8;
  if (n_chunks == 0) return cudaSuccess;
  const int64_t per_block = (kThreads / 32) * 32 * kUnroll;
  const int64_t grid = std::min<int64_t>(ceil_div(n_chunks, per_block), static_cast<int64_t>(sm_count()) * 8);
  quant_rows_kernel<T><<<static_cast<unsigned>(grid), kThreads, 0, stream>>>(
      static_cast<const T*>(x), n_chunks, reinterpret_cast<uint32_t*>(packed), scales);
  return cudaGetLastError();
}

}  // namespace

int quant_fp4_rows(const void* x, DType dtype, int64_t n, int64_t cols, uint8_t* packed, uint8_t* scales,
                   cudaStream_t stream) {
  if (cols <= 0 || cols % 16 || n % cols) return cudaErrorInvalidValue;
  switch (dtype) {
    case DType::kFloat16: return launch<f16_t>(x, n, packed, scales, stream);
    case DType::kBFloat16: return launch<bf16_t>(x, n, packed, scales, stream);
    case DType::kFloat32: return launch<float>(x, n, packed, scales, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace sageattn3
