// Sparse MQA forward: the consumers' start and end of a work item (torch-free), shared by
// sparse_mqa_fwd_kernel and sparse_mqa_fwd_ring32_kernel: the sinks and the reset of the
// running state; the row sums of both consumers, then the normalized output and its LSE
// (unsplit: bf16 out with the sink; split: fp32 partials for the combine). Fragment layout:
// sparse_mqa_softmax.cuh.
#pragma once

#include <cmath>
#include <cstdint>

#include "attention/sparse_mqa_layout.cuh"
#include "attention/sparse_mqa_params.cuh"
#include "attention/sparse_mqa_schedule.cuh"
#include "common/cvt.cuh"
#include "common/ptx/math.cuh"
#include "common/ptx/regs.cuh"
#include "common/ptx/sync.cuh"

namespace dsv4 {
namespace attention {

// A consumer's start of a work item with `rounds` rounds: the sink logits of its rows h0 / h1
// (unsplit calls only: the combine applies the sink otherwise), loaded now so that their
// latency overlaps Q's and the rounds and the epilogue does not start with a dependent global
// load; the running maxima and sums reset; O cleared only for an item with no round (an empty
// token's output is 0) or without first_pv_init. Otherwise the item's first PV sets O
// (scale-d = 0: O = P V, what 0 + P V gives, zeros' signs aside), so the consumers' path to
// their first MMA carries no 64 register-pair clears (1 KB of cold code on a small batch's
// critical path, docs/perf-history/2026-12-04-attention-code-diet.md). The register fence
// keeps the branch: without it the compiler merged the two paths by 128 selects, executed on
// every item.
__device__ __forceinline__ void start_item(const SparseMqaParams& p, int rounds, int h0, int h1, float (&o)[128],
                                           float& m0, float& m1, float& l0, float& l1, float& sink0, float& sink1) {
  sink0 = -INFINITY;
  sink1 = -INFINITY;
  if (p.num_splits == 1 && p.sink != nullptr) {
    sink0 = p.sink[h0];
    sink1 = p.sink[h1];
  }
  if (rounds == 0 || !p.first_pv_init) {
#pragma unroll
    for (int k = 0; k < 128; ++k) o[k] = 0.f;
    fence_regs(o);
  }
  m0 = m1 = -INFINITY;
  l0 = l1 = 0.f;
}

// Row sums of rows r0 / r0 + 8: the quad's, then the other consumer's tiles (both consumers
// end the item at the same max), exchanged through smem across kBarSum.
__device__ __forceinline__ void reduce_row_sums(float& l0, float& l1, uint8_t* smem, int g, int r0, int quad) {
  float* ssum = reinterpret_cast<float*>(smem + kOffSum);
  l0 += __shfl_xor_sync(0xffffffffu, l0, 1);
  l0 += __shfl_xor_sync(0xffffffffu, l0, 2);
  l1 += __shfl_xor_sync(0xffffffffu, l1, 1);
  l1 += __shfl_xor_sync(0xffffffffu, l1, 2);
  if (quad == 0) {
    ssum[g * 64 + r0] = l0;
    ssum[g * 64 + r0 + 8] = l1;
  }
  named_bar_sync(kBarSum, 256);
  l0 += ssum[(1 - g) * 64 + r0];
  l1 += ssum[(1 - g) * 64 + r0 + 8];
}

// Consumer g's half of O (columns 256 g ..) for heads h0 / h1 = rows r0 / r0 + 8, with the
// rows' final maxima m (log2 units), full sums l and sink logits.
__device__ __forceinline__ void store_item_output(const SparseMqaParams& p, const WorkItem& wi, const float (&o)[128],
                                                  float l0, float l1, float m0, float m1, float sink0, float sink1,
                                                  int h0, int h1, int g, int quad) {
  constexpr float kLn2 = 0.6931471805599453f;
  constexpr float kLog2e = 1.4426950408889634f;
  const float lse0 = l0 > 0.f ? (m0 + __log2f(l0)) * kLn2 : -INFINITY;
  const float lse1 = l1 > 0.f ? (m1 + __log2f(l1)) * kLn2 : -INFINITY;
  if (p.num_splits == 1) {
    float inv0 = 0.f, inv1 = 0.f;
    // rcp.approx (1 ulp) rather than an IEEE division (a refinement sequence with a
    // slow-path call): the sums are >= 1 (the reference max is at most the row's max, so
    // its key contributes 2^(max - m) >= 1), far from subnormals, and the result is
    // rounded to bf16.
    if (l0 > 0.f) inv0 = rcp_approx_ftz(l0 + ex2_approx_ftz(sink0 * kLog2e - m0));
    if (l1 > 0.f) inv1 = rcp_approx_ftz(l1 + ex2_approx_ftz(sink1 * kLog2e - m1));
    // A quad holds 8 columns of each 8-column chunk j, two per lane. Lanes q and q ^ 1 swap one
    // word so that each stores 4 contiguous columns (8 bytes): even lanes of chunk j, odd lanes
    // of chunk j + 1. A warp store then writes whole 32-byte sectors, half as many as with
    // 4-byte stores (the output stores were ~10% of the consumers' time).
    const bool odd = quad & 1;
    uint16_t* ob = p.out + wi.b * p.out_stride_b + wi.i * p.out_stride_q + 256 * g + 4 * (quad >> 1) + 8 * odd;
    uint16_t* o0p = ob + h0 * p.out_stride_h;
    uint16_t* o1p = ob + h1 * p.out_stride_h;
#pragma unroll
    for (int j = 0; j < 32; j += 2) {
      const uint32_t a0 = pack_bf16x2(o[4 * j] * inv0, o[4 * j + 1] * inv0);      // chunk j, row r0
      const uint32_t b0 = pack_bf16x2(o[4 * j + 4] * inv0, o[4 * j + 5] * inv0);  // chunk j + 1
      const uint32_t a1 = pack_bf16x2(o[4 * j + 2] * inv1, o[4 * j + 3] * inv1);  // row r0 + 8
      const uint32_t b1 = pack_bf16x2(o[4 * j + 6] * inv1, o[4 * j + 7] * inv1);
      const uint32_t x0 = __shfl_xor_sync(0xffffffffu, odd ? a0 : b0, 1);
      const uint32_t x1 = __shfl_xor_sync(0xffffffffu, odd ? a1 : b1, 1);
      *reinterpret_cast<uint2*>(o0p + 8 * j) = odd ? make_uint2(x0, b0) : make_uint2(a0, x0);
      *reinterpret_cast<uint2*>(o1p + 8 * j) = odd ? make_uint2(x1, b1) : make_uint2(a1, x1);
    }
    if (g == 0 && quad == 0) {
      p.lse[static_cast<int64_t>(wi.token) * p.num_heads + h0] = lse0;
      p.lse[static_cast<int64_t>(wi.token) * p.num_heads + h1] = lse1;
    }
  } else {
    const float inv0 = l0 > 0.f ? rcp_approx_ftz(l0) : 0.f;  // >= 1, see above
    const float inv1 = l1 > 0.f ? rcp_approx_ftz(l1) : 0.f;
    const int64_t row = (static_cast<int64_t>(wi.split) * p.batch * p.s_q + wi.token) * p.num_heads;
    const int dcol = 256 * g + 2 * quad;
    float* o0p = p.part_o + (row + h0) * kHeadDim + dcol;
    float* o1p = p.part_o + (row + h1) * kHeadDim + dcol;
#pragma unroll
    for (int j = 0; j < 32; ++j) {
      *reinterpret_cast<float2*>(o0p + 8 * j) = make_float2(o[4 * j] * inv0, o[4 * j + 1] * inv0);
      *reinterpret_cast<float2*>(o1p + 8 * j) = make_float2(o[4 * j + 2] * inv1, o[4 * j + 3] * inv1);
    }
    if (g == 0 && quad == 0) {
      p.part_lse[row + h0] = lse0;
      p.part_lse[row + h1] = lse1;
    }
  }
}

}  // namespace attention
}  // namespace dsv4
