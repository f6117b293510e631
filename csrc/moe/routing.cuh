// The kernels around the MoE's grouped GEMMs: routing prep (both ops), the activation
// gather (dsv4::nvfp4_moe) and the weighted combine (both ops). Compiled once, in
// routing.cu, whose host launchers (routing.h) nvfp4_moe.cu and mxfp4_moe.cu call. All
// sizes come from shapes; the number of token tiles actually used is a device value
// (*num_tiles) that the later kernels read, so the whole chain is graph capturable.
#pragma once

#include "common/cvt.cuh"
#include "common/nvfp4.cuh"
#include "common/ptx/pdl.cuh"
#include "moe/params.cuh"

namespace dsv4 {
namespace moe {

constexpr int kRouteThreads = 1024;
constexpr int kRouteBatch = 8;  // slots per thread whose ids are loaded together

// Local experts of the kRouteBatch slots base + j * kRouteThreads + lane: -1 when not
// on this rank or the id is invalid (which also raises *error_flag; the wrapper checks
// ids on the host when it may sync), -2 at or past slot S. All ids are loaded before
// any is used, then all map entries: one CTA walks all M * k slots, so its time is the
// number of dependent global-load round trips (~100 us at prefill sizes when done one
// slot at a time).
__device__ __forceinline__ void resolve_experts(const MoeParams& p, int base, int lane, int (&ev)[kRouteBatch],
                                                int S) {
  int id[kRouteBatch];
#pragma unroll
  for (int j = 0; j < kRouteBatch; ++j) {
    const int i = base + j * kRouteThreads + lane;
    id[j] = i < S ? __ldg(p.topk_ids + i) : 0;
  }
  const int n_ids = expert_id_bound(p);
  bool bad = false;
#pragma unroll
  for (int j = 0; j < kRouteBatch; ++j) {
    const bool ok = id[j] >= 0 && id[j] < n_ids;
    bad |= !ok && base + j * kRouteThreads + lane < S;
    ev[j] = ok ? id[j] : -1;
  }
  if (p.expert_map != nullptr) {
#pragma unroll
    for (int j = 0; j < kRouteBatch; ++j) ev[j] = ev[j] >= 0 ? __ldg(p.expert_map + ev[j]) : -1;
#pragma unroll
    for (int j = 0; j < kRouteBatch; ++j) {
      if (map_entry_bad(p, ev[j])) {
        bad = true;
        ev[j] = -1;
      }
    }
  }
#pragma unroll
  for (int j = 0; j < kRouteBatch; ++j)
    if (base + j * kRouteThreads + lane >= S) ev[j] = -2;
  if (bad) *p.error_flag = 1;
}

// Turns the ranks within their expert held in slot_pos for the kRouteBatch slots
// base + j * kRouteThreads + lane (< S) into padded rows, and fills row_slot.
// tile_off: first tile of each expert.
__device__ __forceinline__ void place_slots(const MoeParams& p, int base, int lane, int S, const int* tile_off) {
  int rank[kRouteBatch], ev[kRouteBatch];
#pragma unroll
  for (int j = 0; j < kRouteBatch; ++j) {
    const int i = base + j * kRouteThreads + lane;
    rank[j] = i < S ? p.slot_pos[i] : -1;
  }
  resolve_experts(p, base, lane, ev, S);
#pragma unroll
  for (int j = 0; j < kRouteBatch; ++j) {
    if (rank[j] < 0) continue;
    const int i = base + j * kRouteThreads + lane;
    const int pos = tile_off[ev[j]] * p.block_n + rank[j];
    p.slot_pos[i] = pos;
    p.row_slot[pos] = i;
  }
}

// The prefill kernel's groups: an expert's rows in 32-row halves of its 64-row tiles,
// Q = ceil(count / 32), cut into Q / kGroupHalves full groups (192 rows) and one tail
// group of the remaining halves, so a group's MMA width follows the rows it really has
// (up to 31 padding rows instead of up to 63 per expert).
__device__ __forceinline__ int expert_halves(int count) { return (count + 31) / 32; }

// Token tiles of an expert with `count` local slots: ceil(count / BN), rounded up to even
// with tile_pairs (mxfp4_moe's GEMM1 takes an expert's tiles two by two; the extra tile of
// an odd count holds only padding rows, which the GEMMs skip).
__device__ __forceinline__ int expert_tiles(int count, int BN, int tile_pairs) {
  const int t = (count + BN - 1) / BN;
  return tile_pairs ? t + (t & 1) : t;
}

// Inclusive warp scan.
__device__ __forceinline__ int warp_scan_incl(int v, int lane) {
#pragma unroll
  for (int d = 1; d < 32; d <<= 1) {
    const int u = __shfl_up_sync(0xffffffffu, v, d);
    if (lane >= d) v += u;
  }
  return v;
}

// One CTA: per-expert counts (shared atomics), tile offsets padded
// to block_n, the tile -> expert table, the slot <-> padded-row maps and (ws) the
// prefill kernel's groups. The order of the rows inside an expert depends on
// atomics, but every row is computed independently and the combine reads rows by
// slot, so results are deterministic. Dynamic shared memory: 4 * E + 1 ints.
__global__ void __launch_bounds__(kRouteThreads) moe_route_kernel(const MoeParams p) {
  pdl_launch_dependents();
  extern __shared__ int rsm[];
  int* cnt = rsm;            // [E]
  int* tile_off = rsm + p.E; // [E + 1]
  int* group_at = tile_off + p.E + 1;  // [2 * E] (ws): each expert's first full group and its tail group
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int S = p.M * p.topk;
  const int BN = p.block_n;
  for (int e = tid; e < p.E; e += kRouteThreads) cnt[e] = 0;
  if (tid == 0 && p.route_counts == nullptr) *p.error_flag = 0;  // else zeroed before moe_count_kernel
  if (p.splitk)
    for (int i = tid; i < 2 * p.sk_ctas; i += kRouteThreads) p.sk_count[i] = 0;
  for (int i = tid; i < p.max_tiles; i += kRouteThreads) p.group_ready[i] = 0;
  __syncthreads();

  if (p.route_counts != nullptr) {  // moe_count_kernel ranked the slots
    for (int e = tid; e < p.E; e += kRouteThreads) cnt[e] = p.route_counts[e];
  } else {
    for (int base = warp * 32; base < S; base += kRouteThreads * kRouteBatch) {
      int ev[kRouteBatch];
      resolve_experts(p, base, lane, ev, S);
      // One shared atomic per local slot (the experts' counters sit in different
      // banks), not a match_any aggregation per warp and slot.
#pragma unroll
      for (int j = 0; j < kRouteBatch; ++j) {
        const int i = base + j * kRouteThreads + lane;
        if (i < S) p.slot_pos[i] = ev[j] >= 0 ? atomicAdd(cnt + ev[j], 1) : -1;
      }
    }
  }
  __syncthreads();

  if (warp == 0) {
    const int per = (p.E + 31) / 32;
    const int e0 = lane * per, e1 = min(p.E, e0 + per);
    int sum = 0;
    for (int e = e0; e < e1; ++e) sum += expert_tiles(cnt[e], BN, p.tile_pairs);
    const int incl = warp_scan_incl(sum, lane);
    int run = incl - sum;
    for (int e = e0; e < e1; ++e) {
      tile_off[e] = run;
      run += expert_tiles(cnt[e], BN, p.tile_pairs);
    }
    if (lane == 31) {
      tile_off[p.E] = incl;
      *p.num_tiles = incl;
    }
    if (p.ws) {
      // Groups ordered by size, full groups first, then the tails of 5 .. 1 halves:
      // the persistent grid takes units round-robin, so each round's units then cost
      // about the same. One warp scan per size class.
      int full = 0, tails[kGroupHalves - 1] = {};  // tails[q - 1]: experts with a tail of q halves
      for (int e = e0; e < e1; ++e) {
        const int q = expert_halves(cnt[e]);
        full += q / kGroupHalves;
#pragma unroll
        for (int t = 1; t < kGroupHalves; ++t) tails[t - 1] += q % kGroupHalves == t ? 1 : 0;
      }
      const int full_incl = warp_scan_incl(full, lane);
      int base = __shfl_sync(0xffffffffu, full_incl, 31);  // first group of the current class
      int full_run = full_incl - full;
      int tail_run[kGroupHalves - 1];
#pragma unroll
      for (int t = kGroupHalves - 1; t >= 1; --t) {
        const int incl_t = warp_scan_incl(tails[t - 1], lane);
        tail_run[t - 1] = base + incl_t - tails[t - 1];
        base += __shfl_sync(0xffffffffu, incl_t, 31);
      }
      for (int e = e0; e < e1; ++e) {
        const int q = expert_halves(cnt[e]);
        group_at[2 * e] = full_run;
        full_run += q / kGroupHalves;
        int at = -1;
#pragma unroll
        for (int t = 1; t < kGroupHalves; ++t) {
          if (q % kGroupHalves == t) at = tail_run[t - 1]++;
        }
        group_at[2 * e + 1] = at;
      }
      if (lane == 31) *p.num_groups = base;
    }
  }
  __syncthreads();

  const int total_rows = tile_off[p.E] * BN;
  for (int e = tid; e < p.E; e += kRouteThreads) {
    for (int j = tile_off[e]; j < tile_off[e + 1]; ++j) p.tile_expert[j] = e;
    if (p.ws) {  // group_tile: first tile * 8 + halves - 1 (see expert_halves)
      const int q = expert_halves(cnt[e]);
      int t = tile_off[e];
      for (int f = 0; f < q / kGroupHalves; ++f, t += kGroupHalves / 2)
        p.group_tile[group_at[2 * e] + f] = 8 * t + kGroupHalves - 1;
      if (q % kGroupHalves != 0) p.group_tile[group_at[2 * e + 1]] = 8 * t + q % kGroupHalves - 1;
    }
  }
  for (int r = tid; r < total_rows; r += kRouteThreads) p.row_slot[r] = -1;
  if (p.route_counts != nullptr) {  // moe_place_kernel places the slots
    for (int e = tid; e <= p.E; e += kRouteThreads) p.route_tile_off[e] = tile_off[e];
    return;
  }
  __syncthreads();

  for (int base = warp * 32; base < S; base += kRouteThreads * kRouteBatch) place_slots(p, base, lane, S, tile_off);
}

// Prefill sizes (route_counts set) split the routing over many CTAs: one CTA walking
// all M * k slots took ~35 us at M = 8192. moe_count_kernel: each CTA ranks its
// kRouteSlotsPerCta slots on shared counters, reserves a range per expert with one
// global atomic (route_counts, zeroed before) and writes slot_pos = rank within the
// expert. moe_route_kernel (one CTA) then builds the tables from the counts and
// moe_place_kernel turns ranks into padded rows.
constexpr int kRouteSlotsPerCta = kRouteThreads * kRouteBatch;

__global__ void __launch_bounds__(kRouteThreads) moe_count_kernel(const MoeParams p) {
  extern __shared__ int cnt[];  // [E]
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int S = min(p.M * p.topk, (int(blockIdx.x) + 1) * kRouteSlotsPerCta);
  const int base = blockIdx.x * kRouteSlotsPerCta + warp * 32;
  for (int e = tid; e < p.E; e += kRouteThreads) cnt[e] = 0;
  __syncthreads();
  int ev[kRouteBatch], rank[kRouteBatch];
  resolve_experts(p, base, lane, ev, S);
#pragma unroll
  for (int j = 0; j < kRouteBatch; ++j) rank[j] = ev[j] >= 0 ? atomicAdd(cnt + ev[j], 1) : -1;
  __syncthreads();
  for (int e = tid; e < p.E; e += kRouteThreads)
    if (cnt[e] > 0) cnt[e] = atomicAdd(p.route_counts + e, cnt[e]);
  __syncthreads();
#pragma unroll
  for (int j = 0; j < kRouteBatch; ++j) {
    const int i = base + j * kRouteThreads + lane;
    if (i < S) p.slot_pos[i] = ev[j] >= 0 ? cnt[ev[j]] + rank[j] : -1;
  }
}

__global__ void __launch_bounds__(kRouteThreads) moe_place_kernel(const MoeParams p) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int S = min(p.M * p.topk, (int(blockIdx.x) + 1) * kRouteSlotsPerCta);
  place_slots(p, blockIdx.x * kRouteSlotsPerCta + warp * 32, lane, S, p.route_tile_off);
}

// Padded rows of GEMM1's B operand: the token's x (bf16 mode) or its NVFP4
// quantization with the expert's a13 scale expanded to bf16 code * block scale
// (nvfp4 mode; the Blackwell rule of common/nvfp4.cuh, dsv4.reference.quantize_nvfp4
// with rcp.approx); zeros for padding rows where the prefill kernel (ws) reads them, none
// written otherwise (the one-warpgroup GEMMs zero-fill them as they copy).
// Row-major, or tiled (act_offset) for the prefill kernel (ws).
// Two adjacent lanes share a 16-element block. blockDim.x is a multiple of 32.
// A thread issues kGatherLoads of its 16-byte chunks of a row (bf16: 4, all of a row of
// K <= 8192 at 256 threads) before their stores, and the next row's slot is read while
// this row is copied: one load in flight per thread and a row_slot -> x dependency per row
// held the V4.1-Flash TP8 gather at 1.6 TB/s of writes (96.7 us at M = 2560 on the H100,
// docs/perf-history/2026-12-06-nvfp4-moe-gather-padding.md). nvfp4 mode takes 2: its
// conversion's registers at 4 spilled under the 32 that 8 CTAs per SM allow.
template <bool kNvfp4>
__global__ void __launch_bounds__(256, 8) moe_gather_kernel(const MoeParams p) {  // 8: config.h gather_ctas
  pdl_wait();
  pdl_launch_dependents();
  const int rows = __ldg(p.num_tiles) * p.block_n;
  const int chunks = p.K / 8;
  constexpr int kGatherLoads = kNvfp4 ? 2 : 4;
  int slot = int(blockIdx.x) < rows ? p.row_slot[blockIdx.x] : -1;
  for (int r = blockIdx.x; r < rows; r += gridDim.x) {
    const int r_next = r + int(gridDim.x);
    const int slot_next = r_next < rows ? p.row_slot[r_next] : -1;
    // Padding rows: zeros for the prefill kernel, whose bulk copies read xg whole; the
    // one-warpgroup kernels zero-fill them in their own copies (gemm_segment), so nothing.
    if (slot >= 0 || p.ws) {
      const __nv_bfloat16* src = slot >= 0 ? p.x + size_t(slot / p.topk) * p.K : nullptr;
      Nvfp4Encoder enc{};
      if constexpr (kNvfp4) {
        const int e = p.tile_expert[r / p.block_n];
        enc = nvfp4_encoder(__ldg(p.a13_scale + (p.a13_per_expert ? e : 0)));
      }
      for (int c0 = 0; c0 < chunks; c0 += kGatherLoads * int(blockDim.x)) {
        uint4 raw[kGatherLoads];
#pragma unroll
        for (int i = 0; i < kGatherLoads; ++i) {
          const int c = c0 + i * int(blockDim.x) + int(threadIdx.x);
          raw[i] = make_uint4(0, 0, 0, 0);
          if (src != nullptr && c < chunks) raw[i] = __ldg(reinterpret_cast<const uint4*>(src) + c);
        }
#pragma unroll
        for (int i = 0; i < kGatherLoads; ++i) {
          const int c = c0 + i * int(blockDim.x) + int(threadIdx.x);
          if (c0 + i * int(blockDim.x) >= chunks) break;  // uniform: no lane of the block has a chunk left
          __nv_bfloat16* dst = p.xg + (p.ws ? act_offset<true>(r, c, p.K) : act_offset<false>(r, c, p.K));
          if constexpr (!kNvfp4) {
            if (c < chunks) *reinterpret_cast<uint4*>(dst) = raw[i];
          } else {
            const __nv_bfloat162* h2 = reinterpret_cast<const __nv_bfloat162*>(&raw[i]);
            float v[8];
            float amax = 0.0f;
#pragma unroll
            for (int k = 0; k < 4; ++k) {
              const float2 f = __bfloat1622float2(h2[k]);
              v[2 * k] = f.x;
              v[2 * k + 1] = f.y;
              amax = fmaxf(amax, fmaxf(fabsf(f.x), fabsf(f.y)));
            }
            amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 1));
            const __nv_fp8_e4m3 s8 = nvfp4_block_scale(amax, enc);
            const float sf = float(s8);
            const uint32_t codes = nvfp4_encode8(v, nvfp4_block_recip(sf, enc));
            uint4 o;
            uint32_t* ow = reinterpret_cast<uint32_t*>(&o);
#pragma unroll
            for (int k = 0; k < 4; ++k)
              ow[k] = pack_bf16x2(e2m1_value(codes >> (8 * k)) * sf, e2m1_value(codes >> (8 * k + 4)) * sf);
            if (c < chunks) *reinterpret_cast<uint4*>(dst) = o;
          }
        }
      }
    }
    slot = slot_next;
  }
}

