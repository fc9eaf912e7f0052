// Smoothing + NVFP4 along D for Q and K: a CTA owns 128 rows of one group and holds them in
// registers: every thread loads its P row blocks (whole 16-channel blocks, all loads in flight
// at once), so the tile's column sums, the mean and the quantization all come from one read of
// the tile from DRAM.
//
// Means over 128-row blocks (Q with per_block_mean) are local to a CTA. A mean over the whole
// sequence (K; Q without per_block_mean) is a reduction across the group's CTAs: one read
// when the whole grid is resident at once, else tile sums, means, then the quantization
// (smooth_quant_seq below).
#include "common/launch.cuh"
#include "common/nvfp4.cuh"
#include "preprocess/rowblock.cuh"
#include "preprocess/tile.cuh"
#include "sageattn3.h"

namespace sageattn3 {
namespace {

using rowtile::kRows;
using rowtile::Tile;
using rowtile::passes_for;
using rowtile::group_mean;
using rowtile::ld_acquire;
using rowtile::st_release;

// Tile `tile` of group g: rows minus their mean (computed from the tile when compute_mean, else
// read from `mean`), NVFP4. red: kRowThreads * 16 floats of shared memory.
template <typename T, int P>
__device__ __forceinline__ void smooth_quant_tile(const T* __restrict__ x, int64_t S, int D, float* __restrict__ mean,
                                                  bool compute_mean, int mean_block, int64_t Sp, int64_t g,
                                                  int64_t tile, uint2* __restrict__ packed,
                                                  uint8_t* __restrict__ scales, float* red) {
  const RowMap m(D);
  const int64_t row0 = tile * kRows;
  const int64_t r1 = std::min<int64_t>(S, row0 + kRows);  // real rows of this tile: [row0, r1)
  const int64_t nm = mean_block ? ceil_div(S, kRows) : 1;
  const int64_t mi = mean_block ? tile : 0;
  const bool has_rows = row0 < S;

  Tile<T, P> t;
  t.load(m, x + g * S * D + m.cb * 16, D, row0, r1);
  if (compute_mean) {
    t.colsum(m, D, red);
    if (has_rows && static_cast<int>(threadIdx.x) < D) {
      const float mu = red[threadIdx.x] / static_cast<float>(r1 - row0);
      mean[(g * nm + mi) * D + threadIdx.x] = mu;
      red[threadIdx.x] = mu;
    }
  } else if (has_rows && static_cast<int>(threadIdx.x) < D) {
    red[threadIdx.x] = mean[(g * nm + mi) * D + threadIdx.x];
  }
  __syncthreads();
  if (!m.active) return;
  t.quantize(m, red + m.cb * 16, g, row0, r1, Sp, packed, scales);
}

template <typename T, int P>
__global__ void __launch_bounds__(kRowThreads, (P <= 4 ? 3 : 1)) smooth_quant_kernel(const T* __restrict__ x, int64_t S, int D,
                                                                   float* __restrict__ mean, bool compute_mean,
                                                                   int mean_block, int64_t Sp, int64_t tiles,
                                                                   uint2* __restrict__ packed,
                                                                   uint8_t* __restrict__ scales) {
  __shared__ __align__(16) float red[kRowThreads * 16];
  const uint32_t nt = static_cast<uint32_t>(tiles);  // the grid (< 2^31 CTAs) bounds it: 32-bit division
  smooth_quant_tile<T, P>(x, S, D, mean, compute_mean, mean_block, Sp, blockIdx.x / nt, blockIdx.x % nt, packed,
                          scales, red);
}

// ---- one mean over the whole sequence -------------------------------------------------------
// The mean of group g is sum over its real tiles (in tile order) of the tile column sums, / S.
// Fused (one read): CTAs take tickets in launch order (ticket -> group-major tile), load their
// tile, publish its column sums and arrive on the group's counter; the last to arrive sums the
// partials in tile order, publishes the mean and raises the group's flag; the others wait for
// the flag, then quantize the tile still in registers. A CTA only waits on tiles of its own
// group, handed out before any later ticket, so a group whose tiles all fit on the device
// cannot deadlock; the launcher is stricter and fuses only grids that are resident at once
// (a group waiting for slots held by waiting CTAs serialises the groups: on an H100 at 24
// heads x 32k tokens that was 2x slower than two reads). Otherwise tile sums, a mean kernel,
// then smooth_quant_kernel.
// Both give the same bits.

// sync: [0] the ticket counter, [1 + g] arrivals of group g, [1 + G + g] group g's mean is ready.
template <typename T, int P, bool kFused>
__global__ void __launch_bounds__(kRowThreads, (P <= 4 ? 3 : 1)) seq_mean_quant_kernel(const T* __restrict__ x, int64_t G, int64_t S,
                                                                     int D, int64_t Sp, int64_t tiles,
                                                                     float* __restrict__ partial,
                                                                     float* __restrict__ mean, int* __restrict__ sync,
                                                                     uint2* __restrict__ packed,
                                                                     uint8_t* __restrict__ scales) {
  __shared__ __align__(16) float red[kRowThreads * 16];
  __shared__ int64_t s_ticket;
  __shared__ int s_last;
  const RowMap m(D);
  int64_t ticket = blockIdx.x;
  if (kFused) {
    if (threadIdx.x == 0) s_ticket = atomicAdd(reinterpret_cast<unsigned long long*>(sync), 1ull);
    __syncthreads();
    ticket = s_ticket;
  }
  const int64_t g = ticket / tiles, tile = ticket % tiles;
  const int64_t nt = ceil_div(S, kRows);  // tiles with real rows
  const int64_t row0 = tile * kRows;
  const int64_t r1 = std::min<int64_t>(S, row0 + kRows);
  const bool has_rows = row0 < S;

  Tile<T, P> t;
  t.load(m, x + g * S * D + m.cb * 16, D, row0, r1);
  if (has_rows) {
    t.colsum(m, D, red);
    if (static_cast<int>(threadIdx.x) < D) {
      partial[(g * nt + tile) * D + threadIdx.x] = red[threadIdx.x];
      if (kFused) __threadfence();
    }
  }
  if (!kFused) return;  // tile sums only

  int* arrive = reinterpret_cast<int*>(sync + 2) + g;
  int* ready = reinterpret_cast<int*>(sync + 2) + G + g;
  if (has_rows) {
    __syncthreads();  // every partial of this CTA written
    if (threadIdx.x == 0) {
      __threadfence();
      s_last = atomicAdd(arrive, 1) == nt - 1;
      __threadfence();
    }
    __syncthreads();
    if (s_last) {
      group_mean(partial, g, nt, static_cast<int>(D), S, red, mean);
      __threadfence();
      __syncthreads();
      if (threadIdx.x == 0) {
        st_release(ready, 1);
      }
    } else {
      if (threadIdx.x == 0) {
        while (ld_acquire(ready) == 0) __nanosleep(128);
      }
      __syncthreads();
      if (static_cast<int>(threadIdx.x) < D) red[threadIdx.x] = __ldcg(mean + g * D + threadIdx.x);
    }
    __syncthreads();
  }
  if (!m.active) return;
  t.quantize(m, red + m.cb * 16, g, row0, r1, Sp, packed, scales);
}

__global__ void __launch_bounds__(kRowThreads) seq_mean_kernel(const float* __restrict__ partial, int64_t nt, int D,
                                                                int64_t S, float* __restrict__ mean) {
  __shared__ __align__(16) float red[kRowThreads * 4];
  group_mean(partial, blockIdx.x, nt, D, S, red, mean);
}

template <typename T, int P>
int launch_p(const void* x, int64_t G, int64_t S, int64_t D, float* mean, bool compute_mean, int mean_block,
             int64_t Sp, uint8_t* packed, uint8_t* scales, cudaStream_t stream) {
  const int64_t tiles = ceil_div(Sp, kRows);
  const int64_t grid = G * tiles;
  if (grid == 0) return cudaSuccess;
  if (grid > 0x7FFFFFFF) return cudaErrorInvalidValue;
  smooth_quant_kernel<T, P><<<static_cast<unsigned>(grid), kRowThreads, 0, stream>>>(
      static_cast<const T*>(x), S, static_cast<int>(D), mean, compute_mean, mean_block, Sp, tiles,
      reinterpret_cast<uint2*>(packed), scales);
  return cudaGetLastError();
}

// Whole-sequence mean. One read (fused, a cooperative launch) when every CTA of the grid is
// resident at once: no CTA then waits for a slot, and all groups progress together. Otherwise,
// under stream capture, or when the driver refuses the cooperative launch: two reads (tile
// sums, means, quantization). force_two_pass: always the latter.
template <typename T, int P>
int launch_seq_p(const void* x, int64_t G, int64_t S, int64_t D, float* mean, float* partial, int* sync,
                 int64_t Sp, uint8_t* packed, uint8_t* scales, bool force_two_pass, cudaStream_t stream) {
  const int64_t tiles = ceil_div(Sp, kRows), nt = ceil_div(S, kRows);
  const int64_t grid = G * tiles;
  if (grid == 0) return cudaSuccess;
  if (grid > 0x7FFFFFFF || G > 0x7FFFFFFF) return cudaErrorInvalidValue;
  int per_sm = 0;
  cudaError_t e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, seq_mean_quant_kernel<T, P, true>,
                                                                kRowThreads, 0);
  if (e != cudaSuccess) return e;
  const T* xt = static_cast<const T*>(x);
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(stream, &capture) != cudaSuccess) capture = cudaStreamCaptureStatusActive;
  if (!force_two_pass && capture == cudaStreamCaptureStatusNone && grid <= static_cast<int64_t>(per_sm) * sm_count()) {
    // A cooperative launch: the driver refuses it unless every CTA can be resident at once (also
    // when MPS or other limits shrink the device), which the waiting CTAs rely on.
    e = cudaMemsetAsync(sync, 0, sizeof(int) * (2 + 2 * G), stream);
    if (e != cudaSuccess) return e;
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3(static_cast<unsigned>(grid));
    cfg.blockDim = dim3(kRowThreads);
    cfg.stream = stream;
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeCooperative;
    attr[0].val.cooperative = 1;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
    e = cudaLaunchKernelEx(&cfg, seq_mean_quant_kernel<T, P, true>, xt, G, S, static_cast<int>(D), Sp, tiles, partial,
                           mean, sync, reinterpret_cast<uint2*>(packed), scales);
    if (e == cudaSuccess) return cudaSuccess;
    if (e != cudaErrorCooperativeLaunchTooLarge && e != cudaErrorNotSupported) return e;
    cudaGetLastError();  // refused: clear it and take two reads
  }
  // Tile sums of the real tiles, the means, then the quantization with them. (Running this by
  // L2-sized chunks of groups, so the second read hits L2, measured slower on an H100: the
  // small grids and the serial mean kernels cost more than the DRAM read they save.)
  seq_mean_quant_kernel<T, P, false><<<static_cast<unsigned>(G * nt), kRowThreads, 0, stream>>>(
      xt, G, S, static_cast<int>(D), Sp, nt, partial, mean, sync, reinterpret_cast<uint2*>(packed), scales);
  if ((e = cudaGetLastError()) != cudaSuccess) return e;
  seq_mean_kernel<<<static_cast<unsigned>(G), kRowThreads, 0, stream>>>(partial, nt, static_cast<int>(D), S, mean);
  if ((e = cudaGetLastError()) != cudaSuccess) return e;
  return launch_p<T, P>(x, G, S, D, mean, false, 0, Sp, packed, scales, stream);
}

