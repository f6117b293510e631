// Register-level conversions shared by the kernel families: bf16 packing (round to
// nearest even) and the saturating e4m3 conversion. Torch-free.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <stdint.h>

namespace dsv4 {

// (lo, hi) -> one bf16x2 word, lo in the low half.
__device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}

// Eight floats -> eight bf16 in one 16-byte word, for vector stores.
__device__ __forceinline__ uint4 pack_bf16x8(const float* v) {
  return make_uint4(pack_bf16x2(v[0], v[1]), pack_bf16x2(v[2], v[3]), pack_bf16x2(v[4], v[5]),
                    pack_bf16x2(v[6], v[7]));
}

// acc[i] = fmaf(w, x[i], acc[i]) for the eight bf16 of one 16-byte word x, in element order:
// one slot's term of the MoE weighted combine (moe_combine_kernel, W4A8's slot_sum8).
__device__ __forceinline__ void fma_bf16x8(float (&acc)[8], float w, const uint4& x) {
  const __nv_bfloat162* h2 = reinterpret_cast<const __nv_bfloat162*>(&x);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = __bfloat1622float2(h2[i]);
    acc[2 * i] = fmaf(w, f.x, acc[2 * i]);
    acc[2 * i + 1] = fmaf(w, f.y, acc[2 * i + 1]);
  }
}

// A bf16x2 word as the vector type of the bf16 intrinsics.
__device__ __forceinline__ __nv_bfloat162 as_bf16x2(uint32_t w) { return *reinterpret_cast<const __nv_bfloat162*>(&w); }

// a * b per bf16 lane, rounded to nearest even (mul.rn.bf16x2, sm_90: one HMUL2.BF16;
// subnormals kept).
__device__ __forceinline__ uint32_t mul_bf16x2(uint32_t a, uint32_t b) {
  uint32_t d;
  asm("mul.rn.bf16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  return d;
}

// e4m3 of a float: round to nearest even, finite values saturating at +-448 (one
// cvt.rn.satfinite.e4m3x2.f32 on sm_89+).
__device__ __forceinline__ __nv_fp8_e4m3 e4m3_rn_satfinite(float v) {
  __nv_fp8_e4m3 s;
  s.__x = __nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3);
  return s;
}

// Two floats -> their two e4m3 bytes, lo in the low byte: e4m3_rn_satfinite of each, in
// one cvt.rn.satfinite.e4m3x2.f32.
__device__ __forceinline__ uint32_t e4m3x2_rn_satfinite(float lo, float hi) {
  return uint32_t(__nv_cvt_float2_to_fp8x2(make_float2(lo, hi), __NV_SATFINITE, __NV_E4M3));
}

}  // namespace dsv4
