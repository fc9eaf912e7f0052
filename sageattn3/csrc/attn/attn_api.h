// Host API of the FP4 attention kernel and of the MMA probe: plain C types only (no torch).
//
// Tensor layouts (all contiguous, row-major; "pad" = padded with zeros to a multiple of 128):
//   q      uint8 (B, Hq,  Sq_pad, D/2)   NVFP4 codes along D, low nibble = even element
//   q_sf   uint8 (B, Hq,  Sq_pad, D/16)  E4M3 scale of each 16 elements
//   k      uint8 (B, Hkv, Sk_pad, D/2),  k_sf (B, Hkv, Sk_pad, D/16)       (K smoothed: mean removed)
//   v      uint8 (B, Hkv, D, Sk_pad/2),  v_sf (B, Hkv, D, Sk_pad/16)       (V^T: 16-blocks along keys)
//   v_exp  int8  (B, Hkv, Sk_pad/128, D/32), or null (all 0): V's tile exponents, each in [-40, 40]
//          (not checked: as quant_fp4_cols writes them). v and v_sf are
//          then the NVFP4 of V · 2^e per tile of 128 keys and 32 channels (quant_fp4_cols with
//          exps); the kernel keeps O in the current tile's scale (the online softmax's rescale
//          times 2^(e_t - e_(t-1)) per group, exact) and multiplies by 2^-e of the last tile at the end.
//   mean_q fp32  (B, Hq, mean_qblocks, D): the Q means removed from q; mean_qblocks is Sq_pad/128
//          (one per 128-query block, per_block_mean) or 1 (one Q mean).
//   qbar   fp32  (B, Hq, 1, D): Q's mean for the whole sequence (sampled: reference.sample_mean).
//   ds_key fp32  (B, Hq, Sk_pad): qbar . K_s^T per key with K_s the UNQUANTIZED smoothed K (from
//          preprocessing). The kernel adds delta_s[i, j] = ds_key[j] + (mean_q[i] - qbar) . K^_j
//          to Q K^T before scaling, K^ = (E2M1(code) + k_res / 64) x scale: the dequantized k
//          (exactly the operand in shared memory) plus K's quantization residual (a zero scale
//          byte counts as 2^-9 there, the residual's unit where the codes are 0), i.e. the
//          unquantized smoothed K to within E4M3 rounding of its quantization error
//          (reference.dequantize_rows with the residual). With per-block Q means, delta_s is
//          precomputed per query block and key into ds_work (a kernel before the attention's, K^
//          decoded once per 256 query blocks), in chunks of (batch, q head) rows that fit it;
//          without ds_work (or too small for one row: ceil(Sq/128) x Sk_pad floats) the attention
//          kernel computes the residual part per K tile on the CUDA cores instead (the
//          bounded-memory mode, slower), skipped for a query tile whose residual
//          mean_q[i] - qbar (fp32) is all zeros. Both give the same delta_s bit for bit.
//   k_res  float16 (B, Hkv, Sk_pad, D): K's quantization residual (reference.quantize_residual),
//          or null with one Q mean (mean_qblocks 1: the residual r is 0).
//   ds_work fp32 workspace of ds_work_floats floats, or null (see ds_key). Its size for all rows
//          at once: B x Hq x ceil(Sq/128) x Sk_pad x 4 bytes (32 MiB per (batch, head) at 32k
//          tokens, 512 MiB at 128k).
//   out    bf16/fp16 (B, Hq, Sq, D)
// Q/K/V/mean_q/qbar/k_res must be 16-byte aligned, ds_key, ds_work and the scales 4-byte aligned.
#pragma once
#include <cstdint>
#include <cuda_runtime_api.h>

#include "sageattn3.h"

