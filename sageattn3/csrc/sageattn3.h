// Host-side launch API of the sageattn3 kernels: plain C types only (no torch headers), so
// the .cu translation units compile without parsing torch and the bindings stay thin.
#pragma once
#include <cstdint>
#include <cuda_runtime_api.h>

namespace sageattn3 {

enum class DType : int { kFloat16 = 0, kBFloat16 = 1, kFloat32 = 2 };

// NVFP4 quantization of `rows` rows of `cols` elements (cols % 16 == 0) along each row.
// x: row i starts at x + i * row_stride (elements). packed: rows x cols/2 bytes (low nibble =
// even element); scales: rows x cols/16 E4M3 bytes. Returns a cudaError_t.
int quant_fp4_rows(const void* x, DType dtype, int64_t rows, int64_t cols, int64_t row_stride,
                   uint8_t* packed, uint8_t* scales, cudaStream_t stream);

}  // namespace sageattn3
