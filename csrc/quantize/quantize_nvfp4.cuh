// bf16 [M, K] -> NVFP4: packed e2m1 codes uint8 [M, K/2] (low nibble = even
// element) and e4m3 block scales [M, K/16], both row-major and dense. This is the
// activation layout the NVFP4 MoE kernels read.
//
// Numerics: the Blackwell rule of common/nvfp4.cuh (docs/design.md, section 2). Memory
// bound in bytes, but exact e2m1 rounding in software is instruction bound per
// element: the codes come from per-block bf16 thresholds (nvfp4_thresholds), which
// roughly halves the per-element work (docs/perf-history/2026-11-30-quantize-nvfp4.md).
#pragma once

#include <cuda_bf16.h>
#include <stdint.h>

#include "common/fast_divmod.cuh"
#include "common/nvfp4.cuh"

namespace dsv4 {

struct QuantizeNvfp4Params {
  const __nv_bfloat16* x;  // [M, K], row stride x_row_stride elements, unit column stride
  const float* global_scale;  // 1 element, the dequant multiplier g
  uint32_t* codes;            // [M, K/8] words = [M, K/2] bytes
  __nv_fp8_e4m3* scales;      // [M, K/16]
  uint32_t blocks;            // M * K / 16 (< 2^32, checked by the launcher)
  FastDivmod blocks_per_row;  // K / 16
  int64_t x_row_stride;
};

// Encodes block b from its 16 bf16 values (8 bf16x2 words) and stores its codes
// and scale.
__device__ __forceinline__ void encode_block(const QuantizeNvfp4Params& p, uint32_t b, const uint32_t* w,
                                             const Nvfp4Encoder& enc) {
  // bf16 max is exact, so the amax can be taken on packed pairs
  __nv_bfloat162 m2 = __habs2(as_bf16x2(w[0]));
#pragma unroll
  for (int i = 1; i < 8; ++i) m2 = __hmax2(m2, __habs2(as_bf16x2(w[i])));
  const float amax = fmaxf(__low2float(m2), __high2float(m2));
  const __nv_fp8_e4m3 s = nvfp4_block_scale(amax, enc);
  uint2 word = make_uint2(0, 0);
  if (float(s) != 0.0f) {
    const float d = nvfp4_block_divisor(float(s), enc), r = rcp_approx_ftz(d);
    if (nvfp4_thresholds_exact(d)) {
      const Nvfp4Thresholds T = nvfp4_thresholds(d, r);
      const uint32_t w0[4] = {w[0], w[1], w[2], w[3]}, w1[4] = {w[4], w[5], w[6], w[7]};
      word = make_uint2(nvfp4_encode8_bf16(w0, T), nvfp4_encode8_bf16(w1, T));
    } else {
      // divisors outside [2^-100, 2^16]: the product per element
      float v[2][8];
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const float2 f = __bfloat1622float2(as_bf16x2(w[i]));
        v[i / 4][2 * (i % 4)] = f.x;
        v[i / 4][2 * (i % 4) + 1] = f.y;
      }
      word = make_uint2(nvfp4_encode8(v[0], r), nvfp4_encode8(v[1], r));
    }
  }
  reinterpret_cast<uint2*>(p.codes)[b] = word;
  p.scales[b] = s;
}

// One thread per 16-element block: the per-block work (amax, scale, thresholds)
// is done once, and the thread loads its next blocks before encoding the current
// ones so that enough bytes stay in flight while it computes.
template <bool kContiguous>
__device__ __forceinline__ void load_block(const QuantizeNvfp4Params& p, uint32_t b, uint4 (&raw)[2]) {
  raw[0] = raw[1] = make_uint4(0, 0, 0, 0);
  if (b >= p.blocks) return;
  int64_t offset = int64_t(b) * 16;
  if constexpr (!kContiguous) {
    uint32_t row, col;
    p.blocks_per_row.divmod(b, row, col);
    offset = int64_t(row) * p.x_row_stride + col * 16;
  }
  const uint4* src = reinterpret_cast<const uint4*>(p.x + offset);
  raw[0] = __ldg(src);
  raw[1] = __ldg(src + 1);
}

template <int kThreads, int kUnroll, bool kContiguous>
__global__ void __launch_bounds__(kThreads) quantize_nvfp4_kernel(const QuantizeNvfp4Params p) {
  const Nvfp4Encoder enc = nvfp4_encoder(__ldg(p.global_scale));
  const uint32_t step = gridDim.x * kThreads * kUnroll;
  uint32_t base = blockIdx.x * kThreads * kUnroll;
  uint4 next[kUnroll][2];
#pragma unroll
  for (int u = 0; u < kUnroll; ++u) load_block<kContiguous>(p, base + u * kThreads + threadIdx.x, next[u]);
  for (; base < p.blocks; base += step) {
    uint4 raw[kUnroll][2];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      raw[u][0] = next[u][0];
      raw[u][1] = next[u][1];
      load_block<kContiguous>(p, base + step + u * kThreads + threadIdx.x, next[u]);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const uint32_t b = base + u * kThreads + threadIdx.x;
      if (b >= p.blocks) continue;
      encode_block(p, b, reinterpret_cast<const uint32_t*>(raw[u]), enc);
    }
  }
}

}  // namespace dsv4
