// Prefill grouped GEMMs of the NVFP4 MoE: warp-specialized, persistent, optionally
// in clusters of 2 CTAs that share each token tile by multicast (docs/perf-history/
// 2026-11-30-nvfp4-moe-prefill-ws.md; where its time goes:
// docs/perf-history/2026-12-01-nvfp4-moe-prefill-time.md).
//
// Work unit: (group, rq). A group is 32 to 192 consecutive token rows of one expert,
// in 32-row halves of its 64-row tiles (moe_route_kernel's group_tile list: full groups
// of 192 rows, then each expert's tail rounded up to 32 rows); rq selects 3 x 64 weight
// rows, the 64-row tiles 3rq .. 3rq + 2. Per CTA:
//   * warpgroup 0, the producers: one thread of warp 0 issues the token-tile bulk
//     copies, one thread of warp 1 the weight copies, into rings of kStages stages,
//     each one 64-wide K step: the token rows (one contiguous, pre-swizzled 8 KB block
//     per 64 tokens, see act_offset; its first 4 KB for a group's last half tile),
//     three code tiles (2 KB) and three scale tiles
//     (256 B). (Two issuing threads: one alone fell behind at 64-token units.)
//     GEMM1 with direct_x (bf16 mode, kCluster = 1): warps 0, 2 and 3 copy the token rows
//     from x themselves (ws_producer_x), 16 bytes a lane into the same swizzled places, so
//     no gather kernel writes xg.
//   * warpgroups 1..3, the consumers: consumer w dequantizes weight-row tile 3rq + w
//     into registers and multiplies it with all tokens of the group from shared
//     memory. Each dequantized element feeds 32-192 tokens, and while some
//     warpgroups dequantize, the others' MMAs keep the tensor cores busy (one
//     warpgroup cannot overlap its own dequant with its MMAs: ptxas serializes the
//     wgmmas, C7513).
// full[s]: the two producers' arrivals + the stage's transaction bytes. empty[s]: one
// arrival per consumer warp of every CTA of the cluster, after that warp's MMAs
// reading the stage retired. The ring's phases run on across units, so the producers
// fill the next unit's first stages during the consumers' epilogue.
// Clusters (kCluster = 2): both CTAs walk the same groups with rq = 2 * unit + rank;
// each loads its own weight tiles and half of every token block, multicast to both
// CTAs, so the token tile (the larger operand: 8 KB per 64 tokens vs 2.3 KB per 64
// weight rows) leaves L2 once per cluster.
#pragma once

#include "common/mma/wgmma.cuh"
#include "common/ptx/memory.cuh"
#include "common/ptx/pdl.cuh"
#include "common/ptx/regs.cuh"
#include "common/ptx/sync.cuh"
#include "moe/nvfp4_gemm.cuh"  // gemm1_epilogue, gemm2_epilogue, dequant_tile

