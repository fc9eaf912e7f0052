// The FP4 attention forward kernel (SageAttention3 algorithm) for the sm_120 family.
//
// One CTA = 8 consumer warps (16 query rows each, 128 rows per tile) and, in every instantiation
// but the bounded mode's, a producer warpgroup of its own (warps 8-11, producer_warpgroup): it
// streams Q tiles and K/V stages through an mbarrier ring and fills each stage's delta_s vector,
// V scales and V exponent factors, so the consumers never wait on a CTA barrier per stage. The
// registers follow the roles (setmaxnreg): 40 a producer thread, 232 a consumer thread (launched
// at 168 for 384 threads). The bounded mode (kInLoopResidual: its consumers compute delta_s's
// correction in the loop, two threads a key) keeps 8 warps, thread 0 issuing the TMA between its
// own MMA work (Producer) and the CTA filling each stage before a barrier. Tiles
// (batch x q-head x 128-row block) are distributed over a persistent grid sized from the
// device's SM count; causal tiles are visited longest first.
//
// Per 128-key stage, the stage's delta_s vector (128 floats, each key pair twice:
// delta_pair_offset) is first written, read from a row of p.ds_key: with one Q mean preprocessing's ds_key
// (qbar . K_s[j], the unquantized smoothed K); with per-block Q means the row of this query block
// in the workspace that delta_s_blocks_kernel filled before (delta_s_blocks.cuh: ds_key[j] +
// r . K^[j], r = mean_q - qbar). The kInLoopResidual instantiation (the bounded-memory mode, no
// workspace) computes that r . K^[j] here instead, in the same arithmetic: r of this tile (loaded
// once per tile) times K^ = Kd + the quantization residual (the dequantized smoothed K in shared
// memory plus k_res, read from global memory) on the CUDA cores (2 threads per key, a fixed
// summation order), skipped when the tile's r is all zeros. Then each consumer warp computes
//   S  = delta_s + Q K^T            (block-scaled FP4 MMA, fp32 accumulate, S keys permuted: key_of)
//   online softmax in exp2 domain, P2 = exp2(S*scale*log2e - m + log2 2688)   (level 1)
//   P2 -> NVFP4 in registers (level 2: per 16-key block s = E4M3(amax/6), P2/s computed as
//     exp2(... - log2 s), softmax_pquant.cuh), O = O*alpha + P2 V    (block-scaled FP4 MMA)
// and finally O / l in bf16/fp16.
#pragma once
#include <cstdint>
#include <type_traits>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "attn/attn_params.h"
#include "attn/epilogue.cuh"
#include "attn/fp4_mma.cuh"
#include "attn/fragments.cuh"
#include "attn/softmax_pquant.cuh"
#include "attn/tma_pipeline.cuh"
#include "common/mxfp8.cuh"

namespace sageattn3::attn {

// kQK8: the FP8 Q.K^T instantiation (MXFP8 Q and K: one E4M3 byte per element, one UE8M0 scale
// per 32; attn/fp4_mma.cuh, mma_fp8). Its Q and K tiles are twice the FP4 ones, so at D 128 it runs
// two stages instead of three to stay within sm_120's 99 KiB of shared memory per CTA.
// kPV8: the FP8 P.V instantiation (pv_precision "fp8": P and V in MXFP8, V's tile one E4M3 byte per
// element, D rows of 128 keys, TMA-swizzled by 128 bytes; one UE8M0 scale per channel and 32 keys).
// kQK16 (with kQK8): the 16-bit Q.K^T instantiation (16-bit Q and K rows and no scales; 1: bf16,
// 2: fp16; common/mma16.cuh's mma_m16n8k16). At D 64 (bf16 only) the rows are the smoothed,
// rotated values the MXFP8 launch writes (reference.qk16_rows), 128 bytes as the FP8 rows at D 128. At D 128 (kRaw) they
// are the call's fp16/bf16 inputs as they are (reference, Preprocessed.qk16): S = q.k^T, no delta_s
// (the means are in the rows; K's adds a constant a row). Their 256-byte rows go in
// kParts = 4 column parts of 64 bytes (32 channels, TMA-swizzled by 64 bytes as the FP4 rows at
// D 128): a stage holds K's four parts one after the other (a bf16 K tile is 32 KB), and the Q tile's
// four parts stay in shared memory for the whole tile (kQResident: each key tile reads their
// fragments again). So one stage: Q (32 KB) and two stages would not fit sm_120's 99 KB. Held in
// registers instead (32 a thread), the Q fragments made ptxas spill in the key loop (40-84 bytes,
// 7-17 local accesses an iteration at sm_120a), and with one part resident (8 more) still 13.
template <int D, bool kQK8 = false, bool kPV8 = false, int kQK16 = 0>
struct SmemLayout {
  static_assert(!kQK16 || kQK8, "16-bit Q.K^T: the FP8 path's layout");
  // one stage for the raw 16-bit rows at D 128 (the Q tile resident: see above)
  static constexpr int kStages = (kQK16 && D == 128) ? 1 : (kQK8 && D == 128) ? 2 : ::sageattn3::attn::kStages;
  static constexpr bool kRaw = kQK16 != 0 && D == 128;                    // the raw input rows
  static constexpr int kParts = kRaw ? 4 : 1;                             // column parts of a Q / K row
  static constexpr int kRowBytes = (kQK16 ? 2 * D : kQK8 ? D : D / 2) / kParts;  // bytes per row of a part
  static constexpr int kSfRowBytes = kQK16 ? 0 : kQK8 ? D / 32 : D / 16;  // scale bytes per row of Q / K
  static constexpr int kQBytes = kBlockM * kRowBytes;                     // one part of Q
  static constexpr bool kQResident = kRaw;                                // Q read from shared memory a key tile
  static constexpr int kQSfBytes = kBlockM * kSfRowBytes;
  static constexpr int kKPartBytes = kBlockN * kRowBytes;
  static constexpr int kKBytes = kParts * kKPartBytes;
  static constexpr int kKSfBytes = kBlockN * kSfRowBytes;
  static constexpr int kVRowBytes = kPV8 ? kBlockN : kBlockN / 2;  // bytes per channel row of the V tile
  static constexpr int kVBytes = D * kVRowBytes;
  // delta_s of keys 2i, 2i+1, twice: 16 bytes per pair, 16 bytes of padding after every 8 pairs
  // (delta_pair_offset)
  static constexpr int kDeltaBytes = kBlockN * 8 + kBlockN;
  static constexpr int kVSfBytes = D * kBlockN / 16;  // the stage's V scales (copied in, not TMA-loaded)
  // Offsets from a 1024-aligned base; every swizzled tile starts on a 1024 boundary.
  static constexpr int kQ = 0;
  static constexpr int kQSf = kQ + kParts * kQBytes;
  static constexpr int kStage0 = ((kQSf + kQSfBytes + 1023) / 1024) * 1024;
  static constexpr int kStageK = 0;
  static constexpr int kStageV = kKBytes;
  static constexpr int kStageKSf = kStageV + kVBytes;
  static constexpr int kStageDelta = kStageKSf + kKSfBytes;
  static constexpr int kStageVSf = kStageDelta + kDeltaBytes;
  // Per 32-channel group of V (V's tile exponents, FP4 P.V), written by D/32 threads of the last
  // warp (of the producer warpgroup, or of the CTA in the bounded mode): 2^(e_t - e_(t-1)) (16 bytes), then 2^-e_t (16 bytes, read in the tile's last stage by
  // the bounded-memory instantiation: see consumer)
  static constexpr int kStageVExp = kStageVSf + kVSfBytes;
  static constexpr int kVExpBytes = 32;
  static constexpr int kStageBytes = ((kStageVExp + kVExpBytes + 1023) / 1024) * 1024;
  static constexpr int kBarriers = kStage0 + kStages * kStageBytes;
  static constexpr int kBarrierBytes = 8 * (2 + 2 * kStages);
  static constexpr int kProducerState = kBarriers + kBarrierBytes;  // thread 0's cursor (see Producer)
  // This tile's Q mean residual r = mean_q - qbar (fp32), the second half of D 16 bytes further
  // (no bank conflict between the two threads of a key, see delta_s_part).
  static constexpr int kMeanQ = kProducerState + 64;
  static constexpr int kMeanQBytes = D * 4 + 16;
  // {s, log2 s} for every E4M3 byte s of P's block scales (p_scale_table), where P / s is computed in
  // P's exponent (kFoldP: FP4 Q.K^T and P.V; the FP8 / 16-bit Q.K^T kernels keep the multiply)
  static constexpr bool kFoldP = !kQK8 && !kPV8;
  static constexpr int kPScale = kMeanQ + kMeanQBytes;
  static constexpr int kPScaleTableBytes = kFoldP ? kPScaleBytes * kPScaleEntry : 0;
  static constexpr int kTotal = kPScale + kPScaleTableBytes + 1024;  // + slack to align the base
  // The stage's delta_s vector (kStageDelta) and V scales (kStageVSf) are written by threads
  // (the producer warpgroup's; the bounded mode's consumers), not by TMA (V's scale rows are Sk_pad/16 bytes apart: not the multiple of 16 a
  // tensor map's stride must be when Sk_pad/128 is odd).
  static constexpr uint32_t kStageTx = kKBytes + kVBytes + kKSfBytes;
  static constexpr uint32_t kQTx = kParts * kQBytes + kQSfBytes;  // Q's parts (and its scales)
  static_assert(D / 32 * 4 <= 16 && kStageVExp % 16 == 0, "V's group factors: two 16-byte slots");
};

// Byte offset of key pair i (keys 2i, 2i+1) in a stage's delta_s vector: the four pairs a quarter
// warp loads at once (i, i + 4, i + 8, i + 12) land in distinct banks.
__host__ __device__ __forceinline__ constexpr uint32_t delta_pair_offset(uint32_t i) { return 16 * i + 16 * (i >> 3); }

struct TileCoord {
  int b, hq, hk, mb, num_kb;
};

// The first tile at or after `tile` (stepping by the grid) that this launch computes: all of them,
// or, where p.head_sel is set (the per-head Q.K^T precision), those whose (batch, q head) byte
// equals p.head_sel_want. Producer and consumers walk the same sequence. kSelect false (the
// bounded-memory instantiation, never launched with head_sel) compiles the check out.
template <bool kSelect>
__device__ __forceinline__ int next_tile(const AttnParams& p, int tile) {
  if (kSelect && p.head_sel != nullptr)
    while (tile < p.num_tiles && p.head_sel[p.bh0 + tile % p.bh_count] != p.head_sel_want) tile += gridDim.x;
  return tile;
}

__device__ __forceinline__ TileCoord decode_tile(const AttnParams& p, int tile) {
  TileCoord c;
  const int bh_count = p.bh_count;
  const int bh = p.bh0 + tile % bh_count, step = tile / bh_count;
  c.b = bh / p.heads_q;
  c.hq = bh % p.heads_q;
  c.hk = c.hq / (p.heads_q / p.heads_kv);
  // Causal: the last row blocks see the most keys, so they go first.
  c.mb = p.causal ? p.num_m_blocks - 1 - step : step;
  const int kb_all = (p.seq_k + kBlockN - 1) / kBlockN;
  c.num_kb = p.causal ? min(kb_all, (c.mb * kBlockM + kBlockM - 1) / kBlockN + 1) : kb_all;
  return c;
}

// The bounded mode's TMA producer: thread 0 of the CTA, run between its own MMA work. It walks this CTA's
// (tile, key block) sequence ahead of the consumers, at most kStages stages ahead, and issues each
// tile's Q when it enters the tile. Thread 0 is also a consumer, so it never waits for a stage that
// its own warp has not released: stage n + kStages - 1 is issued at the start of iteration n,
// after every warp (its own included) released stage n - 1.
// FP4 operands only (the bounded mode's), every tile of the grid (no per-head selection bytes).
template <int D>
struct Producer {
  using L = SmemLayout<D>;
  static constexpr int kStages = L::kStages;
  // Lives in shared memory: only thread 0 touches it, and keeping it out of registers leaves the
  // register budget (identical for all threads) to the MMA accumulators.
  int tile = 0, kb = 0;
  TileCoord c{};
  uint32_t n = 0, q_round = 0;