// ---- Q block means and K's tile sums in one launch ------------------------------------------
// Q's block-mean kernel is bound by instruction issue (the quantization), K's tile-sum pass by
// DRAM (it only adds): run as one grid, with the K CTAs spread evenly among the Q ones, the K
// reads proceed under Q's arithmetic instead of after it. The last K CTA of a group to finish
// reduces the group's mean (group_mean: the bits smooth_quant_seq gives) for K's quantization.
struct QBlocks {
  const void* x;
  int64_t S, Sp, tiles;  // tiles: ceil(Sp / 128) per group
  float* mean;
  uint2* packed;
  uint8_t* scales;
};
struct KSums {
  const void* x;
  int64_t S, nt;  // nt: ceil(S / 128) tiles per group
  float* partial;
  float* mean;
  int* arrive;  // one counter per group, zero at launch
};

// Once per group, by one CTA: out of line, so that its registers do not count against the
// quantizing CTAs of the same kernel (inlined, the kernel spilled at 3 CTAs per SM).
__device__ __noinline__ void group_mean_call(const float* partial, int64_t g, int64_t nt, int D, int64_t S,
                                             float* red, float* mean) {
  group_mean(partial, g, nt, D, S, red, mean);
}

// The grid (nq + nk < 2^31 CTAs) in nk runs of `period` = 1 + floor(nq / nk) CTAs, each led by
// one K CTA, then Q CTAs to the end: 32-bit index arithmetic only.
template <typename T, int P>
__global__ void __launch_bounds__(kRowThreads, (P <= 4 ? 3 : 1)) q_blocks_k_sums_kernel(const QBlocks q, const KSums k,
                                                                                         int D, uint32_t nk,
                                                                                         uint32_t period) {
  __shared__ __align__(16) float red[kRowThreads * 16];
  __shared__ int s_last;
  const uint32_t b = blockIdx.x, run = b / period;
  if (run >= nk || b % period != 0) {  // a Q CTA; K CTAs before it: min(run + 1, nk)
    const uint32_t i = b - min(run + 1, nk), tiles = static_cast<uint32_t>(q.tiles);
    smooth_quant_tile<T, P>(static_cast<const T*>(q.x), q.S, D, q.mean, true, kRows, q.Sp, i / tiles, i % tiles,
                            q.packed, q.scales, red);
    return;
  }
  const uint32_t ntk = static_cast<uint32_t>(k.nt);
  const int64_t g = run / ntk, tile = run % ntk;
  const RowMap m(D);
  const int64_t row0 = tile * kRows;
  Tile<T, P> t;
  t.load(m, static_cast<const T*>(k.x) + g * k.S * D + m.cb * 16, D, row0, std::min<int64_t>(k.S, row0 + kRows));
  t.colsum(m, D, red);
  if (static_cast<int>(threadIdx.x) < D) {
    k.partial[(g * k.nt + tile) * D + threadIdx.x] = red[threadIdx.x];
    __threadfence();
  }
  __syncthreads();  // every partial of this CTA written
  if (threadIdx.x == 0) {
    __threadfence();
    s_last = atomicAdd(k.arrive + g, 1) == k.nt - 1;
    __threadfence();
  }
  __syncthreads();
  if (s_last) group_mean_call(k.partial, g, k.nt, D, k.S, red, k.mean);
}