namespace dsv4 {
namespace moe {

constexpr int kWsBlockBytes = 64 * 128;  // one 64 x 64 bf16 activation block

// Shape of the prefill kernel: kConsumers dequantizing warpgroups after the producer
// warpgroup, units of up to kMaxTiles 64-token tiles (2 * kMaxTiles halves).
struct WsConfig {
  static constexpr int kConsumers = 3;
  static constexpr int kMaxTiles = kGroupHalves / 2;
  static constexpr int kThreads = 128 * (1 + kConsumers);
  static constexpr int kStages = 5;
  // Shared memory: the token ring (stages of kMaxTiles 1024-aligned 8 KB blocks), the
  // weight ring (per stage the consumers' code tiles, then their scale tiles), each
  // consumer's epilogue staging (192 rows x 128 bytes), the barriers.
  static constexpr int kB = kMaxTiles * kWsBlockBytes;
  static constexpr int kWStage = kConsumers * (kCodeTileBytes + kScaleTileBytes);
  static constexpr int kS = kConsumers * kCodeTileBytes;  // scales within a weight stage
  static constexpr int kWeightsAt = kStages * kB;
  static constexpr int kStagingAt = kWeightsAt + kStages * kWStage;
  static constexpr int kStaging = 64 * kMaxTiles * 128;
  static constexpr int kBars = kStagingAt + kConsumers * kStaging;
  static constexpr int kBytes = kBars + 2 * kStages * 8 + 1024;  // + alignment slack
  // Registers: the producers keep kProducerRegs, the consumers share the rest of the
  // 64K register file (setmaxnreg, multiples of 8). ptxas still compiles the consumers
  // of this 512-thread kernel within the launch's 128 registers (a wider unit, n224 with
  // 112 accumulators, fails with C7602), so units stop at 192 tokens.
  static constexpr int kProducerRegs = 72;
  static constexpr int kConsumerRegs = (65536 - 128 * kProducerRegs) / (128 * kConsumers) / 8 * 8;
};
static_assert(WsConfig::kBytes <= 227 * 1024, "the prefill kernel's shared memory exceeds the sm_90 limit");

// The unit's first token tile t0, its 32-row halves nh (1..6, BN = 32 nh tokens),
// expert e and row group rq (weight-row tiles kConsumers * rq + w).
struct WsUnit {
  int group, t0, nh, e, rq;
};

template <int kCluster>
__device__ __forceinline__ WsUnit ws_unit(const MoeParams& p, int u, int units_per_group, uint32_t rank) {
  const int group = u / units_per_group;
  const int gt = __ldg(p.group_tile + group);
  WsUnit w;
  w.group = group;
  w.t0 = gt >> 3;
  w.nh = (gt & 7) + 1;
  w.e = __ldg(p.tile_expert + w.t0);
  w.rq = (u - group * units_per_group) * kCluster + int(rank);
  return w;
}

// kTokens: the token-tile producer (warp 0), else the weight producer (warp 1).
template <bool kGemm1, int kCluster, bool kTokens>
__device__ __forceinline__ void ws_producer(const MoeParams& p, uint8_t* smem, uint64_t* full, uint64_t* empty,
                                            int units, int units_per_group, uint32_t rank) {
  using C = WsConfig;
  const int KT = gemm_k_steps<kGemm1>(p);
  const int RT = gemm_row_tiles<kGemm1>(p);
  const uint8_t* codes = kGemm1 ? p.w13 : p.w2;
  const uint8_t* scales = kGemm1 ? p.w13_scale : p.w2_scale;
  const uint8_t* act = reinterpret_cast<const uint8_t*>(kGemm1 ? p.xg : p.h);
  const size_t tile_stride = size_t(KT) * kWsBlockBytes;  // bytes of one 64-token tile
  // Each tile's block (8 KB, or its first 4 KB = 32 rows for an odd last half): all of
  // it, or (clusters) part `rank` of it, multicast to both.
  const uint32_t ring = smem_u32(smem);
  int s = 0;
  uint32_t phase = 0;
  for (int u = blockIdx.x / kCluster; u < units; u += gridDim.x / kCluster) {
    const WsUnit w = ws_unit<kCluster>(p, u, units_per_group, rank);
    const int n_rows = min(C::kConsumers, RT - C::kConsumers * w.rq);  // weight-row tiles of this CTA (<= 0: none)
    const uint32_t bytes =
        kTokens ? uint32_t(w.nh * kWsBlockBytes / 2) : uint32_t(max(n_rows, 0) * (kCodeTileBytes + kScaleTileBytes));
    const uint8_t* b_src = act + size_t(w.t0) * tile_stride;
    const size_t tile0 = (size_t(w.e) * RT + C::kConsumers * w.rq) * KT;  // weight tile (e, first row tile, kt = 0)
    const uint8_t* a_src = codes + tile0 * kCodeTileBytes;
    const uint8_t* s_src = scales + tile0 * kScaleTileBytes;
    if (!kGemm1 && kTokens) {
      // GEMM2 runs alongside GEMM1's last units (programmatic launch, no grid-wide
      // wait): the group's h is complete once all 2N/64 GEMM1 row tiles reported it.
      wait_flag_geq(p.group_ready + w.group, gemm_row_tiles<true>(p));
      fence_proxy_async_global();
    }
    for (int kt = 0; kt < KT; ++kt) {
      mbar_wait(empty + s, phase ^ 1);
      mbar_arrive_expect_tx(full + s, bytes);
      if constexpr (kTokens) {
        const uint32_t st = ring + s * C::kB;
        const uint8_t* bk = b_src + size_t(kt) * kWsBlockBytes;
        for (int j = 0; 2 * j < w.nh; ++j) {
          const uint32_t part = (2 * j + 1 < w.nh ? kWsBlockBytes : kWsBlockBytes / 2) / kCluster;
          const uint32_t dst = st + j * kWsBlockBytes + rank * part;
          const uint8_t* src = bk + j * tile_stride + rank * part;
          if constexpr (kCluster > 1)
            bulk_g2s_multicast(dst, src, part, full + s, uint16_t((1u << kCluster) - 1));
          else
            bulk_g2s(dst, src, part, full + s);
        }
      } else {
        const uint32_t st = ring + C::kWeightsAt + s * C::kWStage;
        for (int r = 0; r < n_rows; ++r) {
          const size_t t = size_t(r) * KT + kt;
          bulk_g2s(st + r * kCodeTileBytes, a_src + t * kCodeTileBytes, kCodeTileBytes, full + s);
          bulk_g2s(st + C::kS + r * kScaleTileBytes, s_src + t * kScaleTileBytes, kScaleTileBytes, full + s);
        }
      }
      if (++s == C::kStages) {
        s = 0;
        phase ^= 1;
      }
    }
  }
}

// GEMM1's token producer with direct_x: the kWsXThreads threads of warps 0, 2 and 3 (q =
// 0..95) copy each stage's token rows from x by cp.async, 16 bytes each, into the layout the
// bulk copies of xg give (act_offset: row r of the unit at block r / 64, 128 bytes a row,
// chunk c at c ^ (r % 8)); rows without a slot are zero-filled, as the gather kernel wrote
// them. Thread q takes chunk q % 8 of rows q / 8 + 12 j: eight adjacent threads read one
// row's 128 bytes. Each thread arrives on full[s] when its copies have landed
// (cp.async.mbarrier.arrive.noinc); the consumers fence the async proxy after their wait.
// The rows' element offsets in x (token * K, in 32 bits: config.h keeps M * K below 2^31
// here) are looked up once per unit; with 64-bit ones the producer's 72 registers spilled.
constexpr int kWsXThreads = 96;
constexpr int kWsXRows = kWsXThreads / 8;                          // rows per pass of the threads
constexpr int kWsXPasses = (WsConfig::kMaxTiles * 64) / kWsXRows;  // 16 at 192 rows
static_assert(kWsXPasses * kWsXRows == WsConfig::kMaxTiles * 64, "whole passes per unit");

__device__ __forceinline__ void ws_producer_x(const MoeParams& p, uint8_t* smem, uint64_t* full, uint64_t* empty,
                                              int units, int units_per_group, int q) {
  using C = WsConfig;
  const int KT = gemm_k_steps<true>(p);
  const int c = q & 7, r0 = q >> 3;
  // Row r of a stage sits at 128 r + 16 (c ^ (r % 8)) bytes (act_offset<true>(r, c, kTileK) in
  // bf16 elements: 64-row blocks of 8 KB are rows of 128 bytes). For r = r0 + 12 j, r % 8 is
  // r0 % 8 at even j and (r0 % 8) ^ 4 at odd j, so copy j goes to one of two places per
  // stage plus 1536 j, an immediate: no per-copy arithmetic on the destination (that
  // arithmetic, ~20 dependent instructions a copy, made the producer the x path's bottleneck:
  // docs/perf-history/2026-12-07-moe-x-producer-feed.md).
  static_assert(kWsXRows % 8 == 4, "odd passes flip bit 2 of r % 8");
  const uint32_t d0 = 128 * r0 + ((c ^ (r0 & 7)) << 4);
  const uint32_t ring = smem_u32(smem);
  int s = 0;
  uint32_t phase = 0;
  for (int u = blockIdx.x; u < units; u += gridDim.x) {
    const WsUnit w = ws_unit<1>(p, u, units_per_group, 0);
    const int rows = 32 * w.nh;
    // The row's token * K; -1: zero-filled, for a row without a slot (as the gather wrote it)
    // and for a row past the unit's 32 nh, which no consumer reads (a zero fill reads no
    // global memory; copying every row spares each copy a skip test).
    int off[kWsXPasses];
#pragma unroll
    for (int j = 0; j < kWsXPasses; ++j) {
      const int r = r0 + kWsXRows * j;
      const int slot = r < rows ? __ldg(p.row_slot + w.t0 * 64 + r) : -1;
      off[j] = slot >= 0 ? (slot / p.topk) * p.K : -1;
    }
    for (int kt = 0; kt < KT; ++kt) {
      mbar_wait(empty + s, phase ^ 1);
      const uint32_t st = ring + s * C::kB;
      uint32_t at0 = st + d0, at1 = st + (d0 ^ 64);
      const __nv_bfloat16* xk = p.x + kt * kTileK + c * 8;
      // Opaque per stage: the two places once a stage (else ptxas recomputes them in every
      // predicated copy), and the base so that each copy's source is computed where it is
      // issued (a max, one wide multiply-add) rather than 16 64-bit addresses hoisted out of
      // the K loop, which spill the producer's 72 registers; the offsets opaque per copy.
      asm volatile("" : "+r"(at0), "+r"(at1), "+l"(xk));
#pragma unroll
      for (int j = 0; j < kWsXPasses; ++j) {
        int o = off[j];
        asm volatile("" : "+r"(o));
        cp_async_16_unordered_zero_if_negative((j & 1 ? at1 : at0) + kWsXRows * 128 * j, xk + max(o, 0), o);
      }
      cp_async_mbar_arrive_noinc(full + s);
      if (++s == C::kStages) {
        s = 0;
        phase ^= 1;
      }
    }
  }
  cp_async_wait_all();  // no thread leaves with its copies in flight
}

// One unit's K loop for consumer warpgroup w (BN = 32 * nh tokens) and its epilogue.
// The next stage's code and scale words are loaded while this stage's MMAs run (they
// are not wgmma operands, so ptxas keeps the MMAs asynchronous); the dequant itself
// waits for the MMAs, which read its output registers. Inactive consumers (no weight
// rows left: 2N or K not a multiple of the unit's rows) still wait for every stage
// and release it, so the ring's phases stay in step.
template <int BN, bool kGemm1, int kCluster, bool kX>
__device__ __forceinline__ void ws_consume(const MoeParams& p, uint8_t* smem, uint64_t* full, uint64_t* empty,
                                           const WsUnit& u, int w, int tid, int& s, uint32_t& phase) {
  using C = WsConfig;
  const int KT = gemm_k_steps<kGemm1>(p);
  const int RT = gemm_row_tiles<kGemm1>(p);
  const int rt = C::kConsumers * u.rq + w;
  const bool active = rt < RT;
  const int warp = tid >> 5, lane = tid & 31, g = lane >> 2;
  const uint32_t ring = smem_u32(smem);
  const uint32_t w_off = ring + C::kWeightsAt + w * kCodeTileBytes + tid * 16;
  const uint32_t s_off = ring + C::kWeightsAt + C::kS + w * kScaleTileBytes + (warp * 8 + g) * 8;
  // Descriptor of stage 0's token tile (K-major rows of 128 bytes, 8-row groups 1024 bytes
  // apart); stage s and k16 step j add s * kB / 16 + 2j to the low word (start address
  // field, no carry out: shared memory < 256 KB).
  const uint64_t desc0 = wgmma_desc_sw128(ring, 16, 1024);
  const uint32_t desc_hi = uint32_t(desc0 >> 32), desc_lo = uint32_t(desc0);

  float acc[BN / 2];
#pragma unroll
  for (int i = 0; i < BN / 2; ++i) acc[i] = 0.0f;
  uint4 codes = make_uint4(0, 0, 0, 0);
  uint2 sc = make_uint2(0, 0);
  // x rows: they came by cp.async (the generic proxy), the wgmmas read them through the
  // async one. (p.direct_x is set wherever the kX instance runs; the run-time test keeps the
  // instance's code that of the build measured in the note.)
  const bool fence_x = kX && p.direct_x;
  mbar_wait(full + s, phase);
  if (fence_x) fence_proxy_async_smem();
  if (active) {
    codes = lds_v4(w_off + s * C::kWStage);
    sc = lds_v2(s_off + s * C::kWStage);
  }
  for (int kt = 0; kt < KT; ++kt) {
    const int next = s + 1 == C::kStages ? 0 : s + 1;
    const uint32_t next_phase = next == 0 ? phase ^ 1 : phase;
    if (active) {
      uint32_t a[4][4];
      dequant_tile(codes, sc, a);
      const uint32_t lo = desc_lo + uint32_t(s * (C::kB >> 4));
      wgmma_fence();
#pragma unroll
      for (int j = 0; j < 4; ++j)
        WgmmaRS<BN>::mma(acc, a[j], (uint64_t(desc_hi) << 32) | uint64_t(lo + 2 * j), 1);
      wgmma_commit();
      if (kt + 1 < KT) {
        mbar_wait(full + next, next_phase);
        if (fence_x) fence_proxy_async_smem();
        codes = lds_v4(w_off + next * C::kWStage);
        sc = lds_v2(s_off + next * C::kWStage);
      }
      wgmma_wait<0>();
      fence_regs(acc);
    } else if (kt + 1 < KT) {
      mbar_wait(full + next, next_phase);
    }
    if (lane == 0) {
      if constexpr (kCluster > 1) {
#pragma unroll
        for (int c = 0; c < kCluster; ++c) mbar_arrive_cluster(empty + s, c);
      } else {
        mbar_arrive(empty + s);
      }
    }
    s = next;
    phase = next_phase;
  }
  if (!active) return;
  uint8_t* stg = smem + C::kStagingAt + w * C::kStaging;
  auto wg_sync = [w] { named_bar_sync(1 + w, kThreads); };
  wg_sync();  // the previous unit's staging reads are done
  if constexpr (kGemm1) {
    gemm1_epilogue<BN, true>(p, acc, reinterpret_cast<float*>(stg), u.e, u.t0 * 64, rt, tid, wg_sync);
    // Publish this row tile of the group's h to GEMM2 (see ws_producer).
    __threadfence();
    wg_sync();
    if (tid == 0) atomicAdd(p.group_ready + u.group, 1);
  } else {
    gemm2_epilogue<BN>(p, acc, reinterpret_cast<__nv_bfloat16*>(stg), u.e, u.t0 * 64, rt, tid, wg_sync);
  }
}

// Grid: a multiple of kCluster CTAs, one per SM (the rings and the staging take all
// 227 KB of shared memory). Launched with WsConfig::kThreads threads and
// WsConfig::kBytes of dynamic shared memory (and cluster dims kCluster x 1 x 1).
// GEMM2 is launched programmatically after GEMM1 and does not wait for GEMM1's grid:
// its CTAs take the SMs that GEMM1's finished CTAs leave (one CTA fits per SM), and its
// producer waits per group for h (group_ready), so GEMM2 fills GEMM1's tail. GEMM1 lets
// it launch at once; all GEMM1 CTAs are resident by then, so the wait cannot deadlock.
// kX (GEMM1, one CTA per cluster; launched where p.direct_x): the token rows come from x by
// ws_producer_x instead of xg by bulk copies.
template <bool kGemm1, int kCluster, bool kX = false>
__global__ void __launch_bounds__(WsConfig::kThreads, 1) moe_gemm_ws_kernel(const MoeParams p) {
  using C = WsConfig;
  static_assert(!kX || (kGemm1 && kCluster == 1), "x rows are read by GEMM1 at one CTA per cluster only");
  if constexpr (kGemm1) pdl_wait();
  pdl_launch_dependents();
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = align_smem_1024(smem_raw);
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + C::kBars);
  uint64_t* empty = full + C::kStages;
  const int wg = threadIdx.x >> 7, tid = threadIdx.x & 127;
  const uint32_t rank = kCluster > 1 ? cluster_cta_rank() : 0;
  const bool direct_x = kX && p.direct_x;
  if (threadIdx.x == 0) {
    for (int s = 0; s < C::kStages; ++s) {
      mbar_init(full + s, direct_x ? 1 + kWsXThreads : 2);  // the producers (direct_x: every x-copying thread)
      mbar_init(empty + s, 4 * C::kConsumers * kCluster);  // every consumer warp of the cluster
    }
    mbar_init_fence();
  }
  if constexpr (kCluster > 1)
    cluster_sync();
  else
    __syncthreads();

