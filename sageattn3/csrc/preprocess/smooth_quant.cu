// Smoothing + NVFP4 along D for Q and K: a CTA owns 128 rows of one group and holds them in
// registers: every thread loads its P row blocks (whole 16-channel blocks, all loads in flight
// at once), so the tile's column sums, the mean and the quantization all come from one read of
// the tile from DRAM.
//
// Means over 128-row blocks (Q with per_block_mean) are local to a CTA. A mean over the whole
// sequence (K; Q without per_block_mean) is a reduction across the group's CTAs: one read
// when the whole grid is resident at once, else tile sums, means, then the quantization
// (smooth_quant_seq below).
#include <type_traits>

#include "common/launch.cuh"
#include "common/nvfp4.cuh"
#include "preprocess/rowblock.cuh"
#include "sageattn3.h"

namespace sageattn3 {
namespace {

constexpr int kRows = 128;

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

// group_mean from a kernel that also quantizes (once per group, by one CTA): out of line, so
// that its registers do not count against the tile the kernel holds (inlined, the kernels
// spilled at 3 CTAs per SM).
__device__ __noinline__ void group_mean_call(const float* partial, int64_t g, int64_t nt, int D, int64_t S,
                                             float* red, float* mean) {
  group_mean(partial, g, nt, D, S, red, mean);
}

// After colsum left the tile's column sums in red[0..D): store them as this tile's row of the
// partial sums and count the tile on *arrive. Every thread of the CTA gets whether it brought
// the group's last tile (the one to reduce the mean). s_last: a shared int.
__device__ __forceinline__ bool publish_tile_sum(const float* red, float* partial_row, int D, int* arrive, int64_t nt,
                                                 int* s_last) {
  if (static_cast<int>(threadIdx.x) < D) {
    partial_row[threadIdx.x] = red[threadIdx.x];
    __threadfence();
  }
  __syncthreads();  // every partial of this CTA written
  if (threadIdx.x == 0) {
    __threadfence();
    *s_last = atomicAdd(arrive, 1) == nt - 1;
    __threadfence();
  }
  __syncthreads();
  return *s_last;
}

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
  if (has_rows) t.colsum(m, D, red);
  if (!kFused) {  // tile sums only
    if (has_rows && static_cast<int>(threadIdx.x) < D) partial[(g * nt + tile) * D + threadIdx.x] = red[threadIdx.x];
    return;
  }

  int* arrive = reinterpret_cast<int*>(sync + 2) + g;
  int* ready = reinterpret_cast<int*>(sync + 2) + G + g;
  if (has_rows) {
    if (publish_tile_sum(red, partial + (g * nt + tile) * D, static_cast<int>(D), arrive, nt, &s_last)) {
      group_mean_call(partial, g, nt, static_cast<int>(D), S, red, mean);
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
  if (publish_tile_sum(red, k.partial + (g * k.nt + tile) * D, D, k.arrive + g, k.nt, &s_last))
    group_mean_call(k.partial, g, k.nt, D, k.S, red, k.mean);
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

// P: rows per thread, so that a CTA covers 128 rows (rpp = 256 / (D/16) rows per pass).
inline int passes_for(int64_t D) { return static_cast<int>(ceil_div(kRows, kRowThreads / (D / 16))); }

// Calls f(std::integral_constant<int, P>{}) with the rows per thread P that D needs.
template <typename F>
int with_passes(int64_t D, F&& f) {
  switch (passes_for(D)) {
    case 1: return f(std::integral_constant<int, 1>{});
    case 2: return f(std::integral_constant<int, 2>{});
    case 3: case 4: return f(std::integral_constant<int, 4>{});
    default: return f(std::integral_constant<int, 8>{});
  }
}

template <typename T>
int launch(const void* x, int64_t G, int64_t S, int64_t D, float* mean, bool compute_mean, int mean_block,
           int64_t Sp, uint8_t* packed, uint8_t* scales, cudaStream_t stream) {
  return with_passes(D, [&](auto p) {
    return launch_p<T, decltype(p)::value>(x, G, S, D, mean, compute_mean, mean_block, Sp, packed, scales, stream);
  });
}

template <typename T>
int launch_seq(const void* x, int64_t G, int64_t S, int64_t D, float* mean, float* partial, int* sync, int64_t Sp,
               uint8_t* packed, uint8_t* scales, bool force_two_pass, cudaStream_t stream) {
  return with_passes(D, [&](auto p) {
    return launch_seq_p<T, decltype(p)::value>(x, G, S, D, mean, partial, sync, Sp, packed, scales, force_two_pass,
                                               stream);
  });
}

template <typename T>
int launch_fused(const QBlocks& q, int64_t Gq, const KSums& k, int64_t Gk, int64_t D, cudaStream_t stream) {
  return with_passes(D, [&](auto p) { return launch_q_blocks_k_sums<T, decltype(p)::value>(q, Gq, k, Gk, D, stream); });
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
