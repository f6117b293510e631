// Routing prep, activation gather and weighted combine of the NVFP4 MoE. All sizes
// come from shapes; the number of token tiles actually used is a device value
// (*num_tiles) that the later kernels read, so the whole chain is graph capturable.
#pragma once

#include "common/nvfp4.cuh"
#include "moe/moe_device.cuh"
#include "moe/moe_params.cuh"

namespace dsv4 {
namespace moe {

constexpr int kRouteThreads = 1024;

// Local expert of slot i, or -1 (not on this rank, or an invalid id, which also
// raises *error_flag; the wrapper checks ids on the host when it may sync).
__device__ __forceinline__ int resolve_expert(const MoeParams& p, int i) {
  const int id = __ldg(p.topk_ids + i);
  if (p.expert_map != nullptr) {
    if (id < 0 || id >= p.E_global) {
      *p.error_flag = 1;
      return -1;
    }
    const int e = __ldg(p.expert_map + id);
    if (e < -1 || e >= p.E) {
      *p.error_flag = 1;
      return -1;
    }
    return e;
  }
  if (id < 0 || id >= p.E) {
    *p.error_flag = 1;
    return -1;
  }
  return id;
}

// One CTA: per-expert counts (warp-aggregated shared atomics), tile offsets padded
// to block_n, the tile -> expert table, and the slot <-> padded-row maps. The order
// of the rows inside an expert depends on atomics, but every row is computed
// independently and the combine reads rows by slot, so results are deterministic.
// Dynamic shared memory: 2 * E + 1 ints.
__global__ void __launch_bounds__(kRouteThreads) moe_route_kernel(const MoeParams p) {
  pdl_launch_dependents();
  extern __shared__ int rsm[];
  int* cnt = rsm;            // [E]
  int* tile_off = rsm + p.E; // [E + 1]
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int S = p.M * p.topk;
  const int BN = p.block_n;
  for (int e = tid; e < p.E; e += kRouteThreads) cnt[e] = 0;
  if (tid == 0) *p.error_flag = 0;
  if (p.splitk)
    for (int i = tid; i < 2 * p.sk_ctas; i += kRouteThreads) p.sk_count[i] = 0;
  __syncthreads();

  for (int base = warp * 32; base < S; base += kRouteThreads) {
    const int i = base + lane;
    const int e = i < S ? resolve_expert(p, i) : -2;
    const unsigned peers = __match_any_sync(0xffffffffu, e);
    const int leader = __ffs(peers) - 1;
    int start = 0;
    if (lane == leader && e >= 0) start = atomicAdd(cnt + e, __popc(peers));
    start = __shfl_sync(0xffffffffu, start, leader);
    if (i < S) p.slot_pos[i] = e >= 0 ? start + __popc(peers & ((1u << lane) - 1u)) : -1;
  }
  __syncthreads();

  if (warp == 0) {
    const int per = (p.E + 31) / 32;
    const int e0 = lane * per, e1 = min(p.E, e0 + per);
    int sum = 0;
    for (int e = e0; e < e1; ++e) sum += (cnt[e] + BN - 1) / BN;
    int incl = sum;
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
      const int v = __shfl_up_sync(0xffffffffu, incl, d);
      if (lane >= d) incl += v;
    }
    int run = incl - sum;
    for (int e = e0; e < e1; ++e) {
      tile_off[e] = run;
      run += (cnt[e] + BN - 1) / BN;
    }
    if (lane == 31) {
      tile_off[p.E] = incl;
      *p.num_tiles = incl;
    }
  }
  __syncthreads();

  const int total_rows = tile_off[p.E] * BN;
  for (int e = tid; e < p.E; e += kRouteThreads)
    for (int j = tile_off[e]; j < tile_off[e + 1]; ++j) p.tile_expert[j] = e;
  for (int r = tid; r < total_rows; r += kRouteThreads) p.row_slot[r] = -1;
  __syncthreads();