  __device__ __forceinline__ void start(const AttnParams& p) {
    n = 0;
    q_round = 0;
    tile = next_tile<false>(p, blockIdx.x);
    kb = 0;
    if (tile < p.num_tiles) c = decode_tile(p, tile);
    tma_prefetch_desc(&p.tm_q);
    tma_prefetch_desc(&p.tm_q_sf);
    tma_prefetch_desc(&p.tm_k);
    tma_prefetch_desc(&p.tm_k_sf);
    tma_prefetch_desc(&p.tm_v);
  }

  // Issues stages until `limit` stages have been issued in total (or the work runs out).
  __device__ __forceinline__ void run(const AttnParams& p, uint8_t* smem, uint32_t limit) {
    uint64_t* bars = reinterpret_cast<uint64_t*>(smem + L::kBarriers);
    uint64_t* q_full = bars + 0;
    uint64_t* q_empty = bars + 1;
    uint64_t* full = bars + 2;
    uint64_t* empty = bars + 2 + kStages;
    while (n < limit && tile < p.num_tiles) {
      if (kb == 0) {
        const int q_row0 = (c.b * p.heads_q + c.hq) * p.seq_q_pad + c.mb * kBlockM;
        mbar_wait(q_empty, (q_round & 1u) ^ 1u);
        mbar_arrive_expect_tx(q_full, L::kQTx);
        tma_load_2d(smem + L::kQ, &p.tm_q, q_full, 0, q_row0);
        tma_load_2d(smem + L::kQSf, &p.tm_q_sf, q_full, 0, q_row0 / kBlockM * L::kSfRowBytes);
        ++q_round;
      }
      const uint32_t st = n % kStages;
      uint8_t* stage = smem + L::kStage0 + st * L::kStageBytes;
      mbar_wait(&empty[st], ((n / kStages) & 1u) ^ 1u);
      mbar_arrive_expect_tx(&full[st], L::kStageTx);
      const int kv_bh = c.b * p.heads_kv + c.hk;
      const int k_row0 = kv_bh * p.seq_k_pad + kb * kBlockN;
      tma_load_2d(stage + L::kStageK, &p.tm_k, &full[st], 0, k_row0);
      tma_load_2d(stage + L::kStageKSf, &p.tm_k_sf, &full[st], 0, k_row0 / kBlockN * L::kSfRowBytes);
      tma_load_2d(stage + L::kStageV, &p.tm_v, &full[st], kb * L::kVRowBytes, kv_bh * D);
      ++n;
      if (++kb == c.num_kb) {
        kb = 0;
        tile = next_tile<false>(p, tile + gridDim.x);
        if (tile < p.num_tiles) c = decode_tile(p, tile);
      }
    }
  }
};

__device__ __forceinline__ uint4 lds_u4(uint32_t saddr) {
  uint4 v;
  asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];\n" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(saddr));
  return v;
}

__device__ __forceinline__ uint2 lds_u2(uint32_t saddr) {
  uint2 v;
  asm volatile("ld.shared.v2.b32 {%0, %1}, [%2];\n" : "=r"(v.x), "=r"(v.y) : "r"(saddr));
  return v;
}

__device__ __forceinline__ float4 lds_f4(uint32_t saddr) {
  float4 v;
  asm volatile("ld.shared.v4.f32 {%0, %1, %2, %3}, [%4];\n" : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "r"(saddr));
  return v;
}

__device__ __forceinline__ void sts_f32(uint32_t saddr, float v) {
  asm volatile("st.shared.f32 [%0], %1;\n" ::"r"(saddr), "f"(v) : "memory");
}

// Two float16s (element 0 in the low half) -> their values as fp32 (exact).
__device__ __forceinline__ float2 f16x2_value(uint32_t x) {
  return __half22float2(*reinterpret_cast<const __half2*>(&x));
}

// K^ x 2^-14 of elements 4q .. 4q+3 of a 16-element block of K, (E2M1(code) + res / 64) x 2^-14,
// from the block's codes word holding them (`word`: bytes 2(q & 1), 2(q & 1) + 1) and their two
// float16x2 residual words; element i (at<i>) in one fma (kResidualStep = 2^-20), evaluated where
// it is used. delta_s_part and the precompute (delta_s_blocks.cuh) both decode through it: the same bits.
struct KHat4 {
  float2 v0, v1, e0, e1;
  __device__ __forceinline__ KHat4(uint32_t word, int q, uint32_t res01, uint32_t res23)
      : v0(e2m1x2_scaled(word >> (16 * (q & 1)))), v1(e2m1x2_scaled(word >> (16 * (q & 1) + 8))),
        e0(f16x2_value(res01)), e1(f16x2_value(res23)) {}
  template <int i>
  __device__ __forceinline__ float at() const {
    if constexpr (i == 0) return fmaf(e0.x, kResidualStep, v0.x);
    if constexpr (i == 1) return fmaf(e0.y, kResidualStep, v0.y);
    if constexpr (i == 2) return fmaf(e1.x, kResidualStep, v1.x);
    return fmaf(e1.y, kResidualStep, v1.y);
  }
};

// Block `blk`'s scale x 2^14 from the word of a half-row's E4M3 scale bytes; a zero byte counts as
// 2^-9 (the residual's unit where the codes are 0): reference.residual_scales
__device__ __forceinline__ float khat_scale(uint32_t sf_word, int blk) {
  return e4m3_value(max((sf_word >> (8 * blk)) & 0xffu, 1u)) * 16384.f;
}

// This thread's share of K's quantization residual for delta_s_part: the D/2 float16s (D bytes)
// of half `half` of key row `key` (global) of the stage starting at key row k_row0, two 16-byte
// words per 16-element block; zeros without k_res (r . Kd then). The bytes are prefetched into L1
// one stage ahead (prefetch: no registers held across the stage wait; D bytes: one line at D 128,
// half of one at D 64).
template <int D>
struct ResidualHalf {
  uint4 w[D / 16];
  static __device__ __forceinline__ const uint8_t* addr(const uint8_t* k_res, int64_t k_row0, int key, int half) {
    return k_res + ((k_row0 + key) * D + half * (D / 2)) * 2;
  }
  static __device__ __forceinline__ void prefetch(const uint8_t* k_res, int64_t k_row0, int key, int half) {
    if (k_res != nullptr) asm volatile("prefetch.global.L1 [%0];" ::"l"(addr(k_res, k_row0, key, half)));
  }
  __device__ __forceinline__ void load(const uint8_t* k_res, int64_t k_row0, int key, int half) {
#pragma unroll
    for (int b = 0; b < D / 16; ++b) w[b] = make_uint4(0u, 0u, 0u, 0u);
    if (k_res == nullptr) return;
    const uint4* src = reinterpret_cast<const uint4*>(addr(k_res, k_row0, key, half));
#pragma unroll
    for (int b = 0; b < D / 16; ++b) w[b] = __ldg(src + b);
  }
};

