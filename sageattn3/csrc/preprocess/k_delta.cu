// K smoothing + NVFP4 along D + delta_s, fused (bf16/fp16 input, D <= 128): one read of K.
//
// A CTA owns 256 keys of one (batch, kv head):
//   1. the K tile goes to shared memory (cp.async, zero-filled past Sk);
//   2. K - mean_k is quantized from there (whole 16-blocks per thread, streaming stores);
//   3. each warp loads the tensor-core B fragments of its 32 keys (ldmatrix) and keeps them in
//      registers;
//   4. for every q head of the GQA group, chunks of 64 Q-mean rows are split into bf16 parts
//      (fp16 for fp16 input) in shared memory and delta_s = mean_q · Kᵀ - mean_q · mean_k is
//      accumulated in fp32 with mma.sync m16n8k16, then written with streaming stores.
//
// Precision: K is exact in its own type; mean_q (fp32) is split into hi+mid+lo bf16 parts
// (24 bits of significand, residual <= 2^-27 relative) or hi+lo fp16 parts (22 bits), so the
// products are those of fp32 mean_q with K, accumulated in fp32. The constant mean_q · mean_k
// is computed by the same MMAs with mean_k split the same way, in the same accumulation order,
// so that e.g. a single key (K == mean_k) gives exactly 0 like the reference.
//
// Why tensor cores: at 32k tokens, 24 heads and 256 Q-mean rows, delta_s is 52 GFLOP; SIMT
// fp32 (~60 TFLOP/s) needs ~0.9 ms, the three bf16 MMAs per product ~0.25 ms, under the 805 MB
// fp32 write that bounds this kernel.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "common/launch.cuh"
#include "common/mma16.cuh"
#include "common/nvfp4.cuh"
#include "preprocess/rowblock.cuh"
#include "sageattn3.h"

namespace sageattn3 {
namespace {

constexpr int kThreads = 256;
constexpr int kKeys = 256;  // keys per CTA, 32 per warp
constexpr int kMCh = 64;    // Q-mean rows per shared-memory chunk
constexpr int kMaxKT = 8;   // D/16 <= 8

template <typename T>
struct Mma;

template <>
struct Mma<bf16_t> {
  static constexpr int kParts = 3;
  static __device__ __forceinline__ void split(float x, uint16_t (&p)[kParts]) {
    float r = x;
#pragma unroll
    for (int i = 0; i < kParts; ++i) {
      const __nv_bfloat16 h = __float2bfloat16_rn(r);
      p[i] = __bfloat16_as_ushort(h);
      r = __fsub_rn(r, __bfloat162float(h));
    }
  }
};

template <>
struct Mma<f16_t> {
  static constexpr int kParts = 2;
  static __device__ __forceinline__ void split(float x, uint16_t (&p)[kParts]) {
    float r = x;
#pragma unroll
    for (int i = 0; i < kParts; ++i) {
      const __half h = __float2half_rn(r);
      p[i] = __half_as_ushort(h);
      r = __fsub_rn(r, __half2float(h));
    }
  }
};

__device__ __forceinline__ void cp_async16(void* dst, const void* src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)), "l"(src), "r"(src_bytes));
}

__host__ __device__ constexpr int row_stride(int D) { return D + 8; }  // elements: 16-byte pad

__host__ __device__ constexpr int64_t smem_bytes(int D, int parts) {
  const int64_t k_tile = static_cast<int64_t>(kKeys) * row_stride(D) * 2;
  const int64_t a_chunk = static_cast<int64_t>(parts) * kMCh * row_stride(D) * 2;
  return (k_tile > a_chunk ? k_tile : a_chunk) + kMCh * 4;
}

/* ---------- the kernel's phases (force-inlined: one kernel, named steps) ---------- */

// 1. The CTA's K tile (kKeys rows; rows past Sk repeat the last one) -> shared memory.
template <typename T>
__device__ __forceinline__ void stage_k_tile(uint16_t* tile, int ld, const T* kg, int64_t j0, int64_t Sk, int D,
                                             int t) {
  const int cpr = D / 8;
  for (int c = t; c < kKeys * cpr; c += kThreads) {
    const int r = c / cpr, cc = c % cpr;
    const int64_t j = j0 + r;
    cp_async16(tile + r * ld + cc * 8, kg + (j < Sk ? j : Sk - 1) * D + cc * 8, j < Sk ? 16 : 0);
  }
  asm volatile("cp.async.wait_all;\n" ::);
  __syncthreads();
}

