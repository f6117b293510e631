// Test-only ops outside the public dsv4 op set (library dsv4_testing, defined by
// csrc/testing/poison_smem.cu; this file adds to it):
//   nvfp4_moe_gemm1_debug: the NVFP4 MoE chain up to GEMM1's epilogue, its output read
//     back (CUDA kernel: csrc/moe/nvfp4_moe.cu; tests/test_moe.py);
//   parse_env_switch, env_switches: the parser of csrc/common/env.h on a given value, and
//     the values this process read (tests/test_moe_config.py).
#include <torch/library.h>

#include <optional>
#include <string>
#include <vector>

#include "common/env.h"

namespace dsv4 {
namespace testing {
namespace {

int64_t as_int(std::optional<bool> v) { return v.has_value() ? int64_t(*v) : -1; }

// -1: unset or empty, 0 or 1; any other value raises the error an op call would.
int64_t parse_env_switch(c10::string_view name, std::optional<c10::string_view> value) {
  const std::string n(name);
  if (!value.has_value()) return as_int(env::parse_switch(n.c_str(), nullptr));
  const std::string v(*value);
  return as_int(env::parse_switch(n.c_str(), v.c_str()));
}

// [DSV4_MOE_WS, DSV4_MOE_SPLITK, DSV4_MOE_DIRECT_X, DSV4_MOE_PDL] as this process read
// them once (-1: unset), then DSV4_PRINT_CONFIG (0 or 1).
std::vector<int64_t> env_switches() {
  const env::Switches& s = env::switches();
  return {as_int(s.moe_ws), as_int(s.moe_splitk), as_int(s.moe_direct_x), as_int(s.moe_pdl),
          int64_t(s.print_config)};
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
}