// One thread's half of r . K^ for key row `key` of a stage's K tile: sum over the elements
// d = half*D/2 .. half*D/2 + D/2 - 1 of r[d] * K^[key][d], K^ = (E2M1(code) + res / 64) x E4M3
// scale (res: the residual's float16 value; scale byte 0 counts as 1). Order (fixed): per 16-element
// block, a sequential fp32 fma chain over the block's elements in order of r[d] times
// (E2M1(code) + res / 64) x 2^-14 (one fma: rounded once to fp32, as the reference's float32 sum),
// then times (scale x 2^14); block results summed in order.
template <int D>
__device__ __forceinline__ float delta_s_part(uint32_t k_tile, uint32_t ksf_tile, uint32_t mean_q, int key, int half,
                                              const ResidualHalf<D>& res) {
  constexpr int kBlocks = D / 32;  // 16-element blocks per half
  const uint32_t sf_addr = ksf_tile + key * (D / 16) + half * kBlocks;
  uint32_t sf;
  if constexpr (kBlocks == 4) {
    sf = lds_u32(sf_addr);
  } else {
    uint16_t v;
    asm volatile("ld.shared.u16 %0, [%1];\n" : "=h"(v) : "r"(sf_addr));
    sf = v;
  }
  float total = 0.f;
#pragma unroll
  for (int b = 0; b < kBlocks; b += 2) {
    // 16 bytes = blocks b and b+1 (8 bytes each) of this half
    const uint4 w = lds_u4(k_tile + swizzled<D / 2>(key * (D / 2) + half * (D / 4) + 8 * b));
    const uint32_t words[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
    for (int bb = 0; bb < 2; ++bb) {
      const uint32_t m_addr = mean_q + 4 * (half * (D / 2 + 4) + 16 * (b + bb));
      const uint4 r0 = res.w[2 * (b + bb)], r1 = res.w[2 * (b + bb) + 1];
      const uint32_t rwords[8] = {r0.x, r0.y, r0.z, r0.w, r1.x, r1.y, r1.z, r1.w};
      float acc = 0.f;
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const float4 m = lds_f4(m_addr + 16 * q);
        const KHat4 k(words[2 * bb + (q >> 1)], q, rwords[2 * q], rwords[2 * q + 1]);
        acc = fmaf(m.x, k.at<0>(), acc);
        acc = fmaf(m.y, k.at<1>(), acc);
        acc = fmaf(m.z, k.at<2>(), acc);
        acc = fmaf(m.w, k.at<3>(), acc);
      }
      total = fmaf(acc, khat_scale(sf, b + bb), total);
    }
  }
  return total;
}

// One row's MXFP8 scale bytes (2 at D 64, 4 at D 128) as a 32-bit word, byte c = k-chunk c.
template <int kBytes>
__device__ __forceinline__ uint32_t lds_sf_row(uint32_t saddr) {
  static_assert(kBytes == 2 || kBytes == 4, "MXFP8 scale bytes per row");
  if constexpr (kBytes == 4) {
    return lds_u32(saddr);
  } else {
    uint16_t v;
    asm volatile("ld.shared.u16 %0, [%1];\n" : "=h"(v) : "r"(saddr));
    return v;
  }
}

// S += Q K^T over bytes [64H, 64H + 64) of the FP8 rows (k-chunks 2H and 2H+1, 32 E4M3 values each,
// with scale bytes 2H and 2H+1 of q_sf / k_sf). Lane L reads key row `row` (= key_of(j, L & 7)),
// bytes 64H + 16(L >> 3): matrices 0/1 are chunk 2H's b0/b1, matrices 2/3 chunk 2H+1's. kQK16: the
// same bytes are 16-bit rows (32 bytes = one k16 chunk), multiplied by mma_m16n8k16 without scales.
template <int H, int kRow, int kQK16 = 0>
__device__ __forceinline__ void qk8_half(float (&s)[4], const uint32_t (&a0)[4], const uint32_t (&a1)[4],
                                         uint32_t k_tile, int row, int lane, uint32_t q_sf, uint32_t k_sf) {
  uint32_t kf[4];
  ldmatrix_x4(kf, k_tile + swizzled<kRow>(row * kRow + 64 * H + 16 * (lane >> 3)));
  const uint32_t b0[2] = {kf[0], kf[1]}, b1[2] = {kf[2], kf[3]};
  if constexpr (kQK16 != 0) {
    using T = std::conditional_t<kQK16 == 2, f16_t, bf16_t>;
    mma_m16n8k16<T>(s, a0, b0[0], b0[1]);
    mma_m16n8k16<T>(s, a1, b1[0], b1[1]);
  } else {
    mma_fp8<2 * H, 2 * H>(s, a0, b0, s, q_sf, k_sf);
    mma_fp8<2 * H + 1, 2 * H + 1>(s, a1, b1, s, q_sf, k_sf);
  }
}

// P.V in MXFP8 (kPV8), with
//   mma.sync ... kind::mxf8f6f4.block_scale.scale_vec::1X.m16n8k32 ... e4m3.e4m3.f32.ue8m0 (mma_fp8)
// per 32-key chunk C of the stage (keys 32C .. 32C+31). S's key order (key_of) already gives lane
// (g, t) keys 32C + 8t + i, i = 2jj + (e & 1), in accumulator e of n-tile 4C + jj: the 8 keys of
// the chunk it holds per row. The MMA's k index is a free relabelling of the chunk's keys (A and B
// only have to agree): k 4t + i is key 8t + i and k 16 + 4t + i is key 8t + 4 + i (i < 4). So P's
// A fragment is the lane's own values (a0/a1: n-tiles 4C, 4C+1; a2/a3: 4C+2, 4C+3; rows g, g+8)
// and B (channel d = 8n + g) is 8 consecutive bytes of V's row d at keys 32C + 8t: b0 the low
// word, b1 the high one (one 8-byte shared load, conflict-free under the 128-byte swizzle: rows
// 8n .. 8n+7 XOR distinct 16-byte chunks). P's 32-key block is the chunk: one UE8M0 byte per row
// from the chunk's amax (exp2 of its largest exponent, as the FP4 path's block amax). SF_A of row
// g comes from lane 4g, of row g + 8 from lane 4g + 1 (byte 0); SF_B of channel d from lane 4g,
// byte C of the stage's scale word of channel d (its 4 chunks).

// P's chunk C to MXFP8: pa (the A fragment) and this lane's row's scale byte (t & 1: row g + 8).
// The block amax is the largest P of the row's 32 keys (this lane's 8, then lanes t^1 and t^2):
// exactly the reference's, and nothing of the softmax's block maxima stays live into P.V.
template <int C>
__device__ __forceinline__ void pv8_quantize(const float (&s)[kBlockN / 8][4], int t, uint32_t (&pa)[4],
                                             uint32_t& p_sf) {
  constexpr int j = 4 * C;
  uint32_t b[2];
  float inv[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float m = fmaxf(s[j][2 * r], s[j][2 * r + 1]);
#pragma unroll
    for (int jj = 1; jj < 4; ++jj) m = fmaxf(m, fmaxf(s[j + jj][2 * r], s[j + jj][2 * r + 1]));
    m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 1));
    m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 2));
    b[r] = ue8m0_byte(m);  // common/mxfp8.cuh: reference.ue8m0_scale_byte
    inv[r] = ue8m0_inverse(b[r]);
  }
  pa[0] = e4m3x4_rn(s[j][0], s[j][1], s[j + 1][0], s[j + 1][1], inv[0]);
  pa[1] = e4m3x4_rn(s[j][2], s[j][3], s[j + 1][2], s[j + 1][3], inv[1]);
  pa[2] = e4m3x4_rn(s[j + 2][0], s[j + 2][1], s[j + 3][0], s[j + 3][1], inv[0]);
  pa[3] = e4m3x4_rn(s[j + 2][2], s[j + 2][3], s[j + 3][2], s[j + 3][3], inv[1]);
  p_sf = (t & 1) ? b[1] : b[0];
}

// o += P's chunk C x V's channels 8n .. 8n+7 (v_rows: row 8n of the stage's V tile; v_lane: this
// lane's row g and swizzled byte 8t; v_sf: channel 8n + g's scale word).
template <int C>
__device__ __forceinline__ void pv8_mma(float (&o)[4], const uint32_t (&pa)[4], uint32_t p_sf, uint32_t v_rows,
                                        uint32_t v_lane, uint32_t v_sf) {
  // v_lane's swizzled chunk bits (4..6) XOR the chunk term 32C (bits 5, 6): the chunk's bytes
  const uint2 vf = lds_u2(v_rows + (v_lane ^ (32 * C)));
  const uint32_t vb[2] = {vf.x, vf.y};
  mma_fp8<0, C>(o, pa, vb, o, p_sf, v_sf);
}

