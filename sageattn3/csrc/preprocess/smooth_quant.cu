// Smoothing + NVFP4 along D for Q and K: a CTA owns 128 rows of one group and holds them in
// registers: every thread loads its P row blocks (whole 16-channel blocks, all loads in flight
// at once), so the tile's column sums, the mean and the quantization all come from one read of
// the tile from DRAM.
//
// Means over 128-row blocks (Q with per_block_mean) are local to a CTA. K's mean, and Q's mean
// for the whole sequence (qbar: the shared part of the correction delta_s; Q's only mean
// without per_block_mean), are taken over a fixed sample of the sequence (sampled means,
// below): two small launches compute them from min(8, ceil(S/128)) tiles, then one launch
// smooths and quantizes every tile of Q and K with no dependency between its CTAs, so Q and K
// are read from DRAM once.
//
// Optionally (D 64/128) the channel balance multiplies Q's channels by 2^-e and K's by 2^e
// first, and/or the rows are rotated (rotation.cuh): means are summed on the raw rows, then
// balanced and rotated (both are linear), every row is balanced and rotated in registers before
// the mean is subtracted. K's quantization can also emit the per-key correction of the
// attention, ds_key[q head][key] = qbar[q head] . (K[key] - mean_k) in the balanced and rotated
// space, over the smoothed fp32 row exactly as it is quantized (from registers), and K's
// quantization residual (nvfp4.cuh, codes16) for the block residuals' part of the correction.
// Q and K may be
// quantized with the scale search (quant16_search, nvfp4.cuh) instead of the plain quantizer.
#include <type_traits>

#include "common/launch.cuh"
#include "common/nvfp4.cuh"
#include "preprocess/rotation.cuh"
#include "preprocess/rowblock.cuh"
#include "sageattn3.h"

namespace sageattn3 {
namespace {

constexpr int kRows = 128;

// v[i] = f(v[i], s[i]) for i < 16, s: 16 floats in shared memory (16-byte aligned, read as four
// 16-byte loads).
template <typename F>
__device__ __forceinline__ void with16(float (&v)[16], const float* s, F f) {
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float4 c = reinterpret_cast<const float4*>(s)[i];
    v[4 * i] = f(v[4 * i], c.x);
    v[4 * i + 1] = f(v[4 * i + 1], c.y);
    v[4 * i + 2] = f(v[4 * i + 2], c.z);
    v[4 * i + 3] = f(v[4 * i + 3], c.w);
  }
}

// The rows of one 128-row tile a thread holds: rows rl + p*rpp, p < P.
template <typename T, int P>
struct Tile {
  Raw16<T> raw[P];

