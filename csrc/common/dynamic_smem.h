// Host: the dynamic shared-memory opt-in of a kernel, made once per device. The
// attribute belongs to the device's context, so a process that launches on a second
// GPU must set it there too (a once-per-process flag would skip it, and the launch
// would fail there with too much shared memory requested).
#pragma once

#include <c10/cuda/CUDAException.h>
#include <c10/util/Exception.h>
#include <cuda_runtime.h>

#include <atomic>

namespace dsv4 {

constexpr int kMaxDevices = 64;

// The current device's index, checked against kMaxDevices (per-device host caches).
inline int current_device() {
  int dev = 0;
  C10_CUDA_CHECK(cudaGetDevice(&dev));
  TORCH_CHECK(dev >= 0 && dev < kMaxDevices, "dsv4: CUDA device ", dev, " is past the ", kMaxDevices,
              " devices dsv4 supports in one process");
  return dev;
}

// Sets kKernel's cudaFuncAttributeMaxDynamicSharedMemorySize to `bytes` on the current
// device, the first time it is called there. `bytes` must not change between calls for
// one kernel. Concurrent first calls on one device both set it (harmless).
template <auto kKernel>
void ensure_max_dynamic_smem(int bytes) {
  static std::atomic<bool> done[kMaxDevices];
  const int dev = current_device();
  if (done[dev].load(std::memory_order_acquire)) return;
  C10_CUDA_CHECK(cudaFuncSetAttribute(kKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
  done[dev].store(true, std::memory_order_release);
}

}  // namespace dsv4
