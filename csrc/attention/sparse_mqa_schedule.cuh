// Sparse MQA forward: the schedule (torch-free). A token's 64-key tiles over its two lists
// and the split's pair range, the work items a persistent CTA walks, and a tile row's raw
// index and slot.
#pragma once

#include <cstdint>

#include "attention/sparse_mqa_layout.cuh"

namespace dsv4 {
namespace attention {

// Per-token geometry shared by all threads of the CTA.
struct TokenTiles {
  int len[2];    // valid prefix of each list
  int ntile[2];  // tiles of each list
  int t0, t1;    // this split's tile range [t0, t1) over the concatenated lists (t0 even
                 // unless kTileSplits and p.tile_splits)
};

// kNumSrc: the sources the kernel instance reads, 1 (p.num_src == 1 only, so a one-source
// call skips the second list's loads and selects) or 2 (either; p.num_src decides).
// kTileSplits (the ring of 32-key tiles, whose round is one tile: sparse_mqa_ring32.cuh) with
// p.tile_splits (DSV4_ATTN_TILE_SPLITS=1): a default-mode split takes whole 64-key tiles
// rather than pairs: 18 tiles in 4 splits are 4, 5, 4, 5 tiles instead of 4, 4, 4, 6
// (docs/perf-history/2026-12-08-attention-ring32-tile-splits.md). The split count is at most
// the pairs (pick_splits), so no split of the longest token is empty; batch-invariant
// boundaries stay at fixed pairs.
template <int kNumSrc, bool kTileSplits = false>
__device__ __forceinline__ TokenTiles token_tiles(const SparseMqaParams& p, int b, int split) {
  static_assert(kNumSrc == 1 || kNumSrc == 2, "one or two sources");
  TokenTiles tt;
#pragma unroll
  for (int k = 0; k < 2; ++k) {
    int len = 0;
    if (k == 0 || (k < kNumSrc && k < p.num_src)) {
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
  // Unsigned 32-bit: tiles <= 2^25 (the launcher takes topk < 2^30 per list) and
  // num_splits <= 64, so the products stay within 2^31, where FastDivmod is exact (it is for
  // any n < 2^32); a 64-bit division is a subroutine call, a far jump that a cold instruction
  // cache pays for, and a 32-bit one ~20 instructions.
  if (kTileSplits && p.tile_splits && p.pairs_per_split == 0) {
    const uint32_t un = static_cast<uint32_t>(n);
    tt.t0 = static_cast<int>(p.splits_div.div(un * static_cast<uint32_t>(split)));
    tt.t1 = static_cast<int>(p.splits_div.div(un * static_cast<uint32_t>(split + 1)));
    return tt;
  }
  int p0, p1;
  if (p.pairs_per_split > 0) {  // batch-invariant: boundaries at fixed key positions
    p0 = min(split * p.pairs_per_split, pairs);
    p1 = min(p0 + p.pairs_per_split, pairs);
  } else {
    const uint32_t up = static_cast<uint32_t>(pairs);
    p0 = static_cast<int>(p.splits_div.div(up * static_cast<uint32_t>(split)));
    p1 = static_cast<int>(p.splits_div.div(up * static_cast<uint32_t>(split + 1)));
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
// Every CTA's producer and consumers decode their first item before anything else, so no
// division by a run-time value here: H is 64 or 128 (the launcher checks), one bit of head
// block, and FastDivmod for the split count and s_q (item < 2^31, the launcher's bound).
__device__ __forceinline__ WorkItem work_item(const SparseMqaParams& p, int item) {
  WorkItem w;
  const int two = p.num_heads > kHeadsPerCta;
  w.hb = item & two;
  uint32_t q, r;
  p.splits_div.divmod(static_cast<uint32_t>(item) >> two, q, r);
  w.split = static_cast<int>(r);
  w.token = static_cast<int>(q);
  p.sq_div.divmod(q, q, r);
  w.b = static_cast<int>(q);
  w.i = static_cast<int>(r);
  return w;
}
__device__ __forceinline__ int num_work_items(const SparseMqaParams& p) {
  return p.batch * p.s_q * p.num_splits * (p.num_heads / kHeadsPerCta);
}

template <int kNumSrc>
__device__ __forceinline__ int tile_list(const TokenTiles& tt, int tile) {
  return kNumSrc == 1 ? 0 : (tile < tt.ntile[0] ? 0 : 1);
}

// Raw index of row `row` of concatenated tile `tile` (one global load), or -1 when the entry
// is past its list's length or the tile past this split's range.
template <int kNumSrc>
__device__ __forceinline__ int tile_index(const SparseMqaParams& p, const TokenTiles& tt, int b, int i, int tile,
                                          int row) {
  if (tile >= tt.t1) return -1;
  const bool l0 = tile_list<kNumSrc>(tt, tile) == 0;
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
template <int kNumSrc>
__device__ __forceinline__ int index_slot(const SparseMqaParams& p, const TokenTiles& tt, int tile, int v) {
  const int64_t ns = tile_list<kNumSrc>(tt, tile) == 0 ? p.src[0].num_slots : p.src[1].num_slots;
  return (v >= 0 && static_cast<int64_t>(v) < ns) ? v : -1;
}

}  // namespace attention
}  // namespace dsv4
