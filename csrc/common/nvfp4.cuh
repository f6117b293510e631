// NVFP4 activation encode on the device, with the instruction sequence of Blackwell
// deployments (DESIGN section 2; vLLM's cvt_warp_fp16_to_fp4, FlashInfer,
// TensorRT-LLM). With g the dequant global scale and G = 1/g the encode scale, per
// block of 16:
//   s = cvt.rn.satfinite.e4m3(G * (amax * rcp(6)))
//   r = s == 0 ? 0 : rcp(float(s) * rcp(G))
//   code = RN-even onto the e2m1 grid of x * r, saturating at 6
// with rcp = rcp.approx.ftz.f32. sm_90 has no cvt to e2m1, so the last step is done
// in software, exactly (nvfp4_encode8, or per-block thresholds in nvfp4_thresholds).
// dsv4.reference.quantize_nvfp4 is the same rule with exact IEEE reciprocals; the codes
// can differ from it only where x * r lies within a few ulps of a rounding tie
// (rcp.approx is within 1 ulp; tests/test_quantize.py counts those cases). No
// fast-math anywhere: every product below is a plain RN float32 multiply.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <stdint.h>

#include "common/cvt.cuh"       // as_bf16x2, e4m3_rn_satfinite
#include "common/ptx/math.cuh"  // rcp_approx_ftz

