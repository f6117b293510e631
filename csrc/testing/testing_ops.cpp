// Test-only ops outside the public dsv4 op set (library dsv4_testing, defined by
// csrc/testing/poison_smem.cu; this file adds to it):
//   nvfp4_moe_gemm1_debug: the NVFP4 MoE chain up to GEMM1's epilogue, its output read
//     back (CUDA kernel: csrc/moe/nvfp4_moe.cu; tests/test_moe.py);
//   parse_env_switch, env_switches: the parser of csrc/common/env.h on a given value, and
//     the values this process read (tests/test_moe_config.py);
//   nvfp4_moe_config, mxfp4_moe_config: the MoE ops' get_best_config (csrc/moe/config.h)
//     on given shapes, device facts and overrides, no device needed
//     (tests/test_moe_config.py).
#include <torch/library.h>

#include <optional>
#include <string>
#include <vector>

#include "common/env.h"
#include "moe/config.h"

namespace dsv4 {
namespace testing {
namespace {

int64_t as_int(std::optional<bool> v) { return v.has_value() ? int64_t(*v) : -1; }

std::optional<bool> as_switch(int64_t v) { return v < 0 ? std::nullopt : std::optional<bool>(v != 0); }

// A token tile override: -1 unset, else 8, 16 or 64 (DSV4_MOE_BLOCK_N's values).
std::optional<int> as_block_n(int64_t v, const char* op) {
  if (v < 0) return std::nullopt;
  TORCH_CHECK(v == 8 || v == 16 || v == 64, "dsv4_testing::", op, ": the block_n override is 8, 16, 64 or -1, got ", v);
  return int(v);
}

// A GEMM2 rows override: -1 unset, else 1, 2, 4 or 8 (DSV4_MOE_GEMM2_ROWS's values).
std::optional<int> as_gemm2_rows(int64_t v, const char* op) {
  if (v < 0) return std::nullopt;
  TORCH_CHECK(v == 1 || v == 2 || v == 4 || v == 8, "dsv4_testing::", op, ": the gemm2_rows override is 1, 2, 4, 8 or -1, got ",
              v);
  return int(v);
}

// -1: unset or empty, 0 or 1; any other value raises the error an op call would.
int64_t parse_env_switch(c10::string_view name, std::optional<c10::string_view> value) {
  const std::string n(name);
  if (!value.has_value()) return as_int(env::parse_switch(n.c_str(), nullptr));
  const std::string v(*value);
  return as_int(env::parse_switch(n.c_str(), v.c_str()));
}

// [DSV4_MOE_WS, DSV4_MOE_SPLITK, DSV4_MOE_DIRECT_X, DSV4_MOE_PDL] as this process read
// them once (-1: unset), then DSV4_PRINT_CONFIG (0 or 1), then DSV4_MOE_BLOCK_N,
// DSV4_MOE_GEMM2_ROWS, DSV4_MOE_GEMM2_RESIDENT and DSV4_MOE_FUSED_ROUTE (-1: unset).
std::vector<int64_t> env_switches() {
  const env::Switches& s = env::switches();
  return {as_int(s.moe_ws), as_int(s.moe_splitk), as_int(s.moe_direct_x), as_int(s.moe_pdl),
          int64_t(s.print_config), int64_t(s.moe_block_n.value_or(-1)), int64_t(s.moe_gemm2_rows.value_or(-1)),
          as_int(s.moe_gemm2_resident), as_int(s.moe_fused_route)};
}

// get_best_config of dsv4::nvfp4_moe.
//   shape: [M, K, N, E, E_global, topk]; nvfp4: activation "nvfp4" (else "bf16");
//   device: [sms, then per token tile 8, 16, 64 the resident split-K GEMM1, split-K GEMM2
//     and classic GEMM1 CTAs per SM, then ws_grid2] (11 values, DeviceFacts);
//   overrides: [DSV4_MOE_WS, DSV4_MOE_SPLITK, DSV4_MOE_DIRECT_X, DSV4_MOE_PDL,
//     DSV4_MOE_BLOCK_N, DSV4_MOE_GEMM2_ROWS], -1 = unset.
// Returns [block_n, max_tiles, multi_cta_route, splitk, gemm1_ctas, gemm2_ctas, sk_ctas,
// direct_x, ws, cluster, ws_ctas, pdl, gather_ctas, combine_ctas, gemm2_rows]
// (Nvfp4MoeConfig's fields in order); an error get_best_config raises comes through as a RuntimeError.
std::vector<int64_t> nvfp4_moe_config(c10::IntArrayRef shape, bool nvfp4, int64_t cta_mode, c10::IntArrayRef device,
                                      c10::IntArrayRef overrides) {
  TORCH_CHECK(shape.size() == 6 && device.size() == 11 && overrides.size() == 6,
              "dsv4_testing::nvfp4_moe_config: shape has 6 values, device 11, overrides 6");
  const moe::Nvfp4MoeShape c{shape[0], shape[1], shape[2], shape[3], shape[4], shape[5], nvfp4};
  moe::DeviceFacts d{};
  d.sms = int(device[0]);
  for (int t = 0; t < 3; ++t)
    d.occ[t] = moe::GemmOccupancy{int(device[1 + 3 * t]), int(device[2 + 3 * t]), int(device[3 + 3 * t])};
  d.ws_grid2 = int(device[10]);
  env::Switches o{};
  o.moe_ws = as_switch(overrides[0]);
  o.moe_splitk = as_switch(overrides[1]);
  o.moe_direct_x = as_switch(overrides[2]);
  o.moe_pdl = as_switch(overrides[3]);
  o.moe_block_n = as_block_n(overrides[4], "nvfp4_moe_config");
  o.moe_gemm2_rows = as_gemm2_rows(overrides[5], "nvfp4_moe_config");
  const moe::Nvfp4MoeConfig g = moe::get_best_config(c, cta_mode, d, o);
  return {g.block_n, g.max_tiles, g.multi_cta_route, g.splitk,      g.gemm1_ctas,   g.gemm2_ctas, g.sk_ctas, g.direct_x,
          g.ws,      g.cluster,   g.ws_ctas,         g.pdl,         g.gather_ctas,  g.combine_ctas, g.gemm2_rows};
}

// get_best_config of dsv4::mxfp4_moe.
//   shape: [M, K, N, E, E_global, topk];
//   device: [sms, then per token tile 8, 16, 64 the resident split-K GEMM1, split-K GEMM2
//     and classic GEMM1 CTAs per SM] (10 values, Mxfp4DeviceFacts);
//   overrides: [DSV4_MOE_SPLITK, DSV4_MOE_PDL, DSV4_MOE_BLOCK_N, DSV4_MOE_GEMM2_ROWS,
//     DSV4_MOE_GEMM2_RESIDENT, DSV4_MOE_FUSED_ROUTE, DSV4_MOE_GEMM1_PAIRS, DSV4_MOE_GEMM2_PAIRS,
//     DSV4_MOE_LATE_ZERO],
//     -1 = unset.
// Returns [block_n, max_tiles, multi_cta_route, splitk, gemm1_ctas, gemm2_ctas, sk_ctas,
// pdl, quant_ctas, gemm2_rows, gemm2_resident, fused_route, grid_tiles, gemm1_pairs,
// grid_pairs, gemm2_pairs, late_zero] (Mxfp4MoeConfig's fields in order).
std::vector<int64_t> mxfp4_moe_config(c10::IntArrayRef shape, c10::IntArrayRef device, c10::IntArrayRef overrides) {
  TORCH_CHECK(shape.size() == 6 && device.size() == 10 && overrides.size() == 9,
              "dsv4_testing::mxfp4_moe_config: shape has 6 values, device 10, overrides 9");
  const moe::Mxfp4MoeShape c{shape[0], shape[1], shape[2], shape[3], shape[4], shape[5]};
  moe::Mxfp4DeviceFacts d{};
  d.sms = int(device[0]);
  for (int t = 0; t < 3; ++t)
    d.occ[t] = moe::GemmOccupancy{int(device[1 + 3 * t]), int(device[2 + 3 * t]), int(device[3 + 3 * t])};
  env::Switches o{};
  o.moe_splitk = as_switch(overrides[0]);
  o.moe_pdl = as_switch(overrides[1]);
  o.moe_block_n = as_block_n(overrides[2], "mxfp4_moe_config");
  o.moe_gemm2_rows = as_gemm2_rows(overrides[3], "mxfp4_moe_config");
  o.moe_gemm2_resident = as_switch(overrides[4]);
  o.moe_fused_route = as_switch(overrides[5]);
  o.moe_gemm1_pairs = as_switch(overrides[6]);
  o.moe_gemm2_pairs = as_switch(overrides[7]);
  o.moe_late_zero = as_switch(overrides[8]);
  const moe::Mxfp4MoeConfig g = moe::get_best_config(c, d, o);
  return {g.block_n,    g.max_tiles, g.multi_cta_route, g.splitk,     g.gemm1_ctas,     g.gemm2_ctas,
          g.sk_ctas,    g.pdl,       g.quant_ctas,      g.gemm2_rows, g.gemm2_resident, g.fused_route,
          g.grid_tiles, g.gemm1_pairs, g.grid_pairs, g.gemm2_pairs, g.late_zero};
}

}  // namespace
}  // namespace testing
}  // namespace dsv4

TORCH_LIBRARY_FRAGMENT(dsv4_testing, m) {
  m.def(
      "nvfp4_moe_gemm1_debug(Tensor x, Tensor topk_ids, Tensor w13, Tensor w13_scale, "
      "Tensor w13_scale_2, Tensor? a13_scale, Tensor? a2_scale, Tensor? expert_map, "
      "float? swiglu_limit, str activation, int cta_mode) -> (Tensor, Tensor, Tensor, Tensor)");
  // No tensor argument: the function is the op's only kernel.
  m.def("parse_env_switch(str name, str? value) -> int", &dsv4::testing::parse_env_switch);
  m.def("env_switches() -> int[]", &dsv4::testing::env_switches);
  m.def("nvfp4_moe_config(int[] shape, bool nvfp4, int cta_mode, int[] device, int[] overrides) -> int[]",
        &dsv4::testing::nvfp4_moe_config);
  m.def("mxfp4_moe_config(int[] shape, int[] device, int[] overrides) -> int[]", &dsv4::testing::mxfp4_moe_config);
}