// out[t] = sum_j topk_weights[t, j] * y[slot_pos[t, j]] in slot order (fp32), bf16 out.
// Up to kCombineSlots slots a token's positions and weights are read once per token (not
// once per 16-byte chunk), and a chunk's y rows are all loaded before the sum: the loop
// over slots was a chain of dependent loads (position, then its row) per chunk, 2.4 TB/s
// at V4.1-Flash TP8 M = 2560 on the H100 (75 us for ~183 MB). The sum's order and fmaf
// are the loop's, so the outputs are bitwise the same; more slots take the loop.
constexpr int kCombineSlots = 8;
__global__ void __launch_bounds__(256) moe_combine_kernel(const MoeParams p) {
  pdl_wait();
  const int chunks = p.K / 8;
  for (int tkn = blockIdx.x; tkn < p.M; tkn += gridDim.x) {
    if (p.topk <= kCombineSlots) {
      int pos[kCombineSlots];
      float w[kCombineSlots];
#pragma unroll
      for (int j = 0; j < kCombineSlots; ++j) {
        pos[j] = j < p.topk ? p.slot_pos[tkn * p.topk + j] : -1;
        w[j] = j < p.topk ? __ldg(p.topk_weights + tkn * p.topk + j) : 0.0f;
      }
      for (int c = threadIdx.x; c < chunks; c += blockDim.x) {
        uint4 raw[kCombineSlots];
#pragma unroll
        for (int j = 0; j < kCombineSlots; ++j)
          if (pos[j] >= 0) raw[j] = *(reinterpret_cast<const uint4*>(p.y + size_t(pos[j]) * p.K) + c);
        float acc[8];
#pragma unroll
        for (int i = 0; i < 8; ++i) acc[i] = 0.0f;
#pragma unroll
        for (int j = 0; j < kCombineSlots; ++j)
          if (pos[j] >= 0) fma_bf16x8(acc, w[j], raw[j]);
        *(reinterpret_cast<uint4*>(p.out + size_t(tkn) * p.K) + c) = pack_bf16x8(acc);
      }
      continue;
    }
    for (int c = threadIdx.x; c < chunks; c += blockDim.x) {
      float acc[8];
#pragma unroll
      for (int i = 0; i < 8; ++i) acc[i] = 0.0f;
      for (int j = 0; j < p.topk; ++j) {
        const int pos = p.slot_pos[tkn * p.topk + j];
        if (pos < 0) continue;
        const float w = __ldg(p.topk_weights + tkn * p.topk + j);
        fma_bf16x8(acc, w, *(reinterpret_cast<const uint4*>(p.y + size_t(pos) * p.K) + c));
      }
      *(reinterpret_cast<uint4*>(p.out + size_t(tkn) * p.K) + c) = pack_bf16x8(acc);
    }
  }
}

}  // namespace moe
}  // namespace dsv4
