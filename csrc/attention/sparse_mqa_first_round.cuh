// Sparse MQA forward: the cooperative first round (torch-free). A CTA's first work item
// starts cold: the producer warpgroup alone would fill round 0's four half-buffers one after
// another (at 88 registers one half's row loads are in flight per thread: four dependent
// DRAM round trips before the consumers have both tiles). Here all 384 threads, before the
// role split and at the launch's 168 registers, issue every row load of round 0 at once (12
// x 16 bytes per thread, one round trip), dequantize their parts into the two KV buffers,
// publish the key masks and arrive on the same ready barriers the producer uses; the
// producer then starts at round 1 (docs/perf-history/2026-12-04-attention-first-round.md).
// For items of two or more rounds the 256 consumer threads do it alone and the producer
// starts on round 1 right away (docs/perf-history/2026-12-04-attention-code-diet.md).
#pragma once

#include <cstdint>

#include "attention/sparse_mqa_layout.cuh"
#include "attention/sparse_mqa_producer.cuh"
#include "attention/sparse_mqa_schedule.cuh"
#include "common/ptx/memory.cuh"
#include "common/ptx/sync.cuh"

namespace dsv4 {
namespace attention {

// Round 0 of a work item (tiles t0 -> buffer 0, t0 + 1 -> buffer 1; t1 > t0), fp8_ds_mla
// rows, called by every thread of kWgs warpgroups with no earlier use of the ring (round 0
// needs no free buffer): kWgs = 3, all three; kWgs = 2, the two consumer warpgroups, while the
// producer warpgroup starts on round 1 at once (its cold code, index, scale and first row
// loads then overlap round 0 instead of following it: items of two or more rounds,
// DSV4_ATTN_PRODUCER_AHEAD). Fills both buffers whole: skipped rows and rows past the split's
// range are zeros, and their mask bits cleared, as in producer_loop_fp8.
//
// A row is 576 bytes: 448 fp8 values in 7 scale blocks of 64 (one UE8M0 scale byte each,
// stored after the block's rows), then the 64 bf16 rope values. Warpgroup k = thread / 128
// takes bytes [192 k, 192 k + 192) of all 128 rows: k = 0 fp8 blocks 0-2 (d 0..191), k = 1
// blocks 3-5 (d 192..383), k = 2 block 6 and the rope (d 384..511). In pass ps = 0..3, warp
// w's lane (g = lane / 4, q = lane % 4) holds row R = 32 ps + 8 w + g of the round (buffer
// R / 64, tile row R % 64) and its 16-byte chunks at bytes 192 k + 64 m + 16 q, m = 0..2:
// a row's 4 lanes read 64 contiguous bytes, and each 16-byte store of a warp's 8 lanes
// (2 rows x 4 chunks) covers all 32 banks (chunk 2q or 2q + 1 swizzled with g = row % 8).
// Arrivals: the left half of a buffer (d < 256) is written by warpgroups 0 and 1, the right
// half by 1 and 2; each of the 8 warps gives 16 of the half's 128 expected arrivals, after
// its lanes' writes (fence.proxy.async by each writer, then __syncwarp).
// kWgs = 2: warpgroup k = thread / 128 - 1 takes bytes [256 k, 256 k + 256 + 64 k), the chunks
// at 256 k + 64 m + 16 q, m < 4 + k: k = 0 fp8 blocks 0-3 (the left half, d < 256), k = 1
// blocks 4-6 and the rope (m = 3, 4: the right half); 16 or 20 row loads per thread, and each
// of a warpgroup's 4 warps gives 32 of its half's 128 arrivals.
// after_loads() runs once every row load of the thread is issued (the consumers' Q copies).
// Round 1 (p.coop_prefetch, items of two or more rounds): lane l also resolves row l of
// round 1 (tile t0 + 2 + l / 16, its index loaded beside round 0's) and, once round 0's loads
// are issued, sends that row into L2: warpgroup k the lines at bytes 256 k and
// min(256 k + 128, 575) of the row (the six 128-byte lines a 576-byte row at a 64-byte
// boundary can touch), warpgroup 1 also its scale bytes' line. The producer starts at round 1
// (sparse_mqa.cuh) and would otherwise fetch it from DRAM, half after half (one half's loads
// in flight per thread at 88 registers), its index and scale loads first: its own L2
// prefetch runs one round ahead of the round it fills, so it never covers its first round.
template <int kNumSrc, int kWgs, typename AfterLoads>
__device__ __forceinline__ void first_round_fp8(const SparseMqaParams& p, const TokenTiles& tt, int b, int i,
                                                uint8_t* smem, AfterLoads&& after_loads) {
  static_assert(kWgs == 2 || kWgs == 3, "all three warpgroups, or the two consumer warpgroups");
  constexpr int kChunks = kWgs == 3 ? 3 : 5;  // 16-byte chunks per row and lane (kWgs = 2: k = 0 uses 4)
  uint64_t* ready = reinterpret_cast<uint64_t*>(smem + kOffBar);
  const int k = (threadIdx.x >> 7) - (3 - kWgs);
  const int w = (threadIdx.x >> 5) & 3;
  const int lane = threadIdx.x & 31;
  const int g = lane >> 2, q = lane & 3;

  // Lane l resolves row 32 (l / 8) + 8 w + l % 8 of the round: tile t0 + l / 16, its index,
  // slot, and the addresses of its row and its scale bytes. Every warpgroup resolves all 128
  // rows (the same addresses: no barrier between the warpgroups before their loads).
  const int tile = tt.t0 + (lane >> 4);
  const int row = 32 * ((lane >> 3) & 1) + 8 * w + (lane & 7);
  const int raw = tile_index<kNumSrc>(p, tt, b, i, tile, row);
  // Round 1's raw index of the same row, loaded before round 0's is used, so that it flies with
  // it (uniform: an item of one round, e.g. every SWA item, skips it).
  const bool pf = p.coop_prefetch && tt.t1 > tt.t0 + 2;
  const int tile1 = tile + 2;
  const int raw1 = pf ? tile_index<kNumSrc>(p, tt, b, i, tile1, row) : -1;
  const int slot = index_slot<kNumSrc>(p, tt, tile, raw);
  const PagedSource src = paged_source<kNumSrc>(p, tile_list<kNumSrc>(tt, tile));
  int64_t data_off, scale_off;
  row_offsets<true>(src, slot, data_off, scale_off);
  // Skipped rows read q's first 576 bytes instead (always there: one token's q is 64 KB), and
  // their values and scales are replaced where they are used: a predicated load would be
  // merged with its zeros through moves that wait for the data, and ptxas, reusing those
  // registers, held the last pass's loads back by a round trip.
  const auto* fallback = reinterpret_cast<const uint8_t*>(p.q);
  const uint8_t* rowp = slot >= 0 ? src.base + data_off : fallback;
  const uint8_t* scalep = slot >= 0 ? src.base + scale_off : fallback;

  // Bit l: lane l's row is used. Key masks, by warpgroup 0: bit l is row 32 (l / 8) + 8 w +
  // l % 8, i.e. byte w or 4 + w of buffer l / 16's 64-bit mask (row r: byte r / 8, bit r % 8).
  const unsigned used = __ballot_sync(0xffffffffu, slot >= 0);
  if (k == 0) {
    if (lane == 0) {
      uint8_t* m8 = smem + kOffMask;
      m8[w] = static_cast<uint8_t>(used);
      m8[4 + w] = static_cast<uint8_t>(used >> 8);
      m8[8 + w] = static_cast<uint8_t>(used >> 16);
      m8[12 + w] = static_cast<uint8_t>(used >> 24);
      mbar_arrive(ready + 8);
      mbar_arrive(ready + 9);
    }
  }

  // All row loads (12; kWgs = 2: 16 or 20) and the 4 rows' scale words before any dequant: one
  // round trip. (Each
  // lane loads its rows' scales itself: shuffled from the resolving lane, they would make
  // the loads after the shuffle wait for the scale load.)
  uint4 v[4][kChunks];
  uint2 sc[4];
  const unsigned ok = (used >> g) & 0x01010101u;  // bit 8 ps: pass ps's row (lane 8 ps + g) is used
#pragma unroll
  for (int ps = 0; ps < 4; ++ps) {
    const auto* r = reinterpret_cast<const uint8_t*>(
        __shfl_sync(0xffffffffu, reinterpret_cast<unsigned long long>(rowp), 8 * ps + g));
    const auto* sp = reinterpret_cast<const uint8_t*>(
        __shfl_sync(0xffffffffu, reinterpret_cast<unsigned long long>(scalep), 8 * ps + g));
#pragma unroll
    for (int m = 0; m < kChunks; ++m) {
      if (kWgs == 3) {
        v[ps][m] = ldg_nc_v4(r + 192 * k + 64 * m + 16 * q);
      } else if (m < 4 || k == 1) {
        v[ps][m] = ldg_nc_v4(r + 256 * k + 64 * m + 16 * q);
      }
    }
    sc[ps] = ldg_nc_v2(sp);
  }
  after_loads();
  if (pf) {
    const int slot1 = index_slot<kNumSrc>(p, tt, tile1, raw1);
    if (slot1 >= 0) {
      const PagedSource s1 = paged_source<kNumSrc>(p, tile_list<kNumSrc>(tt, tile1));
      int64_t d1, so1;
      row_offsets<true>(s1, slot1, d1, so1);
      if (kWgs == 3) {
        prefetch_l2(s1.base + d1 + 256 * k);
        prefetch_l2(s1.base + d1 + min(256 * k + 128, 575));
      } else {  // lines at 384 k + 128 j, j < 3 (the last one at byte 575)
#pragma unroll
        for (int j = 0; j < 3; ++j) prefetch_l2(s1.base + d1 + min(384 * k + 128 * j, 575));
      }
      if (k == 1) prefetch_l2(s1.base + so1);
    }
  }

  // One pass per iteration (a rolled loop: the code a cold instruction cache fetches is one
  // pass, not four), its registers picked by selects from the loop-invariant v. Not by
  // moving the next pass's registers down: the moves into the loop's registers stalled on
  // the loads and, reusing their registers, held back the last pass's loads by a round trip.
  const uint32_t lane_base = smem_u32(smem + kOffKV) + w * 1024 + g * 128;
#pragma unroll 1
  for (int ps = 0; ps < 4; ++ps) {
    // Tile row 32 (ps % 2) + 8 w + g of buffer ps / 2: tile_offset's row terms.
    const uint32_t rb = lane_base + (ps >> 1) * kBufBytes + (ps & 1) * 4096;
    const bool row_ok = (ok >> (8 * ps)) & 1u;
    const uint2 s8 = ps == 0 ? sc[0] : (ps == 1 ? sc[1] : (ps == 2 ? sc[2] : sc[3]));
    // This warpgroup's scale bytes in bytes 0..2 (kWgs = 3: blocks 3k .. 3k + 2, k = 2: block 6)
    // or 0..3 (kWgs = 2: blocks 4k .. 4k + 3, k = 1: 4..6); 2^0 for a skipped row (its zeros
    // times a scale read from q could be NaN).
    const uint32_t es =
        !row_ok ? 0x7F7F7F7Fu
                : (kWgs == 3 ? static_cast<uint32_t>(((static_cast<uint64_t>(s8.y) << 32) | s8.x) >> (24 * k))
                             : (k ? s8.y : s8.x));
#pragma unroll
    for (int m = 0; m < kChunks; ++m) {
      if (kWgs == 2 && m == 4 && k == 0) continue;
      uint4 x = ps == 0 ? v[0][m] : (ps == 1 ? v[1][m] : (ps == 2 ? v[2][m] : v[3][m]));
      if (!row_ok) x = make_uint4(0, 0, 0, 0);
      // Rope: kWgs = 3, k = 2, m = 1, 2; kWgs = 2, k = 1, m = 3, 4. Its chunk j = q + 4 r, r the
      // rope chunk's order (0, 1): d 448 + 8j, column block 7, stored as is.
      const bool rope = kWgs == 3 ? (k == 2 && m > 0) : (k == 1 && m >= 3);
      const int rope_r = kWgs == 3 ? m - 1 : m - 3;
      if (rope) {
        sts_v4(rb + 7 * 8192 + (((q + 4 * rope_r) ^ g) << 4), x);
      } else {  // fp8 values d .. d + 15 of column block cb (d = 64 cb + 16 q): chunks 2q, 2q + 1
        const int cb = kWgs == 3 ? 3 * k + m : 4 * k + m;
        const uint32_t blk = rb + cb * 8192;
        dequant_store_fp8x16(blk + (((2 * q) ^ g) << 4), blk + (((2 * q + 1) ^ g) << 4), x, (es >> (8 * m)) & 0xFFu);
      }
    }
    if (ps & 1) {  // this warp's rows of buffer ps / 2 are written
      fence_proxy_async_smem();
      __syncwarp();
      if (kWgs == 3) {
        const int half = k == 0 ? 0 : (k == 2 ? 1 : lane >> 4);
        if (k == 1 || lane < 16) mbar_arrive(&ready[2 * (ps >> 1) + half]);
      } else {
        mbar_arrive(&ready[2 * (ps >> 1) + k]);
      }
    }
  }
}

}  // namespace attention
}  // namespace dsv4
