// Launch parameters of the FP4 attention kernel. Passed to the kernel by value as a
// __grid_constant__ (the TMA descriptors must live in parameter/const space). The kernel body
// only ever sees `const AttnParams&`, so a toolchain that cannot pass this over-aligned struct by
// value (MSVC: CUtensorMap is alignas(64/128)) can switch the single entry point and the single
// launch site (attn_launch.cu) to a pointer to a device copy without touching the body.
#pragma once
#include <cstdint>
#include <cuda.h>

namespace sageattn3::attn {

constexpr int kBlockM = 128;         // query rows per tile (= the Q smoothing block of mean_q)
constexpr int kBlockN = 128;         // keys per pipeline stage
constexpr int kConsumerWarps = 8;    // 16 query rows each
constexpr int kThreads = kConsumerWarps * 32;       // the consumer warps' threads
constexpr int kStages = 3;
// Warp specialization (every instantiation but the bounded mode's): a producer warpgroup of its
// own (warps 8-11) issues the TMA loads and fills each stage's delta_s, V scales and V exponents.
// Registers are set per warpgroup (setmaxnreg): the launch gives 384 threads 168 each, then the
// producer drops to kProducerRegs and the consumers rise to kConsumerRegs
// (4 x 32 x 40 + 8 x 32 x 232 = 384 x 168 = 64,512 of the SM's 65,536).
constexpr int kProducerThreads = 128;
constexpr int kWsThreads = kThreads + kProducerThreads;
constexpr int kProducerRegs = 40;
constexpr int kConsumerRegs = 232;
static_assert(kProducerThreads * kProducerRegs + kThreads * kConsumerRegs <= kWsThreads * (65536 / kWsThreads / 8 * 8),
              "the registers the launch gives the CTA");
// Threads of a CTA: the bounded mode (its consumers correct delta_s in the key loop, two threads a
// key) keeps thread 0 as the producer.
template <bool kInLoopResidual>
constexpr int kCtaThreads = kInLoopResidual ? kThreads : kWsThreads;

struct AttnParams {
  CUtensorMap tm_q;      // Q packed  (B*Hq*Sq_pad rows, D/2 bytes), box D/2 x 128, swizzled
  CUtensorMap tm_q_sf;   // Q scales as 128-byte lines, box 128 x D/16
  CUtensorMap tm_k;      // K packed  (B*Hkv*Sk_pad rows, D/2 bytes), box D/2 x 128, swizzled
  CUtensorMap tm_k_sf;   // K scales as 128-byte lines
  CUtensorMap tm_v;      // V^T packed (B*Hkv*D rows, Sk_pad/2 bytes), box 64 x D, swizzled
  const uint8_t* v_sf;   // V scales (B, Hkv, D, Sk_pad/16) bytes
  const int8_t* v_exp;   // V's tile exponents (B, Hkv, Sk_pad/128, D/32), or null (all 0; FP8 P.V: unused)
  const float* mean_q;   // Q means fp32 (B*Hq*mean_qblocks rows, D)
  const float* qbar;     // Q means for the whole sequence (sampled) fp32 (B*Hq rows, D)
  // delta_s row of tile (bh, mb): ds_key + (bh - bh0) * ds_bh_stride + mb * ds_m_stride. Either
  // preprocessing's ds_key (B*Hq rows, seq_k_pad: qbar . K_s^T, unquantized K_s; stride 0 per mb),
  // or the precomputed delta_s per query block and key (delta_s_blocks.cuh).
  const float* ds_key;
  int64_t ds_bh_stride, ds_m_stride;
  const uint8_t* k_res;  // K's quantization residual, float16 (B*Hkv*seq_k_pad rows, 2D bytes), or null (one Q mean)
  void* out;             // (B, Hq, Sq, D), bf16 or fp16
  int batch, heads_q, heads_kv;
  int seq_q, seq_k, seq_q_pad, seq_k_pad;
  int mean_qblocks;      // 1 (one Q mean) or seq_q_pad / 128 (one per 128-row block)
  int num_m_blocks, num_tiles;
  int bh0, bh_count;     // the (batch, q head) rows this launch covers: bh0 .. bh0 + bh_count - 1
  float scale_log2;      // softmax scale * log2(e)
  int causal;            // top-left aligned (key j visible to query i iff j <= i), like SDPA
  int out_bf16;          // 1: bf16 output, 0: fp16
  // Per-head Q.K^T precision: null (every tile), or one byte per (batch, q head); this launch
  // computes the tiles whose byte equals head_sel_want (0: the FP4 kernel, 1: the FP8 one).
  const uint8_t* head_sel;
  int head_sel_want;
};

}  // namespace sageattn3::attn
