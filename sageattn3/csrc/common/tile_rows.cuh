// Staging a tile of rows into shared memory for the kernels that quantize along the sequence
// (V's NVFP4 columns, quant/quant_cols.cu; V's MXFP8 columns, quant/mxfp8_cols.cuh).
#pragma once
#include <cstdint>
#include <cuda_runtime.h>

namespace sageattn3 {

// Rows s0 + r0 + k * kRowsPerPass (k < kPasses) of group g's (S, D) row-major matrix x, 16 bytes
// from channel d each, into tile rows r0 + k * kRowsPerPass at 32-bit word cc * 4; tokens >= S
// and channels >= D as zeros. Every load is issued before the first store (streaming loads: x is
// read once), then the block synchronises: every thread of the block calls it.
template <typename T, int kPasses, int kRowsPerPass, int kWords>
__device__ __forceinline__ void stage_rows(const T* __restrict__ x, int64_t S, int64_t D, int64_t g, int64_t s0,
                                           int r0, int cc, int64_t d, uint32_t (*tile)[kWords]) {
  const T* src = x + (g * S + s0 + r0) * D + d;
  uint4 buf[kPasses];
#pragma unroll
  for (int k = 0; k < kPasses; ++k) {
    buf[k] = make_uint4(0u, 0u, 0u, 0u);
    if (s0 + r0 + k * kRowsPerPass < S && d < D)
      buf[k] = __ldcs(reinterpret_cast<const uint4*>(src + static_cast<int64_t>(k * kRowsPerPass) * D));
  }
#pragma unroll
  for (int k = 0; k < kPasses; ++k) *reinterpret_cast<uint4*>(&tile[r0 + k * kRowsPerPass][cc * 4]) = buf[k];
  __syncthreads();
}

}  // namespace sageattn3
