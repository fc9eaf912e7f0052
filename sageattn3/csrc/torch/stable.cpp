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
  // A new contiguous tensor (kByte, kFloat8e4m3fn or kFloat) on like's CUDA device. Through
  // the shim's aoti_torch_empty_strided (a direct at::empty_strided call) rather than
  // torch::stable::new_empty, which goes through the boxed dispatcher.
  static StableTensor empty(std::initializer_list<int64_t> sizes, Kind k, const StableTensor& like) {
    int64_t sz[8], st[8];
    const int64_t n = static_cast<int64_t>(sizes.size());
    if (n > 8) fail(message("sageattn3: at most 8 dims, got ", n));
    int64_t i = 0;
    for (int64_t s : sizes) sz[i++] = s;
    contiguous_strides(sz, n, st);
    AtenTensorHandle h = nullptr;
    if (aoti_torch_empty_strided(n, sz, st, dtype(k), aoti_torch_device_type_cuda(), like.get_device(), &h) !=
        AOTI_TORCH_SUCCESS)
      fail("sageattn3: could not allocate an output tensor on the GPU (out of memory?)");
    return StableTensor(h);
  }
  // A contiguous tensor of kind k (as empty's) and shape sizes[0, ndim) over buffer's memory from
  // offset_bytes on, sharing its storage (torch/outputs.h): buffer is a fresh kByte tensor of
  // empty's, offset_bytes a multiple of k's size. Through the shim's aoti_torch__alloc_from_pool
  // (a new TensorImpl over the same storage; no dispatcher call, no allocation on the GPU).
  static StableTensor view_of(const StableTensor& buffer, int64_t offset_bytes, const int64_t* sizes, int64_t ndim,
                              Kind k) {
    int64_t st[8];
    if (ndim > 8) fail(message("sageattn3: at most 8 dims, got ", ndim));
    contiguous_strides(sizes, ndim, st);
    AtenTensorHandle h = nullptr;
    if (aoti_torch__alloc_from_pool(buffer.get(), offset_bytes, dtype(k), ndim, sizes, st, &h) != AOTI_TORCH_SUCCESS)
      fail(message("sageattn3: could not make an output view ", offset_bytes, " bytes into its allocation"));
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