// 2. K - mean_k -> NVFP4 for the tile's rows j < Sk; zero rows up to Skp.
template <typename T>
__device__ __forceinline__ void quantize_k_tile(const uint16_t* tile, int ld, const float* mk, int64_t bh, int64_t j0,
                                                int64_t Sk, int64_t Skp, int D, uint2* __restrict__ packed,
                                                uint8_t* __restrict__ scales) {
  const RowMap m(D);
  if (!m.active) return;
  float mu[16];
#pragma unroll
  for (int i = 0; i < 16; ++i) mu[i] = mk[m.cb * 16 + i];
  for (int r = m.rl; r < kKeys; r += m.rpp) {
    const int64_t j = j0 + r;
    if (j >= Skp) break;
    Raw16<T> raw;
    const uint4* src = reinterpret_cast<const uint4*>(tile + r * ld + m.cb * 16);
    const uint4 x0 = src[0], x1 = src[1];
    raw.w[0] = x0.x; raw.w[1] = x0.y; raw.w[2] = x0.z; raw.w[3] = x0.w;
    raw.w[4] = x1.x; raw.w[5] = x1.y; raw.w[6] = x1.z; raw.w[7] = x1.w;
    float v[16];
    raw.to_float(v);
    const bool real = j < Sk;
#pragma unroll
    for (int i = 0; i < 16; ++i) v[i] = real ? __fsub_rn(v[i], mu[i]) : 0.f;
    uint32_t sb;
    const uint2 w = quant16(v, sb);
    const int64_t ob = (bh * Skp + j) * m.bpr + m.cb;
    __stcs(packed + ob, w);
    __stcs(reinterpret_cast<char*>(scales + ob), static_cast<char>(sb));
  }
}

// 3. The B fragments of this warp's 32 keys (4 n-tiles of 8) for every 16-channel k-step.
__device__ __forceinline__ void load_b_fragments(uint32_t (&bf)[kMaxKT][4][2], uint16_t* tile, int ld, int kt_n,
                                                 int warp, int lane) {
#pragma unroll
  for (int kt = 0; kt < kMaxKT; ++kt) {
#pragma unroll
    for (int np = 0; np < 2; ++np) {
      uint32_t r[4] = {0u, 0u, 0u, 0u};
      if (kt < kt_n) {
        const int key = warp * 32 + np * 16 + (lane & 7) + ((lane >> 4) << 3);
        const int col = kt * 16 + ((lane >> 3) & 1) * 8;
        ldmatrix_x4(r, tile + key * ld + col);
      }
      bf[kt][2 * np][0] = r[0];
      bf[kt][2 * np][1] = r[1];
      bf[kt][2 * np + 1][0] = r[2];
      bf[kt][2 * np + 1][1] = r[3];
    }
  }
}

// 4a. A chunk of Q-mean rows (rows past `rows` zero) -> its NP parts in shared memory.
template <typename T>
__device__ __forceinline__ void stage_mean_parts(uint16_t* tile, int ld, const float* mq, int64_t i0, int rows, int D,
                                                 int t) {
  using M = Mma<T>;
  constexpr int NP = M::kParts;
  for (int e = t; e < kMCh * D / 2; e += kThreads) {
    const int r = e / (D / 2), c2 = e % (D / 2);
    float2 v = make_float2(0.f, 0.f);
    if (r < rows) v = *reinterpret_cast<const float2*>(mq + (i0 + r) * D + c2 * 2);
    uint16_t p0[NP], p1[NP];
    M::split(v.x, p0);
    M::split(v.y, p1);
#pragma unroll
    for (int p = 0; p < NP; ++p)
      *reinterpret_cast<uint32_t*>(tile + (p * kMCh + r) * ld + c2 * 2) =
          static_cast<uint32_t>(p0[p]) | (static_cast<uint32_t>(p1[p]) << 16);
  }
}

