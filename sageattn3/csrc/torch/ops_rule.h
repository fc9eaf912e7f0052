// The "auto" Q.K^T precision rule's op: its estimate per (batch, q head) (csrc/preprocess/qk_rule.cu).
#pragma once

#include <cstdint>
#include <initializer_list>

#include "sageattn3.h"
#include "torch/checks.h"

namespace sageattn3::torch_ops {

// qk_rule_error(q, k, v, q_packed, q_scales, k_packed, k_scales, mean_q, mean_k, balance, sm_scale,
// partial!, counter!, error!): the "auto" rule's estimate per (batch, q head) (sageattn3.h,
// qk_rule_error): q (B, Hq, Sq, D), k/v (B, Hkv, Sk, D) fp16/bf16, D 64/128; the preprocessing's
// q_packed (B, Hq, Sqp, D/2), q_scales (.., D/16), k_packed (B, Hkv, Skp, D/2), k_scales, mean_q
// (B, Hq, 1 or ceil(Sq/128), D), mean_k (B, Hkv, 1, D), balance (B, Hkv, 1, D) or empty;
// partial (B, Hq, 8, 2) fp32, counter (B, Hq) int32 zeros, error (B, Hq) fp32.
template <class T>
void qk_rule_error(T q, T k, T v, T q_packed, T q_scales, T k_packed, T k_scales, T mean_q, T mean_k, T balance,
                   double sm_scale, T partial, T counter, T error) {
  check_cuda(q, q, "q");
  check_aligned(q, "q");
  for (const T* t : {&k, &v}) {
    check_cuda(*t, q, "k/v");
    check_aligned(*t, "k/v");
  }
  SA3_CHECK(T, q.dim() == 4 && k.dim() == 4 && v.dim() == 4,
            "sageattn3: qk_rule_error needs 4-D q, k, v, got ", shape(q), ", ", shape(k), " and ", shape(v));
  const int64_t B = q.size(0), Hq = q.size(1), Sq = q.size(2), D = q.size(3), Hkv = k.size(1), Sk = k.size(2);
  const DType dt = dtype_of(q, "q");
  SA3_CHECK(T, dt != DType::kFloat32 && TensorApi<T>::kind(k) == TensorApi<T>::kind(q) &&
                   TensorApi<T>::kind(v) == TensorApi<T>::kind(q),
            "sageattn3: qk_rule_error needs q, k and v all float16 or all bfloat16, got ", dtype_name(q), ", ",
            dtype_name(k), " and ", dtype_name(v));
  SA3_CHECK(T, (D == 64 || D == 128) && Sq >= 1 && Sk >= 1 && Hkv >= 1 && Hq % Hkv == 0 && k.size(0) == B &&
                   k.size(3) == D && v.size(0) == B && v.size(1) == Hkv && v.size(2) == Sk &&
                   v.size(3) == D,
            "sageattn3: qk_rule_error needs q (B, Hq, Sq >= 1, D 64/128) and k, v (B, Hkv, Sk >= 1, D), Hq a "
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
  check_f32_on(partial, q, "partial");
  check_f32_on(error, q, "error");
  check_cuda(counter, q, "counter");
  check_i32(counter, "counter");
  SA3_CHECK(T, partial.numel() == B * Hq * 16 && counter.numel() == B * Hq && error.numel() == B * Hq,
            "sageattn3: partial must be (B, Hq, 8, 2), counter and error (B, Hq) = ", dims(B, Hq, 8, 2), " and ",
            dims(B, Hq), ", got ", shape(partial), ", ", shape(counter), " and ", shape(error));
  DeviceScope scope(device_index(q));
  QkRuleArgs a{};
  a.q = q.data_ptr();
  a.k = k.data_ptr();
  a.v = v.data_ptr();
  a.dtype = dt;
  a.B = B;
  a.Hq = Hq;
  a.Hkv = Hkv;
  a.Sq = Sq;
  a.Sk = Sk;
  a.D = D;
  a.Sqp = Sqp;
  a.Skp = Skp;
  a.q_packed = bytes(q_packed);
  a.q_scales = bytes(q_scales);
  a.k_packed = bytes(k_packed);
  a.k_scales = bytes(k_scales);
  a.mean_q = floats(mean_q);
  a.mean_rows = mr;
  a.mean_k = floats(mean_k);
  a.balance = balance.numel() > 0 ? floats(balance) : nullptr;
  a.scale = static_cast<float>(sm_scale);
  a.partial = floats(partial);
  a.counter = ints(counter);
  a.error = floats(error);
  check_cuda_kernel<T>(sageattn3::qk_rule_error(a, TensorApi<T>::stream(q)), "qk_rule_error");
}

}  // namespace sageattn3::torch_ops
