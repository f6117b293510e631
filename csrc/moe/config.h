// The kernel choice of the MoE ops, host only: for each op a pure get_best_config (the
// checked shapes, what is known about the device, the development overrides of
// common/env.h -> a small config struct that the launch reads and nothing else decides)
// and the line DSV4_PRINT_CONFIG=1 prints. Outside any anonymous namespace, so that
// csrc/testing/testing_ops.cpp can call them (dsv4_testing::nvfp4_moe_config,
// mxfp4_moe_config; tests/test_moe_config.py) on made-up shapes and device facts.
// What the device facts are measured from (occupancy queries of the GEMM kernels) is
// nvfp4_moe.cu's device_facts().
#pragma once

#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <string>

#include "common/env.h"
#include "moe/params.cuh"  // kTileRows

namespace dsv4 {
namespace moe {

// ---------------------------------------------------------------------------------
// dsv4::nvfp4_moe
// ---------------------------------------------------------------------------------

// The checked shapes of one call (nvfp4_moe.cu, check_inputs).
struct Nvfp4MoeShape {
  int64_t M, K, N, E, E_global, topk;
  bool nvfp4;  // activation "nvfp4" (W4A4), else "bf16"
};

struct GemmOccupancy {
  int gemm1, gemm2;  // resident split-K CTAs per SM
  int classic1;      // resident classic GEMM1 CTAs per SM
};

// Index of a token tile (8, 16, 64) in the per-tile occupancy tables of both ops' device facts.
inline int tile_index(int block_n) { return block_n == 8 ? 0 : block_n == 16 ? 1 : 2; }

// What the kernel choice needs to know about one device.
struct DeviceFacts {
  int sms;
  GemmOccupancy occ[3];  // token tiles 8, 16, 64
  int ws_grid2;          // CTAs of the 2-CTA prefill grid (0: no 2-CTA cluster fits)

