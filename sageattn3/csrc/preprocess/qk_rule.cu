// The "auto" rule's estimates (reference.qk_fp4_error, reference.pv_p_error) in one launch.
//
// What each estimate compares, per q head, on the rule's sample (every s-th row of Q's sampled
// 128-row blocks, s = query_stride: 8 on long calls, down to 1 on short ones; every row of K's
// sampled blocks, at most 1024 keys): the output of exact scores against the output of the
// scores or the P that FP4 gives.
// - Q.K^T's (kFirst): L = c * Q_s K_s^T (the preprocessing's smoothed rows) against
//   L4 = c * Qd Kd^T (their FP4 codes, dequantized); O = softmax(L) V, O4 = softmax(L4) V.
// - The floor's (kFloor, options as floors: reference.qk_fp4_error step 5): the same on the
//   defaults' rows, raw minus the options-free means, their codes quantized here (quant16).
// - P's (kPv, the FP8 P.V choice): the exact scores of the whole rows, P = e^(L - m) * 2688 per
//   32-key chunk (m the running max) quantized to NVFP4 along the keys, against P unquantized;
//   and V's share (VHatChunk): each key's squared NVFP4 V error weighted by its exact P squared,
//   over kVFactor; the head's estimate is the larger of the two.
//
// The exact scores, up to a constant per row (which no softmax sees): the balance's powers of
// two cancel in each channel's product, the rotation scales every dot product by D/64 (which
// the score scale takes back), and K's mean only adds a constant per row. So for each estimate
// L = c' * (q - w) k^T + const(row), with q and k the raw fp16/bf16 rows, c' the scale of the
// unrotated scores and w Q's options-free mean (reference.options_free_means; zero for P's
// estimate, whose rows keep their mean). q - w is split into three 16-bit parts and k is exact
// in its own type, so three m16n8k16 MMAs with fp32 accumulation give the scores to fp32
// accuracy. The FP4 values (E2M1 x E4M3: at most 6 significant bits) are exact in bf16, P's
// quantized values times 2688 too; P itself goes in two 16-bit parts.
//
// Layout: a block holds kPairs row groups (16 sampled rows each) of one (batch, q head) and one
// estimate (blockIdx.z); each group is a pair of warps, the first on the exact scores, the
// second on the FP4 ones, each with its online softmax and output in registers (flash-attention
// style: the scores' accumulator fragments are P.V's operand fragments). The block stages each
// 32-key chunk of K, V and K's FP4 values in shared memory once for its groups, the next chunk's
// bytes loaded into registers meanwhile. At the end each pair's second warp hands O4 to the
// first through shared memory, which sums (O4 - O)^2 and O^2 over its real rows into
// `partial`; the last warp of a head to report, over every estimate of the grid (an integer
// counter per head, which it resets), adds each estimate's partials in row group order and
// writes sqrt(num / max(den, 1e-30)) (P's) or, for Q.K^T's, that ratio plus kSpreadZ standard
// errors of it under the square root (spread_bound: a head whose error sits on a few rows, as
// near a key with a huge norm, varies most from sample to sample), and the selection. No
// floating-point atomics: the result is the same on every run.
//
// The second statistic (D 128, a.qk16_limit >= 0; reference.qk16_stat): the Q.K^T blocks (kFirst)
// also sum the squares of their sampled rows minus w (each row group its own) and of the keys of K's
// first sampled block minus K's options-free mean (its chunks c with c % gridDim.y == blockIdx.y,
// each block a share: summed over all 1024 sampled keys the statistic cost the D 128 rule 0.02 ms of
// its 0.09 on the H200 at 24 heads x 32k); the last warp adds them in order:
// c' sqrt(q2 / rows * k2 / keys / D). A head that leaves FP4 and exceeds the limit gets bit 2 of
// sel_q (the raw 16-bit rows).
//
// P's estimate (kPv): a head whose estimate exceeds a.pv_limit takes FP8 P.V: bit 1 of sel_q,
// and sel_v of its kv head set. For a causal attention (a.causal) it masks the sampled keys
// after each sampled row's position, as the attention does (key 0 is sampled and seen by every
// row, so each row's running max is finite from the first chunk on).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <type_traits>

#include "common/launch.cuh"
#include "common/mma16.cuh"
#include "common/nvfp4.cuh"
#include "preprocess/rotation.cuh"
#include "sageattn3.h"

namespace sageattn3 {
namespace {

constexpr int kPairs = 2;            // row groups per block
constexpr int kThreads = 64 * kPairs;  // a pair of warps per group
constexpr int kRows = 16;            // query rows per group (one m16 tile)
constexpr int kStride = 8;           // reference.AUTO_QUERY_STRIDE: the rows' stride on long calls
constexpr int kChunk = 32;           // keys per staged chunk (reference.PV_CHUNK)
constexpr int kBlock = 128;          // the sampled blocks' rows
constexpr int kSampled = 8;          // reference.MEAN_SAMPLE_BLOCKS
constexpr int kUnits = kSampled * kBlock / kRows;  // a head's most row groups (stride 1)
// reference.query_stride's budget: 1.5 x a long call's sampled rows times its sampled keys
constexpr int64_t kRowKeyBudget = static_cast<int64_t>(kSampled) * kBlock / kStride * kSampled * kBlock * 3 / 2;
// A row group's partial sums, in floats: n, d, then the rows' sums of n^2, d^2 and n d as three doubles
// (floats 2-7: squares of float32 row sums leave float32's range where |V| is below about 1e-11 or
// above about 1e8, and the spread would stop being scale-invariant).
constexpr int kSums = 8;
constexpr double kSpreadZ = 3.0;     // reference.AUTO_ERROR_SPREAD: standard errors added to Q.K^T's estimates
constexpr float kPScale = 2688.0f;  // 448 * 6: P's row max at the top of E4M3 x E2M1 (the attention's level 1)
constexpr float kVFactor = 1.5f;    // reference.PV_V_FACTOR: V's share of P's estimate counts against pv_limit x this
constexpr int kVTile = 128;         // keys per V tile exponent (reference.V_TILE)
constexpr int kVGroup = 32;         // channels per V tile exponent (reference.V_GROUP)
// P in two fp16 parts is scaled up by 2^14 first: P of large-logit rows sits near e^-10, below
// fp16's smallest normal (2^-14), where both parts would lose bits. bf16 has fp32's exponents.
template <typename T>
constexpr float kPUp = std::is_same_v<T, f16_t> ? 0x1p14f : 1.0f;

// Shared memory, in 16-bit elements then floats. Rows of kP elements: the 8 rows an ldmatrix
// reads land 16 bytes apart modulo 128 (no bank conflict).
template <int D>
struct Smem {
  static constexpr int kP = D + 8;
  static constexpr int kTile = kRows * kP;
  static constexpr int kQ = 0;                      // [pair][exact parts 0, 1, 2, FP4 values][kRows][kP]
  static constexpr int kK = kQ + kPairs * 4 * kTile;  // the chunk's raw K [kChunk][kP]
  static constexpr int kKd = kK + kChunk * kP;        // its FP4 values (bf16)
  static constexpr int kV = kKd + kChunk * kP;        // its V
  static constexpr int kHalves = kV + kChunk * kP;
  static constexpr int kW = kHalves / 2;           // floats: [pair][D] Q's options-free mean
  static constexpr int kMk = kW + kPairs * D;      // K's options-free mean (the floor's rows)
  static constexpr int kEps = kMk + D;             // P's blocks: [D / 32][kChunk] V's squared error per key, by channel group
  static constexpr int kFloats = kEps + D / 32 * kChunk;
  static constexpr size_t kBytes = static_cast<size_t>(kFloats) * sizeof(float);
  static constexpr int kOPitch = D + 4;  // O4 handed over (floats, over the pair's Q area)
  static_assert(kRows * kOPitch * 2 <= 4 * kTile, "O4 fits the pair's Q area");
};
// The kernel's static shared memory: the sampled key blocks' first rows and real-key counts.
constexpr size_t kStaticBytes = kSampled * (sizeof(int64_t) + sizeof(int));
static_assert(2 * (Smem<64>::kBytes + kStaticBytes + 1024) <= 100 * 1024, "D 64: two blocks per SM on sm_120");
static_assert(Smem<128>::kBytes + kStaticBytes + 1024 <= 100 * 1024, "D 128 fits sm_120");

/* ---------- 16-bit operands and the MMA ---------- */

// x rounded to T (bf16 or fp16), as a float
template <typename T>
__device__ __forceinline__ float round16(float x) {
  if constexpr (std::is_same_v<T, bf16_t>) return __bfloat162float(__float2bfloat16_rn(x));
  else return __half2float(__float2half_rn(x));
}

// two floats -> one word of T (lo in the low half), rounded to nearest
template <typename T>
__device__ __forceinline__ uint32_t pack2(float lo, float hi) {
  if constexpr (std::is_same_v<T, bf16_t>) {
    const __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&h);
  } else {
    const __half2 h = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&h);
  }
}