template <typename T, int P>
int launch_q_blocks_k_sums(const QBlocks& q, int64_t Gq, const KSums& k, int64_t Gk, int64_t D, cudaStream_t stream) {
  const int64_t nq = Gq * q.tiles, nk = Gk * k.nt;  // nk >= 1
  if (nq + nk > 0x7FFFFFFF) return cudaErrorInvalidValue;
  cudaError_t e = cudaMemsetAsync(k.arrive, 0, sizeof(int) * Gk, stream);
  if (e != cudaSuccess) return e;
  q_blocks_k_sums_kernel<T, P><<<static_cast<unsigned>(nq + nk), kRowThreads, 0, stream>>>(
      q, k, static_cast<int>(D), static_cast<uint32_t>(nk), static_cast<uint32_t>(1 + nq / nk));
  return cudaGetLastError();
}

template <typename T>
int launch_fused(const QBlocks& q, int64_t Gq, const KSums& k, int64_t Gk, int64_t D, cudaStream_t stream) {
  switch (passes_for(D)) {
    case 1: return launch_q_blocks_k_sums<T, 1>(q, Gq, k, Gk, D, stream);
    case 2: return launch_q_blocks_k_sums<T, 2>(q, Gq, k, Gk, D, stream);
    case 3: case 4: return launch_q_blocks_k_sums<T, 4>(q, Gq, k, Gk, D, stream);
    default: return launch_q_blocks_k_sums<T, 8>(q, Gq, k, Gk, D, stream);
  }
}

