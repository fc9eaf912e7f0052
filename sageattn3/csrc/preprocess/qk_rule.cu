// The "auto" rule's estimates (reference.qk_fp4_error, reference.pv_p_error) in one launch.
//
// Blocks per (batch * q head: blockIdx.x; row group of a sampled 128-row block of Q and key
// split: blockIdx.y; estimate: blockIdx.z). The query rows are every s-th row of Q's sampled
// blocks, s = query_stride (reference.query_stride: 8 on long calls, down to 1 on short ones,
// where the rows times the keys stay within 1.5 x a long call's), 16 of them (one m16 tile) to a block:
// group j of a sampled block takes its strided rows 16j to 16j + 15. Q_s = q * 2^-e - mean_q (e the balance, mean_q the block's or the one mean) and Qd,
// the dequantized FP4 rows of q_packed. The keys are the rows of K's sampled blocks (at most
// 1024), or of its split's share of them: K_s = k * 2^e - mean_k, Kd likewise, and V's rows.
// Keys go through in chunks of 32 (staged in shared memory), with an online softmax per row for
// both score sets, L = c * Q_s K_s^T and L4 = c * Qd Kd^T, and the two outputs O = softmax(L) V,
// O4 = softmax(L4) V accumulated in registers.
//
// With the rotation (a.rotate) Q_s and K_s are the rotated balanced rows minus the rotated means:
// the rows are staged balanced, rotated in shared memory (rotation.cuh, one warp per row), then
// their means subtracted; Qd and Kd are the rotated FP4 codes as they are.
// Options as floors (a.floor; estimate kFloor): more blocks of the launch estimate the defaults'
// rows, raw minus the options-free means (each block takes its means back through the rotation
// and the balance), their Qd and Kd quantized here (quant16, plain scales) instead of read; each
// head keeps the larger estimate (reference.qk_fp4_error, step 5).
//
// Products on tensor cores (mma.m16n8k8 tf32, fp32 accumulation) at float32-level accuracy:
// - Qd Kd^T: the FP4 values (E2M1 x E4M3, at most 6 significant bits) are exact in tf32.
// - Q_s K_s^T: each operand split into a tf32 high part and a tf32 low part of the rest,
//   hi*hi + hi*lo + lo*hi (about 21 bits of each operand).
// - P V: V (fp16/bf16) is exact in tf32; P split as above, P_hi V + P_lo V.
//
// Each row group's sum of (O4 - O)^2 and of O^2 over its rows goes to `partial`; the last block of
// a head to finish, over every estimate of the grid (an integer counter per head, reset by that
// block), adds each estimate's partials in group order and writes sqrt(num / max(den, 1e-30)) and
// the selection. Key splits (calls with few heads: `splits`, from the shapes alone; the Q.K^T
// estimates only, P's quantizes P against the running max of the keys before it): each split
// writes its rows' softmax state (max, sum, unnormalized outputs) to split_state, and the last
// split of the row group to finish merges them in split order (flash-decoding) before the sums. No
// floating-point atomics: the result is the same on every run.
//
// P's error (estimate kPv, reference.pv_p_error), for the FP8 P.V choice: both kinds then take
// the same exact scores of the whole rows, L = c * Q K_s^T (Q's rows balanced and rotated as the
// first estimate's, but not minus their mean: the scores then differ from the attention's only by
// a constant per row), and the FP4 kind's P, P * 2688 relative to the running max of its 32-key
// chunks, is quantized to NVFP4 along the keys (16-key blocks, quantize_p) before P V (V
// exact): O_P = P^ V / (2688 sum P) against O = P V / sum P. A head whose estimate exceeds
// a.pv_limit takes FP8 P.V: bit 1 of sel_q, and sel_v of its kv head set. For a causal attention
// (a.causal) those blocks mask the sampled keys after each sampled row's position, as the
// attention does (key 0 is sampled and seen by every row, so each row's running max is finite
// from the first chunk on).
#include <cuda_fp16.h>

#include <type_traits>

#include "common/launch.cuh"
#include "common/nvfp4.cuh"
#include "preprocess/rotation.cuh"
#include "sageattn3.h"