  const int RT = gemm_row_tiles<kGemm1>(p);
  const int units_per_group = (RT + C::kConsumers * kCluster - 1) / (C::kConsumers * kCluster);
  const int units = __ldg(p.num_groups) * units_per_group;
  if (wg == 0) {
    setmaxnreg_dec<C::kProducerRegs>();
    if (direct_x) {
      if (tid < 32 || tid >= 64) ws_producer_x(p, smem, full, empty, units, units_per_group, tid < 32 ? tid : tid - 32);
    } else if (tid == 0) {
      ws_producer<kGemm1, kCluster, true>(p, smem, full, empty, units, units_per_group, rank);
    }
    if (tid == 32) ws_producer<kGemm1, kCluster, false>(p, smem, full, empty, units, units_per_group, rank);
  } else {
    setmaxnreg_inc<C::kConsumerRegs>();
    int s = 0;
    uint32_t phase = 0;
    for (int u = blockIdx.x / kCluster; u < units; u += gridDim.x / kCluster) {
      const WsUnit unit = ws_unit<kCluster>(p, u, units_per_group, rank);
      const int w = wg - 1;
      static_assert(kGroupHalves == 6, "one case per group size");
      switch (unit.nh) {
        case 6: ws_consume<192, kGemm1, kCluster, kX>(p, smem, full, empty, unit, w, tid, s, phase); break;
        case 5: ws_consume<160, kGemm1, kCluster, kX>(p, smem, full, empty, unit, w, tid, s, phase); break;
        case 4: ws_consume<128, kGemm1, kCluster, kX>(p, smem, full, empty, unit, w, tid, s, phase); break;
        case 3: ws_consume<96, kGemm1, kCluster, kX>(p, smem, full, empty, unit, w, tid, s, phase); break;
        case 2: ws_consume<64, kGemm1, kCluster, kX>(p, smem, full, empty, unit, w, tid, s, phase); break;
        default: ws_consume<32, kGemm1, kCluster, kX>(p, smem, full, empty, unit, w, tid, s, phase); break;
      }
    }
  }
  // Clusters: no CTA may exit while its peer can still multicast into it or arrive
  // on its barriers.
  if constexpr (kCluster > 1) cluster_sync();
}

}  // namespace moe
}  // namespace dsv4
