// The ops sageattn3 registers with torch, written once for both torch-facing units:
//   stable.cpp   LibTorch stable ABI (torch >= the stable-ABI floor, one wheel for all of them)
//   classic.cpp  the classic dispatcher API (TORCH_LIBRARY / at::Tensor), one wheel per torch line
// A build compiles exactly one of them (build_profile.py chooses it from the target).
//
// Here: the op table (names and schemas), the input checks with their messages, and the calls
// into the torch-free launch API (sageattn3.h). Each op is a template over the unit's tensor
// type T; the unit supplies TensorApi<T> (dtype, current stream, throwing an error, allocating).
//
// Ops write into outputs the Python side allocated and validated (shapes, dtypes, devices are
// checked there with messages naming the argument), except preprocess_qkv, which allocates
// and returns its own; here we re-check the invariants the kernels rely on, so a direct
// torch.ops call can never reach a kernel with bad memory.
#pragma once

#include <Python.h>

#include <cstdint>
#include <initializer_list>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>

#include "attn/attn_api.h"
#include "sageattn3.h"

namespace sageattn3::torch_ops {

// The dtypes the checks distinguish; each unit maps its torch's ScalarType onto these.
enum class Kind { kHalf, kBFloat16, kFloat, kByte, kFloat8e4m3fn, kInt, kOther };

// Specialised by each unit for its tensor type:
//   static Kind kind(const T&);
//   static cudaStream_t stream(const T&);           // torch's current stream on t's device
//   [[noreturn]] static void fail(const std::string&);  // throw torch's error with the message
//   static T empty({sizes}, Kind, const T& like);  // new contiguous tensor on like's CUDA device
//   template <auto F> static auto kernel();         // what the unit's m.impl takes for op F
template <class T>
struct TensorApi;

// Error messages are built from strings and integers by appending, without iostreams: built
// with a std::ostringstream, a message holding an integer crashed the process in the stable-ABI
// build on the H100 host (torch 2.11) instead of raising (strings-only messages raised); with
// std::to_string the same calls raise. The cause was not pinned down further.
inline std::string message_piece(const char* s) { return s; }
inline std::string message_piece(const std::string& s) { return s; }
template <class I, std::enable_if_t<std::is_integral_v<I>, int> = 0>
std::string message_piece(I v) {
  return std::to_string(v);
}

template <class... Parts>
std::string message(const Parts&... parts) {
  std::string out;
  ((out += message_piece(parts)), ...);
  return out;
}

#define SA3_CHECK(T, cond, ...)                                                  \
  do {                                                                           \
    if (!(cond)) ::sageattn3::torch_ops::TensorApi<T>::fail(                     \
        ::sageattn3::torch_ops::message(__VA_ARGS__));                           \
  } while (0)

template <class T>
DType dtype_of(const T& t, const char* name) {
  switch (TensorApi<T>::kind(t)) {
    case Kind::kHalf: return DType::kFloat16;
    case Kind::kBFloat16: return DType::kBFloat16;
    case Kind::kFloat: return DType::kFloat32;
    default: SA3_CHECK(T, false, "sageattn3: ", name, " must be float16, bfloat16 or float32");
  }
  return DType::kFloat32;
}

template <class T>
void check_cuda_kernel(int err, const char* what) {
  SA3_CHECK(T, err == 0, "sageattn3: ", what, " failed: ", cudaGetErrorString(static_cast<cudaError_t>(err)));
}

// Runs the launch on the tensors' device (custom ops get no device guard from the dispatcher).
class DeviceScope {
 public:
  explicit DeviceScope(int device) {
    cudaGetDevice(&prev_);
    if (prev_ != device) cudaSetDevice(device);
  }
  ~DeviceScope() {
    int cur = -1;
    cudaGetDevice(&cur);
    if (cur != prev_) cudaSetDevice(prev_);
  }
  DeviceScope(const DeviceScope&) = delete;
  DeviceScope& operator=(const DeviceScope&) = delete;

