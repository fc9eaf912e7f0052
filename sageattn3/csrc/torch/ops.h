// The ops sageattn3 registers with torch, written once for both torch-facing units:
//   stable.cpp   LibTorch stable ABI (torch >= the stable-ABI floor, one wheel for all of them)
//   classic.cpp  the classic dispatcher API (TORCH_LIBRARY / at::Tensor), one wheel per torch line
// A build compiles exactly one of them (build_profile.py chooses it from the target).
//
// Each op is a template over the unit's tensor type T; the unit supplies TensorApi<T> (dtype,
// device name, current stream, throwing an error, allocating: torch/checks.h). The ops, by family:
//   torch/ops_quant.h       NVFP4 along rows / along the sequence, the MXFP8 operands (Q, K; V)
//   torch/ops_preprocess.h  smoothing + NVFP4 of Q and K, the channel balance, preprocess_qkv, delta_s
//   torch/ops_attn.h        the FP4 attention (its per-head FP8 Q.K^T and its FP8 P.V variants)
//   torch/ops_rule.h        the "auto" Q.K^T precision rule's estimate
//   torch/ops_call.h        the whole eager call (preprocessing, the rule, the FP8 operands, attention)
//   torch/ops_probe.h       one block-scaled FP4 MMA, for checking layouts
// Here: the op table (names and schemas) that both units register, and the module init.
//
// Ops write into outputs the Python side allocated and validated (shapes, dtypes, devices are
// checked there with messages naming the argument), except preprocess_qkv, qk_rule_select,
// mxfp8_smooth_quant_qk (one allocation per output, torch/outputs.h) and attention_call (its output
// and one allocation for everything it computes on the way, torch/ops_call.h), which allocate their
// own; the ops re-check the invariants the kernels rely on (torch/checks.h), so a direct torch.ops
// call can never reach a kernel with bad memory.
#pragma once

#include <Python.h>

#include "torch/checks.h"
#include "torch/ops_attn.h"
#include "torch/ops_call.h"
#include "torch/ops_preprocess.h"
#include "torch/ops_probe.h"
#include "torch/ops_quant.h"
#include "torch/ops_rule.h"

