// Shared pieces of the row-block kernels: a CTA of 256 threads walks rows of D channels, each
// thread one 8-channel chunk (cg = t % (D/8)) of rows t / (D/8), t / (D/8) + R, ... with
// R = 256 / (D/8); lane pairs (cg even/odd) hold one 16-channel NVFP4 block.
#pragma once
#include "common/nvfp4.cuh"

namespace sageattn3 {

constexpr int kRowThreads = 256;
constexpr int kMaxD = 256;  // D/8 <= 32 chunks per row

// Column sums of rows [r0, r1) of x (rows of D), in a fixed order; the D sums end in red[0..D).
// red must hold kRowThreads * 8 floats. Ends with a __syncthreads.
template <typename T>
__device__ __forceinline__ void column_sums(const T* __restrict__ x, int64_t r0, int64_t r1, int D,
                                            float* red) {
  const int t = threadIdx.x;
  const int CG = D / 8, R = kRowThreads / CG;
  const int cg = t % CG, rl = t / CG;
  float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  if (rl < R) {
    for (int64_t r = r0 + rl; r < r1; r += R) {
      float v[8];
      Load8<T>::run(x + r * D + cg * 8, v);
#pragma unroll
      for (int i = 0; i < 8; ++i) acc[i] += v[i];
    }
  }
  __syncthreads();
  if (rl < R) {
#pragma unroll
    for (int i = 0; i < 8; ++i) red[rl * D + cg * 8 + i] = acc[i];
  }
  __syncthreads();
  float s = 0.f;
  if (t < D) {
    for (int j = 0; j < R; ++j) s += red[j * D + t];
  }
  __syncthreads();
  if (t < D) red[t] = s;
  __syncthreads();
}

}  // namespace sageattn3