 private:
  int prev_ = 0;
};

template <class T>
void check_cuda(const T& t, const T& ref, const char* name) {
  SA3_CHECK(T, t.is_cuda(), "sageattn3: ", name, " must be a CUDA tensor");
  SA3_CHECK(T, t.get_device() == ref.get_device(), "sageattn3: ", name, " is on another device");
  SA3_CHECK(T, t.is_contiguous(), "sageattn3: ", name, " must be contiguous");
}

// The kernels use 16-byte vector loads and stores.
template <class T>
void check_aligned(const T& t, const char* name) {
  SA3_CHECK(T, reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0, "sageattn3: ", name,
            " must be 16-byte aligned (pass a fresh tensor or .clone())");
}

template <class T>
void check_bytes(const T& t, const char* name) {
  const Kind k = TensorApi<T>::kind(t);
  SA3_CHECK(T, k == Kind::kByte || k == Kind::kFloat8e4m3fn, "sageattn3: ", name, " must be uint8 or float8_e4m3fn");
}

template <class T>
void check_f32(const T& t, const char* name) {
  SA3_CHECK(T, TensorApi<T>::kind(t) == Kind::kFloat, "sageattn3: ", name, " must be float32");
}

template <class T>
void check_i32(const T& t, const char* name) {
  SA3_CHECK(T, TensorApi<T>::kind(t) == Kind::kInt, "sageattn3: ", name, " must be int32");
}

// An fp32 workspace/output of an op, on ref's device.
template <class T>
void check_f32_on(const T& t, const T& ref, const char* name) {
  check_cuda(t, ref, name);
  check_f32(t, name);
}

// x: the CUDA input of a quant/smoothing op (the reference device of the other tensors).
template <class T>
void check_input(const T& x) {
  check_cuda(x, x, "x");
  check_aligned(x, "x");
}

// packed/scales: the NVFP4 outputs of a quant/smoothing op, on x's device.
template <class T>
void check_code_tensor(const T& t, const T& x, const char* name) {
  check_cuda(t, x, name);
  check_bytes(t, name);
  check_aligned(t, name);
}

template <class T>
void check_codes(const T& packed, const T& scales, const T& x) {
  check_code_tensor(packed, x, "packed");
  check_code_tensor(scales, x, "scales");
}

template <class T>
uint8_t* bytes(const T& t) { return static_cast<uint8_t*>(t.data_ptr()); }
template <class T>
float* floats(const T& t) { return static_cast<float*>(t.data_ptr()); }
template <class T>
int* ints(const T& t) { return static_cast<int*>(t.data_ptr()); }
template <class T>
int device_index(const T& t) { return static_cast<int>(t.get_device()); }

// quant_fp4_rows(x, packed!, scales!): x (..., D) contiguous, D % 16 == 0.
template <class T>
void quant_fp4_rows(T x, T packed, T scales) {
  check_input(x);
  check_codes(packed, scales, x);
  const int64_t cols = x.dim() ? x.size(x.dim() - 1) : 0;
  SA3_CHECK(T, x.dim() >= 1 && cols > 0 && cols % 16 == 0, "sageattn3: last dim must be a positive multiple of 16");
  const int64_t n = x.numel();
  SA3_CHECK(T, packed.numel() == n / 2 && scales.numel() == n / 16, "sageattn3: output sizes do not match x");
  DeviceScope scope(device_index(x));
  check_cuda_kernel<T>(sageattn3::quant_fp4_rows(x.data_ptr(), dtype_of(x, "x"), n, cols, bytes(packed),
                                                 bytes(scales), TensorApi<T>::stream(x)),
                       "quant_fp4_rows");
}

// quant_fp4_cols(x, packed!, scales!): x (..., S, D) -> packed (..., D, Sp/2), scales (..., D, Sp/16).
template <class T>
void quant_fp4_cols(T x, T packed, T scales) {
  check_input(x);
  check_codes(packed, scales, x);
  SA3_CHECK(T, x.dim() >= 2 && packed.dim() >= 2, "sageattn3: x must have at least 2 dims");
  const int64_t S = x.size(x.dim() - 2), D = x.size(x.dim() - 1);
  SA3_CHECK(T, D > 0 && D % 16 == 0, "sageattn3: last dim must be a positive multiple of 16");
  const int64_t G = S * D ? x.numel() / (S * D) : 0;
  const int64_t Sp = packed.size(packed.dim() - 1) * 2;
  SA3_CHECK(T, Sp % 16 == 0 && Sp >= S, "sageattn3: packed's last dim must be S padded to a multiple of 16, halved");
  SA3_CHECK(T, packed.numel() == G * D * Sp / 2 && scales.numel() == G * D * Sp / 16,
            "sageattn3: output sizes do not match x");
  DeviceScope scope(device_index(x));
  check_cuda_kernel<T>(sageattn3::quant_fp4_cols(x.data_ptr(), dtype_of(x, "x"), G, S, D, Sp, bytes(packed),
                                                 bytes(scales), TensorApi<T>::stream(x)),
                       "quant_fp4_cols");
}

// smooth_quant_rows(x, mean!, compute_mean, mean_block, packed!, scales!, rotate, search): x (G, S, D);
// mean (G, nm, D) fp32; packed (G, Sp, D/2); scales (G, Sp, D/16).
template <class T>
void smooth_quant_rows(T x, T mean, bool compute_mean, int64_t mean_block, T packed, T scales, bool rotate,
                       bool search) {
  check_input(x);
  check_f32_on(mean, x, "mean");
  check_codes(packed, scales, x);
  SA3_CHECK(T, x.dim() == 3 && packed.dim() == 3, "sageattn3: x and packed must be 3-D (G, S, D)");
  const int64_t G = x.size(0), S = x.size(1), D = x.size(2), Sp = packed.size(1);
  SA3_CHECK(T, D % 16 == 0 && D <= 256, "sageattn3: D must be a multiple of 16, at most 256");
  SA3_CHECK(T, mean_block == 0 || mean_block == 128, "sageattn3: mean_block must be 0 or 128");
  SA3_CHECK(T, !compute_mean || mean_block == 128, "sageattn3: compute_mean needs mean_block 128");
  const int64_t nm = mean_block ? (S + 127) / 128 : 1;
  SA3_CHECK(T, mean.numel() == G * nm * D, "sageattn3: mean has the wrong size");
  SA3_CHECK(T, Sp >= S && packed.numel() == G * Sp * D / 2 && scales.numel() == G * Sp * D / 16,
            "sageattn3: output sizes do not match x");
  SA3_CHECK(T, !rotate || D == 64 || D == 128, "sageattn3: rotate needs D 64 or 128");
  SA3_CHECK(T, !search || D == 64 || D == 128, "sageattn3: the scale search needs D 64 or 128");
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
  SA3_CHECK(T, x.dim() == 3 && packed.dim() == 3, "sageattn3: x and packed must be 3-D (G, S, D)");
  const int64_t G = x.size(0), S = x.size(1), D = x.size(2), Sp = packed.size(1);
  SA3_CHECK(T, S >= 1 && D % 16 == 0 && D > 0 && D <= 256,
            "sageattn3: S must be >= 1 and D a positive multiple of 16, at most 256");
  SA3_CHECK(T, mean.numel() == G * D && partial.numel() == G * ((S + 127) / 128) * D,
            "sageattn3: mean or partial has the wrong size");
  SA3_CHECK(T, Sp >= S && packed.numel() == G * Sp * D / 2 && scales.numel() == G * Sp * D / 16,
            "sageattn3: output sizes do not match x");
  SA3_CHECK(T, !rotate || D == 64 || D == 128, "sageattn3: rotate needs D 64 or 128");
  SA3_CHECK(T, !search || D == 64 || D == 128, "sageattn3: the scale search needs D 64 or 128");
  const bool correction = qbar.numel() > 0 || ds_key.numel() > 0;
  int64_t rep = 1;
  if (correction) {
    check_f32_on(qbar, x, "qbar");
    check_f32_on(ds_key, x, "ds_key");
    SA3_CHECK(T, D == 64 || D == 128, "sageattn3: the per-key correction needs D 64 or 128");
    rep = G ? qbar.numel() / (G * D) : 1;
    SA3_CHECK(T, rep >= 1 && qbar.numel() == G * rep * D && ds_key.numel() == G * rep * Sp,
              "sageattn3: qbar must be (G*rep, D) and ds_key (G*rep, Sp)");
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
// channel balance (D 64/128); k_res (Gk, Skp, D) bytes, K's quantization residual (needs the
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
            "sageattn3: q, k, q_packed and k_packed must be 3-D (G, S, D)");
  const auto dt = dtype_of(q, "q");
  SA3_CHECK(T, dtype_of(k, "k") == dt, "sageattn3: q and k must have the same dtype");
  const int64_t Gq = q.size(0), Sq = q.size(1), D = q.size(2), Gk = k.size(0), Sk = k.size(1);
  const int64_t Sqp = q_packed.size(1), Skp = k_packed.size(1);
  SA3_CHECK(T, k.size(2) == D, "sageattn3: q and k must have the same head dim");
  SA3_CHECK(T, D % 16 == 0 && D > 0 && D <= 256, "sageattn3: D must be a positive multiple of 16, at most 256");
  SA3_CHECK(T, Sk >= 1 && Gk >= 1, "sageattn3: k must not be empty");
  SA3_CHECK(T, mean_q.numel() == Gq * ((Sq + 127) / 128) * D, "sageattn3: mean_q has the wrong size");
  SA3_CHECK(T, Gq % Gk == 0 && (Gq == 0 || Sq >= 1), "sageattn3: q groups must be a multiple of k groups, q not empty");
  SA3_CHECK(T, !rotate || D == 64 || D == 128, "sageattn3: rotate needs D 64 or 128");
  SA3_CHECK(T, !search || D == 64 || D == 128, "sageattn3: the scale search needs D 64 or 128");
  const bool correction = partial_q.numel() > 0 || qbar.numel() > 0 || ds_key.numel() > 0;
  if (correction) {
    check_f32_on(partial_q, q, "partial_q");
    check_f32_on(qbar, q, "qbar");
    check_f32_on(ds_key, q, "ds_key");
    SA3_CHECK(T, Gq > 0 && (D == 64 || D == 128), "sageattn3: the per-key correction needs q and D 64 or 128");
    SA3_CHECK(T, partial_q.numel() == Gq * ((Sq + 127) / 128) * D && qbar.numel() == Gq * D &&
                     ds_key.numel() == Gq * Skp,
              "sageattn3: partial_q, qbar or ds_key has the wrong size");
  }
  const bool balanced = balance.numel() > 0 || balance_part.numel() > 0;
  if (balanced) {
    check_f32_on(balance, q, "balance");
    check_f32_on(balance_part, q, "balance_part");
    SA3_CHECK(T, Gq > 0 && (D == 64 || D == 128), "sageattn3: the channel balance needs q and D 64 or 128");
    const int64_t ns = sageattn3::sampled_tiles(Sq) * Gq + sageattn3::sampled_tiles(Sk) * Gk;
    SA3_CHECK(T, balance.numel() == Gk * D && balance_part.numel() == ns * D,
              "sageattn3: balance or balance_part has the wrong size");
  }
  SA3_CHECK(T, mean_k.numel() == Gk * D && partial_k.numel() == Gk * ((Sk + 127) / 128) * D,
            "sageattn3: mean_k or partial_k has the wrong size");
  SA3_CHECK(T, Sqp >= Sq && q_packed.numel() == Gq * Sqp * D / 2 && q_scales.numel() == Gq * Sqp * D / 16,
            "sageattn3: q_packed/q_scales sizes do not match q");
  SA3_CHECK(T, Skp >= Sk && k_packed.numel() == Gk * Skp * D / 2 && k_scales.numel() == Gk * Skp * D / 16,
            "sageattn3: k_packed/k_scales sizes do not match k");
  const bool residual = k_res.numel() > 0;
  if (residual) {
    check_code_tensor(k_res, q, "k_res");
    SA3_CHECK(T, correction && k_res.numel() == Gk * Skp * D,
              "sageattn3: k_res must be (Gk, Skp, D) bytes, with the per-key correction");
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
                                                  residual ? bytes(k_res) : nullptr, TensorApi<T>::stream(q)),
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
            "sageattn3: q must be (Gq, Sq, D), k (Gk, Sk, D) and exps (Gk, D)");
  const auto dt = dtype_of(q, "q");
  SA3_CHECK(T, dtype_of(k, "k") == dt, "sageattn3: q and k must have the same dtype");
  const int64_t Gq = q.size(0), Sq = q.size(1), D = q.size(2), Gk = k.size(0), Sk = k.size(1);
  SA3_CHECK(T, (D == 64 || D == 128) && Sq >= 1 && Sk >= 1 && k.size(2) == D,
            "sageattn3: the channel balance needs D 64 or 128 (the same for q and k) and Sq, Sk >= 1");
  SA3_CHECK(T, Gk >= 1 && Gq >= 1 && Gq % Gk == 0 && exps.size(0) == Gk && exps.size(1) == D,
            "sageattn3: exps must be (Gk, D) with Gq a positive multiple of Gk");
  SA3_CHECK(T, part.numel() == (Gq * sageattn3::sampled_tiles(Sq) + Gk * sageattn3::sampled_tiles(Sk)) * D,
            "sageattn3: part has the wrong size");
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
// quantization residual k_res (B, Hkv, Skp, D) E4M3 (empty without per_block_mean: no block
// residuals then).
// Launch order: V first (its allocation and launch come before anything else here, so the rest of
// the host work overlaps it), then the launches of smooth_quant_qk (or of smooth_quant_seq for Q,
// then for K with the correction).
template <class T>
std::tuple<T, T, T, T, T, T, T, T, T, T, T, T> preprocess_qkv(T q, T k, T v, int64_t pad, bool per_block_mean,
                                                           bool rotate, bool balance, bool search) {
  for (const auto& [t, name] : {std::pair<const T*, const char*>{&q, "q"}, {&k, "k"}, {&v, "v"}}) {
    check_cuda(*t, q, name);
    check_aligned(*t, name);
  }
  SA3_CHECK(T, q.dim() == 4 && k.dim() == 4 && v.dim() == 4, "sageattn3: q, k and v must be 4-D (B, H, S, D)");
  const auto dt = dtype_of(q, "q");
  SA3_CHECK(T, dtype_of(k, "k") == dt && dtype_of(v, "v") == dt, "sageattn3: q, k and v must have the same dtype");
  const int64_t B = q.size(0), Hq = q.size(1), Sq = q.size(2), D = q.size(3), Hk = k.size(1), Sk = k.size(2);
  SA3_CHECK(T, k.size(0) == B && v.size(0) == B && v.size(1) == Hk && v.size(2) == Sk && k.size(3) == D &&
                   v.size(3) == D,
            "sageattn3: k and v must be (B, Hkv, Sk, D) with q's B and D");
  SA3_CHECK(T, D == 64 || D == 128, "sageattn3: preprocess_qkv needs head dim 64 or 128, got ", D);
  SA3_CHECK(T, B >= 1 && Hk >= 1 && Sq >= 1 && Sk >= 1, "sageattn3: q, k and v must not be empty");
  SA3_CHECK(T, Hq % Hk == 0 && Hq / Hk >= 1 && Hq / Hk <= sageattn3::max_correction_heads(D),
            "sageattn3: q heads must be a multiple of kv heads, at most ", sageattn3::max_correction_heads(D),
            " per kv head at head dim ", D);
  SA3_CHECK(T, pad > 0 && pad % 16 == 0 && pad <= (int64_t{1} << 20),
            "sageattn3: pad must be a positive multiple of 16 (at most 2^20), got ", pad);
  SA3_CHECK(T, per_block_mean || !balance, "sageattn3: the channel balance needs per_block_mean");
  const int64_t Sqp = (Sq + pad - 1) / pad * pad, Skp = (Sk + pad - 1) / pad * pad;
  const int64_t Gq = B * Hq, Gk = B * Hk, nm = per_block_mean ? (Sq + 127) / 128 : 1;
  const int64_t nsq = sageattn3::sampled_tiles(Sq), nsk = sageattn3::sampled_tiles(Sk);
  using A = TensorApi<T>;
  DeviceScope scope(device_index(q));
  const cudaStream_t stream = A::stream(q);
  T vp = A::empty({B, Hk, D, Skp / 2}, Kind::kByte, q), vsc = A::empty({B, Hk, D, Skp / 16}, Kind::kFloat8e4m3fn, q);
  check_cuda_kernel<T>(sageattn3::quant_fp4_cols(v.data_ptr(), dt, Gk, Sk, D, Skp, bytes(vp), bytes(vsc), stream),
                       "preprocess_qkv (V)");
  T qp = A::empty({B, Hq, Sqp, D / 2}, Kind::kByte, q), qsc = A::empty({B, Hq, Sqp, D / 16}, Kind::kFloat8e4m3fn, q);
  T kp = A::empty({B, Hk, Skp, D / 2}, Kind::kByte, q), ksc = A::empty({B, Hk, Skp, D / 16}, Kind::kFloat8e4m3fn, q);
  T mean_q = A::empty({B, Hq, nm, D}, Kind::kFloat, q), mean_k = A::empty({B, Hk, 1, D}, Kind::kFloat, q);
  T qbar = A::empty({per_block_mean ? B : 0, Hq, 1, D}, Kind::kFloat, q);
  T ds_key = A::empty({B, Hq, Skp}, Kind::kFloat, q);
  T exps = A::empty({balance ? B : 0, Hk, 1, D}, Kind::kFloat, q);
  T k_res = A::empty({per_block_mean ? B : 0, Hk, Skp, D}, Kind::kFloat8e4m3fn, q);
  // workspace: the sampled tiles' sums of K, then of Q, then (balance) their squares, Q's then K's
  const int64_t ws_rows = Gk * nsk + Gq * nsq + (balance ? Gq * nsq + Gk * nsk : 0);
  T ws = A::empty({ws_rows, D}, Kind::kFloat, q);
  float* part_k = floats(ws);
  float* part_q = part_k + Gk * nsk * D;
  float* bal_part = balance ? part_q + Gq * nsq * D : nullptr;
  if (per_block_mean) {
    check_cuda_kernel<T>(sageattn3::smooth_quant_qk(q.data_ptr(), k.data_ptr(), dt, Gq, Sq, Gk, Sk, D, floats(mean_q),
                                                    Sqp, bytes(qp), bytes(qsc), floats(mean_k), part_k, Skp, bytes(kp),
                                                    bytes(ksc), rotate, search, part_q, floats(qbar), floats(ds_key),
                                                    balance ? floats(exps) : nullptr, bal_part, bytes(k_res), stream),
                         "preprocess_qkv (Q and K)");
  } else {
    check_cuda_kernel<T>(sageattn3::smooth_quant_seq(q.data_ptr(), dt, Gq, Sq, D, floats(mean_q), part_q, Sqp,
                                                     bytes(qp), bytes(qsc), rotate, search, nullptr, 1, nullptr,
                                                     stream),
                         "preprocess_qkv (Q)");
    check_cuda_kernel<T>(sageattn3::smooth_quant_seq(k.data_ptr(), dt, Gk, Sk, D, floats(mean_k), part_k, Skp,
                                                     bytes(kp), bytes(ksc), rotate, search, floats(mean_q), Hq / Hk,
                                                     floats(ds_key), stream),
                         "preprocess_qkv (K)");
  }
  return {qp, qsc, kp, ksc, vp, vsc, mean_q, mean_k, qbar, ds_key, exps, k_res};
}

// delta_s(k, mean_k, mean_q, out!): k (B, Hkv, Sk, D); mean_k (B, Hkv, 1, D); mean_q (B, Hq, nblk, D);
// out (B, Hq, nblk, Sp) fp32.
template <class T>
void delta_s(T k, T mean_k, T mean_q, T out) {
  check_cuda(k, k, "k");
  check_f32_on(mean_k, k, "mean_k");
  check_f32_on(mean_q, k, "mean_q");
  check_f32_on(out, k, "out");
  SA3_CHECK(T, k.dim() == 4 && mean_q.dim() == 4 && out.dim() == 4, "sageattn3: delta_s takes 4-D tensors");
  const int64_t B = k.size(0), Hkv = k.size(1), Sk = k.size(2), D = k.size(3);
  const int64_t Hq = mean_q.size(1), nblk = mean_q.size(2), Sp = out.size(3);
  SA3_CHECK(T, D % 16 == 0, "sageattn3: D must be a multiple of 16");
  SA3_CHECK(T, Hkv > 0 && Hq % Hkv == 0 && mean_q.size(0) == B && mean_q.size(3) == D,
            "sageattn3: mean_q does not match k");
  SA3_CHECK(T, mean_k.numel() == B * Hkv * D, "sageattn3: mean_k does not match k");
  SA3_CHECK(T, out.size(0) == B && out.size(1) == Hq && out.size(2) == nblk && Sp % 16 == 0 && Sp >= Sk,
            "sageattn3: out has the wrong shape");
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
  SA3_CHECK(T, dt != DType::kFloat32, "sageattn3: smooth_quant_k_delta takes float16/bfloat16 k");
  SA3_CHECK(T, k.dim() == 4 && mean_q.dim() == 4 && out.dim() == 4,
            "sageattn3: smooth_quant_k_delta takes 4-D tensors");
  const int64_t B = k.size(0), Hkv = k.size(1), Sk = k.size(2), D = k.size(3);
  const int64_t Hq = mean_q.size(1), nblk = mean_q.size(2), Skp = out.size(3);
  SA3_CHECK(T, D % 16 == 0 && D > 0 && D <= 128, "sageattn3: D must be a multiple of 16, at most 128");
  SA3_CHECK(T, Sk >= 1 && nblk >= 1, "sageattn3: empty k or mean_q");
  SA3_CHECK(T, Hkv > 0 && Hq % Hkv == 0 && mean_q.size(0) == B && mean_q.size(3) == D,
            "sageattn3: mean_q does not match k");
  SA3_CHECK(T, mean_k.numel() == B * Hkv * D, "sageattn3: mean_k does not match k");
  SA3_CHECK(T, out.size(0) == B && out.size(1) == Hq && out.size(2) == nblk && Skp % 16 == 0 && Skp >= Sk,
            "sageattn3: delta has the wrong shape");
  SA3_CHECK(T, packed.numel() == B * Hkv * Skp * D / 2 && scales.numel() == B * Hkv * Skp * D / 16,
            "sageattn3: packed/scales sizes do not match k");
  SA3_CHECK(T, reinterpret_cast<uintptr_t>(k.data_ptr()) % 16 == 0, "sageattn3: k must be 16-byte aligned");
  DeviceScope scope(device_index(k));
  check_cuda_kernel<T>(sageattn3::smooth_quant_k_delta(k.data_ptr(), dt, B, Hq, Hkv, Sk, D, nblk, floats(mean_k),
                                                       floats(mean_q), Skp, bytes(packed), bytes(scales), floats(out),
                                                       TensorApi<T>::stream(k)),
                       "smooth_quant_k_delta");
}

// ---- FP4 attention (csrc/attn; owner: the attention kernel) --------------------------------
// blockscaled_fp4_attn(q, q_sf, k, k_sf, v, v_sf, mean_q, out!, seq_q, seq_k, sm_scale, causal):
// layouts in attn/attn_api.h (sequence dims padded to multiples of 128, zeros); mean_q
// (B, Hq, 1 or Sq_p/128, D), qbar (B, Hq, 1, D), ds_key (B, Hq, Sk_p) fp32, k_res (B, Hkv, Sk_p, D)
// E4M3 (K's quantization residual; needed with more than one Q mean, else may be empty): the
// kernel adds delta_s = ds_key + (mean_q - qbar) . (dequant(k) + k_res)^T itself; ds_work fp32
// (any shape, contiguous): the workspace that delta_s per query block and key is precomputed
// into (attn/attn_api.h), or empty (the bounded-memory mode).
template <class T>
Fp4AttnArgs attn_args(const T& q, const T& q_sf, const T& k, const T& k_sf, const T& v, const T& v_sf, const T& mean_q,
                      const T& qbar, const T& ds_key, const T& k_res, const T& ds_work, const T& out, int64_t seq_q,
                      int64_t seq_k, double sm_scale, bool causal) {
  check_cuda(q, q, "q");
  for (const T* t : {&q_sf, &k, &k_sf, &v, &v_sf, &mean_q, &qbar, &ds_key, &k_res, &ds_work, &out})
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
            "sageattn3: blockscaled_fp4_attn takes 4-D tensors");
  const int64_t B = q.size(0), Hq = q.size(1), Sqp = q.size(2), D = q.size(3) * 2;
  const int64_t Hkv = k.size(1), Skp = k.size(2);
  SA3_CHECK(T, D == 64 || D == 128, "sageattn3: head_dim must be 64 or 128");
  SA3_CHECK(T, Hkv > 0 && Hq % Hkv == 0, "sageattn3: q heads must be a multiple of kv heads");
  SA3_CHECK(T, Sqp % 128 == 0 && Skp % 128 == 0, "sageattn3: padded sequence lengths must be multiples of 128");
  SA3_CHECK(T, seq_q >= 1 && seq_q <= Sqp && seq_k >= 1 && seq_k <= Skp, "sageattn3: seq_q/seq_k out of range");
  auto same = [](const T& t, int64_t a, int64_t b, int64_t c, int64_t d) {
    return t.size(0) == a && t.size(1) == b && t.size(2) == c && t.size(3) == d;
  };
  SA3_CHECK(T, same(q_sf, B, Hq, Sqp, D / 16), "sageattn3: q_sf shape");
  SA3_CHECK(T, same(k, B, Hkv, Skp, D / 2) && same(k_sf, B, Hkv, Skp, D / 16), "sageattn3: k/k_sf shape");
  SA3_CHECK(T, same(v, B, Hkv, D, Skp / 2) && same(v_sf, B, Hkv, D, Skp / 16), "sageattn3: v/v_sf shape");
  const int64_t nblk = mean_q.size(2);
  SA3_CHECK(T, same(mean_q, B, Hq, nblk, D) && (nblk == 1 || nblk == Sqp / 128), "sageattn3: mean_q shape");
  SA3_CHECK(T, qbar.dim() == 4 && same(qbar, B, Hq, 1, D), "sageattn3: qbar shape");
  SA3_CHECK(T, ds_key.dim() == 3 && ds_key.size(0) == B && ds_key.size(1) == Hq && ds_key.size(2) == Skp,
            "sageattn3: ds_key shape");
  SA3_CHECK(T, same(out, B, Hq, seq_q, D), "sageattn3: out shape");
  const bool residual = k_res.numel() > 0;
  SA3_CHECK(T, residual || nblk == 1, "sageattn3: k_res (K's quantization residual) is needed with per-block Q means");
  if (residual) {
    check_code_tensor(k_res, q, "k_res");
    SA3_CHECK(T, k_res.dim() == 4 && same(k_res, B, Hkv, Skp, D), "sageattn3: k_res shape");
  }
  Fp4AttnArgs a{};
  a.q = q.data_ptr();
  a.q_sf = q_sf.data_ptr();
  a.k = k.data_ptr();
  a.k_sf = k_sf.data_ptr();
  a.v = v.data_ptr();
  a.v_sf = v_sf.data_ptr();
  a.mean_q = floats(mean_q);
  a.qbar = floats(qbar);
  a.ds_key = floats(ds_key);
  a.k_res = residual ? k_res.data_ptr() : nullptr;
  a.ds_work = ds_work.numel() > 0 ? floats(ds_work) : nullptr;
  a.ds_work_floats = ds_work.numel();
  a.out = out.data_ptr();
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
  a.out_dtype = dtype_of(out, "out");
  SA3_CHECK(T, a.out_dtype != DType::kFloat32, "sageattn3: out must be float16 or bfloat16");
  return a;
}

