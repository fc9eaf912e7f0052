// delta_s per query block and key, computed before the attention kernel (the default path with
// per-block Q means):
//   ds[bh][mb][j] = ds_key[bh][j] + r_mb . K^[j],   r_mb = mean_q[bh][mb] - qbar[bh]  (fp32)
// with K^ = (E2M1(code) + k_res / 64) x E4M3 scale (k_res float16), in exactly the arithmetic and order of the
// in-kernel correction (delta_s_part in attn_fwd_kernel.cuh): per 16-element block a sequential
// fp32 fma chain of r[d] times (E2M1(code) + res / 64) x 2^-14, then times (scale x 2^14); block
// results summed in order per half of the head dim, the two halves added, then ds_key added. So
// the attention kernel that reads it computes the same S bit for bit as the one that corrects
// in its loop, and sageattn3/reference/preprocessing.py describes both.
//
// One CTA = 128 keys of one (batch, q head) for up to kDeltaMGroup query blocks. Each thread holds
// K^ of two adjacent keys in registers, decoded once and reused for every query block of the CTA
// (the in-kernel correction decodes it again for every query tile): at D 64 both halves of the head
// dim (64 threads), at D 128 one half (128 threads; the two threads of a key pair exchange their
// halves' sums with one shuffle). r of kDeltaRRows query blocks at a time sits in shared memory,
// each LDS.128 a broadcast (at D 128 two addresses, one per half, in different banks) used by
// both keys (8 fmas per load).
// Query blocks that never see the CTA's key block (causal) are skipped.
#pragma once
#include <cstdint>

#include "attn/attn_fwd_kernel.cuh"  // KHat4, khat_scale
#include "attn/attn_params.h"
#include "common/nvfp4.cuh"

namespace sageattn3::attn {

constexpr int kDeltaMGroup = 256;  // query blocks per CTA of delta_s_blocks_kernel
constexpr int kDeltaRRows = 64;    // of which r in shared memory at once
constexpr int kMUnroll = 4;        // query blocks per step of its loop
constexpr int kDeltaKeys = 2;      // keys per thread
constexpr int kDeltaFullRowD = 64;  // head dims up to which a thread takes both halves of a key's row
static_assert(kDeltaMGroup % kDeltaRRows == 0, "a group of query blocks is whole chunks of r");

// Halves of the head dim per thread, and threads per CTA, of delta_s_blocks_kernel<D>
template <int D>
constexpr int kDeltaHalves = D <= kDeltaFullRowD ? 2 : 1;
template <int D>
constexpr int kDeltaThreads = kBlockN / kDeltaKeys * 2 / kDeltaHalves<D>;
static_assert(kDeltaThreads<64> % 32 == 0 && kDeltaThreads<128> % 32 == 0, "whole warps (the D 128 pairs' shuffle)");

struct DeltaSBlocksParams {
  const uint8_t* k;       // K codes (B*Hkv*seq_k_pad rows, D/2 bytes)
  const uint8_t* k_sf;    // K scales (rows, D/16 bytes)
  const uint8_t* k_res;   // K's residual, float16 (rows, 2D bytes)
  const float* mean_q;    // (B*Hq, mean_qblocks, D)
  const float* qbar;      // (B*Hq, D)
  const float* ds_key;    // (B*Hq, seq_k_pad)
  float* out;             // (bh_count, num_m_blocks, seq_k_pad): rows of (q heads bh0 .. bh0 + bh_count - 1)
  int bh0, heads_q, heads_kv;
  int mean_qblocks, seq_k, seq_k_pad, num_m_blocks, causal;
};

// K^ of half `half` of key row `row` (x 2^-14, exact) into kh, its blocks' scales (x 2^14) into scale
template <int D>
__device__ __forceinline__ void delta_s_decode(const DeltaSBlocksParams& p, int64_t row, int half,
                                               float (&kh)[D / 32][16], float (&scale)[D / 32]) {
  constexpr int kBlocks = D / 32;
  uint32_t sf;
  if constexpr (kBlocks == 4) {
    sf = __ldg(reinterpret_cast<const uint32_t*>(p.k_sf + row * (D / 16) + half * kBlocks));
  } else {
    sf = __ldg(reinterpret_cast<const uint16_t*>(p.k_sf + row * (D / 16) + half * kBlocks));
  }
  const uint2* codes = reinterpret_cast<const uint2*>(p.k + row * (D / 2) + half * (D / 4));
  const uint4* res = reinterpret_cast<const uint4*>(p.k_res + (row * D + half * (D / 2)) * 2);
#pragma unroll
  for (int blk = 0; blk < kBlocks; ++blk) {
    const uint2 cw = __ldg(codes + blk);
    const uint4 r0 = __ldg(res + 2 * blk), r1 = __ldg(res + 2 * blk + 1);
    const uint32_t words[2] = {cw.x, cw.y};
    const uint32_t rwords[8] = {r0.x, r0.y, r0.z, r0.w, r1.x, r1.y, r1.z, r1.w};
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const KHat4 k(words[q >> 1], q, rwords[2 * q], rwords[2 * q + 1]);
      kh[blk][4 * q + 0] = k.at<0>();
      kh[blk][4 * q + 1] = k.at<1>();
      kh[blk][4 * q + 2] = k.at<2>();
      kh[blk][4 * q + 3] = k.at<3>();
    }
    scale[blk] = khat_scale(sf, blk);
  }
}

