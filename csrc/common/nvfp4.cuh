// NVFP4 encode on the device: the rules of dsv4.formats.quantize_nvfp4, written so
// that every step rounds exactly as the float32 reference does (IEEE division, no
// fast-math), because the quantize op and the MoE epilogue are tested bit-exact.
#pragma once

#include <cuda_fp8.h>
#include <stdint.h>

namespace dsv4 {

// Magnitude codes 0..7 = {0, .5, 1, 1.5, 2, 3, 4, 6}; a sum of comparisons is
// round-to-nearest-even on that grid (ties at .25/1.25/2.5/5 go down, at
// .75/1.75/3.5 go up) and saturates at 6. NaN compares false everywhere: code 0.
__device__ __forceinline__ uint32_t e2m1_code(float y) {
  const float a = fabsf(y);
  const uint32_t mag = (a > 0.25f) + (a >= 0.75f) + (a > 1.25f) + (a >= 1.75f) +
                       (a > 2.5f) + (a >= 3.5f) + (a > 5.0f);
  return mag | (y < 0.0f ? 8u : 0u);
}

// Block scale for a 16-element block with absolute maximum `amax` under the
// dequant multiplier `g`: e4m3(min(amax / 6 / g, 448)), round-to-nearest-even.
__device__ __forceinline__ __nv_fp8_e4m3 nvfp4_block_scale(float amax, float g) {
  const float s = fminf((amax / 6.0f) / g, 448.0f);
  return __nv_fp8_e4m3(s);  // cvt.rn.satfinite on sm_89+
}

// RN(x / d) given y = RN(1 / d), as far as an e2m1 code can tell, without a full
// IEEE division per element: two Markstein corrections (the residual x - d*q is
// exact under FMA; once q is within 1 ulp, RN(q + r*y) is the correctly rounded
// quotient). A first estimate beyond 8 (or inf: overflow, where the corrections
// would make NaN) already saturates the code, so it is returned as is.
__device__ __forceinline__ float div_rn_with_reciprocal(float x, float d, float y) {
  const float q0 = x * y;
  float q = fmaf(fmaf(-d, q0, x), y, q0);
  q = fmaf(fmaf(-d, q, x), y, q);
  return fabsf(q0) > 8.0f ? q0 : q;
}

// Encodes 8 consecutive elements of a block (the other 8 belong to the partner
// thread) into 8 nibbles, element 0 in the lowest nibble. `scale` is the decoded
// block scale; a zero scale (all-zero block, or underflow) gives code 0.
__device__ __forceinline__ uint32_t nvfp4_encode8(const float (&x)[8], float scale, float g) {
  if (scale == 0.0f) return 0u;
  const float denom = scale * g;
  const float inv = __frcp_rn(denom);
  uint32_t packed = 0;
#pragma unroll
  for (int i = 0; i < 8; ++i) packed |= e2m1_code(div_rn_with_reciprocal(x[i], denom, inv)) << (4 * i);
  return packed;
}

}  // namespace dsv4