template <class T>
void blockscaled_fp4_attn(T q, T q_sf, T k, T k_sf, T v, T v_sf, T mean_q, T qbar, T ds_key, T k_res, T ds_work,
                          T out, int64_t seq_q, int64_t seq_k, double sm_scale, bool causal) {
  DeviceScope scope(device_index(q));
  const Fp4AttnArgs a =
      attn_args(q, q_sf, k, k_sf, v, v_sf, mean_q, qbar, ds_key, k_res, ds_work, out, seq_q, seq_k, sm_scale, causal);
  check_cuda_kernel<T>(fp4_attn_fwd(a, TensorApi<T>::stream(q)), "blockscaled_fp4_attn");
}

// blockscaled_attn_qk8(<blockscaled_fp4_attn's operands>, head_sel, q8, q8_sf, k8, k8_sf, ...): the
// per-head Q.K^T precision (attn/attn_api.h): head_sel (B, Hq) uint8 (1: FP8 Q.K^T), q8 (B, Hq,
// Sq_p, D) / k8 (B, Hkv, Sk_p, D) E4M3, q8_sf / k8_sf (..., D/32) UE8M0 bytes. ds_work must hold
// at least one (batch, q head) row with per-block Q means (no bounded-memory mode here).
template <class T>
void blockscaled_attn_qk8(T q, T q_sf, T k, T k_sf, T v, T v_sf, T mean_q, T qbar, T ds_key, T k_res, T ds_work,
                          T out, T head_sel, T q8, T q8_sf, T k8, T k8_sf, int64_t seq_q, int64_t seq_k,
                          double sm_scale, bool causal) {
  DeviceScope scope(device_index(q));
  Fp4AttnArgs a =
      attn_args(q, q_sf, k, k_sf, v, v_sf, mean_q, qbar, ds_key, k_res, ds_work, out, seq_q, seq_k, sm_scale, causal);
  const int64_t B = q.size(0), Hq = q.size(1), Sqp = q.size(2), D = q.size(3) * 2, Hkv = k.size(1), Skp = k.size(2);
  for (const T* t : {&head_sel, &q8, &q8_sf, &k8, &k8_sf}) {
    check_code_tensor(*t, q, "an FP8 Q.K^T operand");
    SA3_CHECK(T, t->dim() >= 2, "sageattn3: the FP8 Q.K^T operands are (B, H, ...) tensors");
  }
  SA3_CHECK(T, head_sel.numel() == B * Hq, "sageattn3: head_sel must be (B, Hq) = (", B, ", ", Hq, ") bytes");
  SA3_CHECK(T, q8.numel() == B * Hq * Sqp * D && q8_sf.numel() == B * Hq * Sqp * (D / 32),
            "sageattn3: q8 must be (B, Hq, Sq_p, D) = (", B, ", ", Hq, ", ", Sqp, ", ", D, "), q8_sf (..., D/32)");
  SA3_CHECK(T, k8.numel() == B * Hkv * Skp * D && k8_sf.numel() == B * Hkv * Skp * (D / 32),
            "sageattn3: k8 must be (B, Hkv, Sk_p, D) = (", B, ", ", Hkv, ", ", Skp, ", ", D, "), k8_sf (..., D/32)");
  SA3_CHECK(T, a.mean_qblocks == 1 || a.ds_work != nullptr,
            "sageattn3: the FP8 Q.K^T path needs the delta_s workspace with per-block Q means");
  a.head_sel = bytes(head_sel);
  a.q8 = q8.data_ptr();
  a.q8_sf = q8_sf.data_ptr();
  a.k8 = k8.data_ptr();
  a.k8_sf = k8_sf.data_ptr();
  check_cuda_kernel<T>(fp4_attn_fwd(a, TensorApi<T>::stream(q)), "blockscaled_attn_qk8");
}