namespace sageattn3 {
namespace {

constexpr int kThreads = 256;  // 8 warps
constexpr int kRows = 16;      // query rows per block (a row group)
constexpr int kStride = 8;     // reference.AUTO_QUERY_STRIDE: the rows' stride on long calls
constexpr int kChunk = 32;     // keys per staged chunk
constexpr int kBlock = 128;    // the sampled blocks' rows
constexpr int kSampled = 8;    // reference.MEAN_SAMPLE_BLOCKS
constexpr int kUnits = kSampled * kBlock / kRows;  // a head's most row groups (stride 1)
// reference.query_stride's budget: 1.5 x a long call's sampled rows times its sampled keys
constexpr int64_t kRowKeyBudget = static_cast<int64_t>(kSampled) * kBlock / kStride * kSampled * kBlock * 3 / 2;
constexpr int kSLd = kChunk + 4;
constexpr float kPScale = 2688.0f;  // 448 * 6: P's row max at the top of E4M3 x E2M1 (the attention's level 1)

template <int D>
struct Smem {
  static constexpr int kLd = D + 4;  // Q/K rows: fragment loads hit 32 distinct banks
  static constexpr int kVLd = D + 8;  // V rows, read down the key dim
  static constexpr int kQHi = 0;
  static constexpr int kQLo = kQHi + kRows * kLd;
  static constexpr int kQd = kQLo + kRows * kLd;
  static constexpr int kKs = kQd + kRows * kLd;
  static constexpr int kKd = kKs + kChunk * kLd;
  static constexpr int kV = kKd + kChunk * kLd;
  static constexpr int kS = kV + kChunk * kVLd;            // [kind][half][row][kSLd]
  static constexpr int kAlpha = kS + 2 * 2 * kRows * kSLd;  // [kind][row]
  static constexpr int kL = kAlpha + 2 * kRows;             // [kind][row]
  static constexpr int kMeans = kL + 2 * kRows;             // mean_q row (floor, P), mean_k
  static constexpr int kCf = kMeans + 2 * D;                // the balance's factor per channel of K
  static constexpr int kFloats = kCf + D;
  static constexpr size_t kBytes = static_cast<size_t>(kFloats) * sizeof(float);
};
// The kernel's static shared memory: qk_rule_kernel's tk_tab and cnt_tab (the sampled key
// blocks' first rows and real-key counts; ptxas -v reports it as the kernel's smem).
constexpr size_t kStaticBytes = kSampled * (sizeof(int64_t) + sizeof(int));
// Two blocks per SM at D 64 on sm_120/121 (100 KB of shared memory per SM, 1 KB of it reserved
// per block): one more row of D floats would leave one.
static_assert(2 * (Smem<64>::kBytes + kStaticBytes + 1024) <= 100 * 1024, "D 64 must fit two blocks per SM on sm_120");

__device__ __forceinline__ uint32_t to_tf32(float x) {
  uint32_t r;
  asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(x));
  return r;
}

// x = hi + lo (both tf32 bit patterns)
__device__ __forceinline__ void split_tf32(float x, uint32_t& hi, uint32_t& lo) {
  hi = to_tf32(x);
  lo = to_tf32(__fsub_rn(x, __uint_as_float(hi)));
}

__device__ __forceinline__ void mma_tf32(float (&c)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// 8 FP4 values (codes in `word`, element i in nibble i) times the E4M3 scale byte, exactly.
__device__ __forceinline__ void fp4x8(uint32_t word, uint32_t sbyte, float (&out)[8]) {
  const float s = __fmul_rn(e4m3_value(sbyte), 16384.0f);  // e2m1x2_scaled gives values * 2^-14
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = e2m1x2_scaled((word >> (8 * i)) & 0xFFu);
    out[2 * i] = __fmul_rn(f.x, s);
    out[2 * i + 1] = __fmul_rn(f.y, s);
  }
}

// 8 fp16/bf16 values held in a uint4 -> float
template <typename T>
__device__ __forceinline__ void unpack8(const uint4& r, float (&v)[8]) {
  const uint32_t w[4] = {r.x, r.y, r.z, r.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
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

// 8 floats to 16-byte aligned shared memory, two 16-byte stores
__device__ __forceinline__ void store8(float* dst, const float (&v)[8]) {
  reinterpret_cast<float4*>(dst)[0] = make_float4(v[0], v[1], v[2], v[3]);
  reinterpret_cast<float4*>(dst)[1] = make_float4(v[4], v[5], v[6], v[7]);
}

__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(0xFFFFFFFFu, x, o));
  return x;
}

__device__ __forceinline__ float warp_sum(float x) {
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

/* ---------- qk_rule_kernel's phases, in the order a block runs them ---------- */

// How a block's rows are treated, from its estimate.
struct Role {
  bool pv;       // P's error: exact scores only, Qd and Kd neither read nor multiplied
  bool requant;  // the defaults' rows, Qd/Kd quantized here
  float scale;
};

// How a block's Q and K rows are made: the preprocessing's (rotated where a.rotate, balanced by
// `bal`, minus its means, Qd/Kd its codes) or, in the floor's blocks (requant), raw minus the
// options-free means, Qd/Kd quantized here.
struct RowPlan {
  bool rotate;
  Role role;
  const float* mean_q;  // this block's Q mean row (D floats)
  const float* bal;     // the balance exponents of its kv head, or null
  // in shared memory (row_plan): K's mean at Smem::kMeans + D, the balance's factor per channel
  // of K at Smem::kCf (2^e, 1 without the balance)
};

// What one block estimates (blockIdx.z picks it): Q.K^T's error on the preprocessed rows, the
// same on the defaults' rows (options as floors), or P's error.
enum Estimate : int { kFirst = 0, kFloor = 1, kPv = 2 };

// The launch: the arguments, the estimates of its grid (blockIdx.z -> Estimate), the rows'
// stride and row groups (blockIdx.y = (sampled Q block * groups + group) * nsplit + key split).
struct RuleGrid {
  QkRuleArgs a;
  int estimate[3];
  int nest;
  int nsplit;
  float floor_scale;  // the defaults' rows' scores' scale (the unrotated one)
  int stride;         // query_stride
  int groups;         // row groups per sampled block: kBlock / stride / kRows
  int units;          // row groups per head: sampled_count(Sq) * groups
};

template <int D>
__device__ __forceinline__ void unrotate_row(float* row);

// The floor's blocks: the options' means of this block taken back (reference.options_free_means:
// unrotate = the butterflies, then each channel times its sign and 64/D (as one factor), then
// the balance undone: Q's times 2^e, K's times 2^-e) into shared memory. Warps 0 (Q) and 1 (K).
template <int D>
__device__ __forceinline__ void options_free_means(const QkRuleArgs& a, float* out_q, float* out_k,
                                                   const float* mq, const float* mk, const float* bal, int warp) {
  if (warp > 1) return;
  const int lane = threadIdx.x & 31;
  const float* src = warp == 0 ? mq : mk;
  float* dst = warp == 0 ? out_q : out_k;
  for (int d = lane; d < D; d += 32) dst[d] = src[d];
  __syncwarp();
  if (a.rotate) {
    unrotate_row<D>(dst);
  }
  if (bal != nullptr) {
    for (int d = lane; d < D; d += 32)
      dst[d] = __fmul_rn(dst[d], ldexpf(1.0f, warp == 0 ? static_cast<int>(bal[d]) : -static_cast<int>(bal[d])));
  }
}

// Q's rows row0 + stride * r: Q_s split into tf32 parts, Qd (rows r >= `rows` zero), into shared
// memory.
template <typename T, int D>
__device__ __forceinline__ void stage_q_rows(const QkRuleArgs& a, const RowPlan& pl, float* sm, int tid, int64_t bh,
                                             int64_t row0, int stride, int rows) {
  using L = Smem<D>;
  const bool deferred = pl.rotate || pl.role.requant;
  for (int u = tid; u < kRows * D / 8; u += kThreads) {
    const int r = u / (D / 8), d0 = (u % (D / 8)) * 8;
    float hi[8], lo[8], qd[8];
    if (r < rows) {
      const int64_t row = row0 + static_cast<int64_t>(r) * stride;
      float x[8];
      Load8<T>::run(static_cast<const T*>(a.q) + (bh * a.Sq + row) * D + d0, x);
      const float* mean = pl.mean_q + d0;
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const float c = pl.bal == nullptr ? 1.0f : ldexpf(1.0f, -static_cast<int>(pl.bal[d0 + j]));
        const float y = pl.rotate ? __fmul_rn(x[j], c) : __fsub_rn(__fmul_rn(x[j], c), mean[j]);
        uint32_t h2, l2;
        split_tf32(y, h2, l2);
        hi[j] = deferred ? y : __uint_as_float(h2);  // finish_q_rows splits it later
        lo[j] = __uint_as_float(l2);
      }
      const int64_t e = (bh * a.Sqp + row) * D + d0;
      if (pl.role.requant || pl.role.pv) {
#pragma unroll
        for (int j = 0; j < 8; ++j) qd[j] = 0.0f;  // finish_q_rows quantizes the rows (requant)
      } else {
        fp4x8(*reinterpret_cast<const uint32_t*>(a.q_packed + e / 2), a.q_scales[e / 16], qd);
      }
    } else {
#pragma unroll
      for (int j = 0; j < 8; ++j) hi[j] = lo[j] = qd[j] = 0.0f;
    }
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      sm[L::kQHi + r * L::kLd + d0 + j] = hi[j];
      sm[L::kQLo + r * L::kLd + d0 + j] = lo[j];
      sm[L::kQd + r * L::kLd + d0 + j] = qd[j];
    }
  }
}