// Whether one of four E4M3 codes is zero or subnormal (exponent bits 0): a P that its block's
// scale leaves below E4M3's normal range. Any zero byte of w & 0x78787878, by the borrow trick.
__device__ __forceinline__ bool e4m3_subnormal_in(uint32_t w) {
  const uint32_t e = w & 0x78787878u;
  return ((e - 0x01010101u) & ~e & 0x80808080u) != 0u;
}

// The second term of P's chunk C (reference.mxfp8_p), for the rows whose block holds a zero or
// subnormal E4M3 code: the residual P - hi (hi: the first term's codes pa, dequantized) to MXFP8
// with its own scale, times V by one more MMA per 8 channels; the other rows' residuals count as
// zero (codes 0, adding nothing). Called only where a lane of the warp holds such a code
// (warp-uniform), so other chunks pay the check alone; per row, the flag is the OR over the row's
// four lanes, and the row's first-term scale byte comes from lane t ^ 1 for the other row.
template <int C, int D>
__device__ __forceinline__ void pv8_second(float (&o)[D / 8][4], const float (&s)[kBlockN / 8][4],
                                           const uint32_t (&hi)[4], uint32_t hi_sf, int t, uint32_t v_tile,
                                           uint32_t v_lane, uint32_t vsf_lane) {
  constexpr int j = 4 * C;
  const uint32_t other_sf = __shfl_xor_sync(0xffffffffu, hi_sf, 1);
  uint32_t pa[4], p_sf = 0;
#pragma unroll
  for (int r = 0; r < 2; ++r) {  // row g + 8r: this lane's keys 32C + 8t + 2jj + h in s[j + jj][2r + h]
    const float scale = __uint_as_float((((t & 1) == r) ? hi_sf : other_sf) << 23);  // 2^(b - 127)
    int small = e4m3_subnormal_in(hi[r]) || e4m3_subnormal_in(hi[2 + r]);
    small |= __shfl_xor_sync(0xffffffffu, small, 1);
    small |= __shfl_xor_sync(0xffffffffu, small, 2);
    float res[8], amax = 0.0f;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const uint32_t code = (hi[(i / 4) * 2 + r] >> (8 * (i % 4))) & 0xFFu;
      const float h = __half2float(__half(__nv_cvt_fp8_to_halfraw(static_cast<__nv_fp8_storage_t>(code),
                                                                   __NV_E4M3)));
      res[i] = small ? __fsub_rn(s[j + i / 2][2 * r + i % 2], __fmul_rn(h, scale)) : 0.0f;
      amax = fmaxf(amax, fabsf(res[i]));
    }
    amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 1));
    amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 2));
    const uint32_t b2 = ue8m0_byte(amax);
    const float inv2 = ue8m0_inverse(b2);
    pa[r] = e4m3x4_rn(res[0], res[1], res[2], res[3], inv2);
    pa[2 + r] = e4m3x4_rn(res[4], res[5], res[6], res[7], inv2);
    if ((t & 1) == r) p_sf = b2;
  }
#pragma unroll
  for (int n = 0; n < D / 8; ++n) {
    const uint32_t v_sf = lds_u32(vsf_lane + 32 * n);
    pv8_mma<C>(o[n], pa, p_sf, v_tile + n * 8 * kBlockN, v_lane, v_sf);
  }
}

// Chunks C0 .. C0 + G - 1 of P.V (G = 1, 2 or 4): P's chunks to MXFP8; each chunk's second term
// where a lane of the warp holds a zero or subnormal code (pv8_second); then per 8 channels the
// chunks' MMAs (the channel's scale word once). The second terms come before the first terms'
// MMAs: after them, ptxas spilled 448 bytes at D 128 with FP8 Q.K^T.
template <int C0, int G, int D>
__device__ __forceinline__ void pv8_pass(float (&o)[D / 8][4], const float (&s)[kBlockN / 8][4], int t,
                                         uint32_t v_tile, uint32_t v_lane, uint32_t vsf_lane) {
  static_assert(G == 1 || G == 2 || G == 4, "chunks per pass");
  uint32_t pa[G][4], p_sf[G];
  pv8_quantize<C0>(s, t, pa[0], p_sf[0]);
  if constexpr (G > 1) pv8_quantize<C0 + 1>(s, t, pa[1], p_sf[1]);
  if constexpr (G > 2) {
    pv8_quantize<C0 + 2>(s, t, pa[2], p_sf[2]);
    pv8_quantize<C0 + 3>(s, t, pa[3], p_sf[3]);
  }
#pragma unroll
  for (int c = 0; c < G; ++c) {
    const bool small = e4m3_subnormal_in(pa[c][0]) || e4m3_subnormal_in(pa[c][1]) || e4m3_subnormal_in(pa[c][2]) ||
                       e4m3_subnormal_in(pa[c][3]);
    if (__any_sync(0xffffffffu, small)) {
      if (c == 0) pv8_second<C0, D>(o, s, pa[0], p_sf[0], t, v_tile, v_lane, vsf_lane);
      if constexpr (G > 1) {
        if (c == 1) pv8_second<C0 + 1, D>(o, s, pa[1], p_sf[1], t, v_tile, v_lane, vsf_lane);
      }
      if constexpr (G > 2) {
        if (c == 2) pv8_second<C0 + 2, D>(o, s, pa[2], p_sf[2], t, v_tile, v_lane, vsf_lane);
        if (c == 3) pv8_second<C0 + 3, D>(o, s, pa[3], p_sf[3], t, v_tile, v_lane, vsf_lane);
      }
    }
  }
#pragma unroll
  for (int n = 0; n < D / 8; ++n) {
    const uint32_t v_sf = lds_u32(vsf_lane + 32 * n);
    const uint32_t v_rows = v_tile + n * 8 * kBlockN;
    pv8_mma<C0>(o[n], pa[0], p_sf[0], v_rows, v_lane, v_sf);
    if constexpr (G > 1) pv8_mma<C0 + 1>(o[n], pa[1], p_sf[1], v_rows, v_lane, v_sf);
    if constexpr (G > 2) {
      pv8_mma<C0 + 2>(o[n], pa[2], p_sf[2], v_rows, v_lane, v_sf);
      pv8_mma<C0 + 3>(o[n], pa[3], p_sf[3], v_rows, v_lane, v_sf);
    }
  }
}

// Where O goes back from V's exponents (see consumer): in the tile's last stage, which then reads
// a second slot of the stage's V exponent factors.
template <int D, bool kInLoopResidual, bool kPV8>
constexpr bool kBackInLoopOf = (kInLoopResidual || D == 128) && !kPV8;

template <int n>
__device__ __forceinline__ void setmaxnreg_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(n));
}

template <int n>
__device__ __forceinline__ void setmaxnreg_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(n));
}

