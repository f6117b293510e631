// Sparse MQA forward: the producer warpgroup (torch-free). Paged sources, a slot's row
// offsets, and the fp8_ds_mla (register-staged dequant) and bf16 (cp.async) loops that fill
// the KV ring halves in the consumers' order and publish the key-validity masks.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>

#include "attention/sparse_mqa_layout.cuh"
#include "attention/sparse_mqa_schedule.cuh"
#include "common/cvt.cuh"
#include "common/ptx/memory.cuh"
#include "common/ptx/sync.cuh"

namespace dsv4 {
namespace attention {

constexpr uint32_t kFp8RowBytes = 576;   // 448 fp8 + 64 bf16
constexpr uint32_t kBf16RowBytes = 1024;

// The mask waits: at cluster scope in the crossover (kPair), whose peer CTA stores its
// rows' bits into this CTA's mask and arrives with a cluster-scope release.
template <bool kPair>
__device__ __forceinline__ void ring_wait(uint64_t* bar, uint32_t parity) {
  if (kPair) {
    mbar_wait_cluster(bar, parity);
  } else {
    mbar_wait(bar, parity);
  }
}

// 4 fp8 e4m3 (one 32-bit word) -> 2 words of bf16x2 (exact: e4m3 is a subset of bf16), then
// times sc2, the scale in both bf16 lanes (exact for UE8M0 scales: one rounding of an exact
// product, as the float32 product rounded to bf16 was). 10 instructions per word against 12
// for four float32 multiplies then the packs (FlashMLA's order, dequant.h in
// ../shared/research/attention-vs-flashmla.md section 1).
__device__ __forceinline__ void fp8x4_to_bf16x4(uint32_t w, uint32_t sc2, uint32_t& lo, uint32_t& hi) {
  __half2_raw h0 = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(w & 0xFFFF), __NV_E4M3);
  __half2_raw h1 = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(w >> 16), __NV_E4M3);
  float2 f0 = __half22float2(*reinterpret_cast<__half2*>(&h0));
  float2 f1 = __half22float2(*reinterpret_cast<__half2*>(&h1));
  lo = mul_bf16x2(pack_bf16x2(f0.x, f0.y), sc2);
  hi = mul_bf16x2(pack_bf16x2(f1.x, f1.y), sc2);
}

// 16 fp8 values of one row (a quarter of a 64-column scale block) times the block's UE8M0
// scale 2^(e-127) -> 16 bf16, stored as two 16-byte chunks at smem addresses lo and hi.
// Exact: a power-of-two scale only moves the exponent (results that leave the bf16 range
// round or overflow like the float32 reference rounded to bf16). The scale as bf16 bits is
// e << 7; e = 0 is the subnormal 2^-127 (0x0040, the max below), e = 255 gives inf.
__device__ __forceinline__ void dequant_fp8x16(const uint4& v, uint32_t e, uint4& o0, uint4& o1) {
  const uint32_t sc2 = max(e << 7, 0x40u) * 0x00010001u;
  fp8x4_to_bf16x4(v.x, sc2, o0.x, o0.y);
  fp8x4_to_bf16x4(v.y, sc2, o0.z, o0.w);
  fp8x4_to_bf16x4(v.z, sc2, o1.x, o1.y);
  fp8x4_to_bf16x4(v.w, sc2, o1.z, o1.w);
}
__device__ __forceinline__ void dequant_store_fp8x16(uint32_t lo, uint32_t hi, const uint4& v, uint32_t e) {
  uint4 o0, o1;
  dequant_fp8x16(v, e, o0, o1);
  sts_v4(lo, o0);
  sts_v4(hi, o1);
}

// The paged geometry of source `list` (by selects, see tile_index).
struct PagedSource {
  const uint8_t* base;
  int64_t block_stride;
  int block_size;
  FastDivmod block_div;
};
template <int kNumSrc>
__device__ __forceinline__ PagedSource paged_source(const SparseMqaParams& p, int list) {
  const bool l0 = kNumSrc == 1 || list == 0;
  return {l0 ? p.src[0].base : p.src[1].base, l0 ? p.src[0].block_stride : p.src[1].block_stride,
          l0 ? p.src[0].block_size : p.src[1].block_size, l0 ? p.src[0].block_div : p.src[1].block_div};
}