// mxfp8_smooth_quant(x, mean, balance, balance_sign, sel, codes!, scales!): x (B, H, S, D),
// mean (B, H, 1 or ceil(S/128), D) fp32, balance (B, Hb, 1, D) fp32 exponents or empty (H a
// multiple of Hb), sel (B, H) bytes or empty; codes (B, H, Sp, D), scales (B, H, Sp, D/32) bytes
// (sageattn3.h, smooth_quant_mxfp8).
template <class T>
void mxfp8_smooth_quant(T x, T mean, T balance, int64_t balance_sign, T sel, T codes, T scales) {
  check_input(x);
  check_f32_on(mean, x, "mean");
  check_code_tensor(codes, x, "codes");
  check_code_tensor(scales, x, "scales");
  SA3_CHECK(T, x.dim() == 4 && codes.dim() == 4 && mean.dim() == 4, "sageattn3: x, mean and codes must be 4-D");
  const int64_t B = x.size(0), H = x.size(1), S = x.size(2), D = x.size(3), Sp = codes.size(2);
  SA3_CHECK(T, D % 32 == 0 && S >= 1, "sageattn3: mxfp8_smooth_quant needs D a multiple of 32 and S >= 1, got D ", D);
  SA3_CHECK(T, codes.size(0) == B && codes.size(1) == H && codes.size(3) == D && Sp >= S &&
                   scales.numel() == B * H * Sp * (D / 32),
            "sageattn3: codes must be (B, H, Sp >= S, D) and scales (B, H, Sp, D/32) for x (", B, ", ", H, ", ", S, ", ", D, ")");
  const int64_t mr = mean.size(2);
  SA3_CHECK(T, mean.size(0) == B && mean.size(1) == H && mean.size(3) == D && (mr == 1 || mr * 128 >= S),
            "sageattn3: mean must be (B, H, 1 or ceil(S/128), D)");
  int64_t rep = 1;
  if (balance.numel() > 0) {
    check_f32_on(balance, x, "balance");
    const int64_t hb = balance.numel() / (B * D);
    SA3_CHECK(T, hb >= 1 && balance.numel() == B * hb * D && H % hb == 0, "sageattn3: balance must be (B, Hb, 1, D)");
    rep = H / hb;
  }
  if (sel.numel() > 0) {
    check_cuda(sel, x, "sel");
    check_bytes(sel, "sel");
    SA3_CHECK(T, sel.numel() == B * H, "sageattn3: sel must be (B, H) bytes");
  }
  DeviceScope scope(device_index(x));
  Mxfp8Args a{};
  a.x = x.data_ptr();
  a.dtype = dtype_of(x, "x");
  a.H = B * H;
  a.S = S;
  a.Sp = Sp;
  a.D = D;
  a.mean = floats(mean);
  a.mean_rows = mr;
  a.balance = balance.numel() > 0 ? floats(balance) : nullptr;
  a.balance_sign = balance_sign < 0 ? -1 : 1;
  a.rep = rep;
  a.sel = sel.numel() > 0 ? bytes(sel) : nullptr;
  a.codes = bytes(codes);
  a.scales = bytes(scales);
  check_cuda_kernel<T>(smooth_quant_mxfp8(a, TensorApi<T>::stream(x)), "mxfp8_smooth_quant");
}

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
  SA3_CHECK(T, q.dim() == 4 && k.dim() == 4 && v.dim() == 4, "sageattn3: qk_rule_error needs 4-D q, k, v");
  const int64_t B = q.size(0), Hq = q.size(1), Sq = q.size(2), D = q.size(3), Hkv = k.size(1), Sk = k.size(2);
  const DType dt = dtype_of(q, "q");
  SA3_CHECK(T, dt != DType::kFloat32 && TensorApi<T>::kind(k) == TensorApi<T>::kind(q) &&
                   TensorApi<T>::kind(v) == TensorApi<T>::kind(q),
            "sageattn3: qk_rule_error needs q, k and v all float16 or all bfloat16");
  SA3_CHECK(T, (D == 64 || D == 128) && Sq >= 1 && Sk >= 1 && Hkv >= 1 && Hq % Hkv == 0 && k.size(0) == B &&
                   k.size(3) == D && v.size(0) == B && v.size(1) == Hkv && v.size(2) == Sk &&
                   v.size(3) == D,
            "sageattn3: qk_rule_error needs q (B, Hq, Sq >= 1, D 64/128) and k, v (B, Hkv, Sk >= 1, D), Hq a "
            "multiple of Hkv");
  for (const T* t : {&q_packed, &q_scales, &k_packed, &k_scales}) check_code_tensor(*t, q, "an FP4 operand");
  const int64_t Sqp = q_packed.numel() / (B * Hq * (D / 2)), Skp = k_packed.numel() / (B * Hkv * (D / 2));
  SA3_CHECK(T, Sqp >= Sq && q_packed.numel() == B * Hq * Sqp * (D / 2) && q_scales.numel() == B * Hq * Sqp * (D / 16),
            "sageattn3: q_packed must be (B, Hq, Sqp >= Sq, D/2) and q_scales (B, Hq, Sqp, D/16)");
  SA3_CHECK(T, Skp >= Sk && k_packed.numel() == B * Hkv * Skp * (D / 2) && k_scales.numel() == B * Hkv * Skp * (D / 16),
            "sageattn3: k_packed must be (B, Hkv, Skp >= Sk, D/2) and k_scales (B, Hkv, Skp, D/16)");
  check_f32_on(mean_q, q, "mean_q");
  check_f32_on(mean_k, q, "mean_k");
  const int64_t mr = mean_q.numel() / (B * Hq * D);
  SA3_CHECK(T, mr >= 1 && mean_q.numel() == B * Hq * mr * D && (mr == 1 || mr * 128 >= Sq),
            "sageattn3: mean_q must be (B, Hq, 1 or ceil(Sq/128), D)");
  SA3_CHECK(T, mean_k.numel() == B * Hkv * D, "sageattn3: mean_k must be (B, Hkv, 1, D)");
  if (balance.numel() > 0) {
    check_f32_on(balance, q, "balance");
    SA3_CHECK(T, balance.numel() == B * Hkv * D, "sageattn3: balance must be (B, Hkv, 1, D) or empty");
  }
  check_f32_on(partial, q, "partial");
  check_f32_on(error, q, "error");
  check_cuda(counter, q, "counter");
  check_i32(counter, "counter");
  SA3_CHECK(T, partial.numel() == B * Hq * 16 && counter.numel() == B * Hq && error.numel() == B * Hq,
            "sageattn3: partial must be (B, Hq, 8, 2), counter and error (B, Hq)");
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

