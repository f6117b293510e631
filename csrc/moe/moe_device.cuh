// Device helpers of the NVFP4 MoE family: cp.async copies, wgmma fences and descriptors,
// and the e2m1 -> bf16 register dequantization.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <stdint.h>

#include "common/async_copy.cuh"  // smem_u32, cp_async_commit, cp_async_wait<N>
#include "common/wgmma_sync.cuh"

namespace dsv4 {
namespace moe {

__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src));
}
// src_bytes 0 writes 16 zero bytes (src must still be a valid address).
__device__ __forceinline__ void cp_async16_zfill(uint32_t dst, const void* src, uint32_t src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes));
}
__device__ __forceinline__ uint4 lds128(uint32_t addr) {
  uint4 v;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(addr));
  return v;
}
__device__ __forceinline__ uint2 lds64(uint32_t addr) {
  uint2 v;
  asm volatile("ld.shared.v2.u32 {%0, %1}, [%2];\n" : "=r"(v.x), "=r"(v.y) : "r"(addr));
  return v;
}

// Programmatic dependent launch: every kernel after the routing one is launched so
// that it may start while its predecessor drains; it waits for the predecessor's
// completion (and memory) before touching anything, then lets its own successor
// launch. Both are no-ops in a kernel launched without the attribute.
__device__ __forceinline__ void pdl_wait() { asm volatile("griddepcontrol.wait;\n" ::: "memory"); }
__device__ __forceinline__ void pdl_launch_dependents() { asm volatile("griddepcontrol.launch_dependents;\n" :::); }

// Keeps the compiler from moving accumulator reads/writes across the async MMAs.
template <int NA>
__device__ __forceinline__ void fence_acc(float (&d)[NA]) {
#pragma unroll
  for (int i = 0; i < NA; ++i) asm volatile("" : "+f"(d[i])::"memory");
}
__device__ __forceinline__ void fence_regs(uint32_t (&a)[4]) {
#pragma unroll
  for (int i = 0; i < 4; ++i) asm volatile("" : "+r"(a[i])::"memory");
}

// Shared-memory matrix descriptor of a K-major bf16 tile whose rows are 128 bytes
// (64 elements), stored with the 128-byte swizzle (16-byte chunk c of row r at chunk
// c ^ (r & 7)); 8-row groups are 1024 bytes apart. The tile must be 1024-aligned.
__device__ __forceinline__ uint64_t kmajor_sw128_desc(uint32_t saddr) {
  uint64_t d = 0;
  d |= uint64_t((saddr & 0x3FFFF) >> 4);
  d |= uint64_t(1) << 16;             // leading byte offset (unused with swizzle)
  d |= uint64_t(1024 >> 4) << 32;     // stride byte offset: 8 rows * 128 B
  d |= uint64_t(1) << 62;             // 128-byte swizzle
  return d;
}

__device__ __forceinline__ uint32_t bf16x2_mul(uint32_t a, uint32_t b) {
  uint32_t r;
  asm("mul.rn.bf16x2 %0, %1, %2;\n" : "=r"(r) : "r"(a), "r"(b));
  return r;
}

__device__ __forceinline__ uint32_t bf16x2_bits(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}

// Eight floats -> eight bf16 (round to nearest) in one 16-byte word, for vector stores.
__device__ __forceinline__ uint4 bf16x8_bits(const float* v) {
  return make_uint4(bf16x2_bits(v[0], v[1]), bf16x2_bits(v[2], v[3]), bf16x2_bits(v[4], v[5]),
                    bf16x2_bits(v[6], v[7]));
}

// Bit layout of one prepared code word (the 8 elements of one thread's A fragment
// for one k16 step; see moe_params.cuh). Fragment register p holds an (even, odd)
// element pair; each element's e2m1 code has bits s (sign), e1, e0 (exponent), m.
// The target of a pair is the bf16x2 word with s at bit 15/31 and (e1 e0 m) at bits
// 8..6 / 24..22, which is the bf16 of e2m1 * 2^-126 (e2m1's subnormal 0.5 lands on a
// bf16 subnormal). Pairs 0, 1, 2 are stored as that pattern shifted down by 0, 3, 6
// bits, so one shift and one AND restore them; pair 3 fills the 8 bits left over:
// m at 10/26, e0 at 11/27, e1 at 13/29, s at 14/30.
constexpr uint32_t kPairMask = 0x81C081C0u;

// A fragments of one k16 step from its code word and the two broadcast scales
// (rows g and g+8). Each product is e2m1 * block scale * 2^-7, exact in bf16.
__device__ __forceinline__ void dequant_kstep(uint32_t q, uint32_t s_lo, uint32_t s_hi, uint32_t (&a)[4]) {
  a[0] = bf16x2_mul(q & kPairMask, s_lo);
  a[1] = bf16x2_mul((q << 3) & kPairMask, s_hi);
  a[2] = bf16x2_mul((q << 6) & kPairMask, s_lo);
  const uint32_t p3 = ((q >> 4) & 0x00C000C0u) | ((q >> 5) & 0x01000100u) | ((q << 1) & 0x80008000u);
  a[3] = bf16x2_mul(p3, s_hi);
}

// Prepared scale bytes: b = 0 for a zero scale (its codes are zero), else
// b = (X + 10) << 3 | m for scale = 2^X * (1 + m/8) (every e4m3 value > 0, e4m3
// subnormals included, has X in [-9, 8]). Then (b << 4) + 0x7600 is the bf16 of
// scale * 2^119 (exponent field X + 246 <= 254). One PRMT broadcasts byte `sel` to
// both halves, one IMAD adds the exponent offset.
template <int kByte>
__device__ __forceinline__ uint32_t scale_bf16x2(uint32_t word) {
  const uint32_t b2 = __byte_perm(word, 0u, 0x4040u | (kByte << 8) | kByte);
  return b2 * 16u + 0x76007600u;
}

// The 16-byte code chunk + 8 scale bytes of one thread -> its A fragments for the 4
// k16 steps of a 64-wide K tile.
__device__ __forceinline__ void dequant_tile(const uint4 codes, const uint2 sc, uint32_t (&a)[4][4]) {
  dequant_kstep(codes.x, scale_bf16x2<0>(sc.x), scale_bf16x2<1>(sc.x), a[0]);
  dequant_kstep(codes.y, scale_bf16x2<2>(sc.x), scale_bf16x2<3>(sc.x), a[1]);
  dequant_kstep(codes.z, scale_bf16x2<0>(sc.y), scale_bf16x2<1>(sc.y), a[2]);
  dequant_kstep(codes.w, scale_bf16x2<2>(sc.y), scale_bf16x2<3>(sc.y), a[3]);
}

__device__ __forceinline__ float silu(float v) { return v / (1.0f + __expf(-v)); }

// Value of the e2m1 code in the low nibble of `code` (higher bits ignored).
__device__ __forceinline__ float e2m1_value(uint32_t code) {
  const uint32_t e = (code >> 1) & 3u, m = code & 1u;
  // e = 0: m * 0.5; else 2^(e-1) * (1 + m/2), built as fp32 bits.
  const float mag = e == 0 ? 0.5f * float(m) : __uint_as_float(((e + 126u) << 23) | (m << 22));
  return (code & 8u) ? -mag : mag;
}

}  // namespace moe
}  // namespace dsv4
