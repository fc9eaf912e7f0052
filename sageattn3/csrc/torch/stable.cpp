// The torch-facing unit for torch >= the stable-ABI floor: registers the ops of ops.h through
// the LibTorch stable ABI (TORCH_TARGET_VERSION pins the oldest torch the binary must load
// into), so one wheel serves every later torch of its CUDA major.
#include <torch/csrc/inductor/aoti_torch/c/shim.h>
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/tensor.h>
#include <torch/headeronly/util/Exception.h>

#include "torch/ops.h"

namespace sageattn3::torch_ops {

using StableTensor = torch::stable::Tensor;

template <>
struct TensorApi<StableTensor> {
  static Kind kind(const StableTensor& t) {
    using torch::headeronly::ScalarType;
    switch (t.scalar_type()) {
      case ScalarType::Half: return Kind::kHalf;
      case ScalarType::BFloat16: return Kind::kBFloat16;
      case ScalarType::Float: return Kind::kFloat;
      case ScalarType::Byte: return Kind::kByte;
      case ScalarType::Float8_e4m3fn: return Kind::kFloat8e4m3fn;
      case ScalarType::Int: return Kind::kInt;
      default: return Kind::kOther;
    }
  }
  static cudaStream_t stream(const StableTensor& t) {
    void* s = nullptr;
    STD_TORCH_CHECK(aoti_torch_get_current_cuda_stream(t.get_device(), &s) == AOTI_TORCH_SUCCESS,
                    "sageattn3: could not get the current CUDA stream");
    return static_cast<cudaStream_t>(s);
  }
  [[noreturn]] static void fail(const std::string& msg) { throw std::runtime_error(msg); }
  template <auto F>
  static auto kernel() {
    return TORCH_BOX(F);
  }
};

}  // namespace sageattn3::torch_ops

STABLE_TORCH_LIBRARY(sageattn3, m) { sageattn3::torch_ops::define_ops(m); }

STABLE_TORCH_LIBRARY_IMPL(sageattn3, CUDA, m) {
  sageattn3::torch_ops::implement_ops<sageattn3::torch_ops::StableTensor>(m);
}
