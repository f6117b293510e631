// Sparse MQA: how many splits of the KV axis a call gets (host only, torch-free). Chosen
// from shapes only, so a CUDA graph captured for one shape replays with the same plan.
//
// A split takes whole pairs of 64-key tiles (the kernel's rounds, sparse_mqa_schedule.cuh).
// Splitting shortens each CTA's chain of rounds but adds work items (a wave more once they
// pass the SM count), fp32 partials written and read back, and the combine kernel.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>

#include "attention/sparse_mqa_params.cuh"

namespace dsv4 {
namespace attention {

// The cost model, in microseconds of an H200 (132 SMs), fitted to the decode table of
// docs/perf.md (graph replay, cold L2, measured on 3caf183) where the same case differs only
// in the split count or in one round per CTA:
//  * a round (one tile pair) more per CTA: 4.7 us at HCA 4K vs SWA, one wave (V4-Pro B=64
//    31.8 vs 26.9 us, V4-Flash B=128 32.1 vs 27.5), 6.5 us per round at CSA (V4-Flash
//    B=128 53.7 vs SWA 27.5 over 4 rounds): 6 us;
//  * a work item more per CTA, beyond its rounds: SWA B=128 -> 256 adds 11.5-12 us for one
//    one-round item per CTA, so ~6-7 us;
//  * a split at all: the combine's launch and run (2.9-4.2 us in
//    docs/perf-history/2026-12-02-small-batch-profile.md), 3 us;
//  * the partials: 4 KB per (token, head, split) written by the main kernel and read by the
//    combine (most of it from L2), 8 MB per us: where two tile pairs stop being split, from
//    the forced-split sweep on an H100 (scripts/attn_splits_sweep.sh, 21cfeae): a second
//    split saves 1.9-2.0 us at 32 work items (V4-Pro HCA 4K B=16, V4-Flash HCA 4K B=32) and
//    costs 2.5-3.0 us at 64 (V4-Pro HCA 4K B=32, V4-Flash HCA 4K B=64), so the break-even
//    lies near 46 items: 3 us = 2 * 46 * 64 * 4 KB / rate. (The first fit, 5 MB per us, put
//    it at 28 and left those two B=16/32 cases unsplit, 1.09x slower than split.)
// docs/perf-history/2026-12-04-attention-fixed-cost.md has the decisions it makes,
// docs/perf-history/2026-12-05-attention-splits-sweep.md the sweep.
constexpr double kSplitRoundUs = 6.0;
constexpr double kSplitItemUs = 7.0;
constexpr double kSplitCombineUs = 3.0;
constexpr double kSplitPartialBytesPerUs = 8.0e6;
constexpr double kSplitPartialBytes = 2.0 * kHeadDim * 4;  // per (token, head, split): fp32 out + in

// Pairs of 64-key tiles (the kernel's rounds) in `tiles` tiles: a split's unit.
inline int64_t tile_pairs(int64_t tiles) { return (tiles + 1) / 2; }

// Split count for `base_ctas` (token, head block) work items whose longest index lists hold
// `max_tiles` 64-key tiles in all, on `sms` SMs. `priced`: the cost model above; otherwise
// the earlier rule, which counted a CTA's tiles plus one and nothing for a split itself
// (kept for the A/B through DSV4_ATTN_PRICED_SPLITS=0). `tile_splits`: the splits take whole
// tiles (the ring of 32-key tiles, token_tiles<kNumSrc, true>), so a CTA's chain is
// ceil(tiles / s) tiles at half a round's price each; the count stays at most the pairs.
inline int pick_splits(int64_t base_ctas, int64_t max_tiles, int sms, bool priced = true, bool tile_splits = false) {
  const int64_t max_pairs = tile_pairs(max_tiles);
  if (base_ctas >= sms || max_pairs <= 1) return 1;
  int best = 1;
  double best_cost = 1e30;
  const int64_t limit = std::min<int64_t>(max_pairs, kMaxSplits);
  for (int s = 1; s <= limit; ++s) {
    // Never into a second wave: every such split of the sweep lost 7-13 us to the one-wave
    // count below it (V4-Pro CSA 4K B=8 9 splits 41.2 us against 8 splits 34.1, B=16 5
    // splits 50.6 against 4 splits 38.8, B=32 3 splits 67.0 against 2 splits 53.8; V4-Flash CSA
    // 4K B=32 5 splits 43.0 against 4 splits 35.2), which the wave term alone underprices.
    if (priced && s > 1 && base_ctas * s > sms) break;
    const double waves = std::ceil(double(base_ctas * s) / sms);
    const double rounds = tile_splits ? 0.5 * std::ceil(double(max_tiles) / s) : std::ceil(double(max_pairs) / s);
    double cost;
    if (priced) {
      cost = waves * (kSplitRoundUs * rounds + kSplitItemUs);
      if (s > 1) {
        const double heads = double(base_ctas) * kHeadsPerCta;  // tokens x heads
        cost += kSplitCombineUs + s * heads * kSplitPartialBytes / kSplitPartialBytesPerUs;
      }
    } else {
      cost = waves * (2.0 * rounds + 1.0);
    }
    if (cost < best_cost - 1e-9) {
      best_cost = cost;
      best = s;
    }
  }
  return best;
}

// DSV4_ATTN_SPLITS (csrc/common/env.h) takes counts up to 16.
static_assert(kMaxSplits >= 16, "DSV4_ATTN_SPLITS allows 16 splits: shorten its list in csrc/common/env.h");

// The split count of a default-mode call (not batch-invariant): pick_splits's, or with
// `forced` (DSV4_ATTN_SPLITS, a development override for sweeps of the rule) that count,
// clamped to [1, max_pairs] (and kMaxSplits): a split takes whole tile pairs, and the kernel cuts a token's
// pairs into equal parts (floor(pairs * s / splits), sparse_mqa_schedule.cuh), so with at most
// max_pairs splits no split of the longest token is empty, and a call of at most one pair
// (or no keys) runs unsplit. Unlike pick_splits, a forced count also splits calls of one wave
// of work items or more (base_ctas >= sms), and DSV4_ATTN_PRICED_SPLITS then has no effect.
inline int choose_splits(int64_t base_ctas, int64_t max_tiles, int sms, bool priced, std::optional<int> forced) {
  if (!forced.has_value()) return pick_splits(base_ctas, max_tiles, sms, priced);
  const int64_t cap = std::min<int64_t>(tile_pairs(max_tiles), kMaxSplits);
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(*forced, cap)));
}

