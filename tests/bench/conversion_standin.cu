// Timing harness of tests/bench/conversion_standin.py: the default preprocessing launches (V,
// then the sampled sums, the means and the Q/K launch with per-block Q means and the per-key
// correction), 1 x 24 heads x 32768 tokens x D 128 bf16, timed with CUDA events around calls
// made from C++ (no Python or dispatcher in the way). Prints one line of figures.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "sageattn3.h"

using namespace sageattn3;

namespace {

// Deterministic inputs: uniform values with one offset channel (something for the means to do).
__global__ void fill(__nv_bfloat16* x, int64_t n, uint32_t seed) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x) {
    uint32_t h = static_cast<uint32_t>(i) * 2654435761u ^ seed;
    h ^= h >> 13;
    h *= 0x5bd1e995u;
    h ^= h >> 15;
    const float u = static_cast<float>(h & 0xFFFFFF) / 16777216.f - 0.5f;
    x[i] = __float2bfloat16(3.f * u + (i % 128 == 5 ? 2.f : 0.f));
  }
}

bool ok(cudaError_t e, const char* what) {
  if (e != cudaSuccess) std::fprintf(stderr, "conversion_standin: %s: %s\n", what, cudaGetErrorString(e));
  return e == cudaSuccess;
}

template <class F>
float median_ms(F&& fn, int calls) {
  cudaEvent_t a, b;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  for (int w = 0; w < 3; ++w) fn();
  std::vector<float> t;
  for (int it = 0; it < 9; ++it) {
    cudaEventRecord(a);
    for (int c = 0; c < calls; ++c) fn();
    cudaEventRecord(b);
    cudaEventSynchronize(b);
    float ms = 0.f;
    cudaEventElapsedTime(&ms, a, b);
    t.push_back(ms / calls);
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  const char* tag = argc > 1 ? argv[1] : "";
  const int64_t G = 24, S = 32768, D = 128, n = G * S * D, nm = S / 128, ns = sampled_tiles(S);
  void *q, *k, *v, *src, *dst;
  uint8_t *qp, *qs, *kp, *ks, *vp, *vs, *kr;
  float *mq, *mk, *part_k, *part_q, *qbar, *dk;
  const size_t copy_bytes = size_t{1} << 30;
  if (!ok(cudaMalloc(&q, n * 2), "malloc") || !ok(cudaMalloc(&k, n * 2), "malloc") ||
      !ok(cudaMalloc(&v, n * 2), "malloc") || !ok(cudaMalloc(&qp, n / 2), "malloc") ||
      !ok(cudaMalloc(&qs, n / 16), "malloc") || !ok(cudaMalloc(&kp, n / 2), "malloc") ||
      !ok(cudaMalloc(&ks, n / 16), "malloc") || !ok(cudaMalloc(&vp, n / 2), "malloc") ||
      !ok(cudaMalloc(&vs, n / 16), "malloc") || !ok(cudaMalloc(&kr, n), "malloc") || !ok(cudaMalloc(&mq, G * nm * D * 4), "malloc") ||
      !ok(cudaMalloc(&mk, G * D * 4), "malloc") || !ok(cudaMalloc(&part_k, G * ns * D * 4), "malloc") ||
      !ok(cudaMalloc(&part_q, G * ns * D * 4), "malloc") || !ok(cudaMalloc(&qbar, G * D * 4), "malloc") ||
      !ok(cudaMalloc(&dk, G * S * 4), "malloc") || !ok(cudaMalloc(&src, copy_bytes), "malloc") ||
      !ok(cudaMalloc(&dst, copy_bytes), "malloc"))
    return 1;
  fill<<<1024, 256>>>(static_cast<__nv_bfloat16*>(q), n, 1);
  fill<<<1024, 256>>>(static_cast<__nv_bfloat16*>(k), n, 2);
  fill<<<1024, 256>>>(static_cast<__nv_bfloat16*>(v), n, 3);
  int err = 0;
  int8_t* ve = nullptr;
  if (!ok(cudaMalloc(&ve, G * (S / 128) * (D / 32)), "malloc")) return 1;
  // V as preprocess_qkv quantizes it: with its tile exponents (and without, the plain op)
  auto vq = [&] { err |= quant_fp4_cols(v, DType::kBFloat16, G, S, D, S, vp, vs, ve, nullptr); };
  auto vq_plain = [&] { err |= quant_fp4_cols(v, DType::kBFloat16, G, S, D, S, vp, vs, nullptr, nullptr); };
  auto qk = [&] {
    err |= smooth_quant_qk(q, k, DType::kBFloat16, G, S, G, S, D, mq, S, qp, qs, mk, part_k, S, kp, ks, false, false,
                           part_q, qbar, dk, nullptr, nullptr, kr, nullptr);
  };
  auto all = [&] { vq(); qk(); };
  all();
  if (!ok(cudaDeviceSynchronize(), "first call") || err) return 1;
  const float copy_ms = median_ms([&] { cudaMemcpyAsync(dst, src, copy_bytes, cudaMemcpyDeviceToDevice); }, 3);
  const double bw = 2.0 * copy_bytes / (copy_ms * 1e-3);  // read + write, bytes/s
  const double floor_ms = (3.0 * 2 * n + 3.0 * (n / 2 + n / 16)) / bw * 1e3;  // bench_kernels.py's floor
  const float t_v = median_ms(vq, 10), t_qk = median_ms(qk, 10), t_b2b = median_ms(all, 10), t_one = median_ms(all, 1);
  const float t_vp = median_ms(vq_plain, 10);
  if (!ok(cudaDeviceSynchronize(), "timing") || err) return 1;
  std::printf("%-9s floor %.3f ms | V %.3f ms (without its exponents %.3f ms), sums + means + Q/K %.3f ms | whole: "
              "back to back %.3f ms = %.2fx, one call %.3f ms = %.2fx\n",
              tag, floor_ms, t_v, t_vp, t_qk, t_b2b, t_b2b / floor_ms, t_one, t_one / floor_ms);
  return 0;
}
