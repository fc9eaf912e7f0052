// NVFP4 quantization along rows: one thread per 16-element block.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "common/nvfp4.cuh"
#include "sageattn3.h"

namespace sageattn3 {
namespace {

template <typename T>
__device__ __forceinline__ float to_f32(T v) { return static_cast<float>(v); }

template <typename T>
__global__ void quant_rows_kernel(const T* __restrict__ x, int64_t rows, int64_t cols, int64_t row_stride,
                                  uint8_t* __restrict__ packed, uint8_t* __restrict__ scales) {
  const int64_t blocks_per_row = cols / 16;
  const int64_t b = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (b >= rows * blocks_per_row) return;
  const int64_t r = b / blocks_per_row, c0 = (b % blocks_per_row) * 16;
  const T* src = x + r * row_stride + c0;
  float v[16];
  float amax = 0.f;
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    v[i] = to_f32(src[i]);
    amax = fmaxf(amax, fabsf(v[i]));
  }
  const uint8_t sb = e4m3_byte(amax / 6.0f);
  const float s = e4m3_value(sb);
  const float inv = s > 0.f ? __frcp_rn(s) : 0.f;
  uint8_t* dst = packed + r * (cols / 2) + c0 / 2;
#pragma unroll
  for (int i = 0; i < 16; i += 2) dst[i / 2] = static_cast<uint8_t>(e2m1x2(v[i] * inv, v[i + 1] * inv));
  scales[r * blocks_per_row + c0 / 16] = sb;
}

template <typename T>
int launch(const void* x, int64_t rows, int64_t cols, int64_t row_stride, uint8_t* packed, uint8_t* scales,
           cudaStream_t stream) {
  const int64_t n = rows * (cols / 16);
  if (n == 0) return cudaSuccess;
  const int threads = 256;
  const int64_t grid = (n + threads - 1) / threads;
  quant_rows_kernel<T><<<static_cast<unsigned>(grid), threads, 0, stream>>>(
      static_cast<const T*>(x), rows, cols, row_stride, packed, scales);
  return cudaGetLastError();
}

}  // namespace

int quant_fp4_rows(const void* x, DType dtype, int64_t rows, int64_t cols, int64_t row_stride, uint8_t* packed,
                   uint8_t* scales, cudaStream_t stream) {
  switch (dtype) {
    case DType::kFloat16: return launch<__half>(x, rows, cols, row_stride, packed, scales, stream);
    case DType::kBFloat16: return launch<__nv_bfloat16>(x, rows, cols, row_stride, packed, scales, stream);
    case DType::kFloat32: return launch<float>(x, rows, cols, row_stride, packed, scales, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace sageattn3