// U query blocks (r rows r_rows, r_rows + kRowFloats, ...) for this thread's keys: independent fma
// chains (each in its own fixed order), so their latency overlaps; then delta_s = ds_key + (half
// 0's sum + half 1's sum) into out, out + row_step, ... (D 64: a thread's two keys in one 8-byte
// store, or where the workspace is only 4-byte aligned (!kPairStore) in two)
template <int D, int U, bool kPairStore>
__device__ __forceinline__ void delta_s_rows(const float (&kh)[kDeltaKeys][kDeltaHalves<D>][D / 32][16],
                                             const float (&scale)[kDeltaKeys][kDeltaHalves<D>][D / 32],
                                             const float (&dk)[kDeltaKeys], const float* r_rows, float* out,
                                             int64_t row_step) {
  constexpr int kBlocks = D / 32;
  constexpr int kHalves = kDeltaHalves<D>;
  constexpr int kRowFloats = D + 4;
  float total[U][kDeltaKeys][kHalves];
#pragma unroll
  for (int hh = 0; hh < kHalves; ++hh) {
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
      for (int s = 0; s < kDeltaKeys; ++s) total[u][s][hh] = 0.f;
#pragma unroll
    for (int blk = 0; blk < kBlocks; ++blk) {
      float acc[U][kDeltaKeys];
#pragma unroll
      for (int u = 0; u < U; ++u)
#pragma unroll
        for (int s = 0; s < kDeltaKeys; ++s) acc[u][s] = 0.f;
#pragma unroll
      for (int q = 0; q < 4; ++q) {
#pragma unroll
        for (int u = 0; u < U; ++u) {
          const float4 r = *reinterpret_cast<const float4*>(r_rows + u * kRowFloats + hh * (D / 2 + 4) + 16 * blk + 4 * q);
#pragma unroll
          for (int s = 0; s < kDeltaKeys; ++s) {
            acc[u][s] = fmaf(r.x, kh[s][hh][blk][4 * q + 0], acc[u][s]);
            acc[u][s] = fmaf(r.y, kh[s][hh][blk][4 * q + 1], acc[u][s]);
            acc[u][s] = fmaf(r.z, kh[s][hh][blk][4 * q + 2], acc[u][s]);
            acc[u][s] = fmaf(r.w, kh[s][hh][blk][4 * q + 3], acc[u][s]);
          }
        }
      }
#pragma unroll
      for (int u = 0; u < U; ++u)
#pragma unroll
        for (int s = 0; s < kDeltaKeys; ++s) total[u][s][hh] = fmaf(acc[u][s], scale[s][hh][blk], total[u][s][hh]);
    }
  }
#pragma unroll
  for (int u = 0; u < U; ++u) {
    if constexpr (kHalves == 2) {
      const float2 v = make_float2(__fadd_rn(dk[0], __fadd_rn(total[u][0][0], total[u][0][1])),
                                   __fadd_rn(dk[1], __fadd_rn(total[u][1][0], total[u][1][1])));
      if constexpr (kPairStore) {
        *reinterpret_cast<float2*>(out + u * row_step) = v;
      } else {
        out[u * row_step] = v.x;
        out[u * row_step + 1] = v.y;
      }
    } else {
      const float other = __shfl_xor_sync(0xffffffffu, total[u][1][0], 1);  // the partner's half of key slot 0
      out[u * row_step] = __fadd_rn(dk[0], __fadd_rn(total[u][0][0], other));
    }
  }
}

