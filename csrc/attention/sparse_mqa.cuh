// Sparse MQA attention forward for DeepSeek V4 on Hopper (sm_90a). Torch-free.
//
// Work item = one query token x 64 heads x one split of the token's 64-key tiles, taken in
// pairs: in round r, buffer 0 holds tile 2r and buffer 1 tile 2r + 1. CTAs are persistent
// (one per SM) and walk the items with a grid stride.
// 384 threads = 3 warpgroups:
//   WG0  producer: gathers the KV rows by slot id, each buffer as two halves (d < 256 and
//        d >= 256) with their own ready / free mbarriers, in the order the consumers need
//        them (0L, 1R, 0R, 1L). fp8_ds_mla rows are dequantized to bf16 with their UE8M0
//        power-of-two scales (exact); bf16 rows go by cp.async, the producer never waits for
//        them. Skipped entries become zero rows and a cleared bit of the buffer's mask.
//        The next round's rows are prefetched into L2.
//   WG1, WG2  consumers c = 0, 1 ("seesaw"): consumer c computes S_c = Q K_c^T of buffer c
//        over the full d, runs the online softmax for that tile and owns half the output,
//        O[:, 256c : 256c + 256] += P_c V_c (P from registers) + P_other V_other (P from
//        smem). The running max goes 0 -> 1 through smem within a round and back, so both
//        end the round at the same max; 0 rescales its P before handing it over. While one
//        consumer does its softmax the other's GEMMs keep the tensor cores busy, and every
//        exponential is computed once.
// smem tile layout (Q, KV buffers): 8 column blocks of 64 d (8 KB each), each block 64 rows
// x 128 B with the 128-byte swizzle (16-byte chunk j of row r at j ^ (r % 8)); the P
// tiles are one such block (64 heads x 64 keys).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>

#include "attention/sparse_mqa_params.cuh"
#include "common/cvt.cuh"
#include "common/mma/wgmma.cuh"
#include "common/ptx/math.cuh"
#include "common/ptx/memory.cuh"
#include "common/ptx/regs.cuh"
#include "common/ptx/sync.cuh"

namespace dsv4 {
namespace attention {

constexpr int kThreads = 384;
constexpr int kQBytes = kHeadsPerCta * kHeadDim * 2;    // 64 KB
constexpr int kBufBytes = kTileKeys * kHeadDim * 2;     // 64 KB per buffer
constexpr int kPBytes = kHeadsPerCta * kTileKeys * 2;   // 8 KB bf16 P tile
constexpr int kOffQ = 0;
constexpr int kOffKV = kOffQ + kQBytes;
constexpr int kOffP = kOffKV + 2 * kBufBytes;
// Running maxima handed between the consumers, [direction][round parity][64 rows]: 0 -> 1
// (consumer 0's tile max), 1 -> 0 (the round's max). Separate buffers per direction and
// round, so a write never targets a location the other consumer may still be reading.
constexpr int kOffMax = kOffP + 2 * kPBytes;
constexpr int kOffSum = kOffMax + 2 * 2 * 64 * 4;  // 2 x 64 floats: row sums, epilogue
constexpr int kOffMask = kOffSum + 2 * 64 * 4;  // 2 x 64-bit key validity masks
constexpr int kOffBar = kOffMask + 2 * 8;       // ready[4], free[4], mask_ready[2]
constexpr int kSmemBytes = kOffBar + 10 * 8 + 1024;  // + alignment slack

// setmaxnreg budgets (128 x 88 + 256 x 208 = the launch's 384 x 168). At 200 consumer
// registers ptxas serializes the wgmmas (C7512); the producer's fp8 gather fits in 88.
constexpr int kProducerRegs = 88;
constexpr int kConsumerRegs = 208;

// A round's exponentials are taken against a reference max that only moves when a tile's
// max exceeds it by more than this (log2 units): P <= 2^8 stays exact enough in bf16 and the
// fp32 sums, and the O rescale (128 FMUL per thread) is skipped in most rounds
// (conditional rescaling, as in FlashAttention-4).
constexpr float kMaxSlack = 8.f;

// Named barriers between the two consumer warpgroups (0 is __syncthreads).
constexpr int kBarQ = 1;      // Q is in smem
constexpr int kBarMax0 = 2;   // consumer 0 published its tile's max
constexpr int kBarMax1 = 3;   // consumer 1 published the round's max
constexpr int kBarP0 = 4;     // P_0 (rescaled to the round's max) is in smem
constexpr int kBarP1 = 5;     // P_1 is in smem
constexpr int kBarSum = 6;    // row sums exchanged (epilogue)

constexpr uint32_t kFp8RowBytes = 576;   // 448 fp8 + 64 bf16
constexpr uint32_t kBf16RowBytes = 1024;

// Byte offset inside a swizzled [64 rows x 512] bf16 tile of the 16-byte chunk that
// holds elements d .. d+7 of row r (d a multiple of 8).
__device__ __forceinline__ uint32_t tile_offset(int r, int d) {
  const int c = d >> 6, j = (d >> 3) & 7;
  return c * 8192 + (r >> 3) * 1024 + (r & 7) * 128 + ((j ^ (r & 7)) << 4);
}

// 4 fp8 e4m3 (one 32-bit word) * scale -> 2 words of bf16x2 (exact for UE8M0 scales).
__device__ __forceinline__ void fp8x4_to_bf16x4(uint32_t w, float sc, uint32_t& lo, uint32_t& hi) {
  __half2_raw h0 = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(w & 0xFFFF), __NV_E4M3);
  __half2_raw h1 = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(w >> 16), __NV_E4M3);
  float2 f0 = __half22float2(*reinterpret_cast<__half2*>(&h0));
  float2 f1 = __half22float2(*reinterpret_cast<__half2*>(&h1));
  lo = pack_bf16x2(f0.x * sc, f0.y * sc);
  hi = pack_bf16x2(f1.x * sc, f1.y * sc);
}

