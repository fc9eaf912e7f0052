// The 16-bit tensor-core pieces the preprocessing kernels share (preprocess/k_delta.cu,
// preprocess/qk_rule.cu): shared-memory addresses, ldmatrix, and mma.sync m16n8k16 with fp32
// accumulation on bf16 or fp16 operands.
#pragma once
#include <cstdint>
#include <type_traits>

#include "common/nvfp4.cuh"  // bf16_t, f16_t

namespace sageattn3 {

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// Four 8x8 16-bit matrices from shared memory: lane l gives the (16-byte aligned) address of row
// l % 8 of matrix l / 8 and receives r[j] = its 2 elements of matrix j (row l / 4, columns
// 2 (l % 4) and + 1); kTrans: of each matrix transposed.
template <bool kTrans = false>
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* p) {
#define SAGEATTN3_LDMATRIX_X4(kind)                                                              \
  asm volatile("ldmatrix.sync.aligned.m8n8.x4" kind ".shared.b16 {%0,%1,%2,%3}, [%4];\n"        \
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])                                  \
               : "r"(smem_addr(p)))
  if constexpr (kTrans) {
    SAGEATTN3_LDMATRIX_X4(".trans");
  } else {
    SAGEATTN3_LDMATRIX_X4("");
  }
#undef SAGEATTN3_LDMATRIX_X4
}

// d += a b, m16n8k16, a (4 registers) and b (b0, b1) of T, fp32 accumulation.
template <typename T>
__device__ __forceinline__ void mma_m16n8k16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  static_assert(std::is_same_v<T, bf16_t> || std::is_same_v<T, f16_t>, "bf16 or fp16 operands");
#define SAGEATTN3_MMA_M16N8K16(ty)                                                               \
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." ty "." ty                                \
               ".f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"                    \
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])                                  \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1))
  if constexpr (std::is_same_v<T, bf16_t>) {
    SAGEATTN3_MMA_M16N8K16("bf16");
  } else {
    SAGEATTN3_MMA_M16N8K16("f16");
  }
#undef SAGEATTN3_MMA_M16N8K16
}

}  // namespace sageattn3
