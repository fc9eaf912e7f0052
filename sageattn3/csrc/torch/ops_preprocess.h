// The preprocessing ops: smoothing + NVFP4 of Q and K (csrc/preprocess/smooth_quant.cu), the
// channel balance, preprocess_qkv (everything the attention kernel consumes, in one call), and
// delta_s (csrc/preprocess/delta_s.cu, k_delta.cu).
#pragma once

#include <array>
#include <cstdint>
#include <initializer_list>
#include <tuple>
#include <utility>

#include "sageattn3.h"
#include "torch/checks.h"
#include "torch/outputs.h"

namespace sageattn3::torch_ops {

// smooth_quant_rows(x, mean!, compute_mean, mean_block, packed!, scales!, rotate, search): x (G, S, D);
// mean (G, nm, D) fp32; packed (G, Sp, D/2); scales (G, Sp, D/16).
template <class T>
void smooth_quant_rows(T x, T mean, bool compute_mean, int64_t mean_block, T packed, T scales, bool rotate,
                       bool search) {
  check_input(x);
  check_f32_on(mean, x, "mean");
  check_codes(packed, scales, x);
  SA3_CHECK(T, x.dim() == 3 && packed.dim() == 3, "sageattn3: x and packed must be 3-D (G, S, D), got ", shape(x),
            " and ", shape(packed));
  const int64_t G = x.size(0), S = x.size(1), D = x.size(2), Sp = packed.size(1);
  SA3_CHECK(T, D % 16 == 0 && D <= 256, "sageattn3: D must be a multiple of 16, at most 256, got ", D);
  SA3_CHECK(T, mean_block == 0 || mean_block == 128, "sageattn3: mean_block must be 0 or 128, got ", mean_block);
  SA3_CHECK(T, !compute_mean || mean_block == 128, "sageattn3: compute_mean needs mean_block 128, got ", mean_block);
  const int64_t nm = mean_block ? (S + 127) / 128 : 1;
  SA3_CHECK(T, mean.numel() == G * nm * D, "sageattn3: mean has the wrong size: expected (G, nm, D) = ", dims(G, nm, D),
            ", got ", shape(mean));
  SA3_CHECK(T, Sp >= S && packed.numel() == G * Sp * D / 2 && scales.numel() == G * Sp * D / 16,
            "sageattn3: output sizes do not match x: expected packed (G, Sp >= S, D/2) = (", G, ", >= ", S, ", ",
            D / 2, ") and scales ", dims(G, Sp, D / 16), ", got ", shape(packed), " and ", shape(scales));
  SA3_CHECK(T, !rotate || D == 64 || D == 128, "sageattn3: rotate needs D 64 or 128, got ", D);
  SA3_CHECK(T, !search || D == 64 || D == 128, "sageattn3: the scale search needs D 64 or 128, got ", D);
  DeviceScope scope(device_index(x));
  check_cuda_kernel<T>(sageattn3::smooth_quant_rows(x.data_ptr(), dtype_of(x, "x"), G, S, D, floats(mean),
                                                    compute_mean, static_cast<int>(mean_block), Sp, bytes(packed),
                                                    bytes(scales), rotate, search, TensorApi<T>::stream(x)),
                       "smooth_quant_rows");
}

// smooth_quant_seq(x, mean!, partial!, packed!, scales!, rotate, search, qbar, ds_key!): x (G, S, D),
// S >= 1; mean (G, 1, D) fp32; partial (G, ceil(S/128), D) fp32; packed (G, Sp, D/2);
// qbar (G*rep, D) and ds_key (G*rep, Sp) fp32 for the per-key correction, or both empty (none);
// the mean is the sampled one (sageattn3.h).
template <class T>
void smooth_quant_seq(T x, T mean, T partial, T packed, T scales, bool rotate, bool search, T qbar, T ds_key) {
  check_input(x);
  check_f32_on(mean, x, "mean");
  check_f32_on(partial, x, "partial");
  check_codes(packed, scales, x);
  SA3_CHECK(T, x.dim() == 3 && packed.dim() == 3, "sageattn3: x and packed must be 3-D (G, S, D), got ", shape(x),
            " and ", shape(packed));
  const int64_t G = x.size(0), S = x.size(1), D = x.size(2), Sp = packed.size(1);
  SA3_CHECK(T, S >= 1 && D % 16 == 0 && D > 0 && D <= 256,
            "sageattn3: S must be >= 1 and D a positive multiple of 16, at most 256, got S ", S, " and D ", D);
  SA3_CHECK(T, mean.numel() == G * D && partial.numel() == G * ((S + 127) / 128) * D,
            "sageattn3: mean or partial has the wrong size: expected mean ", dims(G, 1, D), " and partial ",
            dims(G, (S + 127) / 128, D), ", got ", shape(mean), " and ", shape(partial));
  SA3_CHECK(T, Sp >= S && packed.numel() == G * Sp * D / 2 && scales.numel() == G * Sp * D / 16,
            "sageattn3: output sizes do not match x: expected packed (G, Sp >= S, D/2) = (", G, ", >= ", S, ", ",
            D / 2, ") and scales ", dims(G, Sp, D / 16), ", got ", shape(packed), " and ", shape(scales));
  SA3_CHECK(T, !rotate || D == 64 || D == 128, "sageattn3: rotate needs D 64 or 128, got ", D);
  SA3_CHECK(T, !search || D == 64 || D == 128, "sageattn3: the scale search needs D 64 or 128, got ", D);
  const bool correction = qbar.numel() > 0 || ds_key.numel() > 0;
  int64_t rep = 1;
  if (correction) {
    check_f32_on(qbar, x, "qbar");
    check_f32_on(ds_key, x, "ds_key");
    SA3_CHECK(T, D == 64 || D == 128, "sageattn3: the per-key correction needs D 64 or 128, got ", D);
    rep = G ? qbar.numel() / (G * D) : 1;
    SA3_CHECK(T, rep >= 1 && qbar.numel() == G * rep * D && ds_key.numel() == G * rep * Sp,
              "sageattn3: qbar must be (G*rep, D) and ds_key (G*rep, Sp) with G ", G, ", D ", D, ", Sp ", Sp,
              ", got ", shape(qbar), " and ", shape(ds_key));
  }
  DeviceScope scope(device_index(x));
  check_cuda_kernel<T>(sageattn3::smooth_quant_seq(x.data_ptr(), dtype_of(x, "x"), G, S, D, floats(mean),
                                                   floats(partial), Sp, bytes(packed), bytes(scales),
                                                   rotate, search, correction ? floats(qbar) : nullptr, rep,
                                                   correction ? floats(ds_key) : nullptr, TensorApi<T>::stream(x)),
                       "smooth_quant_seq");
}

// smooth_quant_qk(q, k, mean_q!, q_packed!, q_scales!, mean_k!, k_packed!, k_scales!, partial_k!,
// rotate, search, partial_q!, qbar!, ds_key!, balance!, balance_part!): q (Gq, Sq, D) and k (Gk, Sk, D), same dtype, Sk >= 1,
// Gq a multiple of Gk (or 0); mean_q (Gq, ceil(Sq/128), D) fp32; q_packed (Gq, Sqp, D/2); q_scales
// (Gq, Sqp, D/16); mean_k (Gk, 1, D) fp32; k_packed (Gk, Skp, D/2); k_scales (Gk, Skp, D/16);
// partial_k (Gk, ceil(Sk/128), D) fp32; partial_q (Gq, ceil(Sq/128), D),
// qbar (Gq, D), ds_key (Gq, Skp) fp32, all empty for no per-key correction; balance (Gk, D) and
// balance_part (Gq * min(8, ceil(Sq/128)) + Gk * min(8, ceil(Sk/128)), D) fp32, both empty for no
// channel balance (D 64/128); k_res (Gk, Skp, D) float16, K's quantization residual (needs the
// per-key correction), empty for none;
// the means are sampled (sageattn3.h).
template <class T>
void smooth_quant_qk(T q, T k, T mean_q, T q_packed, T q_scales, T mean_k, T k_packed, T k_scales, T partial_k,
                     bool rotate, bool search, T partial_q, T qbar, T ds_key, T balance, T balance_part, T k_res) {
  check_cuda(q, q, "q");
  check_aligned(q, "q");
  check_cuda(k, q, "k");
  check_aligned(k, "k");
  check_f32_on(mean_q, q, "mean_q");
  check_f32_on(mean_k, q, "mean_k");
  check_f32_on(partial_k, q, "partial_k");
  check_code_tensor(q_packed, q, "q_packed");
  check_code_tensor(q_scales, q, "q_scales");
  check_code_tensor(k_packed, q, "k_packed");
  check_code_tensor(k_scales, q, "k_scales");
  SA3_CHECK(T, q.dim() == 3 && k.dim() == 3 && q_packed.dim() == 3 && k_packed.dim() == 3,
            "sageattn3: q, k, q_packed and k_packed must be 3-D (G, S, D), got ", shape(q), ", ", shape(k), ", ",
            shape(q_packed), " and ", shape(k_packed));
  const auto dt = dtype_of(q, "q");
  SA3_CHECK(T, dtype_of(k, "k") == dt, "sageattn3: q and k must have the same dtype, got ", dtype_name(q), " and ",
            dtype_name(k));
  const int64_t Gq = q.size(0), Sq = q.size(1), D = q.size(2), Gk = k.size(0), Sk = k.size(1);
  const int64_t Sqp = q_packed.size(1), Skp = k_packed.size(1);
  SA3_CHECK(T, k.size(2) == D, "sageattn3: q and k must have the same head dim, got ", D, " and ",
            k.size(2));
  SA3_CHECK(T, D % 16 == 0 && D > 0 && D <= 256, "sageattn3: D must be a positive multiple of 16, at most 256, got ",
            D);
  SA3_CHECK(T, Sk >= 1 && Gk >= 1, "sageattn3: k must not be empty, got k of shape ", shape(k));
  SA3_CHECK(T, mean_q.numel() == Gq * ((Sq + 127) / 128) * D, "sageattn3: mean_q has the wrong size: expected ",
            dims(Gq, (Sq + 127) / 128, D), ", got ", shape(mean_q));
  SA3_CHECK(T, Gq % Gk == 0 && (Gq == 0 || Sq >= 1),
            "sageattn3: q groups must be a multiple of k groups, q not empty, got ", Gq, " q groups of ", Sq,
            " rows and ", Gk, " k groups");
  SA3_CHECK(T, !rotate || D == 64 || D == 128, "sageattn3: rotate needs D 64 or 128, got ", D);
  SA3_CHECK(T, !search || D == 64 || D == 128, "sageattn3: the scale search needs D 64 or 128, got ", D);
  const bool correction = partial_q.numel() > 0 || qbar.numel() > 0 || ds_key.numel() > 0;
  if (correction) {
    check_f32_on(partial_q, q, "partial_q");
    check_f32_on(qbar, q, "qbar");
    check_f32_on(ds_key, q, "ds_key");
    SA3_CHECK(T, Gq > 0 && (D == 64 || D == 128), "sageattn3: the per-key correction needs q and D 64 or 128, got ", Gq,
              " q groups and D ", D);
    SA3_CHECK(T, partial_q.numel() == Gq * ((Sq + 127) / 128) * D && qbar.numel() == Gq * D &&
                     ds_key.numel() == Gq * Skp,
              "sageattn3: partial_q, qbar or ds_key has the wrong size: expected ", dims(Gq, (Sq + 127) / 128, D),
              ", ", dims(Gq, D), " and ", dims(Gq, Skp), ", got ", shape(partial_q), ", ", shape(qbar), " and ",
              shape(ds_key));
  }
  const bool balanced = balance.numel() > 0 || balance_part.numel() > 0;
  if (balanced) {
    check_f32_on(balance, q, "balance");
    check_f32_on(balance_part, q, "balance_part");
    SA3_CHECK(T, Gq > 0 && (D == 64 || D == 128), "sageattn3: the channel balance needs q and D 64 or 128, got ", Gq,
              " q groups and D ", D);
    const int64_t ns = sageattn3::sampled_tiles(Sq) * Gq + sageattn3::sampled_tiles(Sk) * Gk;
    SA3_CHECK(T, balance.numel() == Gk * D && balance_part.numel() == ns * D,
              "sageattn3: balance or balance_part has the wrong size: expected ", dims(Gk, D), " and ", dims(ns, D),
              ", got ", shape(balance), " and ", shape(balance_part));
  }
  SA3_CHECK(T, mean_k.numel() == Gk * D && partial_k.numel() == Gk * ((Sk + 127) / 128) * D,
            "sageattn3: mean_k or partial_k has the wrong size: expected ", dims(Gk, 1, D), " and ",
            dims(Gk, (Sk + 127) / 128, D), ", got ", shape(mean_k), " and ", shape(partial_k));
  SA3_CHECK(T, Sqp >= Sq && q_packed.numel() == Gq * Sqp * D / 2 && q_scales.numel() == Gq * Sqp * D / 16,
            "sageattn3: q_packed/q_scales sizes do not match q: expected (Gq, Sqp >= Sq, D/2) = (", Gq, ", >= ", Sq,
            ", ", D / 2, ") and ", dims(Gq, Sqp, D / 16), ", got ", shape(q_packed), " and ", shape(q_scales));
  SA3_CHECK(T, Skp >= Sk && k_packed.numel() == Gk * Skp * D / 2 && k_scales.numel() == Gk * Skp * D / 16,
            "sageattn3: k_packed/k_scales sizes do not match k: expected (Gk, Skp >= Sk, D/2) = (", Gk, ", >= ", Sk,
            ", ", D / 2, ") and ", dims(Gk, Skp, D / 16), ", got ", shape(k_packed), " and ", shape(k_scales));
  const bool residual = k_res.numel() > 0;
  if (residual) {
    check_residual(k_res, q, "k_res");
    SA3_CHECK(T, correction && k_res.numel() == Gk * Skp * D,
              "sageattn3: k_res must be (Gk, Skp, D) float16, with the per-key correction: expected ", dims(Gk, Skp, D),
              ", got ", shape(k_res), correction ? "" : " without the per-key correction");
  }
  DeviceScope scope(device_index(q));
  check_cuda_kernel<T>(sageattn3::smooth_quant_qk(q.data_ptr(), k.data_ptr(), dt, Gq, Sq, Gk, Sk, D, floats(mean_q),
                                                  Sqp, bytes(q_packed), bytes(q_scales), floats(mean_k),
                                                  floats(partial_k), Skp, bytes(k_packed),
                                                  bytes(k_scales), rotate, search,
                                                  correction ? floats(partial_q) : nullptr,
                                                  correction ? floats(qbar) : nullptr,
                                                  correction ? floats(ds_key) : nullptr,
                                                  balanced ? floats(balance) : nullptr,
                                                  balanced ? floats(balance_part) : nullptr,
                                                  residual ? static_cast<uint16_t*>(k_res.data_ptr()) : nullptr, TensorApi<T>::stream(q)),
                       "smooth_quant_qk");
}

// qk_balance(q, k, part!, exps!): q (Gq, Sq, D) and k (Gk, Sk, D), same dtype, D 64 or 128, Sq, Sk >= 1,
// Gq a multiple of Gk; exps (Gk, D) fp32; part (Gq * min(8, ceil(Sq/128)) + Gk * min(8, ceil(Sk/128)), D)
// fp32.
template <class T>
void qk_balance(T q, T k, T part, T exps) {
  check_input(q);
  check_cuda(k, q, "k");
  check_aligned(k, "k");
  check_f32_on(part, q, "part");
  check_f32_on(exps, q, "exps");
  SA3_CHECK(T, q.dim() == 3 && k.dim() == 3 && exps.dim() == 2,
            "sageattn3: q must be (Gq, Sq, D), k (Gk, Sk, D) and exps (Gk, D), got ", shape(q), ", ", shape(k), " and ",
            shape(exps));
  const auto dt = dtype_of(q, "q");
  SA3_CHECK(T, dtype_of(k, "k") == dt, "sageattn3: q and k must have the same dtype, got ", dtype_name(q), " and ",
            dtype_name(k));
  const int64_t Gq = q.size(0), Sq = q.size(1), D = q.size(2), Gk = k.size(0), Sk = k.size(1);
  SA3_CHECK(T, (D == 64 || D == 128) && Sq >= 1 && Sk >= 1 && k.size(2) == D,
            "sageattn3: the channel balance needs D 64 or 128 (the same for q and k) and Sq, Sk >= 1, got q ",
            shape(q), " and k ", shape(k));
  SA3_CHECK(T, Gk >= 1 && Gq >= 1 && Gq % Gk == 0 && exps.size(0) == Gk && exps.size(1) == D,
            "sageattn3: exps must be (Gk, D) with Gq a positive multiple of Gk, got exps ", shape(exps), ", Gq ", Gq,
            " and Gk ", Gk);
  SA3_CHECK(T, part.numel() == (Gq * sageattn3::sampled_tiles(Sq) + Gk * sageattn3::sampled_tiles(Sk)) * D,
            "sageattn3: part has the wrong size: expected ",
            dims(Gq * sageattn3::sampled_tiles(Sq) + Gk * sageattn3::sampled_tiles(Sk), D), ", got ", shape(part));
  DeviceScope scope(device_index(q));
  check_cuda_kernel<T>(sageattn3::qk_balance(q.data_ptr(), k.data_ptr(), dt, Gq, Sq, Gk, Sk, D, floats(part),
                                             floats(exps), TensorApi<T>::stream(q)),
                       "qk_balance");
}

// preprocess_qkv(q, k, v, pad, per_block_mean, rotate, balance, search): everything the attention
// kernel consumes, allocated here and computed by one call (sageattn3.preprocess on its main
// path: the Python side only chooses it): q (B, Hq, Sq, D), k and v (B, Hkv, Sk, D), one dtype,
// contiguous, 16-byte aligned; D 64 or 128; Hq a multiple of Hkv, Hq / Hkv <= max_correction_heads;
// Sq, Sk >= 1; pad a positive multiple of 16 (sequences padded to Sqp, Skp); balance needs
// per_block_mean. Returns, with Sqp/Skp the padded lengths and nm = ceil(Sq/128) (per_block_mean)
// or 1: q_packed (B, Hq, Sqp, D/2), q_scales (B, Hq, Sqp, D/16), k_packed, k_scales (the same over
// Hkv, Skp), v_packed (B, Hkv, D, Skp/2), v_scales (B, Hkv, D, Skp/16), mean_q (B, Hq, nm, D),
// mean_k (B, Hkv, 1, D), qbar (B, Hq, 1, D) (empty without per_block_mean: mean_q is Q's one
// mean then), ds_key (B, Hq, Skp), balance exponents (B, Hkv, 1, D) (empty without balance), K's
// quantization residual k_res (B, Hkv, Skp, D) float16 (empty without per_block_mean: no block
// residuals then), V's tile exponents v_exp (B, Hkv, ceil(Skp/128), D/32) int8 values in uint8
// (quant_fp4_cols). Each output its own allocation (torch/outputs.h); the launches: prep_launch.
// (attention_call, torch/ops_call.h, makes the same launches into one allocation of its own.)

// preprocess_qkv's shapes, from its checked inputs (prep_plan): the 13 outputs in the order
// returned, then the workspace (the sampled tiles' sums of K, then of Q, then with the balance
// their squares, Q's then K's).
struct PrepPlan {
  int64_t B, Hq, Sq, D, Hk, Sk, Sqp, Skp, Gq, Gk, nm, nsq, nsk;
  DType dt;
  bool per_block_mean, balance;
  static constexpr int kOutputs = 14;
  std::array<OutputSpec, kOutputs> specs() const {
    const int64_t Bm = per_block_mean ? B : 0, Bb = balance ? B : 0;
    const int64_t ws_rows = Gk * nsk + Gq * nsq + (balance ? Gq * nsq + Gk * nsk : 0);
    return {OutputSpec{{B, Hq, Sqp, D / 2}, Kind::kByte}, {{B, Hq, Sqp, D / 16}, Kind::kFloat8e4m3fn},
            {{B, Hk, Skp, D / 2}, Kind::kByte},           {{B, Hk, Skp, D / 16}, Kind::kFloat8e4m3fn},
            {{B, Hk, D, Skp / 2}, Kind::kByte},           {{B, Hk, D, Skp / 16}, Kind::kFloat8e4m3fn},
            {{B, Hq, nm, D}, Kind::kFloat},               {{B, Hk, 1, D}, Kind::kFloat},
            {{Bm, Hq, 1, D}, Kind::kFloat},               {{B, Hq, Skp}, Kind::kFloat},
            {{Bb, Hk, 1, D}, Kind::kFloat},               {{Bm, Hk, Skp, D}, Kind::kHalf},
            {{B, Hk, (Skp + 127) / 128, D / 32}, Kind::kByte}, {{ws_rows, D}, Kind::kFloat}};
  }
};

// preprocess_qkv's checks of its inputs, into its plan (op: the op named in the messages).
template <class T>
PrepPlan prep_plan(const T& q, const T& k, const T& v, int64_t pad, bool per_block_mean, bool balance,
                   const char* op = "preprocess_qkv") {
  for (const auto& [t, name] : {std::pair<const T*, const char*>{&q, "q"}, {&k, "k"}, {&v, "v"}}) {
    check_cuda(*t, q, name);
    check_aligned(*t, name);
  }
  SA3_CHECK(T, q.dim() == 4 && k.dim() == 4 && v.dim() == 4, "sageattn3: q, k and v must be 4-D (B, H, S, D), got ",
            shape(q), ", ", shape(k), " and ", shape(v));
  const auto dt = dtype_of(q, "q");
  SA3_CHECK(T, dtype_of(k, "k") == dt && dtype_of(v, "v") == dt, "sageattn3: q, k and v must have the same dtype, got ",
            dtype_name(q), ", ", dtype_name(k), " and ", dtype_name(v));
  const int64_t B = q.size(0), Hq = q.size(1), Sq = q.size(2), D = q.size(3), Hk = k.size(1), Sk = k.size(2);
  SA3_CHECK(T, k.size(0) == B && v.size(0) == B && v.size(1) == Hk && v.size(2) == Sk && k.size(3) == D &&
                   v.size(3) == D,
            "sageattn3: k and v must be (B, Hkv, Sk, D) with q's B and D, got q ", shape(q), ", k ", shape(k),
            " and v ", shape(v));
  SA3_CHECK(T, D == 64 || D == 128, "sageattn3: ", op, " needs head dim 64 or 128, got ", D);
  SA3_CHECK(T, B >= 1 && Hk >= 1 && Sq >= 1 && Sk >= 1, "sageattn3: q, k and v must not be empty, got ", shape(q), ", ",
            shape(k), " and ", shape(v));
  SA3_CHECK(T, Hq % Hk == 0 && Hq / Hk >= 1 && Hq / Hk <= sageattn3::max_correction_heads(D),
            "sageattn3: q heads must be a multiple of kv heads, at most ", sageattn3::max_correction_heads(D),
            " per kv head at head dim ", D, ", got ", Hq, " q heads and ", Hk, " kv heads");
  SA3_CHECK(T, pad > 0 && pad % 16 == 0 && pad <= (int64_t{1} << 20),
            "sageattn3: pad must be a positive multiple of 16 (at most 2^20), got ", pad);
  SA3_CHECK(T, per_block_mean || !balance, "sageattn3: the channel balance needs per_block_mean, got balance true with "
            "per_block_mean false");
  const int64_t Sqp = (Sq + pad - 1) / pad * pad, Skp = (Sk + pad - 1) / pad * pad;
  return PrepPlan{B, Hq, Sq, D, Hk, Sk, Sqp, Skp, B * Hq, B * Hk, per_block_mean ? (Sq + 127) / 128 : 1,
                  sageattn3::sampled_tiles(Sq), sageattn3::sampled_tiles(Sk), dt, per_block_mean, balance};
}

// preprocess_qkv's launches into the plan's outputs (out[i]: where output i of specs() lies),
// on the current device. Launch order: V first (the rest of the host work overlaps it), then the
// launches of smooth_quant_qk (or of smooth_quant_seq for Q, then for K with the correction).
// zero (zero_words words) or null: zeroed by the means launch (sageattn3.h; attention_call's rule).
template <class T>
void prep_launch(const PrepPlan& p, const void* q, const void* k, const void* v, void* const (&out)[PrepPlan::kOutputs],
                 bool rotate, bool search, cudaStream_t stream, uint32_t* zero = nullptr, int64_t zero_words = 0) {
  auto u8 = [&](int i) { return static_cast<uint8_t*>(out[i]); };
  auto f32 = [&](int i) { return static_cast<float*>(out[i]); };
  check_cuda_kernel<T>(sageattn3::quant_fp4_cols(v, p.dt, p.Gk, p.Sk, p.D, p.Skp, u8(4), u8(5),
                                                 reinterpret_cast<int8_t*>(u8(12)), stream),
                       "the preprocessing (V)");
  float* part_k = f32(13);
  float* part_q = part_k + p.Gk * p.nsk * p.D;
  float* bal_part = p.balance ? part_q + p.Gq * p.nsq * p.D : nullptr;
  if (p.per_block_mean) {
    check_cuda_kernel<T>(sageattn3::smooth_quant_qk(q, k, p.dt, p.Gq, p.Sq, p.Gk, p.Sk, p.D, f32(6), p.Sqp, u8(0),
                                                    u8(1), f32(7), part_k, p.Skp, u8(2), u8(3), rotate, search, part_q,
                                                    f32(8), f32(9), p.balance ? f32(10) : nullptr, bal_part,
                                                    static_cast<uint16_t*>(out[11]),
                                                    stream, zero, zero_words),
                         "the preprocessing (Q and K)");
  } else {
    check_cuda_kernel<T>(sageattn3::smooth_quant_seq(q, p.dt, p.Gq, p.Sq, p.D, f32(6), part_q, p.Sqp, u8(0), u8(1),
                                                     rotate, search, nullptr, 1, nullptr, stream),
                         "the preprocessing (Q)");
    check_cuda_kernel<T>(sageattn3::smooth_quant_seq(k, p.dt, p.Gk, p.Sk, p.D, f32(7), part_k, p.Skp, u8(2), u8(3),
                                                     rotate, search, f32(6), p.Hq / p.Hk, f32(9), stream, zero,
                                                     zero_words),
                         "the preprocessing (K)");
  }
}

template <class T>
std::tuple<T, T, T, T, T, T, T, T, T, T, T, T, T> preprocess_qkv(T q, T k, T v, int64_t pad, bool per_block_mean,
                                                           bool rotate, bool balance, bool search) {
  const PrepPlan p = prep_plan(q, k, v, pad, per_block_mean, balance);
  DeviceScope scope(device_index(q));
  auto out = allocate_outputs(p.specs(), q);  // each output its own allocation (torch/outputs.h)
  void* const ptrs[PrepPlan::kOutputs] = {out[0].data_ptr(), out[1].data_ptr(), out[2].data_ptr(), out[3].data_ptr(),
                                          out[4].data_ptr(), out[5].data_ptr(), out[6].data_ptr(), out[7].data_ptr(),
                                          out[8].data_ptr(), out[9].data_ptr(), out[10].data_ptr(), out[11].data_ptr(),
                                          out[12].data_ptr(), out[13].data_ptr()};
  prep_launch<T>(p, q.data_ptr(), k.data_ptr(), v.data_ptr(), ptrs, rotate, search, TensorApi<T>::stream(q));
  return {out[0], out[1], out[2], out[3], out[4], out[5], out[6], out[7], out[8], out[9], out[10], out[11], out[12]};
}

// The operands delta_s and smooth_quant_k_delta share, against k (B, Hkv, Sk, D): mean_q (B, Hq, nblk, D)
// with Hq a multiple of Hkv, mean_k (B, Hkv, 1, D), and their fp32 output `out_name` (B, Hq, nblk, Sp)
// with Sp a multiple of 16, at least Sk.
template <class T>
void check_delta_shapes(const T& k, const T& mean_k, const T& mean_q, const T& out, const char* out_name) {
  const int64_t B = k.size(0), Hkv = k.size(1), Sk = k.size(2), D = k.size(3);
  const int64_t Hq = mean_q.size(1), nblk = mean_q.size(2), Sp = out.size(3);
  SA3_CHECK(T, Hkv > 0 && Hq % Hkv == 0 && mean_q.size(0) == B && mean_q.size(3) == D,
            "sageattn3: mean_q does not match k: expected (B, Hq, nblk, D) with Hq a multiple of Hkv = ", Hkv,
            ", B ", B, ", D ", D, ", got ", shape(mean_q));
  SA3_CHECK(T, mean_k.numel() == B * Hkv * D, "sageattn3: mean_k does not match k: expected ", dims(B, Hkv, 1, D),
            ", got ", shape(mean_k));
  SA3_CHECK(T, out.size(0) == B && out.size(1) == Hq && out.size(2) == nblk && Sp % 16 == 0 && Sp >= Sk,
            "sageattn3: ", out_name, " has the wrong shape: expected (B, Hq, nblk, Sp) = (", B, ", ", Hq, ", ", nblk,
            ", Sp) with Sp a multiple of 16 >= ", Sk, ", got ", shape(out));
}

// delta_s(k, mean_k, mean_q, out!): k (B, Hkv, Sk, D); mean_k (B, Hkv, 1, D); mean_q (B, Hq, nblk, D);
// out (B, Hq, nblk, Sp) fp32.
template <class T>
void delta_s(T k, T mean_k, T mean_q, T out) {
  check_cuda(k, k, "k");
  check_f32_on(mean_k, k, "mean_k");
  check_f32_on(mean_q, k, "mean_q");
  check_f32_on(out, k, "out");
  SA3_CHECK(T, k.dim() == 4 && mean_q.dim() == 4 && out.dim() == 4,
            "sageattn3: delta_s takes 4-D tensors, got k ", shape(k), ", mean_q ", shape(mean_q), " and out ",
            shape(out));
  const int64_t B = k.size(0), Hkv = k.size(1), Sk = k.size(2), D = k.size(3);
  const int64_t Hq = mean_q.size(1), nblk = mean_q.size(2), Sp = out.size(3);
  SA3_CHECK(T, D % 16 == 0, "sageattn3: D must be a multiple of 16, got ", D);
  check_delta_shapes(k, mean_k, mean_q, out, "out");
  DeviceScope scope(device_index(k));
  check_cuda_kernel<T>(sageattn3::delta_s(k.data_ptr(), dtype_of(k, "k"), B, Hq, Hkv, Sk, D, nblk, floats(mean_k),
                                          floats(mean_q), Sp, floats(out), TensorApi<T>::stream(k)),
                       "delta_s");
}

// smooth_quant_k_delta(k, mean_k, mean_q, packed!, scales!, delta!): k (B, Hkv, Sk, D) bf16/fp16,
// D <= 128; mean_k (B, Hkv, 1, D), mean_q (B, Hq, nblk, D) fp32; packed (B, Hkv, Skp, D/2),
// scales (B, Hkv, Skp, D/16); delta (B, Hq, nblk, Skp) fp32.
template <class T>
void smooth_quant_k_delta(T k, T mean_k, T mean_q, T packed, T scales, T out) {
  check_cuda(k, k, "k");
  check_f32_on(mean_k, k, "mean_k");
  check_f32_on(mean_q, k, "mean_q");
  check_cuda(packed, k, "packed");
  check_cuda(scales, k, "scales");
  check_f32_on(out, k, "delta");
  check_bytes(packed, "packed");
  check_bytes(scales, "scales");
  const auto dt = dtype_of(k, "k");
  SA3_CHECK(T, dt != DType::kFloat32, "sageattn3: smooth_quant_k_delta takes float16/bfloat16 k, got ", dtype_name(k));
  SA3_CHECK(T, k.dim() == 4 && mean_q.dim() == 4 && out.dim() == 4,
            "sageattn3: smooth_quant_k_delta takes 4-D tensors, got k ", shape(k), ", mean_q ", shape(mean_q),
            " and delta ", shape(out));
  const int64_t B = k.size(0), Hkv = k.size(1), Sk = k.size(2), D = k.size(3);
  const int64_t Hq = mean_q.size(1), nblk = mean_q.size(2), Skp = out.size(3);
  SA3_CHECK(T, D % 16 == 0 && D > 0 && D <= 128, "sageattn3: D must be a multiple of 16, at most 128, got ",
            D);
  SA3_CHECK(T, Sk >= 1 && nblk >= 1, "sageattn3: empty k or mean_q: expected Sk, nblk >= 1, got k ",
            shape(k), " and mean_q ", shape(mean_q));
  check_delta_shapes(k, mean_k, mean_q, out, "delta");
  SA3_CHECK(T, packed.numel() == B * Hkv * Skp * D / 2 && scales.numel() == B * Hkv * Skp * D / 16,
            "sageattn3: packed/scales sizes do not match k: expected ", dims(B, Hkv, Skp, D / 2), " and ",
            dims(B, Hkv, Skp, D / 16), ", got ", shape(packed), " and ", shape(scales));
  check_aligned(k, "k");
  DeviceScope scope(device_index(k));
  check_cuda_kernel<T>(sageattn3::smooth_quant_k_delta(k.data_ptr(), dt, B, Hq, Hkv, Sk, D, nblk, floats(mean_k),
                                                       floats(mean_q), Skp, bytes(packed), bytes(scales), floats(out),
                                                       TensorApi<T>::stream(k)),
                       "smooth_quant_k_delta");
}

}  // namespace sageattn3::torch_ops