// Byte offsets (from the source base) of a slot's row data and, for fp8, its 8 scale bytes.
template <bool kFp8>
__device__ __forceinline__ void row_offsets(const PagedSource& s, int slot, int64_t& data_off, int64_t& scale_off) {
  data_off = -1;
  scale_off = 0;
  if (slot < 0) return;
  uint32_t blk_id, off;
  s.block_div.divmod(static_cast<uint32_t>(slot), blk_id, off);
  const int64_t blk = static_cast<int64_t>(blk_id) * s.block_stride;
  if (kFp8) {
    data_off = blk + static_cast<int64_t>(off) * kFp8RowBytes;
    scale_off = blk + static_cast<int64_t>(s.block_size) * kFp8RowBytes + off * 8;
  } else {
    data_off = blk + static_cast<int64_t>(off) * kBf16RowBytes;
  }
}

// fp8 producer: fills half `half` of a buffer with this warp's 16 rows and signals ready.
// Lanes 0..15 hold their row's byte offset and its 8 scale bytes.
// Lane group g = lane / 4 takes rows 2g and 2g + 1 of the warp's 16, one per batch, and lane
// q = lane % 4 the 16-byte chunks q + 4m of the row's fp8 bytes (m < 4 in the left half: scale
// blocks 0..3; m < 3 in the right half: blocks 4..6), so a batch needs one row offset and one
// scale word per lane and every address is a per-lane base plus an immediate. Group g starts
// with row 2g + (g & 1): odd and even rows alternate across groups, so each 16-byte store of
// the warp covers all 32 banks (4 wavefronts, the minimum).
// wait_free() runs once the loads are in flight and before the first write to the half: the
// loads need no free buffer, so their latency overlaps the wait.
template <typename WaitFree>
__device__ __forceinline__ void load_half_fp8(uint8_t* buf_smem, const uint8_t* base, int64_t data_off, uint2 scales,
                                              int half, uint64_t* ready, WaitFree&& wait_free) {
  // One body for both halves (the right half's fourth chunk predicated off): with a cold
  // instruction cache, a second body is fetched from DRAM on a small batch's critical path.
  const int warp = (threadIdx.x >> 5) & 3;
  const int lane = threadIdx.x & 31;
  const int g = lane >> 2, q = lane & 3;
  // tile_offset(16 warp + 2g + rb, 16 (q + 4m) + 8 s) = lane_off + m * 8192 + rb * 128 + 16 (s ^ rb)
  const uint32_t lane_off = smem_u32(buf_smem) + half * 4 * 8192 + (2 * warp + (g >> 2)) * 1024 + (g & 3) * 256 +
                            ((q ^ g) & 3) * 32;
  const uint32_t sw = half ? scales.y : scales.x;
  const uint8_t* src0 = base + half * 256 + 16 * q;
  const bool left = half == 0;  // scale blocks 0..3; the right half: 4..6 and the rope
  // Both rows' loads (8 or 6 per lane) before either row's dequant: ptxas keeps 4 ahead and
  // issues the rest as the first row's chunks free their registers.
  int64_t d[2];
  uint32_t e4[2];
  uint4 v[2][4];
#pragma unroll
  for (int bt = 0; bt < 2; ++bt) {
    const int row = 2 * g + (bt ^ (g & 1));
    d[bt] = __shfl_sync(0xffffffffu, data_off, row);
    e4[bt] = __shfl_sync(0xffffffffu, sw, row);
#pragma unroll
    for (int m = 0; m < 4; ++m) {
      v[bt][m] = d[bt] >= 0 && (m < 3 || left) ? ldg_nc_v4(src0 + d[bt] + 64 * m) : make_uint4(0, 0, 0, 0);
    }
  }
  wait_free();
  // Per row: its rope copies, then its dequant, so a row's offset dies before the next
  // row's dequant (in two loops, the one-body loader spilled at 88 registers).
#pragma unroll
  for (int bt = 0; bt < 2; ++bt) {
    const int rb = bt ^ (g & 1);
    if (half) {
      // Rope (bf16, bytes [448, 576) = d 448..511, column block 7): chunks q and q + 4,
      // straight to smem.
#pragma unroll
      for (int n = 0; n < 2; ++n) {
        const int rc = q + 4 * n;
        cp_async_16(smem_u32(buf_smem) + tile_offset(16 * warp + 2 * g + rb, 448 + 8 * rc),
                    d[bt] >= 0 ? base + d[bt] + 448 + 16 * rc : base, d[bt] >= 0);
      }
    }
    const uint32_t lo = lane_off + rb * 144, hi = lane_off + rb * 112 + 16;
#pragma unroll
    for (int m = 0; m < 4; ++m) {
      if (m < 3 || left) dequant_store_fp8x16(lo + m * 8192, hi + m * 8192, v[bt][m], (e4[bt] >> (8 * m)) & 0xFFu);
    }
  }
  if (half) cp_async_wait_all();
  fence_proxy_async_smem();
  mbar_arrive(ready);
}

