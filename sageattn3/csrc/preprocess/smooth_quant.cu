// Smoothing + NVFP4 along D for Q and K: a CTA owns 128 rows of one group and holds them in
// registers: every thread loads its P row blocks (whole 16-channel blocks, all loads in flight
// at once), so the tile's column sums, the mean and the quantization all come from one read of
// the tile from DRAM.
//
// Means over 128-row blocks (Q with per_block_mean) are local to a CTA. A mean over the whole
// sequence (K; Q without per_block_mean) is a reduction across the group's CTAs: tile sums
// first, the quantization a few groups later from L2 (below).
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

  // kLastUse: streaming loads (evict first); else normal ones (the tile is read again soon).
  template <bool kLastUse = true>
  __device__ __forceinline__ void load(const RowMap& m, const T* xg, int D, int64_t row0, int64_t r1) {
#pragma unroll
    for (int p = 0; p < P; ++p) {
      const int r = m.rl + p * m.rpp;
      const int64_t row = row0 + r;
      if (m.active && r < kRows && row < r1) raw[p].template load<kLastUse>(xg + row * D);
      else raw[p].zero();
    }
  }

  // Tile `tile` (rows [128 tile, 128 tile + 128) of those < S) of group g of x (G, S, D).
  template <bool kLastUse = true>
  __device__ __forceinline__ void load_tile(const RowMap& m, const T* x, int64_t S, int D, int64_t g, int64_t tile) {
    const int64_t row0 = tile * kRows;
    load<kLastUse>(m, x + g * S * D + m.cb * 16, D, row0, std::min<int64_t>(S, row0 + kRows));
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

// Tile `tile` of group g, already in t: rows minus their mean (computed from the tile when
// compute_mean, else read from `mean`), NVFP4. red: kRowThreads * 16 floats of shared memory.
template <typename T, int P>
__device__ __forceinline__ void smooth_quant_loaded(const Tile<T, P>& t, int64_t S, int D, float* __restrict__ mean,
                                                    bool compute_mean, int mean_block, int64_t Sp, int64_t g,
                                                    int64_t tile, uint2* __restrict__ packed,
                                                    uint8_t* __restrict__ scales, float* red) {
  const RowMap m(D);
  const int64_t row0 = tile * kRows;
  const int64_t r1 = std::min<int64_t>(S, row0 + kRows);  // real rows of this tile: [row0, r1)
  const int64_t nm = mean_block ? ceil_div(S, kRows) : 1;
  const int64_t mi = mean_block ? tile : 0;
  const bool has_rows = row0 < S;
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
  if (m.active) t.quantize(m, red + m.cb * 16, g, row0, r1, Sp, packed, scales);
}

template <typename T, int P>
__global__ void __launch_bounds__(kRowThreads, (P <= 4 ? 3 : 1)) smooth_quant_kernel(const T* __restrict__ x, int64_t S, int D,
                                                                   float* __restrict__ mean, bool compute_mean,
                                                                   int mean_block, int64_t Sp, int64_t tiles,
                                                                   uint2* __restrict__ packed,
                                                                   uint8_t* __restrict__ scales) {
  __shared__ __align__(16) float red[kRowThreads * 16];
  const uint32_t nt = static_cast<uint32_t>(tiles);  // the grid (< 2^31 CTAs) bounds it: 32-bit division
  const int64_t g = blockIdx.x / nt, tile = blockIdx.x % nt;
  Tile<T, P> t;
  t.load_tile(RowMap(D), x, S, D, g, tile);
  smooth_quant_loaded<T, P>(t, S, D, mean, compute_mean, mean_block, Sp, g, tile, packed, scales, red);
}

// ---- one mean over the whole sequence -------------------------------------------------------
// The mean of group g is (sum over its real tiles, in tile order, of the tile column sums) / S:
// group_mean below, the same bits on every path.
//
// Streamed (one read from DRAM): persistent CTAs take tickets; a ticket names a work item of a
// fixed order in which group g's tile sums come `lag` rounds before its quantization (a round:
// one group's tile sums interleaved with an earlier group's tiles to quantize). A tile sum
// publishes the tile's column sums and arrives on the group's counter; the last to arrive
// reduces the mean and raises the group's flag. A quantization item loads its tile, waits for
// the flag, then quantizes. Its tile was read from DRAM by the sum item `lag` rounds earlier:
// the lag is chosen so that those rounds' tiles fit in 3/4 of the L2, where the second read
// finds most of them (ncu, H100, 24 x 32k x 128 bf16: K alone reads 239 MB from DRAM for its
// 201 MB; with Q's blocks mixed in, 509 MB for Q's and K's 403 MB). Deadlock-free on any
// grid: a waiting item only waits for sum items with earlier tickets, held by CTAs that run
// them first. Q's 128-row block items (local means, no waiting) are spread evenly among K's.
// Two reads (force_two_pass; the reference the streamed path is tested against): tile sums, a
// mean kernel, then smooth_quant_kernel.

__device__ __forceinline__ int ld_acquire(const int* p) {
  int v;
  asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void st_release(int* p, int v) {
  asm volatile("st.release.gpu.global.b32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

// The mean of group g from its nt tile sums, by all kRowThreads threads of a CTA (every path
// calls this, so all give the same bits): D/4 column quads x L = 256/(D/4) lanes; lane j sums
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

// group_mean from the streamed kernel (once per group, by one CTA): out of line, so that its
// registers do not count against the tile the kernel holds.
__device__ __noinline__ void group_mean_call(const float* partial, int64_t g, int64_t nt, int D, int64_t S,
                                             float* red, float* mean) {
  group_mean(partial, g, nt, D, S, red, mean);
}

// Two reads, first pass: the column sums of each real tile, partial (G, nt, D).
template <typename T, int P>
__global__ void __launch_bounds__(kRowThreads, (P <= 4 ? 3 : 1)) tile_sums_kernel(const T* __restrict__ x, int64_t S,
                                                                                   int D, int64_t nt,
                                                                                   float* __restrict__ partial) {
  __shared__ __align__(16) float red[kRowThreads * 16];
  const RowMap m(D);
  const uint32_t n = static_cast<uint32_t>(nt);
  const int64_t g = blockIdx.x / n, tile = blockIdx.x % n;
  Tile<T, P> t;
  t.load_tile(m, x, S, D, g, tile);
  t.colsum(m, D, red);
  if (static_cast<int>(threadIdx.x) < D) partial[(g * nt + tile) * D + threadIdx.x] = red[threadIdx.x];
}

__global__ void __launch_bounds__(kRowThreads) seq_mean_kernel(const float* __restrict__ partial, int64_t nt, int D,
                                                                int64_t S, float* __restrict__ mean) {
  __shared__ __align__(16) float red[kRowThreads * 4];
  group_mean(partial, blockIdx.x, nt, D, S, red, mean);
}

// Q's 128-row block items (as smooth_quant_rows with compute_mean).
struct QBlocks {
  const void* x;
  int64_t S, Sp;
  uint32_t tiles;  // ceil(Sp / 128) per group
  float* mean;
  uint2* packed;
  uint8_t* scales;
};

// K (or any tensor smoothed by its whole-sequence mean), streamed.
struct SeqK {
  const void* x;
  int64_t S, Sp;
  uint32_t G, nt, tiles, lag;  // nt = ceil(S / 128) tile sums, tiles = ceil(Sp / 128) to quantize
  float* partial;               // (G, nt, D)
  float* mean;                  // (G, D)
  int* sync;                    // [0] tickets, [2 + g] arrivals of group g, [2 + G + g] g's mean ready
  uint2* packed;
  uint8_t* scales;
};

struct KItem {
  uint32_t g, tile;
  bool sum;
};

// Work item i of the streamed order (lag in [1, G]): the tile sums of groups 0..lag-1; then
// rounds r = 0..G-lag-1, each the tile sums of group r + lag interleaved with the tiles of
// group r to quantize (padding tiles last); then the tiles of the last lag groups.
__device__ __forceinline__ KItem k_item(const SeqK& k, uint32_t i) {
  const uint32_t L = k.lag, nt = k.nt, tiles = k.tiles, R = nt + tiles;
  if (i < L * nt) return {i / nt, i % nt, true};
  i -= L * nt;
  const uint32_t steady = (k.G - L) * R;
  if (i < steady) {
    const uint32_t r = i / R, o = i % R;
    if (o < 2 * nt) return (o & 1u) ? KItem{r, o >> 1, false} : KItem{r + L, o >> 1, true};
    return {r, o - nt, false};
  }
  i -= steady;
  return {k.G - L + i / tiles, i % tiles, false};
}

// After colsum left the tile's column sums in red[0..D): store them as this tile's row of the
// partial sums and count the tile on *arrive. Every thread of the CTA gets whether it brought
// the group's last tile (the one to reduce the mean). s_last: a shared int.
__device__ __forceinline__ bool publish_tile_sum(const float* red, float* partial_row, int D, int* arrive, uint32_t nt,
                                                 int* s_last) {
  if (static_cast<int>(threadIdx.x) < D) partial_row[threadIdx.x] = red[threadIdx.x];
  __syncthreads();  // every partial of this CTA written; one fence after the barrier releases them all
  if (threadIdx.x == 0) {
    __threadfence();
    *s_last = atomicAdd(arrive, 1) == static_cast<int>(nt) - 1;
    __threadfence();
  }
  __syncthreads();
  return *s_last;
}

// The streamed launch's work items: nk = G * (nt + tiles) K items (k_item) and nq Q block items
// (nk + nq < 2^31), spread evenly so that Q's arithmetic and K's reads overlap: tickets come in
// runs of `period` = 1 + floor(larger / smaller), each led by one item of the smaller set
// (`k_leads`: K's) and filled with items of the larger one; after `smaller` runs, the rest of
// the larger set (32-bit arithmetic only).
struct Item {
  uint32_t kind;  // 0: Q block, 1: K tile sum, 2: K tile to quantize
  uint32_t g, tile;
};

__device__ __forceinline__ Item decode(const SeqK& k, const QBlocks& q, uint32_t nk, uint32_t nq, bool k_leads,
                                       uint32_t period, uint32_t t) {
  uint32_t ki = t;  // K item index, or Q's with is_q
  bool is_q = false;
  if (nq) {
    const uint32_t leads = k_leads ? nk : nq, run = t / period;
    const bool lead = run < leads && t % period == 0;
    ki = lead ? run : t - min(run + 1, leads);
    is_q = lead != k_leads;
  }
  if (is_q) return {0u, ki / q.tiles, ki % q.tiles};
  const KItem it = k_item(k, ki);
  return {it.sum ? 1u : 2u, it.g, it.tile};
}

template <typename T, int P>
__device__ __forceinline__ void load_item(Tile<T, P>& tl, const SeqK& k, const QBlocks& q, const Item& it, int D) {
  const RowMap m(D);
  const bool is_q = it.kind == 0;
  const T* x = static_cast<const T*>(is_q ? q.x : k.x);
  const int64_t S = is_q ? q.S : k.S;
  // K's tile sums leave their tile in L2 for its quantization; every other read is the last
  if (it.kind == 1) tl.template load_tile<false>(m, x, S, D, it.g, it.tile);
  else tl.load_tile(m, x, S, D, it.g, it.tile);
}

template <typename T, int P>
__device__ __forceinline__ void process_item(const Tile<T, P>& tl, const SeqK& k, const QBlocks& q, const Item& it,
                                             int D, float* red, int* s_last) {
  if (it.kind == 0) {
    smooth_quant_loaded<T, P>(tl, q.S, D, q.mean, true, kRows, q.Sp, it.g, it.tile, q.packed, q.scales, red);
    return;
  }
  const RowMap m(D);
  const int64_t g = it.g, row0 = static_cast<int64_t>(it.tile) * kRows;
  const int64_t r1 = std::min<int64_t>(k.S, row0 + kRows);
  if (it.kind == 1) {
    tl.colsum(m, D, red);
    if (publish_tile_sum(red, k.partial + (g * k.nt + it.tile) * D, D, k.sync + 2 + g, k.nt, s_last)) {
      group_mean_call(k.partial, g, k.nt, D, k.S, red, k.mean);
      __syncthreads();
      if (threadIdx.x == 0) {
        __threadfence();
        st_release(k.sync + 2 + k.G + g, 1);
      }
    }
    return;
  }
  if (row0 < k.S) {  // padding tiles need no mean
    if (threadIdx.x == 0) {
      while (ld_acquire(k.sync + 2 + k.G + g) == 0) __nanosleep(200);
    }
    __syncthreads();
    if (static_cast<int>(threadIdx.x) < D) red[threadIdx.x] = __ldcg(k.mean + g * D + threadIdx.x);
    __syncthreads();
  }
  if (m.active) tl.quantize(m, red + m.cb * 16, g, row0, r1, k.Sp, k.packed, k.scales);
}

// CTAs per SM the streamed kernel is compiled for with 16-bit inputs and P <= 4 (fp32: 2), the
// largest count at which it does not spill: 4 (64 registers) with the software E2M1 (on an H100
// 32 warps hid more latency than 24); 2 with the hardware one (sm_120a/121a spill at 3 and 80
// registers; unmeasured there).
#if defined(__CUDA_ARCH__) && !SAGEATTN3_HW_E2M1
constexpr int kStreamCtas16 = 4;
#else
constexpr int kStreamCtas16 = 2;
#endif

// Persistent CTAs (as many as are resident) take tickets until all nk + nq items are done; the
// next ticket is fetched while the current item runs. A CTA may hold a fetched ticket while it
// waits, but only a later one than the one it waits on: the earliest waiting item depends only
// on items that run.

template <typename T, int P>
__global__ void __launch_bounds__(kRowThreads, (P > 4 ? 1 : sizeof(T) == 2 ? kStreamCtas16 : 2)) seq_stream_kernel(const SeqK k, const QBlocks q,
                                                                                    uint32_t nk, uint32_t nq,
                                                                                    bool k_leads, uint32_t period,
                                                                                    int D) {
  __shared__ __align__(16) float red[kRowThreads * 16];
  __shared__ uint32_t s_ticket[2];
  __shared__ int s_last;
  unsigned* const tickets = reinterpret_cast<unsigned*>(k.sync);
  if (threadIdx.x == 0) s_ticket[0] = atomicAdd(tickets, 1u);
  __syncthreads();
  for (int b = 0;; b ^= 1) {
    const uint32_t t = s_ticket[b];
    if (t >= nk + nq) break;
    uint32_t next = 0;
    if (threadIdx.x == 0) next = atomicAdd(tickets, 1u);
    const Item it = decode(k, q, nk, nq, k_leads, period, t);
    Tile<T, P> tl;
    load_item(tl, k, q, it, D);
    process_item<T, P>(tl, k, q, it, D, red, &s_last);
    if (threadIdx.x == 0) s_ticket[b ^ 1] = next;
    __syncthreads();
  }
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

// The lag (in rounds) between a group's tile sums and its quantization: long enough that the
// last sum's mean is ready when the first quantization item starts (about two grids' worth of
// resident CTAs in between), short enough that the lag + 1 groups in flight fit in 3/4 of the L2.
inline uint32_t auto_lag(const SeqK& k, int64_t D, int64_t elt_bytes, int64_t resident) {
  int dev = 0, l2 = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, dev) != cudaSuccess) {
    cudaGetLastError();
    l2 = 0;
  }
  const int64_t by_items = 1 + ceil_div(2 * resident, static_cast<int64_t>(k.nt) + k.tiles);
  const int64_t by_l2 = l2 * 3 / 4 / (k.S * D * elt_bytes) - 1;
  return static_cast<uint32_t>(std::max<int64_t>(1, std::min<int64_t>({by_items, by_l2, k.G})));
}

template <typename T, int P>
int launch_stream_p(SeqK k, const QBlocks& q, int64_t Gq, int64_t D, int lag, cudaStream_t stream) {
  const int64_t nk = static_cast<int64_t>(k.G) * (k.nt + k.tiles), nq = Gq * q.tiles;
  if (nk + nq > 0x7FFFFFFF) return cudaErrorInvalidValue;
  auto* kernel = seq_stream_kernel<T, P>;
  int per_sm = 0;
  cudaError_t e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kRowThreads, 0);
  if (e != cudaSuccess) return e;
  const int64_t resident = static_cast<int64_t>(std::max(per_sm, 1)) * sm_count();
  k.lag = lag > 0 ? std::min<uint32_t>(static_cast<uint32_t>(lag), k.G)
                  : auto_lag(k, D, static_cast<int64_t>(sizeof(T)), resident);
  e = cudaMemsetAsync(k.sync, 0, sizeof(int) * (2 + 2 * static_cast<size_t>(k.G)), stream);
  if (e != cudaSuccess) return e;
  kernel<<<static_cast<unsigned>(std::min(nk + nq, resident)), kRowThreads, 0, stream>>>(
      k, q, static_cast<uint32_t>(nk), static_cast<uint32_t>(nq), nk <= nq,
      static_cast<uint32_t>(nq ? 1 + std::max(nk, nq) / std::min(nk, nq) : 1), static_cast<int>(D));
  return cudaGetLastError();
}

template <typename T, int P>
int launch_two_pass_p(const SeqK& k, int64_t D, cudaStream_t stream) {
  const int64_t nt = k.nt;
  if (static_cast<int64_t>(k.G) * k.tiles > 0x7FFFFFFF) return cudaErrorInvalidValue;  // before any launch
  tile_sums_kernel<T, P><<<static_cast<unsigned>(k.G * nt), kRowThreads, 0, stream>>>(
      static_cast<const T*>(k.x), k.S, static_cast<int>(D), nt, k.partial);
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return e;
  seq_mean_kernel<<<k.G, kRowThreads, 0, stream>>>(k.partial, nt, static_cast<int>(D), k.S, k.mean);
  if ((e = cudaGetLastError()) != cudaSuccess) return e;
  return launch_p<T, P>(k.x, k.G, k.S, D, k.mean, false, 0, k.Sp, reinterpret_cast<uint8_t*>(k.packed), k.scales,
                        stream);
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
int launch_seq(const SeqK& k, const QBlocks& q, int64_t Gq, int64_t D, int lag, bool two_pass, cudaStream_t stream) {
  return with_passes(D, [&](auto p) {
    constexpr int P = decltype(p)::value;
    return two_pass ? launch_two_pass_p<T, P>(k, D, stream) : launch_stream_p<T, P>(k, q, Gq, D, lag, stream);
  });
}

// Calls f(T{}) with the storage type of dtype.
template <typename F>
int with_dtype(DType dtype, F&& f) {
  switch (dtype) {
    case DType::kFloat16: return f(f16_t{});
    case DType::kBFloat16: return f(bf16_t{});
    case DType::kFloat32: return f(float{});
  }
  return cudaErrorInvalidValue;
}

SeqK seq_k(const void* x, int64_t G, int64_t S, int64_t Sp, float* mean, float* partial, int* sync, uint8_t* packed,
           uint8_t* scales) {
  return SeqK{x, S, Sp, static_cast<uint32_t>(G), static_cast<uint32_t>(ceil_div(S, kRows)),
              static_cast<uint32_t>(ceil_div(Sp, kRows)), 1, partial, mean, sync,
              reinterpret_cast<uint2*>(packed), scales};
}

}  // namespace

int smooth_quant_rows(const void* x, DType dtype, int64_t G, int64_t S, int64_t D, float* mean, bool compute_mean,
                      int mean_block, int64_t Sp, uint8_t* packed, uint8_t* scales, cudaStream_t stream) {
  if (D % 16 || D <= 0 || D > kMaxD || Sp < S || (mean_block != 0 && mean_block != kRows) ||
      (compute_mean && mean_block != kRows))
    return cudaErrorInvalidValue;
  return with_dtype(dtype, [&](auto t) {
    return launch<decltype(t)>(x, G, S, D, mean, compute_mean, mean_block, Sp, packed, scales, stream);
  });
}

int smooth_quant_seq(const void* x, DType dtype, int64_t G, int64_t S, int64_t D, float* mean, float* partial,
                     int* sync, int64_t Sp, uint8_t* packed, uint8_t* scales, bool force_two_pass,
                     cudaStream_t stream) {
  if (D % 16 || D <= 0 || D > kMaxD || Sp < S || S < 1) return cudaErrorInvalidValue;
  if (G == 0) return cudaSuccess;
  if (G > 0x7FFFFFFF) return cudaErrorInvalidValue;
  const SeqK k = seq_k(x, G, S, Sp, mean, partial, sync, packed, scales);
  return with_dtype(dtype, [&](auto t) {
    return launch_seq<decltype(t)>(k, QBlocks{}, 0, D, 0, force_two_pass, stream);
  });
}

int smooth_quant_qk(const void* q, const void* k, DType dtype, int64_t Gq, int64_t Sq, int64_t Gk, int64_t Sk,
                    int64_t D, float* mean_q, int64_t Sqp, uint8_t* q_packed, uint8_t* q_scales, float* mean_k,
                    float* partial_k, int* sync, int64_t Skp, uint8_t* k_packed, uint8_t* k_scales, int lag,
                    cudaStream_t stream) {
  if (D % 16 || D <= 0 || D > kMaxD || Sqp < Sq || Skp < Sk || Sk < 1 || Gk < 1 || Gk > 0x7FFFFFFF || Gq < 0 ||
      lag < 0)
    return cudaErrorInvalidValue;
  const QBlocks qa{q, Sq, Sqp, static_cast<uint32_t>(ceil_div(Sqp, kRows)), mean_q,
                   reinterpret_cast<uint2*>(q_packed), q_scales};
  const SeqK ka = seq_k(k, Gk, Sk, Skp, mean_k, partial_k, sync, k_packed, k_scales);
  return with_dtype(dtype, [&](auto t) { return launch_seq<decltype(t)>(ka, qa, Gq, D, lag, false, stream); });
}

}  // namespace sageattn3