// 16 fp8 values of one row (a quarter of a 64-column scale block) times the block's UE8M0
// scale 2^(e-127) -> 16 bf16, stored as two 16-byte chunks at smem addresses lo and hi.
// Exact: a power-of-two scale only moves the exponent (results that leave the bf16 range
// round or overflow like the float32 reference rounded to bf16). e = 0 is the subnormal
// 2^-127 (the max below), e = 255 gives inf.
__device__ __forceinline__ void dequant_store_fp8x16(uint32_t lo, uint32_t hi, const uint4& v, uint32_t e) {
  const float sc = __int_as_float(max(static_cast<int>(e << 23), 0x00400000));
  uint4 o0, o1;
  fp8x4_to_bf16x4(v.x, sc, o0.x, o0.y);
  fp8x4_to_bf16x4(v.y, sc, o0.z, o0.w);
  fp8x4_to_bf16x4(v.z, sc, o1.x, o1.y);
  fp8x4_to_bf16x4(v.w, sc, o1.z, o1.w);
  sts_v4(lo, o0);
  sts_v4(hi, o1);
}

// Per-token geometry shared by all threads of the CTA.
struct TokenTiles {
  int len[2];    // valid prefix of each list
  int ntile[2];  // tiles of each list
  int t0, t1;    // this split's tile range [t0, t1) over the concatenated lists; t0 even
};

__device__ __forceinline__ TokenTiles token_tiles(const SparseMqaParams& p, int b, int split) {
  TokenTiles tt;
#pragma unroll
  for (int k = 0; k < 2; ++k) {
    int len = 0;
    if (k < p.num_src) {
      len = p.src[k].topk;
      if (p.src[k].lengths != nullptr) {
        const int l = p.src[k].lengths[b];
        len = l < 0 ? 0 : (l < len ? l : len);
      }
    }
    tt.len[k] = len;
    tt.ntile[k] = (len + kTileKeys - 1) / kTileKeys;
  }
  // Splits take whole pairs of tiles (one round each); only the last pair may be half empty.
  const int n = tt.ntile[0] + tt.ntile[1];
  const int pairs = (n + 1) / 2;
  // Unsigned 32-bit: pairs <= 2^25 (two int32 lists of 64-key tiles) and num_splits <= 64,
  // so the products stay below 2^32; a 64-bit division is a subroutine call, a far jump that
  // a cold instruction cache pays for.
  int p0, p1;
  if (p.pairs_per_split > 0) {  // batch-invariant: boundaries at fixed key positions
    p0 = min(split * p.pairs_per_split, pairs);
    p1 = min(p0 + p.pairs_per_split, pairs);
  } else {
    const uint32_t up = static_cast<uint32_t>(pairs), ns = static_cast<uint32_t>(p.num_splits);
    p0 = static_cast<int>(up * static_cast<uint32_t>(split) / ns);
    p1 = static_cast<int>(up * static_cast<uint32_t>(split + 1) / ns);
  }
  tt.t0 = 2 * p0;
  tt.t1 = 2 * p1 < n ? 2 * p1 : n;
  return tt;
}

__device__ __forceinline__ int token_rounds(const TokenTiles& tt) { return (tt.t1 - tt.t0 + 1) >> 1; }