// 16 values (floats, each exact in T or bf16) to 16-bit shared memory, two 16-byte stores
template <typename T>
__device__ __forceinline__ void store16(uint16_t* dst, const float (&v)[16]) {
  uint32_t w[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) w[i] = pack2<T>(v[2 * i], v[2 * i + 1]);
  reinterpret_cast<uint4*>(dst)[0] = make_uint4(w[0], w[1], w[2], w[3]);
  reinterpret_cast<uint4*>(dst)[1] = make_uint4(w[4], w[5], w[6], w[7]);
}

// One NVFP4 block's 16 codes (8 bytes, element i in nibble i) times its E4M3 scale byte, exactly.
__device__ __forceinline__ void fp4_values16(uint2 codes, uint32_t sbyte, float (&out)[16]) {
  const float s = __fmul_rn(e4m3_value(sbyte), 16384.0f);  // e2m1x2_scaled gives values * 2^-14
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const float2 f = e2m1x2_scaled(((i < 4 ? codes.x : codes.y) >> (8 * (i % 4))) & 0xFFu);
    out[2 * i] = __fmul_rn(f.x, s);
    out[2 * i + 1] = __fmul_rn(f.y, s);
  }
}

// 16 consecutive fp16/bf16 values from global memory, as floats
template <typename T>
__device__ __forceinline__ void load16(const T* p, float (&v)[16]) {
  float a[8], b[8];
  Load8<T>::run(p, a);
  Load8<T>::run(p + 8, b);
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    v[i] = a[i];
    v[8 + i] = b[i];
  }
}

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xFFFFFFFFu, x, o);
  return x;
}

__device__ __forceinline__ double warp_sum_d(double x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xFFFFFFFFu, x, o);
  return x;
}

__host__ __device__ __forceinline__ int sampled_count(int64_t seq) {
  const int64_t n = ceil_div(seq, kBlock);
  return static_cast<int>(n < kSampled ? n : kSampled);
}

__host__ __device__ __forceinline__ int64_t sampled_block(int64_t seq, int i) {
  const int64_t n = ceil_div(seq, kBlock);
  return (static_cast<int64_t>(i) * n) / sampled_count(seq);
}

// The rows of sampled block i at stride s (its real rows, every s-th from its first).
__host__ __device__ __forceinline__ int64_t block_rows(int64_t seq, int i, int s) {
  const int64_t left = seq - sampled_block(seq, i) * kBlock;
  return ceil_div(left < kBlock ? left : kBlock, s);
}

// reference.query_stride, from the shapes alone: the smallest s of 1, 2, 4 whose sampled rows
// times the sampled keys stay within kRowKeyBudget, else kStride.
int query_stride(const QkRuleArgs& a) {
  int64_t keys = 0;
  for (int i = 0; i < sampled_count(a.Sk); ++i) keys += block_rows(a.Sk, i, 1);
  for (int s = 1; s < kStride; s *= 2) {
    int64_t rows = 0;
    for (int i = 0; i < sampled_count(a.Sq); ++i) rows += block_rows(a.Sq, i, s);
    if (rows * keys <= kRowKeyBudget) return s;
  }
  return kStride;
}

/* ---------- the launch's plan, and a row group's place ---------- */

// What one block estimates (blockIdx.z picks it): Q.K^T's error on the preprocessed rows, the
// same on the defaults' rows (options as floors), or P's error.
enum Estimate : int { kFirst = 0, kFloor = 1, kPv = 2 };

// The launch: the arguments, the estimates of its grid (blockIdx.z -> Estimate), the rows'
// stride and row groups.
struct RuleGrid {
  QkRuleArgs a;
  int estimate[3];
  int nest;
  float scale_exact;  // the unrotated scores' scale (a.scale times D/64 with the rotation; exact)
  int stride;         // query_stride
  int groups;         // row groups per sampled block: kBlock / stride / kRows
  int units;          // row groups per head: sampled_count(Sq) * groups
};

// A row group: rows row0 + stride * r for r < rows (0 for a group past a partial last block,
// which still reports; `report` false past the head's last group).
struct Group {
  int unit;
  bool report;
  int64_t tq;    // its sampled Q block's first row / kBlock
  int64_t row0;
  int rows;
};

__device__ __forceinline__ Group group_of(const RuleGrid& G, int unit) {
  Group u{unit, unit < G.units, 0, 0, 0};
  if (!u.report) return u;
  const int qi = unit / G.groups;
  const int first = (unit % G.groups) * kRows;  // the group's first row among the block's strided rows
  u.tq = sampled_block(G.a.Sq, qi);
  u.row0 = u.tq * kBlock + static_cast<int64_t>(first) * G.stride;
  const int64_t left = block_rows(G.a.Sq, qi, G.stride) - first;
  u.rows = static_cast<int>(left < 0 ? 0 : (left < kRows ? left : kRows));
  return u;
}

/* ---------- a block's phases, in the order it runs them ---------- */

// reference.unrotate of one D-vector in shared memory, by one warp: hadamard_lanes, then each
// channel times its sign and 64/D.
template <int D>
__device__ __forceinline__ void unrotate_row(float* row) {
  constexpr int kV = D / 32;
  const int lane = threadIdx.x & 31;
  float v[kV];
#pragma unroll
  for (int i = 0; i < kV; ++i) v[i] = row[lane * kV + i];
  hadamard_lanes<D>(v, lane);
  __syncwarp();
#pragma unroll
  for (int i = 0; i < kV; ++i) row[lane * kV + i] = __fmul_rn(v[i], __fmul_rn(rotation_sign(lane * kV + i), 64.0f / D));
  __syncwarp();
}

// reference.options_free_means of one mean row (D floats at src) into shared memory, by one
// warp: unrotated (a.rotate), then the balance undone: `sign` +1 for Q's (times 2^e), -1 for
// K's (times 2^-e).
template <int D>
__device__ __forceinline__ void options_free_mean(const QkRuleArgs& a, float* out, const float* src, const float* bal,
                                                  int sign) {
  const int lane = threadIdx.x & 31;
  for (int d = lane; d < D; d += 32) out[d] = src[d];
  __syncwarp();
  if (a.rotate) unrotate_row<D>(out);
  if (bal != nullptr) {
    for (int d = lane; d < D; d += 32) out[d] = __fmul_rn(out[d], ldexpf(1.0f, sign * static_cast<int>(bal[d])));
  }
  __syncwarp();
}

// 16 raw fp16/bf16 values held in two uint4 -> floats
template <typename T>
__device__ __forceinline__ void unpack16(const uint4 (&r)[2], float (&v)[16]) {
  const uint32_t w[8] = {r[0].x, r[0].y, r[0].z, r[0].w, r[1].x, r[1].y, r[1].z, r[1].w};
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    if constexpr (std::is_same_v<T, bf16_t>) {
      v[2 * i] = bf16_lo(w[i]);
      v[2 * i + 1] = bf16_hi(w[i]);
    } else {
      const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&w[i]));
      v[2 * i] = f.x;
      v[2 * i + 1] = f.y;
    }
  }
}