// One lane's global loads of one half (`half`: 0 left, 1 right) of the fp8 cache row at byte
// offset d of base (d < 0: a skipped row, zeros), lane group g = lane / 4 on that row and
// q = lane % 4 on its 16-byte chunks: v[m] the half's chunk q + 4 m of its 256 fp8 bytes
// (m = 3 on the left only), rope[n] the bf16 rope's chunk q + 4 (n ^ (g & 1)) (right only;
// the order alternates with g & 1 for the stores' banks). Zeros where nothing is loaded.
__device__ __forceinline__ void load_row_half_fp8(uint4 (&v)[4], uint4 (&rope)[2], const uint8_t* base, int64_t d,
                                                  int half, int g, int q) {
  const uint8_t* src0 = base + half * 256 + 16 * q;
  const bool left = half == 0;
#pragma unroll
  for (int m = 0; m < 4; ++m) {
    v[m] = d >= 0 && (m < 3 || left) ? ldg_nc_v4(src0 + d + 64 * m) : make_uint4(0, 0, 0, 0);
  }
#pragma unroll
  for (int n = 0; n < 2; ++n) {
    const int rc = q + 4 * (n ^ (g & 1));
    rope[n] = d >= 0 && !left ? ldg_nc_v4(base + d + 448 + 16 * rc) : make_uint4(0, 0, 0, 0);
  }
}

