// The "auto" Q.K^T precision rule's op: its estimate per (batch, q head) (csrc/preprocess/qk_rule.cu).
#pragma once

#include <cstdint>
#include <initializer_list>
#include <tuple>

#include "sageattn3.h"
#include "torch/checks.h"
#include "torch/outputs.h"

namespace sageattn3::torch_ops {

// The launch's arguments (without the outputs and the workspace) from checked operands.
inline QkRuleArgs rule_fill(const void* q, const void* k, const void* v, DType dt, int64_t B, int64_t Hq, int64_t Hkv,
                            int64_t Sq, int64_t Sk, int64_t D, int64_t Sqp, int64_t Skp, const uint8_t* q_packed,
                            const uint8_t* q_scales, const uint8_t* k_packed, const uint8_t* k_scales,
                            const float* mean_q, int64_t mean_rows, const float* mean_k, const float* balance,
                            bool rotate, double sm_scale, bool floor) {
  QkRuleArgs a{};
  a.q = q;
  a.k = k;
  a.v = v;
  a.dtype = dt;
  a.B = B;
  a.Hq = Hq;
  a.Hkv = Hkv;
  a.Sq = Sq;
  a.Sk = Sk;
  a.D = D;
  a.Sqp = Sqp;
  a.Skp = Skp;
  a.q_packed = q_packed;
  a.q_scales = q_scales;
  a.k_packed = k_packed;
  a.k_scales = k_scales;
  a.mean_q = mean_q;
  a.mean_rows = mean_rows;
  a.mean_k = mean_k;
  a.balance = balance;
  a.rotate = rotate;
  a.scale = static_cast<float>(sm_scale);
  a.floor = floor;
  a.qk16_limit = -1.0f;  // no second statistic unless rule_select sets a limit
  return a;
}

// The selection's outputs and limits into a (qk_rule_select's; the workspace bound by the caller).
inline void rule_select(QkRuleArgs& a, float* error, uint8_t* sel_q, uint8_t* sel_k, float* error_pv, uint8_t* sel_v,
                        double limit, bool select_all, double pv_limit, bool causal, double qk16_limit = -1.0,
                        float* qk16_stat = nullptr) {
  a.qk16_limit = static_cast<float>(qk16_limit);
  a.qk16_stat = qk16_stat;
  a.error = error;
  a.sel_q = sel_q;
  a.sel_k = sel_k;
  a.limit = static_cast<float>(limit);
  a.select_all = select_all ? 1 : 0;
  a.error_pv = error_pv;
  a.sel_v = sel_v;
  a.pv_limit = static_cast<float>(pv_limit);
  a.causal = causal;
}

// The rule op's operands (qk_rule_select): q (B, Hq, Sq, D), k/v (B, Hkv, Sk, D) fp16/bf16, D
// 64/128; the preprocessing's q_packed (B, Hq, Sqp, D/2), q_scales (.., D/16), k_packed (B, Hkv,
// Skp, D/2), k_scales, v_packed (B, Hkv, D, Skp/2), v_scales (.., Skp/16) and v_exp (B, Hkv, Skp/128,
// D/32, int8 values as uint8) or empty (V's NVFP4, for V's share of P's estimate: Skp a multiple of
// 128), mean_q (B, Hq, 1 or ceil(Sq/128), D), mean_k (B, Hkv, 1, D), balance (B,
// Hkv, 1, D) or empty; rotate: the preprocessing rotated Q and K (their codes and means are
// rotated; sm_scale is the one the scores take, already divided by D/64); floor: the
// preprocessing had an option (the balance, the rotation, the scale search): also estimate the
// defaults' rows (sageattn3.h).
// Their checks, into the launch's arguments (without the
// outputs and the workspace).
template <class T>
QkRuleArgs rule_args(const T& q, const T& k, const T& v, const T& q_packed, const T& q_scales, const T& k_packed,
                     const T& k_scales, const T& v_packed, const T& v_scales, const T& v_exp, const T& mean_q,
                     const T& mean_k, const T& balance, double sm_scale, bool rotate, bool floor) {
  check_cuda(q, q, "q");
  check_aligned(q, "q");
  for (const T* t : {&k, &v}) {
    check_cuda(*t, q, "k/v");
    check_aligned(*t, "k/v");
  }
  SA3_CHECK(T, q.dim() == 4 && k.dim() == 4 && v.dim() == 4,
            "sageattn3: qk_rule_select needs 4-D q, k, v, got ", shape(q), ", ", shape(k), " and ", shape(v));
  const int64_t B = q.size(0), Hq = q.size(1), Sq = q.size(2), D = q.size(3), Hkv = k.size(1), Sk = k.size(2);
  const DType dt = dtype_of(q, "q");
  SA3_CHECK(T, dt != DType::kFloat32 && TensorApi<T>::kind(k) == TensorApi<T>::kind(q) &&
                   TensorApi<T>::kind(v) == TensorApi<T>::kind(q),
            "sageattn3: qk_rule_select needs q, k and v all float16 or all bfloat16, got ", dtype_name(q), ", ",
            dtype_name(k), " and ", dtype_name(v));
  SA3_CHECK(T, (D == 64 || D == 128) && Sq >= 1 && Sk >= 1 && Hkv >= 1 && Hq % Hkv == 0 && k.size(0) == B &&
                   k.size(3) == D && v.size(0) == B && v.size(1) == Hkv && v.size(2) == Sk &&
                   v.size(3) == D,
            "sageattn3: qk_rule_select needs q (B, Hq, Sq >= 1, D 64/128) and k, v (B, Hkv, Sk >= 1, D), Hq a "
            "multiple of Hkv, got ", shape(q), ", ", shape(k), " and ", shape(v));
  for (const T* t : {&q_packed, &q_scales, &k_packed, &k_scales}) check_code_tensor(*t, q, "an FP4 operand");
  const int64_t Sqp = q_packed.numel() / (B * Hq * (D / 2)), Skp = k_packed.numel() / (B * Hkv * (D / 2));
  SA3_CHECK(T, Sqp >= Sq && q_packed.numel() == B * Hq * Sqp * (D / 2) && q_scales.numel() == B * Hq * Sqp * (D / 16),
            "sageattn3: q_packed must be (B, Hq, Sqp >= Sq, D/2) and q_scales (B, Hq, Sqp, D/16) = (", B, ", ", Hq,
            ", >= ", Sq, ", ", D / 2, ") and (", B, ", ", Hq, ", Sqp, ", D / 16, "), got ", shape(q_packed), " and ",
            shape(q_scales));
  SA3_CHECK(T, Skp >= Sk && k_packed.numel() == B * Hkv * Skp * (D / 2) && k_scales.numel() == B * Hkv * Skp * (D / 16),
            "sageattn3: k_packed must be (B, Hkv, Skp >= Sk, D/2) and k_scales (B, Hkv, Skp, D/16) = (", B, ", ", Hkv,
            ", >= ", Sk, ", ", D / 2, ") and (", B, ", ", Hkv, ", Skp, ", D / 16, "), got ", shape(k_packed), " and ",
            shape(k_scales));
  for (const T* t : {&v_packed, &v_scales}) check_code_tensor(*t, q, "V's NVFP4 operand");
  SA3_CHECK(T, Skp % 128 == 0 && v_packed.numel() == B * Hkv * D * (Skp / 2) && v_scales.numel() == B * Hkv * D * (Skp / 16),
            "sageattn3: v_packed must be (B, Hkv, D, Skp/2) and v_scales (B, Hkv, D, Skp/16) with Skp (K's padded "
            "length) a multiple of 128 = (", B, ", ", Hkv, ", ", D, ", ", Skp / 2, ") and (..., ", Skp / 16, "), got ",
            shape(v_packed), " and ", shape(v_scales));
  if (v_exp.numel() > 0) {
    check_code_tensor(v_exp, q, "v_exp");
    SA3_CHECK(T, v_exp.numel() == B * Hkv * (Skp / 128) * (D / 32),
              "sageattn3: v_exp (V's tile exponents) must be empty or (B, Hkv, Skp/128, D/32) = ",
              dims(B, Hkv, Skp / 128, D / 32), ", got ", shape(v_exp));
  }
  check_f32_on(mean_q, q, "mean_q");
  check_f32_on(mean_k, q, "mean_k");
  const int64_t mr = mean_q.numel() / (B * Hq * D);
  SA3_CHECK(T, mr >= 1 && mean_q.numel() == B * Hq * mr * D && (mr == 1 || mr * 128 >= Sq),
            "sageattn3: mean_q must be (B, Hq, 1 or ceil(Sq/128), D) = (", B, ", ", Hq, ", 1 or ", (Sq + 127) / 128,
            ", ", D, "), got ", shape(mean_q));
  SA3_CHECK(T, mean_k.numel() == B * Hkv * D, "sageattn3: mean_k must be (B, Hkv, 1, D) = ", dims(B, Hkv, 1, D),
            ", got ", shape(mean_k));
  if (balance.numel() > 0) {
    check_f32_on(balance, q, "balance");
    SA3_CHECK(T, balance.numel() == B * Hkv * D, "sageattn3: balance must be (B, Hkv, 1, D) or empty, expected ",
              dims(B, Hkv, 1, D), ", got ", shape(balance));
  }
  QkRuleArgs a = rule_fill(q.data_ptr(), k.data_ptr(), v.data_ptr(), dt, B, Hq, Hkv, Sq, Sk, D, Sqp, Skp,
                           bytes(q_packed), bytes(q_scales), bytes(k_packed), bytes(k_scales), floats(mean_q), mr,
                           floats(mean_k), balance.numel() > 0 ? floats(balance) : nullptr, rotate, sm_scale, floor);
  a.v_packed = bytes(v_packed);
  a.v_scales = bytes(v_scales);
  a.v_exp = v_exp.numel() > 0 ? reinterpret_cast<const int8_t*>(bytes(v_exp)) : nullptr;
  return a;
}

// qk_rule_select(q, k, v, q_packed, q_scales, k_packed, k_scales, v_packed, v_scales, v_exp, mean_q, mean_k, balance, sm_scale,
// rotate, floor, limit, select_all, pv_limit, causal) -> (error, sel_q, sel_k, error_pv, sel_v): the estimate and
// the selection in one op, which allocates its outputs and its workspace (one host call for the
// whole rule, one kernel launch): error (B, Hq) fp32, the estimate (reference.qk_fp4_error); sel_q (B, Hq) bytes, 1 where the head's Q.K^T
// runs in FP8 (every head with select_all, else error > limit; a NaN estimate keeps FP4); sel_k (B, Hkv) bytes, 1 where any
// of its q heads is 1. P's error (sageattn3.h; pv_limit >= 0): error_pv (B, Hq) fp32, bit 1 of sel_q
// where it exceeds pv_limit (the head's P.V runs in FP8), sel_v (B, Hkv) 1 where any of its q heads
// has bit 1; with pv_limit < 0 error_pv is NaN and no bit 1 is set; causal: P's estimate masks the keys
// after each sampled row (the attention is causal). qk16_limit (>= 0, D 128): bit 2 of sel_q where a head
// with bit 0 has qk16_stat (B, Hq) fp32 (reference.qk16_stat; NaN without) above it, the raw 16-bit
// rows (reference.choose_qk16). Each output and the workspace its own allocation (torch/outputs.h).
template <class T>
std::tuple<T, T, T, T, T, T> qk_rule_select(T q, T k, T v, T q_packed, T q_scales, T k_packed, T k_scales, T v_packed,
                                            T v_scales, T v_exp, T mean_q, T mean_k, T balance, double sm_scale,
                                            bool rotate, bool floor, double limit, bool select_all, double pv_limit,
                                            bool causal, double qk16_limit) {
  QkRuleArgs a = rule_args(q, k, v, q_packed, q_scales, k_packed, k_scales, v_packed, v_scales, v_exp, mean_q, mean_k,
                           balance, sm_scale, rotate, floor);
  DeviceScope scope(device_index(q));
  // error, sel_q, sel_k, error_pv, sel_v, then the workspace (its layout: qk_rule_bind_workspace,
  // sageattn3.h); torch/outputs.h
  const OutputSpec specs[] = {{{a.B, a.Hq}, Kind::kFloat}, {{a.B, a.Hq}, Kind::kByte}, {{a.B, a.Hkv}, Kind::kByte},
                              {{a.B, a.Hq}, Kind::kFloat}, {{a.B, a.Hkv}, Kind::kByte},
                              {{a.B, a.Hq}, Kind::kFloat}, {{qk_rule_workspace_floats(a)}, Kind::kFloat}};
  auto out = allocate_outputs(specs, q);
  const T &error = out[0], &sel_q = out[1], &sel_k = out[2], &error_pv = out[3], &sel_v = out[4], &stat = out[5];
  qk_rule_bind_workspace(a, floats(out[6]));
  SA3_CHECK(T, !(qk16_limit >= 0.0) || a.D == 128,
            "sageattn3: qk_rule_select's qk16_limit (the raw 16-bit rows) is for head_dim 128, got ", a.D,
            " (pass -1)");
  rule_select(a, floats(error), bytes(sel_q), bytes(sel_k), floats(error_pv), bytes(sel_v), limit, select_all, pv_limit,
              causal, qk16_limit, floats(stat));
  check_cuda_kernel<T>(sageattn3::qk_rule_error(a, TensorApi<T>::stream(q)), "qk_rule_select");
  return {error, sel_q, sel_k, error_pv, sel_v, stat};
}

}  // namespace sageattn3::torch_ops