  for (int base = warp * 32; base < S; base += kRouteThreads) {
    const int i = base + lane;
    if (i >= S) continue;
    const int rank = p.slot_pos[i];
    if (rank < 0) continue;
    const int e = resolve_expert(p, i);
    const int pos = tile_off[e] * BN + rank;
    p.slot_pos[i] = pos;
    p.row_slot[pos] = i;
  }
}

// Padded rows of GEMM1's B operand: the token's x (bf16 mode) or its NVFP4
// quantization with the expert's a13 scale expanded to bf16 code * block scale
// (nvfp4 mode; the same rules as dsv4.formats.quantize_nvfp4); zeros for padding.
// Two adjacent lanes share a 16-element block. blockDim.x is a multiple of 32.
template <bool kNvfp4>
__global__ void __launch_bounds__(256) moe_gather_kernel(const MoeParams p) {
  pdl_wait();
  pdl_launch_dependents();
  const int rows = __ldg(p.num_tiles) * p.block_n;
  const int chunks = p.K / 8;
  for (int r = blockIdx.x; r < rows; r += gridDim.x) {
    const int slot = p.row_slot[r];
    const __nv_bfloat16* src = slot >= 0 ? p.x + size_t(slot / p.topk) * p.K : nullptr;
    float g = 1.0f;
    if constexpr (kNvfp4) {
      const int e = p.tile_expert[r / p.block_n];
      g = __ldg(p.a13_scale + (p.a13_per_expert ? e : 0));
    }
    __nv_bfloat16* dst = p.xg + size_t(r) * p.K;
    for (int c0 = 0; c0 < chunks; c0 += blockDim.x) {
      const int c = c0 + threadIdx.x;
      uint4 raw = make_uint4(0, 0, 0, 0);
      if (src != nullptr && c < chunks) raw = __ldg(reinterpret_cast<const uint4*>(src) + c);
      if constexpr (!kNvfp4) {
        if (c < chunks) reinterpret_cast<uint4*>(dst)[c] = raw;
      } else {
        const __nv_bfloat162* h2 = reinterpret_cast<const __nv_bfloat162*>(&raw);
        float v[8];
        float amax = 0.0f;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const float2 f = __bfloat1622float2(h2[i]);
          v[2 * i] = f.x;
          v[2 * i + 1] = f.y;
          amax = fmaxf(amax, fmaxf(fabsf(f.x), fabsf(f.y)));
        }
        amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 1));
        const __nv_fp8_e4m3 s8 = nvfp4_block_scale(amax, g);
        const float sf = float(s8);
        const uint32_t codes = nvfp4_encode8(v, sf, g);
        uint4 o;
        uint32_t* ow = reinterpret_cast<uint32_t*>(&o);
#pragma unroll
        for (int i = 0; i < 4; ++i)
          ow[i] = bf16x2_bits(e2m1_value(codes >> (8 * i)) * sf, e2m1_value(codes >> (8 * i + 4)) * sf);
        if (c < chunks) reinterpret_cast<uint4*>(dst)[c] = o;
      }
    }
  }
}

// out[t] = sum_j topk_weights[t, j] * y[slot_pos[t, j]] in slot order (fp32), bf16 out.
__global__ void __launch_bounds__(256) moe_combine_kernel(const MoeParams p) {
  pdl_wait();
  const int chunks = p.K / 8;
  for (int tkn = blockIdx.x; tkn < p.M; tkn += gridDim.x) {
    for (int c = threadIdx.x; c < chunks; c += blockDim.x) {
      float acc[8];
#pragma unroll
      for (int i = 0; i < 8; ++i) acc[i] = 0.0f;
      for (int j = 0; j < p.topk; ++j) {
        const int pos = p.slot_pos[tkn * p.topk + j];
        if (pos < 0) continue;
        const float w = __ldg(p.topk_weights + tkn * p.topk + j);
        const uint4 raw = *(reinterpret_cast<const uint4*>(p.y + size_t(pos) * p.K) + c);
        const __nv_bfloat162* h2 = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const float2 f = __bfloat1622float2(h2[i]);
          acc[2 * i] = fmaf(w, f.x, acc[2 * i]);
          acc[2 * i + 1] = fmaf(w, f.y, acc[2 * i + 1]);
        }
      }
      const uint4 o = bf16x8_bits(acc);
      *(reinterpret_cast<uint4*>(p.out + size_t(tkn) * p.K) + c) = o;
    }
  }
}

}  // namespace moe
}  // namespace dsv4