// The crossover at 128 heads (kPair, sparse_mqa.cuh): the two CTAs of a cluster are the two
// head blocks of one (token, split) and read the same rows, so each producer dequantizes half
// of every tile, rows 32 rank .. 32 rank + 31, and stores them into both CTAs' buffers
// (docs/perf-history/2026-12-05-attention-crossover-plan.md). The local copy signals the
// local ready barrier as load_half_fp8 does; the peer's copy goes by st.async, whose bytes
// complete the peer's ready_remote barrier of the half (FlashMLA's transport: no fence and
// no cluster-scope release per thread, which made the first form 1.3-1.6x slower on an H100;
// this form is 1.05-1.20x slower than the unpaired kernel on an H200), armed
// by this warpgroup's thread 0 with the half's byte count once the half is free.
// Warp w's rows are 32 rank + 8 w + g, one per lane group g = lane / 4, and lane q = lane % 4
// takes the 16-byte chunks q + 4m of the row's fp8 bytes as in load_half_fp8; the rope (bytes
// [448, 576), bf16, no dequant) goes through registers too (cp.async cannot write a peer's
// shared memory), chunks q and q + 4, the odd groups' in the other order so that a quarter
// warp's 16-byte stores cover all 32 banks. peer_off: the peer's shared::cluster address of
// this CTA's smem base minus that base. ready_remote_peer: the peer's ready_remote barrier of
// the half.
constexpr uint32_t kPairHalfBytes = 32 * 256 * 2;  // 32 rows x 256 d of bf16 per half and CTA
template <typename WaitFree>
__device__ __forceinline__ void load_half_fp8_pair(uint8_t* buf_smem, const uint8_t* base, int64_t data_off,
                                                   uint2 scales, int half, uint64_t* ready, uint32_t ready_remote_peer,
                                                   uint32_t peer_off, int rank, WaitFree&& wait_free) {
  const int warp = (threadIdx.x >> 5) & 3;
  const int lane = threadIdx.x & 31;
  const int g = lane >> 2, q = lane & 3;
  // tile_offset(32 rank + 8 warp + g, 256 half + 64 m + 16 q + 8 s) = row + m * 8192 + 16 ((2q + s) ^ g)
  const uint32_t row = smem_u32(buf_smem) + half * 4 * 8192 + (4 * rank + warp) * 1024 + g * 128;
  const uint32_t lo = row + (((2 * q) ^ g) << 4), hi = row + (((2 * q + 1) ^ g) << 4);
  const int64_t d = __shfl_sync(0xffffffffu, data_off, g);
  const uint32_t e4 = __shfl_sync(0xffffffffu, half ? scales.y : scales.x, g);
  const bool left = half == 0;
  uint4 v[4], rope[2];
  load_row_half_fp8(v, rope, base, d, half, g, q);
  wait_free();
  // The peer's phase of this half is the current one: its previous phase completed before
  // the peer's consumers freed the half, which wait_free waited for.
  if (threadIdx.x == 0) mbar_arrive_expect_tx_remote(ready_remote_peer, kPairHalfBytes);
#pragma unroll
  for (int m = 0; m < 4; ++m) {
    if (m < 3 || left) {
      uint4 o0, o1;
      dequant_fp8x16(v[m], (e4 >> (8 * m)) & 0xFFu, o0, o1);
      sts_v4(lo + m * 8192, o0);
      sts_v4(hi + m * 8192, o1);
      st_async_v4(lo + m * 8192 + peer_off, o0, ready_remote_peer);
      st_async_v4(hi + m * 8192 + peer_off, o1, ready_remote_peer);
    }
  }
  if (!left) {
#pragma unroll
    for (int n = 0; n < 2; ++n) {
      const int rc = q + 4 * (n ^ (g & 1));
      const uint32_t a = row + 3 * 8192 + ((rc ^ g) << 4);  // column block 7 = the right half's fourth
      sts_v4(a, rope[n]);
      st_async_v4(a + peer_off, rope[n], ready_remote_peer);
    }
  }
  fence_proxy_async_smem();
  mbar_arrive(ready);
}

// The producers fill the four halves of a round in the order the consumers first need
// them: 0L, 1R, 0R, 1L. Step -> (buffer, half, half index hb = 2 buf + half).
struct HalfStep {
  int buf, half, hb;
};
__device__ __forceinline__ HalfStep half_step(int step) {
  const int buf = step & 1, half = (step == 1 || step == 2) ? 1 : 0;
  return HalfStep{buf, half, 2 * buf + half};
}

// Producer, before filling half hb (= 2 buf + half) in round `round` (counted over all of the
// CTA's work items): wait until the consumers have freed it.
// In the crossover the consumers of both CTAs free it (the producer writes into both); their
// arrivals only say that reads retired, so the wait stays at CTA scope.
__device__ __forceinline__ void wait_half_free(uint8_t* smem, int hb, int round) {
  if (round > 0) mbar_wait(reinterpret_cast<uint64_t*>(smem + kOffBar) + 4 + hb, (round - 1) & 1);
}
// Producer warp: the key-validity bits of its 16 rows of buffer `buf`, written once the
// buffer's first half is free (the consumer that read the previous mask released it).
__device__ __forceinline__ void publish_mask(uint8_t* smem, int buf, unsigned valid16) {
  if ((threadIdx.x & 31) == 0) {
    reinterpret_cast<uint16_t*>(smem + kOffMask)[buf * 4 + ((threadIdx.x >> 5) & 3)] = static_cast<uint16_t>(valid16);
    mbar_arrive(reinterpret_cast<uint64_t*>(smem + kOffBar) + 8 + buf);
  }
}

