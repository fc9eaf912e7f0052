// Shared-memory tile layouts and the loads of MMA fragments from them.
//
// Every FP4 tile in shared memory is a row-major array of rows of R bytes (R = 32 or 64: a row of
// Q/K holds D/2 bytes, a row of V^T holds BLOCK_N/2 bytes), written by TMA with the swizzle that
// matches R (CU_TENSOR_MAP_SWIZZLE_32B / _64B): within each 128-byte line group, the 16-byte
// chunk index is XORed with bits [7, 7 + log2(R/16)) of the byte offset. Buffers are 1024-byte
// aligned so the swizzle is a function of the offset alone. With it, the 8 row addresses of an
// ldmatrix phase hit 8 distinct 16-byte bank groups.
//
// An FP4 MMA fragment word (row r, bytes 4t .. 4t+3 of a 16-byte piece) is exactly what ldmatrix
// (.b16, 8x8) hands lane 4r + t, so A and B fragments come from ldmatrix.x4 with per-lane row
// addresses. That per-lane addressing is also what lets the kernel permute the keys of S freely.
#pragma once
#include <cstdint>

#include "attn/tma_pipeline.cuh"

namespace sageattn3::attn {

template <int kRowBytes>
__device__ __forceinline__ uint32_t swizzled(uint32_t off) {
  static_assert(kRowBytes == 32 || kRowBytes == 64 || kRowBytes == 128, "row bytes");
  constexpr uint32_t kMask = kRowBytes / 16 - 1;  // 1, 3, 7
  return off ^ (((off >> 7) & kMask) << 4);
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t saddr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(saddr));
}

__device__ __forceinline__ uint32_t lds_u32(uint32_t saddr) {
  uint32_t v;
  asm volatile("ld.shared.b32 %0, [%1];\n" : "=r"(v) : "r"(saddr));
  return v;
}

__device__ __forceinline__ float2 lds_f2(uint32_t saddr) {
  float2 v;
  asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];\n" : "=f"(v.x), "=f"(v.y) : "r"(saddr));
  return v;
}

// The key order of S. Column g of n-tile j (j < BLOCK_N/8) of the S accumulator holds key
//   kp(j, g) = 64*(j/8) + 32*((j/4)&1) + 8*(g/2) + 2*(j&3) + (g&1)
// so that lane (g, t) ends up holding, for 64-key chunk q, keys 64q + 8t + 0..7 (n-tiles 8q..8q+3)
// and 64q + 32 + 8t + 0..7 (n-tiles 8q+4..8q+7) in the order of its accumulators: exactly the
// A-fragment of P for the P.V MMA (a0/a1: k 8t.., a2/a3: k 32+8t..) with k = the key itself. So P
// needs no shuffles, V needs no permutation, and P's 16-key scale blocks are V's 16-token blocks.
__host__ __device__ __forceinline__ constexpr int key_of(int j, int g) {
  return 64 * (j >> 3) + 32 * ((j >> 2) & 1) + 8 * (g >> 1) + 2 * (j & 3) + (g & 1);
}

// The swizzle XOR (bits 4..) of an ldmatrix row address of the K tile whose key is
// key_of(j, 0) + (a lane part that only sets bits 0, 1 and >= 3): with 64-byte rows it is bits 1..2
// of the key = (j & 3); with 32-byte rows (j even) bit 2 of the key = (j >> 1) & 1. No carries
// cross those bits, so the XOR is a compile-time constant per n-tile.
template <int kRowBytes>
__device__ __forceinline__ constexpr uint32_t key_swizzle(int j) {
  static_assert(kRowBytes == 32 || kRowBytes == 64, "row bytes");
  return kRowBytes == 64 ? static_cast<uint32_t>(j & 3) << 4 : static_cast<uint32_t>((j >> 1) & 1) << 4;
}

}  // namespace sageattn3::attn