// Work item = (token, split, head block), head block fastest so that the two head blocks of
// a token (same KV rows) run at the same time on neighbouring SMs.
struct WorkItem {
  int hb, split, token, b, i;
};
__device__ __forceinline__ WorkItem work_item(const SparseMqaParams& p, int item) {
  WorkItem w;
  const int hblocks = p.num_heads / kHeadsPerCta;
  w.hb = item % hblocks;
  item /= hblocks;
  w.split = item % p.num_splits;
  w.token = item / p.num_splits;
  w.b = w.token / p.s_q;
  w.i = w.token % p.s_q;
  return w;
}
__device__ __forceinline__ int num_work_items(const SparseMqaParams& p) {
  return p.batch * p.s_q * p.num_splits * (p.num_heads / kHeadsPerCta);
}

__device__ __forceinline__ int tile_list(const TokenTiles& tt, int tile) { return tile < tt.ntile[0] ? 0 : 1; }

// Raw index of row `row` of concatenated tile `tile` (one global load), or -1 when the entry
// is past its list's length or the tile past this split's range.
__device__ __forceinline__ int tile_index(const SparseMqaParams& p, const TokenTiles& tt, int b, int i, int tile,
                                          int row) {
  if (tile >= tt.t1) return -1;
  const bool l0 = tile_list(tt, tile) == 0;
  const int pos = (l0 ? tile : tile - tt.ntile[0]) * kTileKeys + row;
  if (pos >= (l0 ? tt.len[0] : tt.len[1])) return -1;
  // Field selects, not p.src[list]: a runtime index into the kernel parameters makes the
  // compiler copy them to local memory.
  const int32_t* idx = l0 ? p.src[0].indices : p.src[1].indices;
  const int64_t sb = l0 ? p.src[0].idx_stride_b : p.src[1].idx_stride_b;
  const int64_t sq = l0 ? p.src[0].idx_stride_q : p.src[1].idx_stride_q;
  return idx[b * sb + i * sq + pos];
}

// The slot a raw index of `tile` names, or -1 when it is skipped (negative or out of range).
__device__ __forceinline__ int index_slot(const SparseMqaParams& p, const TokenTiles& tt, int tile, int v) {
  const int64_t ns = tile_list(tt, tile) == 0 ? p.src[0].num_slots : p.src[1].num_slots;
  return (v >= 0 && static_cast<int64_t>(v) < ns) ? v : -1;
}

