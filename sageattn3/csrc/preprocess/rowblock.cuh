// Shared pieces of the row kernels (K/Q smoothing, column sums): a CTA of 256 threads covers
// rows of D channels, each thread one whole 16-channel NVFP4 block of a row:
//   cb = t % (D/16) (its block column), rl = t / (D/16) (its row within a pass),
//   kRowThreads / (D/16) rows per pass (threads beyond that idle).
// Whole blocks per thread: two adjacent 16-byte loads, no shuffles, one scale computation.
#pragma once
#include "common/nvfp4.cuh"

namespace sageattn3 {

constexpr int kRowThreads = 256;
constexpr int kMaxD = 256;  // D/16 <= 16 blocks per row

struct RowMap {
  int bpr, rpp, cb, rl;
  bool active;
  __device__ __forceinline__ explicit RowMap(int D) {
    bpr = D / 16;
    rpp = kRowThreads / bpr;
    cb = threadIdx.x % bpr;
    rl = threadIdx.x / bpr;
    active = rl < rpp;
  }
};

// Reduce per-thread column sums acc[16] (block column m.cb, one row slot m.rl) over the row
// slots in a fixed order: on return red[0..D) holds the D column sums. red: kRowThreads*16 floats.
// When D/16 divides 32, the lanes of a warp that share a block column are summed with shuffles
// first (fewer, less conflicting shared stores), then the warps in order.
__device__ __forceinline__ void reduce_columns(const RowMap& m, int D, float (&acc)[16], float* red) {
  const int bpr = m.bpr;
  int slots = m.rpp;  // row slots left to combine through shared memory
  if ((32 % bpr) == 0) {
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      for (int off = 16; off >= bpr; off >>= 1) acc[i] += __shfl_xor_sync(0xffffffffu, acc[i], off);
    }
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    if (lane < bpr) {
      float4* dst = reinterpret_cast<float4*>(red + warp * D + lane * 16);
#pragma unroll
      for (int i = 0; i < 4; ++i) dst[i] = make_float4(acc[4 * i], acc[4 * i + 1], acc[4 * i + 2], acc[4 * i + 3]);
    }
    slots = kRowThreads / 32;
  } else if (m.active) {
#pragma unroll
    for (int i = 0; i < 16; ++i) red[m.rl * D + m.cb * 16 + i] = acc[i];
  }
  __syncthreads();
  float s = 0.f;
  if (static_cast<int>(threadIdx.x) < D) {
    for (int r = 0; r < slots; ++r) s += red[r * D + threadIdx.x];
  }
  __syncthreads();
  if (static_cast<int>(threadIdx.x) < D) red[threadIdx.x] = s;
  __syncthreads();
}

}  // namespace sageattn3