// A group's Q rows into its pair's tiles (rows past `rows` zero), by the pair's 64 threads:
// q - w in three parts of T (q itself, exact, for P's estimate) and the FP4 values: the
// preprocessing's codes (kFirst), or those of q - w quantized here (kFloor: the defaults' rows).
template <typename T, int D>
__device__ __forceinline__ void stage_q(const QkRuleArgs& a, Estimate est, const Group& u, int64_t bh, int stride,
                                        const float* w, uint16_t* tiles, int t64, float& q2) {
  using L = Smem<D>;
  for (int x = t64; x < kRows * D / 16; x += 64) {
    const int r = x / (D / 16), d0 = (x % (D / 16)) * 16;
    float p0[16], p1[16], p2[16], qd[16];
    if (r < u.rows) {
      const int64_t row = u.row0 + static_cast<int64_t>(r) * stride;
      float y[16];
      load16<T>(static_cast<const T*>(a.q) + (bh * a.Sq + row) * D + d0, y);
#pragma unroll
      for (int j = 0; j < 16; ++j) {
        if (est != kPv) y[j] = __fsub_rn(y[j], w[d0 + j]);
        p0[j] = round16<T>(y[j]);
        const float r1 = __fsub_rn(y[j], p0[j]);
        p1[j] = round16<T>(r1);
        p2[j] = round16<T>(__fsub_rn(r1, p1[j]));
      }
      if (est == kFirst) {
#pragma unroll
        for (int j = 0; j < 16; ++j) q2 = fmaf(y[j], y[j], q2);  // the second statistic's |q - w|^2
        const int64_t e = (bh * a.Sqp + row) * D + d0;
        fp4_values16(*reinterpret_cast<const uint2*>(a.q_packed + e / 2), a.q_scales[e / 16], qd);
      } else if (est == kFloor) {
        uint32_t sbyte;
        const uint2 c = quant16(y, sbyte);
        fp4_values16(c, sbyte, qd);
      } else {
#pragma unroll
        for (int j = 0; j < 16; ++j) qd[j] = 0.0f;
      }
    } else {
#pragma unroll
      for (int j = 0; j < 16; ++j) p0[j] = p1[j] = p2[j] = qd[j] = 0.0f;
    }
    store16<T>(tiles + 0 * L::kTile + r * L::kP + d0, p0);
    store16<T>(tiles + 1 * L::kTile + r * L::kP + d0, p1);
    store16<T>(tiles + 2 * L::kTile + r * L::kP + d0, p2);
    store16<bf16_t>(tiles + 3 * L::kTile + r * L::kP + d0, qd);
  }
}

// The next key chunk's raw bytes (K, V, K's FP4 codes and scale), loaded into registers while the
// current one is computed. The chunks: every sampled key block's 32-key chunks that hold a real
// key (only the last sampled block can be partial, so they are the first `nchunks`).
template <typename T, int D>
struct KeyChunk {
  static constexpr int kU = kChunk * D / 16 / kThreads;
  static_assert(kU >= 1 && kU * kThreads == kChunk * D / 16, "the block's threads stage a chunk in whole units");
  uint4 rk[kU][2], rv[kU][2];
  uint2 rc[kU];
  uint32_t rs[kU];
  bool live[kU];

  __device__ __forceinline__ void fetch(const QkRuleArgs& a, Estimate est, const int64_t* tk_tab, const int* cnt_tab,
                                        int64_t bk, int tid, int c) {
    const int64_t tk = tk_tab[c / (kBlock / kChunk)];
    const int off = (c % (kBlock / kChunk)) * kChunk;
    const int count = cnt_tab[c / (kBlock / kChunk)];
#pragma unroll
    for (int i = 0; i < kU; ++i) {
      const int x = tid + i * kThreads, r = x / (D / 16), d0 = (x % (D / 16)) * 16;
      live[i] = off + r < count;
      if (live[i]) {
        const int64_t row = tk + off + r;
        const uint4* pk = reinterpret_cast<const uint4*>(static_cast<const T*>(a.k) + (bk * a.Sk + row) * D + d0);
        const uint4* pv = reinterpret_cast<const uint4*>(static_cast<const T*>(a.v) + (bk * a.Sk + row) * D + d0);
        rk[i][0] = __ldg(pk);
        rk[i][1] = __ldg(pk + 1);
        rv[i][0] = __ldg(pv);
        rv[i][1] = __ldg(pv + 1);
        if (est == kFirst) {  // the floor's rows quantize K here; P's estimate takes no FP4 keys
          const int64_t e = (bk * a.Skp + row) * D + d0;
          rc[i] = __ldg(reinterpret_cast<const uint2*>(a.k_packed + e / 2));
          rs[i] = a.k_scales[e / 16];
        }
      }
    }
  }

  // The sum of (k - mk)^2 over this thread's live keys' values (the second statistic; mk: K's
  // options-free mean)
  __device__ __forceinline__ float sq_dev(const float* mk, int tid) const {
    float acc = 0.0f;
#pragma unroll
    for (int i = 0; i < kU; ++i) {
      if (!live[i]) continue;
      const int d0 = ((tid + i * kThreads) % (D / 16)) * 16;
      float y[16];
      unpack16<T>(rk[i], y);
#pragma unroll
      for (int j = 0; j < 16; ++j) {
        const float e = __fsub_rn(y[j], mk[d0 + j]);
        acc = fmaf(e, e, acc);
      }
    }
    return acc;
  }

  // K and V as they are, and K's FP4 values (kFirst: its codes; kFloor: k - K's options-free
  // mean `mk` quantized here) into shared memory; dead keys zero.
  __device__ __forceinline__ void stage(uint16_t* sm16, const float* mk, Estimate est, int tid) const {
    using L = Smem<D>;
    const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
#pragma unroll
    for (int i = 0; i < kU; ++i) {
      const int x = tid + i * kThreads, r = x / (D / 16), d0 = (x % (D / 16)) * 16;
      uint4* k16 = reinterpret_cast<uint4*>(sm16 + L::kK + r * L::kP + d0);
      uint4* v16 = reinterpret_cast<uint4*>(sm16 + L::kV + r * L::kP + d0);
      k16[0] = live[i] ? rk[i][0] : zero;
      k16[1] = live[i] ? rk[i][1] : zero;
      v16[0] = live[i] ? rv[i][0] : zero;
      v16[1] = live[i] ? rv[i][1] : zero;
      if (est == kPv) continue;
      float kd[16];
      if (!live[i]) {
#pragma unroll
        for (int j = 0; j < 16; ++j) kd[j] = 0.0f;
      } else if (est == kFirst) {
        fp4_values16(rc[i], rs[i], kd);
      } else {
        float y[16];
        unpack16<T>(rk[i], y);
#pragma unroll
        for (int j = 0; j < 16; ++j) y[j] = __fsub_rn(y[j], mk[d0 + j]);
        uint32_t sbyte;
        const uint2 c = quant16(y, sbyte);
        fp4_values16(c, sbyte, kd);
      }
      store16<bf16_t>(sm16 + L::kKd + r * L::kP + d0, kd);
    }
  }
};

// One step of a reduce-scatter over the warp: values 0 .. 2W - 1 to 0 .. W - 1, the lanes with bit
// 2W set keeping the upper W (their partner, across that bit, the lower)
template <int W>
__device__ __forceinline__ void scatter_step(float (&p)[16], int lane) {
  const bool up = (lane & (2 * W)) != 0;
#pragma unroll
  for (int j = 0; j < W; ++j) {
    const float send = up ? p[j] : p[j + W];
    const float keep = up ? p[j + W] : p[j];
    p[j] = __fadd_rn(keep, __shfl_xor_sync(0xFFFFFFFFu, send, 2 * W));
  }
}

// V's share of P's estimate (reference.pv_p_error, step 5): eps_j = ||V-hat_j - V_j||^2 of the
// chunk's keys, V-hat the attention's NVFP4 V (the preprocessing's v_packed, v_scales and v_exp,
// dequantized exactly). The block's threads take (channel, 16-key block) units: the unit's 8 code
// bytes, its scale byte and its tile exponent are fetched a chunk ahead (with KeyChunk's), then
// its 16 squared errors against the staged V are summed over the warp's 32 channels (lane l ends
// with key l / 2's sum) into kEps[channel group][key]; a reader adds the D / 32 groups in order.
template <typename T, int D>
struct VHatChunk {
  static constexpr int kU = 2 * D / kThreads;  // units a thread (2 blocks of 16 keys x D channels)
  static_assert(kU >= 1 && kU * kThreads == 2 * D && kThreads % 32 == 0, "whole units, a warp's in one block");
  uint2 code[kU];
  uint32_t sbyte[kU];
  int exp[kU];

