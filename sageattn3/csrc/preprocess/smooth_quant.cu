// Smoothing + NVFP4 along D for Q and K: a CTA owns 128 rows of one group and holds them in
// registers: every thread loads its P row blocks (whole 16-channel blocks, all loads in flight
// at once), so the tile's column sums, the mean and the quantization all come from one read of
// the tile from DRAM.
//
// Means over 128-row blocks (Q with per_block_mean) are local to a CTA. A mean over the whole
// sequence (K; Q without per_block_mean) is a reduction across the group's CTAs: tile sums
// first, the quantization a few groups later from L2 (below).
//
// Optionally (D 64/128) the rows are rotated first (rotation.cuh): means are summed on the
// unrotated rows and then rotated (the rotation is linear), every row is rotated in registers
// before the mean is subtracted. K's quantization can also emit the per-key correction of the
// attention, ds_key[q head][key] = qbar[q head] . rotate(K[key]) (key_dots), where qbar is each q
// head's (rotated) mean over the whole sequence: given, or computed in the same launch from Q's
// 128-row block sums (smooth_quant_qk). K's own mean is left out of it: it would add the same
// qbar . mean_k to every key of a query row, which the softmax ignores. It is computed from the
// unrotated rows, as transpose(qbar) . K[key] (rotation.cuh), so it needs no second rotation.
#include <type_traits>

