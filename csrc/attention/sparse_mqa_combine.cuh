// Sparse MQA: the combine of split-KV partials (torch-free).
#pragma once

#include <cstdint>

#include "attention/sparse_mqa_params.cuh"
#include "common/cvt.cuh"
#include "common/ptx/math.cuh"
#include "common/ptx/pdl.cuh"

namespace dsv4 {
namespace attention {

// Merges the split partials of one (token, head): 128 threads x 4 columns. Launched with
// programmatic stream serialization (sparse_mqa.cu, DSV4_ATTN_PDL): everything up to
// pdl_wait() reads only the call's inputs, so it runs while the main kernel drains; the
// partials are read after it (pdl_wait returns once the main grid has completed and its
// writes are visible; without the launch attribute it returns at once).
__global__ void __launch_bounds__(128) sparse_mqa_combine_kernel(const __grid_constant__ SparseMqaParams p) {
  const int token = blockIdx.x / p.num_heads;
  const int h = blockIdx.x % p.num_heads;
  const int b = token / p.s_q, i = token % p.s_q;
  const int64_t tokens = static_cast<int64_t>(p.batch) * p.s_q;
  const int64_t split_stride = tokens * p.num_heads;
  const int64_t row = static_cast<int64_t>(token) * p.num_heads + h;
  const float sk = p.sink != nullptr ? p.sink[h] : -INFINITY;
  uint16_t* op = p.out + b * p.out_stride_b + i * p.out_stride_q + h * p.out_stride_h + threadIdx.x * 4;
  pdl_wait();
  float mx = -INFINITY;
  for (int s = 0; s < p.num_splits; ++s) mx = fmaxf(mx, p.part_lse[s * split_stride + row]);
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
  float lsum = 0.f;
  if (mx != -INFINITY) {
    for (int s = 0; s < p.num_splits; ++s) {
      const float ls = p.part_lse[s * split_stride + row];
      if (ls == -INFINITY) continue;
      const float wgt = __expf(ls - mx);
      lsum += wgt;
      const float4 v = reinterpret_cast<const float4*>(p.part_o + (s * split_stride + row) * kHeadDim)[threadIdx.x];
      acc.x += wgt * v.x;
      acc.y += wgt * v.y;
      acc.z += wgt * v.z;
      acc.w += wgt * v.w;
    }
  }
  float inv = 0.f, lse = -INFINITY;
  if (lsum > 0.f) {
    inv = rcp_approx_ftz(lsum + __expf(sk - mx));  // lsum >= 1 (the largest split's weight is 1)
    lse = mx + __logf(lsum);
  }
  uint2 packed;
  packed.x = pack_bf16x2(acc.x * inv, acc.y * inv);
  packed.y = pack_bf16x2(acc.z * inv, acc.w * inv);
  *reinterpret_cast<uint2*>(op) = packed;
  if (threadIdx.x == 0) p.lse[row] = lse;
}

}  // namespace attention
}  // namespace dsv4
