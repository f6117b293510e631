// Approximate math instructions (raw PTX), shared by the kernel families. Torch-free.
#pragma once

namespace dsv4 {

// 2^x, flushing subnormal inputs and results to zero.
__device__ __forceinline__ float ex2_approx_ftz(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// 1/x within 1 ulp, flushing subnormals to zero.
__device__ __forceinline__ float rcp_approx_ftz(float x) {
  float r;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
  return r;
}

}  // namespace dsv4