template <int D, bool kPairStore = true>
__global__ void __launch_bounds__(kDeltaThreads<D>) delta_s_blocks_kernel(const DeltaSBlocksParams p) {
  constexpr int kBlocks = D / 32;  // 16-element blocks per half
  constexpr int kHalves = kDeltaHalves<D>;
  constexpr int kRowFloats = D + 4;  // r of one query block; the second half 16 bytes further
  __shared__ __align__(16) float r_smem[kDeltaRRows][kRowFloats];
  const int kb = blockIdx.x, bh_local = blockIdx.y, mb0 = blockIdx.z * kDeltaMGroup;
  const int bh_q = p.bh0 + bh_local;
  const int hq = bh_q % p.heads_q, b = bh_q / p.heads_q;
  const int kv_bh = b * p.heads_kv + hq / (p.heads_q / p.heads_kv);
  // keys 2 pair, 2 pair + 1; D 128: half `half0` of both, and slot 0 is the key this thread
  // finishes (2 pair + half0), slot 1 its partner's (lane ^ 1, the other half)
  const int pair = kHalves == 2 ? threadIdx.x : threadIdx.x >> 1;
  const int half0 = kHalves == 2 ? 0 : threadIdx.x & 1;
  const int k0 = kb * kBlockN;

  // Query blocks of the group that see this key block: all, or (causal) mb with kb < num_kb(mb).
  const int mb_end = min(p.num_m_blocks, mb0 + kDeltaMGroup);
  int mb_begin = mb0;
  if (p.causal) mb_begin = max(mb0, k0 / kBlockM);  // the kernel's num_kb: kb <= (mb*128 + 127) / 128
  const int kb_all = (p.seq_k + kBlockN - 1) / kBlockN;
  if (kb >= kb_all || mb_begin >= mb_end) return;

  float kh[kDeltaKeys][kHalves][kBlocks][16];
  float scale[kDeltaKeys][kHalves][kBlocks];
  float dk[kDeltaKeys];
#pragma unroll
  for (int s = 0; s < kDeltaKeys; ++s) {
    const int key = 2 * pair + (s ^ half0);
    const int64_t row = static_cast<int64_t>(kv_bh) * p.seq_k_pad + k0 + key;
#pragma unroll
    for (int hh = 0; hh < kHalves; ++hh) delta_s_decode<D>(p, row, half0 + hh, kh[s][hh], scale[s][hh]);
    dk[s] = __ldg(p.ds_key + static_cast<int64_t>(bh_q) * p.seq_k_pad + k0 + key);
  }
  const int64_t row_step = p.seq_k_pad;
  // this thread's output: keys 2 pair, 2 pair + 1 (D 64, one 8-byte store) or key 2 pair + half0
  float* out_head = p.out + static_cast<int64_t>(bh_local) * p.num_m_blocks * row_step + k0 + 2 * pair + half0;

  // This thread's 4 channels of r in every row it stages (kStageRows rows a pass), and qbar's there.
  constexpr int kQuads = D / 4;
  constexpr int kStageRows = kDeltaThreads<D> / kQuads;
  static_assert(kDeltaThreads<D> % kQuads == 0 && kDeltaRRows % kStageRows == 0, "a fixed 4 channels of r per thread");
  const int r_d = 4 * (threadIdx.x % kQuads), r_m = threadIdx.x / kQuads;
  const float4 g = __ldg(reinterpret_cast<const float4*>(p.qbar + static_cast<int64_t>(bh_q) * D + r_d));
  const float* mq_head = p.mean_q + static_cast<int64_t>(bh_q) * p.mean_qblocks * D + r_d;
  float* r_dst = &r_smem[0][r_d + (r_d >= D / 2 ? 4 : 0)];

  for (int c0 = mb_begin; c0 < mb_end; c0 += kDeltaRRows) {
    // r of query blocks c0 .. c0 + rows - 1
    const int rows = min(kDeltaRRows, mb_end - c0);
    __syncthreads();  // every thread is done with the previous rows
    // every row of r_smem written, those past `rows` from the last row (never read): no branch per pass
#pragma unroll
    for (int pass = 0; pass < kDeltaRRows / kStageRows; ++pass) {
      const int m = r_m + pass * kStageRows;
      const float4 mq = __ldg(reinterpret_cast<const float4*>(mq_head + static_cast<int64_t>(c0 + min(m, rows - 1)) * D));
      *reinterpret_cast<float4*>(r_dst + m * kRowFloats) =
          make_float4(__fsub_rn(mq.x, g.x), __fsub_rn(mq.y, g.y), __fsub_rn(mq.z, g.z), __fsub_rn(mq.w, g.w));
    }
    __syncthreads();

    float* out = out_head + static_cast<int64_t>(c0) * row_step;
    const float* r_rows = &r_smem[0][half0 * (D / 2 + 4)];
    // kMUnroll query blocks a step, then the chunk's last rows one at a time
    int m = 0;
    for (; m + kMUnroll <= rows; m += kMUnroll) delta_s_rows<D, kMUnroll, kPairStore>(kh, scale, dk, r_rows + m * kRowFloats, out + m * row_step, row_step);
    for (; m < rows; ++m) delta_s_rows<D, 1, kPairStore>(kh, scale, dk, r_rows + m * kRowFloats, out + m * row_step, row_step);
  }
}

}  // namespace sageattn3::attn