  const GemmOccupancy& occupancy(int block_n) const { return occ[tile_index(block_n)]; }
};

// What one call launches (nvfp4_moe.cu's launch reads nothing else to decide).
struct Nvfp4MoeConfig {
  int block_n;           // token tile of the grouped GEMMs: 8, 16 (mma.sync) or 64
  int max_tiles;         // bound on the token tiles (grids, workspace)
  bool multi_cta_route;  // routing on many CTAs: count -> tables -> place
  bool splitk;           // split-K persistent grid (moe_gemm_splitk_kernel)
  int gemm1_ctas, gemm2_ctas, sk_ctas;  // split-K: the two grids and their bound (else 0)
  bool direct_x;         // bf16 decode tiles: GEMM1 reads x rows itself, no gather kernel
  bool ws;               // the warp-specialized prefill kernel (nvfp4_gemm_ws.cuh)
  int cluster;           // ws: CTAs per cluster
  int ws_ctas;           // ws: the persistent grid
  bool pdl;              // programmatic dependent launches
  int gather_ctas, combine_ctas;
  int gemm2_rows;        // 64-token one-warpgroup GEMM2: weight-row tiles per CTA over a
                         // resident token tile (moe_gemm2_resident_kernel); 1 = the classic kernel
};

// Token tile of the grouped GEMMs from shapes only: expected tokens per local expert
// under uniform routing over the global experts, 8 up to 4, 16 up to the op's max16, 64
// above. 64 is the prefill tile (NVFP4's warp-specialized kernel groups up to three of
// them into one unit). Each op's max16 is where its 64-token kernels overtook its
// 16-token ones when both tiles were timed side by side at every model's shape on an
// H100 (docs/perf-history/2026-12-06-moe-token-tile-crossover.md).
inline int pick_block_n(int64_t M, int64_t topk, int64_t E_global, double max16) {
  const double per_expert = double(M) * double(topk) / double(E_global);
  if (per_expert <= 4.0) return 8;
  if (per_expert <= max16) return 16;
  return 64;
}

// nvfp4_moe's max16: crossovers at 19-22 tokens per expert at the expert-parallel shapes
// (N = 2048-3072) and, with GEMM2 over a resident token tile where N <= 512
// (moe_gemm2_resident_kernel), at 19-20 at V4.1-Flash tensor parallel 8 (N = 288 padded to
// 320; it was ~37 with the classic GEMM2, which reads its token tile again for every
// weight tile: docs/perf-history/2026-12-06-nvfp4-moe-gemm2-resident.md).
constexpr double kNvfp4Max16 = 20.0;

// mxfp4_moe's max16: crossovers at 16 tokens per expert at V4-Pro, V4.1-Flash local-48
// and tensor parallel 8, ~20 at V4-Flash local-32 (the 16-token tile 6% faster at 18).
constexpr double kMxfp4Max16 = 16.0;

// Above this many slots (M * k) the routing runs on many CTAs (moe_count_kernel); below
// it one CTA is faster (one launch instead of three, plus a memset).
constexpr int64_t kMultiCtaRouteSlots = 8192;

// Split-K (persistent grid, items cut into K chunks) or the classic grid (one CTA
// per token tile x weight-row tile, hardware-scheduled). Split-K when the expected
// classic GEMM1 grid (touched experts under uniform routing x weight-row tiles) does
// not fill one wave: then most SMs idle while each CTA runs a latency-bound K loop.
// Above that the classic grid measured as fast or faster
// (docs/perf-history/2026-11-30-nvfp4-moe-split-k-pdl.md). DSV4_MOE_SPLITK overrides.
// (Both ops: GEMM1's items are 64-row tiles of w13, 2N / 64 per touched expert.)
inline bool splitk_by_items(int64_t M, int64_t topk, int64_t E, int64_t E_global, int64_t N, int block_n,
                            int classic1_wave) {
  if (block_n > 16) return false;
  const double local_slots = double(M) * double(topk) * double(E) / double(E_global);
  const double touched = double(E) * (1.0 - std::pow(1.0 - 1.0 / double(E), local_slots));
  const double items = touched * double(2 * N / kTileRows);
  return items < double(classic1_wave);
}
inline bool splitk_by_shape(const Nvfp4MoeShape& c, int block_n, int classic1_wave) {
  return splitk_by_items(c.M, c.topk, c.E, c.E_global, c.N, block_n, classic1_wave);
}

// Rows of token tiles of mxfp4_moe's classic GEMM grids at 64-row tiles (mxfp4_gemm.cuh
// mxfp4_gemm_kernel): the tiles expected
// under uniform routing over the global experts (the local slots' full tiles plus one
// partial tile per touched local expert), with a quarter more as margin, at most
// max_tiles. max_tiles counts every slot as local (the host cannot see the routing), so
// under expert parallelism it is ~6x the tiles that exist; a grid of that many rows
// launched mostly CTAs that read the tile count and exit
// (docs/perf-history/2026-12-05-mxfp4-w4a8-quant-x.md). Routing that makes more tiles than
// the grid has rows costs time, not correctness: a CTA takes the tiles of its row one
// after the other. mxfp4_moe's GEMM2 rows and resident kernels keep max_tiles rows: the
// same loop there took 37-50 registers more (137-146, 3 CTAs per SM; spills in the K loop
// when held to 128; 148 with the loop's addresses recomputed per tile, 154 and 232 bytes
// of stack with the tile a noinline call). nvfp4_moe keeps max_tiles rows: the same loop
// in its moe_gemm_kernel measured 4% slower at M = 2048 (V4-Flash 310 -> 323 us, V4-Pro
// 984 -> 1026 on an H100), its empty CTAs being cheaper than a CTA's second tile.
inline int pick_grid_tiles(int64_t M, int64_t topk, int64_t E, int64_t E_global, int block_n, int max_tiles) {
  const double local_slots = double(M) * double(topk) * double(E) / double(E_global);
  const double touched = double(E) * (1.0 - std::pow(1.0 - 1.0 / double(E), local_slots));
  const double expected = std::ceil(local_slots / double(block_n)) + touched;
  return int(std::min<double>(double(max_tiles), std::ceil(1.25 * expected) + 1.0));
}

// The prefill kernel (nvfp4_gemm_ws.cuh) runs at the 64-token tile when cta_mode is
// given (1 or 2) or, in auto mode, from kWsMinTokensPerExpert expected tokens per local
// expert (ws_min_tokens_per_expert: more where N <= kNvfp4ResidentMaxN): below that most
// groups are one partly filled tile and the one-warpgroup kernel, with 2-3 CTAs per SM,
// measured as fast or faster (the prefill kernel at 32-48 tokens: 0.82-1.0x of it; at
// 64-72: 1.21-1.49x;
// docs/perf-history/2026-11-30-nvfp4-moe-prefill-ws.md). DSV4_MOE_WS overrides at the
// 64-token tile (0: the one-warpgroup kernel).
constexpr double kWsMinTokensPerExpert = 60.0;

// moe_gemm2_resident_kernel (nvfp4_gemm.cuh): GEMM2's K = N in at most 8 steps of 64 (the
// token tile, two weight slots and the y staging: 72 KB at N = 320, 3 CTAs per SM as the
// classic kernel's 64 KB; 109 KB at 512), 8 weight-row tiles per CTA as mxfp4_moe's GEMM2
// at the same shape (pick_gemm2_rows; not yet timed for this op).
constexpr int64_t kNvfp4ResidentMaxN = 512;
constexpr int kNvfp4Gemm2Rows = 8;
// Where GEMM2 runs over a resident token tile (N <= kNvfp4ResidentMaxN) the one-warpgroup
// kernels stay ahead of the prefill kernel further: V4.1-Flash tensor parallel 8, H100,
// 1.08x / 1.02x at 64 / 72 tokens per expert, 0.98x / 0.97x at 80 / 88
// (docs/perf-history/2026-12-06-nvfp4-moe-gemm2-resident.md).
constexpr double kWsMinTokensPerExpertResident = 76.0;
// GEMM1 reading x rows itself (direct_x) instead of the gather kernel's per-slot copy xg:
// the copy costs per slot ~K bytes written, while reading scattered x rows (128 bytes per row
// and K step, where xg's rows of a tile lie together) slows GEMM1 itself, most in the prefill
// kernel, whose token blocks otherwise come by one bulk copy each. GEMM1's work per slot grows
// with N, the copy's does not, so the copy is worth skipping where N is short. H100, main's
// build against the direct one (docs/perf-history/2026-12-07-moe-direct-x-prefill.md):
// V4.1-Flash at tensor parallel 8 (N = 288, padded 320) 1.19x at M = 8192 (prefill kernel
// 0.84x, gather 387 us gone) and 1.08x at 2048 (64-token kernel 0.96x, gather 73 us gone);
// N = 2048-3072 (V4-Flash, V4-Pro local experts) 0.87-0.98x (the prefill kernel 0.80-0.81x,
// the 64-token one 0.92-0.95x). Decode tiles read x rows either way (one launch less).
constexpr int64_t kDirectXMaxN = 512;
inline bool pick_direct_x(int block_n, int64_t N) { return block_n <= 16 || N <= kDirectXMaxN; }

inline double ws_min_tokens_per_expert(int64_t N) {
  return N <= kNvfp4ResidentMaxN ? kWsMinTokensPerExpertResident : kWsMinTokensPerExpert;
}

// CTAs per cluster of the prefill kernel: cta_mode 1 or 2; auto: 1. With the modes timed
// round-robin, pairs measured 0.97-0.99x of single CTAs at every prefill size (the kernel
// is bound by dequant and MMA issue, not by the L2 traffic that multicasting the token
// rows halves; docs/perf-history/2026-11-30-nvfp4-moe-prefill-ws.md).
inline int ws_cluster(int64_t cta_mode) { return cta_mode != 0 ? int(cta_mode) : 1; }

// The kernel choice: a pure function of the checked shapes, cta_mode, the device facts
// and the overrides (each unset override leaves its decision to the rule beside it).
inline Nvfp4MoeConfig get_best_config(const Nvfp4MoeShape& c, int64_t cta_mode, const DeviceFacts& d,
                                      const env::Switches& o) {
  Nvfp4MoeConfig cfg{};
  const int64_t S = c.M * c.topk;
  cfg.block_n = o.moe_block_n.value_or(pick_block_n(c.M, c.topk, c.E_global, kNvfp4Max16));
  // Every local slot in a tile; at most one partly filled tile per busy expert.
  const int64_t busy = std::min<int64_t>(c.E, S);
  cfg.max_tiles = int(std::max<int64_t>(1, (S + busy * (cfg.block_n - 1)) / cfg.block_n));
  cfg.multi_cta_route = S > kMultiCtaRouteSlots;
  const GemmOccupancy& occ = d.occupancy(cfg.block_n);
  cfg.splitk = o.moe_splitk.value_or(splitk_by_shape(c, cfg.block_n, occ.classic1 * d.sms));
  if (cfg.splitk) {
    cfg.gemm1_ctas = occ.gemm1 * d.sms;
    cfg.gemm2_ctas = occ.gemm2 * d.sms;
    cfg.sk_ctas = std::max(cfg.gemm1_ctas, cfg.gemm2_ctas);
  }
  if (cfg.block_n == 64 && !cfg.splitk)
    cfg.ws = o.moe_ws.value_or(cta_mode != 0 || double(S) / double(c.E_global) >= ws_min_tokens_per_expert(c.N));
  if (cfg.ws) {
    cfg.cluster = ws_cluster(cta_mode);
    TORCH_CHECK(cfg.cluster == 1 || d.ws_grid2 > 0,
                "dsv4: nvfp4_moe's 2-CTA prefill kernel does not fit on this device (cta_mode=2)");
    cfg.ws_ctas = cfg.cluster == 2 ? d.ws_grid2 : d.sms;
  } else {
    cfg.cluster = 1;
    TORCH_CHECK(cfg.splitk || cfg.max_tiles <= 65535, "dsv4: nvfp4_moe's one-warpgroup GEMM grid takes at most "
                "65535 token tiles, got ", cfg.max_tiles, " (M * k = ", S, " slots); call it on fewer tokens at a time");
  }
  // bf16 mode: GEMM1 may copy each token tile's rows from x itself, by row_slot (gemm_segment;
  // the prefill kernel's token producer, ws_producer_x), so that no gather kernel writes xg.
  // Not with the 2-CTA prefill kernel, whose token blocks are multicast by bulk copies of xg,
  // nor where the prefill kernel's 32-bit row offsets would not hold M * K, nor in the
  // split-K grid at 64-token tiles (a forced choice; no instance of it reads x). By default at
  // decode tiles, and at 64-token tiles where N <= kDirectXMaxN (pick_direct_x);
  // DSV4_MOE_DIRECT_X=1 / 0 forces it wherever it can run / nowhere.
  const bool offsets32 = c.M * c.K <= int64_t(INT32_MAX);
  const bool direct_possible =
      !c.nvfp4 && cfg.cluster == 1 && (!cfg.ws || offsets32) && (cfg.block_n <= 16 || !cfg.splitk);
  cfg.direct_x = direct_possible && o.moe_direct_x.value_or(pick_direct_x(cfg.block_n, c.N));
  // Launch with programmatic stream serialization (see pdl_wait in common/ptx/pdl.cuh):
  // the kernel may be scheduled while its predecessor in the stream drains, which
  // hides the launch gap between the five kernels of a (decode-sized) call.
  // On by default at decode token tiles (<= 16), where it saved ~3 us per call; at
  // prefill the same-process A/B was within its +-5-9 % noise either way
  // (docs/perf-history/2026-11-30-nvfp4-moe-split-k-pdl.md), so prefill keeps plain
  // launches. DSV4_MOE_PDL overrides.
  cfg.pdl = o.moe_pdl.value_or(cfg.block_n <= 16);
  cfg.gather_ctas = int(std::min<int64_t>(int64_t(cfg.max_tiles) * cfg.block_n, int64_t(d.sms) * 8));
  cfg.combine_ctas = int(std::min<int64_t>(c.M, int64_t(d.sms) * 16));
  // GEMM2 with a short K (N <= 512: tensor parallel 8) at 64-token tiles on the classic
  // grid: kNvfp4Gemm2Rows weight-row tiles per CTA over a resident token tile, halved until
  // it divides K / 64 (DSV4_MOE_GEMM2_ROWS overrides there; 1 runs the classic kernel).
  cfg.gemm2_rows = 1;
  if (cfg.block_n == 64 && !cfg.ws && !cfg.splitk && c.N <= kNvfp4ResidentMaxN) {
    const int64_t row_tiles = c.K / 64;
    int r = kNvfp4Gemm2Rows;
    while (row_tiles % r != 0) r /= 2;
    cfg.gemm2_rows = o.moe_gemm2_rows.value_or(r);
    TORCH_CHECK(row_tiles % cfg.gemm2_rows == 0, "dsv4: DSV4_MOE_GEMM2_ROWS=", cfg.gemm2_rows,
                " must divide nvfp4_moe's K / 64 = ", row_tiles, " GEMM2 weight tiles");
  }
  return cfg;
}

// The DSV4_PRINT_CONFIG=1 line: the inputs of the choice, then the choice.
inline void print_config(const char* op, const Nvfp4MoeShape& c, int64_t cta_mode, const DeviceFacts& d,
                         const Nvfp4MoeConfig& cfg, int64_t workspace_bytes) {
  const std::string line = c10::str(
      "dsv4 config ", op, ": M=", c.M, " K=", c.K, " N=", c.N, " E=", c.E, " E_global=", c.E_global, " topk=", c.topk,
      " activation=", c.nvfp4 ? "nvfp4" : "bf16", " cta_mode=", cta_mode, " sms=", d.sms,
      " classic1=", d.occupancy(cfg.block_n).classic1, " -> block_n=", cfg.block_n, " max_tiles=", cfg.max_tiles,
      " multi_cta_route=", int(cfg.multi_cta_route), " splitk=", int(cfg.splitk), " sk_ctas=", cfg.sk_ctas,
      " direct_x=", int(cfg.direct_x), " ws=", int(cfg.ws), " cluster=", cfg.cluster, " ws_ctas=", cfg.ws_ctas,
      " pdl=", int(cfg.pdl), " gemm2_rows=", cfg.gemm2_rows, " workspace_bytes=", workspace_bytes);
  std::fprintf(stderr, "%s\n", line.c_str());
  std::fflush(stderr);
}

// ---------------------------------------------------------------------------------
// dsv4::mxfp4_moe (W4A8: the FP8 mma.sync GEMMs of mxfp4_gemm.cuh)
// ---------------------------------------------------------------------------------

// The checked shapes of one call (mxfp4_moe.cu, check_inputs); N is the padded one.
struct Mxfp4MoeShape {
  int64_t M, K, N, E, E_global, topk;
};

// What the kernel choice needs to know about one device (mxfp4_moe.cu's device_facts).
struct Mxfp4DeviceFacts {
  int sms;
  GemmOccupancy occ[3];  // token tiles 8, 16, 64

