// The 128-row tile of the row smoothing kernels (Q and K): how a CTA holds it, sums its columns
// and quantizes it, and the whole-sequence mean reduced from tile sums. Every kernel that sums
// a tile or reduces a mean goes through these, so every path gives the same bits.
#pragma once
#include "common/launch.cuh"
#include "common/nvfp4.cuh"
#include "preprocess/rowblock.cuh"

namespace sageattn3 {
namespace rowtile {

constexpr int kRows = 128;

// P: rows per thread, so that a CTA covers 128 rows (rpp = 256 / (D/16) rows per pass).
inline int passes_for(int64_t D) { return static_cast<int>(ceil_div(kRows, kRowThreads / (D / 16))); }

// The rows of one 128-row tile a thread holds: rows rl + p*rpp, p < P.
template <typename T, int P>
struct Tile {
  Raw16<T> raw[P];

  __device__ __forceinline__ void load(const RowMap& m, const T* xg, int D, int64_t row0, int64_t r1) {
#pragma unroll
    for (int p = 0; p < P; ++p) {
      const int r = m.rl + p * m.rpp;
      const int64_t row = row0 + r;
      if (m.active && r < kRows && row < r1) raw[p].load(xg + row * D);
      else raw[p].zero();
    }
  }

  // red[0..D) = the column sums of the tile (padding rows hold zeros), a fixed order.
  __device__ __forceinline__ void colsum(const RowMap& m, int D, float* red) const {
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
    reduce_columns(m, D, acc, red);
  }

  // Writes rows [row0, min(row0 + 128, Sp)) of x - mu (rows >= r1 are padding: zero codes and
  // scales); mu: this thread's 16 means in shared memory, 16-byte aligned (read per row, as four
  // 16-byte loads: fewer registers, more CTAs per SM).
  __device__ __forceinline__ void quantize(const RowMap& m, const float* mu, int64_t g, int64_t row0,
                                           int64_t r1, int64_t Sp, uint2* __restrict__ packed,
                                           uint8_t* __restrict__ scales) const {
    const int bpr = m.bpr;
#pragma unroll
    for (int p = 0; p < P; ++p) {
      const int r = m.rl + p * m.rpp;
      const int64_t row = row0 + r;
      if (r >= kRows || row >= Sp) continue;
      uint32_t sb = 0;
      uint2 w = make_uint2(0u, 0u);
      if (row < r1) {
        float v[16];
        raw[p].to_float(v);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const float4 u = reinterpret_cast<const float4*>(mu)[i];
          v[4 * i] = __fsub_rn(v[4 * i], u.x);
          v[4 * i + 1] = __fsub_rn(v[4 * i + 1], u.y);
          v[4 * i + 2] = __fsub_rn(v[4 * i + 2], u.z);
          v[4 * i + 3] = __fsub_rn(v[4 * i + 3], u.w);
        }
        w = quant16(v, sb);
      }
      const int64_t ob = (g * Sp + row) * bpr + m.cb;  // output block index
      __stcs(packed + ob, w);
      __stcs(reinterpret_cast<char*>(scales + ob), static_cast<char>(sb));
    }
  }
};

__device__ __forceinline__ int ld_acquire(const int* p) {
  int v;
  asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void st_release(int* p, int v) {
  asm volatile("st.release.gpu.global.b32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

// The mean of group g from its nt tile sums, by all kRowThreads threads of a CTA (both paths
// call this, so both give the same bits): D/4 column quads x L = 256/(D/4) lanes; lane j sums
// tiles j, j+L, ... (16-byte L2 loads, 4 in flight, 4 accumulators combined in a fixed order);
// then the lanes are combined in order and divided by S. On return red[0..D) holds the mean
// (red: at least kRowThreads*4 floats), and mean[g*D..] too when `mean` is not null.
__device__ __forceinline__ void group_mean(const float* partial, int64_t g, int64_t nt, int D, int64_t S,
                                           float* red, float* mean) {
  const int quads = D / 4;
  const int lanes = kRowThreads / quads;
  const int q = threadIdx.x % quads, j = threadIdx.x / quads;
  float4 acc[4];
#pragma unroll
  for (int u = 0; u < 4; ++u) acc[u] = make_float4(0.f, 0.f, 0.f, 0.f);
  if (j < lanes) {
    const float4* p = reinterpret_cast<const float4*>(partial + g * nt * D) + q;
    const int64_t step = static_cast<int64_t>(lanes) * quads;  // float4s between a lane's tiles
    int64_t i = j;
    for (; i + 3 * lanes < nt; i += 4 * lanes) {
      float4 v[4];
#pragma unroll
      for (int u = 0; u < 4; ++u) v[u] = __ldcg(p + (i * quads) + u * step);
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        acc[u].x += v[u].x; acc[u].y += v[u].y; acc[u].z += v[u].z; acc[u].w += v[u].w;
      }
    }
#pragma unroll
    for (int u = 0; u < 3; ++u) {  // at most 3 tiles left
      if (i + u * lanes < nt) {
        const float4 v = __ldcg(p + i * quads + u * step);
        acc[u].x += v.x; acc[u].y += v.y; acc[u].z += v.z; acc[u].w += v.w;
      }
    }
  }
  __syncthreads();  // red may still be read by the caller's previous phase
  if (j < lanes) {
    const float4 t = make_float4((acc[0].x + acc[1].x) + (acc[2].x + acc[3].x),
                                 (acc[0].y + acc[1].y) + (acc[2].y + acc[3].y),
                                 (acc[0].z + acc[1].z) + (acc[2].z + acc[3].z),
                                 (acc[0].w + acc[1].w) + (acc[2].w + acc[3].w));
    reinterpret_cast<float4*>(red)[j * quads + q] = t;
  }
  __syncthreads();
  float mu = 0.f;
  if (static_cast<int>(threadIdx.x) < D) {
    float s = 0.f;
    for (int l = 0; l < lanes; ++l) s += red[l * D + threadIdx.x];
    mu = s / static_cast<float>(S);
  }
  __syncthreads();
  if (static_cast<int>(threadIdx.x) < D) {
    red[threadIdx.x] = mu;
    if (mean) mean[g * D + threadIdx.x] = mu;
  }
}

}  // namespace rowtile
}  // namespace sageattn3