// The producer warpgroup (warps 8-11 of a warp-specialized CTA). It walks the CTA's (tile, key
// block) sequence as the consumers do, kStages stages ahead at most. Per stage, once the consumer
// warps released it (`empty`): its first thread issues the TMA loads of K, K's scales and V (and
// a tile's Q on entering it), and its 128 threads write the stage's delta_s vector (ds_key's row,
// each key pair twice: delta_pair_offset), V's scales and V's tile exponent factors, then each
// arrives on `full` (count 1 + 128: the first thread's expect_tx arrival and every thread's own,
// which releases its stores to the consumers' wait). No CTA barrier per stage.
template <int D, bool kQK8, bool kPV8, int kQK16>
__device__ __forceinline__ void producer_warpgroup(const AttnParams& p, uint8_t* smem) {
  using L = SmemLayout<D, kQK8, kPV8, kQK16>;
  constexpr int kStages = L::kStages;
  constexpr int kVGroups = D / 32;
  constexpr int kVsfWords = kPV8 ? D : 2 * D;  // 4-byte words of V scales per stage
  constexpr bool kBackInLoop = kBackInLoopOf<D, false, kPV8>;
  // Whether a thread's delta_s pair and V scale word of a stage are read together, before the wait
  // for the stage (D 64 with FP4 Q.K^T), or each read and stored in turn after it (a shared store
  // with a memory clobber orders the next read after it: two round trips in series, the delta_s
  // one from DRAM with the defaults). At D 64 reading them together cut defaults / one Q mean by
  // 3-5% on the H200 stand-in against the same code reading in turn, in one run; D 128 and the
  // 16-bit Q.K^T kernels keep the reads in turn, where the change showed no gain (docs/performance.md,
  // "The producer's reads together").
  constexpr bool kReadsFirst = D == 64 && !kQK16;
  static_assert(!kReadsFirst || kVsfWords <= kProducerThreads, "one V scale word per thread read first");
  static_assert(kBlockN / 2 <= kProducerThreads && kVGroups <= kProducerThreads, "one key pair per thread");
  uint64_t* bars = reinterpret_cast<uint64_t*>(smem + L::kBarriers);
  uint64_t* q_full = bars + 0;
  uint64_t* q_empty = bars + 1;
  uint64_t* full = bars + 2;
  uint64_t* empty = bars + 2 + kStages;
  const int tid = threadIdx.x - kThreads;
  const bool leader = tid == 0;
  const uint32_t s_base = smem_u32(smem);
  if (leader) {
    tma_prefetch_desc(&p.tm_q);
    tma_prefetch_desc(&p.tm_q_sf);
    tma_prefetch_desc(&p.tm_k);
    tma_prefetch_desc(&p.tm_k_sf);
    tma_prefetch_desc(&p.tm_v);
  }
  uint32_t n = 0, q_round = 0;
  for (int tile = next_tile<true>(p, blockIdx.x); tile < p.num_tiles; tile = next_tile<true>(p, tile + gridDim.x), ++q_round) {
    const TileCoord c = decode_tile(p, tile);
    const int bh_q = c.b * p.heads_q + c.hq, kv_bh = c.b * p.heads_kv + c.hk;
    if (leader) {
      // kRaw: the inputs' rows (seq_q a head, unpadded; rows past it are masked or never written)
      const int q_row0 = bh_q * (L::kRaw ? p.seq_q : p.seq_q_pad) + c.mb * kBlockM;
      mbar_wait(q_empty, (q_round & 1u) ^ 1u);
      mbar_arrive_expect_tx(q_full, L::kQTx);
#pragma unroll
      for (int part = 0; part < L::kParts; ++part)
        tma_load_2d(smem + L::kQ + part * L::kQBytes, &p.tm_q, q_full, part * L::kRowBytes, q_row0);
      if constexpr (!kQK16) tma_load_2d(smem + L::kQSf, &p.tm_q_sf, q_full, 0, q_row0 / kBlockM * L::kSfRowBytes);
    }
    const float* ds_row = p.ds_key + static_cast<int64_t>(bh_q - p.bh0) * p.ds_bh_stride + c.mb * p.ds_m_stride;
    const uint8_t* v_sf = p.v_sf + static_cast<int64_t>(kv_bh) * D * (p.seq_k_pad / (kPV8 ? 32 : 16));
    const int v_exp_row = kv_bh * (p.seq_k_pad / kBlockN) * kVGroups;
    // V scales: FP4, word i = channel i / 2's bytes 4 (i & 1) .. +3 of the stage's 8; FP8 P.V,
    // word i = channel i's 4 bytes (one per 32 keys)
    auto vsf_src = [&](int i, int k0) {
      return kPV8 ? v_sf + static_cast<int64_t>(i) * (p.seq_k_pad / 32) + k0 / 32
                  : v_sf + static_cast<int64_t>(i >> 1) * (p.seq_k_pad / 16) + k0 / 16 + 4 * (i & 1);
    };
    for (int kb = 0; kb < c.num_kb; ++kb, ++n) {
      const uint32_t st = n % kStages;
      const int k0 = kb * kBlockN;
      uint8_t* stage = smem + L::kStage0 + st * L::kStageBytes;
      const uint32_t sstage = s_base + L::kStage0 + st * L::kStageBytes;
      // kReadsFirst: this thread's delta_s pair and V scale word into registers before the wait
      // (they do not need the stage): their latency passes during it, one round trip a thread
      // instead of one per vector. Each store below is still ordered after its read.
      float ds_first[2] = {0.f, 0.f};
      uint32_t vsf_first = 0;
      if constexpr (kReadsFirst) {
        if (tid < kBlockN / 2) ds_first[0] = __ldg(ds_row + k0 + 2 * tid), ds_first[1] = __ldg(ds_row + k0 + 2 * tid + 1);
        if (tid < kVsfWords) vsf_first = __ldg(reinterpret_cast<const uint32_t*>(vsf_src(tid, k0)));
      }
      mbar_wait(&empty[st], ((n / kStages) & 1u) ^ 1u);
      if (leader) {
        mbar_arrive_expect_tx(&full[st], L::kStageTx);
        const int k_row0 = kv_bh * (L::kRaw ? p.seq_k : p.seq_k_pad) + k0;
#pragma unroll
        for (int part = 0; part < L::kParts; ++part)
          tma_load_2d(stage + L::kStageK + part * L::kKPartBytes, &p.tm_k, &full[st], part * L::kRowBytes, k_row0);
        if constexpr (!kQK16) tma_load_2d(stage + L::kStageKSf, &p.tm_k_sf, &full[st], 0, k_row0 / kBlockN * L::kSfRowBytes);
        tma_load_2d(stage + L::kStageV, &p.tm_v, &full[st], kb * L::kVRowBytes, kv_bh * D);
      }
      // (the raw 16-bit rows' consumers read no delta_s: written all the same, one code for all)
      if (tid < kBlockN / 2) {  // keys 2 tid, 2 tid + 1: {d0, d1, d0, d1}
        float d0, d1;
        if constexpr (kReadsFirst) d0 = ds_first[0], d1 = ds_first[1];
        else d0 = __ldg(ds_row + k0 + 2 * tid), d1 = __ldg(ds_row + k0 + 2 * tid + 1);
        asm volatile("st.shared.v4.f32 [%0], {%1, %2, %3, %4};\n" ::"r"(sstage + L::kStageDelta + delta_pair_offset(tid)),
                     "f"(d0), "f"(d1), "f"(d0), "f"(d1)
                     : "memory");
      }
#pragma unroll
      for (int i = tid; i < kVsfWords; i += kProducerThreads) {
        uint32_t w;
        if constexpr (kReadsFirst) w = vsf_first;
        else w = __ldg(reinterpret_cast<const uint32_t*>(vsf_src(i, k0)));
        asm volatile("st.shared.u32 [%0], %1;\n" ::"r"(sstage + L::kStageVSf + 4 * i), "r"(w) : "memory");
      }
      if constexpr (!kPV8) {
        // V's tile exponents: 2^(e_kb - e_(kb-1)) (exact, at most 2^80), 1 for a tile's first stage
        // or without exponents; and 2^-e_kb where the last stage takes O back
        if (tid >= kProducerThreads - kVGroups) {
          const int x = tid - (kProducerThreads - kVGroups);
          int e = 0, prev = 0;
          if (p.v_exp != nullptr) {
            const int8_t* ep = p.v_exp + (v_exp_row + kb * kVGroups + x);  // one 64-bit add: nothing 64-bit held across tiles
            e = __ldg(ep);
            prev = kb > 0 ? __ldg(ep - kVGroups) : e;
          }
          sts_f32(sstage + L::kStageVExp + 4 * x, __int_as_float((e - prev + 127) << 23));
          if constexpr (kBackInLoop) sts_f32(sstage + L::kStageVExp + 16 + 4 * x, __int_as_float((127 - e) << 23));
        }
      }
      mbar_arrive(&full[st]);
    }
  }
}