// The paged geometry of source `list` (by selects, see tile_index).
struct PagedSource {
  const uint8_t* base;
  int64_t block_stride;
  int block_size;
  FastDivmod block_div;
};
__device__ __forceinline__ PagedSource paged_source(const SparseMqaParams& p, int list) {
  const bool l0 = list == 0;
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

// fp8_ds_mla rows: register-staged loads, dequantized into the buffer.
__device__ __forceinline__ void producer_loop_fp8(const SparseMqaParams& p, const TokenTiles& tt, int b, int i,
                                                  uint8_t* smem, int round_base) {
  // Everything from the one smem base: separate pointers would cost registers.
  uint64_t* ready = reinterpret_cast<uint64_t*>(smem + kOffBar);
  const int warp = (threadIdx.x >> 5) & 3;
  const int lane = threadIdx.x & 31;
  const int row_lane = warp * 16 + (lane & 15);  // the row whose slot this lane resolves (lanes 0..15)
  const int rounds = token_rounds(tt);

  // Per lane 0..15 and tile of the round: the row's slot and its 8 scale bytes, both
  // fetched one round ahead, and its raw index two rounds ahead, so index and scale loads
  // are never waited for.
  int slot[2], slot_next[2], raw_next[2];
  uint2 scales[2], scales_next[2];
  // fp8 rows of skipped entries are zeros; their scale byte 127 (2^0) keeps them zeros.
  const auto fetch_scales = [&](int tile, int sl) {
    uint2 sw = make_uint2(0x7F7F7F7Fu, 0x7F7F7F7Fu);
    if (sl >= 0) {
      const PagedSource s = paged_source(p, tile_list(tt, tile));
      int64_t d, so;
      row_offsets<true>(s, sl, d, so);
      sw = ldg_nc_v2(s.base + so);
    }
    return sw;
  };
  const bool row_lane_ok = lane < 16;
#pragma unroll
  for (int k = 0; k < 2; ++k) {
    const int raw = row_lane_ok ? tile_index(p, tt, b, i, tt.t0 + k, row_lane) : -1;
    raw_next[k] = row_lane_ok ? tile_index(p, tt, b, i, tt.t0 + 2 + k, row_lane) : -1;
    slot[k] = index_slot(p, tt, tt.t0 + k, raw);
    scales[k] = fetch_scales(tt.t0 + k, slot[k]);
  }

  for (int r = 0; r < rounds; ++r) {
    const int tile0 = tt.t0 + 2 * r;
    // Next round: its slots (indices loaded last round), its scales and its rows into L2;
    // the round after next: its indices.
#pragma unroll
    for (int k = 0; k < 2; ++k) {
      slot_next[k] = index_slot(p, tt, tile0 + 2 + k, raw_next[k]);
      raw_next[k] = row_lane_ok ? tile_index(p, tt, b, i, tile0 + 4 + k, row_lane) : -1;
      scales_next[k] = fetch_scales(tile0 + 2 + k, slot_next[k]);
      // Rows into L2: lane l covers row l % 16 at bytes min(128 (l / 16 + 2 m), 575), m < 3.
      const PagedSource s = paged_source(p, tile_list(tt, tile0 + 2 + k));
      int64_t d, so;
      row_offsets<true>(s, slot_next[k], d, so);
      d = __shfl_sync(0xffffffffu, d, lane & 15);
      if (d >= 0) {
#pragma unroll
        for (int m = 0; m < 3; ++m) prefetch_l2(s.base + d + min(128 * ((lane >> 4) + 2 * m), 575));
      }
    }
    int64_t data_off[2];
#pragma unroll
    for (int k = 0; k < 2; ++k) {
      int64_t so;
      row_offsets<true>(paged_source(p, tile_list(tt, tile0 + k)), slot[k], data_off[k], so);
    }

    // Halves in half_step order. Not unrolled: the compiler would hoist every step's row
    // addresses and spill them (88 registers here).
#pragma unroll 1
    for (int step = 0; step < 4; ++step) {
      const auto [buf, half, hb] = half_step(step);
      const auto wait_free = [&] {
        wait_half_free(smem, hb, round_base + r);
        if (step < 2) publish_mask(smem, buf, __ballot_sync(0xffffffffu, (buf ? slot[1] : slot[0]) >= 0) & 0xFFFFu);
      };
      const uint8_t* base = paged_source(p, tile_list(tt, tile0 + buf)).base;
      // (Selects, not data_off[buf]: a runtime index would put the arrays in local memory.)
      uint8_t* dst = smem + kOffKV + buf * kBufBytes;
      const int64_t off = buf ? data_off[1] : data_off[0];
      const uint2 sc = buf ? scales[1] : scales[0];
      load_half_fp8(dst, base, off, sc, half, &ready[hb], wait_free);
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
    row_offsets<false>(paged_source(p, tile_list(tt, tile)), index_slot(p, tt, tile, raw), d, so);
    return d;
  };
  // Raw indices of this lane's rows: this round's and the next round's (loaded two rounds ahead).
  int raw[2][4], raw_next[2][4];
#pragma unroll
  for (int t = 0; t < 2; ++t) {
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      raw[t][k] = tile_index(p, tt, b, i, tt.t0 + t, 4 * grp + k);
      raw_next[t][k] = tile_index(p, tt, b, i, tt.t0 + 2 + t, 4 * grp + k);
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
        raw_next[t][k] = tile_index(p, tt, b, i, tile0 + 4 + t, 4 * grp + k);
      }
      // Next round's rows into L2, one 128-byte line per lane and row.
      const uint8_t* nbase = paged_source(p, tile_list(tt, tile0 + 2 + t)).base;
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const int64_t d = row_off(tile0 + 2 + t, raw[t][k]);
        if (d >= 0) prefetch_l2(nbase + d + 128 * chunk);
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
      const uint8_t* base = paged_source(p, tile_list(tt, tile0 + buf)).base;
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

template <bool kFp8>
__global__ void __launch_bounds__(kThreads, 1) sparse_mqa_fwd_kernel(const __grid_constant__ SparseMqaParams p) {
  extern __shared__ uint8_t smem_raw[];
  // (Not align_smem_1024: that form changes this kernel's code, 64 fewer instructions, so it
  // waits for a measured change: docs/perf-history/2026-12-01-device-helpers.md.)
  uint8_t* smem = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  uint64_t* ready = reinterpret_cast<uint64_t*>(smem + kOffBar);  // [2 * buf + half]
  uint64_t* freed = ready + 4;
  uint64_t* mask_ready = ready + 8;                               // [buf]
  uint16_t* mask16 = reinterpret_cast<uint16_t*>(smem + kOffMask);  // [buf][producer warp]

  if (threadIdx.x == 0) {
    for (int k = 0; k < 8; ++k) mbar_init(&ready[k], 128);
    mbar_init(&mask_ready[0], 4);
    mbar_init(&mask_ready[1], 4);
    mbar_init_fence();
  }
  __syncthreads();

  // Persistent CTAs (one per SM) walk the work items with a grid stride. Producer and
  // consumers visit the same items, and the ring's barrier phases count rounds over all of
  // them, so the producer fills the next item's first round while the consumers finish the
  // current one, and the next item's Q loads during the current item's output stores.
  const int num_items = num_work_items(p);
  const int wg = threadIdx.x >> 7;
  if (wg == 0) {
    setmaxnreg_dec<kProducerRegs>();
    int round_base = 0;
    for (int item = blockIdx.x; item < num_items; item += gridDim.x) {
      const WorkItem wi = work_item(p, item);
      const TokenTiles tt = token_tiles(p, wi.b, wi.split);
      if (kFp8) {
        producer_loop_fp8(p, tt, wi.b, wi.i, smem, round_base);
      } else {
        producer_loop_bf16(p, tt, wi.b, wi.i, smem, round_base);
      }
      round_base += token_rounds(tt);
    }
    return;
  }
  setmaxnreg_inc<kConsumerRegs>();

  // This consumer's buffer (S, softmax) and O half. Broadcast from lane 0 so the compiler
  // sees a warp-uniform value: wgmma under a branch it thinks divergent gets serialized.
  const int g = __shfl_sync(0xffffffffu, wg - 1, 0);
  const int t = threadIdx.x & 127;
  const int w = t >> 5, lane = t & 31, quad = lane & 3;
  const int r0 = 16 * w + (lane >> 2);  // this thread's accumulator rows: r0 and r0 + 8

  // Q [64 heads x 512] of a work item -> smem (swizzled), by the consumers only so that the
  // producer's gathers overlap it; cp.async keeps all 16 chunks per thread in flight at once.
  // Waited for (cp_async_wait_all + kBarQ) when the item starts.
  const auto load_q = [&](int item) {
    const WorkItem wi = work_item(p, item);
    const uint16_t* qg = p.q + wi.b * p.q_stride_b + wi.i * p.q_stride_q +
                         static_cast<int64_t>(wi.hb) * kHeadsPerCta * p.q_stride_h;
    const uint32_t q_u32 = smem_u32(smem + kOffQ);
    const int ct = threadIdx.x - 128;
#pragma unroll
    for (int k = 0; k < kHeadsPerCta * (kHeadDim / 8) / 256; ++k) {
      const int c = ct + 256 * k;
      const int r = c >> 6, d = (c & 63) * 8;
      cp_async_16(q_u32 + tile_offset(r, d), qg + r * p.q_stride_h + d);
    }
  };
  const uint32_t q_base = smem_u32(smem + kOffQ);
  const uint32_t kv_mine = smem_u32(smem + kOffKV + g * kBufBytes);
  const uint32_t kv_other = smem_u32(smem + kOffKV + (1 - g) * kBufBytes);
  uint8_t* p_mine = smem + kOffP + g * kPBytes;
  const uint32_t p_other = smem_u32(smem + kOffP + (1 - g) * kPBytes);
  float* smax_fw = reinterpret_cast<float*>(smem + kOffMax);            // [parity][64]: 0 -> 1
  float* smax_bw = reinterpret_cast<float*>(smem + kOffMax + 2 * 64 * 4);  // [parity][64]: 1 -> 0
  // Buffer halves: consumer 0 starts on the left (d < 256) half, consumer 1 on the right.
  const int first = g, second = 1 - g;  // half indices in load order for this consumer
  uint64_t* ready_first = &ready[2 * g + first];
  uint64_t* ready_second = &ready[2 * g + second];

  float o[128];
  float m0, m1;  // running max (log2 domain) of rows r0, r0 + 8
  float l0, l1;  // this thread's share of the row sums of its own P
  float s[32];                           // S, then P, of this consumer's tile
  uint32_t pa[16];                       // bf16 P as the A operand of the local PV

  // S = Q K^T over the d columns of one half (4 blocks x 4 k-steps of 16).
  auto issue_s_half = [&](int half, bool zero) {
    uint64_t dq = wgmma_desc_sw128(q_base + 4 * half * 8192, 16, 1024);
    uint64_t dk = wgmma_desc_sw128(kv_mine + 4 * half * 8192, 16, 1024);
    // Descriptors advance by adding (byte offset >> 4); the opaque copies keep the compiler
    // from hoisting 32 precomputed descriptors into registers.
    asm volatile("" : "+l"(dq));
    asm volatile("" : "+l"(dk));
#pragma unroll
    for (int kk = 0; kk < 16; ++kk) {
      const uint32_t off = ((kk >> 2) * 8192 + (kk & 3) * 32) >> 4;
      WgmmaSS<64>::mma(s, dq + off, dk + off, (zero && kk == 0) ? 0 : 1);
    }
  };
  // Both halves of this round's S; the second half's wait overlaps the first half's GEMMs.
  auto compute_s = [&](uint32_t phase) {
    fence_regs(s);
    mbar_wait(ready_first, phase);
    if (!kFp8) fence_proxy_async_smem();  // cp.async (generic proxy) writes -> wgmma reads
    wgmma_fence();
    issue_s_half(first, true);
    wgmma_commit();
    mbar_wait(ready_second, phase);
    if (!kFp8) fence_proxy_async_smem();
    issue_s_half(second, false);
    wgmma_commit();
  };
  // O[:, my half] += P V, P [64 x 64 keys] from registers, V = one half of a buffer.
  auto pv_regs = [&](uint32_t kv) {
    fence_regs(o);
    fence_regs(pa);
    wgmma_fence();
    uint64_t dv = wgmma_desc_sw128(kv + 4 * g * 8192, 8192, 1024);
    asm volatile("" : "+l"(dv));
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) WgmmaRS<256, true>::mma(o, &pa[4 * kk], dv + ((kk * 2048) >> 4), 1);
    wgmma_commit();
  };
  // Same with P from smem (the other consumer's tile).
  auto pv_smem = [&](uint32_t p_tile, uint32_t kv) {
    fence_regs(o);
    wgmma_fence();
    uint64_t dv = wgmma_desc_sw128(kv + 4 * g * 8192, 8192, 1024);
    uint64_t dp = wgmma_desc_sw128(p_tile, 16, 1024);
    asm volatile("" : "+l"(dv));
    asm volatile("" : "+l"(dp));
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) WgmmaSS<256, true>::mma(o, dp + ((kk * 32) >> 4), dv + ((kk * 2048) >> 4), 1);
    wgmma_commit();
  };
  // S -> scaled log2 logits with skipped keys at -inf; returns the row maxima of the tile.
  // Thread holds rows r0, r0 + 8 and keys 8j + 2*quad + {0, 1}, j = 0..7.
  auto mask_and_max = [&](uint32_t phase, float& mx0, float& mx1) {
    mbar_wait(&mask_ready[g], phase);
    const uint64_t valid = *reinterpret_cast<const volatile uint64_t*>(mask16 + 4 * g);
    // A tile with every key valid (all but the last of most tokens) skips the per-key
    // select (~64 instructions per thread); the branch is uniform (one mask per tile).
    if (valid == ~uint64_t(0)) {
#pragma unroll
      for (int k = 0; k < 32; ++k) s[k] *= p.scale_log2;
    } else {
#pragma unroll
      for (int k = 0; k < 32; ++k) {
        const int key = 8 * (k >> 2) + 2 * quad + (k & 1);
        s[k] = ((valid >> key) & 1) ? s[k] * p.scale_log2 : -INFINITY;
      }
    }
    mx0 = -INFINITY;
    mx1 = -INFINITY;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      mx0 = fmaxf(mx0, fmaxf(s[4 * j], s[4 * j + 1]));
      mx1 = fmaxf(mx1, fmaxf(s[4 * j + 2], s[4 * j + 3]));
    }
    mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 1));
    mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 2));
    mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 1));
    mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 2));
  };
  // P = 2^(S - new max) (in s), O and the row sums rescaled from the old max to the new one.
  // A max of -inf (nothing visible yet) is used as 0 so no (-inf) - (-inf) appears; the
  // factor from an old -inf max is 0 (nothing accumulated).
  // O rows r0 / r0 + 8 times f0 / f1, skipped when every factor of the warp is 1 (the common
  // case once the row maxima settle; multiplying by 1 changes nothing).
  auto rescale_o = [&](float f0, float f1) {
    if (__all_sync(0xffffffffu, f0 == 1.f && f1 == 1.f)) return;
#pragma unroll
    for (int j = 0; j < 32; ++j) {
      o[4 * j] *= f0;
      o[4 * j + 1] *= f0;
      o[4 * j + 2] *= f1;
      o[4 * j + 3] *= f1;
    }
  };
  auto softmax = [&](float mn0, float mn1) {
    const float ms0 = mn0 == -INFINITY ? 0.f : mn0;
    const float ms1 = mn1 == -INFINITY ? 0.f : mn1;
    const float a0 = ex2_approx_ftz(m0 - ms0), a1 = ex2_approx_ftz(m1 - ms1);
    m0 = mn0;
    m1 = mn1;
    float sum0 = 0.f, sum1 = 0.f;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      s[4 * j] = ex2_approx_ftz(s[4 * j] - ms0);
      s[4 * j + 1] = ex2_approx_ftz(s[4 * j + 1] - ms0);
      s[4 * j + 2] = ex2_approx_ftz(s[4 * j + 2] - ms1);
      s[4 * j + 3] = ex2_approx_ftz(s[4 * j + 3] - ms1);
      sum0 += s[4 * j] + s[4 * j + 1];
      sum1 += s[4 * j + 2] + s[4 * j + 3];
    }
    l0 = l0 * a0 + sum0;
    l1 = l1 * a1 + sum1;
    rescale_o(a0, a1);
  };
  auto pack_p = [&](float c0, float c1) {
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
      pa[4 * kk + 0] = pack_bf16x2(s[8 * kk + 0] * c0, s[8 * kk + 1] * c0);
      pa[4 * kk + 1] = pack_bf16x2(s[8 * kk + 2] * c1, s[8 * kk + 3] * c1);
      pa[4 * kk + 2] = pack_bf16x2(s[8 * kk + 4] * c0, s[8 * kk + 5] * c0);
      pa[4 * kk + 3] = pack_bf16x2(s[8 * kk + 6] * c1, s[8 * kk + 7] * c1);
    }
  };
  // pa -> my P tile in smem (K-major, 128-byte swizzle: the A operand of the other's PV).
  auto store_p = [&]() {
    uint8_t* prow = p_mine + r0 * 128 + 4 * quad;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const int chunk = (j ^ (r0 & 7)) << 4;
      const int kk = j >> 1;
      *reinterpret_cast<uint32_t*>(prow + chunk) = (j & 1) ? pa[4 * kk + 2] : pa[4 * kk + 0];
      *reinterpret_cast<uint32_t*>(prow + 1024 + chunk) = (j & 1) ? pa[4 * kk + 3] : pa[4 * kk + 1];
    }
    fence_proxy_async_smem();
  };

  if (blockIdx.x < num_items) load_q(blockIdx.x);
  int round_base = 0;  // rounds of the CTA's earlier items: the barrier phases continue
  for (int item = blockIdx.x; item < num_items; item += gridDim.x) {
    const WorkItem wi = work_item(p, item);
    const int rounds = token_rounds(token_tiles(p, wi.b, wi.split));
#pragma unroll
    for (int k = 0; k < 128; ++k) o[k] = 0.f;
    m0 = m1 = -INFINITY;
    l0 = l1 = 0.f;
    cp_async_wait_all();
    fence_proxy_async_smem();
    named_bar_sync(kBarQ, 256);

    if (g == 0) {
      if (rounds > 0) {
        compute_s(round_base & 1);
        wgmma_wait<0>();
      }
      for (int r = 0; r < rounds; ++r) {
        const uint32_t ph = (round_base + r) & 1;
        fence_regs(s);
        float mx0, mx1;
        mask_and_max(ph, mx0, mx1);
        const float mn0 = fmaxf(m0, mx0), mn1 = fmaxf(m1, mx1);
        if (quad == 0) {
          smax_fw[64 * ph + r0] = mn0;
          smax_fw[64 * ph + r0 + 8] = mn1;
        }
        named_bar_arrive(kBarMax0, 256);
        // Own reference: the running max unless this tile exceeds it by more than the slack
        // (consumer 1 then moves the round's max at least as far, so c0, c1 below are <= 1).
        const float t0 = mx0 > m0 + kMaxSlack ? mn0 : m0, t1 = mx1 > m1 + kMaxSlack ? mn1 : m1;
        softmax(t0, t1);
        pack_p(1.f, 1.f);
        pv_regs(kv_mine);  // O_left += P_0 V_0,left
        wgmma_wait<0>();
        fence_regs(o);
        mbar_arrive(&freed[0]);

        // The round's max (consumer 1's): rescale P_0 for consumer 1, and O and the sums.
        named_bar_sync(kBarMax1, 256);
        const float mf0 = smax_bw[64 * ph + r0], mf1 = smax_bw[64 * ph + r0 + 8];
        const float c0 = ex2_approx_ftz(t0 - (mf0 == -INFINITY ? 0.f : mf0));
        const float c1 = ex2_approx_ftz(t1 - (mf1 == -INFINITY ? 0.f : mf1));
        m0 = mf0;
        m1 = mf1;
        l0 *= c0;
        l1 *= c1;
        if (!__all_sync(0xffffffffu, c0 == 1.f && c1 == 1.f)) pack_p(c0, c1);  // else pa holds P_0 already
        store_p();
        named_bar_arrive(kBarP0, 256);
        rescale_o(c0, c1);
        named_bar_sync(kBarP1, 256);
        pv_smem(p_other, kv_other);  // O_left += P_1 V_1,left
        if (r + 1 < rounds) {
          // Next S behind the PV: its left half as soon as it lands, then release buffer 1's
          // left half once the PV that reads it is done.
          fence_regs(s);
          mbar_wait(ready_first, ph ^ 1);
          if (!kFp8) fence_proxy_async_smem();
          wgmma_fence();
          issue_s_half(first, true);
          wgmma_commit();
          wgmma_wait<1>();
          mbar_arrive(&freed[2]);
          mbar_wait(ready_second, ph ^ 1);
          if (!kFp8) fence_proxy_async_smem();
          issue_s_half(second, false);
          wgmma_commit();
          wgmma_wait<0>();
        } else {
          wgmma_wait<0>();
          mbar_arrive(&freed[2]);
        }
        fence_regs(o);
      }
    } else {
      for (int r = 0; r < rounds; ++r) {
        const uint32_t ph = (round_base + r) & 1;
        compute_s(ph);
        wgmma_wait<0>();
        fence_regs(s);
        float mx0, mx1;
        mask_and_max(ph, mx0, mx1);
        named_bar_sync(kBarMax0, 256);
        // The round's max so far, and its reference: the running max unless a tile of this
        // round exceeds it by more than the slack.
        const float mn0 = fmaxf(smax_fw[64 * ph + r0], mx0), mn1 = fmaxf(smax_fw[64 * ph + r0 + 8], mx1);
        const float t0 = mn0 > m0 + kMaxSlack ? mn0 : m0, t1 = mn1 > m1 + kMaxSlack ? mn1 : m1;
        if (quad == 0) {
          smax_bw[64 * ph + r0] = t0;
          smax_bw[64 * ph + r0 + 8] = t1;
        }
        named_bar_arrive(kBarMax1, 256);
        softmax(t0, t1);
        pack_p(1.f, 1.f);
        pv_regs(kv_mine);  // O_right += P_1 V_1,right
        store_p();
        named_bar_arrive(kBarP1, 256);
        named_bar_sync(kBarP0, 256);
        pv_smem(p_other, kv_other);  // O_right += P_0 V_0,right
        wgmma_wait<1>();
        mbar_arrive(&freed[3]);
        wgmma_wait<0>();
        fence_regs(o);
        mbar_arrive(&freed[1]);
      }
    }

    // Row sums: quad, then the other consumer's tiles (same final max on both).
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
    // Both consumers are past their last S of this item, so Q's smem is free: the next item's
    // Q loads while this one's output is stored.
    if (item + static_cast<int>(gridDim.x) < num_items) load_q(item + gridDim.x);

    // ---- epilogue ----
    const int h0 = wi.hb * kHeadsPerCta + r0, h1 = h0 + 8;
    constexpr float kLn2 = 0.6931471805599453f;
    constexpr float kLog2e = 1.4426950408889634f;
    const float lse0 = l0 > 0.f ? (m0 + __log2f(l0)) * kLn2 : -INFINITY;
    const float lse1 = l1 > 0.f ? (m1 + __log2f(l1)) * kLn2 : -INFINITY;
    if (p.num_splits == 1) {
      float inv0 = 0.f, inv1 = 0.f;
      if (l0 > 0.f) {
        const float sk = p.sink != nullptr ? p.sink[h0] * kLog2e : -INFINITY;
        inv0 = 1.f / (l0 + ex2_approx_ftz(sk - m0));
      }
      if (l1 > 0.f) {
        const float sk = p.sink != nullptr ? p.sink[h1] * kLog2e : -INFINITY;
        inv1 = 1.f / (l1 + ex2_approx_ftz(sk - m1));
      }
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
        const uint32_t a0 = pack_bf16x2(o[4 * j] * inv0, o[4 * j + 1] * inv0);  // chunk j, row r0
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
      const float inv0 = l0 > 0.f ? 1.f / l0 : 0.f;
      const float inv1 = l1 > 0.f ? 1.f / l1 : 0.f;
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
    round_base += rounds;
  }  // work items
}

