// NVFP4 encode on the device: the rules of dsv4.formats.quantize_nvfp4, computed
// cheaply but with the same result bit for bit (no fast-math anywhere), because
// the quantize op and the MoE epilogue are tested bit-exact against it.
#pragma once

#include <cuda_bf16.h>
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

// Encoding bf16 inputs by per-block thresholds.
//
// For a fixed divisor d the code magnitude is a monotone step function of |x|, and x
// is bf16, so "y = RN(x / d) rounds to code >= k" is exactly "|x| >= T_k" for seven
// bf16 values T_k that depend on d only. Computing them once per block (in double,
// where m * d is exact) turns the per-element work into packed bf16x2 compares
// and adds (about half the instructions of nvfp4_encode8), bit-identical by
// construction.
//
// Boundary k of the e2m1 grid sits at t_k = .25 .75 1.25 1.75 2.5 3.5 5; ties at
// .75, 1.75 and 3.5 go up (to the even code), the others down. With y = RN_f32(q),
// q = |x| / d: y > t  <=>  q > t + ulp(t)/2, and y >= t  <=>  q >= t - ulp(t)/2
// (each t has an even last mantissa bit, so the f32 tie goes to t). ulp(t)/2 =
// 2^(exponent(t) - 24).
struct Nvfp4Thresholds {
  uint32_t t[7];  // T_1..T_7, each replicated into both halves of a bf16x2 word
};

// Smallest bf16 (bit pattern, replicated) above P (strict) or at or above P, for a
// positive P in the normal f32 range: floor to bf16 by truncating the double's
// high word, then step up one bf16 ulp unless P is a bf16 value and the bound is
// not strict.
__device__ __forceinline__ uint32_t nvfp4_bf16_bound(double P, bool strict) {
  const uint32_t hi = uint32_t(__double2hiint(P)), lo = uint32_t(__double2loint(P));
  uint32_t t = (hi >> 13) - (uint32_t(1023 - 127) << 7);
  t += strict ? 1u : uint32_t(((hi & 0x1fffu) | lo) != 0u);
  return t * 0x10001u;
}

// Only for 2^-100 <= denom <= 2^16 (as Nvfp4Divisor::fast): every product below is
// then a normal f32 magnitude, and no nonzero x / d underflows to a signed zero,
// so the code's sign bit is simply x < 0.
__device__ __forceinline__ Nvfp4Thresholds nvfp4_thresholds(float denom) {
  const double d = double(denom);
  Nvfp4Thresholds T;
  T.t[0] = nvfp4_bf16_bound((0.25 + 0x1p-26) * d, true);
  T.t[1] = nvfp4_bf16_bound((0.75 - 0x1p-25) * d, false);
  T.t[2] = nvfp4_bf16_bound((1.25 + 0x1p-24) * d, true);
  T.t[3] = nvfp4_bf16_bound((1.75 - 0x1p-24) * d, false);
  T.t[4] = nvfp4_bf16_bound((2.5 + 0x1p-23) * d, true);
  T.t[5] = nvfp4_bf16_bound((3.5 - 0x1p-23) * d, false);
  T.t[6] = nvfp4_bf16_bound((5.0 + 0x1p-22) * d, true);
  return T;
}

__device__ __forceinline__ __nv_bfloat162 as_bf16x2(uint32_t w) { return *reinterpret_cast<const __nv_bfloat162*>(&w); }

// One bf16x2 word (elements 2i, 2i+1) -> their codes in the low byte of each half.
// Each bound passed adds 1.0 (bf16 set-on-compare), accumulated from 128 (+8 for
// x < 0, which excludes -0 as the reference does): 128 + c is exact in bf16 for
// c <= 15, so the code is the low byte. The adds run on the FMA pipes; a binary
// search over the bounds with bit selects (3 compares + 7 LOP3 per word) was 5%
// slower because the integer pipe was the limit (docs/perf-history/notebook-2026.md, quantize_nvfp4).
__device__ __forceinline__ uint32_t nvfp4_pair_codes(uint32_t w, const Nvfp4Thresholds& T) {
  const __nv_bfloat162 x = as_bf16x2(w), a = __habs2(x);
  __nv_bfloat162 acc = __hfma2(__hlt2(x, __float2bfloat162_rn(0.0f)), __float2bfloat162_rn(8.0f),
                               __float2bfloat162_rn(128.0f));
#pragma unroll
  for (int k = 0; k < 7; ++k) acc = __hadd2(acc, __hge2(a, as_bf16x2(T.t[k])));
  return *reinterpret_cast<const uint32_t*>(&acc);
}

// Four bf16x2 words (8 consecutive elements) -> 8 nibbles, element 0 lowest.
__device__ __forceinline__ uint32_t nvfp4_encode8_bf16(const uint32_t (&w)[4], const Nvfp4Thresholds& T) {
  const uint32_t v0 = nvfp4_pair_codes(w[0], T), v1 = nvfp4_pair_codes(w[1], T);
  const uint32_t v2 = nvfp4_pair_codes(w[2], T), v3 = nvfp4_pair_codes(w[3], T);
  const uint32_t p01 = __byte_perm(v0, v1, 0x6240), p23 = __byte_perm(v2, v3, 0x6240);
  const uint32_t even = __byte_perm(p01, p23, 0x5410), odd = __byte_perm(p01, p23, 0x7632);
  return odd * 16u + even;  // no carries: every byte of `even` is < 16
}

// `scale` is the decoded block scale; a zero scale (all-zero block, or underflow)
// gives code 0.
__device__ __forceinline__ uint32_t nvfp4_encode8(const float (&x)[8], float scale, float g) {
  if (scale == 0.0f) return 0u;
  return nvfp4_encode8(x, nvfp4_divisor(scale, g));
}

}  // namespace dsv4
