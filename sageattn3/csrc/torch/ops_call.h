// attention_call: the whole eager FP4 call of sageattn3_blackwell in one op, the kernels of
// preprocess_qkv, qk_rule_select, mxfp8_smooth_quant_qk, quant_mxfp8_cols and the attention op in
// the same order and with the same arguments (the values they write are the same), but with one
// host call and one allocation for every intermediate tensor (and one for the output), and fewer
// host calls into the runtime: the rule's zeros are written by the preprocessing's means launch
// (no memsets), V's MXFP8 comes with the FP8 rows' launch. The intermediates are never outputs, so
// carving them from one allocation breaks no aliasing rule (torch/outputs.h). The Python side
// decides what the separate ops would run (sageattn3/_call.py) and passes it as qk_mode / pv_mode.
// Each piece has the size of the tensor the separate op allocates, at a 256-byte boundary, but for
// the rule's workspace, which holds sel_k and sel_v after it (one run of words to zero).
#pragma once

#include <algorithm>
#include <cstdint>

#include "attn/attn_api.h"
#include "sageattn3.h"
#include "torch/checks.h"
#include "torch/ops_attn.h"
#include "torch/ops_preprocess.h"
#include "torch/ops_quant.h"
#include "torch/ops_rule.h"
#include "torch/outputs.h"