// fp4_mma_probe(a, b, sfa, sfb, c, d!, tid_a, tid_b): one block-scaled FP4 MMA per problem
// (a (n,16,32), b (n,8,32), sfa (n,16,4), sfb (n,8,4) bytes; c, d (n,16,8) fp32).
template <class T>
void fp4_mma_probe(T a, T b, T sfa, T sfb, T c, T d, int64_t tid_a, int64_t tid_b) {
  check_cuda(a, a, "a");
  for (const T* t : {&b, &sfa, &sfb, &c, &d}) check_cuda(*t, a, "a probe operand");
  for (const T* t : {&a, &b, &sfa, &sfb}) check_bytes(*t, "a probe operand");
  check_f32(c, "c");
  check_f32(d, "d");
  const int64_t n = a.numel() / (16 * 32);
  SA3_CHECK(T, a.numel() == n * 512 && b.numel() == n * 256 && sfa.numel() == n * 64 && sfb.numel() == n * 32 &&
                   c.numel() == n * 128 && d.numel() == n * 128,
            "sageattn3: fp4_mma_probe operand sizes");
  SA3_CHECK(T, tid_a >= 0 && tid_a < 2 && tid_b >= 0 && tid_b < 4, "sageattn3: tid_a in [0,2), tid_b in [0,4)");
  DeviceScope scope(device_index(a));
  check_cuda_kernel<T>(sageattn3::fp4_mma_probe(bytes(a), bytes(b), bytes(sfa), bytes(sfb), floats(c), floats(d),
                                                static_cast<int>(n), static_cast<int>(tid_a), static_cast<int>(tid_b),
                                                TensorApi<T>::stream(a)),
                       "fp4_mma_probe");
}
// ---- end FP4 attention ----------------------------------------------------------------------

}  // namespace sageattn3::torch_ops

