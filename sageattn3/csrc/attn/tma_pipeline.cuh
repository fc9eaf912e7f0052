// TMA (cp.async.bulk.tensor) loads and the mbarrier ring that feeds the consumer warps.
// Works on sm_90 and the sm_120 family alike (the MMA model flavour runs on sm_90a).
#pragma once
#include <cstdint>
#include <cuda.h>  // CUtensorMap (type only; the driver is reached through the runtime)

namespace sageattn3::attn {

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// ---- mbarrier -------------------------------------------------------------------------------
__device__ __forceinline__ void mbar_init(uint64_t* bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_u32(bar)), "r"(count) : "memory");
}

// Makes the initialised barriers visible to the async (TMA) proxy.
__device__ __forceinline__ void mbar_init_fence() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

__device__ __forceinline__ void mbar_arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_u32(bar)), "r"(bytes)
               : "memory");
}

__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(smem_u32(bar)) : "memory");
}

// Blocks until the phase with the given parity has completed.
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
  asm volatile(
      "{\n"
      ".reg .pred done;\n"
      "WAIT_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT_%=;\n"
      "}\n" ::"r"(smem_u32(bar)),
      "r"(parity)
      : "memory");
}

// ---- TMA ------------------------------------------------------------------------------------
__device__ __forceinline__ void tma_prefetch_desc(const CUtensorMap* map) {
  asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(map)) : "memory");
}

// 2D tile load: box at element coordinates (c0 = innermost, c1), completion counted on `bar`.
// Out-of-bounds elements are filled with zeros. The `.shared::cta` destination (PTX ISA 8.6): with
// `.shared::cluster`, ptxas 13.0 for sm_120a makes each load a call into an external routine, and a
// kernel with such a call keeps no setmaxnreg (ptxas C7506, "ignored to maintain compatibility
// into 'extern' call"), which the warp-specialized kernel needs.
__device__ __forceinline__ void tma_load_2d(void* dst, const CUtensorMap* map, uint64_t* bar, int c0, int c1) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cta.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4}], [%2];\n" ::"r"(
          smem_u32(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(smem_u32(bar)), "r"(c0), "r"(c1)
      : "memory");
}

// Stage ring bookkeeping: iteration n uses stage n % kStages and waits for phase parity
// (n / kStages) & 1 on the "full" barrier; the producer re-fills a stage once the "empty"
// barrier of its previous use has completed (parity flipped; the first round passes at once).
template <int kStages>
struct RingPos {
  uint32_t n = 0;
  __device__ __forceinline__ uint32_t stage() const { return n % kStages; }
  __device__ __forceinline__ uint32_t full_parity() const { return (n / kStages) & 1u; }
  __device__ __forceinline__ uint32_t empty_parity() const { return full_parity() ^ 1u; }
  __device__ __forceinline__ void advance() { ++n; }
};

}  // namespace sageattn3::attn
