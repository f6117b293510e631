// Sparse MQA forward, fp8_ds_mla caches, 128 heads: the two-round ring of 32-key tiles
// (DSV4_ATTN_RING32=1; =2 the same with the producer's loads one half-step ahead,
// producer_loop_ring32_ahead; design: docs/perf-history/2026-12-07-attention-pro-tile-ring-study.md,
// "The structural candidate: a two-round ring of 32-key tiles"; what was built:
// docs/perf-history/2026-12-07-attention-ring32.md). Torch-free.
//
// Today's kernel (sparse_mqa.cuh) holds exactly one round in its ring: two 64-key buffers,
// tile 2r in buffer 0 and 2r + 1 in buffer 1, each read by both consumers until the round's
// last PV, so the producer refills a half only after the round that reads it is (nearly)
// done and every round carries two to three post-free half latencies (the study's "coupled
// cycle"). Here the same 128 KB holds four 32-key buffers and a round is ONE 64-key tile of
// the schedule, split in two 32-key sub-tiles: rows 0..31 for consumer 0, rows 32..63 for
// consumer 1. The ring holds two rounds (buffer set R % 2 for the CTA's global round R), so
// the producer fills round R + 1 while round R is computed; the seesaw stays (each consumer
// its own S and softmax, half of O, P handed over through smem), at twice the max / P
// exchanges per 64 keys and S as m64n32k16 (Q re-read per 32 keys).
//
// What stays as today: kTileKeys = 64 is the unit of the schedule (token tiles, the split
// count of pick_splits / choose_splits, the combine); an item's rounds are its tiles t1 - t0
// (an odd count needs no empty tile here), so under DSV4_ATTN_TILE_SPLITS=1 a default-mode
// split takes whole tiles, not pairs (token_tiles<kNumSrc, true>: 18 tiles in 4 splits are
// 4, 5, 4, 5, not 4, 4, 4, 6); batch-invariant splits keep their fixed pairs (a split that
// starts past the token's last tile has no round, ring32_rounds). Round 0 of every item is
// filled by the producer (no cooperative first round under this switch).
//
// Buffers and barriers (all indices in this file):
//   buffer   sb = 2 set + c (c = consumer = sub-tile: tile rows 32 c .. 32 c + 31), 32 KB each,
//            [32 rows x 512] bf16 in 8 column blocks of 64 d (4 KB: 32 rows x 128 B, 128-byte
//            swizzle, tile_offset32);
//   halves   hb = 2 sb + half (half 0: d < 256, 1: d >= 256): ready[hb] (128 producer
//            arrivals), freed[hb] = ready[8 + hb] (128 arrivals of the half's last reader);
//   masks    mask_ready[sb] = ready[16 + sb] (one arrival per producer warp), the 32-bit key
//            mask of buffer sb at kOffMask + 4 sb (byte w from producer warp w).
// Each barrier serves every other round: in global round R, use u = R >> 1 of set R % 2.
// Consumers wait ready / mask_ready with parity u & 1; the producer, before filling round
// R >= 2, waits freed with parity (u - 1) & 1, the phase the consumers completed in round
// R - 2. A parity wait cannot pass on a stale phase: the producer fills use u only after use
// u - 1 was freed, so a barrier is never two phases ahead of its waiter (ready: the consumer's
// free of use u, needed before use u + 1 is filled, follows its ready wait of use u; freed:
// the consumers' free of use u + 1 follows the ready of use u + 1, which the producer arrives
// only after its freed wait of use u).
// Last readers, as today's halves with buffer b -> sb = 2 set + b: consumer c's S reads its
// buffer whole; consumer 0's PV reads both buffers' left halves, consumer 1's both right
// halves. 0L (hb 4 set) is released by consumer 0 after its register-P PV; 1L (4 set + 2) by
// consumer 0 after its smem-P PV (consumer 1's S of buffer 1, which also reads 1L, finished
// before consumer 1 handed over P_1: kBarP1); 1R (4 set + 3) by consumer 1 after its
// register-P PV; 0R (4 set + 1) by consumer 1 after its smem-P PV (consumer 0's S read it
// before kBarP0). The mask of buffer sb is rewritten after the free wait of the buffer's
// first-filled half (0L for c = 0, 1R for c = 1), which its reader released after reading
// the mask (mask_and_max precedes the register-P PV).
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "attention/sparse_mqa.cuh"  // load_q_tile, kMaxSlack
#include "attention/sparse_mqa_item.cuh"
#include "attention/sparse_mqa_layout.cuh"
#include "attention/sparse_mqa_params.cuh"
#include "attention/sparse_mqa_producer.cuh"
#include "attention/sparse_mqa_schedule.cuh"
#include "attention/sparse_mqa_softmax.cuh"
#include "common/cvt.cuh"
#include "common/mma/wgmma.cuh"
#include "common/ptx/math.cuh"
#include "common/ptx/memory.cuh"
#include "common/ptx/pdl.cuh"
#include "common/ptx/regs.cuh"
#include "common/ptx/sync.cuh"