// Merges the split partials of one (token, head): 128 threads x 4 columns.
__global__ void __launch_bounds__(128) sparse_mqa_combine_kernel(const __grid_constant__ SparseMqaParams p) {
  const int token = blockIdx.x / p.num_heads;
  const int h = blockIdx.x % p.num_heads;
  const int b = token / p.s_q, i = token % p.s_q;
  const int64_t tokens = static_cast<int64_t>(p.batch) * p.s_q;
  const int64_t split_stride = tokens * p.num_heads;
  const int64_t row = static_cast<int64_t>(token) * p.num_heads + h;
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
    const float sk = p.sink != nullptr ? p.sink[h] : -INFINITY;
    inv = 1.f / (lsum + __expf(sk - mx));
    lse = mx + __logf(lsum);
  }
  uint16_t* op = p.out + b * p.out_stride_b + i * p.out_stride_q + h * p.out_stride_h + threadIdx.x * 4;
  uint2 packed;
  packed.x = pack_bf16x2(acc.x * inv, acc.y * inv);
  packed.y = pack_bf16x2(acc.z * inv, acc.w * inv);
  *reinterpret_cast<uint2*>(op) = packed;
  if (threadIdx.x == 0) p.lse[row] = lse;
}

}  // namespace attention
}  // namespace dsv4