template <typename T>
int launch(const void* x, int64_t G, int64_t S, int64_t D, float* mean, bool compute_mean, int mean_block,
           int64_t Sp, uint8_t* packed, uint8_t* scales, cudaStream_t stream) {
  switch (passes_for(D)) {
    case 1: return launch_p<T, 1>(x, G, S, D, mean, compute_mean, mean_block, Sp, packed, scales, stream);
    case 2: return launch_p<T, 2>(x, G, S, D, mean, compute_mean, mean_block, Sp, packed, scales, stream);
    case 3: case 4: return launch_p<T, 4>(x, G, S, D, mean, compute_mean, mean_block, Sp, packed, scales, stream);
    default: return launch_p<T, 8>(x, G, S, D, mean, compute_mean, mean_block, Sp, packed, scales, stream);
  }
}

template <typename T>
int launch_seq(const void* x, int64_t G, int64_t S, int64_t D, float* mean, float* partial, int* sync, int64_t Sp,
               uint8_t* packed, uint8_t* scales, bool force_two_pass, cudaStream_t stream) {
  switch (passes_for(D)) {
    case 1: return launch_seq_p<T, 1>(x, G, S, D, mean, partial, sync, Sp, packed, scales, force_two_pass, stream);
    case 2: return launch_seq_p<T, 2>(x, G, S, D, mean, partial, sync, Sp, packed, scales, force_two_pass, stream);
    case 3: case 4: return launch_seq_p<T, 4>(x, G, S, D, mean, partial, sync, Sp, packed, scales, force_two_pass, stream);
    default: return launch_seq_p<T, 8>(x, G, S, D, mean, partial, sync, Sp, packed, scales, force_two_pass, stream);
  }
}

}  // namespace