namespace dsv4 {
namespace attention {

constexpr int kSubKeys = 32;                                 // keys per ring buffer
constexpr int kSubBufBytes = kSubKeys * kHeadDim * 2;        // 32 KB; 4 of them = today's 2 x 64 KB
constexpr int kSubColBytes = kSubKeys * 128;                 // one column block of 64 d: 4 KB
static_assert(4 * kSubBufBytes == 2 * kBufBytes, "the ring's bytes are today's");
static_assert(2 * kSubKeys == kTileKeys, "a round is one 64-key tile of the schedule");
constexpr int kRing32Free = 8;        // freed[hb] = ready[kRing32Free + hb]
constexpr int kRing32MaskReady = 16;  // mask_ready[sb] = ready[kRing32MaskReady + sb]
constexpr int kRing32Bars = 20;
// Same offsets as today's layout up to the barriers (Q, the 128 KB ring, two P tiles of which
// the first 64 bytes of each row are used (64 x 32 keys), maxima, sums, 16 bytes of masks:
// 4 x 32 bits instead of 2 x 64), then 20 barriers instead of 14.
constexpr int kSmemBytesRing32 = kOffBar + kRing32Bars * 8 + 1024;
static_assert(kSmemBytesRing32 <= 227 * 1024, "one CTA per SM");

// Byte offset inside a swizzled [32 rows x 512] bf16 buffer of the 16-byte chunk holding
// elements d .. d + 7 of row r (tile_offset with 4 KB column blocks).
__device__ __forceinline__ uint32_t tile_offset32(int r, int d) {
  const int c = d >> 6, j = (d >> 3) & 7;
  return c * kSubColBytes + (r >> 3) * 1024 + (r & 7) * 128 + ((j ^ (r & 7)) << 4);
}

// An item's rounds: one per 64-key tile of its split (no empty tile for an odd count). In
// batch-invariant mode a split may start past a token's last tile (token_tiles clamps the
// split's pair, not t0: n = 3 tiles, split 1 gives t0 = 4, t1 = 3), where today's kernel
// counts (t1 - t0 + 1) >> 1 = 0 pairs; here that item has no round, never -1 (a negative
// count would move round_base back and every later item's parity waits by a use).
__device__ __forceinline__ int ring32_rounds(const TokenTiles& tt) { return max(tt.t1 - tt.t0, 0); }

// fp8 producer: half `half` of sub-tile buffer `buf_smem` (32 rows x 256 d), the rows of
// sub-tile c, then ready. Lanes 0..15 of each warp hold the byte offset and scale bytes of
// tile row 32 (lane / 8) + 8 warp + lane % 8, so sub-tile c's row 8 warp + g sits on lane
// 8 c + g. Lane group g = lane / 4 takes that one row, lane q = lane % 4 its 16-byte chunks
// q + 4 m (the crossover loader's mapping, load_half_fp8_pair): 4 (left) or 3 + 2 rope
// (right) loads per lane, all issued before the free wait, the rope included (today's
// cp.async rope was a round trip waited for after the free). Each 16-byte store of a
// quarter warp covers all 32 banks: even groups store even chunks (2q) ^ g, odd groups odd
// ones; the rope's chunk order alternates with g & 1 for the same reason.
template <typename WaitFree>
__device__ __forceinline__ void load_sub_half_fp8(uint8_t* buf_smem, const uint8_t* base, int64_t data_off,
                                                  uint2 scales, int c, int half, uint64_t* ready,
                                                  WaitFree&& wait_free) {
  const int warp = (threadIdx.x >> 5) & 3;
  const int lane = threadIdx.x & 31;
  const int g = lane >> 2, q = lane & 3;
  // tile_offset32(8 warp + g, 256 half + 64 m + 16 q + 8 s) = row + m * 4 KB + 16 ((2q + s) ^ g)
  const uint32_t row = smem_u32(buf_smem) + half * 4 * kSubColBytes + warp * 1024 + g * 128;
  const uint32_t lo = row + (((2 * q) ^ g) << 4), hi = row + (((2 * q + 1) ^ g) << 4);
  const int64_t d = __shfl_sync(0xffffffffu, data_off, 8 * c + g);
  const uint32_t e4 = __shfl_sync(0xffffffffu, half ? scales.y : scales.x, 8 * c + g);
  const bool left = half == 0;
  uint4 v[4], rope[2];
  load_row_half_fp8(v, rope, base, d, half, g, q);
  wait_free();
#pragma unroll
  for (int m = 0; m < 4; ++m) {
    if (m < 3 || left) dequant_store_fp8x16(lo + m * kSubColBytes, hi + m * kSubColBytes, v[m], (e4 >> (8 * m)) & 0xFFu);
  }
  if (!left) {
#pragma unroll
    for (int n = 0; n < 2; ++n) {
      const int rc = q + 4 * (n ^ (g & 1));
      sts_v4(row + 3 * kSubColBytes + ((rc ^ g) << 4), rope[n]);  // d 448 + 8 rc: column block 7
    }
  }
  fence_proxy_async_smem();  // generic-proxy stores -> the consumers' wgmma reads
  mbar_arrive(ready);
}

// The producer warpgroup's rounds of one item (round_base: the CTA's earlier rounds).
// Per round (one tile): the next tile's slots and scales (its indices loaded a round
// earlier), the tile after next's indices, the next tile's rows into L2; then the four
// halves in the order the consumers first need them (half_step: 0L, 1R, 0R, 1L, buffer
// b = sub-tile b of set R % 2).
template <int kNumSrc>
__device__ __forceinline__ void producer_loop_ring32(const SparseMqaParams& p, const TokenTiles& tt, int b, int i,
                                                     uint8_t* smem, int round_base) {
  uint64_t* ready = reinterpret_cast<uint64_t*>(smem + kOffBar);
  const int warp = (threadIdx.x >> 5) & 3;
  const int lane = threadIdx.x & 31;
  const bool row_lane_ok = lane < 16;
  const int row_lane = 32 * ((lane >> 3) & 1) + 8 * warp + (lane & 7);  // tile row of lanes 0..15
  const int rounds = ring32_rounds(tt);
  int slot, raw_next;
  uint2 scales;
  {
    const int raw = row_lane_ok ? tile_index<kNumSrc>(p, tt, b, i, tt.t0, row_lane) : -1;
    raw_next = row_lane_ok ? tile_index<kNumSrc>(p, tt, b, i, tt.t0 + 1, row_lane) : -1;
    slot = index_slot<kNumSrc>(p, tt, tt.t0, raw);
    scales = tile_scales<kNumSrc>(p, tt, tt.t0, slot);
  }
  for (int r = 0; r < rounds; ++r) {
    const int tile = tt.t0 + r;
    const int gr = round_base + r;  // the CTA's global round: buffer set gr % 2, use gr / 2
    const int slot_next = index_slot<kNumSrc>(p, tt, tile + 1, raw_next);
    raw_next = row_lane_ok ? tile_index<kNumSrc>(p, tt, b, i, tile + 2, row_lane) : -1;
    const uint2 scales_next = tile_scales<kNumSrc>(p, tt, tile + 1, slot_next);
    prefetch_tile_rows_l2<kNumSrc>(p, tt, tile + 1, slot_next, lane);  // the next tile's rows
    const PagedSource src = paged_source<kNumSrc>(p, tile_list<kNumSrc>(tt, tile));
    int64_t data_off, so;
    row_offsets<true>(src, slot, data_off, so);
    // Bit l (l < 16): lane l's row is used; sub-tile c's rows are bits 8 c .. 8 c + 7.
    const unsigned valid = __ballot_sync(0xffffffffu, slot >= 0);
    const int set = gr & 1;
    // Not unrolled: one body for the four halves (today's loop does the same, for code size
    // and registers).
#pragma unroll 1
    for (int step = 0; step < 4; ++step) {
      const auto [c, half, hb4] = half_step(step);  // c: sub-tile (buffer of the set)
      const int sb = 2 * set + c;
      const int hb = 4 * set + hb4;
      const auto wait_free = [&] {
        // The phase the consumers completed on this half in round gr - 2 (none before).
        if (gr >= 2) mbar_wait(&ready[kRing32Free + hb], ((gr >> 1) - 1) & 1);
        if (step < 2 && lane == 0) {  // the buffer's first half: its mask's reader is done
          smem[kOffMask + 4 * sb + warp] = static_cast<uint8_t>(valid >> (8 * c));
          mbar_arrive(&ready[kRing32MaskReady + sb]);
        }
      };
      load_sub_half_fp8(smem + kOffKV + sb * kSubBufBytes, src.base, data_off, scales, c, half, &ready[hb], wait_free);
    }
    slot = slot_next;
    scales = scales_next;
  }
}

// DSV4_ATTN_RING32=2 (kLoadsAhead = 1): the same halves, the same loads and arithmetic, in
// another order: each half's global loads are issued one half-step ahead, before the
// previous half's free wait and dequant, so that a half's load round trip overlaps the
// previous half's dequant and stores (software pipelining over the half-steps, across the
// round boundary too: round R + 1's 0L is loaded during round R's 1L; not across items).
// A half's loads of one lane: x[0..2] its fp8 chunks q + 4 m (m < 3), x[3] the fourth fp8
// chunk (left half) or rope chunk n = 0 (right), x[4] rope chunk n = 1 (right; zeros on the
// left). Same addresses and zero fills as load_sub_half_fp8.
__device__ __forceinline__ void issue_sub_half_loads(uint4 (&x)[5], const uint8_t* base, int64_t data_off, int c,
                                                     int half) {
  const int lane = threadIdx.x & 31;
  const int g = lane >> 2, q = lane & 3;
  const int64_t d = __shfl_sync(0xffffffffu, data_off, 8 * c + g);
  const uint8_t* src0 = base + half * 256 + 16 * q;
  const bool left = half == 0;
  const int rc0 = q + 4 * (g & 1), rc1 = q + 4 * ((g & 1) ^ 1);  // the rope chunks n = 0, 1
#pragma unroll
  for (int m = 0; m < 3; ++m) x[m] = d >= 0 ? ldg_nc_v4(src0 + d + 64 * m) : make_uint4(0, 0, 0, 0);
  x[3] = d >= 0 ? ldg_nc_v4(left ? src0 + d + 192 : base + d + 448 + 16 * rc0) : make_uint4(0, 0, 0, 0);
  x[4] = d >= 0 && !left ? ldg_nc_v4(base + d + 448 + 16 * rc1) : make_uint4(0, 0, 0, 0);
}
// The rest of load_sub_half_fp8 on loads issued earlier: the free wait, dequant and stores
// (the same stores in the same order), fence, ready.
template <typename WaitFree>
__device__ __forceinline__ void store_sub_half_fp8(uint8_t* buf_smem, const uint4 (&x)[5], uint2 scales, int c,
                                                   int half, uint64_t* ready, WaitFree&& wait_free) {
  const int warp = (threadIdx.x >> 5) & 3;
  const int lane = threadIdx.x & 31;
  const int g = lane >> 2, q = lane & 3;
  const uint32_t row = smem_u32(buf_smem) + half * 4 * kSubColBytes + warp * 1024 + g * 128;
  const uint32_t lo = row + (((2 * q) ^ g) << 4), hi = row + (((2 * q + 1) ^ g) << 4);
  const uint32_t e4 = __shfl_sync(0xffffffffu, half ? scales.y : scales.x, 8 * c + g);
  const bool left = half == 0;
  wait_free();
#pragma unroll
  for (int m = 0; m < 3; ++m) {
    dequant_store_fp8x16(lo + m * kSubColBytes, hi + m * kSubColBytes, x[m], (e4 >> (8 * m)) & 0xFFu);
  }
  if (left) {
    dequant_store_fp8x16(lo + 3 * kSubColBytes, hi + 3 * kSubColBytes, x[3], e4 >> 24);
  } else {
    const int rc0 = q + 4 * (g & 1), rc1 = q + 4 * ((g & 1) ^ 1);
    sts_v4(row + 3 * kSubColBytes + ((rc0 ^ g) << 4), x[3]);  // d 448 + 8 rc: column block 7
    sts_v4(row + 3 * kSubColBytes + ((rc1 ^ g) << 4), x[4]);
  }
  fence_proxy_async_smem();  // generic-proxy stores -> the consumers' wgmma reads
  mbar_arrive(ready);
}

// producer_loop_ring32 with the loads one half-step ahead. The half-steps in pairs (steps
// 2j, 2j + 1 = (sub-tile 0, half j), (sub-tile 1, half 1 - j)): sub-tile 0's halves in xa,
// sub-tile 1's in xb, so that a rolled pair needs no register moves. Before step s's free
// wait, step s + 1's loads: step 3's are round R + 1's 0L (the next tile's offsets from
// slot_next, known since this round's prologue), none after an item's last round; an item's
// first 0L is loaded before its first round's prologue (which then overlaps those loads).
template <int kNumSrc>
__device__ __forceinline__ void producer_loop_ring32_ahead(const SparseMqaParams& p, const TokenTiles& tt, int b,
                                                           int i, uint8_t* smem, int round_base) {
  uint64_t* ready = reinterpret_cast<uint64_t*>(smem + kOffBar);
  const int warp = (threadIdx.x >> 5) & 3;
  const int lane = threadIdx.x & 31;
  const bool row_lane_ok = lane < 16;
  const int row_lane = 32 * ((lane >> 3) & 1) + 8 * warp + (lane & 7);  // tile row of lanes 0..15
  const int rounds = ring32_rounds(tt);
  int slot, raw_next;
  uint2 scales;
  uint4 xa[5], xb[5];
  {
    const int raw = row_lane_ok ? tile_index<kNumSrc>(p, tt, b, i, tt.t0, row_lane) : -1;
    raw_next = row_lane_ok ? tile_index<kNumSrc>(p, tt, b, i, tt.t0 + 1, row_lane) : -1;
    slot = index_slot<kNumSrc>(p, tt, tt.t0, raw);
    if (rounds > 0) {  // round 0's 0L
      const PagedSource src = paged_source<kNumSrc>(p, tile_list<kNumSrc>(tt, tt.t0));
      int64_t data_off, so;
      row_offsets<true>(src, slot, data_off, so);
      issue_sub_half_loads(xa, src.base, data_off, 0, 0);
    }
    scales = tile_scales<kNumSrc>(p, tt, tt.t0, slot);
  }
  for (int r = 0; r < rounds; ++r) {
    const int tile = tt.t0 + r;
    const int gr = round_base + r;
    const int slot_next = index_slot<kNumSrc>(p, tt, tile + 1, raw_next);
    raw_next = row_lane_ok ? tile_index<kNumSrc>(p, tt, b, i, tile + 2, row_lane) : -1;
    const uint2 scales_next = tile_scales<kNumSrc>(p, tt, tile + 1, slot_next);
    prefetch_tile_rows_l2<kNumSrc>(p, tt, tile + 1, slot_next, lane);
    const PagedSource src = paged_source<kNumSrc>(p, tile_list<kNumSrc>(tt, tile));
    int64_t data_off, so;
    row_offsets<true>(src, slot, data_off, so);
    const unsigned valid = __ballot_sync(0xffffffffu, slot >= 0);
    const int set = gr & 1;
#pragma unroll 1
    for (int j = 0; j < 2; ++j) {
      const auto wait_free = [&](int c, int hb) {
        return [&, c, hb] {
          if (gr >= 2) mbar_wait(&ready[kRing32Free + 4 * set + hb], ((gr >> 1) - 1) & 1);
          if (j == 0 && lane == 0) {  // steps 0 and 1: the buffer's first half
            const int sb = 2 * set + c;
            smem[kOffMask + 4 * sb + warp] = static_cast<uint8_t>(valid >> (8 * c));
            mbar_arrive(&ready[kRing32MaskReady + sb]);
          }
        };
      };
      // Step 2j (sub-tile 0, half j, hb j), loads of step 2j + 1 first.
      issue_sub_half_loads(xb, src.base, data_off, 1, 1 - j);
      store_sub_half_fp8(smem + kOffKV + (2 * set) * kSubBufBytes, xa, scales, 0, j, &ready[4 * set + j],
                         wait_free(0, j));
      // Step 2j + 1 (sub-tile 1, half 1 - j, hb 3 - j), loads of step 2j + 2 first: 0R of
      // this round, or round R + 1's 0L.
      if (j == 0) {
        issue_sub_half_loads(xa, src.base, data_off, 0, 1);
      } else if (r + 1 < rounds) {
        const PagedSource sn = paged_source<kNumSrc>(p, tile_list<kNumSrc>(tt, tile + 1));
        int64_t dn, son;
        row_offsets<true>(sn, slot_next, dn, son);
        issue_sub_half_loads(xa, sn.base, dn, 0, 0);
      }
      store_sub_half_fp8(smem + kOffKV + (2 * set + 1) * kSubBufBytes, xb, scales, 1, 1 - j,
                         &ready[4 * set + 3 - j], wait_free(1, 3 - j));
    }
    slot = slot_next;
    scales = scales_next;
  }
}

// The kernel: sparse_mqa_fwd_kernel's structure (persistent CTAs over work items, the
// producer warpgroup and the two seesaw consumers, the same epilogue), over the ring above.
// A kernel of its own rather than a template argument of sparse_mqa_fwd_kernel, so that
// today's instances are untouched by construction (their SASS is checked identical).
// kLoadsAhead: 0 = producer_loop_ring32 (DSV4_ATTN_RING32=1), 1 = producer_loop_ring32_ahead
// (=2); the consumers are the same code in both.
template <int kNumSrc, int kLoadsAhead>
__global__ void __launch_bounds__(kThreads, 1) sparse_mqa_fwd_ring32_kernel(const __grid_constant__ SparseMqaParams p) {
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = align_smem_1024(smem_raw);
  uint64_t* ready = reinterpret_cast<uint64_t*>(smem + kOffBar);

  if (threadIdx.x == 0) {
    for (int k = 0; k < 16; ++k) mbar_init(&ready[k], 128);  // ready[8], freed[8]
    for (int k = 0; k < 4; ++k) mbar_init(&ready[kRing32MaskReady + k], 4);
    mbar_init_fence();
  }
  __syncthreads();
  // PDL: every global access after the wait (as sparse_mqa_fwd_kernel).
  pdl_wait();
  const int wg = threadIdx.x >> 7;
  if (wg == 0) {
    setmaxnreg_dec<kProducerRegs>();
    const int num_items = num_work_items(p);
    int round_base = 0;
    for (int item = blockIdx.x; item < num_items; item += gridDim.x) {
      const WorkItem wi = work_item(p, item);
      const TokenTiles tt = token_tiles<kNumSrc, true>(p, wi.b, wi.split);
      if constexpr (kLoadsAhead == 0) {
        producer_loop_ring32<kNumSrc>(p, tt, wi.b, wi.i, smem, round_base);
      } else {
        producer_loop_ring32_ahead<kNumSrc>(p, tt, wi.b, wi.i, smem, round_base);
      }
      round_base += ring32_rounds(tt);
    }
    return;
  }
  setmaxnreg_inc<kConsumerRegs>();
  const int num_items = num_work_items(p);

  // This consumer's sub-tile and O half; warp-uniform by the broadcast (as today).
  const int g = __shfl_sync(0xffffffffu, wg - 1, 0);
  const int t = threadIdx.x & 127;
  const int w = t >> 5, lane = t & 31, quad = lane & 3;
  const int r0 = 16 * w + (lane >> 2);  // this thread's accumulator rows: r0 and r0 + 8

  const uint32_t q_base = smem_u32(smem + kOffQ);
  const uint32_t kv_base = smem_u32(smem + kOffKV);
  uint8_t* p_mine = smem + kOffP + g * kPBytes;
  const uint32_t p_other = smem_u32(smem + kOffP + (1 - g) * kPBytes);
  float* smax_fw = reinterpret_cast<float*>(smem + kOffMax);               // [set][64]: 0 -> 1
  float* smax_bw = reinterpret_cast<float*>(smem + kOffMax + 2 * 64 * 4);  // [set][64]: 1 -> 0
  const int first = g, second = 1 - g;  // consumer 0 starts on the left half, consumer 1 on the right
  const auto kv_of = [&](int sb) { return kv_base + sb * kSubBufBytes; };
  const auto release_half = [&](int hb) { mbar_arrive(&ready[kRing32Free + hb]); };

  float o[128];
  float m0, m1;  // running max (log2 domain) of rows r0, r0 + 8
  float l0, l1;  // this thread's share of the row sums of its own P
  float s[16];     // S, then P, of this consumer's 32-key sub-tile
  uint32_t pa[8];  // bf16 P as the A operand of the local PV (2 k-steps of 16 keys)

  // S = Q K^T over the d columns of one half: 4 column blocks x 4 k-steps, N = 32 keys.
  // Q's column blocks are 8 KB apart (64 rows), the sub-tile's 4 KB (32 rows).
  auto issue_s_half = [&](uint32_t kv, int half, bool zero) {
    uint64_t dq = wgmma_desc_sw128(q_base + 4 * half * 8192, 16, 1024);
    uint64_t dk = wgmma_desc_sw128(kv + 4 * half * kSubColBytes, 16, 1024);
    asm volatile("" : "+l"(dq));
    asm volatile("" : "+l"(dk));
#pragma unroll
    for (int kk = 0; kk < 16; ++kk) {
      const uint32_t offq = ((kk >> 2) * 8192 + (kk & 3) * 32) >> 4;
      const uint32_t offk = ((kk >> 2) * kSubColBytes + (kk & 3) * 32) >> 4;
      WgmmaSS<32>::mma(s, dq + offq, dk + offk, (zero && kk == 0) ? 0 : 1);
    }
  };
  // Both halves of round gr's S on this consumer's sub-tile (buffer 2 (gr % 2) + g).
  auto compute_s = [&](int gr) {
    const int sb = 2 * (gr & 1) + g;
    const uint32_t ph = (gr >> 1) & 1;
    fence_regs(s);
    mbar_wait(&ready[2 * sb + first], ph);
    wgmma_fence();
    issue_s_half(kv_of(sb), first, true);
    wgmma_commit();
    mbar_wait(&ready[2 * sb + second], ph);
    issue_s_half(kv_of(sb), second, false);
    wgmma_commit();
  };
  // O[:, my half] += P V, P [64 x 32 keys] from registers, V = one half of a sub-tile:
  // 2 k-steps; MN-major V, column blocks 4 KB apart (LBO), 8-key groups 1 KB (SBO).
  auto pv_regs = [&](uint32_t kv, int scale_d) {
    fence_regs(o);
    fence_regs(pa);
    wgmma_fence();
    uint64_t dv = wgmma_desc_sw128(kv + 4 * g * kSubColBytes, kSubColBytes, 1024);
    asm volatile("" : "+l"(dv));
#pragma unroll
    for (int kk = 0; kk < 2; ++kk) WgmmaRS<256, true>::mma(o, &pa[4 * kk], dv + ((kk * 2048) >> 4), kk ? 1 : scale_d);
    wgmma_commit();
  };
  // Same with P from smem (the other consumer's sub-tile): the first 64 bytes of each
  // 128-byte row of its P tile.
  auto pv_smem = [&](uint32_t p_tile, uint32_t kv) {
    fence_regs(o);
    wgmma_fence();
    uint64_t dv = wgmma_desc_sw128(kv + 4 * g * kSubColBytes, kSubColBytes, 1024);
    uint64_t dp = wgmma_desc_sw128(p_tile, 16, 1024);
    asm volatile("" : "+l"(dv));
    asm volatile("" : "+l"(dp));
#pragma unroll
    for (int kk = 0; kk < 2; ++kk) WgmmaSS<256, true>::mma(o, dp + ((kk * 32) >> 4), dv + ((kk * 2048) >> 4), 1);
    wgmma_commit();
  };
  // S with skipped keys at -inf, the sub-tile's row maxima as scaled log2 logits (as
  // sparse_mqa_fwd_kernel's mask_and_max, 32 keys: thread keys 8j + 2 quad + {0, 1}, j < 4).
  // A sub-tile with no valid key (rows 32.. of a tile with <= 32 keys, or all skipped) gives
  // -inf maxima: its P is 0 and the running max moves only with the other sub-tile.
  auto mask_and_max = [&](int gr, float& mx0, float& mx1) {
    const int sb = 2 * (gr & 1) + g;
    mbar_wait(&ready[kRing32MaskReady + sb], (gr >> 1) & 1);
    const uint32_t valid = *reinterpret_cast<const volatile uint32_t*>(smem + kOffMask + 4 * sb);
    if (valid != ~0u) mask_skipped_keys(s, valid, quad);
    row_max_scaled(s, p.scale_log2, mx0, mx1);
  };
  // sparse_mqa_fwd_kernel's softmax steps (sparse_mqa_softmax.cuh) over 16 values: its
  // comments hold (-inf maxima, the FFMA exponent and its large-logit fallback, conditional
  // rescale). P tile stores: two stmatrix.x4, chunks 0..3 of each swizzled 128-byte row.
  auto rescale_o = [&](float f0, float f1) { rescale_rows(o, f0, f1); };
  auto softmax = [&](float mn0, float mn1, bool fresh) {
    online_softmax(s, o, m0, m1, l0, l1, mn0, mn1, p.scale_log2, fresh);
  };
  auto pack_p = [&](float c0, float c1) { pack_p_frag(pa, s, c0, c1); };
  const int st_i = lane >> 3, st_r = lane & 7;
  const uint32_t st_row = smem_u32(p_mine) + (16 * w + st_r + 8 * (st_i & 1)) * 128;
  auto store_p = [&]() { store_p_frag(st_row, st_i, st_r, pa); };

  if (blockIdx.x < num_items) load_q_tile(p, work_item(p, blockIdx.x), smem);
  int round_base = 0;  // rounds of the CTA's earlier items: the barrier phases continue
  for (int item = blockIdx.x; item < num_items; item += gridDim.x) {
    const WorkItem wi = work_item(p, item);
    const int rounds = ring32_rounds(token_tiles<kNumSrc, true>(p, wi.b, wi.split));
    const int h0 = wi.hb * kHeadsPerCta + r0, h1 = h0 + 8;
    float sink0, sink1;
    start_item(p, rounds, h0, h1, o, m0, m1, l0, l1, sink0, sink1);
    cp_async_wait_all();
    fence_proxy_async_smem();
    named_bar_sync(kBarQ, 256);

    // Round gr: consumer c's sub-tile is buffer 2 (gr % 2) + c; the maxima hand-off slots
    // are indexed by gr % 2 (a slot's previous reader, two rounds earlier, is ordered before
    // its writer by the round's named barriers exactly as in sparse_mqa_fwd_kernel).
    if (g == 0) {
      if (rounds > 0) {
        compute_s(round_base);
        wgmma_wait<0>();
      }
      for (int r = 0; r < rounds; ++r) {
        const int gr = round_base + r;
        const int set = gr & 1;
        fence_regs(s);
        float mx0, mx1;
        mask_and_max(gr, mx0, mx1);
        const float mn0 = fmaxf(m0, mx0), mn1 = fmaxf(m1, mx1);
        if (quad == 0) {
          smax_fw[64 * set + r0] = mn0;
          smax_fw[64 * set + r0 + 8] = mn1;
        }
        named_bar_arrive(kBarMax0, 256);
        const float t0 = mx0 > m0 + kMaxSlack ? mn0 : m0, t1 = mx1 > m1 + kMaxSlack ? mn1 : m1;
        const bool fresh = r == 0 && p.first_pv_init;
        softmax(t0, t1, fresh);
        pack_p(1.f, 1.f);
        pv_regs(kv_of(2 * set), fresh ? 0 : 1);  // O_left (+)= P_0 V_0,left
        wgmma_wait<0>();
        fence_regs(o);
        release_half(4 * set + 0);  // 0L: S_0 and this PV were its readers

        named_bar_sync(kBarMax1, 256);
        const float mf0 = smax_bw[64 * set + r0], mf1 = smax_bw[64 * set + r0 + 8];
        const float c0 = ex2_approx_ftz(t0 - (mf0 == -INFINITY ? 0.f : mf0));
        const float c1 = ex2_approx_ftz(t1 - (mf1 == -INFINITY ? 0.f : mf1));
        m0 = mf0;
        m1 = mf1;
        l0 *= c0;
        l1 *= c1;
        if (!__all_sync(0xffffffffu, c0 == 1.f && c1 == 1.f)) pack_p(c0, c1);
        store_p();
        named_bar_arrive(kBarP0, 256);
        rescale_o(c0, c1);
        named_bar_sync(kBarP1, 256);
        pv_smem(p_other, kv_of(2 * set + 1));  // O_left += P_1 V_1,left
        if (r + 1 < rounds) {
          // Round gr + 1's S (the other buffer set, filled by the producer while this round
          // ran) behind the PV; then 1L of this set once the PV that reads it is done.
          const int sbn = 2 * (set ^ 1);
          const uint32_t phn = ((gr + 1) >> 1) & 1;
          fence_regs(s);
          mbar_wait(&ready[2 * sbn + first], phn);
          wgmma_fence();
          issue_s_half(kv_of(sbn), first, true);
          wgmma_commit();
          wgmma_wait<1>();
          release_half(4 * set + 2);
          mbar_wait(&ready[2 * sbn + second], phn);
          issue_s_half(kv_of(sbn), second, false);
          wgmma_commit();
          wgmma_wait<0>();
        } else {
          wgmma_wait<0>();
          release_half(4 * set + 2);
        }
        fence_regs(o);
      }
    } else {
      for (int r = 0; r < rounds; ++r) {
        const int gr = round_base + r;
        const int set = gr & 1;
        compute_s(gr);
        wgmma_wait<0>();
        fence_regs(s);
        float mx0, mx1;
        mask_and_max(gr, mx0, mx1);
        named_bar_sync(kBarMax0, 256);
        const float mn0 = fmaxf(smax_fw[64 * set + r0], mx0), mn1 = fmaxf(smax_fw[64 * set + r0 + 8], mx1);
        const float t0 = mn0 > m0 + kMaxSlack ? mn0 : m0, t1 = mn1 > m1 + kMaxSlack ? mn1 : m1;
        // The hand-off to consumer 0 (bar.arrive orders it; racecheck's report on it is its
        // limit: see sparse_mqa_fwd_kernel).
        if (quad == 0) {
          smax_bw[64 * set + r0] = t0;
          smax_bw[64 * set + r0 + 8] = t1;
        }
        named_bar_arrive(kBarMax1, 256);
        const bool fresh = r == 0 && p.first_pv_init;
        softmax(t0, t1, fresh);
        pack_p(1.f, 1.f);
        pv_regs(kv_of(2 * set + 1), fresh ? 0 : 1);  // O_right (+)= P_1 V_1,right
        store_p();
        named_bar_arrive(kBarP1, 256);
        named_bar_sync(kBarP0, 256);
        pv_smem(p_other, kv_of(2 * set));  // O_right += P_0 V_0,right
        wgmma_wait<1>();
        release_half(4 * set + 3);  // 1R: S_1 and the register-P PV
        wgmma_wait<0>();
        fence_regs(o);
        release_half(4 * set + 1);  // 0R: S_0 (before kBarP0) and this PV
      }
    }

    // Row sums and the epilogue: as sparse_mqa_fwd_kernel's (sparse_mqa_item.cuh).
    reduce_row_sums(l0, l1, smem, g, r0, quad);
    if (item + static_cast<int>(gridDim.x) < num_items) load_q_tile(p, work_item(p, item + gridDim.x), smem);

    if (item + static_cast<int>(gridDim.x) >= num_items) pdl_launch_dependents();
    store_item_output(p, wi, o, l0, l1, m0, m1, sink0, sink1, h0, h1, g, quad);
    round_base += rounds;
  }  // work items
}

}  // namespace attention
}  // namespace dsv4