  __device__ __forceinline__ void fetch(const QkRuleArgs& a, int64_t bk, int64_t key0, int tid) {
#pragma unroll
    for (int i = 0; i < kU; ++i) {
      const int x = tid + i * kThreads, c = x % D, blk = x / D;
      const int64_t krow = key0 + 16 * blk;  // within Skp: the sampled blocks are whole 128-key tiles
      const int64_t e = (bk * D + c) * a.Skp + krow;
      code[i] = __ldg(reinterpret_cast<const uint2*>(a.v_packed + e / 2));
      sbyte[i] = a.v_scales[e / 16];
      exp[i] = a.v_exp == nullptr ? 0 : a.v_exp[(bk * (a.Skp / kVTile) + krow / kVTile) * (D / kVGroup) + c / kVGroup];
    }
  }

  // The units' squared errors into kEps, summed over each warp's 32 channels (V staged at kV)
  __device__ __forceinline__ void partials(const uint16_t* sm16, float* sm, int tid) const {
    using L = Smem<D>;
    const int lane = tid & 31;
#pragma unroll
    for (int i = 0; i < kU; ++i) {
      const int x = tid + i * kThreads, c = x % D, blk = x / D;
      float vh[16], p[16];
      fp4_values16(code[i], sbyte[i], vh);
      const float f = __int_as_float((127 - exp[i]) << 23);  // 2^-e, |e| <= 40: exact
#pragma unroll
      for (int j = 0; j < 16; ++j) {
        const uint16_t raw = sm16[L::kV + (16 * blk + j) * L::kP + c];
        const float vr = std::is_same_v<T, bf16_t> ? __uint_as_float(static_cast<uint32_t>(raw) << 16)
                                                   : __half2float(__ushort_as_half(raw));
        const float dv = __fsub_rn(__fmul_rn(vh[j], f), vr);
        p[j] = __fmul_rn(dv, dv);
      }
      // reduce-scatter over the warp: after the steps of 16, 8, 4 and 2 lane l holds key l / 2's
      // sum over 16 lanes, after the step of 1 over all 32
      scatter_step<8>(p, lane);
      scatter_step<4>(p, lane);
      scatter_step<2>(p, lane);
      scatter_step<1>(p, lane);
      p[0] = __fadd_rn(p[0], __shfl_xor_sync(0xFFFFFFFFu, p[0], 1));
      if ((lane & 1) == 0) sm[L::kEps + (c / kVGroup) * kChunk + 16 * blk + (lane >> 1)] = p[0];
    }
  }
};

// The chunk's eps of keys col and col + 1 (the D / 32 channel groups' sums, in order)
template <int D>
__device__ __forceinline__ float2 eps_pair(const float* sm, int col) {
  using L = Smem<D>;
  float2 e = *reinterpret_cast<const float2*>(sm + L::kEps + col);
#pragma unroll
  for (int g = 1; g < D / kVGroup; ++g) {
    const float2 x = *reinterpret_cast<const float2*>(sm + L::kEps + g * kChunk + col);
    e.x = __fadd_rn(e.x, x.x);
    e.y = __fadd_rn(e.y, x.y);
  }
  return e;
}


// The warp's 16 x 32 scores of the chunk, accumulator layout (n-tile nt: keys 8 nt .. 8 nt + 7):
// kParts tiles of Q (from `q`, one tile apart) times the chunk's keys at `kb`, MMAs of TM. Three
// sets of accumulators (one per part, or per k-step modulo 3 with one part) keep the dependent
// MMA chains short; the sets are added at the end, the smallest first.
template <typename TM, int kParts, int D>
__device__ __forceinline__ void chunk_scores(const uint16_t* kb, const uint16_t* q, float (&s)[4][4], int lane) {
  using L = Smem<D>;
  float acc[3][4][4];
#pragma unroll
  for (int i = 0; i < 3; ++i)
#pragma unroll
    for (int nt = 0; nt < 4; ++nt) acc[i][nt][0] = acc[i][nt][1] = acc[i][nt][2] = acc[i][nt][3] = 0.0f;
  const int ar = (lane & 7) + ((lane >> 3) & 1) * 8, ac = (lane >> 4) * 8;  // A: row, column of lane's address
  const int bn = (lane & 7) + (lane >> 4) * 8, bc = ((lane >> 3) & 1) * 8;  // B: key, column
#pragma unroll
  for (int k0 = 0; k0 < D; k0 += 16) {
    uint32_t b[2][4];
    ldmatrix_x4(b[0], kb + bn * L::kP + k0 + bc);
    ldmatrix_x4(b[1], kb + (16 + bn) * L::kP + k0 + bc);
#pragma unroll
    for (int p = 0; p < kParts; ++p) {
      uint32_t a[4];
      ldmatrix_x4(a, q + p * L::kTile + ar * L::kP + k0 + ac);
      const int set = kParts == 1 ? (k0 / 16) % 3 : p;
#pragma unroll
      for (int nt = 0; nt < 4; ++nt) mma_m16n8k16<TM>(acc[set][nt], a, b[nt >> 1][(nt & 1) * 2], b[nt >> 1][(nt & 1) * 2 + 1]);
    }
  }
#pragma unroll
  for (int nt = 0; nt < 4; ++nt)
#pragma unroll
    for (int j = 0; j < 4; ++j) s[nt][j] = __fadd_rn(__fadd_rn(acc[2][nt][j], acc[1][nt][j]), acc[0][nt][j]);
}

// 2^x (ex2.approx: a relative error of about 2^-22; 2^-inf = +0, NaN stays NaN)
__device__ __forceinline__ float exp2_approx(float x) {
  float y;
  asm("ex2.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// Online softmax of the chunk's scores in base 2 (scale2: the scores' scale times log2 e), in
// registers: the keys below live[h] are real for rows g (h 0) and g + 8 (h 1); s becomes
// 2^(x - m) = e^(scaled score - max) (0 for a dead key), m and l the running max (base 2) and sum
// (per thread: the quad's sum at the end), O rescaled where a row's max moved.
template <int D>
__device__ __forceinline__ void chunk_softmax(float (&s)[4][4], float scale2, const int (&live)[2], float (&m)[2],
                                              float (&l)[2], float (&o)[D / 8][4], int lane) {
  const int t = lane & 3;
  float a2[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float mx = -INFINITY;
    if (live[h] >= kChunk) {  // every key real (the common case: no compare)
#pragma unroll
      for (int nt = 0; nt < 4; ++nt) {
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          s[nt][2 * h + j] = __fmul_rn(s[nt][2 * h + j], scale2);
          mx = fmaxf(mx, s[nt][2 * h + j]);
        }
      }
    } else {
#pragma unroll
      for (int nt = 0; nt < 4; ++nt) {
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          const float x = nt * 8 + 2 * t + j < live[h] ? __fmul_rn(s[nt][2 * h + j], scale2) : -INFINITY;
          s[nt][2 * h + j] = x;
          mx = fmaxf(mx, x);
        }
      }
    }
    mx = fmaxf(mx, __shfl_xor_sync(0xFFFFFFFFu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xFFFFFFFFu, mx, 2));
    const float mn = fmaxf(m[h], mx);
    // a row that has seen no live key yet keeps its empty state (-inf - -inf would be NaN); key 0
    // is seen by every row, so this is a guard
    const float base = mn == -INFINITY ? 0.0f : mn;
    const float alpha = exp2_approx(m[h] - base);
    float sum = 0.0f;
#pragma unroll
    for (int nt = 0; nt < 4; ++nt) {
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const float e = exp2_approx(s[nt][2 * h + j] - base);
        s[nt][2 * h + j] = e;
        sum += e;
      }
    }
    l[h] = l[h] * alpha + sum;
    m[h] = mn;
    a2[h] = alpha;
  }
  // O rescaled, unless no row of the warp's max moved (alpha 1: the product would not change O)
  if (__any_sync(0xFFFFFFFFu, a2[0] != 1.0f || a2[1] != 1.0f)) {
#pragma unroll
    for (int i = 0; i < D / 8; ++i) {
      o[i][0] *= a2[0];
      o[i][1] *= a2[0];
      o[i][2] *= a2[1];
      o[i][3] *= a2[1];
    }
  }
}