#include "common/launch.cuh"
#include "common/nvfp4.cuh"
#include "preprocess/rotation.cuh"
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
  // scales), x rotated first when `rotate` (every lane of the warp takes part then: the rows of a
  // warp go through the same steps, the stores are conditional); mu: this thread's 16 means in
  // shared memory, 16-byte aligned (read per row, as four 16-byte loads: fewer registers, more
  // CTAs per SM). cs (null: none): this thread's 16 channel balance factors in shared memory
  // (16-byte aligned): the row is multiplied by them (powers of two: exact) before mu (then the
  // balanced mean) is subtracted.
  __device__ __forceinline__ void quantize(const RowMap& m, const float* mu, int64_t g, int64_t row0, int64_t r1,
                                           int64_t Sp, uint2* __restrict__ packed, uint8_t* __restrict__ scales,
                                           bool rotate, const float* cs = nullptr) const {
    const int bpr = m.bpr;
#pragma unroll
    for (int p = 0; p < P; ++p) {
      const int r = m.rl + p * m.rpp;
      const int64_t row = row0 + r;
      const bool stored = r < kRows && row < Sp;
      if (!rotate && !stored) continue;  // no shuffle below: lanes may part here
      float v[16];
      raw[p].to_float(v);
      // D/16 = 2P where the rotation exists (D 64 and 128)
      if constexpr (P == 2 || P == 4) {
        if (rotate) rotate_block<2 * P>(v, m.cb);
      }
      if (!stored) continue;
      uint32_t sb = 0;
      uint2 w = make_uint2(0u, 0u);
      if (row < r1) {
        if (cs != nullptr) {
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            const float4 c = reinterpret_cast<const float4*>(cs)[i];
            v[4 * i] = __fmul_rn(v[4 * i], c.x);
            v[4 * i + 1] = __fmul_rn(v[4 * i + 1], c.y);
            v[4 * i + 2] = __fmul_rn(v[4 * i + 2], c.z);
            v[4 * i + 3] = __fmul_rn(v[4 * i + 3], c.w);
          }
        }
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

// The per-key correction of a K tile's rows (D 64/128: D/16 = 2P lanes per row): for q heads
// h < nh, out[h * Sp + row] = u_s[h] . x[row] over the unrotated row (fp32; u_s: nh x D floats in
// shared memory). The rows are read again (from L1/L2: the tile was just quantized), one at a
// time, so that the tile's registers are free by then. Order (fixed): per thread a 16-term fma
// chain over its block from 0, then the block sums of the row added by an xor butterfly over its
// lanes (1, 2, 4). Rows S..Sp-1 (padding) get 0. Every lane of the warp takes part.
template <typename T, int P>
__device__ __forceinline__ void key_dots(const RowMap& m, const T* x, int D, int64_t g, int64_t S, const float* u_s,
                                         int nh, float* out, int64_t row0, int64_t Sp) {
  if constexpr (P == 2 || P == 4) {
    const int64_t r1 = std::min<int64_t>(S, row0 + kRows);
#pragma unroll 1
    for (int p = 0; p < P; ++p) {
      const int64_t row = row0 + m.rl + p * m.rpp;
      Raw16<T> raw;
      if (row < r1) raw.template load<false>(x + (g * S + row) * D + m.cb * 16);
      else raw.zero();
      float v[16];
      raw.to_float(v);
      float* o = out + row;
      for (int h = 0; h < nh; ++h, o += Sp) {
        const float4* uv = reinterpret_cast<const float4*>(u_s + h * D + m.cb * 16);
        float acc = 0.f;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const float4 u = uv[i];
          acc = fmaf(u.x, v[4 * i], acc);
          acc = fmaf(u.y, v[4 * i + 1], acc);
          acc = fmaf(u.z, v[4 * i + 2], acc);
          acc = fmaf(u.w, v[4 * i + 3], acc);
        }
#pragma unroll
        for (int s = 1; s < 2 * P; s <<= 1) acc = __fadd_rn(acc, __shfl_xor_sync(0xffffffffu, acc, s));
        if (m.cb == 0 && row < Sp) *o = row < r1 ? acc : 0.f;
      }
    }
  }
}

// The mean of a tile from its column sums in red[0..D) (count real rows): left in red[0..D),
// rotated when asked (or times the balance factors cs[0..D) when given: never both), and written
// to mean_out. Every thread calls it; ends with a barrier.
__device__ __forceinline__ void tile_mean(float* red, int D, int64_t count, bool rotate, float* mean_out,
                                          const float* cs = nullptr) {
  if (static_cast<int>(threadIdx.x) < D) {
    float mu = red[threadIdx.x] / static_cast<float>(count);
    if (cs != nullptr) mu = __fmul_rn(mu, cs[threadIdx.x]);
    red[threadIdx.x] = mu;
    if (!rotate) mean_out[threadIdx.x] = mu;
  }
  __syncthreads();
  if (rotate) {
    if (threadIdx.x < 32) rotate_vector(red, D, mean_out);
    __syncthreads();
  }
}

// q heads per K group whose qbar rows fit in shared memory next to the mean (red[D..)).
__host__ __device__ constexpr int max_correction_heads(int D) { return (kRowThreads * 16 - D) / D; }

// Quantizes a K tile whose (rotated) mean is in red[0..D) and, when qbar is given, writes the
// per-key correction of q groups g*rep .. g*rep + rep - 1 (rep <= max_correction_heads(D)) into
// ds_key (Gq, Sp): their qbar rows are staged in red[D..), turned into u = transpose(qbar) when
// rotating (one warp per head), then dotted with the unrotated rows.
template <typename T, int P>
__device__ __forceinline__ void quantize_k_tile(const Tile<T, P>& t, const RowMap& m, const T* x, int64_t S, int D,
                                                float* red, int64_t g, int64_t row0, int64_t Sp,
                                                uint2* __restrict__ packed, uint8_t* __restrict__ scales, bool rotate,
                                                const float* qbar, int rep, float* ds_key, const float* cs = nullptr) {
  if (m.active) {
    t.quantize(m, red + m.cb * 16, g, row0, std::min<int64_t>(S, row0 + kRows), Sp, packed, scales, rotate,
               cs ? cs + m.cb * 16 : nullptr);
  }
  if (qbar == nullptr) return;
  float* u_s = red + D;
  const float* src = qbar + g * rep * D;
  // with the balance, qbar is stored balanced (qbar / c); times K's factor c it is qbar again (exact)
  for (int i = threadIdx.x; i < rep * D; i += kRowThreads) {
    const float u = __ldcg(src + i);
    u_s[i] = cs ? __fmul_rn(u, cs[i % D]) : u;
  }
  __syncthreads();
  if (rotate) {
    for (int h = threadIdx.x / 32; h < rep; h += kRowThreads / 32) rotate_vector(u_s + h * D, D, nullptr, true);
    __syncthreads();
  }
  key_dots<T, P>(m, x, D, g, S, u_s, rep, ds_key + g * rep * Sp, row0, Sp);
}

// Tile `tile` of group g, already in t: rows minus their mean (computed from the tile when
// compute_mean, else read from `mean`), NVFP4. red: kRowThreads * 16 floats of shared memory.
template <typename T, int P>
__device__ __forceinline__ void smooth_quant_loaded(const Tile<T, P>& t, int64_t S, int D, float* __restrict__ mean,
                                                    bool compute_mean, int mean_block, int64_t Sp, int64_t g,
                                                    int64_t tile, uint2* __restrict__ packed,
                                                    uint8_t* __restrict__ scales, float* red, bool rotate) {
  const RowMap m(D);
  const int64_t row0 = tile * kRows;
  const int64_t r1 = std::min<int64_t>(S, row0 + kRows);  // real rows of this tile: [row0, r1)
  const int64_t nm = mean_block ? ceil_div(S, kRows) : 1;
  const int64_t mi = mean_block ? tile : 0;
  const bool has_rows = row0 < S;
  if (compute_mean) {
    t.colsum(m, D, red);
    if (has_rows) tile_mean(red, D, r1 - row0, rotate, mean + (g * nm + mi) * D);
  } else {
    if (has_rows && static_cast<int>(threadIdx.x) < D) red[threadIdx.x] = mean[(g * nm + mi) * D + threadIdx.x];
    __syncthreads();
  }
  if (m.active) t.quantize(m, red + m.cb * 16, g, row0, r1, Sp, packed, scales, rotate);
}

// One 128-row tile per CTA. With qbar (K, mean given, mean_block 0): also the per-key correction.
// kRotate is a template parameter (here and in the streamed kernel) so that the default,
// unrotated instantiation carries none of the rotation's code and registers.
template <typename T, int P, bool kRotate>
__global__ void __launch_bounds__(kRowThreads, (P <= 4 ? 3 : 1)) smooth_quant_kernel(const T* __restrict__ x, int64_t S, int D,
                                                                   float* __restrict__ mean, bool compute_mean,
                                                                   int mean_block, int64_t Sp, int64_t tiles,
                                                                   uint2* __restrict__ packed,
                                                                   uint8_t* __restrict__ scales,
                                                                   const float* __restrict__ qbar, int rep,
                                                                   float* __restrict__ ds_key) {
  constexpr bool rotate = kRotate;
  __shared__ __align__(16) float red[kRowThreads * 16];
  const uint32_t nt = static_cast<uint32_t>(tiles);  // the grid (< 2^31 CTAs) bounds it: 32-bit division
  const int64_t g = blockIdx.x / nt, tile = blockIdx.x % nt;
  Tile<T, P> t;
  if (qbar == nullptr) t.load_tile(RowMap(D), x, S, D, g, tile);
  else t.template load_tile<false>(RowMap(D), x, S, D, g, tile);  // read again by key_dots
  if (qbar == nullptr) {
    smooth_quant_loaded<T, P>(t, S, D, mean, compute_mean, mean_block, Sp, g, tile, packed, scales, red, rotate);
    return;
  }
  const int64_t row0 = tile * kRows;
  if (row0 < S && static_cast<int>(threadIdx.x) < D) red[threadIdx.x] = mean[g * D + threadIdx.x];
  __syncthreads();
  quantize_k_tile(t, RowMap(D), x, S, D, red, g, row0, Sp, packed, scales, rotate, qbar, rep, ds_key);
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
//
// Measured on an H100 (24 heads x 32k x D 128 bf16, one run, back to back), and not kept: V's
// tiles as a third kind of item of this launch (quant_cols' code, same bits) made Q + K + V
// 0.50 ms against 0.47 ms for this launch and quant_cols one after the other (with the software
// E2M1 the work is about as much instruction-bound as memory-bound, so there is little idle
// bandwidth to fill); the per-key dots from the tile's registers during the quantization spilled
// at the 64-register budget (0.378 vs 0.372 ms) and at 3 CTAs per SM did not spill but lost more
// to occupancy (0.398 ms); key_dots loading a thread's P rows at once was slower (0.382 vs
// 0.362 ms). A longer lag than auto_lag's (5 to 8 groups instead of 3) was about 3% faster there
// (auto_lag unchanged: one shape on one GPU, and the L2 sizes of sm_120 parts differ).

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
// then the lanes are combined in order and divided by S (and the mean rotated when `rotate`).
// On return (after a barrier of the caller) red[0..D) holds the mean (red: at least
// kRowThreads*4 floats), and mean[g*D..] too when `mean` is not null.
__device__ __forceinline__ void group_mean(const float* partial, int64_t g, int64_t nt, int D, int64_t S,
                                           float* red, float* mean, bool rotate, const float* cs = nullptr) {
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
    if (cs != nullptr) mu = __fmul_rn(mu, cs[threadIdx.x]);  // balanced (never with the rotation)
  }
  __syncthreads();
  if (static_cast<int>(threadIdx.x) < D) {
    red[threadIdx.x] = mu;
    if (mean && !rotate) mean[g * D + threadIdx.x] = mu;
  }
  if (rotate) {
    __syncthreads();
    if (threadIdx.x < 32) rotate_vector(red, D, mean ? mean + g * D : nullptr);
  }
}

// group_mean from the streamed kernel (once per group, by one CTA): out of line, so that its
// registers do not count against the tile the kernel holds.
__device__ __noinline__ void group_mean_call(const float* partial, int64_t g, int64_t nt, int D, int64_t S,
                                             float* red, float* mean, bool rotate, const float* cs) {
  group_mean(partial, g, nt, D, S, red, mean, rotate, cs);
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
                                                                int64_t S, float* __restrict__ mean, bool rotate) {
  __shared__ __align__(16) float red[kRowThreads * 4];
  group_mean(partial, blockIdx.x, nt, D, S, red, mean, rotate);
}

// Q's 128-row block items (as smooth_quant_rows with compute_mean). With `partial`, each real
// tile also publishes its column sums; the last of a q group reduces the group's mean over the
// whole sequence (as K's, group_mean), rotated, into qbar, and counts the group on ready[group /
// rep] (the K group whose correction needs it).
struct QBlocks {
  const void* x;
  int64_t S, Sp;
  uint32_t tiles;  // ceil(Sp / 128) per group
  uint32_t nt;     // ceil(S / 128): the real tiles
  float* mean;
  uint2* packed;
  uint8_t* scales;
  float* partial;  // (Gq, nt, D) column sums, or null (no global mean)
  int* arrive;     // Gq tile counters
  int* ready;      // per K group: its q groups whose qbar is written
  float* qbar;     // (Gq, D)
  uint32_t rep;    // q groups per K group
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
  // The per-key correction (qbar null: none): ds_key (G*rep, Sp) from qbar (G*rep, D); q_ready:
  // per group, how many of its q groups' qbar are written (null: qbar is given, complete).
  const float* qbar;
  float* ds_key;
  uint32_t rep;
  int* q_ready;
  // (G, D) channel balance exponents (balance_kernel, launched before), or null: Q items use 2^-e
  // of their K group, K items 2^e
  const float* bal;
};

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

// ---- the channel balance exponents (reference.balance_exponents) ----------------------------
// One CTA per (q group, sampled block): the block's mean over its real rows, then the sums of
// squares of its rows minus that mean, published as a row of `part`; the last CTA of a K group
// sums its rep * ns rows in order, and from ms_d = sum / rows: a_d = sqrt(ms_d), m = (pairwise
// tree sum of a_d) / D, e_d from ms_d against 4 m^2, 64 m^2, m^2 / 4, m^2 / 64 (0 unless m^2 is a
// positive finite number). exps (Gk, D) fp32. arrive: Gk counters, zeroed before the launch.
constexpr uint32_t kBalanceSamples = 8;

__host__ __device__ inline uint32_t balance_samples(uint32_t nt) { return nt < kBalanceSamples ? nt : kBalanceSamples; }

template <typename T, int P>
__global__ void __launch_bounds__(kRowThreads) balance_kernel(const T* __restrict__ x, int64_t S, int D, uint32_t nt,
                                                               uint32_t rep, float* __restrict__ part,
                                                               int* __restrict__ arrive, float* __restrict__ exps) {
  __shared__ __align__(16) float red[kRowThreads * 16];
  __shared__ float wsum[4];
  __shared__ int s_last;
  const RowMap m(D);
  const uint32_t ns = balance_samples(nt);
  const uint32_t gq = blockIdx.x / ns, i = blockIdx.x % ns;
  const int64_t tile = (static_cast<int64_t>(i) * nt) / ns;
  const int64_t row0 = tile * kRows, r1 = std::min<int64_t>(S, row0 + kRows);
  Tile<T, P> t;
  t.load_tile(m, x, S, D, gq, tile);
  t.colsum(m, D, red);
  if (static_cast<int>(threadIdx.x) < D) red[threadIdx.x] = red[threadIdx.x] / static_cast<float>(r1 - row0);
  __syncthreads();
  float mu[16], acc[16];
#pragma unroll
  for (int j = 0; j < 16; ++j) {
    mu[j] = m.active ? red[m.cb * 16 + j] : 0.f;
    acc[j] = 0.f;
  }
  __syncthreads();  // red is reused by reduce_columns
#pragma unroll
  for (int p = 0; p < P; ++p) {
    const int r = m.rl + p * m.rpp;
    if (m.active && r < kRows && row0 + r < r1) {
      float v[16];
      t.raw[p].to_float(v);
#pragma unroll
      for (int j = 0; j < 16; ++j) {
        const float d = __fsub_rn(v[j], mu[j]);
        acc[j] = fmaf(d, d, acc[j]);
      }
    }
  }
  reduce_columns(m, D, acc, red);
  const uint32_t g = gq / rep;
  if (!publish_tile_sum(red, part + static_cast<int64_t>(blockIdx.x) * D, D, arrive + g, rep * ns, &s_last)) return;
  int64_t rows = 0;
  for (uint32_t j = 0; j < ns; ++j) {
    const int64_t t0 = (static_cast<int64_t>(j) * nt) / ns * kRows;
    rows += std::min<int64_t>(S, t0 + kRows) - t0;
  }
  float ms = 0.f, a = 0.f;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  if (static_cast<int>(threadIdx.x) < D) {
    const float* src = part + static_cast<int64_t>(g) * rep * ns * D + threadIdx.x;
    float sum = 0.f;
    for (uint32_t j = 0; j < rep * ns; ++j) sum += __ldcg(src + static_cast<int64_t>(j) * D);
    ms = sum / static_cast<float>(rows * rep);
    a = sqrtf(ms);
#pragma unroll
    for (int off = 1; off < 32; off <<= 1) a = __fadd_rn(a, __shfl_xor_sync(0xffffffffu, a, off));
    if (lane == 0) wsum[warp] = a;
  }
  __syncthreads();
  if (static_cast<int>(threadIdx.x) < D) {
    const float total = D == 128 ? __fadd_rn(__fadd_rn(wsum[0], wsum[1]), __fadd_rn(wsum[2], wsum[3]))
                                 : __fadd_rn(wsum[0], wsum[1]);
    const float mm = total / static_cast<float>(D);
    const float m2 = __fmul_rn(mm, mm);
    float e = 0.f;
    if (m2 > 0.f && m2 <= 3.4028235e38f) {
      e = static_cast<float>((ms >= __fmul_rn(4.f, m2)) + (ms >= __fmul_rn(64.f, m2)) - (ms < m2 / 4.f) -
                             (ms < m2 / 64.f));
    }
    exps[static_cast<int64_t>(g) * D + threadIdx.x] = e;
  }
}

// The streamed launch's work items, in rounds (lag L in [1, G]; nq_g = Q block items per K
// group, rep * q.tiles, 0 without Q):
//   round r < G:  the tile sums of K group r and the Q blocks of its q groups;
//   round r >= L: the tiles of K group r - L to quantize (interleaved with the sums, padding
//                 tiles last).
// So everything a quantization item waits for (its group's mean, its q groups' qbar) has an
// earlier ticket. Within a round, Q's and K's items are spread evenly so that Q's arithmetic and
// K's reads overlap: runs of `period` = 1 + floor(larger / smaller) items, each led by one item
// of the smaller set, then the rest of the larger one (32-bit arithmetic only; nk + nq < 2^31).
struct Item {
  uint32_t kind;  // 0: Q block, 1: K tile sum, 2: K tile to quantize
  uint32_t g, tile;
};

__device__ __forceinline__ Item decode(const SeqK& k, const QBlocks& q, uint32_t nq_g, uint32_t t) {
  const uint32_t L = k.lag, G = k.G, nt = k.nt, tiles = k.tiles;
  const uint32_t first = nt + nq_g, steady = nt + tiles + nq_g;
  uint32_t r, o;  // round, position in it
  if (t < L * first) {
    r = t / first;
    o = t % first;
  } else if ((t -= L * first) < (G - L) * steady) {
    r = L + t / steady;
    o = t % steady;
  } else {
    t -= (G - L) * steady;
    r = G + t / tiles;
    o = t % tiles;
  }
  const uint32_t nk = (r < G ? nt : 0u) + (r >= L ? tiles : 0u), nq = r < G ? nq_g : 0u;
  uint32_t ki = o;  // K item index in the round, or Q's with is_q
  bool is_q = nk == 0;
  if (nq && nk) {
    const bool k_leads = nk <= nq;
    const uint32_t leads = k_leads ? nk : nq, period = 1 + (k_leads ? nq / nk : nk / nq), run = o / period;
    const bool lead = run < leads && o % period == 0;
    ki = lead ? run : o - min(run + 1, leads);
    is_q = lead != k_leads;
  }
  if (is_q) return {0u, r * q.rep + ki / q.tiles, ki % q.tiles};
  if (r < L) return {1u, r, ki};
  if (r >= G) return {2u, r - L, ki};
  if (ki < 2 * nt) return (ki & 1u) ? Item{2u, r - L, ki >> 1} : Item{1u, r, ki >> 1};
  return {2u, r - L, ki - nt};
}

template <typename T, int P>
__device__ __forceinline__ void load_item(Tile<T, P>& tl, const SeqK& k, const QBlocks& q, const Item& it, int D) {
  const RowMap m(D);
  const bool is_q = it.kind == 0;
  const T* x = static_cast<const T*>(is_q ? q.x : k.x);
  const int64_t S = is_q ? q.S : k.S;
  // K's tile sums leave their tile in L2 for its quantization, and a quantization with the
  // per-key correction for key_dots' second read; every other read is the last
  if (it.kind == 1 || (it.kind == 2 && k.qbar != nullptr)) tl.template load_tile<false>(m, x, S, D, it.g, it.tile);
  else tl.load_tile(m, x, S, D, it.g, it.tile);
}

__device__ __forceinline__ void wait_at_least(const int* flag, int n) {
  while (ld_acquire(flag) < n) __nanosleep(200);
}

// 2^e (Q: 2^-e) for a balance exponent e in {-2..2}, exactly.
__device__ __forceinline__ float balance_factor(float e, bool is_q) {
  const int x = static_cast<int>(e);
  return __int_as_float((127 + (is_q ? -x : x)) << 23);
}

template <typename T, int P, bool kBalance>
__device__ __forceinline__ void process_item(const Tile<T, P>& tl, const SeqK& k, const QBlocks& q, const Item& it,
                                             int D, float* red, int* s_last, bool rotate, float* cs_s) {
  const RowMap m(D);
  const int64_t g = it.g, row0 = static_cast<int64_t>(it.tile) * kRows;
  // the balance factors of this item's group into cs_s[0..D) (Q: 2^-e, K: 2^e)
  const float* cs = nullptr;
  if constexpr (kBalance) {
    const bool is_q = it.kind == 0;
    const int64_t kg = is_q ? g / q.rep : g;
    if (static_cast<int>(threadIdx.x) < D) cs_s[threadIdx.x] = balance_factor(__ldg(k.bal + kg * D + threadIdx.x), is_q);
    __syncthreads();
    cs = cs_s;
  }
  if (it.kind == 0) {
    const int64_t r1 = std::min<int64_t>(q.S, row0 + kRows);
    const bool has_rows = row0 < q.S;
    tl.colsum(m, D, red);
    bool last = false;
    if (q.partial && has_rows) last = publish_tile_sum(red, q.partial + (g * q.nt + it.tile) * D, D, q.arrive + g, q.nt, s_last);
    if (has_rows) tile_mean(red, D, r1 - row0, rotate, q.mean + (g * q.nt + it.tile) * D, cs);
    if (m.active) tl.quantize(m, red + m.cb * 16, g, row0, r1, q.Sp, q.packed, q.scales, rotate, cs ? cs + m.cb * 16 : nullptr);
    if (last) {
      group_mean_call(q.partial, g, q.nt, D, q.S, red, q.qbar, rotate, cs);
      __syncthreads();
      if (threadIdx.x == 0) {
        __threadfence();
        atomicAdd(q.ready + g / q.rep, 1);
      }
    }
    return;
  }
  const int64_t r1 = std::min<int64_t>(k.S, row0 + kRows);
  if (it.kind == 1) {
    tl.colsum(m, D, red);
    if (publish_tile_sum(red, k.partial + (g * k.nt + it.tile) * D, D, k.sync + 2 + g, k.nt, s_last)) {
      group_mean_call(k.partial, g, k.nt, D, k.S, red, k.mean, rotate, cs);
      __syncthreads();
      if (threadIdx.x == 0) {
        __threadfence();
        st_release(k.sync + 2 + k.G + g, 1);
      }
    }
    return;
  }
  if (row0 < k.S) {  // padding tiles need no mean (and write a zero correction)
    if (threadIdx.x == 0) {
      wait_at_least(k.sync + 2 + k.G + g, 1);
      if (k.q_ready) wait_at_least(k.q_ready + g, static_cast<int>(k.rep));
    }
    __syncthreads();
    if (static_cast<int>(threadIdx.x) < D) red[threadIdx.x] = __ldcg(k.mean + g * D + threadIdx.x);
    __syncthreads();
  }
  quantize_k_tile(tl, m, static_cast<const T*>(k.x), k.S, D, red, g, row0, k.Sp, k.packed, k.scales, rotate, k.qbar,
                  static_cast<int>(k.rep), k.ds_key, cs);
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

// Persistent CTAs (as many as are resident) take tickets until all n items are done; the
// next ticket is fetched while the current item runs. A CTA may hold a fetched ticket while it
// waits, but only a later one than the one it waits on: the earliest waiting item depends only
// on items that run.

// kBalance (never with kRotate): the channel balance (k.bal set).
template <typename T, int P, bool kRotate, bool kBalance>
__global__ void __launch_bounds__(kRowThreads, (P > 4 ? 1 : sizeof(T) == 2 ? kStreamCtas16 : 2)) seq_stream_kernel(const SeqK k, const QBlocks q,
                                                                                    uint32_t n, uint32_t nq_g,
                                                                                    int D) {
  constexpr bool rotate = kRotate;
  __shared__ __align__(16) float red[kRowThreads * 16];
  __shared__ __align__(16) float cs_s[128];  // balance factors (D <= 128 where the balance applies)
  __shared__ uint32_t s_ticket[2];
  __shared__ int s_last;
  unsigned* const tickets = reinterpret_cast<unsigned*>(k.sync);
  if (threadIdx.x == 0) s_ticket[0] = atomicAdd(tickets, 1u);
  __syncthreads();
  for (int b = 0;; b ^= 1) {
    const uint32_t t = s_ticket[b];
    if (t >= n) break;
    uint32_t next = 0;
    if (threadIdx.x == 0) next = atomicAdd(tickets, 1u);
    const Item it = decode(k, q, nq_g, t);
    Tile<T, P> tl;
    load_item(tl, k, q, it, D);
    process_item<T, P, kBalance>(tl, k, q, it, D, red, &s_last, rotate, cs_s);
    if (threadIdx.x == 0) s_ticket[b ^ 1] = next;
    __syncthreads();
  }
}

template <typename T, int P, bool kRotate>
int launch_p(const void* x, int64_t G, int64_t S, int64_t D, float* mean, bool compute_mean, int mean_block,
             int64_t Sp, uint8_t* packed, uint8_t* scales, const float* qbar, int rep, float* ds_key,
             cudaStream_t stream) {
  const int64_t tiles = ceil_div(Sp, kRows);
  const int64_t grid = G * tiles;
  if (grid == 0) return cudaSuccess;
  if (grid > 0x7FFFFFFF) return cudaErrorInvalidValue;
  smooth_quant_kernel<T, P, kRotate><<<static_cast<unsigned>(grid), kRowThreads, 0, stream>>>(
      static_cast<const T*>(x), S, static_cast<int>(D), mean, compute_mean, mean_block, Sp, tiles,
      reinterpret_cast<uint2*>(packed), scales, qbar, rep, ds_key);
  return cudaGetLastError();
}

// The lag (in rounds) between a group's tile sums and its quantization: long enough that the
// last sum's mean (and the last Q block's qbar) is ready when the first quantization item starts
// (about two grids' worth of resident CTAs in between), short enough that the lag + 1 groups in
// flight fit in 3/4 of the L2.
inline uint32_t auto_lag(const SeqK& k, int64_t D, int64_t elt_bytes, int64_t resident, int64_t nq_g) {
  int dev = 0, l2 = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, dev) != cudaSuccess) {
    cudaGetLastError();
    l2 = 0;
  }
  const int64_t by_items = 1 + ceil_div(2 * resident, static_cast<int64_t>(k.nt) + k.tiles + nq_g);
  const int64_t by_l2 = l2 * 3 / 4 / (k.S * D * elt_bytes) - 1;
  return static_cast<uint32_t>(std::max<int64_t>(1, std::min<int64_t>({by_items, by_l2, k.G})));
}