int smooth_quant_rows(const void* x, DType dtype, int64_t G, int64_t S, int64_t D, float* mean, bool compute_mean,
                      int mean_block, int64_t Sp, uint8_t* packed, uint8_t* scales, cudaStream_t stream) {
  if (D % 16 || D <= 0 || D > kMaxD || Sp < S || (mean_block != 0 && mean_block != kRows) ||
      (compute_mean && mean_block != kRows))
    return cudaErrorInvalidValue;
  switch (dtype) {
    case DType::kFloat16: return launch<f16_t>(x, G, S, D, mean, compute_mean, mean_block, Sp, packed, scales, stream);
    case DType::kBFloat16: return launch<bf16_t>(x, G, S, D, mean, compute_mean, mean_block, Sp, packed, scales, stream);
    case DType::kFloat32: return launch<float>(x, G, S, D, mean, compute_mean, mean_block, Sp, packed, scales, stream);
  }
  return cudaErrorInvalidValue;
}

int smooth_quant_seq(const void* x, DType dtype, int64_t G, int64_t S, int64_t D, float* mean, float* partial,
                     int* sync, int64_t Sp, uint8_t* packed, uint8_t* scales, bool force_two_pass,
                     cudaStream_t stream) {
  if (D % 16 || D <= 0 || D > kMaxD || Sp < S || S < 1) return cudaErrorInvalidValue;
  switch (dtype) {
    case DType::kFloat16:
      return launch_seq<f16_t>(x, G, S, D, mean, partial, sync, Sp, packed, scales, force_two_pass, stream);
    case DType::kBFloat16:
      return launch_seq<bf16_t>(x, G, S, D, mean, partial, sync, Sp, packed, scales, force_two_pass, stream);
    case DType::kFloat32:
      return launch_seq<float>(x, G, S, D, mean, partial, sync, Sp, packed, scales, force_two_pass, stream);
  }
  return cudaErrorInvalidValue;
}

int smooth_quant_q_blocks_k_sums(const void* q, const void* k, DType dtype, int64_t Gq, int64_t Sq, int64_t Gk,
                                 int64_t Sk, int64_t D, float* mean_q, int64_t Sqp, uint8_t* q_packed,
                                 uint8_t* q_scales, float* mean_k, float* partial_k, int* sync, cudaStream_t stream) {
  if (D % 16 || D <= 0 || D > kMaxD || Sqp < Sq || Sk < 1 || Gk < 1) return cudaErrorInvalidValue;
  const QBlocks qa{q, Sq, Sqp, ceil_div(Sqp, kRows), mean_q, reinterpret_cast<uint2*>(q_packed), q_scales};
  const KSums ka{k, Sk, ceil_div(Sk, kRows), partial_k, mean_k, sync};
  switch (dtype) {
    case DType::kFloat16: return launch_fused<f16_t>(qa, Gq, ka, Gk, D, stream);
    case DType::kBFloat16: return launch_fused<bf16_t>(qa, Gq, ka, Gk, D, stream);
    case DType::kFloat32: return launch_fused<float>(qa, Gq, ka, Gk, D, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace sageattn3