// Rotates rows [0, nrows) of the fp32 matrix at `rows` (row stride ld) in place, one warp per
// row on 32 lanes (rotation.cuh: the signs, then hadamard_lanes; the bits of reference.rotate).
// Every warp of the block calls it, between two __syncthreads.
template <int D>
__device__ __forceinline__ void rotate_rows(float* rows, int ld, int nrows, int warp) {
  constexpr int kV = D / 32;
  const int lane = threadIdx.x & 31;
  for (int r = warp; r < nrows; r += kThreads / 32) {
    float* row = rows + r * ld + lane * kV;
    float v[kV];
#pragma unroll
    for (int i = 0; i < kV; ++i) v[i] = __fmul_rn(row[i], rotation_sign(lane * kV + i));
    hadamard_lanes<D>(v, lane);
#pragma unroll
    for (int i = 0; i < kV; ++i) row[i] = v[i];
  }
}

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

// 16 values of a staged row (fp32, one NVFP4 block) -> their FP4 codes' values (quant16, plain
// scales, as reference.quantize_rows), into out.
__device__ __forceinline__ void requantize16(const float* row, float* out) {
  float v[16];
#pragma unroll
  for (int i = 0; i < 16; ++i) v[i] = row[i];
  uint32_t sbyte;
  const uint2 w = quant16(v, sbyte);
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float vals[8];
    fp4x8(h ? w.y : w.x, sbyte, vals);
#pragma unroll
    for (int i = 0; i < 8; ++i) out[8 * h + i] = vals[i];
  }
}

// With the rotation or the in-kernel quantization (a.rotate, Role::requant): Q's staged rows (y
// unsplit in the hi area) rotated, minus their (rotated) mean, quantized (requant: Qd), then split
// into tf32 parts, as stage_q_rows does at once otherwise. Called by the whole block after it.
template <int D>
__device__ __forceinline__ void finish_q_rows(const RowPlan& pl, float* sm, int tid, int warp, int rows) {
  using L = Smem<D>;
  __syncthreads();
  if (pl.rotate) {
    rotate_rows<D>(sm + L::kQHi, L::kLd, rows, warp);
    __syncthreads();
  }
  const float* mean = pl.mean_q;
  for (int u = tid; u < rows * D / 16; u += kThreads) {
    const int r = u / (D / 16), d0 = (u % (D / 16)) * 16;
    float* y = sm + L::kQHi + r * L::kLd + d0;
    if (pl.rotate) {
#pragma unroll
      for (int i = 0; i < 16; ++i) y[i] = __fsub_rn(y[i], mean[d0 + i]);
    }
    if (pl.role.requant) requantize16(y, sm + L::kQd + r * L::kLd + d0);
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      uint32_t h2, l2;
      split_tf32(y[i], h2, l2);
      y[i] = __uint_as_float(h2);
      sm[L::kQLo + r * L::kLd + d0 + i] = __uint_as_float(l2);
    }
  }
}

// With the rotation or the in-kernel quantization: the staged chunk's K rows (the first `live`
// real; balanced, and minus K's mean unless rotated) rotated, minus K's (rotated) mean, and
// quantized into Kd (requant); dead rows stay zero. Called by the whole block after
// KeyChunk::stage and a __syncthreads; ends with one.
template <int D>
__device__ __forceinline__ void finish_k_rows(const RowPlan& pl, float* sm, int tid, int warp, int live) {
  using L = Smem<D>;
  if (pl.rotate) {
    rotate_rows<D>(sm + L::kKs, L::kLd, live, warp);
    __syncthreads();
  }
  for (int u = tid; u < live * D / 16; u += kThreads) {
    const int r = u / (D / 16), d0 = (u % (D / 16)) * 16;
    float* y = sm + L::kKs + r * L::kLd + d0;
    if (pl.rotate) {
#pragma unroll
      for (int i = 0; i < 16; ++i) y[i] = __fsub_rn(y[i], sm[L::kMeans + D + d0 + i]);
    }
    if (pl.role.requant) requantize16(y, sm + L::kKd + r * L::kLd + d0);
  }
  __syncthreads();
}

// The next key chunk's raw bytes (K, V, K's FP4 codes and scale), loaded into registers while the
// current one is computed. The chunks: every sampled key block's 32-key chunks that hold a real
// key (only the last sampled block can be partial, so they are the first `nchunks`).
template <typename T, int D>
struct KeyChunk {
  static constexpr int kUnits = kChunk * D / 8 / kThreads;
  uint4 rk[kUnits], rv[kUnits];
  uint32_t rp[kUnits], rs[kUnits];
  bool rlive[kUnits];

  // chunk c of the sampled key blocks whose first rows and real-key counts are tk_tab, cnt_tab
  // (codes: K's FP4 codes and scales too)
  __device__ __forceinline__ void fetch(const QkRuleArgs& a, bool codes, const int64_t* tk_tab, const int* cnt_tab,
                                        int64_t bk, int tid, int c) {
    const int64_t tk = tk_tab[c / (kBlock / kChunk)];
    const int off = (c % (kBlock / kChunk)) * kChunk;
    const int count = cnt_tab[c / (kBlock / kChunk)];
#pragma unroll
    for (int i = 0; i < kUnits; ++i) {
      const int u = tid + i * kThreads, r = u / (D / 8), d0 = (u % (D / 8)) * 8;
      rlive[i] = off + r < count;
      if (rlive[i]) {
        const int64_t row = tk + off + r;
        rk[i] = __ldg(reinterpret_cast<const uint4*>(static_cast<const T*>(a.k) + (bk * a.Sk + row) * D + d0));
        rv[i] = __ldg(reinterpret_cast<const uint4*>(static_cast<const T*>(a.v) + (bk * a.Sk + row) * D + d0));
        if (codes) {  // the defaults' rows quantize K here; P's estimate takes no Kd
          const int64_t e = (bk * a.Skp + row) * D + d0;
          rp[i] = __ldg(reinterpret_cast<const uint32_t*>(a.k_packed + e / 2));
          rs[i] = a.k_scales[e / 16];
        }
      }
    }
  }

