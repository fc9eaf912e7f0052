// NVFP4 along rows for contiguous tensors. The row layout is the flat layout: block b (16
// consecutive elements) becomes packed bytes 8b..8b+7 and scale byte b, whatever the row length.
//
// Bandwidth design (H100: ~3 TB/s copy, 132 SMs): every thread owns whole 16-blocks (two
// adjacent 16-byte loads, no shuffles, the scale computed once), keeps kUnroll blocks of loads
// in flight before converting (kUnroll x 32 bytes per thread), stores 8-byte code words and
// one scale byte per block (a warp writes 256 + 32 contiguous bytes), and uses streaming
// (evict-first) loads and stores. The grid is sized from the SM count and the occupancy the
// compiler left us; a grid-stride loop covers the rest.
#include "common/launch.cuh"
#include "common/nvfp4.cuh"
#include "sageattn3.h"

namespace sageattn3 {
namespace {

constexpr int kThreads = 256;
constexpr int kUnroll = 4;

template <typename T>
__global__ void __launch_bounds__(kThreads) quant_rows_kernel(const T* __restrict__ x, int64_t n_blocks,
                                                              uint2* __restrict__ packed,
                                                              uint8_t* __restrict__ scales) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  for (int64_t base = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; base < n_blocks;
       base += stride * kUnroll) {
    Raw16<T> r[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t b = base + u * stride;
      if (b < n_blocks) r[u].load(x + b * 16);
      else r[u].zero();
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t b = base + u * stride;
      float v[16];
      r[u].to_float(v);
      uint32_t sb;
      const uint2 w = quant16_with_amax(v, r[u].amax_bits(), sb);
      if (b < n_blocks) {
        __stcs(packed + b, w);
        __stcs(reinterpret_cast<char*>(scales + b), static_cast<char>(sb));
      }
    }
  }
}

template <typename T>
int launch(const void* x, int64_t n, uint8_t* packed, uint8_t* scales, cudaStream_t stream) {
  const int64_t n_blocks = n / 16;
  if (n_blocks == 0) return cudaSuccess;
  static KernelSetup setup;  // its occupancy, asked once per device
  int per_sm = 0;
  if (setup.blocks_per_sm(&per_sm, quant_rows_kernel<T>, kThreads, 0) != cudaSuccess || per_sm <= 0) per_sm = 4;
  const int64_t grid = std::min<int64_t>(ceil_div(n_blocks, static_cast<int64_t>(kThreads) * kUnroll),
                                         static_cast<int64_t>(sm_count()) * per_sm);
  quant_rows_kernel<T><<<static_cast<unsigned>(grid), kThreads, 0, stream>>>(
      static_cast<const T*>(x), n_blocks, reinterpret_cast<uint2*>(packed), scales);
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
