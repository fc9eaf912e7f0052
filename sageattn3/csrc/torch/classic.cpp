// The torch-facing unit for torch lines below the stable-ABI floor (2.7-2.9): registers the ops
// of torch/ops.h through the classic dispatcher API (TORCH_LIBRARY, at::Tensor). Built once per torch
// line: the binary is tied to that line's C++ ABI, and the import guard refuses other lines.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "torch/checks.h"
#include "torch/ops.h"

namespace sageattn3::torch_ops {

template <>
struct TensorApi<at::Tensor> {
  static Kind kind(const at::Tensor& t) {
    switch (t.scalar_type()) {
      case at::ScalarType::Half: return Kind::kHalf;
      case at::ScalarType::BFloat16: return Kind::kBFloat16;
      case at::ScalarType::Float: return Kind::kFloat;
      case at::ScalarType::Byte: return Kind::kByte;
      case at::ScalarType::Float8_e4m3fn: return Kind::kFloat8e4m3fn;
      case at::ScalarType::Int: return Kind::kInt;
      case at::ScalarType::Double: return Kind::kDouble;
      case at::ScalarType::Long: return Kind::kLong;
      case at::ScalarType::Short: return Kind::kShort;
      case at::ScalarType::Char: return Kind::kChar;
      case at::ScalarType::Bool: return Kind::kBool;
      case at::ScalarType::Float8_e5m2: return Kind::kFloat8e5m2;
      default: return Kind::kOther;
    }
  }
  // "cuda:0", "cpu", ... as torch prints the device.
  static std::string device(const at::Tensor& t) { return t.device().str(); }
  static cudaStream_t stream(const at::Tensor& t) {
    return c10::cuda::getCurrentCUDAStream(t.get_device()).stream();
  }
  [[noreturn]] static void fail(const std::string& msg) { TORCH_CHECK(false, msg); }
  // A new contiguous tensor (kByte, kFloat8e4m3fn, kFloat, kHalf or kBFloat16) on like's CUDA device.
  static at::Tensor empty(std::initializer_list<int64_t> sizes, Kind k, const at::Tensor& like) {
    return at::empty(at::IntArrayRef(sizes.begin(), sizes.size()), like.options().dtype(scalar_type(k)));
  }
  static at::Tensor empty_n(const int64_t* sizes, int64_t ndim, Kind k, const at::Tensor& like) {
    return at::empty(at::IntArrayRef(sizes, static_cast<size_t>(ndim)), like.options().dtype(scalar_type(k)));
  }
  static at::ScalarType scalar_type(Kind k) {
    return k == Kind::kByte           ? at::kByte
           : k == Kind::kFloat8e4m3fn ? at::kFloat8_e4m3fn
           : k == Kind::kHalf         ? at::kHalf
           : k == Kind::kBFloat16     ? at::kBFloat16
                                      : at::kFloat;
  }
  template <auto F>
  static auto kernel() {
    return F;
  }
};

}  // namespace sageattn3::torch_ops

TORCH_LIBRARY(sageattn3, m) { sageattn3::torch_ops::define_ops(m); }

TORCH_LIBRARY_IMPL(sageattn3, CUDA, m) { sageattn3::torch_ops::implement_ops<at::Tensor>(m); }
