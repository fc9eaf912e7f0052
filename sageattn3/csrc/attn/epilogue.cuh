// Epilogue: O / l, converted to bf16 or fp16, rows past seq_q dropped.
#pragma once
#include <cstdint>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "attn/attn_params.h"

namespace sageattn3::attn {

// o[n][e]: row row_g + 8(e>>1), column 8n + 2t + (e&1) of the head's (seq_q, D) output; v_back[x]:
// the power of two that takes columns 32x .. 32x + 31 back from V's tile exponent (exact: o times
// (1/l times it) is o / l times it, rounded once).
template <int D>
__device__ __forceinline__ void store_output(const AttnParams& p, int bh, int row_g, const float (&o)[D / 8][4],
                                             const float (&row_sum)[2], const float (&v_back)[D / 32]) {
  const int t = threadIdx.x & 3;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = row_g + 8 * r;
    if (row >= p.seq_q) continue;
    const float inv = row_sum[r] > 0.f ? 1.f / row_sum[r] : 0.f;
    const int64_t base = (static_cast<int64_t>(bh) * p.seq_q + row) * D + 2 * t;
    if (p.out_bf16) {
      __nv_bfloat162* out = reinterpret_cast<__nv_bfloat162*>(static_cast<__nv_bfloat16*>(p.out) + base);
#pragma unroll
      for (int n = 0; n < D / 8; ++n) {
        const float f = inv * v_back[n / 4];
        out[4 * n] = __floats2bfloat162_rn(o[n][2 * r] * f, o[n][2 * r + 1] * f);
      }
    } else {
      __half2* out = reinterpret_cast<__half2*>(static_cast<__half*>(p.out) + base);
#pragma unroll
      for (int n = 0; n < D / 8; ++n) {
        const float f = inv * v_back[n / 4];
        out[4 * n] = __floats2half2_rn(o[n][2 * r] * f, o[n][2 * r + 1] * f);
      }
    }
  }
}

}  // namespace sageattn3::attn