// P's rows' sums of P^2 eps over the chunk (kind 0 of P's estimate, after chunk_softmax: s = e^(L - m)
// with the running max m, which moved from m_old): pe rescaled by the square of the rescale of O.
template <int D>
__device__ __forceinline__ void chunk_pe(const float (&s)[4][4], const float (&m_old)[2], const float (&m)[2],
                                         const float* sm, int lane, float (&pe)[2]) {
  const int t = lane & 3;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const float base = m[h] == -INFINITY ? 0.0f : m[h];
    const float alpha = exp2_approx(m_old[h] - base);  // chunk_softmax's
    pe[h] = __fmul_rn(pe[h], __fmul_rn(alpha, alpha));
  }
#pragma unroll
  for (int nt = 0; nt < 4; ++nt) {
    const float2 e = eps_pair<D>(sm, nt * 8 + 2 * t);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      pe[h] = fmaf(__fmul_rn(s[nt][2 * h], s[nt][2 * h]), e.x, pe[h]);
      pe[h] = fmaf(__fmul_rn(s[nt][2 * h + 1], s[nt][2 * h + 1]), e.y, pe[h]);
    }
  }
}

// P's estimate: the chunk's P * 2688 to NVFP4 per row and 16-key block (n-tiles 0-1, 2-3;
// reference.quantize_rows: the block's amax, its E4M3 scale, each value's E2M1 code), in place
// as the values code x scale (P-hat x 2688: exact in 16 bits). Each thread holds 4 values of a
// block, the quad the other 12 (amax by shuffles, max.NaN: the same bits in any order); one
// conversion takes a row's 4 + 4 values of both blocks, each times its block's 1/scale (codes16's
// steps; the clamp keeps every |value| < 7 at its code, nvfp4.cuh), and a block whose scale is 0
// or NaN gets codes 0.
__device__ __forceinline__ void quantize_p(float (&s)[4][4]) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float y[8], sc[2];
    bool ok[2];
#pragma unroll
    for (int b = 0; b < 2; ++b) {
      const float v[4] = {__fmul_rn(s[2 * b][2 * h], kPScale), __fmul_rn(s[2 * b][2 * h + 1], kPScale),
                          __fmul_rn(s[2 * b + 1][2 * h], kPScale), __fmul_rn(s[2 * b + 1][2 * h + 1], kPScale)};
      float amax = 0.0f;
#pragma unroll
      for (int i = 0; i < 4; ++i) amax = abs_max_nan(amax, v[i]);
      amax = abs_max_nan(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, 1));
      amax = abs_max_nan(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, 2));
      sc[b] = e4m3_value(e4m3_scale_byte(amax));
      ok[b] = sc[b] > 0.0f;  // false for 0 and NaN
      const float inv = ok[b] ? __frcp_rn(sc[b]) : 0.0f;
      const float mul = SAGEATTN3_HW_E2M1 ? inv : inv * kE2M1Prescale;  // the software conversion's pre-scale
#pragma unroll
      for (int i = 0; i < 4; ++i) y[4 * b + i] = __fmul_rn(v[i], mul);
    }
#if SAGEATTN3_HW_E2M1
    uint32_t w = e2m1x8_hw(y);
#else
    uint32_t w = e2m1x8_sw<true>(y);
#endif
    if (!ok[0]) w &= 0xFFFF0000u;
    if (!ok[1]) w &= 0x0000FFFFu;
#pragma unroll
    for (int b = 0; b < 2; ++b) {
      const float s14 = __fmul_rn(sc[b], 16384.0f);  // e2m1x2_scaled gives values * 2^-14
      const float2 f0 = e2m1x2_scaled((w >> (16 * b)) & 0xFFu), f1 = e2m1x2_scaled((w >> (16 * b + 8)) & 0xFFu);
      s[2 * b][2 * h] = __fmul_rn(f0.x, s14);
      s[2 * b][2 * h + 1] = __fmul_rn(f0.y, s14);
      s[2 * b + 1][2 * h] = __fmul_rn(f1.x, s14);
      s[2 * b + 1][2 * h + 1] = __fmul_rn(f1.y, s14);
    }
  }
}

// O += P V over the chunk for kCols channels of V from `v` (n-tiles kNt0 .. of o), P from the
// scores' fragments (keys 16 kk .. 16 kk + 15: n-tiles 2 kk and 2 kk + 1, whose accumulators are
// the A operand's registers), in `parts` parts of T (2: P x kPUp = hi + lo, so O comes out kPUp
// times too large; 1: P's values are exact in T, as they are).
template <typename T, int D, int kCols, int kNt0>
__device__ __forceinline__ void chunk_pv(const uint16_t* v, const float (&s)[4][4], int parts, float (&o)[D / 8][4],
                                         int lane) {
  using L = Smem<D>;
  const int vk = (lane & 7) + ((lane >> 3) & 1) * 8, vc = (lane >> 4) * 8;  // V: key, column of lane's address
#pragma unroll
  for (int kk = 0; kk < 2; ++kk) {
    const float x[8] = {s[2 * kk][0], s[2 * kk][1], s[2 * kk][2], s[2 * kk][3],
                        s[2 * kk + 1][0], s[2 * kk + 1][1], s[2 * kk + 1][2], s[2 * kk + 1][3]};
    float xh[8], xl[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const float xs = parts > 1 ? __fmul_rn(x[i], kPUp<T>) : x[i];  // exact: a power of two
      xh[i] = round16<T>(xs);
      xl[i] = __fsub_rn(xs, xh[i]);
    }
    const uint32_t hi[4] = {pack2<T>(xh[0], xh[1]), pack2<T>(xh[2], xh[3]), pack2<T>(xh[4], xh[5]),
                            pack2<T>(xh[6], xh[7])};
    const uint32_t lo[4] = {pack2<T>(xl[0], xl[1]), pack2<T>(xl[2], xl[3]), pack2<T>(xl[4], xl[5]),
                            pack2<T>(xl[6], xl[7])};
#pragma unroll
    for (int n0 = 0; n0 < kCols; n0 += 16) {
      uint32_t b[4];
      ldmatrix_x4<true>(b, v + (kk * 16 + vk) * L::kP + n0 + vc);
      const int nt = kNt0 + n0 / 8;
      mma_m16n8k16<T>(o[nt], hi, b[0], b[1]);
      mma_m16n8k16<T>(o[nt + 1], hi, b[2], b[3]);
      if (parts > 1) {
        mma_m16n8k16<T>(o[nt], lo, b[0], b[1]);
        mma_m16n8k16<T>(o[nt + 1], lo, b[2], b[3]);
      }
    }
  }
}