// sync words the streamed launch uses: 2 + 2G (K), + Gq arrivals and G ready counts with Q's global mean
inline size_t sync_words(const SeqK& k, int64_t Gq, bool q_global) {
  return 2 + 2 * static_cast<size_t>(k.G) + (q_global ? static_cast<size_t>(Gq) + k.G : 0);
}

// The balance exponents of the K groups of q (Gq groups, rep per K group) into exps (Gk, D);
// part (Gq * balance_samples(nt), D) fp32; arrive (Gk) int32, zeroed by the caller.
template <typename T, int P>
int launch_balance_p(const void* q, int64_t Gq, int64_t S, int64_t D, uint32_t rep, float* part, int* arrive,
                     float* exps, cudaStream_t stream) {
  const uint32_t nt = static_cast<uint32_t>(ceil_div(S, kRows));
  const int64_t grid = Gq * balance_samples(nt);
  if (grid == 0) return cudaSuccess;
  if (grid > 0x7FFFFFFF) return cudaErrorInvalidValue;
  balance_kernel<T, P><<<static_cast<unsigned>(grid), kRowThreads, 0, stream>>>(static_cast<const T*>(q), S,
                                                                                 static_cast<int>(D), nt, rep, part,
                                                                                 arrive, exps);
  return cudaGetLastError();
}