// The op table: X(name, schema) for every op; both units register exactly these.
#define SAGEATTN3_OPS(X)                                                                                            \
  X(quant_fp4_rows, "quant_fp4_rows(Tensor x, Tensor(a!) packed, Tensor(b!) scales) -> ()")                         \
  X(quant_fp4_cols, "quant_fp4_cols(Tensor x, Tensor(a!) packed, Tensor(b!) scales, Tensor(c!) exps) -> ()")       \
  X(quant_mxfp8_cols, "quant_mxfp8_cols(Tensor x, Tensor sel, Tensor(a!) codes, Tensor(b!) scales) -> ()")         \
  X(smooth_quant_rows, "smooth_quant_rows(Tensor x, Tensor(a!) mean, bool compute_mean, int mean_block, "           \
                       "Tensor(b!) packed, Tensor(c!) scales, bool rotate, bool search) -> ()")                                  \
  X(smooth_quant_seq, "smooth_quant_seq(Tensor x, Tensor(a!) mean, Tensor(b!) partial, Tensor(c!) packed, "         \
                      "Tensor(d!) scales, bool rotate, bool search, Tensor qbar, Tensor(e!) ds_key) -> ()")                                                                   \
  X(smooth_quant_qk, "smooth_quant_qk(Tensor q, Tensor k, Tensor(a!) mean_q, Tensor(b!) q_packed, "                 \
                     "Tensor(c!) q_scales, Tensor(d!) mean_k, Tensor(e!) k_packed, Tensor(f!) k_scales, "           \
                     "Tensor(g!) partial_k, bool rotate, bool search, Tensor(h!) partial_q, Tensor(i!) qbar, "     \
                     "Tensor(j!) ds_key, Tensor(k!) balance, Tensor(l!) balance_part, Tensor(m!) k_res) -> ()")      \
  X(qk_balance, "qk_balance(Tensor q, Tensor k, Tensor(a!) part, Tensor(b!) exps) -> ()")                           \
  X(preprocess_qkv, "preprocess_qkv(Tensor q, Tensor k, Tensor v, int pad, bool per_block_mean, bool rotate, "      \
                    "bool balance, bool search) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, "      \
                    "Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)")                                              \
  X(delta_s, "delta_s(Tensor k, Tensor mean_k, Tensor mean_q, Tensor(a!) out) -> ()")                               \
  X(smooth_quant_k_delta, "smooth_quant_k_delta(Tensor k, Tensor mean_k, Tensor mean_q, Tensor(a!) packed, "        \
                          "Tensor(b!) scales, Tensor(c!) delta) -> ()")                                             \
  X(blockscaled_fp4_attn, "blockscaled_fp4_attn(Tensor q, Tensor q_sf, Tensor k, Tensor k_sf, Tensor v, "           \
                          "Tensor v_sf, Tensor v_exp, Tensor mean_q, Tensor qbar, Tensor ds_key, Tensor k_res, Tensor(b!) ds_work, " \
                          "Tensor(a!) out, "                                                                        \
                          "int seq_q, "                                                                             \
                          "int seq_k, float sm_scale, "                                                             \
                          "bool causal) -> ()")                                                                     \
  X(blockscaled_attn_qk8, "blockscaled_attn_qk8(Tensor q, Tensor q_sf, Tensor k, Tensor k_sf, Tensor v, "           \
                          "Tensor v_sf, Tensor v_exp, Tensor mean_q, Tensor qbar, Tensor ds_key, Tensor k_res, Tensor(b!) ds_work, " \
                          "Tensor(a!) out, Tensor head_sel, Tensor q8, Tensor q8_sf, Tensor k8, Tensor k8_sf, "     \
                          "Tensor q_raw, Tensor k_raw, float raw_scale, "                                           \
                          "int seq_q, int seq_k, float sm_scale, bool causal) -> ()")                               \
  X(blockscaled_attn_pv8, "blockscaled_attn_pv8(Tensor q, Tensor q_sf, Tensor k, Tensor k_sf, Tensor v, "           \
                          "Tensor v_sf, Tensor v_exp, Tensor mean_q, Tensor qbar, Tensor ds_key, Tensor k_res, Tensor(b!) ds_work, " \
                          "Tensor(a!) out, Tensor head_sel, Tensor q8, Tensor q8_sf, Tensor k8, Tensor k8_sf, "     \
                          "Tensor v8, Tensor v8_sf, Tensor q_raw, Tensor k_raw, float raw_scale, "                  \
                          "int seq_q, int seq_k, float sm_scale, bool causal) -> ()")                               \
  X(blockscaled_attn_mixed, "blockscaled_attn_mixed(Tensor q, Tensor q_sf, Tensor k, Tensor k_sf, Tensor v, "       \
                            "Tensor v_sf, Tensor v_exp, Tensor mean_q, Tensor qbar, Tensor ds_key, Tensor k_res, "  \
                            "Tensor(b!) ds_work, Tensor(a!) out, Tensor head_sel, Tensor q8, Tensor q8_sf, "        \
                            "Tensor k8, Tensor k8_sf, Tensor v8, Tensor v8_sf, Tensor q_raw, Tensor k_raw, "        \
                            "float raw_scale, int seq_q, int seq_k, float sm_scale, bool causal) -> ()")            \
  X(mxfp8_smooth_quant, "mxfp8_smooth_quant(Tensor x, Tensor mean, Tensor balance, int balance_sign, Tensor sel, "  \
                        "Tensor(a!) codes, Tensor(b!) scales, int rotate, float row_scale) -> ()")               \
  X(mxfp8_smooth_quant_qk, "mxfp8_smooth_quant_qk(Tensor q, Tensor k, Tensor mean_q, Tensor mean_k, "              \
                           "Tensor balance, Tensor sel_q, Tensor sel_k, int seq_pad, int rotate) -> (Tensor, "  \
                           "Tensor, Tensor, Tensor)")                                                            \
  X(qk_rule_select, "qk_rule_select(Tensor q, Tensor k, Tensor v, Tensor q_packed, Tensor q_scales, "               \
                    "Tensor k_packed, Tensor k_scales, Tensor v_packed, Tensor v_scales, Tensor v_exp, "            \
                    "Tensor mean_q, Tensor mean_k, Tensor balance, "                                               \
                    "float sm_scale, bool rotate, bool floor, float limit, bool select_all, float pv_limit, "   \
                    "bool causal, float qk16_limit) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)")         \
  X(attention_call, "attention_call(Tensor q, Tensor k, Tensor v, bool causal, bool per_block_mean, bool rotate, " \
                    "bool balance, bool search, int qk_mode, int pv_mode, float sm_scale, float rule_scale, "      \
                    "bool rule_floor, float limit, float pv_limit, float qk16_limit, int ws_limit) -> Tensor")     \
  X(fp4_mma_probe, "fp4_mma_probe(Tensor a, Tensor b, Tensor sfa, Tensor sfb, Tensor c, Tensor(a!) d, int tid_a, " \
                   "int tid_b) -> ()")

namespace sageattn3::torch_ops {

// The unit's TORCH_LIBRARY block calls define_ops(m), its TORCH_LIBRARY_IMPL(.., CUDA, m) block
// implement_ops<Tensor>(m): the same table, whichever API registers it.
template <class Library>
void define_ops(Library& m) {
#define SAGEATTN3_DEF(name, schema) m.def(schema);
  SAGEATTN3_OPS(SAGEATTN3_DEF)
#undef SAGEATTN3_DEF
}

template <class T, class Library>
void implement_ops(Library& m) {
#define SAGEATTN3_IMPL(name, schema) m.impl(#name, TensorApi<T>::template kernel<&name<T>>());
  SAGEATTN3_OPS(SAGEATTN3_IMPL)
#undef SAGEATTN3_IMPL
}

}  // namespace sageattn3::torch_ops

// `import sageattn3._C` only needs the module to exist: loading the library runs the unit's
// static op registrations. (Defined here, in the one torch-facing unit a build compiles.)
static struct PyModuleDef sageattn3_module = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
PyMODINIT_FUNC PyInit__C(void) { return PyModule_Create(&sageattn3_module); }