template <int D, bool kInLoopResidual, bool kQK8 = false, bool kPV8 = false, int kQK16 = 0>
__device__ __forceinline__ void consumer(const AttnParams& p, uint8_t* smem, int warp) {
  using L = SmemLayout<D, kQK8, kPV8, kQK16>;
  constexpr int kStages = L::kStages;
  constexpr int kRow = L::kRowBytes;   // a part's row (the whole row but for the 16-bit Q.K^T at D 128)
  constexpr int kParts = L::kParts;
  constexpr int kPartChunks = kRow / 32;  // MMA k-chunks of a part (32 bytes each: k64 FP4, k32 FP8, k16 bf16)
  constexpr int kChunks = kParts * kPartChunks;  // of the head dim
  constexpr int kNT = kBlockN / 8;      // n-tiles of S
  constexpr int kDT = D / 8;            // n-tiles of O
  constexpr int kVGroups = D / 32;      // 32-channel groups of V's tile exponents (4 n-tiles each)
  // Where O goes back from V's exponents: in the tile's last stage (a branch in the key loop) at
  // D 128 and in the bounded-memory instantiation, else in the epilogue. Measured on the H200
  // stand-in and ptxas 13.0's spills: the epilogue costs D 128 5% there (docs/performance.md,
  // "V's tile exponents"); at D 64 the branch would add 32 multiplies to its issue-bound count.
  constexpr bool kBackInLoop = kBackInLoopOf<D, kInLoopResidual, kPV8>;
  uint64_t* bars = reinterpret_cast<uint64_t*>(smem + L::kBarriers);
  uint64_t* q_full = bars + 0;
  uint64_t* q_empty = bars + 1;
  uint64_t* full = bars + 2;
  uint64_t* empty = bars + 2 + kStages;
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const uint32_t s_base = smem_u32(smem);
  const int row_in_tile = warp * 16;

  // kWS: the producer warpgroup (producer_warpgroup) fills the stages; else thread 0 issues the
  // TMA between its own MMA work and the CTA fills each stage's vectors before a CTA barrier.
  constexpr bool kWS = !kInLoopResidual;
  const bool is_producer = !kWS && threadIdx.x == 0;
  static_assert(kWS || (!kQK8 && !kPV8 && !kQK16), "the bounded mode: FP4 Q.K^T and P.V only");
  using Prod = Producer<D>;  // the bounded mode's (is_producer is false in every other instantiation)
  Prod& prod = *reinterpret_cast<Prod*>(smem + L::kProducerState);
  if (is_producer) prod.start(p);

  // Per-lane parts of the shared-memory addresses (see the loops below).
  // D=128: lane L reads row key_of(j, L&7), bytes 16(L>>3) (one n-tile, both chunks);
  // D=64:  lane L reads row key_of(j + (L>>4), L&7) = key_of(j, L&7) + 2(L>>4), bytes 16((L>>3)&1).
  const uint32_t k_lane_row = (kChunks == 2 ? key_of(0, lane & 7) : key_of(0, lane & 7) + 2 * (lane >> 4)) * (D / 2);
  const uint32_t k_lane_col = kChunks == 2 ? 16 * (lane >> 3) : 16 * ((lane >> 3) & 1);
  const uint32_t ksf_lane = key_of(0, g) * (D / 16) + (kChunks == 2 ? 4 * (t & 1) : 0);
  // FP4 V: ldmatrix rows; FP8 V (kPV8): row g, bytes 8t of a chunk, under the 128-byte swizzle
  const uint32_t v_lane = kPV8 ? g * kBlockN + ((8 * t) ^ (g << 4))
                               : swizzled<kBlockN / 2>((lane & 7) * (kBlockN / 2) + 16 * (lane >> 3));
  // delta_pair_offset(key_of(j, 0) / 2 + 4t) = delta_pair_offset(key_of(j, 0) / 2) + this
  const uint32_t delta_lane = 16 * (4 * t) + 16 * (t >> 1);

  RingPos<kStages> ring;
  uint32_t q_round = 0;
  // delta_s: thread i handles half (i & 1) of the head dim of key row i >> 1 of each stage.
  const int ds_k = threadIdx.x >> 1, ds_half = threadIdx.x & 1;
  static_assert(kThreads == 2 * kBlockN, "two threads per key for delta_s");
  static_assert(2 * D <= kThreads, "one 4-byte word of V scales per thread and stage");
  for (int tile = next_tile<!kInLoopResidual>(p, blockIdx.x); tile < p.num_tiles;
       tile = next_tile<!kInLoopResidual>(p, tile + gridDim.x), ++q_round) {
    const TileCoord c = decode_tile(p, tile);
    const int m0 = c.mb * kBlockM;
    if (is_producer) prod.run(p, smem, ring.n + kStages);
    __syncwarp();

    const int bh_q = c.b * p.heads_q + c.hq;
    bool has_residual = false;
    const int64_t kres_row0 = static_cast<int64_t>(c.b * p.heads_kv + c.hk) * p.seq_k_pad;
    if constexpr (kInLoopResidual) {
      // ---- this tile's Q mean residual r = mean_q - qbar into shared memory ----
      // Safe to overwrite: every thread read the previous tile's residual before the last stage barrier.
      int nonzero = 0;
      if (threadIdx.x < D / 4) {
        const float* mq = p.mean_q + (static_cast<int64_t>(bh_q) * p.mean_qblocks + (p.mean_qblocks > 1 ? c.mb : 0)) * D;
        const float4 m = __ldg(reinterpret_cast<const float4*>(mq) + threadIdx.x);
        const float4 g = __ldg(reinterpret_cast<const float4*>(p.qbar + static_cast<int64_t>(bh_q) * D) + threadIdx.x);
        const float4 v = make_float4(__fsub_rn(m.x, g.x), __fsub_rn(m.y, g.y), __fsub_rn(m.z, g.z), __fsub_rn(m.w, g.w));
        nonzero = v.x != 0.f || v.y != 0.f || v.z != 0.f || v.w != 0.f;
        const int d = 4 * threadIdx.x;
        *reinterpret_cast<float4*>(smem + L::kMeanQ + 4 * (d + (d >= D / 2 ? 4 : 0))) = v;
      }
      has_residual = __syncthreads_or(nonzero) != 0;
      if (has_residual) ResidualHalf<D>::prefetch(p.k_res, kres_row0, ds_k, ds_half);  // the first stage's
    }
    // At D 64 (issue-bound), this thread's delta_s entry of the tile's first stage; each stage moves
    // it kBlockN keys on (kWalk), and the V scales' pointer below likewise: an address from two
    // registers instead of 64-bit arithmetic per stage (14 fewer warp-instructions per stage). Not
    // at D 128 (tensor-bound on sm_120): there the H200 stand-in ran 3% slower with them, and with
    // FP8 Q.K^T ptxas 13.0 spilled more (20/20 -> 68/84 bytes; with FP8 P.V, 12/16 -> 20/36); each
    // stage adds its offset to fixed pointers instead (docs/performance.md, "V's tile exponents").
    constexpr bool kWalk = D == 64;
    const float* ds_key_row = p.ds_key + static_cast<int64_t>(bh_q - p.bh0) * p.ds_bh_stride + c.mb * p.ds_m_stride;
    const float* ds_key_ptr = ds_key_row + ds_k;

    // ---- Q fragments and scales into registers, then hand the Q buffer back (the resident Q's at
    // the tile's end: its key tiles read the fragments again) ----
    // matrices: rows 0-7 / 8-15 of the warp's 16, bytes [32ch, +16) then [32ch+16, +16)
    const uint32_t q_lane = (row_in_tile + (lane & 7) + 8 * ((lane >> 3) & 1)) * kRow + 16 * (lane >> 4);
    mbar_wait(q_full, q_round & 1u);
    uint32_t qa[kChunks][4];
    if constexpr (!L::kQResident) {
#pragma unroll
      for (int ch = 0; ch < kChunks; ++ch) ldmatrix_x4(qa[ch], s_base + L::kQ + swizzled<kRow>(q_lane + 32 * ch));
    }
    // FP4: lane 4g+t: row g + 8(t&1), k-chunk t>>1 (SF_A with thread-id-a = chunk). FP8: lane 4g+t:
    // all of row g + 8(t&1)'s scale bytes (SF_A with thread-id-a 0, byte-id = chunk).
    // kQK16: no scales.
    uint32_t q_sf = 0;
    if constexpr (kQK16) {
    } else if constexpr (kQK8) {
      q_sf = lds_sf_row<L::kSfRowBytes>(s_base + L::kQSf + (row_in_tile + g + 8 * (t & 1)) * L::kSfRowBytes);
    } else {
      q_sf = lds_u32(s_base + L::kQSf + (row_in_tile + g + 8 * (t & 1)) * (D / 16) + 4 * (kChunks == 2 ? (t >> 1) : 0));
    }
    if constexpr (!L::kQResident) {
      __syncwarp();
      if (lane == 0) mbar_arrive(q_empty);
    }

    float o[kDT][4];
#pragma unroll
    for (int n = 0; n < kDT; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
    float row_max[2] = {-INFINITY, -INFINITY};
    float row_sum[2] = {0.f, 0.f};

    const int kv_bh = c.b * p.heads_kv + c.hk;
    const uint8_t* v_sf_head = p.v_sf + static_cast<int64_t>(kv_bh) * D * (p.seq_k_pad / 16);
    const int row_g = m0 + row_in_tile + g;  // this lane's rows: row_g, row_g + 8
    // V scales of a stage (copied into it by the producer warpgroup, or in the bounded mode by thread
    // i < 2D: row d = i / 2, bytes 4(i & 1) .. +3 of the stage's 8, from v_sf_copy: the first stage's
    // bytes, with kWalk moved on by each stage's): d x 8 bytes, lane 4g + t reads d = 8n + g, bytes
    // 4(t & 1) (key chunk t & 1). kPV8 (v_sf: (B, Hkv, D, Sk_pad/32) UE8M0): channel i's 4 bytes of
    // the stage at word i (D x 4 bytes); lane 4g + t reads channel 8n + g's word (byte = key chunk).
    const uint8_t* v_sf_copy = v_sf_head + static_cast<int64_t>(threadIdx.x >> 1) * (p.seq_k_pad / 16) + 4 * (threadIdx.x & 1);
    const uint32_t v_sf_lane = kPV8 ? 4 * g : g * 8 + 4 * (t & 1);
    // V's tile exponents of this kv head: tile kb, group x at p.v_exp[v_exp_row + kb * kVGroups + x]
    const int v_exp_row = kv_bh * (p.seq_k_pad / kBlockN) * kVGroups;  // < 2^31: k's rows are int too

    for (int kb = 0; kb < c.num_kb; ++kb, ring.advance()) {
      const int k0 = kb * kBlockN;
      if (is_producer) prod.run(p, smem, ring.n + kStages);
      __syncwarp();
      const uint32_t st = ring.stage();
      const uint32_t stage = s_base + L::kStage0 + st * L::kStageBytes;
      mbar_wait(&full[st], ring.full_parity());

      // ---- delta_s of this stage's keys (whole CTA), into the stage's vector ----
      // delta_s[j] = ds_key[j] + (part_0 + part_1), the two halves of r . K^[j] (0 without residual).
      // The vector of stage st is rewritten kStages iterations later, after 2 more barriers: by
      // then every warp has read it. (kWS: the producer warpgroup wrote them before its arrival.)
      if constexpr (!kWS) {
        float res = 0.f;
        if (has_residual) {
          ResidualHalf<D> kres;
          kres.load(p.k_res, kres_row0 + k0, ds_k, ds_half);
          if (kb + 1 < c.num_kb) ResidualHalf<D>::prefetch(p.k_res, kres_row0 + k0 + kBlockN, ds_k, ds_half);
          const float part =
              delta_s_part<D>(stage + L::kStageK, stage + L::kStageKSf, s_base + L::kMeanQ, ds_k, ds_half, kres);
          res = __fadd_rn(part, __shfl_xor_sync(0xffffffffu, part, 1));
        }
        // pair layout {d[2i], d[2i+1], d[2i], d[2i+1]}: the two threads of key ds_k write a copy each
        if constexpr (kWalk) {
          sts_f32(stage + L::kStageDelta + delta_pair_offset(ds_k >> 1) + 8 * ds_half + 4 * (ds_k & 1),
                  __fadd_rn(__ldg(ds_key_ptr), res));
        } else {
          sts_f32(stage + L::kStageDelta + delta_pair_offset(ds_k >> 1) + 8 * ds_half + 4 * (ds_k & 1),
                  __fadd_rn(__ldg(ds_key_row + k0 + ds_k), res));
        }
        if (threadIdx.x < 2 * D) {
          const uint32_t w = __ldg(reinterpret_cast<const uint32_t*>(kWalk ? v_sf_copy : v_sf_copy + k0 / 16));
          asm volatile("st.shared.u32 [%0], %1;\n" ::"r"(stage + L::kStageVSf + 4 * threadIdx.x), "r"(w) : "memory");
        }
        // V's tile exponents: the factor 2^(e_kb - e_(kb-1)) that moves O to this tile's scale
        // (exact, at most 2^80: |e| <= 40), 1 for the first tile (O is 0) or without exponents
        if (threadIdx.x >= kThreads - kVGroups) {
          const int x = threadIdx.x - (kThreads - kVGroups);
          int e = 0, prev = 0;
          if (p.v_exp != nullptr) {
            const int8_t* ep = p.v_exp + v_exp_row + kb * kVGroups + x;
            e = __ldg(ep);
            prev = kb > 0 ? __ldg(ep - kVGroups) : e;
          }
          sts_f32(stage + L::kStageVExp + 4 * x, __int_as_float((e - prev + 127) << 23));
          if constexpr (kBackInLoop) sts_f32(stage + L::kStageVExp + 16 + 4 * x, __int_as_float((127 - e) << 23));
        }
        __syncthreads();
      }

      // ---- S = delta_s + Q K^T ----
      float s[kNT][4];
#pragma unroll
      for (int j = 0; j < kNT; ++j) {
        if constexpr (L::kRaw) {  // no delta_s: S = q.k^T of the raw rows
          s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.f;
          continue;
        }
        // rows g and g + 8 of keys 2i, 2i+1 in one load straight into the accumulator's registers
        // (a pair loaded once took four register moves: docs/performance.md, section 3)
        // pair key_of(j, 0) / 2 + 4t: the carry into bit 3 of the pair index comes from t alone
        static_assert(key_of(0, 2) == 8 && (key_of(3, 0) & 15) == 6, "pair index split");
        const float4 dl = lds_f4(stage + L::kStageDelta + delta_lane + delta_pair_offset(key_of(j, 0) / 2));
        s[j][0] = dl.x; s[j][1] = dl.y; s[j][2] = dl.z; s[j][3] = dl.w;
      }
      if constexpr (kQK8) {
        // FP8: per n-tile j, one ldmatrix.x4 per 64 bytes of the key rows (lane L: row key_of(j, L&7),
        // bytes 64h + 16(L>>3)): chunk 2h in kf[0..1], chunk 2h+1 in kf[2..3]; the K scale word of
        // key column g (all its chunks) in every lane of quad g.
        // the resident Q's fragments (kQResident), read once a key tile; else those held since the
        // tile began
        uint32_t qr[kChunks][4];
        if constexpr (L::kQResident) {
#pragma unroll
          for (int x = 0; x < kChunks; ++x)
            ldmatrix_x4(qr[x], s_base + L::kQ + (x / kPartChunks) * L::kQBytes + swizzled<kRow>(q_lane + 32 * (x % kPartChunks)));
        }
        const uint32_t(&qf)[kChunks][4] = L::kQResident ? qr : qa;
#pragma unroll
        for (int j = 0; j < kNT; ++j) {
          const int row = key_of(j, 0) + key_of(0, lane & 7);
          uint32_t k_sf = 0;
          if constexpr (!kQK16)
            k_sf = lds_sf_row<L::kSfRowBytes>(stage + L::kStageKSf + (key_of(j, 0) + key_of(0, g)) * L::kSfRowBytes);
#pragma unroll
          for (int part = 0; part < kParts; ++part) {
            const uint32_t k_part = stage + L::kStageK + part * L::kKPartBytes;
            qk8_half<0, kRow, kQK16>(s[j], qf[2 * part], qf[2 * part + 1], k_part, row, lane, q_sf, k_sf);
            if constexpr (kRow == 128) qk8_half<1, kRow, kQK16>(s[j], qf[2 * part + 2], qf[2 * part + 3], k_part, row, lane, q_sf, k_sf);
          }
        }
      } else {
      // Key rows of n-tile j: key_of(j, x) = key_of(j, 0) + key_of(0, x), and the swizzle XOR of
      // such a row depends on j only (see key_swizzle), so each address is a per-lane base plus
      // compile-time terms.
#pragma unroll
      for (int j = 0; j < kNT; j += (kChunks == 2 ? 1 : 2)) {
        uint32_t kf[4];
        const uint32_t k_addr = stage + L::kStageK + k_lane_row + key_of(j, 0) * (D / 2) + (k_lane_col ^ key_swizzle<D / 2>(j));
        ldmatrix_x4(kf, k_addr);
        const uint32_t b0[2] = {kf[0], kf[1]}, b1[2] = {kf[2], kf[3]};
        if constexpr (kChunks == 2) {
          // lane 4g+t: key column g of n-tile j, chunk t (SF_B with thread-id-b = chunk)
          const uint32_t k_sf = lds_u32(stage + L::kStageKSf + ksf_lane + key_of(j, 0) * (D / 16));
          mma_fp4<0, 0>(s[j], qa[0], b0, s[j], q_sf, k_sf);
          mma_fp4<1, 1>(s[j], qa[kChunks - 1], b1, s[j], q_sf, k_sf);
        } else {
          const uint32_t k_sf0 = lds_u32(stage + L::kStageKSf + ksf_lane + key_of(j, 0) * (D / 16));
          const uint32_t k_sf1 = lds_u32(stage + L::kStageKSf + ksf_lane + key_of(j + 1, 0) * (D / 16));
          mma_fp4<0, 0>(s[j], qa[0], b0, s[j], q_sf, k_sf0);
          mma_fp4<0, 0>(s[j + 1], qa[0], b1, s[j + 1], q_sf, k_sf1);
        }
      }
      }

      // ---- masks: keys past seq_k, and the causal diagonal ----
      const bool tail = k0 + kBlockN > p.seq_k;
      const bool diag = p.causal && (k0 + kBlockN - 1 > m0 + row_in_tile);
      if (tail || diag) {
#pragma unroll
        for (int j = 0; j < kNT; ++j) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int key = k0 + key_of(j, 0) + key_of(0, 2 * t + (e & 1));
            const int row = row_g + 8 * (e >> 1);
            if (key >= p.seq_k || (p.causal && key > row)) s[j][e] = -INFINITY;
          }
        }
      }

      // ---- online softmax (exp2 domain), level-1 scaling folded into the exponent ----
      // Maxima of S per 16-key block of P (bm[q][h][r]: row g + 8r, keys 64q + 32h + 16(t>>1) ..
      // +15, this lane's 8 and its partner t^1's), then the row maxima from them. P's block amax
      // is exp2 of the block's largest exponent (P rises with S: scale_log2 >= 0), computed once
      // per block instead of a maximum over its 8 values of P.
      float bm[kBlockN / 64][2][2];
#pragma unroll
      for (int q = 0; q < kBlockN / 64; ++q)
#pragma unroll
        for (int h = 0; h < 2; ++h)
#pragma unroll
          for (int r = 0; r < 2; ++r) {
            float m = fmaxf(s[8 * q + 4 * h][2 * r], s[8 * q + 4 * h][2 * r + 1]);
#pragma unroll
            for (int jj = 1; jj < 4; ++jj) m = fmaxf(m, fmaxf(s[8 * q + 4 * h + jj][2 * r], s[8 * q + 4 * h + jj][2 * r + 1]));
            bm[q][h][r] = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 1));
          }
      // V's group factors of this stage, 2^(e_kb - e_(kb-1)) (1 without exponents, and for FP8 P.V)
      constexpr bool kLateRescale = kQK8 && !kPV8;
      float vf[kVGroups], o_scale[2];
