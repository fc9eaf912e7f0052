// The Q/K rotation of the smoothing kernels: a randomized Walsh-Hadamard transform of the head
// dim (D 64 or 128), bit-exact with sageattn3/reference/transforms.py (rotate):
//   y_d = x_d * s_d, s_d = -1/8 where bit d of kSignBits is set, else +1/8 (exact), then the
//   butterflies in fp32, stages h = 1, 2, ..., D/2 in that order: for each i with (i & h) == 0,
//   (y_i, y_{i+h}) <- (y_i + y_{i+h}, y_i - y_{i+h}).
// rotate(q) . rotate(k) = (D/64) q . k: the attention divides its softmax scale by D/64.
//
// Layout (rowblock.cuh): a thread holds one 16-channel block (block column cb) of a row and the
// D/16 blocks of a row sit in consecutive lanes (D/16 divides 32), so stages 1..8 run in the
// thread and stages 16, 32, 64 between lanes cb ^ 1, cb ^ 2, cb ^ 4 (register shuffles; every lane
// of the warp must take part).
#pragma once
#include <cstdint>

namespace sageattn3 {

// random.Random(3).getrandbits(128), low and high 64 bits (reference.ROTATION_SIGN_BITS).
constexpr uint64_t kRotationSignsLo = 0x97B750923CEB3FFDull;
constexpr uint64_t kRotationSignsHi = 0x216363698B529B4Aull;

__host__ __device__ constexpr bool rotation_applies(int D) { return D == 64 || D == 128; }

// The sign bits of channels 16cb .. 16cb + 15.
__device__ __forceinline__ uint32_t rotation_signs16(int cb) {
  const uint64_t w = cb < 4 ? kRotationSignsLo : kRotationSignsHi;
  return static_cast<uint32_t>(w >> (16 * (cb & 3))) & 0xFFFFu;
}

// The butterflies alone (no signs) on the 16 values v of block column cb of a row whose kBpr =
// D/16 blocks (4 or 8) are held by consecutive lanes. Called by all 32 lanes of the warp.
template <int kBpr>
__device__ __forceinline__ void hadamard_block(float (&v)[16], int cb) {
  static_assert(kBpr == 4 || kBpr == 8, "the rotation is defined for D 64 and 128");
#pragma unroll
  for (int h = 1; h < 16; h <<= 1) {
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      if (i & h) continue;
      const float a = v[i], b = v[i + h];
      v[i] = __fadd_rn(a, b);
      v[i + h] = __fsub_rn(a, b);
    }
  }
#pragma unroll
  for (int m = 1; m < kBpr; m <<= 1) {
    const bool upper = (cb & m) != 0;  // this lane holds the y_{i+h} of each pair
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      const float other = __shfl_xor_sync(0xffffffffu, v[i], m);
      v[i] = upper ? __fsub_rn(other, v[i]) : __fadd_rn(v[i], other);
    }
  }
}

__device__ __forceinline__ void apply_signs(float (&v)[16], int cb) {
  const uint32_t signs = rotation_signs16(cb);
#pragma unroll
  for (int i = 0; i < 16; ++i) v[i] = __fmul_rn(v[i], ((signs >> i) & 1u) ? -0.125f : 0.125f);
}

// Rotates the 16 values v of block column cb of a row (see hadamard_block).
template <int kBpr>
__device__ __forceinline__ void rotate_block(float (&v)[16], int cb) {
  apply_signs(v, cb);
  hadamard_block<kBpr>(v, cb);
}

/* ---------- The same on 32 lanes: a warp per row, lane l holding channels l*D/32 .. +D/32 ---------- */

// The sign (+-1/8) of channel e.
__device__ __forceinline__ float rotation_sign(int e) {
  const uint64_t w = e < 64 ? kRotationSignsLo : kRotationSignsHi;
  return ((w >> (e & 63)) & 1u) ? -0.125f : 0.125f;
}

// The butterflies alone on a row whose D values sit D/32 per lane, in hadamard_block's stage
// order (h = 1, 2, ..., D/2: within the lane for h < D/32, with lane ^ (h / (D/32)) above): each
// pair's sum and difference are the same fp32 operations, so the bits are those of hadamard_block
// and reference.rotate. Called by all 32 lanes.
template <int D>
__device__ __forceinline__ void hadamard_lanes(float (&v)[D / 32], int lane) {
  constexpr int kV = D / 32;
#pragma unroll
  for (int h = 1; h < kV; h <<= 1) {
#pragma unroll
    for (int i = 0; i < kV; ++i) {
      if (i & h) continue;
      const float a = v[i], b = v[i + h];
      v[i] = __fadd_rn(a, b);
      v[i + h] = __fsub_rn(a, b);
    }
  }
#pragma unroll
  for (int m = 1; m < 32; m <<= 1) {
    const bool upper = (lane & m) != 0;  // this lane holds the y_{i+h} of each pair
#pragma unroll
    for (int i = 0; i < kV; ++i) {
      const float other = __shfl_xor_sync(0xffffffffu, v[i], m);
      v[i] = upper ? __fsub_rn(other, v[i]) : __fadd_rn(v[i], other);
    }
  }
}

// Rotates the D-vector vec[0..D) in shared memory in place (D 64 or 128), and writes it to
// out[0..D) too when out is not null; `transpose`: applies the transposed map instead,
// x -> x H S / 8 (butterflies first, then the signs), so that transpose(rotate(a)) . b =
// (D/64) a . b and rotate(a) . rotate(b) = transpose(rotate(a)) . b. Called by the 32 threads of
// one warp (lane = threadIdx % 32).
__device__ __forceinline__ void rotate_vector(float* vec, int D, float* out, bool transpose = false) {
  const int lane = threadIdx.x & 31, bpr = D / 16, cb = lane < bpr ? lane : 0;
  float v[16];
#pragma unroll
  for (int i = 0; i < 16; ++i) v[i] = lane < bpr ? vec[16 * lane + i] : 0.f;
  if (!transpose) apply_signs(v, cb);
  if (bpr == 8) hadamard_block<8>(v, cb);
  else hadamard_block<4>(v, cb);
  if (transpose) apply_signs(v, cb);
  __syncwarp();
  if (lane < bpr) {
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      vec[16 * lane + i] = v[i];
      if (out) out[16 * lane + i] = v[i];
    }
  }
  __syncwarp();
}

}  // namespace sageattn3