namespace sageattn3::torch_ops {

// Byte offsets into one allocation, each piece at a 256-byte boundary.
struct Carve {
  int64_t size = 0;
  int64_t take(int64_t bytes) {
    const int64_t at = size;
    size += (bytes + 255) / 256 * 256;
    return at;
  }
};

// Where the rule's and the FP8 operands' pieces lie (offsets; -1 where the call has none).
struct CallPieces {
  int64_t prep[PrepPlan::kOutputs];
  int64_t work = -1, error = -1, sel_q = -1, sel_k = -1, error_pv = -1, sel_v = -1, rule_ws = -1;
  int64_t q8 = -1, q8_sf = -1, k8 = -1, k8_sf = -1, v8 = -1, v8_sf = -1;
};

// attention_call(q, k, v, causal, per_block_mean, rotate, balance, search, qk_mode, pv_mode, sm_scale,
// rule_scale, rule_floor, limit, pv_limit, qk16_limit, ws_limit) -> out (B, Hq, Sq, D) in q's dtype: q (B, Hq,
// Sq, D), k and v (B, Hkv, Sk, D) float16/bfloat16 as preprocess_qkv takes them (pad 128).
// qk_mode 0: every head's Q.K^T in FP4 (the rule does not run); 1: the rule picks per head (limit;
// qk_rule_select); 2: every head FP8 (select_all). pv_mode 0: NVFP4 P.V; 1 (with qk_mode > 0): the
// rule picks per head (pv_limit; blockscaled_attn_mixed); 2: every head MXFP8. sm_scale: the
// attention's softmax scale (divided by D/64 already with the rotation); rule_scale and rule_floor:
// qk_rule_select's sm_scale and floor; qk16_limit (D 128, >= 0; -1 off): qk_rule_select's, the heads it
// gives bit 2 multiplying q and k as they are (Fp4AttnArgs.q_raw); ws_limit: the most bytes of the delta_s workspace
// (SAGEATTN3_DELTA_S_WORKSPACE_MIB; it must hold one (batch, q head) row where an FP8 path runs with
// per-block Q means).
template <class T>
T attention_call(T q, T k, T v, bool causal, bool per_block_mean, bool rotate, bool balance, bool search,
                 int64_t qk_mode, int64_t pv_mode, double sm_scale, double rule_scale, bool rule_floor, double limit,
                 double pv_limit, double qk16_limit, int64_t ws_limit) {
  SA3_CHECK(T, qk_mode >= 0 && qk_mode <= 2 && pv_mode >= 0 && pv_mode <= 2 && (pv_mode != 1 || qk_mode > 0),
            "sageattn3: attention_call's qk_mode and pv_mode must be 0, 1 or 2, pv_mode 1 only with the rule "
            "(qk_mode 1 or 2), got ", qk_mode, " and ", pv_mode);
  SA3_CHECK(T, ws_limit >= 0, "sageattn3: attention_call's ws_limit must be >= 0 bytes, got ", ws_limit);
  const PrepPlan p = prep_plan(q, k, v, 128, per_block_mean, balance, "attention_call");
  SA3_CHECK(T, p.dt != DType::kFloat32, "sageattn3: attention_call takes float16 or bfloat16 q, k and v, got ",
            dtype_name(q));
  const auto specs = p.specs();
  Carve c;
  CallPieces at;
  for (int i = 0; i < PrepPlan::kOutputs; ++i) at.prep[i] = c.take(output_bytes<T>(specs[i]));
  // the delta_s workspace: whole (batch, q head) rows of ceil(Sq/128) x Skp floats (_attn.delta_s_workspace)
  const int64_t row = (p.Sq + 127) / 128 * p.Skp;
  const int64_t rows = p.nm > 1 ? std::min(p.Gq, ws_limit / (4 * row)) : 0;
  SA3_CHECK(T, (qk_mode == 0 && pv_mode == 0) || p.nm == 1 || rows >= 1,
            "sageattn3: the FP8 paths need the delta_s workspace to hold one (batch, q head) row: ", 4 * row,
            " bytes, got a limit of ", ws_limit, " (raise SAGEATTN3_DELTA_S_WORKSPACE_MIB or use FP4)");
  if (rows > 0) at.work = c.take(4 * rows * row);
  QkRuleArgs r{};
  const int64_t D = p.D, row8 = D == 64 ? 2 * D : D, sf8 = D == 64 ? 0 : D / 32;
  if (qk_mode > 0) {
    r = rule_fill(q.data_ptr(), k.data_ptr(), v.data_ptr(), p.dt, p.B, p.Hq, p.Hk, p.Sq, p.Sk, D, p.Sqp, p.Skp,
                  nullptr, nullptr, nullptr, nullptr, nullptr, p.nm, nullptr, nullptr, rotate, rule_scale, rule_floor);
    at.error = c.take(4 * p.Gq);
    at.sel_q = c.take(p.Gq);
    at.error_pv = c.take(4 * p.Gq);
    // the workspace, sel_k and sel_v end to end: the counters (the workspace's end) and both
    // selections are one run of words to zero (qk_rule_bind_workspace)
    const int64_t ws = 4 * qk_rule_workspace_floats(r);
    at.rule_ws = c.take(ws + 2 * p.Gk + 3);  // + 3: the zeroed words' last may pass sel_v's end
    at.sel_k = at.rule_ws + ws;
    at.sel_v = at.sel_k + p.Gk;
    at.q8 = c.take(p.Gq * p.Sqp * row8);
    at.q8_sf = c.take(p.Gq * p.Sqp * sf8);
    at.k8 = c.take(p.Gk * p.Skp * row8);
    at.k8_sf = c.take(p.Gk * p.Skp * sf8);
  }
  if (pv_mode > 0) {
    at.v8 = c.take(p.Gk * D * p.Skp);
    at.v8_sf = c.take(p.Gk * D * p.Skp / 32);
  }
  DeviceScope scope(device_index(q));
  const T buf = TensorApi<T>::empty({c.size}, Kind::kByte, q);
  T out = TensorApi<T>::empty({p.B, p.Hq, p.Sq, D}, TensorApi<T>::kind(q), q);
  uint8_t* base = bytes(buf);
  auto ptr = [&](int64_t off) { return off < 0 ? nullptr : base + off; };
  auto f32 = [&](int64_t off) { return reinterpret_cast<float*>(ptr(off)); };
  const cudaStream_t stream = TensorApi<T>::stream(q);
  void* prep[PrepPlan::kOutputs];
  for (int i = 0; i < PrepPlan::kOutputs; ++i) prep[i] = ptr(at.prep[i]);
  // the rule's counters (its workspace's end), sel_k and sel_v: zeroed by the preprocessing's
  // means launch, not by a memset of the rule's own
  uint32_t* zero = nullptr;
  int64_t zero_words = 0;
  if (qk_mode > 0) {
    qk_rule_bind_workspace(r, f32(at.rule_ws));
    r.zeroed = true;
    zero = reinterpret_cast<uint32_t*>(r.counter);
    zero_words = (ptr(at.sel_v) + p.Gk - reinterpret_cast<uint8_t*>(zero) + 3) / 4;  // within the piece's padding
  }
  prep_launch<T>(p, q.data_ptr(), k.data_ptr(), v.data_ptr(), prep, rotate, search, stream, zero, zero_words);
  float* exps = balance ? f32(at.prep[10]) : nullptr;
  Fp4AttnArgs a = attn_fill({prep[0], prep[1], prep[2], prep[3], prep[4], prep[5], static_cast<int8_t*>(prep[12]),
                             f32(at.prep[6]), per_block_mean ? f32(at.prep[8]) : f32(at.prep[6]), f32(at.prep[9]),
                             per_block_mean ? prep[11] : nullptr, f32(at.work), rows * row, out.data_ptr()},
                            p.B, p.Hq, p.Hk, D, p.Sq, p.Sk, p.Sqp, p.Skp, p.nm, sm_scale, causal, p.dt);
  // V's MXFP8 for FP8 P.V (quant_mxfp8_cols; with pv_mode 1 only the kv heads sel_v marks)
  const Mxfp8ColsArgs v8{v.data_ptr(), p.Gk, p.Sk, D, p.Skp, ptr(at.v8), ptr(at.v8_sf),
                         pv_mode == 1 ? ptr(at.sel_v) : nullptr};
  if (qk_mode > 0) {
    r.q_packed = ptr(at.prep[0]);
    r.q_scales = ptr(at.prep[1]);
    r.k_packed = ptr(at.prep[2]);
    r.k_scales = ptr(at.prep[3]);
    r.v_packed = ptr(at.prep[4]);
    r.v_scales = ptr(at.prep[5]);
    r.v_exp = static_cast<const int8_t*>(prep[12]);
    r.mean_q = f32(at.prep[6]);
    r.mean_k = f32(at.prep[7]);
    r.balance = exps;
    // bit 2: the raw 16-bit rows (q and k as they are), where Q and K each hold a 128-row TMA box
    // (reference.raw16_fits)
    const bool raw = D == 128 && qk16_limit >= 0.0 && p.Gq * p.Sq >= 128 && p.Gk * p.Sk >= 128;
    rule_select(r, f32(at.error), ptr(at.sel_q), ptr(at.sel_k), f32(at.error_pv), ptr(at.sel_v), limit, qk_mode == 2,
                pv_mode == 1 ? pv_limit : -1.0, causal, raw ? qk16_limit : -1.0);
    check_cuda_kernel<T>(sageattn3::qk_rule_error(r, stream), "attention_call (the rule)");
    // mxfp8_smooth_quant_qk: rows rotated as the preprocessing's, or here with Q's times 64/D
    const int64_t rot = rotate ? 1 : 2;
    const Mxfp8Args aq = mxfp8_fill(q.data_ptr(), p.dt, p.Gq, p.Sq, p.Sqp, D, f32(at.prep[6]), p.nm, exps, -1,
                                    exps ? p.Hq / p.Hk : 1, ptr(at.sel_q), ptr(at.q8), sf8 ? ptr(at.q8_sf) : nullptr,
                                    sf8 == 0, rot, rot == 2 ? 64.0 / D : 1.0);
    const Mxfp8Args ak = mxfp8_fill(k.data_ptr(), p.dt, p.Gk, p.Sk, p.Skp, D, f32(at.prep[7]), 1, exps, 1, 1,
                                    ptr(at.sel_k), ptr(at.k8), sf8 ? ptr(at.k8_sf) : nullptr, sf8 == 0, rot, 1.0);
    // Q's and K's rows, and V's MXFP8 where P.V may run in FP8, in one launch
    check_cuda_kernel<T>(smooth_quant_mxfp8_pair(aq, ak, stream, pv_mode > 0 ? &v8 : nullptr),
                         "attention_call (the FP8 operands)");
    qk8_fill(a, ptr(at.sel_q), ptr(at.q8), ptr(at.q8_sf), ptr(at.k8), ptr(at.k8_sf));
    if (raw) {  // their softmax scale in unrotated units (sm_scale is divided by D/64 with the rotation)
      a.q_raw = q.data_ptr();
      a.k_raw = k.data_ptr();
      a.raw_f16 = p.dt == DType::kFloat16;
      a.raw_sm_scale = static_cast<float>(rotate ? sm_scale * (D / 64.0) : sm_scale);
    }
  }
  if (pv_mode > 0) {
    if (qk_mode == 0)
      check_cuda_kernel<T>(sageattn3::quant_mxfp8_cols(v8.x, p.dt, v8.G, v8.S, v8.D, v8.Sp, v8.codes, v8.scales, v8.sel,
                                                       stream),
                           "attention_call (V's MXFP8)");
    pv8_fill(a, ptr(at.v8), ptr(at.v8_sf), pv_mode == 1);
  }
  check_cuda_kernel<T>(fp4_attn_fwd(a, stream), "attention_call (the attention)");
  return out;
}

}  // namespace sageattn3::torch_ops