#pragma unroll
      for (int x = 0; x < kVGroups; ++x) vf[x] = 1.f;
      if constexpr (!kPV8 && !kLateRescale) {
        if constexpr (kVGroups == 4) {
          const float4 f4 = lds_f4(stage + L::kStageVExp);
          vf[0] = f4.x; vf[1] = f4.y; vf[2] = f4.z; vf[3] = f4.w;
        } else {
          const float2 f2 = lds_f2(stage + L::kStageVExp);
          vf[0] = f2.x; vf[1] = f2.y;
        }
      }
      float bias[2];
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        float mx = bm[0][0][r];
#pragma unroll
        for (int q = 0; q < kBlockN / 64; ++q)
#pragma unroll
          for (int h = 0; h < 2; ++h)
            if (q + h > 0) mx = fmaxf(mx, bm[q][h][r]);
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        const float m_new = fmaxf(row_max[r], mx * p.scale_log2);
        const float m_use = m_new == -INFINITY ? 0.f : m_new;  // fully masked so far: P = 0
        const float alpha = fast_exp2(row_max[r] - m_use);      // exp2(-inf) = 0 on the first block
        row_max[r] = m_new;
        row_sum[r] *= alpha;
        // alpha times V's group factor of this stage (exact: a power of two); with FP8 Q.K^T and
        // FP4 P.V once P is in registers (below): S is dead then, and registers scarce here
        o_scale[r] = alpha;
        if constexpr (!kLateRescale) {
#pragma unroll
          for (int x = 0; x < kVGroups; ++x) {
            const float ag = alpha * vf[x];
#pragma unroll
            for (int n = 4 * x; n < 4 * x + 4; ++n) {
              o[n][2 * r] *= ag;
              o[n][2 * r + 1] *= ag;
            }
          }
        }
        bias[r] = (kPV8 ? 0.f : kLog2P2Max) - m_use;  // FP8 P: P = exp2(t - m), no 2688 factor
      }
      // P / s in the exponent with FP4 Q.K^T (p_chunk_nvfp4); else the exponentials first (quantize_p_chunk)
      constexpr bool kFoldP = L::kFoldP;
      if constexpr (!kFoldP) {
#pragma unroll
        for (int j = 0; j < kNT; ++j) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const float v = fast_exp2(fmaf(s[j][e], p.scale_log2, bias[e >> 1]));
            s[j][e] = v;
            row_sum[e >> 1] += v;
          }
        }
      }
      if constexpr (kPV8) {
        // ---- P -> MXFP8 and O += P V, per 32-key chunk (pv8_quantize, pv8_mma) ----
        static_assert(kBlockN == 128, "four 32-key chunks per stage");
        // chunks per pass (P's codes of G chunks live at once): what spilled least at D 128 when
        // chosen (ptxas 13.0, sm_120a, before the producer warpgroup; D 64 spills none either way):
        // with FP4 Q.K^T four passes of one, with FP8 Q.K^T one pass of four. Spills now
        // (`python -m ci.checks.kernel_report` at c65bb61, in bytes stored): FP4 Q.K^T 12 at sm_120a,
        // none at sm_121a; FP8 Q.K^T none at sm_120a, 20 at sm_121a.
        constexpr int G = (kQK8 && D == 128) ? 4 : 1;
        const uint32_t v_tile = stage + L::kStageV, vsf_lane = stage + L::kStageVSf + v_sf_lane;
        pv8_pass<0, G, D>(o, s, t, v_tile, v_lane, vsf_lane);
        if constexpr (G < 4) pv8_pass<G, G, D>(o, s, t, v_tile, v_lane, vsf_lane);
        if constexpr (G == 1) {
          pv8_pass<2, G, D>(o, s, t, v_tile, v_lane, vsf_lane);
          pv8_pass<3, G, D>(o, s, t, v_tile, v_lane, vsf_lane);
        }
      } else {
        // ---- P2 -> NVFP4 (level 2; with FP4 Q.K^T folded into P's exponent: p_chunk_nvfp4) and O += P V ----
        uint32_t pa[kBlockN / 64][4], p_sf[kBlockN / 64];
#pragma unroll
        for (int q = 0; q < kBlockN / 64; ++q) {
          float pv[2][2][8];  // [h][r][i]: S (kFoldP) or P2 of row g+8r, keys 64q + 32h + 8t + i
#pragma unroll
          for (int h = 0; h < 2; ++h)
#pragma unroll
            for (int jj = 0; jj < 4; ++jj)
#pragma unroll
              for (int r = 0; r < 2; ++r) {
                pv[h][r][2 * jj] = s[8 * q + 4 * h + jj][2 * r];
                pv[h][r][2 * jj + 1] = s[8 * q + 4 * h + jj][2 * r + 1];
              }
          float amax[2][2];
#pragma unroll
          for (int h = 0; h < 2; ++h)
#pragma unroll
            for (int r = 0; r < 2; ++r) amax[h][r] = fast_exp2(fmaf(bm[q][h][r], p.scale_log2, bias[r]));
          if constexpr (kFoldP) p_chunk_nvfp4(pv, amax, bias, p.scale_log2, s_base + L::kPScale, row_sum, pa[q], p_sf[q]);
          else quantize_p_chunk(pv, amax, pa[q], p_sf[q]);
        }
        if constexpr (kLateRescale) {
#pragma unroll
          for (int x = 0; x < kVGroups; ++x) {
            const float f = __uint_as_float(lds_u32(stage + L::kStageVExp + 4 * x));
#pragma unroll
            for (int r = 0; r < 2; ++r) {
              const float ag = o_scale[r] * f;
#pragma unroll
              for (int n = 4 * x; n < 4 * x + 4; ++n) {
                o[n][2 * r] *= ag;
                o[n][2 * r + 1] *= ag;
              }
            }
          }
        }
#pragma unroll
        for (int n = 0; n < kDT; ++n) {
          // V^T rows d = 8n .. 8n+7; matrices = key bytes [0,16) [16,32) [32,48) [48,64)
          const uint32_t v_sf = lds_u32(stage + L::kStageVSf + v_sf_lane + 64 * n);
          uint32_t vf[4];
          ldmatrix_x4(vf, stage + L::kStageV + v_lane + 8 * n * (kBlockN / 2));
          const uint32_t b0[2] = {vf[0], vf[1]}, b1[2] = {vf[2], vf[3]};
          // SF_B of column d = 8n+g for key chunk q sits in lane 4g + q: thread-id-b = q
          mma_fp4<0, 0>(o[n], pa[0], b0, o[n], p_sf[0], v_sf);
          mma_fp4<0, 1>(o[n], pa[1], b1, o[n], p_sf[1], v_sf);
        }
      }
      if constexpr (kBackInLoop) {
        // the tile's last stage: O back from V's exponents (2^-e of its groups, exact), read
        // before the stage is released
        if (kb + 1 == c.num_kb) {
#pragma unroll
          for (int x = 0; x < kVGroups; ++x) {
            const float back = __uint_as_float(lds_u32(stage + L::kStageVExp + 16 + 4 * x));
#pragma unroll
            for (int n = 4 * x; n < 4 * x + 4; ++n)
#pragma unroll
              for (int e = 0; e < 4; ++e) o[n][e] *= back;
          }
        }
      }
      // kWS: every lane arrives (count 256), so that each lane's own reads of the stage are
      // released to the producer warpgroup's stores into it, not through a warp barrier
      __syncwarp();
      if (kWS || lane == 0) mbar_arrive(&empty[st]);
      if constexpr (kWalk && !kWS) {
        ds_key_ptr += kBlockN;
        v_sf_copy += kBlockN / 16;
      }
    }
    if constexpr (L::kQResident) {  // the resident Q read for the last time: its buffers back
      __syncwarp();
      if (lane == 0) mbar_arrive(q_empty);
    }

    // ---- epilogue ----
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      row_sum[r] += __shfl_xor_sync(0xffffffffu, row_sum[r], 1);
      row_sum[r] += __shfl_xor_sync(0xffffffffu, row_sum[r], 2);
    }
    // O back from V's exponents: 2^-e of the last stage's groups (exact; 1 without exponents),
    // folded into 1 / l per group (the bounded-memory instantiation did it in its last stage)
    float v_back[kVGroups];
