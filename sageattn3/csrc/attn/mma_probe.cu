// A one-instruction probe of the block-scaled FP4 MMA: places plain matrices into registers by
// the PTX ISA's fragment formulas (written out here independently of the kernel's ldmatrix
// reasoning), runs mma_fp4 (the hardware instruction, or the model in the test flavour) and
// writes D back by the accumulator formula. Tested against a float64 matmul of the dequantized
// operands; on sm_120 hardware the same probe checks the real instruction.
#include <cuda_runtime.h>

#include "attn/attn_api.h"
#include "attn/fp4_mma.cuh"

namespace sageattn3 {
namespace attn {
namespace {

__device__ __forceinline__ uint32_t nibble(const uint8_t* rowmajor, int row, int col, int row_bytes) {
  const uint8_t byte = rowmajor[row * row_bytes + col / 2];
  return (col & 1) ? (byte >> 4) : (byte & 15u);
}

__device__ __forceinline__ uint32_t load_u32(const uint8_t* p) {
  return uint32_t(p[0]) | (uint32_t(p[1]) << 8) | (uint32_t(p[2]) << 16) | (uint32_t(p[3]) << 24);
}

template <int TA, int TB>
__global__ void mma_probe_kernel(const uint8_t* __restrict__ a, const uint8_t* __restrict__ b,
                                 const uint8_t* __restrict__ sfa, const uint8_t* __restrict__ sfb,
                                 const float* __restrict__ c, float* __restrict__ d) {
  const int prob = blockIdx.x;
  const int lane = threadIdx.x, g = lane >> 2, t = lane & 3;
  a += prob * 16 * 32;
  b += prob * 8 * 32;
  sfa += prob * 16 * 4;
  sfb += prob * 8 * 4;
  c += prob * 16 * 8;
  d += prob * 16 * 8;
  // A: a_i, i = 0..31 (register i/8, bits 4(i%8)): row g for i < 8 or 16 <= i < 24, else g + 8;
  //    col 8t + (i & 7), + 32 for i >= 16.
  uint32_t ar[4] = {0, 0, 0, 0};
  for (int i = 0; i < 32; ++i) {
    const int row = (i < 8 || (i >= 16 && i < 24)) ? g : g + 8;
    const int col = 8 * t + (i & 7) + (i >= 16 ? 32 : 0);
    ar[i / 8] |= nibble(a, row, col, 32) << (4 * (i % 8));
  }
  // B (k64 x n8, given column-major: b[n][k]): b_i, i = 0..15: row (k) 8t + (i & 7), + 32 for
  //    i >= 8; col g.
  uint32_t br[2] = {0, 0};
  for (int i = 0; i < 16; ++i) {
    const int k = 8 * t + (i & 7) + (i >= 8 ? 32 : 0);
    br[i / 8] |= nibble(b, g, k, 32) << (4 * (i % 8));
  }
  // C: c_i: row g for i < 2 else g + 8, col 2t + (i & 1).
  float cr[4], dr[4];
  for (int i = 0; i < 4; ++i) cr[i] = c[((i < 2) ? g : g + 8) * 8 + 2 * t + (i & 1)];
  // Scale operands: row g of SF_A from lane 4g + 2TA, row g+8 from lane 4g + 2TA + 1; column n of
  // SF_B from lane 4n + TB. Every other lane holds NaN scales, so a wrong selector shows.
  uint32_t sa = 0x7f7f7f7fu, sb = 0x7f7f7f7fu;
  if ((t >> 1) == TA) sa = load_u32(sfa + 4 * (g + 8 * (t & 1)));
  if (t == TB) sb = load_u32(sfb + 4 * g);
  mma_fp4<TA, TB>(dr, ar, br, cr, sa, sb);
  for (int i = 0; i < 4; ++i) d[((i < 2) ? g : g + 8) * 8 + 2 * t + (i & 1)] = dr[i];
}

template <int TA, int TB>
int launch_probe(const uint8_t* a, const uint8_t* b, const uint8_t* sfa, const uint8_t* sfb, const float* c,
                 float* d, int n, cudaStream_t stream) {
  mma_probe_kernel<TA, TB><<<n, 32, 0, stream>>>(a, b, sfa, sfb, c, d);
  return cudaGetLastError();
}

}  // namespace
}  // namespace attn

int fp4_mma_probe(const uint8_t* a, const uint8_t* b, const uint8_t* sfa, const uint8_t* sfb, const float* c,
                  float* d, int n, int tid_a, int tid_b, cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  using attn::launch_probe;
  switch (tid_a * 4 + tid_b) {
    case 0: return launch_probe<0, 0>(a, b, sfa, sfb, c, d, n, stream);
    case 1: return launch_probe<0, 1>(a, b, sfa, sfb, c, d, n, stream);
    case 2: return launch_probe<0, 2>(a, b, sfa, sfb, c, d, n, stream);
    case 3: return launch_probe<0, 3>(a, b, sfa, sfb, c, d, n, stream);
    case 4: return launch_probe<1, 0>(a, b, sfa, sfb, c, d, n, stream);
    case 5: return launch_probe<1, 1>(a, b, sfa, sfb, c, d, n, stream);
    case 6: return launch_probe<1, 2>(a, b, sfa, sfb, c, d, n, stream);
    case 7: return launch_probe<1, 3>(a, b, sfa, sfb, c, d, n, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace sageattn3