// n, d = the warp's sums of (O4 - O)^2 and O^2 over the real rows (r < rows): O4 from o4s
// (shared memory, [kRows][kOPitch]), or with kPv O_P from o's n-tiles D / 16 .. (O in 0 ..).
// inv: 1 / (the row sum x kPUp) for the outputs of P in two parts, inv_p: 1 / the row sum.
// Without kPv also the spread of the rows' own sums (a row's n_r and d_r): v = (sum n_r^2,
// sum d_r^2, sum n_r d_r) over the warp's rows (n and d themselves keep their order of sums).
template <int D, bool kPv>
__device__ __forceinline__ void error_sums(const float (&o)[D / 8][4], const float* o4s, const float (&inv)[2],
                                           const float (&inv_p)[2], int rows, int lane, float& n, float& d,
                                           double (&v)[3]) {
  using L = Smem<D>;
  const int g = lane >> 2, t = lane & 3;
  float rn[2] = {0.0f, 0.0f}, rd[2] = {0.0f, 0.0f};  // rows g and g + 8: this lane's share
#pragma unroll
  for (int nt = 0; nt < (kPv ? D / 16 : D / 8); ++nt) {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int r = g + (j >> 1) * 8, col = nt * 8 + 2 * t + (j & 1);
      if (r < rows) {
        const float e = o[nt][j] * inv[j >> 1];
        float other;
        if constexpr (kPv) other = __fdiv_rn(o[nt + D / 16][j], kPScale) * inv_p[j >> 1];  // as P-hat / 2688 first
        else other = o4s[r * L::kOPitch + col];
        const float dlt = other - e;
        n += dlt * dlt;
        d += e * e;
        if constexpr (!kPv) {
          rn[j >> 1] += dlt * dlt;
          rd[j >> 1] += e * e;
        }
      }
    }
  }
  n = warp_sum(n);
  d = warp_sum(d);
  v[0] = v[1] = v[2] = 0.0;
  if constexpr (!kPv) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {  // the row's sums over its quad, then its products (lane t 0 counts them)
      rn[h] += __shfl_xor_sync(0xFFFFFFFFu, rn[h], 1);
      rn[h] += __shfl_xor_sync(0xFFFFFFFFu, rn[h], 2);
      rd[h] += __shfl_xor_sync(0xFFFFFFFFu, rd[h], 1);
      rd[h] += __shfl_xor_sync(0xFFFFFFFFu, rd[h], 2);
      if (t == 0) {  // float x float is exact in double
        v[0] += static_cast<double>(rn[h]) * rn[h];
        v[1] += static_cast<double>(rd[h]) * rd[h];
        v[2] += static_cast<double>(rn[h]) * rd[h];
      }
    }
#pragma unroll
    for (int i = 0; i < 3; ++i) v[i] = warp_sum_d(v[i]);
  }
}

// The group's sums of (O4 - O)^2 and O^2 over its real rows (r < rows), into n and d of lane 0
// of its first warp (kind 0), the outputs normalized (the outputs of P in two parts divided by
// kPUp too; O_P divided by 2688 first: P-hat x 2688 went in, and a P-hat of 1 then gives O
// exactly, as the reference's P-hat / 2688 does).
// Q.K^T's estimates: the second warp's O4 through `x` (the pair's Q area) to the first. P's: each
// warp sums over its half of the channels (O in n-tiles 0 .., O_P in D / 16 ..), the second's
// sums through `x`. Called by every warp of the block (two block-wide barriers).
template <typename T, int D>
__device__ __forceinline__ void group_error(const float (&o)[D / 8][4], float (&l)[2], float (&pe)[2], bool pv,
                                            int kind, int rows, float* x, int lane, float& n, float& d,
                                            double (&v)[3]) {
  using L = Smem<D>;
  const int g = lane >> 2, t = lane & 3;
  float inv[2], inv_p[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    l[h] += __shfl_xor_sync(0xFFFFFFFFu, l[h], 1);
    l[h] += __shfl_xor_sync(0xFFFFFFFFu, l[h], 2);
    inv_p[h] = 1.0f / l[h];
    inv[h] = __fmul_rn(inv_p[h], 1.0f / kPUp<T>);  // exact: a power of two
  }
  __syncthreads();  // every warp's reads of the Q tiles are done
  v[0] = v[1] = v[2] = 0.0;
  if (pv) {
    error_sums<D, true>(o, nullptr, inv, inv_p, rows, lane, n, d, v);
    if (kind == 1 && lane == 0) {
      x[0] = n;
      x[1] = d;
    }
  } else if (kind == 1 && rows > 0) {
#pragma unroll
    for (int nt = 0; nt < D / 8; ++nt) {
      const int col = nt * 8 + 2 * t;
      *reinterpret_cast<float2*>(x + g * L::kOPitch + col) = make_float2(o[nt][0] * inv[0], o[nt][1] * inv[0]);
      *reinterpret_cast<float2*>(x + (g + 8) * L::kOPitch + col) = make_float2(o[nt][2] * inv[1], o[nt][3] * inv[1]);
    }
  }
  __syncthreads();
  if (kind != 0) return;
  if (pv) {
    n += x[0];
    d += x[1];
    // V's share: sum over the real rows of pe / l^2 (pe over the row's quad first), into v[0]
    float nv = 0.0f;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      pe[h] = __fadd_rn(pe[h], __shfl_xor_sync(0xFFFFFFFFu, pe[h], 1));
      pe[h] = __fadd_rn(pe[h], __shfl_xor_sync(0xFFFFFFFFu, pe[h], 2));
      if (t == 0 && g + 8 * h < rows) nv = fmaf(pe[h], __fmul_rn(inv_p[h], inv_p[h]), nv);
    }
    v[0] = warp_sum(nv);
  } else {
    error_sums<D, false>(o, x, inv, inv_p, rows, lane, n, d, v);
  }
}

// Lane 0 of a group's first warp, with the group's sums (n, d) (row group `unit`): they go to `partial`; the last
// block of the head to finish (of every estimate in the grid) adds each estimate's partials in
// row group order and writes the head's errors and selection.
// The second statistic's partial sums, after the estimates' (n, d): per head, the row groups' q2, then
// the blocks' k2 (blockIdx.y).
__device__ __forceinline__ float* stat_partial(const QkRuleArgs& a, int64_t bh) {
  return a.partial + 3 * (a.B * a.Hq) * kUnits * kSums + bh * 2 * kUnits;
}

// Whether a launch computes the second statistic (reference.qk16_stat): D 128 with a limit.
__device__ __forceinline__ bool stat_on(const QkRuleArgs& a) { return a.D == 128 && a.qk16_limit >= 0.0f; }

// The head's second statistic from the partials (the last warp): c' sqrt(q2 / rows * k2 / keys / D).
__device__ __forceinline__ float head_stat(const RuleGrid& G, int64_t bh) {
  const QkRuleArgs& a = G.a;
  const float* sp = stat_partial(a, bh);
  float q2 = 0.0f, k2 = 0.0f;
  int64_t rows = 0, keys = 0;
  for (int i = 0; i < G.units; ++i) {
    q2 += __ldcg(sp + i);
    rows += group_of(G, i).rows;
  }
  for (int y = 0; y < static_cast<int>(gridDim.y); ++y) k2 += __ldcg(sp + kUnits + y);
  keys = block_rows(a.Sk, 0, 1);  // K's first sampled block
  const float q_ms = q2 / static_cast<float>(max(rows, static_cast<int64_t>(1)));
  const float k_ms = k2 / static_cast<float>(max(keys, static_cast<int64_t>(1)));
  return G.scale_exact * sqrtf(q_ms * k_ms / static_cast<float>(a.D));
}

// Q.K^T's estimate with the spread of its rows (reference.spread_bound): r = n / d over the sample
// plus kSpreadZ standard errors of that ratio, from the rows' n_r - r d_r (their sums of squares
// and products sv) with the finite-population factor 1 - rows / seq (0 where every query row is
// read: no sampling error left): r + z sqrt(sum (n_r - r d_r)^2 rows / (rows - 1) (1 - rows / seq))
// / d, in double (the row terms' squares summed in double: error_sums), and its square root; the
// plain sqrt(r) where that is not finite (the float32 row terms themselves out of range: |V| near
// 1e18).
__device__ __forceinline__ float spread_bound(float n, float d, const double (&sv)[3], int64_t rows, int64_t seq) {
  const float r = n / fmaxf(d, 1e-30f);
  if (rows < 2 || !(d > 0.0f) || rows >= seq) return sqrtf(r);
  const double rr = r;
  const double res = sv[0] - 2.0 * rr * sv[2] + rr * rr * sv[1];
  const double fpc = 1.0 - static_cast<double>(rows) / static_cast<double>(seq);
  const double se = sqrt(fmax(res, 0.0) * static_cast<double>(rows) / static_cast<double>(rows - 1) * fpc) / d;
  const double bound = sqrt(rr + kSpreadZ * se);
  return isfinite(res) && isfinite(bound) ? static_cast<float>(bound) : sqrtf(r);
}