// kPair: the crossover's producer warp: the key-validity bits of its 8 rows (32 rank + 8 warp
// ..) into byte 4 rank + warp of both CTAs' masks of buffer `buf`, arriving on both
// mask_ready barriers (8 arrivals each).
__device__ __forceinline__ void publish_mask_pair(uint8_t* smem, int buf, unsigned valid8, int rank,
                                                  uint32_t peer_off) {
  if ((threadIdx.x & 31) == 0) {
    const int byte = buf * 8 + 4 * rank + ((threadIdx.x >> 5) & 3);
    smem[kOffMask + byte] = static_cast<uint8_t>(valid8);
    sts_cluster_u8(smem_u32(smem + kOffMask + byte) + peer_off, valid8);
    uint64_t* mask_ready = reinterpret_cast<uint64_t*>(smem + kOffBar) + 8 + buf;
    mbar_arrive(mask_ready);
    mbar_arrive_remote(smem_u32(mask_ready) + peer_off);
  }
}

// A row lane's scale bytes of tile `tile` at slot sl (the row lanes hold a tile row each). fp8
// rows of skipped entries (sl < 0) are zeros; their scale byte 127 (2^0) keeps them zeros.
template <int kNumSrc>
__device__ __forceinline__ uint2 tile_scales(const SparseMqaParams& p, const TokenTiles& tt, int tile, int sl) {
  uint2 sw = make_uint2(0x7F7F7F7Fu, 0x7F7F7F7Fu);
  if (sl >= 0) {
    const PagedSource s = paged_source<kNumSrc>(p, tile_list<kNumSrc>(tt, tile));
    int64_t d, so;
    row_offsets<true>(s, sl, d, so);
    sw = ldg_nc_v2(s.base + so);
  }
  return sw;
}

// Tile `tile`'s fp8 rows into L2, the slot of each row held by one of the first kRowLanes
// lanes: lane l covers the row of lane l % kRowLanes at bytes min(128 (l / kRowLanes +
// kGroups m), 575), m < kLines (the six 128-byte lines a 576-byte row can touch; with 8 row
// lanes, 4 groups of 2 lines cover them). `lane` is the caller's lane index (recomputed here from
// threadIdx, the 64-key kernels' producers came out 8-16 instructions longer).
template <int kNumSrc, int kRowLanes = 16>
__device__ __forceinline__ void prefetch_tile_rows_l2(const SparseMqaParams& p, const TokenTiles& tt, int tile,
                                                      int slot, int lane) {
  constexpr int kGroups = 32 / kRowLanes, kLines = (6 + kGroups - 1) / kGroups;
  const PagedSource s = paged_source<kNumSrc>(p, tile_list<kNumSrc>(tt, tile));
  int64_t d, so;
  row_offsets<true>(s, slot, d, so);
  d = __shfl_sync(0xffffffffu, d, lane & (kRowLanes - 1));
  if (d >= 0) {
#pragma unroll
    for (int m = 0; m < kLines; ++m) prefetch_l2(s.base + d + min(128 * (lane / kRowLanes + kGroups * m), 575));
  }
}