template <typename T, int P, bool kRotate>
int launch_stream_p(SeqK k, const QBlocks& q, int64_t Gq, int64_t D, int lag, float* bal_part, cudaStream_t stream) {
  const int64_t nq_g = Gq ? static_cast<int64_t>(q.rep) * q.tiles : 0;
  const int64_t n = static_cast<int64_t>(k.G) * (k.nt + k.tiles + nq_g);
  if (n > 0x7FFFFFFF) return cudaErrorInvalidValue;
  auto* kernel = seq_stream_kernel<T, P, kRotate, false>;
  if constexpr (!kRotate && (P == 2 || P == 4)) {
    if (bal_part != nullptr) kernel = seq_stream_kernel<T, P, false, true>;
  }
  int per_sm = 0;
  cudaError_t e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kRowThreads, 0);
  if (e != cudaSuccess) return e;
  const int64_t resident = static_cast<int64_t>(std::max(per_sm, 1)) * sm_count();
  k.lag = lag > 0 ? std::min<uint32_t>(static_cast<uint32_t>(lag), k.G)
                  : auto_lag(k, D, static_cast<int64_t>(sizeof(T)), resident, nq_g);
  const size_t words = sync_words(k, Gq, q.partial != nullptr);
  e = cudaMemsetAsync(k.sync, 0, sizeof(int) * (words + (bal_part ? k.G : 0)), stream);
  if (e != cudaSuccess) return e;
  if (bal_part != nullptr) {  // the exponents first (stream order: complete before the items read them)
    if constexpr (P == 2 || P == 4) {
      e = static_cast<cudaError_t>(launch_balance_p<T, P>(q.x, Gq, q.S, D, q.rep, bal_part, k.sync + words,
                                                          const_cast<float*>(k.bal), stream));
      if (e != cudaSuccess) return e;
    } else {
      return cudaErrorInvalidValue;
    }
  }
  kernel<<<static_cast<unsigned>(std::min(n, resident)), kRowThreads, 0, stream>>>(
      k, q, static_cast<uint32_t>(n), static_cast<uint32_t>(nq_g), static_cast<int>(D));
  return cudaGetLastError();
}

