// Small host helpers shared by the launchers.
#pragma once
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cuda_runtime_api.h>
#include <mutex>

namespace sageattn3 {

// Devices whose answers the per-device caches below keep (a device past them is asked every time).
constexpr int kCachedDevices = 64;

// One int per device, 0 until set: what the runtime answered once for that device. Lock-free to
// read; set by whoever first got an answer (every writer stores the same answer, or see KernelSetup).
class PerDevice {
 public:
  int get(int dev) const { return cached(dev) ? slots_[dev].load(std::memory_order_acquire) : 0; }
  void set(int dev, int value) {
    if (cached(dev)) slots_[dev].store(value, std::memory_order_release);
  }
  static bool cached(int dev) { return dev >= 0 && dev < kCachedDevices; }

 private:
  std::atomic<int> slots_[kCachedDevices] = {};
};

// The current device, or -1 where the runtime cannot say.
inline int current_device() {
  int dev = -1;
  return cudaGetDevice(&dev) == cudaSuccess ? dev : -1;
}

// Multiprocessor count of the current device (looked up once per device; 132 where the runtime
// cannot say).
inline int sm_count() {
  static PerDevice cache;
  const int dev = current_device();
  int n = cache.get(dev);
  if (n > 0) return n;
  if (dev < 0 || cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess || n <= 0) return 132;
  cache.set(dev, n);
  return n;
}

// The host set-up one kernel needs before its launches, asked of the runtime once per device
// rather than per launch: each launcher keeps one as a static of the kernel instantiation it
// launches. Both answers belong to the device (its primary context), hence the per-device tables.
// A failure is returned to the caller and never cached: the next launch asks again.
class KernelSetup {
 public:
  // cudaFuncSetAttribute(kernel, MaxDynamicSharedMemorySize, bytes) on the current device, unless
  // an earlier call set `bytes` or more there (the attribute is a ceiling). Raising it is
  // serialised, so the ceiling recorded is never above the one set.
  template <class Kernel>
  cudaError_t smem(Kernel kernel, int bytes) {
    const int dev = current_device();
    if (smem_.get(dev) >= bytes) return cudaSuccess;
    std::lock_guard<std::mutex> lock(mu_);
    if (smem_.get(dev) >= bytes) return cudaSuccess;
    const cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
    if (err == cudaSuccess) smem_.set(dev, bytes);
    return err;
  }
  // cudaOccupancyMaxActiveBlocksPerMultiprocessor(per_sm, kernel, threads, bytes) on the current
  // device, asked once per device: a launcher's kernel always launches with the same threads and
  // dynamic shared memory per block.
  template <class Kernel>
  cudaError_t blocks_per_sm(int* per_sm, Kernel kernel, int threads, size_t bytes) {
    const int dev = current_device();
    const int known = per_sm_.get(dev);  // the answer + 1 (0: not asked yet)
    if (known > 0) {
      *per_sm = known - 1;
      return cudaSuccess;
    }
    const cudaError_t err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(per_sm, kernel, threads, bytes);
    if (err == cudaSuccess && *per_sm >= 0) per_sm_.set(dev, *per_sm + 1);
    return err;
  }

 private:
  PerDevice smem_, per_sm_;
  std::mutex mu_;
};

__host__ __device__ inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

}  // namespace sageattn3
