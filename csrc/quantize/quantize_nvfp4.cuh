// bf16 [M, K] -> NVFP4: packed e2m1 codes uint8 [M, K/2] (low nibble = even
// element) and e4m3 block scales [M, K/16], both row-major and dense. This is the
// activation layout the NVFP4 MoE kernels read.
//
// Memory bound: two threads share a 16-element block, each loads 16 bytes
// (8 bf16) and stores 4 bytes of codes, so loads and stores are fully coalesced;
// the pair exchanges its partial amax with one shuffle.
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
  uint32_t chunks;            // M * K / 8 (< 2^32, checked by the launcher)
  FastDivmod chunks_per_row;  // K / 8
  int64_t x_row_stride;
};

// Chunk c = 8 consecutive elements of a row; the chunk count is even (K/8 is),
// so thread pairs (2i, 2i+1) always hold the two halves of one 16-element block.
template <int kThreads, int kUnroll, bool kContiguous>
__global__ void __launch_bounds__(kThreads) quantize_nvfp4_kernel(const QuantizeNvfp4Params p) {
  const uint32_t total = p.chunks;
  const float g = __ldg(p.global_scale);
  const uint32_t step = gridDim.x * kThreads * kUnroll;
  // The loop bound is uniform over the block, so every lane reaches the shuffle.
  for (uint32_t base = blockIdx.x * kThreads * kUnroll; base < total; base += step) {
    uint4 raw[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const uint32_t c = base + u * kThreads + threadIdx.x;
      raw[u] = make_uint4(0, 0, 0, 0);
      if (c < total) {
        int64_t offset = int64_t(c) * 8;
        if constexpr (!kContiguous) {
          uint32_t row, col;
          p.chunks_per_row.divmod(c, row, col);
          offset = int64_t(row) * p.x_row_stride + col * 8;
        }
        raw[u] = __ldg(reinterpret_cast<const uint4*>(p.x + offset));
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const uint32_t c = base + u * kThreads + threadIdx.x;
      const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&raw[u]);
      float v[8];
      float amax = 0.0f;
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const float2 f = __bfloat1622float2(h[i]);
        v[2 * i] = f.x;
        v[2 * i + 1] = f.y;
        amax = fmaxf(amax, fmaxf(fabsf(f.x), fabsf(f.y)));
      }
      amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 1));
      const __nv_fp8_e4m3 s = nvfp4_block_scale(amax, g);
      const uint32_t word = nvfp4_encode8(v, float(s), g);
      if (c < total) {
        p.codes[c] = word;  // chunk c of 8 elements is word c of the dense output
        if ((threadIdx.x & 1) == 0) p.scales[c / 2] = s;
      }
    }
  }
}

}  // namespace dsv4