// 4b. c = mean_q . mean_k per row of the chunk (one warp per 16-row tile), in the MMA order of 4c.
template <typename T>
__device__ __forceinline__ void mean_dot_mean(float* cs, uint16_t* tile, int ld, const float* mk, int kt_n, int warp,
                                              int lane, int arow, int acol) {
  using M = Mma<T>;
  constexpr int NP = M::kParts;
  float acc[4] = {0.f, 0.f, 0.f, 0.f};
  for (int kt = 0; kt < kt_n; ++kt) {
    const int d = kt * 16 + 2 * (lane & 3);
    uint16_t q0[NP], q1[NP], q8[NP], q9[NP];
    M::split(mk[d], q0);
    M::split(mk[d + 1], q1);
    M::split(mk[d + 8], q8);
    M::split(mk[d + 9], q9);
#pragma unroll
    for (int p = 0; p < NP; ++p) {
      uint32_t a[4];
      ldmatrix_x4(a, tile + (p * kMCh + warp * 16 + arow) * ld + kt * 16 + acol);
#pragma unroll
      for (int q = 0; q < NP; ++q)
        mma_m16n8k16<T>(acc, a, static_cast<uint32_t>(q0[q]) | (static_cast<uint32_t>(q1[q]) << 16),
               static_cast<uint32_t>(q8[q]) | (static_cast<uint32_t>(q9[q]) << 16));
    }
  }
  if ((lane & 3) == 0) {
    cs[warp * 16 + lane / 4] = acc[0];
    cs[warp * 16 + lane / 4 + 8] = acc[2];
  }
}

// 4c. mean_q . K^T - c for the chunk's rows and this warp's 32 keys, to the output rows.
template <typename T>
__device__ __forceinline__ void delta_rows(float* __restrict__ out, uint16_t* tile, int ld, const float* cs,
                                           const uint32_t (&bf)[kMaxKT][4][2], int kt_n, int mtiles, int rows,
                                           int64_t i0, int64_t j0, int64_t Sk, int64_t Skp, int warp, int lane,
                                           int arow, int acol) {
  using M = Mma<T>;
  constexpr int NP = M::kParts;
  for (int mt = 0; mt < mtiles; ++mt) {
    float acc[4][4];
#pragma unroll
    for (int nt = 0; nt < 4; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[nt][e] = 0.f;
#pragma unroll
    for (int kt = 0; kt < kMaxKT; ++kt) {
      if (kt < kt_n) {
#pragma unroll
        for (int p = 0; p < NP; ++p) {
          uint32_t a[4];
          ldmatrix_x4(a, tile + (p * kMCh + mt * 16 + arow) * ld + kt * 16 + acol);
#pragma unroll
          for (int nt = 0; nt < 4; ++nt) mma_m16n8k16<T>(acc[nt], a, bf[kt][nt][0], bf[kt][nt][1]);
        }
      }
    }
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int ri = mt * 16 + lane / 4 + half * 8;
      if (ri >= rows) continue;
      const float c = cs[ri];
      float* orow = out + (i0 + ri) * Skp;
#pragma unroll
      for (int nt = 0; nt < 4; ++nt) {
        const int64_t j = j0 + warp * 32 + nt * 8 + 2 * (lane & 3);
        if (j >= Skp) continue;
        float2 val;
        val.x = j < Sk ? __fsub_rn(acc[nt][2 * half], c) : 0.f;
        val.y = j + 1 < Sk ? __fsub_rn(acc[nt][2 * half + 1], c) : 0.f;
        __stcs(reinterpret_cast<float2*>(orow + j), val);
      }
    }
  }
}

/* ---------- the kernel: one CTA's kKeys keys of one kv head, phase by phase ---------- */

