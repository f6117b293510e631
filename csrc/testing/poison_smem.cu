// Test-only op dsv4_testing::poison_shared_memory(pattern): fills the dynamic shared memory of
// every SM with a 32-bit pattern on the current stream. Shared memory keeps its bytes from one
// kernel to the next, so the kernel launched after this one starts on that pattern wherever it
// reads shared memory it did not write (tests/test_attention.py, tests/test_fmha.py: skipped KV
// entries, stale tiles). Its own library namespace keeps it out of the dsv4 op set.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <torch/library.h>

#include <cstdint>

namespace dsv4 {
namespace testing {
namespace {

__global__ void poison_shared_memory_kernel(uint32_t pattern, int words) {
  extern __shared__ uint32_t smem[];
  volatile uint32_t* s = smem;  // volatile: stores that nothing in this kernel reads stay
  for (int i = threadIdx.x; i < words; i += blockDim.x) s[i] = pattern;
}

void poison_shared_memory(int64_t pattern) {
  TORCH_CHECK(pattern >= 0 && pattern <= int64_t(UINT32_MAX), "dsv4: pattern must be a 32-bit unsigned value, got ",
              pattern);
  const cudaDeviceProp* prop = at::cuda::getCurrentDeviceProperties();
  const int bytes = static_cast<int>(prop->sharedMemPerBlockOptin);
  C10_CUDA_CHECK(
      cudaFuncSetAttribute(poison_shared_memory_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
  // At the largest dynamic size one CTA fits an SM at a time: 2 per SM reach every SM.
  poison_shared_memory_kernel<<<2 * prop->multiProcessorCount, 1024, bytes, at::cuda::getCurrentCUDAStream()>>>(
      static_cast<uint32_t>(pattern), bytes / 4);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace
}  // namespace testing
}  // namespace dsv4

// No tensor argument, so the function is the op's only kernel (runs on the current device).
TORCH_LIBRARY(dsv4_testing, m) {
  m.def("poison_shared_memory(int pattern) -> ()", &dsv4::testing::poison_shared_memory);
}