__device__ __forceinline__ void head_error(const RuleGrid& G, int64_t bh, int unit, int z, float n, float d,
                                           const double (&v)[3], float q2) {
  const QkRuleArgs& a = G.a;
  const int64_t BH = a.B * a.Hq;
  float* mine = a.partial + ((z * BH + bh) * kUnits + unit) * kSums;
  mine[0] = n;
  mine[1] = d;
  for (int i = 0; i < 3; ++i) reinterpret_cast<double*>(mine + 2)[i] = v[i];  // 8-byte aligned: kSums even
  if (G.estimate[z] == kFirst && stat_on(a)) stat_partial(a, bh)[unit] = q2;
  __threadfence();
  if (atomicAdd(a.counter + bh, 1) != G.units * G.nest - 1) return;
  __threadfence();
  const auto estimate = [&](int zz) {  // estimate zz of the grid from its partials, in row group order
    float sn = 0.0f, sd = 0.0f;
    double sv[3] = {0.0, 0.0, 0.0};
    int64_t rows = 0;
    for (int i = 0; i < G.units; ++i) {
      const float* p = a.partial + ((zz * BH + bh) * kUnits + i) * kSums;
      sn += __ldcg(p);
      sd += __ldcg(p + 1);
      for (int k = 0; k < 3; ++k) sv[k] += __ldcg(reinterpret_cast<const double*>(p + 2) + k);
      rows += group_of(G, i).rows;
    }
    if (G.estimate[zz] == kPv) {  // P's: its ratio, and V's share over kVFactor (NaN if either is)
      const float ep = sqrtf(sn / fmaxf(sd, 1e-30f)), ev = sqrtf(static_cast<float>(sv[0]) / fmaxf(sd, 1e-30f));
      return (ep != ep || ev != ev) ? __int_as_float(0x7fc00000) : fmaxf(ep, ev / kVFactor);
    }
    return spread_bound(sn, sd, sv, rows, a.Sq);
  };
  a.counter[bh] = 0;  // ready for the next launch
  int z_first = 0, z_floor = -1, z_pv = -1;
  for (int zz = 0; zz < G.nest; ++zz) {
    if (G.estimate[zz] == kFirst) z_first = zz;
    if (G.estimate[zz] == kFloor) z_floor = zz;
    if (G.estimate[zz] == kPv) z_pv = zz;
  }
  float err = estimate(z_first);
  if (z_floor >= 0) {  // the larger of the two, NaN if either is
    const float fl = estimate(z_floor);
    err = (err != err || fl != fl) ? __int_as_float(0x7fc00000) : fmaxf(err, fl);
  }
  a.error[bh] = err;
  const int64_t kv = (bh / a.Hq) * a.Hkv + (bh % a.Hq) / (a.Hq / a.Hkv);
  uint32_t byte = 0;
  if (a.select_all != 0 || err > a.limit) {  // a NaN estimate keeps FP4
    byte = 1;
    a.sel_k[kv] = 1;
  }
  if (a.error_pv != nullptr) {  // FP8 P.V: bit 1 of the head's byte
    const float epv = z_pv >= 0 ? estimate(z_pv) : __int_as_float(0x7fc00000);
    a.error_pv[bh] = epv;
    if (z_pv >= 0 && epv > a.pv_limit) {  // sel_v set: qk_rule_error checks it
      byte |= 2;
      a.sel_v[kv] = 1;
    }
  }
  // the raw 16-bit rows: bit 2, for a head that leaves FP4 (a NaN keeps MXFP8); NaN where off
  const float st = stat_on(a) ? head_stat(G, bh) : __int_as_float(0x7fc00000);
  if (a.qk16_stat != nullptr) a.qk16_stat[bh] = st;
  if ((byte & 1u) != 0u && st > a.qk16_limit) byte |= 4;
  a.sel_q[bh] = static_cast<uint8_t>(byte);
}


// The second statistic's sums at the loop's end (every thread of a block with `stat`): by warp into
// the pairs' w (dead since stage_q), then the block's k2 to its partial (thread 0) and the pair's q2
// (returned).
template <int D>
__device__ __forceinline__ float stat_sums(const QkRuleArgs& a, int64_t bh, float* sm, int tid, float q2, float k2) {
  using L = Smem<D>;
  const int warp = tid >> 5, lane = tid & 31, pair = warp >> 1;
  const float qw = warp_sum(q2), kw = warp_sum(k2);
  __syncthreads();
  if (lane == 0) sm[L::kW + 2 * warp] = qw, sm[L::kW + 2 * warp + 1] = kw;
  __syncthreads();
  if (tid == 0) {
    float kb = 0.0f;
    for (int i = 0; i < kThreads / 32; ++i) kb += sm[L::kW + 2 * i + 1];
    stat_partial(a, bh)[kUnits + blockIdx.y] = kb;
    __threadfence();
  }
  const float mine = sm[L::kW + 4 * pair] + sm[L::kW + 4 * pair + 2];  // the pair's two warps
  __syncthreads();  // thread 0's k2 before any group of the block reports
  return mine;
}

/* ---------- the kernel ---------- */

template <typename T, int D>
__global__ void __launch_bounds__(kThreads) qk_rule_kernel(const __grid_constant__ RuleGrid G) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  using L = Smem<D>;
  extern __shared__ __align__(16) float sm[];
  __shared__ int64_t tk_tab[kSampled];  // kStaticBytes counts these two
  __shared__ int cnt_tab[kSampled];
  uint16_t* sm16 = reinterpret_cast<uint16_t*>(sm);
  const QkRuleArgs& a = G.a;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, pair = warp >> 1, kind = warp & 1;
  const int64_t bh = blockIdx.x;  // batch * Hq + q head
  const int z = blockIdx.z;
  const Estimate est = static_cast<Estimate>(G.estimate[z]);
  const int64_t b = bh / a.Hq, h = bh % a.Hq;
  const int64_t bk = b * a.Hkv + h / (a.Hq / a.Hkv);  // its kv head, flattened
  const Group u = group_of(G, blockIdx.y * kPairs + pair);
  uint16_t* tiles = sm16 + L::kQ + pair * 4 * L::kTile;
  float* w = sm + L::kW + pair * D;
  const int kblocks = sampled_count(a.Sk);
  if (tid < kblocks) {
    tk_tab[tid] = sampled_block(a.Sk, tid) * kBlock;
    cnt_tab[tid] = static_cast<int>(min(static_cast<int64_t>(kBlock), a.Sk - tk_tab[tid]));
  }
  // the pair's w (Q's options-free mean; zero for P's estimate) and, in the floor's blocks, K's
  const float* bal = a.balance == nullptr ? nullptr : a.balance + bk * D;
  if (kind == 0) {
    if (est == kPv) {
      for (int d = lane; d < D; d += 32) w[d] = 0.0f;
    } else {
      options_free_mean<D>(a, w, a.mean_q + (bh * a.mean_rows + (a.mean_rows > 1 ? u.tq : 0)) * D, bal, 1);
    }
  } else if (pair == 0 && (est == kFloor || (est == kFirst && stat_on(a)))) {
    options_free_mean<D>(a, sm + L::kMk, a.mean_k + bk * D, bal, -1);
  }
  __syncthreads();
  float q2 = 0.0f, k2 = 0.0f;  // the second statistic's sums (kFirst)
  stage_q<T, D>(a, est, u, bh, G.stride, w, tiles, tid & 63, q2);
  const bool stat = est == kFirst && stat_on(a);  // block-uniform

  // the warp's kind: the exact scores (kind 0, and both of P's estimate) or the FP4 ones
  const bool fp4 = kind == 1 && est != kPv;
  const float scale2 = (est == kFirst && kind == 1 ? a.scale : G.scale_exact) * 1.4426950408889634f;  // base 2
  const bool causal = est == kPv && a.causal;
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};
  float o[D / 8][4];