  // K_s = k * 2^e - mean_k, Kd and V of the fetched chunk into shared memory (dead keys zero);
  // `rotate`: k * 2^e alone (finish_k_rows rotates it and subtracts the mean); `requant`: Kd
  // left to finish_k_rows; `pv`: Kd zeros (P's estimate takes no FP4 scores).
  __device__ __forceinline__ void stage(float* sm, int tid, const RowPlan& pl) const {
    using L = Smem<D>;
    const float* mean_k = sm + L::kMeans + D;
    const bool rotate = pl.rotate, no_codes = pl.role.requant || pl.role.pv;
#pragma unroll
    for (int i = 0; i < kUnits; ++i) {
      const int u = tid + i * kThreads, r = u / (D / 8), d0 = (u % (D / 8)) * 8;
      float ks[8], kd[8], vv[8];
      if (rlive[i]) {
        float x[8];
        unpack8<T>(rk[i], x);
        unpack8<T>(rv[i], vv);
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          const float cf = sm[L::kCf + d0 + j];
          ks[j] = rotate ? __fmul_rn(x[j], cf) : __fsub_rn(__fmul_rn(x[j], cf), mean_k[d0 + j]);
        }
        if (no_codes) {
#pragma unroll
          for (int j = 0; j < 8; ++j) kd[j] = 0.0f;  // finish_k_rows quantizes the rows (requant)
        } else {
          fp4x8(rp[i], rs[i], kd);
        }
      } else {
#pragma unroll
        for (int j = 0; j < 8; ++j) ks[j] = kd[j] = vv[j] = 0.0f;
      }
      store8(sm + L::kKs + r * L::kLd + d0, ks);
      store8(sm + L::kKd + r * L::kLd + d0, kd);
      store8(sm + L::kV + r * L::kVLd + d0, vv);
    }
  }
};

// scores: warp -> keys (warp % 4) * 8.., half of D (warp / 4); both kinds, into the S area.
template <int D>
__device__ __forceinline__ void chunk_scores(float* sm, int warp, int g, int t, bool pv) {
  using L = Smem<D>;
  const int n0 = (warp & 3) * 8, half = warp >> 2;
  // four independent accumulation chains: hi*hi, hi*lo, lo*hi, the FP4 products
  float s[4] = {0.f, 0.f, 0.f, 0.f}, sx[4] = {0.f, 0.f, 0.f, 0.f}, sy[4] = {0.f, 0.f, 0.f, 0.f},
        s4[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
  for (int k0 = half * (D / 2); k0 < (half + 1) * (D / 2); k0 += 8) {
    const float* qh = sm + L::kQHi;
    const float* ql = sm + L::kQLo;
    const float* qd = sm + L::kQd;
    const int i0 = g * L::kLd + k0 + t, i1 = (g + 8) * L::kLd + k0 + t;
    const uint32_t ahi[4] = {__float_as_uint(qh[i0]), __float_as_uint(qh[i1]), __float_as_uint(qh[i0 + 4]),
                             __float_as_uint(qh[i1 + 4])};
    const uint32_t alo[4] = {__float_as_uint(ql[i0]), __float_as_uint(ql[i1]), __float_as_uint(ql[i0 + 4]),
                             __float_as_uint(ql[i1 + 4])};
    const uint32_t ad[4] = {__float_as_uint(qd[i0]), __float_as_uint(qd[i1]), __float_as_uint(qd[i0 + 4]),
                            __float_as_uint(qd[i1 + 4])};
    const int j0 = (n0 + g) * L::kLd + k0 + t;
    uint32_t bhi[2], blo[2];
    split_tf32(sm[L::kKs + j0], bhi[0], blo[0]);
    split_tf32(sm[L::kKs + j0 + 4], bhi[1], blo[1]);
    const uint32_t bd[2] = {__float_as_uint(sm[L::kKd + j0]), __float_as_uint(sm[L::kKd + j0 + 4])};
    mma_tf32(sx, alo, bhi);
    mma_tf32(sy, ahi, blo);
    mma_tf32(s, ahi, bhi);
    if (!pv) mma_tf32(s4, ad, bd);  // P's estimate takes the exact scores for both kinds
  }
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    s[j] = __fadd_rn(s[j], __fadd_rn(sx[j], sy[j]));
    if (pv) s4[j] = s[j];  // P's estimate: both kinds take the exact scores
  }
  float* s0 = sm + L::kS + (0 * 2 + half) * kRows * kSLd;
  float* s1 = sm + L::kS + (1 * 2 + half) * kRows * kSLd;
  const int c = n0 + 2 * t;
  s0[g * kSLd + c] = s[0];
  s0[g * kSLd + c + 1] = s[1];
  s0[(g + 8) * kSLd + c] = s[2];
  s0[(g + 8) * kSLd + c + 1] = s[3];
  s1[g * kSLd + c] = s4[0];
  s1[g * kSLd + c + 1] = s4[1];
  s1[(g + 8) * kSLd + c] = s4[2];
  s1[(g + 8) * kSLd + c + 1] = s4[3];
}

// online softmax: lane = key (keys off + lane < count are real; with `causal`, those at positions
// key0 + lane up to the row's, row0 + stride * r); P's tf32 parts go where the two halves' sums were, each
// row's alpha to the alpha area. With pv the FP4 kind's P * 2688 goes unsplit to the first half's
// place (quantize_p quantizes and splits it).
template <int D>
__device__ __forceinline__ void chunk_softmax(float* sm, float scale, int off, int count, int warp, int lane,
                                              float (&m_run)[4], float (&l_run)[4], bool pv, bool causal,
                                              int64_t key0, int64_t row0, int stride) {
  using L = Smem<D>;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int p = warp * 4 + i, kind = p / kRows, r = p % kRows;
    float* h0 = sm + L::kS + (kind * 2 + 0) * kRows * kSLd + r * kSLd;
    float* h1 = sm + L::kS + (kind * 2 + 1) * kRows * kSLd + r * kSLd;
    const bool live = off + lane < count && (!causal || key0 + lane <= row0 + static_cast<int64_t>(r) * stride);
    const float x = __fmul_rn(__fadd_rn(h0[lane], h1[lane]), scale);
    const float m_new = fmaxf(m_run[i], warp_max(live ? x : -INFINITY));
    // a row that has seen no live key yet keeps its empty state (-inf - -inf would be NaN); key 0
    // is seen by every row and only the Q.K^T estimates, which mask nothing, are split, so this
    // is a guard
    const float alpha = m_new == -INFINITY ? 1.0f : expf(m_run[i] - m_new);
    const float e = live ? expf(x - m_new) : 0.0f;
    l_run[i] = l_run[i] * alpha + warp_sum(e);
    m_run[i] = m_new;
    uint32_t ph, pl;
    split_tf32(e, ph, pl);
    h0[lane] = pv && kind == 1 ? __fmul_rn(e, kPScale) : __uint_as_float(ph);
    h1[lane] = __uint_as_float(pl);
    if (lane == 0) sm[L::kAlpha + p] = alpha;
  }
}