namespace sageattn3 {

struct Fp4AttnArgs {
  const void* q;
  const void* q_sf;
  const void* k;
  const void* k_sf;
  const void* v;
  const void* v_sf;
  const int8_t* v_exp;
  const float* mean_q;
  const float* qbar;
  const float* ds_key;
  const void* k_res;
  float* ds_work;
  int64_t ds_work_floats;
  void* out;
  int batch, heads_q, heads_kv, head_dim;
  int seq_q, seq_k, seq_q_pad, seq_k_pad;
  int mean_qblocks;
  float sm_scale;
  int causal;
  DType out_dtype;  // kBFloat16 or kFloat16
  // The per-head Q.K^T precision (null head_sel: every head FP4, as before): head_sel (B*Hq) bytes,
  // 1 where the head's Q.K^T runs in FP8 from q8 (B, Hq, Sq_pad, D) E4M3 bytes + q8_sf (B, Hq,
  // Sq_pad, D/32) UE8M0 and k8 (B, Hkv, Sk_pad, D) + k8_sf (B, Hkv, Sk_pad, D/32) (MXFP8 of the same
  // smoothed rows; reference.quantize_mxfp8_rows). Needs delta_s rows (one Q mean, or a workspace
  // that holds at least one (batch, q head) row): the bounded-memory mode has no FP8 kernel.
  const uint8_t* head_sel;
  const void* q8;
  const void* q8_sf;
  const void* k8;
  const void* k8_sf;
  // 16-bit Q.K^T (D 64 only): q8 (B, Hq, Sq_pad, D) and k8 (B, Hkv, Sk_pad, D) are bf16 rows of the
  // same smoothed, rotated values (reference.qk16_rows), q8_sf and k8_sf unused; the heads whose
  // head_sel bit 0 is set take Q.K^T from them (mma_m16n8k16<bf16_t>) instead of MXFP8.
  bool qk16;
  // P.V in MXFP8 (pv_precision "fp8"; null v8: NVFP4 P.V, as before): v8 (B, Hkv, D, Sk_pad) E4M3
  // bytes and v8_sf (B, Hkv, D, Sk_pad/32) UE8M0 (reference.quantize_mxfp8_transposed of the padded
  // V; v and v_sf are then unused). Like FP8 Q.K^T, needs delta_s rows (not the bounded-memory mode).
  const void* v8;
  const void* v8_sf;
  // Both precisions per head (blockscaled_attn_mixed): head_sel bit 0 FP8 Q.K^T, bit 1 FP8 P.V from
  // v8 (v for the heads without it); one launch per byte value 0-3.
  bool v8_by_head;
  // The raw 16-bit Q.K^T (D 128; null q_raw: no head takes it): the heads whose head_sel byte also
  // has bit 2 (with bit 0; the rule's qk16_stat) multiply the call's inputs as they are, q_raw
  // (B, Hq, seq_q, D) and k_raw (B, Hkv, seq_k, D), contiguous, fp16 (raw_f16) or bf16, with no
  // delta_s (reference: Preprocessed.qk16); raw_sm_scale: their softmax scale (unrotated units).
  // Values 5 and 7 (FP4 and FP8 P.V) launch after 0-3.
  const void* q_raw;
  const void* k_raw;
  bool raw_f16;
  float raw_sm_scale;
};

// Launches the attention forward on `stream` (device = current device). Returns a cudaError_t;
// cudaErrorInvalidValue for arguments the kernel does not support (see attn_launch.cu).
int fp4_attn_fwd(const Fp4AttnArgs& args, cudaStream_t stream);

// One m16n8k64 block-scaled FP4 MMA per problem (n problems), operands given as plain matrices
// and placed into registers by the PTX ISA's fragment formulas: a (n,16,32) bytes = A row-major,
// b (n,8,32) bytes = B column-major (row = column of B), sfa (n,16,4), sfb (n,8,4) UE4M3 bytes,
// c and d (n,16,8) fp32. Lanes not selected by (tid_a, tid_b) carry NaN scales. Runs the real
// instruction on sm_120/121 and the software model in the SAGEATTN3_MMA_MODEL flavour.
int fp4_mma_probe(const uint8_t* a, const uint8_t* b, const uint8_t* sfa, const uint8_t* sfb, const float* c,
                  float* d, int n, int tid_a, int tid_b, cudaStream_t stream);

// 1 if this build carries a kernel that can run on `device` (sm_120/121, or sm_90 in the model
// flavour), else 0.
int fp4_attn_supported(int device);

}  // namespace sageattn3
