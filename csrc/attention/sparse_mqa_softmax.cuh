// Sparse MQA forward: the consumers' per-thread softmax arithmetic on S / P / O fragments
// (torch-free), shared by sparse_mqa_fwd_kernel (64-key tiles, kN = 32 values of S per
// thread) and sparse_mqa_fwd_ring32_kernel (32-key sub-tiles, kN = 16).
//
// Fragment layout (wgmma's m64nNk16 accumulator, one warp's 16 rows): a thread holds rows
// r0 and r0 + 8; its value k is key 8 (k >> 2) + 2 quad + (k & 1) of row r0 + 8 ((k >> 1) & 1),
// so values 4j, 4j + 1 are row r0's and 4j + 2, 4j + 3 row r0 + 8's. O [rows x 256 d] uses
// the same pattern over its 128 values.
#pragma once

#include <cmath>
#include <cstdint>

#include "common/cvt.cuh"
#include "common/mma/mma_sync.cuh"
#include "common/ptx/math.cuh"
#include "common/ptx/sync.cuh"

namespace dsv4 {
namespace attention {

// Past this |row max| (scaled log2 units) the softmax rounds S * scale before subtracting the
// max instead of one FFMA: the FFMA's max-key exponent (the product's rounding error, up to
// 2^-12 here) then stays below bf16's half ulp of P = 1, so one visible key still gives its
// value row exactly (tests/test_attention.py test_decode_fp8_dequant_exact). Real logits are
// far below it.
constexpr float kFfmaMaxLogit = 4096.f;

// Skipped keys of S to -inf (bit `key` of `valid` clear; Mask: the tile's key mask type).
template <int kN, typename Mask>
__device__ __forceinline__ void mask_skipped_keys(float (&s)[kN], Mask valid, int quad) {
#pragma unroll
  for (int k = 0; k < kN; ++k) {
    const int key = 8 * (k >> 2) + 2 * quad + (k & 1);
    s[k] = ((valid >> key) & 1) ? s[k] : -INFINITY;
  }
}

// The tile's maxima of rows r0 / r0 + 8 over the quad (4 lanes share a row), as scaled log2
// logits: max(S) * scale is max(S * scale) exactly (scale > 0, and rounding keeps order).
template <int kN>
__device__ __forceinline__ void row_max_scaled(const float (&s)[kN], float scale_log2, float& mx0, float& mx1) {
  mx0 = -INFINITY;
  mx1 = -INFINITY;
#pragma unroll
  for (int j = 0; j < kN / 4; ++j) {
    mx0 = fmaxf(mx0, fmaxf(s[4 * j], s[4 * j + 1]));
    mx1 = fmaxf(mx1, fmaxf(s[4 * j + 2], s[4 * j + 3]));
  }
  mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 1));
  mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 2));
  mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 1));
  mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 2));
  mx0 *= scale_log2;
  mx1 *= scale_log2;
}

// O rows r0 / r0 + 8 times f0 / f1, skipped when every factor of the warp is 1 (the common
// case once the row maxima settle; multiplying by 1 changes nothing).
template <int kO>
__device__ __forceinline__ void rescale_rows(float (&o)[kO], float f0, float f1) {
  if (__all_sync(0xffffffffu, f0 == 1.f && f1 == 1.f)) return;
#pragma unroll
  for (int j = 0; j < kO / 4; ++j) {
    o[4 * j] *= f0;
    o[4 * j + 1] *= f0;
    o[4 * j + 2] *= f1;
    o[4 * j + 3] *= f1;
  }
}

