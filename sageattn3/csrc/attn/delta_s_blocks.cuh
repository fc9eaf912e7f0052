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
// One CTA = 128 keys x 2 halves (thread i: key i >> 1, half i & 1) of one (batch, q head) for
// kDeltaMGroup query blocks: K^ of its half-row is decoded once into registers and reused for every
// query block of the group (the in-kernel correction decodes it again for every query tile).
// r of the group's query blocks sits in shared memory, each LDS.128 broadcast to the warp.
// Query blocks that never see the CTA's key block (causal) are skipped.
#pragma once
#include <cstdint>

#include "attn/attn_fwd_kernel.cuh"  // f16x2_value
#include "attn/attn_params.h"
#include "common/nvfp4.cuh"

namespace sageattn3::attn {

constexpr int kDeltaMGroup = 64;  // query blocks per CTA of delta_s_blocks_kernel (a multiple of kMUnroll)
constexpr int kMUnroll = 4;       // query blocks per step of its loop
static_assert(kDeltaMGroup % kMUnroll == 0, "r's zero rows (up to a multiple of kMUnroll) must fit the group");

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

template <int D>
__global__ void __launch_bounds__(2 * kBlockN) delta_s_blocks_kernel(const DeltaSBlocksParams p) {
  constexpr int kBlocks = D / 32;  // 16-element blocks per half
  constexpr int kRowFloats = D + 4;  // r of one query block; the second half 16 bytes further
  __shared__ __align__(16) float r_smem[kDeltaMGroup][kRowFloats];
  const int kb = blockIdx.x, bh_local = blockIdx.y, mb0 = blockIdx.z * kDeltaMGroup;
  const int bh_q = p.bh0 + bh_local;
  const int hq = bh_q % p.heads_q, b = bh_q / p.heads_q;
  const int kv_bh = b * p.heads_kv + hq / (p.heads_q / p.heads_kv);
  const int key = threadIdx.x >> 1, half = threadIdx.x & 1;
  const int k0 = kb * kBlockN;

  // Query blocks of the group that see this key block: all, or (causal) mb with kb < num_kb(mb).
  int mb_end = min(p.num_m_blocks, mb0 + kDeltaMGroup);
  int mb_begin = mb0;
  if (p.causal) mb_begin = max(mb0, k0 / kBlockM);  // the kernel's num_kb: kb <= (mb*128 + 127) / 128
  const int kb_all = (p.seq_k + kBlockN - 1) / kBlockN;
  if (kb >= kb_all || mb_begin >= mb_end) return;

  // r of the group: thread i < rows * D/4 writes 4 floats; rows past mb_end up to a multiple of
  // kMUnroll are zeros (computed on, never stored), so the loop below needs no clamp.
  const int rows = mb_end - mb_begin, rows_padded = (rows + kMUnroll - 1) / kMUnroll * kMUnroll;
  for (int i = threadIdx.x; i < rows_padded * (D / 4); i += blockDim.x) {
    const int m = i / (D / 4), d = 4 * (i % (D / 4));
    float4 r = make_float4(0.f, 0.f, 0.f, 0.f);
    if (m < rows) {
      const float4 mq = __ldg(reinterpret_cast<const float4*>(p.mean_q + (static_cast<int64_t>(bh_q) * p.mean_qblocks + mb_begin + m) * D + d));
      const float4 g = __ldg(reinterpret_cast<const float4*>(p.qbar + static_cast<int64_t>(bh_q) * D + d));
      r = make_float4(__fsub_rn(mq.x, g.x), __fsub_rn(mq.y, g.y), __fsub_rn(mq.z, g.z), __fsub_rn(mq.w, g.w));
    }
    *reinterpret_cast<float4*>(&r_smem[m][d + (d >= D / 2 ? 4 : 0)]) = r;
  }

  // K^ of this thread's half-row, x 2^-14 (exact), and the blocks' scales x 2^14
  const int64_t row = static_cast<int64_t>(kv_bh) * p.seq_k_pad + k0 + key;
  float kh[kBlocks][16];
  float scale[kBlocks];
  {
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
        const uint32_t word = words[q >> 1];
        const float2 v0 = e2m1x2_scaled(word >> (16 * (q & 1)));
        const float2 v1 = e2m1x2_scaled(word >> (16 * (q & 1) + 8));
        const float2 e0 = f16x2_value(rwords[2 * q]);
        const float2 e1 = f16x2_value(rwords[2 * q + 1]);
        kh[blk][4 * q + 0] = fmaf(e0.x, kResidualStep, v0.x);
        kh[blk][4 * q + 1] = fmaf(e0.y, kResidualStep, v0.y);
        kh[blk][4 * q + 2] = fmaf(e1.x, kResidualStep, v1.x);
        kh[blk][4 * q + 3] = fmaf(e1.y, kResidualStep, v1.y);
      }
      scale[blk] = e4m3_value(max((sf >> (8 * blk)) & 0xffu, 1u)) * 16384.f;
    }
  }
  __syncthreads();

  const float dk = __ldg(p.ds_key + static_cast<int64_t>(bh_q) * p.seq_k_pad + k0 + key);
  // The output row of query block mb_begin; each step of the loop moves it kMUnroll rows on.
  const int64_t row_step = p.seq_k_pad;
  float* out = p.out + (static_cast<int64_t>(bh_local) * p.num_m_blocks + mb_begin) * row_step + k0 + key;
  const float* r_rows = &r_smem[0][half * (D / 2 + 4)];
  // kMUnroll query blocks at a time: independent fma chains (each in its own fixed order), so the
  // chains' latency overlaps. Blocks past mb_end compute on zero rows and are not stored.
  for (int mb = mb_begin; mb < mb_end; mb += kMUnroll, out += kMUnroll * row_step, r_rows += kMUnroll * kRowFloats) {
    float total[kMUnroll];
#pragma unroll
    for (int u = 0; u < kMUnroll; ++u) total[u] = 0.f;
#pragma unroll
    for (int blk = 0; blk < kBlocks; ++blk) {
      float acc[kMUnroll];
#pragma unroll
      for (int u = 0; u < kMUnroll; ++u) acc[u] = 0.f;
#pragma unroll
      for (int q = 0; q < 4; ++q) {
#pragma unroll
        for (int u = 0; u < kMUnroll; ++u) {
          const float4 m = *reinterpret_cast<const float4*>(r_rows + u * kRowFloats + 16 * blk + 4 * q);
          acc[u] = fmaf(m.x, kh[blk][4 * q + 0], acc[u]);
          acc[u] = fmaf(m.y, kh[blk][4 * q + 1], acc[u]);
          acc[u] = fmaf(m.z, kh[blk][4 * q + 2], acc[u]);
          acc[u] = fmaf(m.w, kh[blk][4 * q + 3], acc[u]);
        }
      }
#pragma unroll
      for (int u = 0; u < kMUnroll; ++u) total[u] = fmaf(acc[u], scale[blk], total[u]);
    }
#pragma unroll
    for (int u = 0; u < kMUnroll; ++u) {
      const float res = __fadd_rn(total[u], __shfl_xor_sync(0xffffffffu, total[u], 1));
      if (half == 0 && mb + u < mb_end) out[u * row_step] = __fadd_rn(dk, res);
    }
  }
}

}  // namespace sageattn3::attn
