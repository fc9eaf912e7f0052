// The FP4 attention ops (csrc/attn; the kernel's launch API is attn/attn_api.h): the checks of
// its operands, blockscaled_fp4_attn, the per-head FP8 Q.K^T variant blockscaled_attn_qk8 and the
// FP8 P.V one blockscaled_attn_pv8 (either Q.K^T).
#pragma once

#include <cstdint>
#include <initializer_list>

#include "attn/attn_api.h"
#include "torch/checks.h"

namespace sageattn3::torch_ops {

// The attention's operands by address (attn/attn_api.h's order, checked by the caller).
struct AttnOperands {
  const void *q, *q_sf, *k, *k_sf, *v, *v_sf;
  const int8_t* v_exp;
  const float *mean_q, *qbar, *ds_key;
  const void* k_res;
  float* ds_work;
  int64_t ds_work_floats;
  void* out;
};

// The launch's arguments from checked operands and their shapes (nblk: Q means per head).
inline Fp4AttnArgs attn_fill(const AttnOperands& o, int64_t B, int64_t Hq, int64_t Hkv, int64_t D, int64_t seq_q,
                             int64_t seq_k, int64_t Sqp, int64_t Skp, int64_t nblk, double sm_scale, bool causal,
                             DType out_dtype) {
  Fp4AttnArgs a{};
  a.q = o.q;
  a.q_sf = o.q_sf;
  a.k = o.k;
  a.k_sf = o.k_sf;
  a.v = o.v;
  a.v_sf = o.v_sf;
  a.v_exp = o.v_exp;
  a.mean_q = o.mean_q;
  a.qbar = o.qbar;
  a.ds_key = o.ds_key;
  a.k_res = o.k_res;
  a.ds_work = o.ds_work;
  a.ds_work_floats = o.ds_work_floats;
  a.out = o.out;
  a.batch = static_cast<int>(B);
  a.heads_q = static_cast<int>(Hq);
  a.heads_kv = static_cast<int>(Hkv);
  a.head_dim = static_cast<int>(D);
  a.seq_q = static_cast<int>(seq_q);
  a.seq_k = static_cast<int>(seq_k);
  a.seq_q_pad = static_cast<int>(Sqp);
  a.seq_k_pad = static_cast<int>(Skp);
  a.mean_qblocks = static_cast<int>(nblk);
  a.sm_scale = static_cast<float>(sm_scale);
  a.causal = causal ? 1 : 0;
  a.out_dtype = out_dtype;
  return a;
}

// The per-head Q.K^T precision's operands into a (set_qk8's, checked by the caller): at D 64 the
// 16-bit Q.K^T (bf16 rows, no scales), at D 128 MXFP8.
inline void qk8_fill(Fp4AttnArgs& a, const uint8_t* head_sel, const void* q8, const void* q8_sf, const void* k8,
                     const void* k8_sf) {
  a.head_sel = head_sel;
  a.q8 = q8;
  a.q8_sf = q8_sf;
  a.k8 = k8;
  a.k8_sf = k8_sf;
  a.qk16 = a.head_dim == 64;
}

// V's MXFP8 operands into a (set_pv8's, checked by the caller); by_head: per head from head_sel's bit 1.
inline void pv8_fill(Fp4AttnArgs& a, const void* v8, const void* v8_sf, bool by_head) {
  a.v8 = v8;
  a.v8_sf = v8_sf;
  a.v8_by_head = by_head;
}

// blockscaled_fp4_attn(q, q_sf, k, k_sf, v, v_sf, v_exp, mean_q, qbar, ds_key, k_res, ds_work!, out!,
// seq_q, seq_k, sm_scale, causal):
// layouts in attn/attn_api.h (sequence dims padded to multiples of 128, zeros); mean_q
// (B, Hq, 1 or Sq_p/128, D), qbar (B, Hq, 1, D), ds_key (B, Hq, Sk_p) fp32, k_res (B, Hkv, Sk_p, D)
// float16 (K's quantization residual; needed with more than one Q mean, else may be empty): the
// kernel adds delta_s = ds_key + (mean_q - qbar) . (dequant(k) + k_res)^T itself; ds_work fp32
// (any shape, contiguous): the workspace that delta_s per query block and key is precomputed
// into (attn/attn_api.h), or empty (the bounded-memory mode); v_exp (B, Hkv, Sk_p/128, D/32) int8
// values as uint8 (V's tile exponents, preprocess_qkv), or empty (every exponent 0).
template <class T>
Fp4AttnArgs attn_args(const T& q, const T& q_sf, const T& k, const T& k_sf, const T& v, const T& v_sf, const T& v_exp,
                      const T& mean_q, const T& qbar, const T& ds_key, const T& k_res, const T& ds_work, const T& out,
                      int64_t seq_q, int64_t seq_k, double sm_scale, bool causal) {
  check_cuda(q, q, "q");
  for (const T* t : {&q_sf, &k, &k_sf, &v, &v_sf, &v_exp, &mean_q, &qbar, &ds_key, &k_res, &ds_work, &out})
    check_cuda(*t, q, "an attention operand");
  check_bytes(q, "q");
  check_bytes(q_sf, "q_sf");
  check_bytes(k, "k");
  check_bytes(k_sf, "k_sf");
  check_bytes(v, "v");
  check_bytes(v_sf, "v_sf");
  check_f32(mean_q, "mean_q");
  check_f32(qbar, "qbar");
  check_f32(ds_key, "ds_key");
  check_f32(ds_work, "ds_work");
  SA3_CHECK(T, q.dim() == 4 && k.dim() == 4 && v.dim() == 4 && q_sf.dim() == 4 && k_sf.dim() == 4 &&
                   v_sf.dim() == 4 && mean_q.dim() == 4 && out.dim() == 4,
            "sageattn3: blockscaled_fp4_attn takes 4-D tensors, got q, k, v, q_sf, k_sf, v_sf, mean_q and out with ",
            dims(q.dim(), k.dim(), v.dim(), q_sf.dim(), k_sf.dim(), v_sf.dim(), mean_q.dim(), out.dim()), " dims");
  const int64_t B = q.size(0), Hq = q.size(1), Sqp = q.size(2), D = q.size(3) * 2;
  const int64_t Hkv = k.size(1), Skp = k.size(2);
  SA3_CHECK(T, D == 64 || D == 128, "sageattn3: head_dim must be 64 or 128, got ", D);
  SA3_CHECK(T, Hkv > 0 && Hq % Hkv == 0, "sageattn3: q heads must be a multiple of kv heads, got ", Hq, " and ", Hkv);
  SA3_CHECK(T, Sqp % 128 == 0 && Skp % 128 == 0, "sageattn3: padded sequence lengths must be multiples of 128, got ",
            Sqp, " and ", Skp);
  SA3_CHECK(T, seq_q >= 1 && seq_q <= Sqp && seq_k >= 1 && seq_k <= Skp,
            "sageattn3: seq_q/seq_k out of range: expected 1..", Sqp, " and 1..", Skp, ", got ", seq_q, " and ", seq_k);
  auto same = [](const T& t, int64_t a, int64_t b, int64_t c, int64_t d) {
    return t.size(0) == a && t.size(1) == b && t.size(2) == c && t.size(3) == d;
  };
  SA3_CHECK(T, same(q_sf, B, Hq, Sqp, D / 16), "sageattn3: q_sf shape must be (B, Hq, Sq_p, D/16) = ",
            dims(B, Hq, Sqp, D / 16), ", got ", shape(q_sf));
  SA3_CHECK(T, same(k, B, Hkv, Skp, D / 2) && same(k_sf, B, Hkv, Skp, D / 16),
            "sageattn3: k/k_sf shape must be (B, Hkv, Sk_p, D/2) / (.., D/16) = ", dims(B, Hkv, Skp, D / 2), " / ",
            dims(B, Hkv, Skp, D / 16), ", got ", shape(k), " / ", shape(k_sf));
  SA3_CHECK(T, same(v, B, Hkv, D, Skp / 2) && same(v_sf, B, Hkv, D, Skp / 16),
            "sageattn3: v/v_sf shape must be (B, Hkv, D, Sk_p/2) / (.., Sk_p/16) = ", dims(B, Hkv, D, Skp / 2), " / ",
            dims(B, Hkv, D, Skp / 16), ", got ", shape(v), " / ", shape(v_sf));
  const int64_t nblk = mean_q.size(2);
  SA3_CHECK(T, same(mean_q, B, Hq, nblk, D) && (nblk == 1 || nblk == Sqp / 128),
            "sageattn3: mean_q shape must be (B, Hq, 1 or Sq_p/128, D) = (", B, ", ", Hq, ", 1 or ", Sqp / 128, ", ", D,
            "), got ", shape(mean_q));
  SA3_CHECK(T, qbar.dim() == 4 && same(qbar, B, Hq, 1, D), "sageattn3: qbar shape must be (B, Hq, 1, D) = ",
            dims(B, Hq, 1, D), ", got ", shape(qbar));
  SA3_CHECK(T, ds_key.dim() == 3 && ds_key.size(0) == B && ds_key.size(1) == Hq && ds_key.size(2) == Skp,
            "sageattn3: ds_key shape must be (B, Hq, Sk_p) = ", dims(B, Hq, Skp), ", got ", shape(ds_key));
  SA3_CHECK(T, same(out, B, Hq, seq_q, D), "sageattn3: out shape must be (B, Hq, seq_q, D) = ", dims(B, Hq, seq_q, D),
            ", got ", shape(out));
  if (v_exp.numel() > 0) {
    check_code_tensor(v_exp, q, "v_exp");
    SA3_CHECK(T, v_exp.dim() == 4 && same(v_exp, B, Hkv, Skp / 128, D / 32),
              "sageattn3: v_exp (V's tile exponents) must be empty or (B, Hkv, Sk_p/128, D/32) = ",
              dims(B, Hkv, Skp / 128, D / 32), ", got ", shape(v_exp));
  }
  const bool residual = k_res.numel() > 0;
  SA3_CHECK(T, residual || nblk == 1, "sageattn3: k_res (K's quantization residual) is needed with per-block Q means, ",
            "got an empty k_res with ", nblk, " Q means per head");
  if (residual) {
    check_residual(k_res, q, "k_res");
    SA3_CHECK(T, k_res.dim() == 4 && same(k_res, B, Hkv, Skp, D), "sageattn3: k_res shape must be (B, Hkv, Sk_p, D) = ",
              dims(B, Hkv, Skp, D), ", got ", shape(k_res));
  }
  const Fp4AttnArgs a = attn_fill({q.data_ptr(), q_sf.data_ptr(), k.data_ptr(), k_sf.data_ptr(), v.data_ptr(),
                                    v_sf.data_ptr(),
                                    v_exp.numel() > 0 ? reinterpret_cast<const int8_t*>(v_exp.data_ptr()) : nullptr,
                                    floats(mean_q), floats(qbar), floats(ds_key), residual ? k_res.data_ptr() : nullptr,
                                    ds_work.numel() > 0 ? floats(ds_work) : nullptr, ds_work.numel(), out.data_ptr()},
                                   B, Hq, Hkv, D, seq_q, seq_k, Sqp, Skp, nblk, sm_scale, causal, dtype_of(out, "out"));
  SA3_CHECK(T, a.out_dtype != DType::kFloat32, "sageattn3: out must be float16 or bfloat16, got ", dtype_name(out));
  return a;
}

template <class T>
void blockscaled_fp4_attn(T q, T q_sf, T k, T k_sf, T v, T v_sf, T v_exp, T mean_q, T qbar, T ds_key, T k_res, T ds_work,
                          T out, int64_t seq_q, int64_t seq_k, double sm_scale, bool causal) {
  DeviceScope scope(device_index(q));
  const Fp4AttnArgs a =
      attn_args(q, q_sf, k, k_sf, v, v_sf, v_exp, mean_q, qbar, ds_key, k_res, ds_work, out, seq_q, seq_k, sm_scale,
                causal);
  check_cuda_kernel<T>(fp4_attn_fwd(a, TensorApi<T>::stream(q)), "blockscaled_fp4_attn");
}

// The per-head FP8 Q.K^T operands into a (attn/attn_api.h): head_sel (B, Hq) uint8 (1: FP8 Q.K^T),
// q8 (B, Hq, Sq_p, D) / k8 (B, Hkv, Sk_p, D) E4M3, q8_sf / k8_sf (..., D/32) UE8M0 bytes. At D 64
// the 16-bit Q.K^T instead (a.qk16): q8 (B, Hq, Sq_p, 2D) / k8 (B, Hkv, Sk_p, 2D) bytes, bf16 rows,
// and q8_sf / k8_sf empty (mxfp8_smooth_quant_qk's outputs at D 64).
template <class T>
void set_qk8(Fp4AttnArgs& a, const T& q, const T& head_sel, const T& q8, const T& q8_sf, const T& k8,
             const T& k8_sf) {
  const int64_t B = a.batch, Hq = a.heads_q, Sqp = a.seq_q_pad, D = a.head_dim, Hkv = a.heads_kv, Skp = a.seq_k_pad;
  for (const T* t : {&head_sel, &q8, &q8_sf, &k8, &k8_sf}) {
    check_code_tensor(*t, q, "an FP8 Q.K^T operand");
    SA3_CHECK(T, t->dim() >= 2, "sageattn3: the FP8 Q.K^T operands are (B, H, ...) tensors, got one of shape ",
              shape(*t));
  }
  SA3_CHECK(T, head_sel.numel() == B * Hq, "sageattn3: head_sel must be (B, Hq) = (", B, ", ", Hq, ") bytes, got ",
            shape(head_sel));
  // D 64: bf16 rows (2D bytes each), no scales; D 128: MXFP8
  const bool qk16 = D == 64;
  const int64_t row = qk16 ? 2 * D : D, sf = qk16 ? 0 : D / 32;
  SA3_CHECK(T, q8.numel() == B * Hq * Sqp * row && q8_sf.numel() == B * Hq * Sqp * sf,
            "sageattn3: q8 must be (B, Hq, Sq_p, ", qk16 ? "2D" : "D", ") = (", B, ", ", Hq, ", ", Sqp, ", ", row,
            ") bytes and q8_sf (..., ", sf, ") (at D 64 the bf16 rows of mxfp8_smooth_quant_qk), got ", shape(q8),
            " and ", shape(q8_sf));
  SA3_CHECK(T, k8.numel() == B * Hkv * Skp * row && k8_sf.numel() == B * Hkv * Skp * sf,
            "sageattn3: k8 must be (B, Hkv, Sk_p, ", qk16 ? "2D" : "D", ") = (", B, ", ", Hkv, ", ", Skp, ", ", row,
            ") bytes and k8_sf (..., ", sf, ") (at D 64 the bf16 rows of mxfp8_smooth_quant_qk), got ", shape(k8),
            " and ", shape(k8_sf));
  SA3_CHECK(T, a.mean_qblocks == 1 || a.ds_work != nullptr,
            "sageattn3: the FP8 Q.K^T path needs the delta_s workspace with per-block Q means, got an empty ds_work "
            "with ", a.mean_qblocks, " Q means per head");
  qk8_fill(a, bytes(head_sel), q8.data_ptr(), q8_sf.data_ptr(), k8.data_ptr(), k8_sf.data_ptr());
}

// The raw 16-bit Q.K^T's operands into a (attn/attn_api.h; none where q_raw is empty): q_raw (B, Hq,
// seq_q, D) and k_raw (B, Hkv, seq_k, D), the call's float16/bfloat16 inputs (contiguous, 16-byte
// aligned), for the heads whose head_sel byte has bit 2 (qk_rule_select with a qk16_limit; D 128);
// raw_scale: their softmax scale, unrotated. Set after set_qk8.
template <class T>
void set_raw(Fp4AttnArgs& a, const T& q, const T& q_raw, const T& k_raw, double raw_scale) {
  if (q_raw.numel() == 0 && k_raw.numel() == 0) return;
  check_cuda(q_raw, q, "q_raw");
  check_cuda(k_raw, q, "k_raw");
  check_aligned(q_raw, "q_raw");
  check_aligned(k_raw, "k_raw");
  const DType dt = dtype_of(q_raw, "q_raw");
  SA3_CHECK(T, dt != DType::kFloat32 && dtype_of(k_raw, "k_raw") == dt,
            "sageattn3: q_raw and k_raw must be both float16 or both bfloat16, got ", dtype_name(q_raw), " and ",
            dtype_name(k_raw));
  SA3_CHECK(T, a.head_dim == 128 && a.head_sel != nullptr,
            "sageattn3: the raw 16-bit Q.K^T (q_raw, k_raw) is for head_dim 128 with head_sel, got head_dim ",
            a.head_dim, a.head_sel == nullptr ? " and no head_sel" : "");
  SA3_CHECK(T, q_raw.dim() == 4 && k_raw.dim() == 4 && q_raw.size(0) == a.batch && q_raw.size(1) == a.heads_q &&
                   q_raw.size(2) == a.seq_q && q_raw.size(3) == 128 && k_raw.size(0) == a.batch &&
                   k_raw.size(1) == a.heads_kv && k_raw.size(2) == a.seq_k && k_raw.size(3) == 128,
            "sageattn3: q_raw must be (B, Hq, seq_q, D) = ", dims(a.batch, a.heads_q, a.seq_q, 128),
            " and k_raw (B, Hkv, seq_k, D) = ", dims(a.batch, a.heads_kv, a.seq_k, 128), ", got ", shape(q_raw),
            " and ", shape(k_raw));
  a.q_raw = q_raw.data_ptr();
  a.k_raw = k_raw.data_ptr();
  a.raw_f16 = dt == DType::kFloat16;
  a.raw_sm_scale = static_cast<float>(raw_scale);
}

// blockscaled_attn_qk8(<blockscaled_fp4_attn's operands>, head_sel, q8, q8_sf, k8, k8_sf, ...): the
// per-head Q.K^T precision (set_qk8). ds_work must hold at least one (batch, q head) row with
// per-block Q means (no bounded-memory mode here). q_raw, k_raw, raw_scale: set_raw (empty: none).
template <class T>
void blockscaled_attn_qk8(T q, T q_sf, T k, T k_sf, T v, T v_sf, T v_exp, T mean_q, T qbar, T ds_key, T k_res, T ds_work,
                          T out, T head_sel, T q8, T q8_sf, T k8, T k8_sf, T q_raw, T k_raw, double raw_scale,
                          int64_t seq_q, int64_t seq_k, double sm_scale, bool causal) {
  DeviceScope scope(device_index(q));
  Fp4AttnArgs a =
      attn_args(q, q_sf, k, k_sf, v, v_sf, v_exp, mean_q, qbar, ds_key, k_res, ds_work, out, seq_q, seq_k, sm_scale,
                causal);
  set_qk8(a, q, head_sel, q8, q8_sf, k8, k8_sf);
  set_raw(a, q, q_raw, k_raw, raw_scale);
  check_cuda_kernel<T>(fp4_attn_fwd(a, TensorApi<T>::stream(q)), "blockscaled_attn_qk8");
}

// V's MXFP8 operands into a (attn/attn_api.h): v8 (B, Hkv, D, Sk_p) E4M3 and v8_sf (B, Hkv, D,
// Sk_p/32) UE8M0 bytes (quant_mxfp8_cols of V). Like the FP8 Q.K^T path, the FP8 P.V path needs
// the delta_s workspace with per-block Q means.
template <class T>
void set_pv8(Fp4AttnArgs& a, const T& q, const T& v8, const T& v8_sf, bool by_head = false) {
  check_code_tensor(v8, q, "v8");
  check_code_tensor(v8_sf, q, "v8_sf");
  const int64_t BH = static_cast<int64_t>(a.batch) * a.heads_kv, D = a.head_dim, Skp = a.seq_k_pad;
  SA3_CHECK(T, v8.dim() == 4 && v8.numel() == BH * D * Skp && v8.size(2) == D && v8_sf.numel() == BH * D * (Skp / 32),
            "sageattn3: v8 must be (B, Hkv, D, Sk_p) = (", a.batch, ", ", a.heads_kv, ", ", D, ", ", Skp,
            ") and v8_sf (..., Sk_p/32), got ", shape(v8), " and ", shape(v8_sf));
  SA3_CHECK(T, a.mean_qblocks == 1 || a.ds_work != nullptr,
            "sageattn3: the FP8 P.V path needs the delta_s workspace with per-block Q means, got an empty ds_work "
            "with ", a.mean_qblocks, " Q means per head");
  pv8_fill(a, v8.data_ptr(), v8_sf.data_ptr(), by_head);
}

// blockscaled_attn_pv8(<blockscaled_attn_qk8's operands but the raw ones>, v8, v8_sf, <q_raw, k_raw,
// raw_scale>, ...): P.V in MXFP8 for every
// head (pv_precision "fp8"; set_pv8); v and v_sf are checked but unused. An empty head_sel: every
// head's Q.K^T in FP4 (q8, q8_sf, k8, k8_sf unused, may be empty), else per head as
// blockscaled_attn_qk8.
template <class T>
void blockscaled_attn_pv8(T q, T q_sf, T k, T k_sf, T v, T v_sf, T v_exp, T mean_q, T qbar, T ds_key, T k_res, T ds_work,
                          T out, T head_sel, T q8, T q8_sf, T k8, T k8_sf, T v8, T v8_sf, T q_raw, T k_raw,
                          double raw_scale, int64_t seq_q, int64_t seq_k, double sm_scale, bool causal) {
  DeviceScope scope(device_index(q));
  Fp4AttnArgs a =
      attn_args(q, q_sf, k, k_sf, v, v_sf, v_exp, mean_q, qbar, ds_key, k_res, ds_work, out, seq_q, seq_k, sm_scale,
                causal);
  if (head_sel.numel() > 0) set_qk8(a, q, head_sel, q8, q8_sf, k8, k8_sf);
  set_raw(a, q, q_raw, k_raw, raw_scale);
  set_pv8(a, q, v8, v8_sf);
  check_cuda_kernel<T>(fp4_attn_fwd(a, TensorApi<T>::stream(q)), "blockscaled_attn_pv8");
}

// blockscaled_attn_mixed(<blockscaled_attn_pv8's operands>): both precisions chosen per head (the
// rule, qk_rule_select): head_sel (B, Hq) bytes, bit 0 FP8 Q.K^T (q8, k8), bit 1 FP8 P.V (v8, the
// kv heads of such q heads quantized; v and v_sf for the others). One launch per byte value.
template <class T>
void blockscaled_attn_mixed(T q, T q_sf, T k, T k_sf, T v, T v_sf, T v_exp, T mean_q, T qbar, T ds_key, T k_res, T ds_work,
                            T out, T head_sel, T q8, T q8_sf, T k8, T k8_sf, T v8, T v8_sf, T q_raw, T k_raw,
                            double raw_scale, int64_t seq_q, int64_t seq_k, double sm_scale, bool causal) {
  DeviceScope scope(device_index(q));
  Fp4AttnArgs a =
      attn_args(q, q_sf, k, k_sf, v, v_sf, v_exp, mean_q, qbar, ds_key, k_res, ds_work, out, seq_q, seq_k, sm_scale,
                causal);
  set_qk8(a, q, head_sel, q8, q8_sf, k8, k8_sf);
  set_raw(a, q, q_raw, k_raw, raw_scale);
  set_pv8(a, q, v8, v8_sf, true);
  check_cuda_kernel<T>(fp4_attn_fwd(a, TensorApi<T>::stream(q)), "blockscaled_attn_mixed");
}

}  // namespace sageattn3::torch_ops
