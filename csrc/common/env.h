// The environment variables that the CUDA entries read: development overrides of the
// kernel choice (MoE and attention) and one debug switch. All are read here and only here, once per process
// (at the first call of an op that reads them), and validated: a value other than the
// documented ones is an error naming the variable, on every call, never a silent default.
// README.md, "Environment variables", lists the same variables; tests/test_moe_config.py
// checks that the two lists agree.
#pragma once

#include <c10/util/Exception.h>

#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <optional>
#include <string>

namespace dsv4 {
namespace env {

// A switch: unset or empty -> std::nullopt (the library decides), "0" -> false,
// "1" -> true; anything else is an error.
inline std::optional<bool> parse_switch(const char* name, const char* value) {
  if (value == nullptr || value[0] == '\0') return std::nullopt;
  TORCH_CHECK(std::strcmp(value, "0") == 0 || std::strcmp(value, "1") == 0, "dsv4: environment variable ", name,
              " must be 0 or 1 (or unset), got \"", value, "\"");
  return value[0] == '1';
}

// A choice among a few integers: unset or empty -> std::nullopt, else exactly the
// decimal spelling of one of `allowed` (no sign, spaces or leading zeros); anything else
// is an error naming the variable and the values.
inline std::optional<int> parse_int_choice(const char* name, const char* value, std::initializer_list<int> allowed) {
  if (value == nullptr || value[0] == '\0') return std::nullopt;
  std::string list;
  for (int a : allowed) {
    if (std::to_string(a) == value) return a;
    list += (list.empty() ? "" : ", ") + std::to_string(a);
  }
  TORCH_CHECK(false, "dsv4: environment variable ", name, " must be one of ", list, " (or unset), got \"", value,
              "\"");
  return std::nullopt;
}

struct Switches {
  // MoE kernel choice (csrc/moe/config.h, get_best_config; split-K, PDL, the token tile and
  // GEMM2's rows serve both ops, WS and DIRECT_X nvfp4_moe, the others mxfp4_moe); unset:
  // automatic.
  std::optional<bool> moe_ws;        // DSV4_MOE_WS: the warp-specialized prefill GEMMs at 64-token tiles
  std::optional<bool> moe_splitk;    // DSV4_MOE_SPLITK: the split-K persistent GEMM grid
  std::optional<bool> moe_direct_x;  // DSV4_MOE_DIRECT_X: 0 keeps the gather kernel in bf16 decode
  std::optional<bool> moe_pdl;       // DSV4_MOE_PDL: programmatic dependent launches
  std::optional<int> moe_block_n;    // DSV4_MOE_BLOCK_N: the token tile of both ops (8, 16 or 64)
  std::optional<int> moe_gemm2_rows;  // DSV4_MOE_GEMM2_ROWS: 64-row weight tiles per GEMM2 CTA (1, 2, 4, 8)
  std::optional<bool> moe_gemm2_resident;  // DSV4_MOE_GEMM2_RESIDENT: 0 = GEMM2's token tile fetched per weight tile
  std::optional<bool> moe_fused_route;  // DSV4_MOE_FUSED_ROUTE: 0 = mxfp4_moe's routing kernel at decode sizes too
  std::optional<bool> moe_gemm1_pairs;  // DSV4_MOE_GEMM1_PAIRS: 1 = mxfp4_moe's GEMM1 on pairs of 64-token tiles
  std::optional<bool> moe_gemm2_pairs;  // DSV4_MOE_GEMM2_PAIRS: 1 = mxfp4_moe's GEMM2 on pairs of 64-token tiles
  std::optional<bool> moe_late_zero;    // DSV4_MOE_LATE_ZERO: 1 = all-remote tokens' zero rows by GEMM1's pair kernel
  bool print_config;                 // DSV4_PRINT_CONFIG=1: each MoE call prints its config to stderr
  // Sparse MQA attention (csrc/attention/sparse_mqa.cu); unset: the library's rule.
  std::optional<bool> attn_priced_splits;  // DSV4_ATTN_PRICED_SPLITS: 0 = the earlier split-count rule
  std::optional<int> attn_splits;  // DSV4_ATTN_SPLITS: this split count instead of the rule's (sweeps), clamped to
                                   // the call's tile pairs (attention::choose_splits, sparse_mqa_splits.h)
  std::optional<bool> attn_pdl;            // DSV4_ATTN_PDL: 0 = the combine launched without PDL
  std::optional<bool> attn_specialize;     // DSV4_ATTN_SPECIALIZE: 0 = the general kernel instance for all
  std::optional<bool> attn_main_pdl;       // DSV4_ATTN_MAIN_PDL: 0 = the main kernel launched without PDL
  std::optional<bool> attn_coop_round;    // DSV4_ATTN_COOP_ROUND: 0 = the producer alone fills round 0
  std::optional<bool> attn_producer_ahead;   // DSV4_ATTN_PRODUCER_AHEAD: 0 = the producer in the cooperative round always
  std::optional<bool> attn_coop_prefetch;  // DSV4_ATTN_COOP_PREFETCH: 0 = round 1's rows not sent to L2 early
  std::optional<bool> attn_first_pv_init;    // DSV4_ATTN_FIRST_PV_INIT: 0 = O cleared in registers per item
  std::optional<bool> attn_row_prefetch;  // DSV4_ATTN_ROW_PREFETCH: 1 = bf16 rows sent to L2 a round ahead
  std::optional<bool> attn_crossover;  // DSV4_ATTN_CROSSOVER: 1 = 128-head fp8 calls in two-CTA clusters
  std::optional<int> attn_ring32;  // DSV4_ATTN_RING32: 1 = 128-head fp8 calls on the two-round ring of 32-key tiles,
                                   // 2 = the same with the producer's loads one half-step ahead, 0 = today's
                                   // kernel; unset: attention::pick_ring32's rule (sparse_mqa_splits.h)
  std::optional<bool> attn_tile_splits;  // DSV4_ATTN_TILE_SPLITS: 1 = the ring's splits at whole tiles (plan_ring32)
};

inline Switches read_switches() {
  auto get = [](const char* name) { return parse_switch(name, std::getenv(name)); };
  Switches s;
  s.moe_ws = get("DSV4_MOE_WS");
  s.moe_splitk = get("DSV4_MOE_SPLITK");
  s.moe_direct_x = get("DSV4_MOE_DIRECT_X");
  s.moe_pdl = get("DSV4_MOE_PDL");
  s.moe_block_n = parse_int_choice("DSV4_MOE_BLOCK_N", std::getenv("DSV4_MOE_BLOCK_N"), {8, 16, 64});
  s.moe_gemm2_rows = parse_int_choice("DSV4_MOE_GEMM2_ROWS", std::getenv("DSV4_MOE_GEMM2_ROWS"), {1, 2, 4, 8});
  s.moe_gemm2_resident = get("DSV4_MOE_GEMM2_RESIDENT");
  s.moe_fused_route = get("DSV4_MOE_FUSED_ROUTE");
  s.moe_gemm1_pairs = get("DSV4_MOE_GEMM1_PAIRS");
  s.moe_gemm2_pairs = get("DSV4_MOE_GEMM2_PAIRS");
  s.moe_late_zero = get("DSV4_MOE_LATE_ZERO");
  s.print_config = get("DSV4_PRINT_CONFIG").value_or(false);
  s.attn_priced_splits = get("DSV4_ATTN_PRICED_SPLITS");
  // Counts up to 16, all within attention::kMaxSplits (sparse_mqa_splits.h asserts it).
  s.attn_splits = parse_int_choice("DSV4_ATTN_SPLITS", std::getenv("DSV4_ATTN_SPLITS"),
                                   {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 12, 16});
  s.attn_pdl = get("DSV4_ATTN_PDL");
  s.attn_specialize = get("DSV4_ATTN_SPECIALIZE");
  s.attn_main_pdl = get("DSV4_ATTN_MAIN_PDL");
  s.attn_coop_round = get("DSV4_ATTN_COOP_ROUND");
  s.attn_producer_ahead = get("DSV4_ATTN_PRODUCER_AHEAD");
  s.attn_coop_prefetch = get("DSV4_ATTN_COOP_PREFETCH");
  s.attn_first_pv_init = get("DSV4_ATTN_FIRST_PV_INIT");
  s.attn_crossover = get("DSV4_ATTN_CROSSOVER");
  s.attn_row_prefetch = get("DSV4_ATTN_ROW_PREFETCH");
  s.attn_ring32 = parse_int_choice("DSV4_ATTN_RING32", std::getenv("DSV4_ATTN_RING32"), {0, 1, 2});
  s.attn_tile_splits = get("DSV4_ATTN_TILE_SPLITS");
  return s;
}

// Read on the first call. A bad value throws from the initializer, which C++ then runs
// again on the next call: the error repeats instead of leaving a half-read state.
inline const Switches& switches() {
  static const Switches s = read_switches();
  return s;
}

}  // namespace env
}  // namespace dsv4