// fp8_ds_mla rows: register-staged loads, dequantized into the buffer. kPair: the crossover
// (load_half_fp8_pair), rows 32 rank .. 32 rank + 31 of every tile into both CTAs.
template <int kNumSrc, bool kPair = false>
__device__ __forceinline__ void producer_loop_fp8(const SparseMqaParams& p, const TokenTiles& tt, int b, int i,
                                                  uint8_t* smem, int round_base) {
  // Everything from the one smem base: separate pointers would cost registers.
  uint64_t* ready = reinterpret_cast<uint64_t*>(smem + kOffBar);
  const int warp = (threadIdx.x >> 5) & 3;
  const int lane = threadIdx.x & 31;
  // The row whose slot this lane resolves: lanes 0..15 of the warp's 16 rows, or (kPair)
  // lanes 0..7 of its 8. The cluster's rank is the work item's head block (blockIdx.x % 2,
  // sparse_mqa_schedule.cuh), and the peer's smem is this CTA's at a fixed offset.
  const int rank = kPair ? static_cast<int>(blockIdx.x & 1) : 0;
  const uint32_t peer_off = kPair ? mapa_u32(smem_u32(smem), rank ^ 1) - smem_u32(smem) : 0;
  constexpr int kRowLanes = kPair ? 8 : 16;
  const int row_lane = kPair ? 32 * rank + 8 * warp + (lane & 7) : warp * 16 + (lane & 15);
  const int rounds = token_rounds(tt);

  // Per lane 0..15 and tile of the round: the row's slot and its 8 scale bytes, both
  // fetched one round ahead, and its raw index two rounds ahead, so index and scale loads
  // are never waited for.
  int slot[2], slot_next[2], raw_next[2];
  uint2 scales[2], scales_next[2];
  const bool row_lane_ok = lane < kRowLanes;
#pragma unroll
  for (int k = 0; k < 2; ++k) {
    const int raw = row_lane_ok ? tile_index<kNumSrc>(p, tt, b, i, tt.t0 + k, row_lane) : -1;
    raw_next[k] = row_lane_ok ? tile_index<kNumSrc>(p, tt, b, i, tt.t0 + 2 + k, row_lane) : -1;
    slot[k] = index_slot<kNumSrc>(p, tt, tt.t0 + k, raw);
    scales[k] = tile_scales<kNumSrc>(p, tt, tt.t0 + k, slot[k]);
  }

  for (int r = 0; r < rounds; ++r) {
    const int tile0 = tt.t0 + 2 * r;
    // Next round: its slots (indices loaded last round), its scales and its rows into L2;
    // the round after next: its indices.
#pragma unroll
    for (int k = 0; k < 2; ++k) {
      slot_next[k] = index_slot<kNumSrc>(p, tt, tile0 + 2 + k, raw_next[k]);
      raw_next[k] = row_lane_ok ? tile_index<kNumSrc>(p, tt, b, i, tile0 + 4 + k, row_lane) : -1;
      scales_next[k] = tile_scales<kNumSrc>(p, tt, tile0 + 2 + k, slot_next[k]);
      prefetch_tile_rows_l2<kNumSrc, kRowLanes>(p, tt, tile0 + 2 + k, slot_next[k], lane);  // its rows into L2
    }
    int64_t data_off[2];
#pragma unroll
    for (int k = 0; k < 2; ++k) {
      int64_t so;
      row_offsets<true>(paged_source<kNumSrc>(p, tile_list<kNumSrc>(tt, tile0 + k)), slot[k], data_off[k], so);
    }

    // Halves in half_step order. Not unrolled: the compiler would hoist every step's row
    // addresses and spill them (88 registers here).
#pragma unroll 1
    for (int step = 0; step < 4; ++step) {
      const auto [buf, half, hb] = half_step(step);
      const auto wait_free = [&] {
        wait_half_free(smem, hb, round_base + r);
        if (step < 2) {
          const unsigned valid = __ballot_sync(0xffffffffu, (buf ? slot[1] : slot[0]) >= 0);
          if (kPair) {
            publish_mask_pair(smem, buf, valid & 0xFFu, rank, peer_off);
          } else {
            publish_mask(smem, buf, valid & 0xFFFFu);
          }
        }
      };
      const uint8_t* base = paged_source<kNumSrc>(p, tile_list<kNumSrc>(tt, tile0 + buf)).base;
      // (Selects, not data_off[buf]: a runtime index would put the arrays in local memory.)
      uint8_t* dst = smem + kOffKV + buf * kBufBytes;
      const int64_t off = buf ? data_off[1] : data_off[0];
      const uint2 sc = buf ? scales[1] : scales[0];
      if (kPair) {
        load_half_fp8_pair(dst, base, off, sc, half, &ready[hb], smem_u32(&ready[kBarReadyRemote + hb]) + peer_off,
                           peer_off, rank, wait_free);
      } else {
        load_half_fp8(dst, base, off, sc, half, &ready[hb], wait_free);
      }
    }
#pragma unroll
    for (int k = 0; k < 2; ++k) {
      slot[k] = slot_next[k];
      scales[k] = scales_next[k];
    }
  }
}