// The op table: X(name, schema) for every op; both units register exactly these.
#define SAGEATTN3_OPS(X)                                                                                            \
  X(quant_fp4_rows, "quant_fp4_rows(Tensor x, Tensor(a!) packed, Tensor(b!) scales) -> ()")                         \
  X(quant_fp4_cols, "quant_fp4_cols(Tensor x, Tensor(a!) packed, Tensor(b!) scales) -> ()")                         \
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
                    "Tensor, Tensor, Tensor, Tensor, Tensor)")                                                      \
  X(delta_s, "delta_s(Tensor k, Tensor mean_k, Tensor mean_q, Tensor(a!) out) -> ()")                               \
  X(smooth_quant_k_delta, "smooth_quant_k_delta(Tensor k, Tensor mean_k, Tensor mean_q, Tensor(a!) packed, "        \
                          "Tensor(b!) scales, Tensor(c!) delta) -> ()")                                             \
  X(blockscaled_fp4_attn, "blockscaled_fp4_attn(Tensor q, Tensor q_sf, Tensor k, Tensor k_sf, Tensor v, "           \
                          "Tensor v_sf, Tensor mean_q, Tensor qbar, Tensor ds_key, Tensor k_res, Tensor(b!) ds_work, " \
                          "Tensor(a!) out, "                                                                        \
                          "int seq_q, "                                                                             \
                          "int seq_k, float sm_scale, "                                                             \
                          "bool causal) -> ()")                                                                     \
  X(blockscaled_attn_qk8, "blockscaled_attn_qk8(Tensor q, Tensor q_sf, Tensor k, Tensor k_sf, Tensor v, "           \
                          "Tensor v_sf, Tensor mean_q, Tensor qbar, Tensor ds_key, Tensor k_res, Tensor(b!) ds_work, " \
                          "Tensor(a!) out, Tensor head_sel, Tensor q8, Tensor q8_sf, Tensor k8, Tensor k8_sf, "     \
                          "int seq_q, int seq_k, float sm_scale, bool causal) -> ()")                               \
  X(mxfp8_smooth_quant, "mxfp8_smooth_quant(Tensor x, Tensor mean, Tensor balance, int balance_sign, Tensor sel, "  \
                        "Tensor(a!) codes, Tensor(b!) scales) -> ()")                                               \
  X(qk_rule_error, "qk_rule_error(Tensor q, Tensor k, Tensor v, Tensor q_packed, Tensor q_scales, "              \
                   "Tensor k_packed, Tensor k_scales, Tensor mean_q, Tensor mean_k, Tensor balance, "            \
                   "float sm_scale, Tensor(a!) partial, Tensor(b!) counter, Tensor(c!) error) -> ()")            \
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