#pragma unroll
    for (int x = 0; x < kVGroups; ++x)
      v_back[x] = kPV8 || kBackInLoop || p.v_exp == nullptr
                      ? 1.f
                      : __int_as_float((127 - static_cast<int>(__ldg(p.v_exp + v_exp_row + (c.num_kb - 1) * kVGroups + x))) << 23);
    store_output<D>(p, c.b * p.heads_q + c.hq, row_g, o, row_sum, v_back);
  }
}

template <int D, bool kInLoopResidual, bool kQK8 = false, bool kPV8 = false, int kQK16 = 0>
__device__ __forceinline__ void attn_fwd_body(const AttnParams& p) {
  using L = SmemLayout<D, kQK8, kPV8, kQK16>;
  constexpr int kStages = L::kStages;
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  constexpr bool kWS = !kInLoopResidual;
  const int warp = threadIdx.x >> 5;
  if (threadIdx.x == 0) {
    uint64_t* bars = reinterpret_cast<uint64_t*>(smem + L::kBarriers);
    mbar_init(&bars[0], 1);                   // q_full: producer's expect_tx arrival
    mbar_init(&bars[1], kConsumerWarps);      // q_empty: one arrival per consumer warp
    for (int s = 0; s < kStages; ++s) {
      mbar_init(&bars[2 + s], kWS ? 1 + kProducerThreads : 1);  // full (kWS: see producer_warpgroup)
      mbar_init(&bars[2 + kStages + s], kWS ? kThreads : kConsumerWarps);  // empty (kWS: every lane)
    }
    mbar_init_fence();
  }
  if constexpr (L::kFoldP) {
    static_assert(kCtaThreads<kInLoopResidual> >= kPScaleBytes, "one table entry a thread");
    if (threadIdx.x < kPScaleBytes) p_scale_table(smem + L::kPScale, threadIdx.x);
  }
  __syncthreads();
  if constexpr (kWS) {
    if (warp >= kConsumerWarps) {
      setmaxnreg_dec<kProducerRegs>();
      producer_warpgroup<D, kQK8, kPV8, kQK16>(p, smem);
      return;
    }
    setmaxnreg_inc<kConsumerRegs>();
  }
  consumer<D, kInLoopResidual, kQK8, kPV8, kQK16>(p, smem, warp);
}

}  // namespace sageattn3::attn
