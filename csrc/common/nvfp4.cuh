// NVFP4 encode on the device: the rules of dsv4.formats.quantize_nvfp4, computed
// cheaply but with the same result bit for bit (no fast-math anywhere), because
// the quantize op and the MoE epilogue are tested bit-exact against it.
#pragma once

#include <cuda_fp8.h>
#include <stdint.h>

namespace dsv4 {

// Magnitude codes 0..7 = {0, .5, 1, 1.5, 2, 3, 4, 6}: the grid step is 0.5 below
// 2, 1 in [2, 4) and 2 from 4 on. Scaling |y| by 2, 1 or 1/2 (exact) and adding
// 1.5 * 2^23 rounds it to an integer n in [0, 4] half-to-even; the code is n plus
// 0, 2 or 4, saturated at 7 (= 6.0). Ties: .25 -> 0, .75 -> 1, 1.25 -> 1,
// 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4. NaN (no ordered comparison holds) -> 0.
__device__ __forceinline__ uint32_t e2m1_code(float y) {
  const float t = fabsf(y);
  const float a = t < 8.0f ? t : (t >= 8.0f ? 8.0f : 0.0f);
  const bool ge2 = a >= 2.0f, ge4 = a >= 4.0f;
  const float n = fmaf(a, ge4 ? 0.5f : (ge2 ? 1.0f : 2.0f), 12582912.0f);
  const uint32_t mag = min((__float_as_uint(n) & 7u) + (ge4 ? 4u : (ge2 ? 2u : 0u)), 7u);
  return mag | (y < 0.0f ? 8u : 0u);
}

// Block scale for a 16-element block with absolute maximum `amax` under the
// dequant multiplier `g`: e4m3(min(amax / 6 / g, 448)), round-to-nearest-even.
__device__ __forceinline__ __nv_fp8_e4m3 nvfp4_block_scale(float amax, float g) {
  const float s = fminf((amax / 6.0f) / g, 448.0f);
  return __nv_fp8_e4m3(s);  // cvt.rn.satfinite on sm_89+
}

// The divisor d = scale * g of one block and its correctly rounded reciprocal.
struct Nvfp4Divisor {
  float denom, inv;
  bool fast;  // 2^-100 <= d <= 2^16: see nvfp4_encode8
};

__device__ __forceinline__ Nvfp4Divisor nvfp4_divisor(float scale, float g) {
  Nvfp4Divisor d;
  d.denom = scale * g;
  d.inv = __frcp_rn(d.denom);
  d.fast = d.denom >= 0x1p-100f && d.denom <= 0x1p16f;
  return d;
}

// Encodes 8 consecutive elements of a block into 8 nibbles, element 0 in the
// lowest nibble, for a block with nonzero scale.
//
// Exact rounding needs y = RN(x / d) per element; a division plus seven threshold
// tests per element made the quantizer compute bound. The fast path rounds
// q = x * RN(1/d) instead (within 2 ulp of y) with FMA-pipe arithmetic only, and
// the whole chunk falls back to exact division when any element lies so close to
// a rounding boundary that those 2 ulp could matter (a vanishing fraction of real
// chunks). 2^-100 <= d keeps every x that can reach a threshold normal; d <= 2^16
// keeps nonzero bf16 quotients from underflowing, so sign(q) = sign(y).
// NaN inputs give unspecified codes (the reference's scale is NaN there too).
__device__ __forceinline__ uint32_t nvfp4_encode8(const float (&x)[8], const Nvfp4Divisor& d) {
  if (d.fast) {
    constexpr float kBig = 0x1p100f, kMagic = 12582912.0f;  // 1.5 * 2^23
    float c[8], worst = 0.0f;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const float q = x[i] * d.inv;
      const float a = fminf(fabsf(q), 6.5f);
      // saturate(a * 2^100 - b * 2^100) is exactly 1 for a > b and 0 otherwise
      const float ge2 = __saturatef(fmaf(a, kBig, -0x1.fffffep0f * kBig));
      const float ge4 = __saturatef(fmaf(a, kBig, -0x1.fffffep1f * kBig));
      // grid step 0.5 / 1 / 2 below 2 / below 4 / above: scale onto integers
      const float v = a * fmaf(ge4, -0.5f, fmaf(ge2, -1.0f, 2.0f));
      const float n = (v + kMagic) - kMagic;  // round half to even
      worst = fmaxf(worst, fabsf(v - n));
      // twice, because a subnormal q times 2^100 is still below 1
      const float negative = __saturatef(__saturatef(q * -kBig) * kBig);
      c[i] = fmaf(negative, 8.0f, fmaf(ge2 + ge4, 2.0f, n));
    }
    if (worst < 0.5f - 0x1p-19f) {
      // four codes per float keep every partial sum an exact integer < 2^16
      const float lo = fmaf(c[3], 4096.0f, fmaf(c[2], 256.0f, fmaf(c[1], 16.0f, c[0] + kMagic)));
      const float hi = fmaf(c[7], 4096.0f, fmaf(c[6], 256.0f, fmaf(c[5], 16.0f, c[4] + kMagic)));
      return (__float_as_uint(lo) & 0xffffu) | (__float_as_uint(hi) << 16);
    }
  }
  uint32_t packed = 0;
#pragma unroll
  for (int i = 0; i < 8; ++i) packed |= e2m1_code(x[i] / d.denom) << (4 * i);
  return packed;
}

// `scale` is the decoded block scale; a zero scale (all-zero block, or underflow)
// gives code 0.
__device__ __forceinline__ uint32_t nvfp4_encode8(const float (&x)[8], float scale, float g) {
  if (scale == 0.0f) return 0u;
  return nvfp4_encode8(x, nvfp4_divisor(scale, g));
}

}  // namespace dsv4