// bf16 rows by cp.async (zero-filled when skipped); the producer never waits for its copies.
// Lane group grp = 4 * warp + lane / 8 owns rows 4 grp .. 4 grp + 3 of every tile and lane % 8
// one 16-byte chunk of each 128-byte column block, so every copy address is a per-row base plus
// an immediate and each lane resolves its own rows (no shuffles: this loop is the producer's
// whole instruction budget).
template <int kNumSrc>
__device__ __forceinline__ void producer_loop_bf16(const SparseMqaParams& p, const TokenTiles& tt, int b, int i,
                                                   uint8_t* smem, int round_base) {
  uint64_t* ready = reinterpret_cast<uint64_t*>(smem + kOffBar);
  const int warp = (threadIdx.x >> 5) & 3;
  const int lane = threadIdx.x & 31;
  const int grp = 4 * warp + (lane >> 3);
  const int chunk = lane & 7;
  // smem address of this lane's chunk of row 4 grp + k in column block 0 of buffer 0.
  uint32_t srow[4];
#pragma unroll
  for (int k = 0; k < 4; ++k) srow[k] = smem_u32(smem + kOffKV) + tile_offset(4 * grp + k, 8 * chunk);
  const int rounds = token_rounds(tt);

  // Byte offset of a raw index's row from its source base, -1 when skipped.
  const auto row_off = [&](int tile, int raw) {
    int64_t d, so;
    row_offsets<false>(paged_source<kNumSrc>(p, tile_list<kNumSrc>(tt, tile)), index_slot<kNumSrc>(p, tt, tile, raw), d, so);
    return d;
  };
  // Raw indices of this lane's rows: this round's and the next round's (loaded two rounds ahead).
  int raw[2][4], raw_next[2][4];
#pragma unroll
  for (int t = 0; t < 2; ++t) {
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      raw[t][k] = tile_index<kNumSrc>(p, tt, b, i, tt.t0 + t, 4 * grp + k);
      raw_next[t][k] = tile_index<kNumSrc>(p, tt, b, i, tt.t0 + 2 + t, 4 * grp + k);
    }
  }

  for (int r = 0; r < rounds; ++r) {
    const int tile0 = tt.t0 + 2 * r;
    int64_t off[2][4];
#pragma unroll
    for (int t = 0; t < 2; ++t) {
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        off[t][k] = row_off(tile0 + t, raw[t][k]);
        raw[t][k] = raw_next[t][k];
        raw_next[t][k] = tile_index<kNumSrc>(p, tt, b, i, tile0 + 4 + t, 4 * grp + k);
      }
      // Next round's rows into L2, one 128-byte line per lane and row (DSV4_ATTN_ROW_PREFETCH=1;
      // off by default: 2026-12-06-attention-prefill-row-prefetch.md).
      if (p.row_prefetch) {
        const uint8_t* nbase = paged_source<kNumSrc>(p, tile_list<kNumSrc>(tt, tile0 + 2 + t)).base;
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          const int64_t d = row_off(tile0 + 2 + t, raw[t][k]);
          if (d >= 0) prefetch_l2(nbase + d + 128 * chunk);
        }
      }
    }

    // Halves in half_step order.
#pragma unroll 1
    for (int step = 0; step < 4; ++step) {
      const auto [buf, half, hb] = half_step(step);
      wait_half_free(smem, hb, round_base + r);
      // (Selects, not off[buf]: a runtime index would put the array in local memory.)
      int64_t d[4];
#pragma unroll
      for (int k = 0; k < 4; ++k) d[k] = buf ? off[1][k] : off[0][k];
      if (step < 2) {
        // Bit 4 g + k of warp w's 16 bits = row 16 w + 4 g + k, g = lane / 8.
        unsigned valid = 0;
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          const unsigned v = __ballot_sync(0xffffffffu, d[k] >= 0);
#pragma unroll
          for (int g = 0; g < 4; ++g) valid |= ((v >> (8 * g)) & 1u) << (4 * g + k);
        }
        publish_mask(smem, buf, valid);
      }
      const uint8_t* base = paged_source<kNumSrc>(p, tile_list<kNumSrc>(tt, tile0 + buf)).base;
      const uint32_t sbase = buf * kBufBytes + half * (kBufBytes / 2);
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const bool ok = d[k] >= 0;
        const uint8_t* g = ok ? base + d[k] + 512 * half + 16 * chunk : base;
#pragma unroll
        for (int blk = 0; blk < 4; ++blk) cp_async_16(srow[k] + sbase + blk * 8192, g + (ok ? 128 * blk : 0), ok);
      }
      cp_async_mbar_arrive_noinc(&ready[hb]);
    }
  }
}

}  // namespace attention
}  // namespace dsv4