template <typename T>
__global__ void __launch_bounds__(kThreads, 2)
    k_delta_kernel(const T* __restrict__ k, int64_t Hq, int64_t Hkv, int64_t Sk, int D, int64_t nblk,
                   const float* __restrict__ mean_k, const float* __restrict__ mean_q, int64_t Skp, int64_t j_tiles,
                   uint2* __restrict__ packed, uint8_t* __restrict__ scales, float* __restrict__ delta) {
  constexpr int NP = Mma<T>::kParts;
  extern __shared__ __align__(16) uint8_t smem[];
  const int ld = row_stride(D);
  uint16_t* tile = reinterpret_cast<uint16_t*>(smem);  // K: [kKeys][ld]; later A: [NP][kMCh][ld]
  float* cs = reinterpret_cast<float*>(smem + (smem_bytes(D, NP) - kMCh * 4));
  const int t = threadIdx.x, lane = t & 31, warp = t >> 5;
  const int64_t jt = blockIdx.x % j_tiles, bh = blockIdx.x / j_tiles;
  const int64_t b = bh / Hkv, hkv = bh % Hkv;
  const int64_t j0 = jt * kKeys;
  const float* mk = mean_k + bh * D;
  const int kt_n = D / 16;

  stage_k_tile<T>(tile, ld, k + bh * Sk * D, j0, Sk, D, t);
  quantize_k_tile<T>(tile, ld, mk, bh, j0, Sk, Skp, D, packed, scales);
  uint32_t bf[kMaxKT][4][2];
  load_b_fragments(bf, tile, ld, kt_n, warp, lane);
  __syncthreads();  // the tile's memory now holds the A chunks

  // 4. delta_s for every q head of the group, kMCh Q-mean rows at a time
  const int64_t rep = Hq / Hkv;
  const int arow = (lane & 7) + ((lane >> 3) & 1) * 8, acol = (lane >> 4) * 8;
  for (int64_t h = 0; h < rep; ++h) {
    const int64_t gq = b * Hq + hkv * rep + h;
    const float* mq = mean_q + gq * nblk * D;
    float* out = delta + gq * nblk * Skp;
    for (int64_t i0 = 0; i0 < nblk; i0 += kMCh) {
      const int rows = static_cast<int>(std::min<int64_t>(kMCh, nblk - i0));
      stage_mean_parts<T>(tile, ld, mq, i0, rows, D, t);
      __syncthreads();
      const int mtiles = (rows + 15) / 16;
      if (warp < mtiles) mean_dot_mean<T>(cs, tile, ld, mk, kt_n, warp, lane, arow, acol);
      __syncthreads();
      delta_rows<T>(out, tile, ld, cs, bf, kt_n, mtiles, rows, i0, j0, Sk, Skp, warp, lane, arow, acol);
      __syncthreads();  // before the next chunk overwrites A and cs
    }
  }
}

template <typename T>
int launch(const void* k, int64_t B, int64_t Hq, int64_t Hkv, int64_t Sk, int64_t D, int64_t nblk,
           const float* mean_k, const float* mean_q, int64_t Skp, uint8_t* packed, uint8_t* scales, float* delta,
           cudaStream_t stream) {
  const int64_t j_tiles = ceil_div(Skp, kKeys);
  const int64_t grid = B * Hkv * j_tiles;
  if (grid == 0) return cudaSuccess;
  if (grid > 0x7FFFFFFF) return cudaErrorInvalidValue;
  const int64_t bytes = smem_bytes(static_cast<int>(D), Mma<T>::kParts);
  // Opt in to more than 48 KB of dynamic shared memory: once per device, raised to the largest D asked for.
  static KernelSetup setup;
  int err = setup.smem(k_delta_kernel<T>, static_cast<int>(bytes));
  if (err != cudaSuccess) return err;
  k_delta_kernel<T><<<static_cast<unsigned>(grid), kThreads, bytes, stream>>>(
      static_cast<const T*>(k), Hq, Hkv, Sk, static_cast<int>(D), nblk, mean_k, mean_q, Skp, j_tiles,
      reinterpret_cast<uint2*>(packed), scales, delta);
  return cudaGetLastError();
}

}  // namespace

int smooth_quant_k_delta(const void* k, DType dtype, int64_t B, int64_t Hq, int64_t Hkv, int64_t Sk, int64_t D,
                         int64_t nblk, const float* mean_k, const float* mean_q, int64_t Skp, uint8_t* packed,
                         uint8_t* scales, float* delta, cudaStream_t stream) {
  if (D % 16 || D <= 0 || D > 16 * kMaxKT || Hkv <= 0 || Hq % Hkv || Skp % 16 || Skp < Sk || Sk < 1 || nblk < 1)
    return cudaErrorInvalidValue;
  switch (dtype) {
    case DType::kFloat16:
      return launch<f16_t>(k, B, Hq, Hkv, Sk, D, nblk, mean_k, mean_q, Skp, packed, scales, delta, stream);
    case DType::kBFloat16:
      return launch<bf16_t>(k, B, Hq, Hkv, Sk, D, nblk, mean_k, mean_q, Skp, packed, scales, delta, stream);
    case DType::kFloat32: return cudaErrorInvalidValue;  // the fused kernel takes 16-bit K only
  }
  return cudaErrorInvalidValue;
}

}  // namespace sageattn3