#pragma unroll
  for (int i = 0; i < D / 8; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.0f;

  constexpr int kPer = kBlock / kChunk;
  const int nchunks = (kblocks - 1) * kPer + (cnt_tab[kblocks - 1] + kChunk - 1) / kChunk;
  KeyChunk<T, D> next;
  next.fetch(a, est, tk_tab, cnt_tab, bk, tid, 0);
  VHatChunk<T, D> vh;  // P's blocks: V-hat's bytes a chunk ahead, for V's share
  float pe[2] = {0.0f, 0.0f};
  if (est == kPv) vh.fetch(a, bk, tk_tab[0], tid);
  for (int c = 0; c < nchunks; ++c) {
    const int off = (c % kPer) * kChunk;
    const int64_t key0 = tk_tab[c / kPer] + off;
    const int count = cnt_tab[c / kPer];
    __syncthreads();  // the previous chunk's reads are done (the first time: Q's tiles are written)
    next.stage(sm16, sm + L::kMk, est, tid);
    if (stat && c < kPer && c % static_cast<int>(gridDim.y) == static_cast<int>(blockIdx.y))
      k2 += next.sq_dev(sm + L::kMk, tid);  // K's first sampled block (its chunks 0 .. kPer - 1)
    if (c + 1 < nchunks) next.fetch(a, est, tk_tab, cnt_tab, bk, tid, c + 1);
    __syncthreads();
    if (est == kPv) {  // block-uniform: the chunk's eps, then the next chunk's bytes
      vh.partials(sm16, sm, tid);
      if (c + 1 < nchunks) vh.fetch(a, bk, tk_tab[(c + 1) / kPer] + ((c + 1) % kPer) * kChunk, tid);
      __syncthreads();
    }
    if (u.rows > 0) {
      // the keys of the chunk below live[h] are real (and, causal, at or before row g + 8 h)
      int live[2];
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        live[hh] = count - off;
        if (causal) {
          const int64_t cut = u.row0 + static_cast<int64_t>((lane >> 2) + 8 * hh) * G.stride - key0 + 1;
          live[hh] = static_cast<int>(min(static_cast<int64_t>(live[hh]), max(cut, static_cast<int64_t>(0))));
        }
      }
      float s[4][4];
      if (fp4) chunk_scores<bf16_t, 1, D>(sm16 + L::kKd, tiles + 3 * L::kTile, s, lane);  // Qd Kd^T
      else if (est == kPv) chunk_scores<T, 1, D>(sm16 + L::kK, tiles, s, lane);        // q k^T
      else chunk_scores<T, 3, D>(sm16 + L::kK, tiles, s, lane);                        // (q - w) k^T
      const float m_old[2] = {m[0], m[1]};
      chunk_softmax<D>(s, scale2, live, m, l, o, lane);
      if (est == kPv && kind == 0) chunk_pe<D>(s, m_old, m, sm, lane, pe);
      if (est == kPv) {  // each warp both kinds over its half of the channels: O (n-tiles 0..), O_P
        float q[4][4];
#pragma unroll
        for (int nt = 0; nt < 4; ++nt)
#pragma unroll
          for (int j = 0; j < 4; ++j) q[nt][j] = s[nt][j];
        quantize_p(q);
        chunk_pv<T, D, D / 2, 0>(sm16 + L::kV + kind * (D / 2), s, 2, o, lane);
        chunk_pv<T, D, D / 2, D / 16>(sm16 + L::kV + kind * (D / 2), q, 1, o, lane);
      } else {
        chunk_pv<T, D, D, 0>(sm16 + L::kV, s, 2, o, lane);
      }
    }
  }

  if (stat) q2 = stat_sums<D>(a, bh, sm, tid, q2, k2);
  float n = 0.0f, d = 0.0f;
  double v[3];
  group_error<T, D>(o, l, pe, est == kPv, kind, u.rows, reinterpret_cast<float*>(tiles), lane, n, d, v);
  if (kind == 0 && lane == 0 && u.report) head_error(G, bh, u.unit, z, n, d, v, q2);
#else
  __trap();  // mma.sync m16n8k16 and ldmatrix need sm_80 or newer (the builds target sm_90 and sm_120 families)
#endif
}

// The workspace per (batch, q head): partial, (n, d and the rows' spread: kSums) of each estimate
// and row group, then the counters last, one per head.
constexpr int64_t kPartialFloats = 3 * kUnits * kSums + 2 * kUnits;  // + the second statistic's (stat_partial)

// The row groups of a head at stride s: kRows strided rows each, every sampled block alike.
int units(const QkRuleArgs& a, int s) { return sampled_count(a.Sq) * (kBlock / s / kRows); }

template <typename T, int D>
int launch(const QkRuleArgs& a, cudaStream_t stream) {
  using L = Smem<D>;
  const auto kernel = qk_rule_kernel<T, D>;
  static KernelSetup setup;  // its shared-memory ceiling, set once per device
  cudaError_t err = setup.smem(kernel, static_cast<int>(L::kBytes));
  if (err != cudaSuccess) return err;
  // P's blocks first (blockIdx.z 0, scheduled first): they are the longest (two warps of exact
  // scores in the FP4 kind's place)
  const int stride = query_stride(a);
  RuleGrid G{a, {kFirst, kFirst, kFirst}, 0,
             a.rotate ? a.scale * static_cast<float>(D / 64) : a.scale,  // the unrotated scores' scale (exact)
             stride, kBlock / stride / kRows, units(a, stride)};
  if (a.error_pv != nullptr && a.pv_limit >= 0.0f) G.estimate[G.nest++] = kPv;
  G.estimate[G.nest++] = kFirst;
  if (a.floor) G.estimate[G.nest++] = kFloor;
  // the counters and the selection's zeros, stream-ordered before the blocks that count and set
  // them (unless the caller zeroed them: attention_call)
  const int64_t BH = a.B * a.Hq;
  if (!a.zeroed) {
    err = cudaMemsetAsync(a.counter, 0, sizeof(int32_t) * static_cast<size_t>(BH), stream);
    if (err == cudaSuccess) err = cudaMemsetAsync(a.sel_k, 0, static_cast<size_t>(a.B * a.Hkv), stream);
    if (err == cudaSuccess && a.sel_v != nullptr)
      err = cudaMemsetAsync(a.sel_v, 0, static_cast<size_t>(a.B * a.Hkv), stream);
    if (err != cudaSuccess) return err;
  }
  const dim3 grid(static_cast<unsigned>(BH), static_cast<unsigned>(ceil_div(G.units, kPairs)),
                  static_cast<unsigned>(G.nest));
  kernel<<<grid, kThreads, L::kBytes, stream>>>(G);
  return cudaGetLastError();
}

template <typename T>
int launch_d(const QkRuleArgs& a, cudaStream_t stream) {
  return a.D == 64 ? launch<T, 64>(a, stream) : launch<T, 128>(a, stream);
}

}  // namespace

int64_t qk_rule_workspace_floats(const QkRuleArgs& a) { return a.B * a.Hq * (kPartialFloats + 1); }

// partial, then the counters last: the workspace's end is theirs (sageattn3.h)
void qk_rule_bind_workspace(QkRuleArgs& a, float* ws) {
  const int64_t BH = a.B * a.Hq;
  a.partial = ws;
  a.counter = reinterpret_cast<int32_t*>(ws + BH * kPartialFloats);
}

int qk_rule_error(const QkRuleArgs& a, cudaStream_t stream) {
  if ((a.D != 64 && a.D != 128) || a.B < 1 || a.Hq < 1 || a.Hkv < 1 || a.Hq % a.Hkv || a.Sq < 1 || a.Sk < 1 ||
      a.Sqp < a.Sq || a.Skp < a.Sk || a.mean_rows < 1 || (a.mean_rows > 1 && a.mean_rows * kBlock < a.Sq) ||
      a.B * a.Hq > 0x7FFFFFFF || a.sel_q == nullptr || a.sel_k == nullptr || a.partial == nullptr ||
      a.counter == nullptr ||
      (a.error_pv != nullptr && a.pv_limit >= 0.0f &&
       (a.sel_v == nullptr || a.v_packed == nullptr || a.v_scales == nullptr || a.Skp % kVTile != 0)))
    return cudaErrorInvalidValue;
  switch (a.dtype) {
    case DType::kFloat16: return launch_d<f16_t>(a, stream);
    case DType::kBFloat16: return launch_d<bf16_t>(a, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace sageattn3
