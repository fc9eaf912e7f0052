// The probe op: one block-scaled FP4 MMA per problem, to check the fragment and scale layouts
// (csrc/attn/mma_probe.cu).
#pragma once

#include <cstdint>
#include <initializer_list>

#include "attn/attn_api.h"
#include "torch/checks.h"

namespace sageattn3::torch_ops {

// fp4_mma_probe(a, b, sfa, sfb, c, d!, tid_a, tid_b): one block-scaled FP4 MMA per problem
// (a (n,16,32), b (n,8,32), sfa (n,16,4), sfb (n,8,4) bytes; c, d (n,16,8) fp32).
template <class T>
void fp4_mma_probe(T a, T b, T sfa, T sfb, T c, T d, int64_t tid_a, int64_t tid_b) {
  check_cuda(a, a, "a");
  for (const T* t : {&b, &sfa, &sfb, &c, &d}) check_cuda(*t, a, "a probe operand");
  for (const T* t : {&a, &b, &sfa, &sfb}) check_bytes(*t, "a probe operand");
  check_f32(c, "c");
  check_f32(d, "d");
  const int64_t n = a.numel() / (16 * 32);
  SA3_CHECK(T, a.numel() == n * 512 && b.numel() == n * 256 && sfa.numel() == n * 64 && sfb.numel() == n * 32 &&
                   c.numel() == n * 128 && d.numel() == n * 128,
            "sageattn3: fp4_mma_probe operand sizes: expected a (n,16,32), b (n,8,32), sfa (n,16,4), sfb (n,8,4), "
            "c and d (n,16,8) with n = ", n, ", got ", shape(a), ", ", shape(b), ", ", shape(sfa), ", ", shape(sfb),
            ", ", shape(c), " and ", shape(d));
  SA3_CHECK(T, tid_a >= 0 && tid_a < 2 && tid_b >= 0 && tid_b < 4,
            "sageattn3: tid_a in [0,2), tid_b in [0,4), got ", tid_a, " and ", tid_b);
  DeviceScope scope(device_index(a));
  check_cuda_kernel<T>(sageattn3::fp4_mma_probe(bytes(a), bytes(b), bytes(sfa), bytes(sfb), floats(c), floats(d),
                                                static_cast<int>(n), static_cast<int>(tid_a), static_cast<int>(tid_b),
                                                TensorApi<T>::stream(a)),
                       "fp4_mma_probe");
}

}  // namespace sageattn3::torch_ops
