// Host-side launch API of the sageattn3 kernels: plain C types only (no torch headers), so
// the .cu translation units compile without parsing torch and the bindings stay thin.
// Every function returns a cudaError_t (as int). All tensors are contiguous; "G" is a flattened
// group of (batch, head); S a sequence length; D a head dim (a multiple of 16).
// NVFP4 numerics: common/nvfp4.cuh (bit-exact with sageattn3/reference/formats.py).
#pragma once
#include <cstdint>
#include <cuda_runtime_api.h>

namespace sageattn3 {

enum class DType : int { kFloat16 = 0, kBFloat16 = 1, kFloat32 = 2 };

// NVFP4 along rows: x is `n` contiguous elements forming rows of `cols` (cols % 16 == 0);
// packed[n/2] (element 2i low nibble of byte i), scales[n/16] (one E4M3 byte per 16 elements).
int quant_fp4_rows(const void* x, DType dtype, int64_t n, int64_t cols, uint8_t* packed, uint8_t* scales,
                   cudaStream_t stream);

// NVFP4 along the sequence: x (G, S, D) -> packed (G, D, Sp/2), scales (G, D, Sp/16), with
// Sp >= S a multiple of 16; tokens S..Sp-1 are zeros. exps (G, ceil(Sp/128), D/32) int8, or null:
// V's tile exponents (D a multiple of 32): the codes and scales are then those of x · 2^e per
// tile of 128 tokens and 32 channels (reference.quantize_transposed_tiled, bit for bit).
int quant_fp4_cols(const void* x, DType dtype, int64_t G, int64_t S, int64_t D, int64_t Sp, uint8_t* packed,
                   uint8_t* scales, int8_t* exps, cudaStream_t stream);

// MXFP8 along the sequence (V of the FP8 P.V path; quant/quant_mxfp8_cols.cu, bit-exact with
// reference.quantize_mxfp8_transposed): x (G, S, D) bf16/fp16, D a multiple of 16 -> codes
// (G, D, Sp) E4M3 bytes and scales (G, D, Sp/32) UE8M0 bytes, Sp >= S a multiple of 32; tokens
// S..Sp-1 are zeros. x and codes 16-byte aligned. sel (G bytes) or null: a group whose byte is 0 is
// skipped (its codes and scales left as they were: the kv heads no head reads in FP8).
int quant_mxfp8_cols(const void* x, DType dtype, int64_t G, int64_t S, int64_t D, int64_t Sp, uint8_t* codes,
                     uint8_t* scales, const uint8_t* sel, cudaStream_t stream);

// Q/K rotation (rotate, D 64 or 128 only): rows are rotated before the mean is subtracted,
// x -> x S H / 8 (S = diag(+-1) from fixed sign bits, H the Walsh-Hadamard matrix, fp32
// butterflies in a fixed order: preprocess/rotation.cuh, bit-exact with reference.rotate); means
// are summed unrotated and then rotated, and `mean` holds the rotated means.

// Smoothing + NVFP4 along D: row r of group g becomes x[g, r] - mean[g, m(r)] (fp32), with
// m(r) = r / 128 if mean_block == 128, else 0 (mean_block == 0: one mean per group);
// mean has shape (G, nm, D) fp32. compute_mean (needs mean_block == 128): the kernel computes
// each 128-row block's mean (over its rows < S) and writes it to `mean` first. Output rows
// S..Sp-1 (Sp a multiple of 16... any Sp >= S) are zero codes with zero scales. search: NVFP4
// with the scale search (reference.quantize_rows(..., scale_search=True)), in every smoothing op.
int smooth_quant_rows(const void* x, DType dtype, int64_t G, int64_t S, int64_t D, float* mean, bool compute_mean,
                      int mean_block, int64_t Sp, uint8_t* packed, uint8_t* scales, bool rotate, bool search,
                      cudaStream_t stream);

// Smoothing with one mean per group + NVFP4 along D (S >= 1): mean (G, D) = the sampled mean
// (reference.sample_mean: the column sums of min(8, ceil(S/128)) evenly spaced 128-row tiles,
// added in tile order, / their real rows), then rows as smooth_quant_rows with mean_block 0.
// Workspace: partial (G, ceil(S/128), D) fp32 (its first G * min(8, ceil(S/128)) rows). Three
// launches: the sampled tiles' sums, the means, one read of x to quantize.
// With qbar (G*rep, D) fp32 (and ds_key (G*rep, Sp) fp32; D 64 or 128): the per-key correction
// of K, ds_key[g*rep + h, r] = sum_d qbar[g*rep + h, d] * (x[g, r] - mean[g])[d] over the
// smoothed (rotated) fp32 row as quantized (fixed fp32 order: per 16-block fma chains, block
// sums by xor butterfly), 0 for rows S..Sp-1. Null qbar and ds_key: none.
int smooth_quant_seq(const void* x, DType dtype, int64_t G, int64_t S, int64_t D, float* mean, float* partial,
                     int64_t Sp, uint8_t* packed, uint8_t* scales, bool rotate, bool search, const float* qbar,
                     int64_t rep, float* ds_key, cudaStream_t stream, uint32_t* zero = nullptr,
                     int64_t zero_words = 0);

// Q and K: Q's 128-row block means + smoothing + NVFP4 (as smooth_quant_rows with compute_mean:
// mean_q (Gq, ceil(Sq/128), D), q_packed (Gq, Sqp, D/2), q_scales (Gq, Sqp, D/16)) and K's
// smoothing by its sampled mean (as smooth_quant_seq, same bits: mean_k (Gk, D), k_packed
// (Gk, Skp, D/2), k_scales (Gk, Skp, D/16); workspace partial_k (Gk, ceil(Sk/128), D) fp32, of
// which the first Gk * min(8, ceil(Sk/128)) rows are used, as for partial_q). q and
// k share dtype and D; Sk >= 1; Gq a multiple of Gk (rep = Gq / Gk q groups per k group, GQA), 0
// for K only. Launches: the sampled tiles'
// sums (K's, and Q's with qbar or the balance), the means, then one launch for every tile of Q
// and K (one read each).
// With partial_q (Gq, ceil(Sq/128), D), qbar (Gq, D) and ds_key (Gq, Skp) (all or none; Gq > 0;
// D 64 or 128): qbar = each q group's sampled mean (rotated) and ds_key = K's per-key correction
// from it (as smooth_quant_seq with qbar).
// With balance (Gk, D) and balance_part (Gq * min(8, ceil(Sq/128)) + Gk * min(8, ceil(Sk/128)), D)
// fp32 (both or neither; D 64 or 128, Gq > 0): the channel balance (reference.balance_exponents /
// preprocess), from Q's and K's sampled tiles, into balance; then Q group g's rows become x * 2^-e[g / rep] - mean_q and K's
// x * 2^e - mean_k (balanced first, then rotated with rotate), with mean_q, qbar and mean_k
// written balanced (times 2^-e or 2^e, then rotated); ds_key is qbar . the balanced smoothed K
// row (the same products). search: as smooth_quant_rows, for Q and K.
// With k_res (Gk, Skp, D) float16 (needs the per-key correction): K's quantization residual,
// reference.quantize_residual (fp16 of (K_s - Kd) / scale * 64 per element, zeros in rows
// Sk..Skp-1), from the registers the row is quantized from.
int smooth_quant_qk(const void* q, const void* k, DType dtype, int64_t Gq, int64_t Sq, int64_t Gk, int64_t Sk,
                    int64_t D, float* mean_q, int64_t Sqp, uint8_t* q_packed, uint8_t* q_scales, float* mean_k,
                    float* partial_k, int64_t Skp, uint8_t* k_packed, uint8_t* k_scales, bool rotate,
                    bool search, float* partial_q, float* qbar, float* ds_key, float* balance, float* balance_part,
                    uint16_t* k_res, cudaStream_t stream, uint32_t* zero = nullptr, int64_t zero_words = 0);
// zero (both smooth_quant_seq and smooth_quant_qk), or null: zero_words 32-bit words the means
// launch zeroes, stream-ordered before every later launch (attention_call's rule counters and
// selections: no memset of their own).

// Sampled 128-row tiles per group of a sequence of S >= 0 rows: min(8, ceil(S/128)) (the rows
// of the sampled-sums workspaces and balance_part per group).
int64_t sampled_tiles(int64_t S);

// The most q groups per k group (rep) for which the K kernels compute the per-key correction
// (their correction vectors sit in shared memory): 25 at D 128, 51 at D 64.
int max_correction_heads(int64_t D);

// The channel balance exponents alone: q (Gq, Sq, D) and k (Gk, Sk, D), same dtype, D 64 or 128,
// Sq, Sk >= 1, Gq a multiple of Gk -> exps (Gk, D) fp32 in {-2..2} (reference.balance_exponents).
// part (Gq * min(8, ceil(Sq/128)) + Gk * min(8, ceil(Sk/128)), D) fp32 is workspace.
int qk_balance(const void* q, const void* k, DType dtype, int64_t Gq, int64_t Sq, int64_t Gk, int64_t Sk, int64_t D,
               float* part, float* exps, cudaStream_t stream);

// delta_s[b, hq, i, j] = sum_d mean_q[b, hq, i, d] * (k[b, hq / (Hq/Hkv), j, d] - mean_k[b, hkv, d])
// for j < Sk, 0 for Sk <= j < Sp. k (B, Hkv, Sk, D); mean_k (B, Hkv, D); mean_q (B, Hq, nblk, D);
// out (B, Hq, nblk, Sp), all fp32 except k.
int delta_s(const void* k, DType dtype, int64_t B, int64_t Hq, int64_t Hkv, int64_t Sk, int64_t D, int64_t nblk,
            const float* mean_k, const float* mean_q, int64_t Sp, float* out, cudaStream_t stream);

// K smoothing + NVFP4 + delta_s in one pass over K (bf16/fp16 K, D a multiple of 16, <= 128):
// packed (B, Hkv, Skp, D/2) and scales (B, Hkv, Skp, D/16) of K - mean_k as smooth_quant_rows
// writes them (rows Sk..Skp-1 zero), and delta (B, Hq, nblk, Skp) fp32 as delta() defines it,
// computed on tensor cores with fp32 mean_q split into bf16/fp16 parts (fp32-level accuracy).
int smooth_quant_k_delta(const void* k, DType dtype, int64_t B, int64_t Hq, int64_t Hkv, int64_t Sk, int64_t D,
                         int64_t nblk, const float* mean_k, const float* mean_q, int64_t Skp, uint8_t* packed,
                         uint8_t* scales, float* delta, cudaStream_t stream);

// Smoothing + MXFP8 along D for the FP8 Q.K^T path (quant/quant_mxfp8.cu; reference
// quantize_mxfp8_rows): x (H, S, D) bf16/fp16/fp32 -> codes (H, Sp, D) E4M3 bytes and scales
// (H, Sp, D/32) UE8M0 bytes of x * 2^(balance_sign * balance[h / rep]) - mean[h, r / 128 or 0];
// mean (H, mean_rows, D) fp32; balance (H / rep, D) fp32 exponents or null; sel (H) bytes or null:
// heads whose sel byte has bit 0 clear are skipped (outputs untouched). D a multiple of 32.
struct Mxfp8Args {
  const void* x;
  DType dtype;
  int64_t H, S, Sp, D;
  const float* mean;
  int64_t mean_rows;
  const float* balance;
  int balance_sign;
  int64_t rep;
  const uint8_t* sel;
  uint8_t* codes;
  uint8_t* scales;
  bool rotate;  // the rows rotated (D 64/128) after the balance, before the (rotated) mean
  // with rotate: the mean rows are unrotated and rotated here, the same butterflies as the rows
  // (reference.fp8_rows); else they come rotated already
  bool rotate_mean = false;
  float row_scale = 1.f;  // a power of two every row is multiplied by after the mean (1: none; rotate_mean only)
  // The 16-bit Q.K^T rows (reference.qk16_rows) instead: codes (H, Sp, D) bf16 values (2 bytes
  // each, round to nearest even; padding rows +0), scales unused (may be null).
  bool bf16_out = false;
};
int smooth_quant_mxfp8(const Mxfp8Args& args, cudaStream_t stream);
// V's MXFP8 along the sequence as quant_mxfp8_cols takes it (x (G, S, D) 16-bit, codes (G, D, Sp),
// scales (G, D, Sp/32), sel (G bytes) or null), for smooth_quant_mxfp8_pair to make as well.
struct Mxfp8ColsArgs {
  const void* x;
  int64_t G, S, D, Sp;
  uint8_t* codes;
  uint8_t* scales;
  const uint8_t* sel;
};
// Two row sets in one launch (Q's and K's: the same dtype, D, rotate and bf16_out), each as
// smooth_quant_mxfp8 makes it; with cols (x in first's dtype, 16-bit; rotated rows only), V's
// MXFP8 in the same launch, as quant_mxfp8_cols makes it.
int smooth_quant_mxfp8_pair(const Mxfp8Args& first, const Mxfp8Args& second, cudaStream_t stream,
                            const Mxfp8ColsArgs* cols = nullptr);

// The "auto" Q.K^T precision rule's estimate per (batch, q head) (preprocess/qk_rule.cu;
// reference.qk_fp4_error) in one launch: q (B, Hq, Sq, D), k and v (B, Hkv, Sk, D) fp16/bf16,
// D 64 or 128; q_packed (B, Hq, Sqp, D/2) / q_scales (.., D/16) and k_packed (B, Hkv, Skp, D/2) /
// k_scales as the preprocessing wrote them; mean_q (B, Hq, mean_rows, D), mean_k (B, Hkv, D),
// balance (B, Hkv, D) exponents or null; scale the softmax scale. One launch makes every estimate
// (Q.K^T's, the floor's, P's), over row groups of 16 sampled query rows (every 8th row of a
// sampled Q block on long calls, more on short ones), a pair of warps per group.
// Workspace: qk_rule_workspace_floats(args) fp32, which qk_rule_bind_workspace carves into
// partial and, last, the counters (from `counter` to the workspace's end), which the launch
// zeroes first unless `zeroed`.
// error (B * Hq) fp32 out.
struct QkRuleArgs {
  const void* q;
  const void* k;
  const void* v;
  DType dtype;
  int64_t B, Hq, Hkv, Sq, Sk, D, Sqp, Skp;
  const uint8_t* q_packed;
  const uint8_t* q_scales;
  const uint8_t* k_packed;
  const uint8_t* k_scales;
  // V's NVFP4 as the preprocessing wrote it (v_packed (B, Hkv, D, Skp/2), v_scales (.., Skp/16),
  // v_exp (B, Hkv, Skp/128, D/32) or null), for V's share of P's estimate (reference.pv_p_error):
  // read only where P's estimate runs (error_pv set, pv_limit >= 0), then Skp a multiple of 128.
  const uint8_t* v_packed;
  const uint8_t* v_scales;
  const int8_t* v_exp;
  const float* mean_q;
  int64_t mean_rows;
  const float* mean_k;
  const float* balance;
  // Q and K rotated (D 64/128) before their means, which are then rotated means, are subtracted
  // (the preprocessing's qk_rotation); the caller divides `scale` by D/64.
  bool rotate;
  float scale;
  float* partial;
  int32_t* counter;
  float* error;
  // The selection (both required): the launch zeroes sel_k first (unless `zeroed`); the block that writes a head's error sets sel_q[head] = select_all || error > limit
  // (a NaN estimate keeps FP4) and, where set, sel_k of its kv head to 1.
  uint8_t* sel_q;
  uint8_t* sel_k;
  float limit;
  int select_all;
  // Options as floors (reference.qk_fp4_error, step 5): with `floor` (the preprocessing had the
  // balance, the rotation or the scale search) the launch also estimates the defaults' rows (raw
  // minus the means taken back without the balance and the rotation, reference.options_free_means,
  // quantized in the kernel) and each head's error becomes the larger of the two (NaN if either
  // is), its selection from that.
  bool floor;
  // P's error for the FP8 P.V choice (reference.pv_p_error), where error_pv is set: the launch
  // also writes each head's estimate to error_pv and sets bit 1 of sel_q where it exceeds
  // pv_limit and sel_v (B*Hkv bytes, zeroed first unless `zeroed`) of that head's kv head to 1; a pv_limit below
  // 0 (or NaN) skips it and fills error_pv with NaN. With a pv_limit >= 0, sel_v must be set (the
  // launch refuses a null one).
  float* error_pv;
  uint8_t* sel_v;
  float pv_limit;
  // The attention is causal: P's estimate masks a sampled key after the sampled row's position
  // (reference.pv_p_error's is_causal); the Q.K^T estimate stays a statistic of the whole rows.
  bool causal;
  // D 128: the second statistic (reference.qk16_stat, the scale of MXFP8's logit error), written to
  // qk16_stat (B*Hq floats) where set; where it exceeds qk16_limit (>= 0; below 0 or NaN: off) a head
  // that leaves FP4 also gets bit 2 of sel_q: the raw 16-bit rows (reference.choose_qk16).
  float qk16_limit;
  float* qk16_stat;
  // The caller zeroed the counters (from `counter` to the workspace's end), sel_k and sel_v
  // (where set) in stream order before the launch (attention_call, through the preprocessing's
  // means launch): no memset.
  bool zeroed;
};
int qk_rule_error(const QkRuleArgs& args, cudaStream_t stream);
// The workspace floats a launch with these shapes (B, Hq, Sq, Sk, D) needs, and the pointers into
// it (partial, counter).
int64_t qk_rule_workspace_floats(const QkRuleArgs& args);
void qk_rule_bind_workspace(QkRuleArgs& args, float* workspace);

}  // namespace sageattn3