  const GemmOccupancy& occupancy(int block_n) const { return occ[tile_index(block_n)]; }
};

// What one call launches (mxfp4_moe.cu's launch reads nothing else to decide).
struct Mxfp4MoeConfig {
  int block_n;           // token tile: 8, 16 or 64
  int max_tiles;         // bound on the token tiles (grids, workspace)
  bool multi_cta_route;  // routing on many CTAs: count -> tables -> place
  bool splitk;           // split-K persistent grid (mxfp4_gemm_splitk_kernel)
  int gemm1_ctas, gemm2_ctas, sk_ctas;  // split-K: the two grids and their bound (else 0)
  bool pdl;              // programmatic dependent launches
  int quant_ctas;        // the grid of GEMM1's input quantization (mxfp4_quant_x_kernel or the fused one)
  int gemm2_rows;        // 64-row weight tiles per GEMM2 CTA (mxfp4_gemm2_rows_kernel when > 1)
  bool gemm2_resident;   // ... with the token tile resident (mxfp4_gemm2_resident_kernel)
  bool fused_route;      // routing + GEMM1's input in one kernel (mxfp4_route_quant_kernel)
  int grid_tiles;        // token-tile rows of the classic mxfp4_gemm_kernel grids (its CTAs loop at 64-row tiles)
  bool gemm1_pairs;      // GEMM1 on pairs of an expert's 64-token tiles (mxfp4_gemm1_pair_kernel; routing tile_pairs)
  int grid_pairs;        // ... its grid's rows of tile pairs
  bool gemm2_pairs;      // GEMM2 on pairs of an expert's 64-token tiles (mxfp4_gemm2_pair_kernel, gemm2_rows / 2
                         // weight tiles per CTA; needs gemm1_pairs' tile_pairs)
  bool late_zero;        // the output rows of tokens without a local slot zeroed by GEMM1's pair kernel
};

// GEMM1 on pairs of an expert's tiles from two full tiles per expert: measured 1.01-1.10x
// the op at 128-256 expected tokens per local expert (M >= 8192 at EP8 and TP8) and 0.92x
// at 32 (V4-Pro M = 2048: every pair half empty) on an H100
// (docs/perf-history/2026-12-05-mxfp4-w4a8-pairs.md). DSV4_MOE_GEMM1_PAIRS overrides.
constexpr double kPairsMinTokensPerExpert = 128.0;

// GEMM2 weight tiles per CTA on the classic grid at 64-token tiles (a classic CTA's fixed
// cost is ~8 us against ~1 us per K chunk), as measured on the H200 at M = 2048-16384
// (docs/perf-history/2026-12-04-mxfp4-w4a8-gemm2-rows.md): 8 where GEMM2 has at most 4 K
// chunks (V4.1-Flash at tensor parallel 8, G2 = 3: the op 1.27-1.38x faster than with 1),
// 4 otherwise (the expert-parallel shapes, G2 = 16-24: 1.04-1.13x; 8 loses there at
// M = 2048, too few CTAs for the SMs); halved until it divides the K / 64 weight tiles.
inline int pick_gemm2_rows(int64_t G2, int64_t row_tiles) {
  int r = G2 <= 4 ? 8 : 4;
  while (row_tiles % r != 0) r /= 2;
  return r;
}

// The kernel choice, the NVFP4 op's rules where they apply: the token tile of
// pick_block_n (8, 16, then 64 above kMxfp4Max16 expected tokens per local expert; tiles
// of 32 and 128 rows measured slower than 64 at every prefill size of the three models,
// docs/perf-history/2026-12-04-mxfp4-w4a8-token-tiles.md; DSV4_MOE_BLOCK_N overrides),
// split-K by splitk_by_items with this op's occupancy (decode tiles only), PDL on; at
// 64-token tiles on the classic grid, GEMM2 CTAs of pick_gemm2_rows weight tiles (and one
// chunk of wgmmas in flight per warpgroup: two, at 3 CTAs per SM, measured 4-20% slower at
// every prefill size, docs/perf-history/2026-12-05-mxfp4-w4a8-overlap-wg.md);
// DSV4_MOE_SPLITK, DSV4_MOE_PDL, DSV4_MOE_GEMM2_ROWS and DSV4_MOE_GEMM2_RESIDENT (there
// only) override. At decode sizes (at most kFusedRouteSlots slots on 8- or 16-row tiles)
// the routing and GEMM1's input quantization run as one kernel (one kernel boundary less
// before GEMM1; DSV4_MOE_FUSED_ROUTE=0 keeps the two).
inline Mxfp4MoeConfig get_best_config(const Mxfp4MoeShape& c, const Mxfp4DeviceFacts& d, const env::Switches& o) {
  Mxfp4MoeConfig cfg{};
  const int64_t S = c.M * c.topk;
  cfg.block_n = o.moe_block_n.value_or(pick_block_n(c.M, c.topk, c.E_global, kMxfp4Max16));
  const int64_t busy = std::min<int64_t>(c.E, S);
  cfg.max_tiles = int(std::max<int64_t>(1, (S + busy * (cfg.block_n - 1)) / cfg.block_n));
  cfg.multi_cta_route = S > kMultiCtaRouteSlots;
  const GemmOccupancy& occ = d.occupancy(cfg.block_n);
  cfg.splitk = o.moe_splitk.value_or(
      splitk_by_items(c.M, c.topk, c.E, c.E_global, c.N, cfg.block_n, occ.classic1 * d.sms));
  if (cfg.splitk) {
    cfg.gemm1_ctas = occ.gemm1 * d.sms;
    cfg.gemm2_ctas = occ.gemm2 * d.sms;
    cfg.sk_ctas = std::max(cfg.gemm1_ctas, cfg.gemm2_ctas);
  }
  cfg.pdl = o.moe_pdl.value_or(true);
  cfg.gemm2_rows = 1;
  const int64_t G2 = (c.N + 127) / 128;  // GEMM2's K chunks of 128
  if (!cfg.splitk && cfg.block_n == 64) {
    const int64_t row_tiles = c.K / 64;
    cfg.gemm2_rows = o.moe_gemm2_rows.value_or(pick_gemm2_rows(G2, row_tiles));
    TORCH_CHECK(row_tiles % cfg.gemm2_rows == 0, "dsv4: DSV4_MOE_GEMM2_ROWS=", cfg.gemm2_rows,
                " must divide mxfp4_moe's K / 64 = ", row_tiles, " GEMM2 weight tiles");
    // The token tile resident where its G2 chunks and two weight slots fit 4 CTAs per SM
    // and a slot holds the y staging: 2 <= G2 <= 4 (mxfp4_gemm.cuh, ResidentSmem).
    cfg.gemm2_resident = cfg.gemm2_rows > 1 && G2 >= 2 && G2 <= 4 && o.moe_gemm2_resident.value_or(true);
  }
  cfg.grid_tiles =
      cfg.block_n == 64 ? pick_grid_tiles(c.M, c.topk, c.E, c.E_global, cfg.block_n, cfg.max_tiles) : cfg.max_tiles;
  // GEMM1 on pairs of tiles (the conversion paid once per 128 tokens) from
  // kPairsMinTokensPerExpert expected tokens per local expert: each touched expert may add
  // one empty tile, so the bound grows by the experts that can be busy.
  const bool pairs_rule = double(S) / double(c.E_global) >= kPairsMinTokensPerExpert;
  cfg.gemm1_pairs = !cfg.splitk && cfg.block_n == 64 && o.moe_gemm1_pairs.value_or(pairs_rule);
  if (cfg.gemm1_pairs) {
    cfg.max_tiles += int(busy);
    cfg.max_tiles += cfg.max_tiles & 1;
    // rows of mxfp4_gemm1_pair_kernel's grid: pick_grid_tiles in units of pairs (128 rows)
    cfg.grid_pairs = pick_grid_tiles(c.M, c.topk, c.E, c.E_global, 128, cfg.max_tiles / 2);
  }
  // GEMM2 on pairs of tiles where GEMM1 runs on them (the routing's tile_pairs) and GEMM2 runs
  // CTAs of several weight tiles: each weight chunk converted once for 128 tokens, with half
  // the rows kernel's weight tiles per CTA so that a CTA does the same work and the grid has
  // as many CTAs (docs/perf-history/2026-12-07-mxfp4-w4a8-gemm2-rate-study.md). Measured on
  // an H100: GEMM2 6.0-7.2% faster at M >= 8192, the op 1.02-1.04x, M = 2048 1.00-1.01x,
  // outputs bitwise the rows kernel's. On by default except where the token tile is resident
  // (2 <= G2 <= 4, V4.1-Flash at TP8: pairs against the resident kernel not yet measured);
  // DSV4_MOE_GEMM2_PAIRS=1 turns it on there too, in place of the resident kernel, =0 off.
  cfg.gemm2_pairs = cfg.gemm1_pairs && cfg.gemm2_rows > 1 && o.moe_gemm2_pairs.value_or(G2 < 2 || G2 > 4);
  if (cfg.gemm2_pairs) cfg.gemm2_resident = false;
  // Under expert parallelism the output rows of tokens without a local slot are zeros (45%
  // of the tokens at EP8, top-6 of 384), written by the quantization of GEMM1's input,
  // which is bound by memory: at V4-Pro M = 8192 they are 53 of its ~161 MB. Where GEMM1
  // runs on pairs (M >= 8192 at EP8) it is bound by its MMA chains, not by memory, so its
  // pair kernel writes those rows instead (mxfp4_gemm.cuh zero_remote_rows). Measured on an
  // H100 (docs/perf-history/2026-12-07-mxfp4-w4a8-late-zero.md): the quantization 75.5 ->
  // 52.6 us at V4-Pro M = 8192, GEMM1 +9 us; the op's kernels 10-25 us faster at every EP
  // shape at M = 8192 and 16384, outputs bitwise the same. DSV4_MOE_LATE_ZERO=0 keeps them in
  // the quantization.
  cfg.late_zero = cfg.gemm1_pairs && o.moe_late_zero.value_or(true);
  // the classic grids (GEMM2's rows kernels have max_tiles rows), on the final bound
  TORCH_CHECK(cfg.splitk || cfg.max_tiles <= 65535, "dsv4: mxfp4_moe's GEMM grid takes at most 65535 token tiles, ",
              "got ", cfg.max_tiles, " (M * k = ", S, " slots); call it on fewer tokens at a time");
  cfg.fused_route = S <= kFusedRouteSlots && cfg.block_n <= 16 &&
                    int64_t(cfg.max_tiles) * cfg.block_n <= kFusedRouteRows && o.moe_fused_route.value_or(true);
  // GEMM1's input, 8 warps per CTA: fused, one warp per 128-group (up to 8 CTAs per SM);
  // else one warp per step of 8 groups of a token, at most one wave of the CTAs per SM that
  // mxfp4_quant_x_kernel's launch bounds keep resident (the warps stride over the steps).
  const int64_t G1 = c.K / 128, units = c.M * (cfg.fused_route ? G1 : (G1 + 7) / 8);
  cfg.quant_ctas = int(std::max<int64_t>(
      1, std::min<int64_t>((units + 7) / 8, int64_t(d.sms) * (cfg.fused_route ? 8 : w4a8::kQuantXCtasPerSm))));
  return cfg;
}

inline void print_config(const Mxfp4MoeShape& c, const Mxfp4DeviceFacts& d, const Mxfp4MoeConfig& cfg,
                         int64_t workspace_bytes) {
  const std::string line = c10::str(
      "dsv4 config mxfp4_moe: M=", c.M, " K=", c.K, " N=", c.N, " E=", c.E, " E_global=", c.E_global,
      " topk=", c.topk, " activation=fp8 sms=", d.sms, " classic1=", d.occupancy(cfg.block_n).classic1,
      " -> block_n=", cfg.block_n, " max_tiles=", cfg.max_tiles, " multi_cta_route=", int(cfg.multi_cta_route),
      " splitk=", int(cfg.splitk), " sk_ctas=", cfg.sk_ctas, " pdl=", int(cfg.pdl), " quant_ctas=", cfg.quant_ctas,
      " gemm2_rows=", cfg.gemm2_rows, " gemm2_resident=", int(cfg.gemm2_resident),
      " fused_route=", int(cfg.fused_route), " grid_tiles=", cfg.grid_tiles, " gemm1_pairs=", int(cfg.gemm1_pairs),
      " grid_pairs=", cfg.grid_pairs, " gemm2_pairs=", int(cfg.gemm2_pairs), " late_zero=", int(cfg.late_zero),
      " workspace_bytes=", workspace_bytes);
  std::fprintf(stderr, "%s\n", line.c_str());
  std::fflush(stderr);
}

}  // namespace moe
}  // namespace dsv4