  // kLastUse: streaming loads (evict first); else normal ones (the tile is read again soon: the
  // sampled tiles, which the smoothing launch reads after the sums).
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
  // (16-byte aligned): the row is multiplied by them (powers of two: exact) first, before the
  // rotation, and mu is then the balanced (and rotated) mean. search: NVFP4 with the scale search
  // (quant16_search) instead of the plain quantizer. u (null: none; D 64/128): this thread's 16 floats of nh vectors
  // in shared memory, ustride floats apart (16-byte aligned): the per-key correction
  // dk[h * Sp + row] = u[h] . (the smoothed
  // fp32 row, as quantized): per thread a 16-term fma chain over its block from 0, then the
  // block sums of the row added by an xor butterfly over its lanes (1, 2, 4); 0 for padding rows.
  // res (null: none): the quantization residual of every row (codes16), (G, Sp, D) float16
  // (2-byte words), zeros for padding rows.
  __device__ __forceinline__ void quantize(const RowMap& m, const float* mu, int64_t g, int64_t row0, int64_t r1,
                                           int64_t Sp, uint2* __restrict__ packed, uint8_t* __restrict__ scales,
                                           bool rotate, bool search, const float* cs = nullptr, const float* u = nullptr,
                                           int nh = 0, int ustride = 0, float* __restrict__ dk = nullptr,
                                           uint16_t* __restrict__ res = nullptr) const {
    const int bpr = m.bpr;
#pragma unroll
    for (int p = 0; p < P; ++p) {
      const int r = m.rl + p * m.rpp;
      const int64_t row = row0 + r;
      const bool stored = r < kRows && row < Sp;
      // no shuffle below without the rotation or the correction: lanes may part here
      if (!rotate && u == nullptr && !stored) continue;
      float v[16];
      raw[p].to_float(v);
      const auto balance = [](float x, float c) { return __fmul_rn(x, c); };
      // D/16 = 2P where the rotation exists (D 64 and 128); balanced first (padding rows are
      // zeros: the balance and the rotation keep them so)
      if constexpr (P == 2 || P == 4) {
        if (rotate) {
          if (cs != nullptr) with16(v, cs, balance);
          rotate_block<2 * P>(v, m.cb);
        }
      }
      const bool real = stored && row < r1;
      if (real) {
        // without the rotation the balance stays here, on real rows only: one multiply site per
        // path keeps the default instantiation at 80 registers without spills
        if (!rotate && cs != nullptr) with16(v, cs, balance);
        with16(v, mu, [](float x, float m) { return __fsub_rn(x, m); });
      }
      if constexpr (P == 2 || P == 4) {
        if (u != nullptr) {  // every lane: the butterfly shuffles
          for (int h = 0; h < nh; ++h) {
            const float4* uv = reinterpret_cast<const float4*>(u + h * ustride);
            float acc = 0.f;
#pragma unroll
            for (int i = 0; i < 4; ++i) {
              const float4 c = uv[i];
              acc = fmaf(c.x, v[4 * i], acc);
              acc = fmaf(c.y, v[4 * i + 1], acc);
              acc = fmaf(c.z, v[4 * i + 2], acc);
              acc = fmaf(c.w, v[4 * i + 3], acc);
            }
#pragma unroll
            for (int s = 1; s < 2 * P; s <<= 1) acc = __fadd_rn(acc, __shfl_xor_sync(0xffffffffu, acc, s));
            if (m.cb == 0 && stored) dk[h * Sp + row] = real ? acc : 0.f;
          }
        }
      }
      if (!stored) continue;
      uint32_t sb = 0;
      uint2 w = make_uint2(0u, 0u);
      Residual16 e{make_uint4(0u, 0u, 0u, 0u), make_uint4(0u, 0u, 0u, 0u)};
      if (real) w = search ? quant16_search(v, sb, e, res != nullptr) : quant16(v, sb, e, res != nullptr);
      const int64_t ob = (g * Sp + row) * bpr + m.cb;  // output block index
      __stcs(packed + ob, w);
      __stcs(reinterpret_cast<char*>(scales + ob), static_cast<char>(sb));
      if (res != nullptr) {
        __stcs(reinterpret_cast<uint4*>(res) + 2 * ob, e.lo);
        __stcs(reinterpret_cast<uint4*>(res) + 2 * ob + 1, e.hi);
      }
    }
  }
};

// Vectors of D floats that every thread reads its 16-channel block of (means, balance factors,
// correction vectors) sit in shared memory with 20 floats per block: the 8 lanes of a 16-byte
// load phase then read 8 different bank quads (16 floats apart they would hit 2).
constexpr int kPadBlock = 20;
__host__ __device__ constexpr int padded(int D) { return D / 16 * kPadBlock; }
__device__ __forceinline__ int padded_index(int c) { return c / 16 * kPadBlock + c % 16; }

// vec[d] = mu (the mean of channel d, from thread d < D), written to out[0..D) as is or, when
// asked, after rotating vec (one warp). Every thread calls it; ends with a barrier.
__device__ __forceinline__ void store_mean(float* vec, float mu, int D, bool rotate, float* out) {
  if (static_cast<int>(threadIdx.x) < D) {
    vec[threadIdx.x] = mu;
    if (!rotate) out[threadIdx.x] = mu;
  }
  __syncthreads();
  if (rotate) {
    if (threadIdx.x < 32) rotate_vector(vec, D, out);
    __syncthreads();
  }
}

// The mean of a tile from its column sums in red[0..D) (count real rows): left in red[0..D),
// times the balance factors cs (padded) when given, then rotated when asked, and written to
// mean_out (store_mean).
__device__ __forceinline__ void tile_mean(float* red, int D, int64_t count, bool rotate, float* mean_out,
                                          const float* cs = nullptr) {
  float mu = 0.f;
  if (static_cast<int>(threadIdx.x) < D) {
    mu = red[threadIdx.x] / static_cast<float>(count);
    if (cs != nullptr) mu = __fmul_rn(mu, cs[padded_index(threadIdx.x)]);
  }
  store_mean(red, mu, D, rotate, mean_out);
}

// q heads per K group whose correction vectors fit in shared memory (red, padded).
__host__ __device__ constexpr int max_correction_heads(int D) { return kRowThreads * 16 / padded(D); }

// 2^e (Q: 2^-e) for a balance exponent e in {-2..2}, exactly.
__device__ __forceinline__ float balance_factor(float e, bool is_q) {
  const int x = static_cast<int>(e);
  return __int_as_float((127 + (is_q ? -x : x)) << 23);
}

// ---- sampled means --------------------------------------------------------------------------
// K's mean and qbar (each q group's mean for the whole sequence) are taken over a fixed sample:
// ns = min(8, nt) of the nt = ceil(S/128) tiles, tile (i * nt) / ns for i < ns (all of them up
// to 1024 rows), mean = (sum over the sampled tiles, in order, of their column sums) / (their
// real rows) in fp32 (reference.sample_mean). The channel balance statistics come from the same
// tiles of Q and K. Any vector subtracted from K leaves the attention unchanged (the softmax ignores
// a constant per query row) and qbar only splits the correction delta_s (exact for any qbar):
// the sample decides how well a channel bias is removed before the quantization, not what is
// computed, and it makes the means known before the data is read, so the smoothing launch reads
// Q and K once with no dependency between its CTAs (the whole-sequence means needed either a
// second read of K or a persistent launch streaming it through the L2, and the per-key dots
// had to wait for Q's last block).
constexpr uint32_t kMeanSamples = 8;

__host__ __device__ inline uint32_t mean_samples(uint32_t nt) { return nt < kMeanSamples ? nt : kMeanSamples; }
__host__ __device__ inline int64_t sample_tile(uint32_t i, uint32_t nt, uint32_t ns) {
  return (static_cast<int64_t>(i) * nt) / ns;
}
// real rows of the ns sampled tiles of a sequence of S rows (nt tiles)
inline int64_t sample_rows(int64_t S, uint32_t nt, uint32_t ns) {
  int64_t rows = 0;
  for (uint32_t i = 0; i < ns; ++i) {
    const int64_t r0 = sample_tile(i, nt, ns) * kRows;
    rows += std::min<int64_t>(S, r0 + kRows) - r0;
  }
  return rows;
}

// One tensor's sampled tiles: G groups of S rows.
struct SampleSrc {
  const void* x;
  int64_t S;
  uint32_t G, nt, ns;
  float* sums;  // (G * ns, D): each sampled tile's column sums, or null
  float* ss;    // (G * ns, D): each sampled tile's sums of squares about its own mean, or null
};

// The sums of squares about the tile's mean (the channel balance statistics) into out[0..D);
// red[0..D) holds the tile's column sums on entry. Every thread calls it.
template <typename T, int P>
__device__ __forceinline__ void tile_square_sums(const Tile<T, P>& t, const RowMap& m, int D, int64_t S, int64_t tile,
                                                 float* red, float* out) {
  const int64_t row0 = tile * kRows, r1 = std::min<int64_t>(S, row0 + kRows);
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
  if (static_cast<int>(threadIdx.x) < D) out[threadIdx.x] = red[threadIdx.x];
}

// One CTA per sampled tile: those of a, then those of b.
template <typename T, int P>
__global__ void __launch_bounds__(kRowThreads) sample_sums_kernel(const __grid_constant__ SampleSrc a,
                                                                  const __grid_constant__ SampleSrc b, int D) {
  __shared__ __align__(16) float red[kRowThreads * 16];
  const uint32_t na = a.G * a.ns;
  const bool in_a = blockIdx.x < na;
  const SampleSrc& s = in_a ? a : b;
  const uint32_t c = in_a ? blockIdx.x : blockIdx.x - na;
  const int64_t tile = sample_tile(c % s.ns, s.nt, s.ns);
  const RowMap m(D);
  Tile<T, P> t;
  t.template load_tile<false>(m, static_cast<const T*>(s.x), s.S, D, c / s.ns, tile);
  t.colsum(m, D, red);
  if (s.sums != nullptr && static_cast<int>(threadIdx.x) < D) s.sums[static_cast<int64_t>(c) * D + threadIdx.x] = red[threadIdx.x];
  if (s.ss != nullptr) tile_square_sums(t, m, D, s.S, tile, red, s.ss + static_cast<int64_t>(c) * D);
}

// What sample_means_kernel makes of the sums, per group g of K (one CTA each).
struct SampleMeans {
  const float* k_sums;  // (G * nsk, D), or null: no K mean
  uint32_t nsk;
  int64_t k_rows;
  float* mean_k;        // (G, D)
  const float* q_sums;  // (G * rep * nsq, D), or null: no qbar
  const float* q_ss;    // (G * rep * nsq, D): with exps
  const float* k_ss;    // (G * nsk, D): with exps
  uint32_t nsq, rep;
  int64_t q_rows;
  float* qbar;          // (G * rep, D)
  float* exps;          // (G, D) balance exponents, or null: no balance
  uint32_t* zero;       // zero_words words the launch zeroes (a later launch's counters), or null
  int64_t zero_words;
};

// The mean of n sum rows src[j * D + d] (in order) over `rows` rows, times f, into vec[d] and
// out[0..D) (store_mean).
__device__ __forceinline__ void mean_of_sums(const float* src, uint32_t n, int64_t rows, float f, int D, bool rotate,
                                             float* vec, float* out) {
  float mu = 0.f;
  if (static_cast<int>(threadIdx.x) < D) {
    float s = 0.f;
    for (uint32_t j = 0; j < n; ++j) s += src[static_cast<int64_t>(j) * D + threadIdx.x];
    mu = __fmul_rn(s / static_cast<float>(rows), f);
  }
  store_mean(vec, mu, D, rotate, out);
}

// Balance exponents (reference.balance_exponents), K mean, qbar of the group's rep q groups;
// balanced (times 2^e for K, 2^-e for Q), then rotated when asked.
__global__ void __launch_bounds__(kRowThreads) sample_means_kernel(const SampleMeans f, int D, bool rotate) {
  __shared__ __align__(16) float vec[kMaxD];
  __shared__ float wsum[2][kRowThreads / 32];
  const int64_t g = blockIdx.x;
  const int d = threadIdx.x;
  for (int64_t i = g * kRowThreads + d; i < f.zero_words; i += static_cast<int64_t>(gridDim.x) * kRowThreads)
    f.zero[i] = 0u;
  float e = 0.f;
  if (f.exps != nullptr) {
    // Q's and K's mean squares over the group's sampled tiles (sums of their ss_d, in order, /
    // rows), a_d and b_d their square roots, r_d = a_d / b_d, valid where a_d > 0, b_d > 0 and
    // r_d finite; m = (pairwise sum of the valid r_d) / (pairwise count), both as lanes by xor
    // butterfly, then warps; e_d from r_d against 2m, 8m, m/2, m/8 on valid channels (0
    // everywhere unless m is a positive finite number); D 64 or 128
    float r = 0.f;
    bool valid = false;
    if (d < D) {
      const float* src = f.q_ss + g * f.rep * f.nsq * D + d;
      float sq = 0.f, sk = 0.f;
      for (uint32_t j = 0; j < f.rep * f.nsq; ++j) sq += src[static_cast<int64_t>(j) * D];
      const float* srk = f.k_ss + g * f.nsk * D + d;
      for (uint32_t j = 0; j < f.nsk; ++j) sk += srk[static_cast<int64_t>(j) * D];
      const float a = sqrtf(__fdiv_rn(sq, static_cast<float>(f.q_rows * f.rep)));
      const float b = sqrtf(__fdiv_rn(sk, static_cast<float>(f.k_rows)));
      r = __fdiv_rn(a, b);
      valid = a > 0.f && b > 0.f && fabsf(r) <= 3.4028235e38f;
      float rs = valid ? r : 0.f, n = valid ? 1.f : 0.f;
#pragma unroll
      for (int off = 1; off < 32; off <<= 1) {
        rs = __fadd_rn(rs, __shfl_xor_sync(0xffffffffu, rs, off));
        n = __fadd_rn(n, __shfl_xor_sync(0xffffffffu, n, off));
      }
      if (d % 32 == 0) {
        wsum[0][d / 32] = rs;
        wsum[1][d / 32] = n;
      }
    }
    __syncthreads();
    if (d < D) {
      const auto total = [&](const float* w) {
        return D == 128 ? __fadd_rn(__fadd_rn(w[0], w[1]), __fadd_rn(w[2], w[3])) : __fadd_rn(w[0], w[1]);
      };
      const float m = __fdiv_rn(total(wsum[0]), total(wsum[1]));
      if (valid && m > 0.f && m <= 3.4028235e38f) {
        e = static_cast<float>((r >= __fmul_rn(2.f, m)) + (r >= __fmul_rn(8.f, m)) - (r < __fdiv_rn(m, 2.f)) -
                               (r < __fdiv_rn(m, 8.f)));
      }
      f.exps[g * D + d] = e;
    }
  }
  if (f.k_sums != nullptr) {
    mean_of_sums(f.k_sums + g * f.nsk * D, f.nsk, f.k_rows, balance_factor(e, false), D, rotate, vec, f.mean_k + g * D);
  }
  if (f.q_sums != nullptr) {
    for (uint32_t h = 0; h < f.rep; ++h) {
      const int64_t gq = g * f.rep + h;
      mean_of_sums(f.q_sums + gq * f.nsq * D, f.nsq, f.q_rows, balance_factor(e, true), D, rotate, vec, f.qbar + gq * D);
    }
  }
}

// ---- the smoothing launch -------------------------------------------------------------------
// One tensor's share of a launch: G groups of S rows, rows padded to Sp, one CTA per 128-row tile.
struct RowsJob {
  const void* x;
  int64_t S, Sp;
  uint32_t G, tiles;      // tiles = ceil(Sp / 128)
  float* mean;            // compute_mean: out, (G, ceil(S/128), D) block means; else in, (G, mean_rows, D)
  bool compute_mean;
  uint32_t mean_rows;     // given means per group: 1, or ceil(S/128) (one per 128-row block)
  uint2* packed;          // (G, Sp, D/2)
  uint8_t* scales;        // (G, Sp, D/16)
  const float* bal;       // balance exponents (G / bal_div, D), or null
  uint32_t bal_div;       // groups per exponent row (Q: rep; K: 1)
  bool bal_q;             // 2^-e (Q) or 2^e (K)
  const float* u;         // per-key correction vectors (G * rep, D), or null
  uint32_t rep;
  float* ds_key;          // (G * rep, Sp)
  bool search;            // NVFP4 with the scale search (quant16_search)
  uint16_t* res;          // the quantization residual (G, Sp, D) float16 (codes16), or null
};

// One CTA per tile: those of a, then those of b (G 0: none). Shared vectors padded (padded()):
// the mean in mu_s, the balance factors in cs_s, the correction vectors in red.
// The scale search converts every block twice: its instantiations get 2 CTAs per SM (128
// registers) instead of 3 (80), where the 80-register bound spilled (on sm_90a: 24 bytes at
// D 128, 84 with the rotation). The rotation alone keeps 3 CTAs although it spills there (44/100
// bytes stored/loaded on sm_90a, 20/60 on sm_120a at D 128): with 2 CTAs and no spills the
// whole preprocessing with balance and rotation was 6% slower on an H100 (0.594-0.600 ms
// against 0.562-0.564 back to back, same run).
template <typename T, int P, bool kRotate, bool kSearch>
__global__ void __launch_bounds__(kRowThreads, (P <= 4 ? (kSearch ? 2 : 3) : 1)) smooth_quant_kernel(
    const __grid_constant__ RowsJob a, const __grid_constant__ RowsJob b, int D) {
  __shared__ __align__(16) float red[kRowThreads * 16];
  __shared__ __align__(16) float mu_s[padded(kMaxD)];
  __shared__ __align__(16) float cs_s[padded(128)];  // balance factors (D <= 128 where the balance applies)
  const uint32_t na = a.G * a.tiles;
  const bool in_a = blockIdx.x < na;
  const RowsJob& j = in_a ? a : b;
  const uint32_t c = in_a ? blockIdx.x : blockIdx.x - na;
  const int64_t g = c / j.tiles, tile = c % j.tiles;
  const RowMap m(D);
  Tile<T, P> t;
  t.load_tile(m, static_cast<const T*>(j.x), j.S, D, g, tile);
  const int64_t row0 = tile * kRows;
  const int64_t r1 = std::min<int64_t>(j.S, row0 + kRows);  // real rows of this tile: [row0, r1)
  const bool has_rows = row0 < j.S;
  const int d = threadIdx.x;
  bool balanced = false;
  if constexpr (P == 2 || P == 4) {
    if (j.bal != nullptr) {
      if (d < D) cs_s[padded_index(d)] = balance_factor(__ldg(j.bal + (g / j.bal_div) * D + d), j.bal_q);
      balanced = true;  // the barriers below publish cs_s
    }
  }
  if (j.compute_mean) {
    t.colsum(m, D, red);
    if (has_rows) {
      tile_mean(red, D, r1 - row0, kRotate, j.mean + (g * j.mean_rows + tile) * D, balanced ? cs_s : nullptr);
      if (d < D) mu_s[padded_index(d)] = red[d];
    }
  } else {
    const int64_t mi = g * j.mean_rows + (j.mean_rows > 1 ? tile : 0);
    if (has_rows && d < D) mu_s[padded_index(d)] = __ldg(j.mean + mi * D + d);
    if (j.u != nullptr) {
      const int n = static_cast<int>(j.rep) * D;
      for (int i = d; i < n; i += kRowThreads) red[(i / D) * padded(D) + padded_index(i % D)] = __ldg(j.u + g * n + i);
    }
  }
  __syncthreads();
  if (m.active) {
    const int off = m.cb * kPadBlock;
    t.quantize(m, mu_s + off, g, row0, r1, j.Sp, j.packed, j.scales, kRotate, kSearch, balanced ? cs_s + off : nullptr,
               j.u ? red + off : nullptr, static_cast<int>(j.rep), padded(D),
               j.u ? j.ds_key + g * j.rep * j.Sp : nullptr, j.res);
  }
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

// Calls f(std::bool_constant<on>{}) for an option that exists at D 64 and 128 only (the
// rotation, the scale search): its instantiations exist for P 2 and 4 only (the launchers refuse
// the option elsewhere).
template <int P, typename F>
int with_option(bool on, F&& f) {
  if constexpr (P == 2 || P == 4) {
    if (on) return f(std::true_type{});
  } else {
    if (on) return cudaErrorInvalidValue;
  }
  return f(std::false_type{});
}


template <typename T, int P>
int launch_sums_p(const SampleSrc& a, const SampleSrc& b, int64_t D, cudaStream_t stream) {
  const int64_t grid = static_cast<int64_t>(a.G) * a.ns + static_cast<int64_t>(b.G) * b.ns;
  if (grid == 0) return cudaSuccess;
  if (grid > 0x7FFFFFFF) return cudaErrorInvalidValue;
  sample_sums_kernel<T, P><<<static_cast<unsigned>(grid), kRowThreads, 0, stream>>>(a, b, static_cast<int>(D));
  return cudaGetLastError();
}

template <typename T, int P, bool kRotate, bool kSearch>
int launch_rows_p(const RowsJob& a, const RowsJob& b, int64_t D, cudaStream_t stream) {
  const int64_t grid = static_cast<int64_t>(a.G) * a.tiles + static_cast<int64_t>(b.G) * b.tiles;
  if (grid == 0) return cudaSuccess;
  if (grid > 0x7FFFFFFF) return cudaErrorInvalidValue;
  smooth_quant_kernel<T, P, kRotate, kSearch><<<static_cast<unsigned>(grid), kRowThreads, 0, stream>>>(a, b,
                                                                                               static_cast<int>(D));
  return cudaGetLastError();
}

int launch_means(const SampleMeans& f, int64_t G, int64_t D, bool rotate, cudaStream_t stream) {
  if (G == 0) return cudaSuccess;
  sample_means_kernel<<<static_cast<unsigned>(G), kRowThreads, 0, stream>>>(f, static_cast<int>(D), rotate);
  return cudaGetLastError();
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

// The launches of a smoothing op, in stream order: the sampled tiles' sums (sa, sb; none when
// both are empty), the means from them (f over mg groups), then the rows (ja, jb).
template <typename T>
int launch_all(const SampleSrc& sa, const SampleSrc& sb, const SampleMeans& f, int64_t mg, const RowsJob& ja,
               const RowsJob& jb, int64_t D, bool rotate, cudaStream_t stream) {
  // decltype(p)::value at each use, not a constexpr local: MSVC 14.44 does not see such a local
  // inside the nested lambdas (error C3861).
  return with_passes(D, [&](auto p) {
    return with_option<decltype(p)::value>(rotate, [&](auto r) {
      int e = launch_sums_p<T, decltype(p)::value>(sa, sb, D, stream);
      if (e == cudaSuccess && mg > 0) e = launch_means(f, mg, D, rotate, stream);
      if (e != cudaSuccess) return e;
      return with_option<decltype(p)::value>(ja.search || jb.search, [&](auto sr) {
        return launch_rows_p<T, decltype(p)::value, decltype(r)::value, decltype(sr)::value>(ja, jb, D, stream);
      });
    });
  });
}

// block_means: one mean per 128-row block (computed with compute_mean, else given), or one per group.
RowsJob rows_job(const void* x, int64_t G, int64_t S, int64_t Sp, float* mean, bool compute_mean, bool block_means,
                 uint8_t* packed, uint8_t* scales) {
  return RowsJob{x, S, Sp, static_cast<uint32_t>(G), static_cast<uint32_t>(ceil_div(Sp, kRows)), mean, compute_mean,
                 block_means ? static_cast<uint32_t>(ceil_div(S, kRows)) : 1u, reinterpret_cast<uint2*>(packed),
                 scales, nullptr, 1, false, nullptr, 1, nullptr, false, nullptr};
}

SampleSrc sample_src(const void* x, int64_t G, int64_t S, float* sums, float* ss) {
  const uint32_t nt = static_cast<uint32_t>(ceil_div(S, kRows));
  return SampleSrc{x, S, static_cast<uint32_t>(G), nt, mean_samples(nt), sums, ss};
}

// The rotation, the balance, the scale search and the per-key correction exist for D 64 and 128 (the attention's
// head dims).
bool options_fit(int64_t D, bool rotate, bool correction, bool search = false) {
  return !(rotate || correction || search) || rotation_applies(static_cast<int>(D));
}

}  // namespace

int smooth_quant_rows(const void* x, DType dtype, int64_t G, int64_t S, int64_t D, float* mean, bool compute_mean,
                      int mean_block, int64_t Sp, uint8_t* packed, uint8_t* scales, bool rotate, bool search,
                      cudaStream_t stream) {
  if (D % 16 || D <= 0 || D > kMaxD || Sp < S || (mean_block != 0 && mean_block != kRows) ||
      (compute_mean && mean_block != kRows) || !options_fit(D, rotate, false, search) || G > 0x7FFFFFFF)
    return cudaErrorInvalidValue;
  if (ceil_div(Sp, kRows) > 0x7FFFFFFF) return cudaErrorInvalidValue;
  RowsJob j = rows_job(x, G, S, Sp, mean, compute_mean, mean_block == kRows, packed, scales);
  j.search = search;
  return with_dtype(dtype, [&](auto t) {
    return launch_all<decltype(t)>(SampleSrc{}, SampleSrc{}, SampleMeans{}, 0, j, RowsJob{}, D, rotate, stream);
  });
}

int smooth_quant_seq(const void* x, DType dtype, int64_t G, int64_t S, int64_t D, float* mean, float* partial,
                     int64_t Sp, uint8_t* packed, uint8_t* scales, bool rotate, bool search, const float* qbar,
                     int64_t rep, float* ds_key, cudaStream_t stream, uint32_t* zero, int64_t zero_words) {
  if (D % 16 || D <= 0 || D > kMaxD || Sp < S || S < 1 || ceil_div(Sp, kRows) > 0x7FFFFFFF)
    return cudaErrorInvalidValue;
  if ((qbar != nullptr) != (ds_key != nullptr) || (qbar && (rep < 1 || rep > max_correction_heads(static_cast<int>(D)))) ||
      !options_fit(D, rotate, qbar != nullptr, search))
    return cudaErrorInvalidValue;
  if (G == 0) return cudaSuccess;
  if (G > 0x7FFFFFFF) return cudaErrorInvalidValue;
  const SampleSrc s = sample_src(x, G, S, partial, nullptr);
  SampleMeans f{};
  f.k_sums = partial;
  f.nsk = s.ns;
  f.k_rows = sample_rows(S, s.nt, s.ns);
  f.mean_k = mean;
  f.zero = zero;
  f.zero_words = zero != nullptr ? zero_words : 0;
  RowsJob j = rows_job(x, G, S, Sp, mean, false, false, packed, scales);
  j.search = search;
  if (qbar != nullptr) {
    j.u = qbar;
    j.rep = static_cast<uint32_t>(rep);
    j.ds_key = ds_key;
  }
  return with_dtype(dtype, [&](auto t) {
    return launch_all<decltype(t)>(s, SampleSrc{}, f, G, j, RowsJob{}, D, rotate, stream);
  });
}

int smooth_quant_qk(const void* q, const void* k, DType dtype, int64_t Gq, int64_t Sq, int64_t Gk, int64_t Sk,
                    int64_t D, float* mean_q, int64_t Sqp, uint8_t* q_packed, uint8_t* q_scales, float* mean_k,
                    float* partial_k, int64_t Skp, uint8_t* k_packed, uint8_t* k_scales, bool rotate,
                    bool search, float* partial_q, float* qbar, float* ds_key, float* balance, float* balance_part,
                    uint16_t* k_res, cudaStream_t stream, uint32_t* zero, int64_t zero_words) {
  if (D % 16 || D <= 0 || D > kMaxD || Sqp < Sq || Skp < Sk || Sk < 1 || Gk < 1 || Gk > 0x7FFFFFFF || Gq < 0 ||
      Gq > 0x7FFFFFFF || Gq % Gk != 0 || (Gq > 0 && Sq < 1) || ceil_div(Sqp, kRows) > 0x7FFFFFFF ||
      ceil_div(Skp, kRows) > 0x7FFFFFFF)
    return cudaErrorInvalidValue;
  if ((balance != nullptr) != (balance_part != nullptr) ||
      (balance && (Gq == 0 || !rotation_applies(static_cast<int>(D)))))
    return cudaErrorInvalidValue;
  const bool global = Gq > 0 && (partial_q || qbar || ds_key);
  if (global && (!partial_q || !qbar || !ds_key)) return cudaErrorInvalidValue;
  if (k_res != nullptr && !global) return cudaErrorInvalidValue;
  if (!options_fit(D, rotate, global, search)) return cudaErrorInvalidValue;
  const uint32_t rep = static_cast<uint32_t>(Gq / Gk);
  if (global && rep > static_cast<uint32_t>(max_correction_heads(static_cast<int>(D)))) return cudaErrorInvalidValue;
  // balance_part: Q's sampled tiles' squares, then K's
  const uint32_t nsq = mean_samples(static_cast<uint32_t>(ceil_div(Sq, kRows)));
  float* k_ss = balance ? balance_part + static_cast<int64_t>(Gq) * nsq * D : nullptr;
  const SampleSrc sk = sample_src(k, Gk, Sk, partial_k, k_ss);
  const SampleSrc sq = Gq > 0 && (global || balance) ? sample_src(q, Gq, Sq, global ? partial_q : nullptr, balance_part)
                                                     : SampleSrc{};
  SampleMeans f{};
  f.k_sums = partial_k;
  f.nsk = sk.ns;
  f.k_rows = sample_rows(Sk, sk.nt, sk.ns);
  f.mean_k = mean_k;
  f.rep = rep;
  f.zero = zero;
  f.zero_words = zero != nullptr ? zero_words : 0;
  if (Gq > 0 && (global || balance)) {
    f.nsq = sq.ns;
    f.q_rows = sample_rows(Sq, sq.nt, sq.ns);
    f.q_ss = balance_part;
    f.k_ss = k_ss;
    f.exps = balance;
    if (global) {
      f.q_sums = partial_q;
      f.qbar = qbar;
    }
  }
  RowsJob jq = rows_job(q, Gq, Sq, Sqp, mean_q, true, true, q_packed, q_scales);
  RowsJob jk = rows_job(k, Gk, Sk, Skp, mean_k, false, false, k_packed, k_scales);
  jq.search = jk.search = search;
  if (balance != nullptr) {
    jq.bal = jk.bal = balance;
    jq.bal_div = rep;
    jq.bal_q = true;
  }
  if (global) {
    jk.u = qbar;
    jk.rep = rep;
    jk.ds_key = ds_key;
    jk.res = k_res;
  }
  return with_dtype(dtype, [&](auto t) {
    return launch_all<decltype(t)>(sq, sk, f, Gk, jq, jk, D, rotate, stream);
  });
}

int64_t sampled_tiles(int64_t S) {
  return S <= 0 ? 0 : mean_samples(static_cast<uint32_t>(std::min<int64_t>(ceil_div(S, kRows), kMeanSamples)));
}

int max_correction_heads(int64_t D) {
  return D > 0 && D <= kMaxD && D % 16 == 0 ? max_correction_heads(static_cast<int>(D)) : 0;
}

int qk_balance(const void* q, const void* k, DType dtype, int64_t Gq, int64_t Sq, int64_t Gk, int64_t Sk, int64_t D,
               float* part, float* exps, cudaStream_t stream) {
  if (!rotation_applies(static_cast<int>(D)) || Sq < 1 || Sk < 1 || Gk < 1 || Gq % Gk != 0 || Gq > 0x7FFFFFFF ||
      Gk > 0x7FFFFFFF)
    return cudaErrorInvalidValue;
  if (Gq == 0) return cudaSuccess;
  const SampleSrc s = sample_src(q, Gq, Sq, nullptr, part);
  const SampleSrc sk = sample_src(k, Gk, Sk, nullptr, part + static_cast<int64_t>(Gq) * s.ns * D);
  SampleMeans f{};
  f.q_ss = part;
  f.k_ss = sk.ss;
  f.nsq = s.ns;
  f.nsk = sk.ns;
  f.k_rows = sample_rows(Sk, sk.nt, sk.ns);
  f.rep = static_cast<uint32_t>(Gq / Gk);
  f.q_rows = sample_rows(Sq, s.nt, s.ns);
  f.exps = exps;
  return with_dtype(dtype, [&](auto t) {
    using T = decltype(t);
    const int e = D == 64 ? launch_sums_p<T, 2>(s, sk, D, stream) : launch_sums_p<T, 4>(s, sk, D, stream);
    return e == cudaSuccess ? launch_means(f, Gk, D, false, stream) : e;
  });
}

}  // namespace sageattn3
