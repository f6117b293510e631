// Registers (sm_90): reallocation between warpgroups, and fences that pin register
// values in place around asynchronous MMAs. Torch-free.
#pragma once

#include <cstdint>

namespace dsv4 {

// ---- register reallocation between warpgroups ------------------------------------
template <int N>
__device__ __forceinline__ void setmaxnreg_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N));
}
template <int N>
__device__ __forceinline__ void setmaxnreg_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N));
}

// ---- register fences -------------------------------------------------------------
// Keep the compiler from moving reads and writes of a wgmma accumulator or A fragment
// across the (asynchronous) issue and wait points: the wgmma reads and writes these
// registers after the issuing instruction has retired.
__device__ __forceinline__ void fence_reg(float& r) { asm volatile("" : "+f"(r)::"memory"); }
__device__ __forceinline__ void fence_reg(uint32_t& r) { asm volatile("" : "+r"(r)::"memory"); }
template <typename T, int N>
__device__ __forceinline__ void fence_regs(T (&r)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) fence_reg(r[i]);
}

}  // namespace dsv4