// P's estimate (kPv): the FP4 kind's P * 2688 of the chunk, NVFP4 per row and 16-key block
// (reference.quantize_rows: the block's amax, its E4M3 scale, each value's E2M1 code: quant16's
// steps), then / 2688 and split into tf32 parts. Every thread: 8 lanes per block (16 rows x 2
// blocks), 2 keys each, the amax across the 8 by shuffles (max.NaN: the same bits in any order);
// called by the whole block between two __syncthreads.
template <int D>
__device__ __forceinline__ void quantize_p(float* sm, int tid) {
  using L = Smem<D>;
  const int blk = tid >> 3, r = blk >> 1, k = (blk & 1) * 16 + 2 * (tid & 7);
  float* h0 = sm + L::kS + (1 * 2 + 0) * kRows * kSLd + r * kSLd + k;
  float* h1 = sm + L::kS + (1 * 2 + 1) * kRows * kSLd + r * kSLd + k;
  const float x0 = h0[0], x1 = h0[1];
  float amax = abs_max_nan(abs_max_nan(0.0f, x0), x1);
#pragma unroll
  for (int o = 1; o < 8; o <<= 1) amax = abs_max_nan(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, o));
  const uint32_t sbyte = e4m3_scale_byte(amax);
  // codes16 of the block with this lane's two values in places 0 and 1 (its codes are per value)
  const float v[16] = {x0, x1, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
  const uint32_t codes = codes16(v, sbyte).x & 0xFFu;
  const float s = __fmul_rn(e4m3_value(sbyte), 16384.0f);  // e2m1x2_scaled gives values * 2^-14 (fp4x8)
  const float2 f = e2m1x2_scaled(codes);
  const float q[2] = {__fmul_rn(f.x, s), __fmul_rn(f.y, s)};
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    uint32_t ph, pl;
    split_tf32(__fdiv_rn(q[i], kPScale), ph, pl);
    h0[i] = __uint_as_float(ph);
    h1[i] = __uint_as_float(pl);
  }
}

// O (kind warp / 4) = O * alpha + P V
template <int D>
__device__ __forceinline__ void chunk_pv(const float* sm, int warp, int g, int t, float (&acc)[D / 32][4]) {
  using L = Smem<D>;
  constexpr int kNt = D / 32;
  const int kind = warp >> 2;
  const float al0 = sm[L::kAlpha + kind * kRows + g], al1 = sm[L::kAlpha + kind * kRows + g + 8];
#pragma unroll
  for (int i = 0; i < kNt; ++i) {
    acc[i][0] *= al0;
    acc[i][1] *= al0;
    acc[i][2] *= al1;
    acc[i][3] *= al1;
  }
  const float* ph = sm + L::kS + (kind * 2 + 0) * kRows * kSLd;
  const float* pl = sm + L::kS + (kind * 2 + 1) * kRows * kSLd;
#pragma unroll
  for (int k0 = 0; k0 < kChunk; k0 += 8) {
    const int i0 = g * kSLd + k0 + t, i1 = (g + 8) * kSLd + k0 + t;
    const uint32_t ahi[4] = {__float_as_uint(ph[i0]), __float_as_uint(ph[i1]), __float_as_uint(ph[i0 + 4]),
                             __float_as_uint(ph[i1 + 4])};
    const uint32_t alo[4] = {__float_as_uint(pl[i0]), __float_as_uint(pl[i1]), __float_as_uint(pl[i0 + 4]),
                             __float_as_uint(pl[i1 + 4])};
#pragma unroll
    for (int i = 0; i < kNt; ++i) {
      const int n0 = ((warp & 3) + 4 * i) * 8;
      const uint32_t bv[2] = {__float_as_uint(sm[L::kV + (k0 + t) * L::kVLd + n0 + g]),
                              __float_as_uint(sm[L::kV + (k0 + t + 4) * L::kVLd + n0 + g])};
      mma_tf32(acc[i], alo, bv);
      mma_tf32(acc[i], ahi, bv);
    }
  }
}

// row sums, then O4 to shared memory (over K's staging area) for the exact-kind warps; the
// exact-kind warps' sums of (O4 - O)^2 and O^2 over their rows < `rows`, per warp, into `red`
// (2 x 8 floats over the alpha area).
template <int D>
__device__ __forceinline__ void block_error(float* sm, int warp, int lane, int g, int t, int rows,
                                            const float (&l_run)[4], const float (&acc)[D / 32][4]) {
  using L = Smem<D>;
  constexpr int kNt = D / 32;
#pragma unroll
  for (int i = 0; i < 4; ++i)
    if (lane == 0) sm[L::kL + warp * 4 + i] = l_run[i];
  __syncthreads();
  const int kind = warp >> 2;
  const float inv0 = 1.0f / sm[L::kL + kind * kRows + g], inv1 = 1.0f / sm[L::kL + kind * kRows + g + 8];
  float* o4 = sm + L::kKs;  // [kRows][kLd]
  if (kind == 1) {
#pragma unroll
    for (int i = 0; i < kNt; ++i) {
      const int c = ((warp & 3) + 4 * i) * 8 + 2 * t;
      o4[g * L::kLd + c] = acc[i][0] * inv0;
      o4[g * L::kLd + c + 1] = acc[i][1] * inv0;
      o4[(g + 8) * L::kLd + c] = acc[i][2] * inv1;
      o4[(g + 8) * L::kLd + c + 1] = acc[i][3] * inv1;
    }
  }
  __syncthreads();
  float num = 0.0f, den = 0.0f;
  if (kind == 0) {
#pragma unroll
    for (int i = 0; i < kNt; ++i) {
      const int c = ((warp & 3) + 4 * i) * 8 + 2 * t;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int r = g + (j >> 1) * 8, cc = c + (j & 1);
        if (r < rows) {
          const float o = acc[i][j] * (j < 2 ? inv0 : inv1);
          const float dlt = o4[r * L::kLd + cc] - o;
          num += dlt * dlt;
          den += o * o;
        }
      }
    }
  }
  num = warp_sum(num);
  den = warp_sum(den);
  __syncthreads();  // o4 reads done before the area is reused
  float* red = sm + L::kAlpha;  // 2 x 8 floats
  if (lane == 0) {
    red[warp] = num;
    red[8 + warp] = den;
  }
}

