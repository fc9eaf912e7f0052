// The only translation unit that sees torch: registers sageattn3's ops with the dispatcher
// through the LibTorch stable ABI (TORCH_TARGET_VERSION pins the oldest torch it must load
// into) and defines a Python limited-API module so `import sageattn3._C` loads it.
//
// Ops write into outputs the Python side allocated and validated (shapes, dtypes, devices
// are checked there with messages naming the argument); here we re-check the invariants the
// kernels rely on, so a direct torch.ops call can never reach a kernel with bad memory.
#include <Python.h>

#include <torch/csrc/inductor/aoti_torch/c/shim.h>
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/tensor.h>
#include <torch/headeronly/util/Exception.h>

#include "sageattn3.h"

namespace {

using torch::stable::Tensor;

cudaStream_t current_stream(const Tensor& t) {
  void* stream = nullptr;
  STD_TORCH_CHECK(aoti_torch_get_current_cuda_stream(t.get_device(), &stream) == AOTI_TORCH_SUCCESS,
                  "sageattn3: could not get the current CUDA stream");
  return static_cast<cudaStream_t>(stream);
}

sageattn3::DType dtype_of(const Tensor& t, const char* name) {
  switch (t.scalar_type()) {
    case torch::headeronly::ScalarType::Half: return sageattn3::DType::kFloat16;
    case torch::headeronly::ScalarType::BFloat16: return sageattn3::DType::kBFloat16;
    case torch::headeronly::ScalarType::Float: return sageattn3::DType::kFloat32;
    default: STD_TORCH_CHECK(false, "sageattn3: ", name, " must be float16, bfloat16 or float32");
  }
  return sageattn3::DType::kFloat32;
}

void check_cuda_kernel(int err, const char* what) {
  STD_TORCH_CHECK(err == 0, "sageattn3: ", what, " failed: ", cudaGetErrorString(static_cast<cudaError_t>(err)));
}

// quant_fp4_rows(x, packed!, scales!): x viewed as (rows, cols) with unit stride along cols.
void quant_fp4_rows(Tensor x, Tensor packed, Tensor scales) {
  STD_TORCH_CHECK(x.is_cuda() && packed.is_cuda() && scales.is_cuda(), "sageattn3: tensors must be on CUDA");
  STD_TORCH_CHECK(x.get_device() == packed.get_device() && x.get_device() == scales.get_device(),
                  "sageattn3: tensors on different devices");
  const int64_t cols = x.dim() ? x.size(x.dim() - 1) : 0;
  STD_TORCH_CHECK(x.dim() >= 1 && cols % 16 == 0, "sageattn3: last dim must be a multiple of 16");
  STD_TORCH_CHECK(x.stride(x.dim() - 1) == 1 && x.is_contiguous(), "sageattn3: x must be contiguous");
  STD_TORCH_CHECK(packed.is_contiguous() && scales.is_contiguous(), "sageattn3: outputs must be contiguous");
  const int64_t rows = cols ? x.numel() / cols : 0;
  STD_TORCH_CHECK(packed.numel() == rows * cols / 2 && scales.numel() == rows * cols / 16,
                  "sageattn3: output sizes do not match x");
  check_cuda_kernel(sageattn3::quant_fp4_rows(x.data_ptr(), dtype_of(x, "x"), rows, cols, cols,
                                              static_cast<uint8_t*>(packed.data_ptr()),
                                              static_cast<uint8_t*>(scales.data_ptr()), current_stream(x)),
                    "quant_fp4_rows");
}

}  // namespace

STABLE_TORCH_LIBRARY(sageattn3, m) {
  m.def("quant_fp4_rows(Tensor x, Tensor(a!) packed, Tensor(b!) scales) -> ()");
}

STABLE_TORCH_LIBRARY_IMPL(sageattn3, CUDA, m) {
  m.impl("quant_fp4_rows", TORCH_BOX(&quant_fp4_rows));
}

// `import sageattn3._C` only needs the module to exist: loading the library runs the static
// registrations above.
static struct PyModuleDef sageattn3_module = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
PyMODINIT_FUNC PyInit__C(void) {
  return PyModule_Create(&sageattn3_module);
}