// DSV4_ATTN_RING32 (csrc/common/env.h): which kernel a 128-head fp8 call (not paired) runs,
// 0 = today's (sparse_mqa.cuh), 1 = the two-round ring of 32-key tiles
// (sparse_mqa_ring32.cuh), 2 = the ring with the producer's loads one half-step ahead.
// `forced` (the variable set): that value. Unset: value 2 where the call's longest work item
// has at most kRing32MaxTiles 64-key tiles (ceil(max_tiles / num_splits)), today's otherwise.
// From the look-back of docs/perf-history/2026-12-07-attention-ring32.md (H100): value 2
// won where items are short (V4-Pro HCA 4K, 3 tiles: 0.85-0.94x -> 0.98-1.05x FlashMLA at
// B = 8-256; SWA, 2-3 tiles; CSA / HCA split items at B = 8-16), tied at 9 tiles (CSA 4K
// B = 32, 2 splits: 53.2 us both) and lost 3-7% at 18 tiles (B >= 64 unsplit). Measured as
// the rule on H100s since (that note's look-backs: V4-Pro 0.98-1.13x FlashMLA over the whole
// decode sweep at 8752082); not yet on an H200.
constexpr int64_t kRing32MaxTiles = 9;
inline int pick_ring32(int64_t max_tiles, int num_splits, std::optional<int> forced) {
  if (forced.has_value()) return *forced;
  const int64_t splits = std::max(num_splits, 1);
  const int64_t item_tiles = (max_tiles + splits - 1) / splits;
  return item_tiles <= kRing32MaxTiles ? 2 : 0;
}

// The split count and DSV4_ATTN_RING32 value of a default-mode 128-head fp8 call that is not
// paired, under DSV4_ATTN_TILE_SPLITS=1 (the ring's splits at whole tiles, token_tiles).
// Where the rule puts the call on the ring (at the pairs' split count), the count is priced
// again with whole-tile splits (pick_splits, tile_splits) and taken if the ring's rule still
// holds at it: V4-Pro CSA at B = 8 / 16 gets 6 / 4 splits of 3 / 5 tiles instead of 5 / 3
// splits of up to 4 / 6 tiles, HCA 32K at B = 32 two splits of 3 tiles instead of one item
// of 6 (docs/perf-history/2026-12-08-attention-ring32-tile-splits.md). A forced or unpriced
// split count (DSV4_ATTN_SPLITS, DSV4_ATTN_PRICED_SPLITS=0) is kept as it is.
struct Ring32Plan {
  int splits, ring32;
};
inline Ring32Plan plan_ring32(int64_t base_ctas, int64_t max_tiles, int sms, bool priced,
                              std::optional<int> forced_splits, std::optional<int> forced_ring32) {
  Ring32Plan plan{choose_splits(base_ctas, max_tiles, sms, priced, forced_splits), 0};
  plan.ring32 = pick_ring32(max_tiles, plan.splits, forced_ring32);
  if (plan.ring32 == 0 || !priced || forced_splits.has_value()) return plan;
  const int s = pick_splits(base_ctas, max_tiles, sms, true, true);
  const int r = pick_ring32(max_tiles, s, forced_ring32);
  if (r != 0) plan = {s, r};
  return plan;
}

}  // namespace attention
}  // namespace dsv4
