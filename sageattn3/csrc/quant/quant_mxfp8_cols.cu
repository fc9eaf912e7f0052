// MXFP8 along the sequence for V (quant_mxfp8_cols; the tile's device code and what it computes:
// quant/mxfp8_cols.cuh).
#include "quant/mxfp8_cols.cuh"

namespace sageattn3 {
namespace {

using mxfp8_cols::kTC;
using mxfp8_cols::kThreads;
using mxfp8_cols::kTS;
using mxfp8_cols::kWords;

template <typename T>
__global__ void __launch_bounds__(kThreads)
    quant_mxfp8_cols_kernel(const T* __restrict__ x, int64_t S, int64_t D, int64_t Sp, uint8_t* __restrict__ codes,
                            uint8_t* __restrict__ scales, const uint8_t* __restrict__ sel) {
  __shared__ __align__(16) uint32_t tile[kTS][kWords];
  mxfp8_cols::cols_tile<T>(x, S, D, Sp, codes, scales, sel, blockIdx.x, blockIdx.y, blockIdx.z, tile);
}

template <typename T>
int launch(const void* x, int64_t G, int64_t S, int64_t D, int64_t Sp, uint8_t* codes, uint8_t* scales,
           const uint8_t* sel, cudaStream_t stream) {
  const int64_t s_tiles = ceil_div(Sp, static_cast<int64_t>(kTS)), d_tiles = ceil_div(D, static_cast<int64_t>(kTC));
  if (G == 0 || s_tiles == 0) return cudaSuccess;
  if (s_tiles > 0x7FFFFFFF || d_tiles > 65535) return cudaErrorInvalidValue;
  // grid z holds at most 65535 groups: more go in further launches
  for (int64_t g0 = 0; g0 < G; g0 += 65535) {
    const int64_t ng = G - g0 < 65535 ? G - g0 : 65535;
    const dim3 grid(static_cast<unsigned>(s_tiles), static_cast<unsigned>(d_tiles), static_cast<unsigned>(ng));
    quant_mxfp8_cols_kernel<T><<<grid, kThreads, 0, stream>>>(static_cast<const T*>(x) + g0 * S * D, S, D, Sp,
                                                              codes + g0 * D * Sp, scales + g0 * D * (Sp / 32),
                                                              sel == nullptr ? nullptr : sel + g0);
    const cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) return e;
  }
  return cudaSuccess;
}

}  // namespace

int quant_mxfp8_cols(const void* x, DType dtype, int64_t G, int64_t S, int64_t D, int64_t Sp, uint8_t* codes,
                     uint8_t* scales, const uint8_t* sel, cudaStream_t stream) {
  if (!mxfp8_cols::args_fit(G, S, D, Sp)) return cudaErrorInvalidValue;
  switch (dtype) {
    case DType::kFloat16: return launch<f16_t>(x, G, S, D, Sp, codes, scales, sel, stream);
    case DType::kBFloat16: return launch<bf16_t>(x, G, S, D, Sp, codes, scales, sel, stream);
    case DType::kFloat32: break;  // V is 16-bit: the op refuses fp32 with a message
  }
  return cudaErrorInvalidValue;
}

}  // namespace sageattn3
