// delta_s = mean_q · (K - mean_k)ᵀ in fp32 (SIMT): a CTA owns 64 keys of one (batch, kv head)
// and produces, for every q head of its GQA group, 64 q-means x 64 keys tiles; each thread
// computes a 4x4 block, accumulating over D in chunks of 16 channels staged in shared memory.
#include "common/launch.cuh"
#include "common/nvfp4.cuh"
#include "sageattn3.h"

namespace sageattn3 {
namespace {

constexpr int kThreads = 256;
constexpr int kTJ = 64;  // keys per CTA
constexpr int kTI = 64;  // q-mean rows per tile
constexpr int kKC = 16;  // channels per stage

template <typename T>
__global__ void __launch_bounds__(kThreads) delta_s_kernel(const T* __restrict__ k, int64_t Hq, int64_t Hkv,
                                                           int64_t Sk, int D, int64_t nblk,
                                                           const float* __restrict__ mean_k,
                                                           const float* __restrict__ mean_q, int64_t Sp,
                                                           int64_t j_tiles, float* __restrict__ out) {
  __shared__ __align__(16) float ks[kKC][kTJ + 4];
  __shared__ __align__(16) float mq[kKC][kTI + 4];
  const int t = threadIdx.x;
  const int64_t jt = blockIdx.x % j_tiles, bh = blockIdx.x / j_tiles;  // bh = b * Hkv + hkv
  const int64_t b = bh / Hkv, hkv = bh % Hkv;
  const int64_t j0 = jt * kTJ;
  const int64_t rep = Hq / Hkv;
  const T* kg = k + bh * Sk * D;
  const float* mk = mean_k + bh * D;
  const int tx = t % 16, ty = t / 16;

  for (int64_t h = 0; h < rep; ++h) {
    const int64_t hq = hkv * rep + h;
    const float* mqg = mean_q + (b * Hq + hq) * nblk * D;
    float* og = out + (b * Hq + hq) * nblk * Sp;
    for (int64_t i0 = 0; i0 < nblk; i0 += kTI) {
      float acc[4][4] = {};
      for (int d0 = 0; d0 < D; d0 += kKC) {
        __syncthreads();
        if (t < kTJ * kKC / 8) {  // 64 keys x 2 chunks of 8 channels
          const int j = t / 2, c8 = t % 2;
          float v[8];
          if (j0 + j < Sk) {
            Load8<T>::run(kg + (j0 + j) * D + d0 + c8 * 8, v);
#pragma unroll
            for (int e = 0; e < 8; ++e) v[e] = __fsub_rn(v[e], mk[d0 + c8 * 8 + e]);
          } else {
#pragma unroll
            for (int e = 0; e < 8; ++e) v[e] = 0.f;
          }
#pragma unroll
          for (int e = 0; e < 8; ++e) ks[c8 * 8 + e][j] = v[e];
        }
        {  // 64 rows x 16 channels of mean_q: 4 per thread
          const int i = t / 4, c4 = t % 4;
          float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
          if (i0 + i < nblk) v = *reinterpret_cast<const float4*>(mqg + (i0 + i) * D + d0 + c4 * 4);
          mq[c4 * 4 + 0][i] = v.x;
          mq[c4 * 4 + 1][i] = v.y;
          mq[c4 * 4 + 2][i] = v.z;
          mq[c4 * 4 + 3][i] = v.w;
        }
        __syncthreads();
#pragma unroll
        for (int dd = 0; dd < kKC; ++dd) {
          const float4 a = *reinterpret_cast<const float4*>(&mq[dd][ty * 4]);
          const float4 c = *reinterpret_cast<const float4*>(&ks[dd][tx * 4]);
          const float av[4] = {a.x, a.y, a.z, a.w}, cv[4] = {c.x, c.y, c.z, c.w};
#pragma unroll
          for (int p = 0; p < 4; ++p)
#pragma unroll
            for (int q = 0; q < 4; ++q) acc[p][q] = fmaf(av[p], cv[q], acc[p][q]);
        }
      }
      const int64_t j = j0 + tx * 4;
      if (j < Sp) {
#pragma unroll
        for (int p = 0; p < 4; ++p) {
          const int64_t i = i0 + ty * 4 + p;
          if (i < nblk)
            *reinterpret_cast<float4*>(og + i * Sp + j) = make_float4(acc[p][0], acc[p][1], acc[p][2], acc[p][3]);
        }
      }
    }
  }
}

template <typename T>
int launch(const void* k, int64_t B, int64_t Hq, int64_t Hkv, int64_t Sk, int64_t D, int64_t nblk,
           const float* mean_k, const float* mean_q, int64_t Sp, float* out, cudaStream_t stream) {
  const int64_t j_tiles = ceil_div(Sp, kTJ);
  const int64_t grid = B * Hkv * j_tiles;
  if (grid == 0) return cudaSuccess;
  if (grid > 0x7FFFFFFF) return cudaErrorInvalidValue;
  delta_s_kernel<T><<<static_cast<unsigned>(grid), kThreads, 0, stream>>>(
      static_cast<const T*>(k), Hq, Hkv, Sk, static_cast<int>(D), nblk, mean_k, mean_q, Sp, j_tiles, out);
  return cudaGetLastError();
}

}  // namespace

int delta_s(const void* k, DType dtype, int64_t B, int64_t Hq, int64_t Hkv, int64_t Sk, int64_t D, int64_t nblk,
            const float* mean_k, const float* mean_q, int64_t Sp, float* out, cudaStream_t stream) {
  if (D % 16 || Hkv <= 0 || Hq % Hkv || Sp % 16 || Sp < Sk) return cudaErrorInvalidValue;
  switch (dtype) {
    case DType::kFloat16: return launch<f16_t>(k, B, Hq, Hkv, Sk, D, nblk, mean_k, mean_q, Sp, out, stream);
    case DType::kBFloat16: return launch<bf16_t>(k, B, Hq, Hkv, Sk, D, nblk, mean_k, mean_q, Sp, out, stream);
    case DType::kFloat32: return launch<float>(k, B, Hq, Hkv, Sk, D, nblk, mean_k, mean_q, Sp, out, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace sageattn3
