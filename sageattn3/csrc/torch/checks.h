// The argument checks of the torch-facing ops (torch/ops_*.h), for both torch-facing units.
//
// Here: the contract each unit fulfils for its tensor type (TensorApi<T>), the error messages
// (message(), SA3_CHECK) and the checks every op family shares: dtype, device, contiguity,
// alignment. Each check's message names what it expected and what it got, e.g.
// "sageattn3: q must be float16, bfloat16 or float32, got float64".
#pragma once

#include <cstdint>
#include <string>
#include <type_traits>

#include "sageattn3.h"

namespace sageattn3::torch_ops {

// The dtypes the checks distinguish or name; each unit maps its torch's ScalarType onto these.
enum class Kind {
  kHalf,
  kBFloat16,
  kFloat,
  kByte,
  kFloat8e4m3fn,
  kInt,
  kDouble,
  kLong,
  kShort,
  kChar,
  kBool,
  kFloat8e5m2,
  kOther
};

// torch's name of a dtype, as Python prints it (torch.float32 -> "float32").
inline const char* kind_name(Kind k) {
  switch (k) {
    case Kind::kHalf: return "float16";
    case Kind::kBFloat16: return "bfloat16";
    case Kind::kFloat: return "float32";
    case Kind::kByte: return "uint8";
    case Kind::kFloat8e4m3fn: return "float8_e4m3fn";
    case Kind::kInt: return "int32";
    case Kind::kDouble: return "float64";
    case Kind::kLong: return "int64";
    case Kind::kShort: return "int16";
    case Kind::kChar: return "int8";
    case Kind::kBool: return "bool";
    case Kind::kFloat8e5m2: return "float8_e5m2";
    default: return "another dtype";
  }
}

// Specialised by each unit for its tensor type:
//   static Kind kind(const T&);
//   static std::string device(const T&);            // "cuda:0", "cpu", ... (for messages)
//   static cudaStream_t stream(const T&);           // torch's current stream on t's device
//   [[noreturn]] static void fail(const std::string&);  // throw torch's error with the message
//   static T empty({sizes}, Kind, const T& like);  // new contiguous tensor on like's CUDA device
//   static T empty_n(const int64_t* sizes, int64_t ndim, Kind, const T& like);  // the same, sizes[0, ndim)
//   template <auto F> static auto kernel();         // what the unit's m.impl takes for op F
template <class T>
struct TensorApi;

/* ---------- Messages ---------- */

// Error messages are built from strings and integers by appending, without iostreams: built
// with a std::ostringstream, a message holding an integer crashed the process in the stable-ABI
// build on the H100 host (torch 2.11) instead of raising (strings-only messages raised); with
// std::to_string the same calls raise. The cause was not pinned down further.
inline std::string message_piece(const char* s) { return s; }
inline std::string message_piece(const std::string& s) { return s; }
inline std::string message_piece(Kind k) { return kind_name(k); }
template <class I, std::enable_if_t<std::is_integral_v<I> && !std::is_same_v<I, bool>, int> = 0>
std::string message_piece(I v) {
  return std::to_string(v);
}
inline std::string message_piece(bool v) { return v ? "true" : "false"; }

// message("x must be ", 4, "-D, got ", 3): the pieces (strings, integers, bools, Kinds) appended.
template <class... Parts>
std::string message(const Parts&... parts) {
  std::string out;
  ((out += message_piece(parts)), ...);
  return out;
}

// "(2, 8, 128)": a shape, or any list of integers, as Python prints a tuple.
template <class... I>
std::string dims(I... v) {
  std::string out = "(";
  const char* sep = "";
  ((out += sep, out += std::to_string(static_cast<int64_t>(v)), sep = ", "), ...);
  return out + ")";
}

// t's shape, "(2, 8, 128)".
template <class T>
std::string shape(const T& t) {
  std::string out = "(";
  for (int64_t i = 0; i < t.dim(); ++i) out += (i ? ", " : "") + std::to_string(t.size(i));
  return out + (t.dim() == 1 ? ",)" : ")");
}

// t's strides, as shape() prints a shape.
template <class T>
std::string strides(const T& t) {
  std::string out = "(";
  for (int64_t i = 0; i < t.dim(); ++i) out += (i ? ", " : "") + std::to_string(t.stride(i));
  return out + (t.dim() == 1 ? ",)" : ")");
}

template <class T>
std::string dtype_name(const T& t) {
  return kind_name(TensorApi<T>::kind(t));
}

template <class T>
std::string device_name(const T& t) {
  return TensorApi<T>::device(t);
}

// SA3_CHECK(T, cond, pieces...): throws torch's error with message(pieces...) unless cond; the
// pieces are only formatted when the check fails.
#define SA3_CHECK(T, cond, ...)                                                  \
  do {                                                                           \
    if (!(cond)) ::sageattn3::torch_ops::TensorApi<T>::fail(                     \
        ::sageattn3::torch_ops::message(__VA_ARGS__));                           \
  } while (0)

/* ---------- Checks shared by the op families ---------- */

template <class T>
DType dtype_of(const T& t, const char* name) {
  switch (TensorApi<T>::kind(t)) {
    case Kind::kHalf: return DType::kFloat16;
    case Kind::kBFloat16: return DType::kBFloat16;
    case Kind::kFloat: return DType::kFloat32;
    default:
      SA3_CHECK(T, false, "sageattn3: ", name, " must be float16, bfloat16 or float32, got ", dtype_name(t));
  }
  return DType::kFloat32;
}

template <class T>
void check_cuda_kernel(int err, const char* what) {
  SA3_CHECK(T, err == 0, "sageattn3: ", what, " failed: ", cudaGetErrorString(static_cast<cudaError_t>(err)),
            " (expected cudaSuccess, got CUDA error ", err, ")");
}

template <class T>
void check_cuda(const T& t, const T& ref, const char* name) {
  SA3_CHECK(T, t.is_cuda(), "sageattn3: ", name, " must be a CUDA tensor, got a tensor on ", device_name(t));
  SA3_CHECK(T, t.get_device() == ref.get_device(), "sageattn3: ", name, " is on another device, expected ",
            device_name(ref), ", got ", device_name(t));
  SA3_CHECK(T, t.is_contiguous(), "sageattn3: ", name, " must be contiguous, got strides ", strides(t),
            " for shape ", shape(t));
}

// The kernels use 16-byte vector loads and stores.
template <class T>
void check_aligned(const T& t, const char* name) {
  const auto misalign = static_cast<int>(reinterpret_cast<uintptr_t>(t.data_ptr()) % 16);
  SA3_CHECK(T, misalign == 0, "sageattn3: ", name, " must be 16-byte aligned (pass a fresh tensor or .clone()), ",
            "got an address ", misalign, " bytes past a 16-byte boundary");
}

template <class T>
void check_bytes(const T& t, const char* name) {
  const Kind k = TensorApi<T>::kind(t);
  SA3_CHECK(T, k == Kind::kByte || k == Kind::kFloat8e4m3fn, "sageattn3: ", name,
            " must be uint8 or float8_e4m3fn, got ", k);
}

template <class T>
void check_f32(const T& t, const char* name) {
  SA3_CHECK(T, TensorApi<T>::kind(t) == Kind::kFloat, "sageattn3: ", name, " must be float32, got ", dtype_name(t));
}

template <class T>
void check_i32(const T& t, const char* name) {
  SA3_CHECK(T, TensorApi<T>::kind(t) == Kind::kInt, "sageattn3: ", name, " must be int32, got ", dtype_name(t));
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

// K's quantization residual (reference.quantize_residual), on x's device: float16, 16-byte aligned.
template <class T>
void check_residual(const T& t, const T& x, const char* name) {
  check_cuda(t, x, name);
  SA3_CHECK(T, TensorApi<T>::kind(t) == Kind::kHalf, "sageattn3: ", name,
            " (K's quantization residual, reference.quantize_residual) must be float16, got ", dtype_name(t),
            " (a one-byte E4M3 residual of an earlier release is in the same units: .to(torch.float16) "
            "converts it exactly; or run the preprocessing again)");
  check_aligned(t, name);
}

template <class T>
void check_codes(const T& packed, const T& scales, const T& x) {
  check_code_tensor(packed, x, "packed");
  check_code_tensor(scales, x, "scales");
}

/* ---------- What the ops hand to the launch API ---------- */

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
uint8_t* bytes(const T& t) { return static_cast<uint8_t*>(t.data_ptr()); }
template <class T>
float* floats(const T& t) { return static_cast<float*>(t.data_ptr()); }
template <class T>
int* ints(const T& t) { return static_cast<int*>(t.data_ptr()); }
template <class T>
int device_index(const T& t) { return static_cast<int>(t.get_device()); }

}  // namespace sageattn3::torch_ops