// Thread 0, with the block's sums (n, d) over its row group `unit`: they go to `partial`; the last
// block of the head to finish (of every estimate in the grid) adds each estimate's partials in
// row group order and writes the head's errors and selection.
__device__ __forceinline__ void head_error(const RuleGrid& G, int64_t bh, int unit, int z, float n, float d) {
  const QkRuleArgs& a = G.a;
  const int64_t BH = a.B * a.Hq;
  a.partial[((z * BH + bh) * kUnits + unit) * 2] = n;
  a.partial[((z * BH + bh) * kUnits + unit) * 2 + 1] = d;
  __threadfence();
  if (atomicAdd(a.counter + bh, 1) != G.units * G.nest - 1) return;
  __threadfence();
  const auto estimate = [&](int zz) {  // estimate zz of the grid from its partials, in row group order
    float sn = 0.0f, sd = 0.0f;
    for (int i = 0; i < G.units; ++i) {
      sn += __ldcg(a.partial + ((zz * BH + bh) * kUnits + i) * 2);
      sd += __ldcg(a.partial + ((zz * BH + bh) * kUnits + i) * 2 + 1);
    }
    return sqrtf(sn / fmaxf(sd, 1e-30f));
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
  a.sel_q[bh] = static_cast<uint8_t>(byte);
}

// The block's RowPlan: in the floor's blocks (requant) the options-free means go to shared
// memory and the rows are neither balanced nor rotated; otherwise K's mean is copied there. K's
// balance factor per channel goes to shared memory too (Q's rows take theirs once, in
// stage_q_rows). Whole block; ends with a __syncthreads.
template <int D>
__device__ __forceinline__ RowPlan row_plan(const QkRuleArgs& a, const Role& role, float* sm, int warp, int64_t bh,
                                            int64_t bk, int64_t tq) {
  using L = Smem<D>;
  RowPlan pl{a.rotate, role, a.mean_q + (bh * a.mean_rows + (a.mean_rows > 1 ? tq : 0)) * D,
             a.balance == nullptr ? nullptr : a.balance + bk * D};
  const float* mean_k = a.mean_k + bk * D;
  const bool balanced = pl.bal != nullptr && !role.requant;
  for (int d = threadIdx.x; d < D; d += kThreads) {
    const int e = balanced ? static_cast<int>(pl.bal[d]) : 0;
    sm[L::kCf + d] = ldexpf(1.0f, e);
    if (!role.requant) sm[L::kMeans + D + d] = mean_k[d];
    if (role.pv) sm[L::kMeans + d] = 0.0f;  // P's estimate: Q's rows whole (a zero mean), K_s as Q.K^T's
  }
  if (role.requant)
    options_free_means<D>(a, sm + L::kMeans, sm + L::kMeans + D, pl.mean_q, mean_k, pl.bal, warp);
  __syncthreads();
  if (role.requant) return RowPlan{false, role, sm + L::kMeans, nullptr};
  if (role.pv) pl.mean_q = sm + L::kMeans;
  return pl;
}

// With key splits: the block's softmax state (m, l and the unnormalized output of each (kind,
// row)) to its slot of a.split_state; the last split of the row group to finish merges the
// slots in split order (flash-decoding) into O and O4 in shared memory and returns the sums of
// (O4 - O)^2 and O^2 over its rows < `rows` in (n, d) of thread 0. Returns false in the other blocks.
template <int D>
__device__ __forceinline__ bool merge_splits(const RuleGrid& G, float* sm, int64_t bh, int unit, int si, int z, int warp,
                                             int lane, int g, int t, int rows, const float (&m_run)[4],
                                             const float (&l_run)[4], const float (&acc)[D / 32][4], float& n, float& d) {
  using L = Smem<D>;
  constexpr int kNt = D / 32, kRow = D + 2, kSlot = 2 * kRows * kRow;
  const QkRuleArgs& a = G.a;
  const int64_t group = (z * a.B * a.Hq + bh) * G.units + unit;  // the split state: G.units per head
  float* slots = a.split_state + group * G.nsplit * kSlot;
  float* mine = slots + si * kSlot;  // [kind][row][m, l, acc[D]]
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int p = warp * 4 + i;
    if (lane == 0) {
      mine[p * kRow] = m_run[i];
      mine[p * kRow + 1] = l_run[i];
    }
  }
  const int kind = warp >> 2;
#pragma unroll
  for (int i = 0; i < kNt; ++i) {
    const int c = ((warp & 3) + 4 * i) * 8 + 2 * t;
    *reinterpret_cast<float2*>(mine + (kind * kRows + g) * kRow + 2 + c) = make_float2(acc[i][0], acc[i][1]);
    *reinterpret_cast<float2*>(mine + (kind * kRows + g + 8) * kRow + 2 + c) = make_float2(acc[i][2], acc[i][3]);
  }
  __threadfence();
  __syncthreads();
  int* last = reinterpret_cast<int*>(sm + L::kAlpha);
  if (threadIdx.x == 0) {
    int32_t* ctr = a.counter + a.B * a.Hq + (z * a.B * a.Hq + bh) * kUnits + unit;
    *last = atomicAdd(ctr, 1) == G.nsplit - 1;
    if (*last) *ctr = 0;  // ready for the next launch
  }
  __syncthreads();
  if (!*last) return false;
  __threadfence();
  // per (kind, row): each split's weight exp(m_s - M) and 1 / sum_s weight * l_s
  float* w = sm + L::kS;  // [2 * kRows][8], then [2 * kRows] inverses
  if (threadIdx.x < 2 * kRows) {
    const int p = threadIdx.x;
    float mx = -INFINITY;
    for (int s = 0; s < G.nsplit; ++s) mx = fmaxf(mx, __ldcg(slots + s * kSlot + p * kRow));
    float l = 0.0f;
    for (int s = 0; s < G.nsplit; ++s) {
      const float m = __ldcg(slots + s * kSlot + p * kRow);
      const float ws = m == -INFINITY ? 0.0f : expf(m - mx);
      w[p * 8 + s] = ws;
      l += ws * __ldcg(slots + s * kSlot + p * kRow + 1);
    }
    w[2 * kRows * 8 + p] = l > 0.0f ? 1.0f / l : 0.0f;
  }
  __syncthreads();
  float* o = sm + L::kKs;   // O: [kRows][kLd]
  float* o4 = sm + L::kKd;  // O4
  for (int e = threadIdx.x; e < 2 * kRows * D; e += kThreads) {
    const int p = e / D, c = e % D;
    float x = 0.0f;
    for (int s = 0; s < G.nsplit; ++s) x += w[p * 8 + s] * __ldcg(slots + s * kSlot + p * kRow + 2 + c);
    (p < kRows ? o : o4)[(p % kRows) * L::kLd + c] = x * w[2 * kRows * 8 + p];
  }
  __syncthreads();
  float num = 0.0f, den = 0.0f;
  for (int e = threadIdx.x; e < rows * D; e += kThreads) {
    const int r = e / D, c = e % D;
    const float x = o[r * L::kLd + c], dlt = o4[r * L::kLd + c] - x;
    num += dlt * dlt;
    den += x * x;
  }
  num = warp_sum(num);
  den = warp_sum(den);
  float* red = sm + L::kAlpha + 1;  // 2 x 8 floats, after the flag
  __syncthreads();
  if (lane == 0) {
    red[warp] = num;
    red[8 + warp] = den;
  }
  __syncthreads();
  n = d = 0.0f;
  for (int w8 = 0; w8 < kThreads / 32; ++w8) {
    n += red[w8];
    d += red[8 + w8];
  }
  return true;
}