template <typename T, int P, bool kRotate>
int launch_two_pass_p(const SeqK& k, int64_t D, cudaStream_t stream) {
  const int64_t nt = k.nt;
  if (static_cast<int64_t>(k.G) * k.tiles > 0x7FFFFFFF) return cudaErrorInvalidValue;  // before any launch
  tile_sums_kernel<T, P><<<static_cast<unsigned>(k.G * nt), kRowThreads, 0, stream>>>(
      static_cast<const T*>(k.x), k.S, static_cast<int>(D), nt, k.partial);
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return e;
  seq_mean_kernel<<<k.G, kRowThreads, 0, stream>>>(k.partial, nt, static_cast<int>(D), k.S, k.mean, kRotate);
  if ((e = cudaGetLastError()) != cudaSuccess) return e;
  return launch_p<T, P, kRotate>(k.x, k.G, k.S, D, k.mean, false, 0, k.Sp, reinterpret_cast<uint8_t*>(k.packed),
                                 k.scales, k.qbar, static_cast<int>(k.rep), k.ds_key, stream);
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

// Calls f(std::bool_constant<kRotate>{}); rotated instantiations exist for P 2 and 4 only (D 64
// and 128: the launchers refuse the rotation elsewhere).
template <int P, typename F>
int with_rotation(bool rotate, F&& f) {
  if constexpr (P == 2 || P == 4) {
    if (rotate) return f(std::true_type{});
  } else {
    if (rotate) return cudaErrorInvalidValue;
  }
  return f(std::false_type{});
}

template <typename T>
int launch(const void* x, int64_t G, int64_t S, int64_t D, float* mean, bool compute_mean, int mean_block,
           int64_t Sp, uint8_t* packed, uint8_t* scales, bool rotate, cudaStream_t stream) {
  return with_passes(D, [&](auto p) {
    constexpr int P = decltype(p)::value;
    return with_rotation<P>(rotate, [&](auto r) {
      return launch_p<T, P, decltype(r)::value>(x, G, S, D, mean, compute_mean, mean_block, Sp, packed, scales,
                                                nullptr, 0, nullptr, stream);
    });
  });
}

template <typename T>
int launch_seq(const SeqK& k, const QBlocks& q, int64_t Gq, int64_t D, int lag, bool two_pass, bool rotate,
               float* bal_part, cudaStream_t stream) {
  return with_passes(D, [&](auto p) {
    constexpr int P = decltype(p)::value;
    return with_rotation<P>(rotate, [&](auto r) {
      constexpr bool R = decltype(r)::value;
      return two_pass ? launch_two_pass_p<T, P, R>(k, D, stream)
                      : launch_stream_p<T, P, R>(k, q, Gq, D, lag, bal_part, stream);
    });
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
              reinterpret_cast<uint2*>(packed), scales, nullptr, nullptr, 1, nullptr, nullptr};
}

// The rotation and the per-key correction exist for D 64 and 128 (the attention's head dims).
bool options_fit(int64_t D, bool rotate, bool correction) {
  return !(rotate || correction) || rotation_applies(static_cast<int>(D));
}

}  // namespace

int smooth_quant_rows(const void* x, DType dtype, int64_t G, int64_t S, int64_t D, float* mean, bool compute_mean,
                      int mean_block, int64_t Sp, uint8_t* packed, uint8_t* scales, bool rotate,
                      cudaStream_t stream) {
  if (D % 16 || D <= 0 || D > kMaxD || Sp < S || (mean_block != 0 && mean_block != kRows) ||
      (compute_mean && mean_block != kRows) || !options_fit(D, rotate, false))
    return cudaErrorInvalidValue;
  return with_dtype(dtype, [&](auto t) {
    return launch<decltype(t)>(x, G, S, D, mean, compute_mean, mean_block, Sp, packed, scales, rotate, stream);
  });
}

int smooth_quant_seq(const void* x, DType dtype, int64_t G, int64_t S, int64_t D, float* mean, float* partial,
                     int* sync, int64_t Sp, uint8_t* packed, uint8_t* scales, bool force_two_pass, bool rotate,
                     const float* qbar, int64_t rep, float* ds_key, cudaStream_t stream) {
  if (D % 16 || D <= 0 || D > kMaxD || Sp < S || S < 1) return cudaErrorInvalidValue;
  if ((qbar != nullptr) != (ds_key != nullptr) || (qbar && (rep < 1 || rep > max_correction_heads(static_cast<int>(D)))) ||
      !options_fit(D, rotate, qbar != nullptr))
    return cudaErrorInvalidValue;
  if (G == 0) return cudaSuccess;
  if (G > 0x7FFFFFFF) return cudaErrorInvalidValue;
  SeqK k = seq_k(x, G, S, Sp, mean, partial, sync, packed, scales);
  k.qbar = qbar;
  k.ds_key = ds_key;
  k.rep = qbar ? static_cast<uint32_t>(rep) : 1u;
  return with_dtype(dtype, [&](auto t) {
    return launch_seq<decltype(t)>(k, QBlocks{}, 0, D, 0, force_two_pass, rotate, nullptr, stream);
  });
}

int smooth_quant_qk(const void* q, const void* k, DType dtype, int64_t Gq, int64_t Sq, int64_t Gk, int64_t Sk,
                    int64_t D, float* mean_q, int64_t Sqp, uint8_t* q_packed, uint8_t* q_scales, float* mean_k,
                    float* partial_k, int* sync, int64_t Skp, uint8_t* k_packed, uint8_t* k_scales, int lag,
                    bool rotate, float* partial_q, float* qbar, float* ds_key, float* balance, float* balance_part,
                    cudaStream_t stream) {
  if (D % 16 || D <= 0 || D > kMaxD || Sqp < Sq || Skp < Sk || Sk < 1 || Gk < 1 || Gk > 0x7FFFFFFF || Gq < 0 ||
      lag < 0 || Gq % Gk != 0 || (Gq > 0 && Sq < 1))
    return cudaErrorInvalidValue;
  if ((balance != nullptr) != (balance_part != nullptr) ||
      (balance && (rotate || Gq == 0 || !rotation_applies(static_cast<int>(D)))))
    return cudaErrorInvalidValue;
  const bool global = Gq > 0 && (partial_q || qbar || ds_key);
  if (global && (!partial_q || !qbar || !ds_key)) return cudaErrorInvalidValue;
  if (!options_fit(D, rotate, global)) return cudaErrorInvalidValue;
  const uint32_t rep = static_cast<uint32_t>(Gq / Gk);
  if (global && rep > static_cast<uint32_t>(max_correction_heads(static_cast<int>(D)))) return cudaErrorInvalidValue;
  SeqK ka = seq_k(k, Gk, Sk, Skp, mean_k, partial_k, sync, k_packed, k_scales);
  int* const q_sync = sync + 2 + 2 * Gk;
  QBlocks qa{q, Sq, Sqp, static_cast<uint32_t>(ceil_div(Sqp, kRows)), static_cast<uint32_t>(ceil_div(Sq, kRows)),
             mean_q, reinterpret_cast<uint2*>(q_packed), q_scales, nullptr, nullptr, nullptr, nullptr, rep};
  if (global) {
    qa.partial = partial_q;
    qa.arrive = q_sync;
    qa.ready = q_sync + Gq;
    qa.qbar = qbar;
    ka.qbar = qbar;
    ka.ds_key = ds_key;
    ka.rep = rep;
    ka.q_ready = q_sync + Gq;
  }
  ka.bal = balance;
  return with_dtype(dtype, [&](auto t) {
    return launch_seq<decltype(t)>(ka, qa, Gq, D, lag, false, rotate, balance_part, stream);
  });
}

int qk_balance(const void* q, DType dtype, int64_t Gq, int64_t S, int64_t Gk, int64_t D, float* part, int* arrive,
               float* exps, cudaStream_t stream) {
  if (!rotation_applies(static_cast<int>(D)) || S < 1 || Gk < 1 || Gq % Gk != 0 || Gq > 0x7FFFFFFF)
    return cudaErrorInvalidValue;
  if (Gq == 0) return cudaSuccess;
  const cudaError_t e = cudaMemsetAsync(arrive, 0, sizeof(int) * Gk, stream);
  if (e != cudaSuccess) return e;
  const uint32_t rep = static_cast<uint32_t>(Gq / Gk);
  return with_dtype(dtype, [&](auto t) {
    using T = decltype(t);
    return D == 64 ? launch_balance_p<T, 2>(q, Gq, S, D, rep, part, arrive, exps, stream)
                   : launch_balance_p<T, 4>(q, Gq, S, D, rep, part, arrive, exps, stream);
  });
}

}  // namespace sageattn3
