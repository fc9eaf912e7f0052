// The torch-facing unit for torch >= the stable-ABI floor: registers the ops of torch/ops.h through
// the LibTorch stable ABI (TORCH_TARGET_VERSION pins the oldest torch the binary must load
// into), so one wheel serves every later torch of its CUDA major.
#include <torch/csrc/inductor/aoti_torch/c/shim.h>
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/tensor.h>
#include <torch/headeronly/util/Exception.h>

#include "torch/checks.h"
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
      case ScalarType::Double: return Kind::kDouble;
      case ScalarType::Long: return Kind::kLong;
      case ScalarType::Short: return Kind::kShort;
      case ScalarType::Char: return Kind::kChar;
      case ScalarType::Bool: return Kind::kBool;
      case ScalarType::Float8_e5m2: return Kind::kFloat8e5m2;
      default: return Kind::kOther;
    }
  }
  // "cuda:0", "cpu", or (another device type) "a non-CUDA device".
  static std::string device(const StableTensor& t) {
    if (t.is_cuda()) return "cuda:" + std::to_string(t.get_device());
    return t.is_cpu() ? "cpu" : "a non-CUDA device";
  }
  static cudaStream_t stream(const StableTensor& t) {
    void* s = nullptr;
    if (aoti_torch_get_current_cuda_stream(t.get_device(), &s) != AOTI_TORCH_SUCCESS)
      fail("sageattn3: could not get the current CUDA stream");
    return static_cast<cudaStream_t>(s);
  }
  [[noreturn]] static void fail(const std::string& msg) { throw std::runtime_error(msg); }
  // A new contiguous tensor (kByte, kFloat8e4m3fn, kFloat, kHalf or kBFloat16) on like's CUDA device. Through
  // the shim's aoti_torch_empty_strided (a direct at::empty_strided call) rather than
  // torch::stable::new_empty, which goes through the boxed dispatcher.
  static StableTensor empty(std::initializer_list<int64_t> sizes, Kind k, const StableTensor& like) {
    return empty_n(sizes.begin(), static_cast<int64_t>(sizes.size()), k, like);
  }
  static StableTensor empty_n(const int64_t* sizes, int64_t n, Kind k, const StableTensor& like) {
    int64_t st[8];
    if (n > 8) fail(message("sageattn3: at most 8 dims, got ", n));
    contiguous_strides(sizes, n, st);
    AtenTensorHandle h = nullptr;
    if (aoti_torch_empty_strided(n, sizes, st, dtype(k), aoti_torch_device_type_cuda(), like.get_device(), &h) !=
        AOTI_TORCH_SUCCESS)
      fail("sageattn3: could not allocate an output tensor on the GPU (out of memory?)");
    return StableTensor(h);
  }
  static void contiguous_strides(const int64_t* sizes, int64_t n, int64_t* strides) {
    int64_t stride = 1;
    for (int64_t i = n - 1; i >= 0; --i) {
      strides[i] = stride;
      stride *= sizes[i] > 1 ? sizes[i] : 1;
    }
  }
  static int32_t dtype(Kind k) {
    return k == Kind::kByte            ? aoti_torch_dtype_uint8()
           : k == Kind::kFloat8e4m3fn ? aoti_torch_dtype_float8_e4m3fn()
           : k == Kind::kHalf         ? aoti_torch_dtype_float16()
           : k == Kind::kBFloat16     ? aoti_torch_dtype_bfloat16()
                                      : aoti_torch_dtype_float32();
  }
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