/* ---------- the kernel: one block's rows and keys, phase by phase ---------- */

template <typename T, int D>
// At least two blocks per SM in the register budget (the shared memory allows two at D 64 on sm_120's
// 100 KB, one at D 128): ptxas then keeps D 64 under 128 registers rather than at 80 with a spill
// in the key loop.
__global__ void __launch_bounds__(kThreads, 2) qk_rule_kernel(const __grid_constant__ RuleGrid G) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  using L = Smem<D>;
  extern __shared__ __align__(16) float sm[];
  __shared__ int64_t tk_tab[kSampled];  // kStaticBytes counts these two
  __shared__ int cnt_tab[kSampled];
  const QkRuleArgs& a = G.a;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const int64_t bh = blockIdx.x;  // batch * Hq + q head
  const int unit = blockIdx.y / G.nsplit, si = blockIdx.y % G.nsplit;  // row group, key split
  const int qi = unit / G.groups;  // its sampled block of Q
  const int z = blockIdx.z;
  const Role role{G.estimate[z] == kPv, G.estimate[z] == kFloor, G.estimate[z] == kFloor ? G.floor_scale : a.scale};
  // P's estimate quantizes P against the running max of the keys before it, in order: its blocks
  // take every key of the Q block (split 0; the others have nothing to do)
  const int nsplit = role.pv ? 1 : G.nsplit;
  if (si >= nsplit) return;
  const int64_t b = bh / a.Hq, h = bh % a.Hq;
  const int64_t bk = b * a.Hkv + h / (a.Hq / a.Hkv);  // its kv head, flattened
  const int64_t tq = sampled_block(a.Sq, qi);
  const int first = (unit % G.groups) * kRows;  // the group's first row among the block's strided rows
  const int64_t row0 = tq * kBlock + static_cast<int64_t>(first) * G.stride;
  const int rows = static_cast<int>(min(static_cast<int64_t>(kRows), block_rows(a.Sq, qi, G.stride) - first));
  if (rows <= 0) {  // a group past a partial last block's rows: nothing to estimate, it still reports
    if (si == 0 && tid == 0) head_error(G, bh, unit, z, 0.0f, 0.0f);
    return;
  }
  const int kblocks = sampled_count(a.Sk);
  if (tid < kblocks) {
    tk_tab[tid] = sampled_block(a.Sk, tid) * kBlock;
    cnt_tab[tid] = static_cast<int>(min(static_cast<int64_t>(kBlock), a.Sk - tk_tab[tid]));
  }
  const RowPlan pl = row_plan<D>(a, role, sm, warp, bh, bk, tq);  // ends with a __syncthreads

  stage_q_rows<T, D>(a, pl, sm, tid, bh, row0, G.stride, rows);
  if (pl.rotate || pl.role.requant) finish_q_rows<D>(pl, sm, tid, warp, rows);

  // softmax state of the 4 (kind, row) pairs this warp owns: pair p = warp * 4 + i, kind p / 16
  float m_run[4], l_run[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    m_run[i] = -INFINITY;
    l_run[i] = 0.0f;
  }
  // P.V accumulators: kind warp / 4, n-tiles (warp % 4) + 4 i
  constexpr int kNt = D / 32;
  float acc[kNt][4];
#pragma unroll
  for (int i = 0; i < kNt; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.0f;

  // this split's chunks: those of its sampled key blocks that hold a real key (only the last
  // sampled block can be partial)
  constexpr int kPer = kBlock / kChunk;
  const int kb0 = si * kblocks / nsplit, kb1 = (si + 1) * kblocks / nsplit;
  const int c0 = kb0 * kPer, c1 = (kb1 - 1) * kPer + (cnt_tab[kb1 - 1] + kChunk - 1) / kChunk;
  KeyChunk<T, D> next;
  next.fetch(a, !pl.role.requant && !pl.role.pv, tk_tab, cnt_tab, bk, tid, c0);
  for (int c = c0; c < c1; ++c) {
    const int off = (c % kPer) * kChunk;
    const int64_t key0 = tk_tab[c / kPer];
    const int count = cnt_tab[c / kPer];
    __syncthreads();  // the previous chunk's reads are done
    next.stage(sm, tid, pl);
    if (c + 1 < c1) next.fetch(a, !pl.role.requant && !pl.role.pv, tk_tab, cnt_tab, bk, tid, c + 1);
    __syncthreads();
    if (pl.rotate || pl.role.requant) finish_k_rows<D>(pl, sm, tid, warp, min(kChunk, count - off));
    chunk_scores<D>(sm, warp, g, t, role.pv);
    __syncthreads();
    chunk_softmax<D>(sm, role.scale, off, count, warp, lane, m_run, l_run, role.pv, role.pv && a.causal, key0 + off,
                     row0, G.stride);
    __syncthreads();
    if (role.pv) {
      quantize_p<D>(sm, tid);
      __syncthreads();
    }
    chunk_pv<D>(sm, warp, g, t, acc);
  }

  float n = 0.0f, d = 0.0f;
  if (nsplit > 1) {
    __syncthreads();  // the last chunk's reads of the staging area are done
    if (!merge_splits<D>(G, sm, bh, unit, si, z, warp, lane, g, t, rows, m_run, l_run, acc, n, d)) return;
  } else {
    block_error<D>(sm, warp, lane, g, t, rows, l_run, acc);
    __syncthreads();
    const float* red = sm + L::kAlpha;
    for (int w4 = 0; w4 < 4; ++w4) {
      n += red[w4];
      d += red[8 + w4];
    }
  }
  if (tid == 0) head_error(G, bh, unit, z, n, d);
#else
  __trap();  // mma.sync tf32 needs sm_80 or newer (the builds target sm_90 and sm_120 families)
#endif
}

