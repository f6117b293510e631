// Register dequantization of the prepared NVFP4 weight tiles (params.cuh): one thread's
// code word and scale bytes -> its bf16 MMA A fragments, exact. Read by the NVFP4 GEMMs
// (nvfp4_gemm.cuh, nvfp4_gemm_ws.cuh). The generic helpers (copies, MMAs, fences,
// packing, PDL, the e2m1 value of a code) are in common/.
#pragma once

#include <stdint.h>

namespace dsv4 {
namespace moe {

// Bit layout of one prepared code word (the 8 elements of one thread's A fragment
// for one k16 step; see params.cuh). Fragment register p holds an (even, odd)
// element pair; each element's e2m1 code has bits s (sign), e1, e0 (exponent), m.
// The target of a pair is the bf16x2 word with s at bit 15/31 and (e1 e0 m) at bits
// 8..6 / 24..22 (kPairMask), which is the bf16 of e2m1 * 2^-126 (e2m1's subnormal 0.5
// lands on a bf16 subnormal). Pair 0 is stored as that pattern (one AND), pairs 1 and
// 2 as the pattern rotated right by 10 and 13 bits (a funnel shift and an AND each),
// and pair 3 fills the 8 bits left over: bits (m, e0, e1, s) at (3, 4, 0, 1) and
// (19, 20, 16, 17), which one multiply by 2^3 + 2^8 + 2^14 moves onto the pattern
// (the stray partial products miss kPairMask and never carry into it; checked for
// all 256 codes of the pair). 8 integer instructions per word instead of 11 with
// plain shifts: no 4 rotations of the pattern tile a word (exhaustive search).
// dsv4/formats/nvfp4_moe_layout.py (_BIT_POS) writes the same table.
constexpr uint32_t kPairMask = 0x81C081C0u;

// a * (the low (kHigh = 0) or high bf16 of s, broadcast to both halves). ptxas folds
// the broadcast into the multiply's operand swizzle (HMUL2 ... R.H0_H0 / R.H1_H1), so
// one scale word serves two rows for free.
template <int kHigh>
__device__ __forceinline__ uint32_t bf16x2_mul_bcast(uint32_t a, uint32_t s) {
  uint32_t r;
  if constexpr (kHigh == 0)
    asm("{\n.reg .b16 l, h;\n.reg .b32 b;\nmov.b32 {l, h}, %2;\nmov.b32 b, {l, l};\nmul.rn.bf16x2 %0, %1, b;\n}\n"
        : "=r"(r) : "r"(a), "r"(s));
  else
    asm("{\n.reg .b16 l, h;\n.reg .b32 b;\nmov.b32 {l, h}, %2;\nmov.b32 b, {h, h};\nmul.rn.bf16x2 %0, %1, b;\n}\n"
        : "=r"(r) : "r"(a), "r"(s));
  return r;
}

// A fragments of one k16 step from its code word and the scale word s (bf16 scale of
// row g in the low half, of row g+8 in the high half). Each product is e2m1 * block
// scale * 2^-7, exact in bf16.
__device__ __forceinline__ void dequant_kstep(uint32_t q, uint32_t s, uint32_t (&a)[4]) {
  a[0] = bf16x2_mul_bcast<0>(q & kPairMask, s);
  a[1] = bf16x2_mul_bcast<1>(__funnelshift_l(q, q, 10) & kPairMask, s);
  a[2] = bf16x2_mul_bcast<0>(__funnelshift_l(q, q, 13) & kPairMask, s);
  a[3] = bf16x2_mul_bcast<1>(((q & 0x001B001Bu) * 0x4108u) & kPairMask, s);
}

// Prepared scale bytes: b = 0 for a zero scale (its codes are zero), else
// b = (X + 10) << 3 | m for scale = 2^X * (1 + m/8) (every e4m3 value > 0, e4m3
// subnormals included, has X in [-9, 8]). Then (b << 4) + 0x7600 is the bf16 of
// scale * 2^119 (exponent field X + 246 <= 254). One PRMT spreads bytes kByte (row g)
// and kByte + 1 (row g+8) to the two halves, one IMAD adds the exponent offset.
template <int kByte>
__device__ __forceinline__ uint32_t scale_pair_bf16x2(uint32_t word) {
  const uint32_t b2 = __byte_perm(word, 0u, 0x4040u | ((kByte + 1) << 8) | kByte);
  return b2 * 16u + 0x76007600u;
}

// The 16-byte code chunk + 8 scale bytes of one thread -> its A fragments for the 4
// k16 steps of a 64-wide K tile.
__device__ __forceinline__ void dequant_tile(const uint4 codes, const uint2 sc, uint32_t (&a)[4][4]) {
  dequant_kstep(codes.x, scale_pair_bf16x2<0>(sc.x), a[0]);
  dequant_kstep(codes.y, scale_pair_bf16x2<2>(sc.x), a[1]);
  dequant_kstep(codes.z, scale_pair_bf16x2<0>(sc.y), a[2]);
  dequant_kstep(codes.w, scale_pair_bf16x2<2>(sc.y), a[3]);
}

}  // namespace moe
}  // namespace dsv4