namespace dsv4 {

// The per-call constants of one global scale: G = 1/g is the IEEE reciprocal, as
// vLLM computes it once at load (1.0 / input_scale); rcp(G) and rcp(6) are
// rcp.approx, evaluated at run time as the Blackwell kernel does.
struct Nvfp4Encoder {
  float G, rcp_G, rcp6;
};

__device__ __forceinline__ Nvfp4Encoder nvfp4_encoder(float g) {
  Nvfp4Encoder e;
  e.G = __frcp_rn(g);
  e.rcp_G = rcp_approx_ftz(e.G);
  e.rcp6 = rcp_approx_ftz(6.0f);
  return e;
}

// Block scale of a 16-element block with absolute maximum `amax`.
__device__ __forceinline__ __nv_fp8_e4m3 nvfp4_block_scale(float amax, const Nvfp4Encoder& e) {
  return e4m3_rn_satfinite(__fmul_rn(e.G, __fmul_rn(amax, e.rcp6)));
}

// d = float(s) * rcp(G), the dequant divisor of a block with decoded scale s, and its
// reciprocal r (0 for a zero scale: an all-zero block, or a scale that underflowed).
__device__ __forceinline__ float nvfp4_block_divisor(float scale, const Nvfp4Encoder& e) {
  return __fmul_rn(scale, e.rcp_G);
}

__device__ __forceinline__ float nvfp4_block_recip(float scale, const Nvfp4Encoder& e) {
  return scale != 0.0f ? rcp_approx_ftz(nvfp4_block_divisor(scale, e)) : 0.0f;
}

// Encodes 8 consecutive elements of a block into 8 nibbles, element 0 in the lowest
// nibble: the e2m1 code of y = x * r, round-to-nearest-even, |y| > 6 (inf too)
// saturating to 6, sign bit = (y < 0) (so -0.0 and r = 0 give code 0, as
// dsv4.formats.round_to_e2m1). NaN gives an unspecified code. FMA-pipe arithmetic
// only: the grid step is 0.5 below 2, 1 in [2, 4) and 2 from 4 on; scaling |y| by 2,
// 1 or 1/2 (exact) and adding 1.5 * 2^23 rounds it half-to-even to an integer n in
// [0, 4]; the code is n plus 0, 2 or 4. Ties: .25 -> 0, .75 -> 1, 1.25 -> 1,
// 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4.
__device__ __forceinline__ uint32_t nvfp4_encode8(const float (&x)[8], float r) {
  constexpr float kBig = 0x1p100f, kMagic = 12582912.0f;  // 1.5 * 2^23
  float c[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const float q = __fmul_rn(x[i], r);
    const float a = fminf(fabsf(q), 6.5f);
    // saturate(a * 2^100 - b * 2^100) is exactly 1 for a > b and 0 otherwise
    const float ge2 = __saturatef(fmaf(a, kBig, -0x1.fffffep0f * kBig));
    const float ge4 = __saturatef(fmaf(a, kBig, -0x1.fffffep1f * kBig));
    const float v = a * fmaf(ge4, -0.5f, fmaf(ge2, -1.0f, 2.0f));
    const float n = (v + kMagic) - kMagic;  // round half to even
    // twice, because a subnormal q times 2^100 is still below 1
    const float negative = __saturatef(__saturatef(q * -kBig) * kBig);
    c[i] = fmaf(negative, 8.0f, fmaf(ge2 + ge4, 2.0f, n));
  }
  // four codes per float keep every partial sum an exact integer < 2^16
  const float lo = fmaf(c[3], 4096.0f, fmaf(c[2], 256.0f, fmaf(c[1], 16.0f, c[0] + kMagic)));
  const float hi = fmaf(c[7], 4096.0f, fmaf(c[6], 256.0f, fmaf(c[5], 16.0f, c[4] + kMagic)));
  return (__float_as_uint(lo) & 0xffffu) | (__float_as_uint(hi) << 16);
}

// The value of the e2m1 code in the low nibble of `code` (higher bits ignored): the
// element format of NVFP4 and MXFP4 alike. Used where codes are expanded on the device
// (the MoE's activation gather and GEMM1 epilogue, the MXFP4 W4A8 shift tables).
__device__ __forceinline__ float e2m1_value(uint32_t code) {
  const uint32_t e = (code >> 1) & 3u, m = code & 1u;
  // e = 0: m * 0.5; else 2^(e-1) * (1 + m/2), built as fp32 bits.
  const float mag = e == 0 ? 0.5f * float(m) : __uint_as_float(((e + 126u) << 23) | (m << 22));
  return (code & 8u) ? -mag : mag;
}

// Encoding bf16 inputs by per-block thresholds (the quantize op's fast path).
//
// For a fixed r the code magnitude of RN(x * r) is a monotone step function of |x|,
// and x is bf16, so "code >= k" is exactly "|x| >= T_k" for seven bf16 values T_k
// that depend on r only. Computing them once per block turns the per-element work
// into packed bf16x2 compares and adds, bit-identical to nvfp4_encode8 by
// construction.
//
// Boundary k of the e2m1 grid sits at t_k = .25 .75 1.25 1.75 2.5 3.5 5; ties at .75,
// 1.75 and 3.5 go up (to the even code), the others down: x passes boundary k iff
// RN(x * r) > t_k (ties down) or >= t_k (ties up), which is what nvfp4_bound
// evaluates. The real threshold theta_k (the least x that passes) is within 2^-21
// relative of c = RN(t_k * d), as r = rcp(d) is within 1 ulp of 1/d, while bf16 values
// are more than 2^-8 relative apart: so no bf16 value lies between theta_k and c
// unless it is a nearest one to c, V, and T_k is V if V passes, the bf16 value
// above V otherwise.
struct Nvfp4Thresholds {
  uint32_t t[7];  // T_1..T_7, each replicated into both halves of a bf16x2 word
};

// V is found on the FMA pipes (the quantizer is bound by the integer pipe): Veltkamp's
// split c * (2^16 + 1) - (c * (2^16 + 1) - c) rounds c to its nearest 8-significant-bit
// value, a bf16 value (ties either way, which the argument above allows); the
// threshold word is V's high half replicated, plus one bf16 step when V fails.
template <bool kTieDown>
__device__ __forceinline__ uint32_t nvfp4_bound(float t, float d, float r) {
  const float c = __fmul_rn(t, d);
  const float big = __fmul_rn(c, 65537.0f);
  const float v = __fsub_rn(big, __fsub_rn(big, c));
  const float y = __fmul_rn(v, r);
  const bool pass = kTieDown ? y > t : y >= t;
  return __byte_perm(__float_as_uint(v) + (pass ? 0u : 0x10000u), 0u, 0x3232);
}

// Only for 2^-100 <= d <= 2^16: every c above and every product y near a boundary is
// then a normal f32, and no nonzero bf16 x gives x * r == 0, so the code's sign bit
// is simply x < 0.
__device__ __forceinline__ Nvfp4Thresholds nvfp4_thresholds(float d, float r) {
  Nvfp4Thresholds T;
  T.t[0] = nvfp4_bound<true>(0.25f, d, r);
  T.t[1] = nvfp4_bound<false>(0.75f, d, r);
  T.t[2] = nvfp4_bound<true>(1.25f, d, r);
  T.t[3] = nvfp4_bound<false>(1.75f, d, r);
  T.t[4] = nvfp4_bound<true>(2.5f, d, r);
  T.t[5] = nvfp4_bound<false>(3.5f, d, r);
  T.t[6] = nvfp4_bound<true>(5.0f, d, r);
  return T;
}

__device__ __forceinline__ bool nvfp4_thresholds_exact(float d) { return d >= 0x1p-100f && d <= 0x1p16f; }

// One bf16x2 word (elements 2i, 2i+1) -> their codes in the low byte of each half.
// Each bound passed adds 1.0 (bf16 set-on-compare), accumulated from 128 (+8 for
// x < 0, which excludes -0 as nvfp4_encode8 does): 128 + c is exact in bf16 for
// c <= 15, so the code is the low byte. The adds run on the FMA pipes; a binary
// search over the bounds with bit selects (3 compares + 7 LOP3 per word) was 5%
// slower because the integer pipe was the limit
// (docs/perf-history/2026-11-30-quantize-nvfp4.md).
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

}  // namespace dsv4