// The key splits of a launch, from the shapes alone (so that a result does not depend on the
// GPU): while the grid of the row groups has at most kSplitBlocks / 2 blocks per estimate,
// the sampled key blocks are split in two more, up to one per split. Calls with few heads then
// fill the GPU: the blocks' chunk loops are serial.
constexpr int64_t kSplitBlocks = 128;
// The workspace per (batch, q head): partial, (n, d) of each estimate and row group (an even
// count: the split state after them stays 8-byte aligned); the counters, one per head and one per
// (estimate, row group) for the key splits.
constexpr int64_t kPartialFloats = 3 * kUnits * 2;
constexpr int64_t kCounters = 1 + 3 * kUnits;

// The row groups of a head at stride s: kRows strided rows each, every sampled block alike.
int units(const QkRuleArgs& a, int s) { return sampled_count(a.Sq) * (kBlock / s / kRows); }

int splits(const QkRuleArgs& a) {
  const int64_t grid = a.B * a.Hq * units(a, query_stride(a));
  const int kb = sampled_count(a.Sk);
  int s = 1;
  while (2 * s <= kb && grid * 2 * s <= kSplitBlocks) s *= 2;
  return s;
}

template <typename T, int D>
int launch(const QkRuleArgs& a, cudaStream_t stream) {
  using L = Smem<D>;
  const auto kernel = qk_rule_kernel<T, D>;
  static KernelSetup setup;  // its shared-memory ceiling, set once per device
  cudaError_t err = setup.smem(kernel, static_cast<int>(L::kBytes));
  if (err != cudaSuccess) return err;
  // P's blocks first (blockIdx.z 0, scheduled first): never split, they are the longest where the
  // others are
  const int stride = query_stride(a);
  RuleGrid G{a, {kFirst, kFirst, kFirst}, 0, a.split_state == nullptr ? 1 : splits(a),
             a.rotate ? a.scale * static_cast<float>(D / 64) : a.scale,  // the unrotated scores' scale (exact)
             stride, kBlock / stride / kRows, units(a, stride)};
  if (a.error_pv != nullptr && a.pv_limit >= 0.0f) G.estimate[G.nest++] = kPv;
  G.estimate[G.nest++] = kFirst;
  if (a.floor) G.estimate[G.nest++] = kFloor;
  // the counters (per head, then per estimate, head and sampled Q block) and the selection's
  // zeros, stream-ordered before the blocks that count and set them
  // (unless the caller zeroed them: attention_call)
  const int64_t BH = a.B * a.Hq;
  if (!a.zeroed) {
    err = cudaMemsetAsync(a.counter, 0, sizeof(int32_t) * static_cast<size_t>(BH * (G.nsplit > 1 ? kCounters : 1)),
                          stream);
    if (err == cudaSuccess) err = cudaMemsetAsync(a.sel_k, 0, static_cast<size_t>(a.B * a.Hkv), stream);
    if (err == cudaSuccess && a.sel_v != nullptr)
      err = cudaMemsetAsync(a.sel_v, 0, static_cast<size_t>(a.B * a.Hkv), stream);
    if (err != cudaSuccess) return err;
  }
  const dim3 grid(static_cast<unsigned>(BH), static_cast<unsigned>(G.units * G.nsplit),
                  static_cast<unsigned>(G.nest));
  kernel<<<grid, kThreads, L::kBytes, stream>>>(G);
  return cudaGetLastError();
}

template <typename T>
int launch_d(const QkRuleArgs& a, cudaStream_t stream) {
  return a.D == 64 ? launch<T, 64>(a, stream) : launch<T, 128>(a, stream);
}

int64_t split_floats(const QkRuleArgs& a) {
  if ((a.D != 64 && a.D != 128) || a.B < 1 || a.Hq < 1 || a.Sq < 1 || a.Sk < 1) return 0;
  const int s = splits(a);
  return s > 1 ? 3 * a.B * a.Hq * units(a, query_stride(a)) * s * 2 * kRows * (a.D + 2) : 0;
}

}  // namespace

int64_t qk_rule_workspace_floats(const QkRuleArgs& a) {
  return a.B * a.Hq * (kPartialFloats + kCounters) + split_floats(a);
}

// partial, the key splits' state, then the counters last: the workspace's end is theirs (sageattn3.h)
void qk_rule_bind_workspace(QkRuleArgs& a, float* ws) {
  const int64_t BH = a.B * a.Hq, split = split_floats(a);
  a.partial = ws;
  a.split_state = split > 0 ? ws + BH * kPartialFloats : nullptr;
  a.counter = reinterpret_cast<int32_t*>(ws + BH * kPartialFloats + split);
}

int qk_rule_error(const QkRuleArgs& a, cudaStream_t stream) {
  if ((a.D != 64 && a.D != 128) || a.B < 1 || a.Hq < 1 || a.Hkv < 1 || a.Hq % a.Hkv || a.Sq < 1 || a.Sk < 1 ||
      a.Sqp < a.Sq || a.Skp < a.Sk || a.mean_rows < 1 || (a.mean_rows > 1 && a.mean_rows * kBlock < a.Sq) ||
      a.B * a.Hq > 0x7FFFFFFF || a.sel_q == nullptr || a.sel_k == nullptr || a.partial == nullptr ||
      a.counter == nullptr || (a.error_pv != nullptr && a.pv_limit >= 0.0f && a.sel_v == nullptr))
    return cudaErrorInvalidValue;
  switch (a.dtype) {
    case DType::kFloat16: return launch_d<f16_t>(a, stream);
    case DType::kBFloat16: return launch_d<bf16_t>(a, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace sageattn3