// The online softmax step to the new row maxima mn0 / mn1: P = 2^(S * scale - new max) in s
// (one FFMA per element, as FlashMLA's softmax, instead of a multiply in the max and a
// subtraction here), the row sums l and O rescaled from the old maxima m to the new ones.
// A max of -inf (nothing visible yet) is used as 0 so no (-inf) - (-inf) appears; the factor
// from an old -inf max is 0 (nothing accumulated). fresh: O holds nothing of this item yet
// (set by its first PV), so no rescale (the factors are 0 there anyway).
template <int kN, int kO>
__device__ __forceinline__ void online_softmax(float (&s)[kN], float (&o)[kO], float& m0, float& m1, float& l0,
                                               float& l1, float mn0, float mn1, float sc, bool fresh) {
  const float ms0 = mn0 == -INFINITY ? 0.f : mn0;
  const float ms1 = mn1 == -INFINITY ? 0.f : mn1;
  const float a0 = ex2_approx_ftz(m0 - ms0), a1 = ex2_approx_ftz(m1 - ms1);
  m0 = mn0;
  m1 = mn1;
  float sum0 = 0.f, sum1 = 0.f;
  // The FFMA's exponent for the max key is the rounding error of max(S) * scale, up to
  // 2^-24 |max|: harmless for real logits, but at |max| ~ 2^30 it overflows 2^x or
  // flushes the whole row to 0 (the fp8 cache's scales reach 2^73). Past kFfmaMaxLogit
  // (warp-uniform) the exponent is the old scale-round-subtract, exact 0 at the max.
  if (__any_sync(0xffffffffu, fmaxf(fabsf(ms0), fabsf(ms1)) > kFfmaMaxLogit)) {
#pragma unroll
    for (int k = 0; k < kN; ++k) s[k] = __fmul_rn(s[k], sc);  // _rn: never contracted into the FFMA
#pragma unroll
    for (int j = 0; j < kN / 4; ++j) {
      s[4 * j] = ex2_approx_ftz(s[4 * j] - ms0);
      s[4 * j + 1] = ex2_approx_ftz(s[4 * j + 1] - ms0);
      s[4 * j + 2] = ex2_approx_ftz(s[4 * j + 2] - ms1);
      s[4 * j + 3] = ex2_approx_ftz(s[4 * j + 3] - ms1);
    }
  } else {
#pragma unroll
    for (int j = 0; j < kN / 4; ++j) {
      s[4 * j] = ex2_approx_ftz(fmaf(s[4 * j], sc, -ms0));
      s[4 * j + 1] = ex2_approx_ftz(fmaf(s[4 * j + 1], sc, -ms0));
      s[4 * j + 2] = ex2_approx_ftz(fmaf(s[4 * j + 2], sc, -ms1));
      s[4 * j + 3] = ex2_approx_ftz(fmaf(s[4 * j + 3], sc, -ms1));
    }
  }
#pragma unroll
  for (int j = 0; j < kN / 4; ++j) {
    sum0 += s[4 * j] + s[4 * j + 1];
    sum1 += s[4 * j + 2] + s[4 * j + 3];
  }
  l0 = l0 * a0 + sum0;
  l1 = l1 * a1 + sum1;
  if (!fresh) rescale_rows(o, a0, a1);
}

// P (rows r0 / r0 + 8 times c0 / c1) -> bf16 pairs in wgmma's A-fragment order: key step kk
// (16 keys) is pa[4 kk .. 4 kk + 3].
template <int kN>
__device__ __forceinline__ void pack_p_frag(uint32_t (&pa)[kN / 2], const float (&s)[kN], float c0, float c1) {
#pragma unroll
  for (int kk = 0; kk < kN / 8; ++kk) {
    pa[4 * kk + 0] = pack_bf16x2(s[8 * kk + 0] * c0, s[8 * kk + 1] * c0);
    pa[4 * kk + 1] = pack_bf16x2(s[8 * kk + 2] * c1, s[8 * kk + 3] * c1);
    pa[4 * kk + 2] = pack_bf16x2(s[8 * kk + 4] * c0, s[8 * kk + 5] * c0);
    pa[4 * kk + 3] = pack_bf16x2(s[8 * kk + 6] * c1, s[8 * kk + 7] * c1);
  }
}

// pa -> the warp's rows of a P tile in smem (K-major, 128-byte swizzle: the A operand of the
// other consumer's PV), by stmatrix.x4 instead of 32-bit stores (as FlashMLA stores P). Key
// step kk's four matrices are pa[4 kk + i]: rows 8 (i & 1) .. + 7 of the warp's 16, keys
// 16 kk + 8 (i >> 1) .. + 7, the 16-byte chunk 2 kk + (i >> 1) of each row, swizzled by the
// row (row & 7 is lane & 7 here). Lane l addresses row st_r = l & 7 of matrix st_i = l >> 3;
// st_row: that row's smem address.
template <int kPa>
__device__ __forceinline__ void store_p_frag(uint32_t st_row, int st_i, int st_r, const uint32_t (&pa)[kPa]) {
#pragma unroll
  for (int kk = 0; kk < kPa / 4; ++kk)
    stmatrix_x4(st_row + (((2 * kk + (st_i >> 1)) ^ st_r) << 4), pa[4 * kk], pa[4 * kk + 1], pa[4 * kk + 2],
                pa[4 * kk + 3]);
  fence_proxy_async_smem();
}

}  // namespace attention
}  // namespace dsv4
