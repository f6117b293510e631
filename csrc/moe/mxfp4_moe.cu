// C++ entry of the MXFP4 W4A8 MoE: dsv4::mxfp4_moe (CUDA). Laid out as the NVFP4 entry
// (nvfp4_moe.cu): (a) checks, (b) the launch configuration (get_best_config in
// config.h; the kernels are the small-batch path only, 8-token tiles at every M for now;
// DSV4_PRINT_CONFIG=1 prints it), (c) a workspace laid out by one function that counts,
// then carves one allocation (common/workspace.h; sized from shapes only), (d) the
// launch on the current stream: routing (routing.h, the kernels the NVFP4 op runs too)
// -> FP8 quantization of x -> GEMM1 with the SwiGLU + FP8 epilogue -> GEMM2
// (mxfp4_gemm.cuh) -> the weighted combine (routing.h).
// No host sync, no value-dependent allocation: CUDA-graph capturable.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <optional>
#include <string>

#include "common/checks.h"
#include "common/env.h"
#include "common/workspace.h"
#include "moe/config.h"
#include "moe/mxfp4_gemm.cuh"
#include "moe/params.cuh"
#include "moe/routing.h"

namespace dsv4 {
namespace {

namespace w4a8 = moe::w4a8;
using moe::Mxfp4MoeConfig;
using moe::Mxfp4MoeShape;

// ---------------------------------------------------------------------------------
// (a) checks
// ---------------------------------------------------------------------------------

Mxfp4MoeShape check_inputs(const at::Tensor& x, const at::Tensor& topk_ids, const at::Tensor& topk_weights,
                     const at::Tensor& w13, const at::Tensor& w13_scale, const at::Tensor& w2,
                     const at::Tensor& w2_scale, const std::optional<at::Tensor>& expert_map,
                     std::optional<double> swiglu_limit, c10::string_view activation, const at::Tensor& out) {
  const char* prep = " (pass the output of dsv4.prepare_moe_weights(..., activation='fp8'))";
  check_cuda(x, "x");
  check_dtype(x, at::kBFloat16, "x");
  check_dim(x, 2, "x", "[M, K]");
  check_contiguous(x, "x");
  check_aligned(x, 16, "x");
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(K > 0 && K % 128 == 0, "dsv4: the MXFP4 W4A8 CUDA kernels need the hidden size K (x.shape[1]) to be a "
              "positive multiple of 128 (the activation groups), got ", K);
  TORCH_CHECK(activation == "fp8", "dsv4: dsv4::mxfp4_moe runs activation \"fp8\" (W4A8), got \"", activation, "\"");

  check_same_device(topk_ids, x, "topk_ids", "x");
  check_dtype(topk_ids, at::kInt, "topk_ids");
  check_dim(topk_ids, 2, "topk_ids", "[M, k]");
  check_contiguous(topk_ids, "topk_ids");
  TORCH_CHECK(topk_ids.size(0) == M && topk_ids.size(1) >= 1, "dsv4: topk_ids must have shape [M=", M, ", k], got ",
              topk_ids.sizes());
  const int64_t topk = topk_ids.size(1);
  check_same_device(topk_weights, x, "topk_weights", "x");
  check_dtype(topk_weights, at::kFloat, "topk_weights");
  check_contiguous(topk_weights, "topk_weights");
  TORCH_CHECK(topk_weights.dim() == 2 && topk_weights.size(0) == M && topk_weights.size(1) == topk,
              "dsv4: topk_weights must have shape [M=", M, ", k=", topk, "] like topk_ids, got ", topk_weights.sizes());

  for (auto [t, name] : {std::pair{&w13, "w13"}, {&w13_scale, "w13_scale"}, {&w2, "w2"}, {&w2_scale, "w2_scale"}}) {
    check_same_device(*t, x, name, "x");
    check_dtype(*t, at::kByte, name);
    check_dim(*t, 3, name, "[E, rows, cols]");
    check_contiguous(*t, name);
    check_aligned(*t, 16, name);
  }
  const int64_t E = w13.size(0), N = w13.size(1) / 2;
  TORCH_CHECK(E >= 1 && w13.size(1) % 2 == 0 && w13.size(2) * 2 == K, "dsv4: w13 must have shape [E, 2N, K/2 = ",
              K / 2, "]", prep, ", got ", w13.sizes());
  TORCH_CHECK(N >= 64 && N % 64 == 0, "dsv4: the prepared intermediate size N must be a multiple of 64, got ", N, prep);
  TORCH_CHECK(w13_scale.size(0) == E && w13_scale.size(1) == 2 * N && w13_scale.size(2) == K / 32,
              "dsv4: w13_scale must have shape [", E, ", ", 2 * N, ", ", K / 32, "]", prep, ", got ", w13_scale.sizes());
  TORCH_CHECK(w2.size(0) == E && w2.size(1) == K && w2.size(2) == N / 2, "dsv4: w2 must have shape [", E, ", ", K,
              ", ", N / 2, "]", prep, ", got ", w2.sizes());
  TORCH_CHECK(w2_scale.size(0) == E && w2_scale.size(1) == K && w2_scale.size(2) == N / 32,
              "dsv4: w2_scale must have shape [", E, ", ", K, ", ", N / 32, "]", prep, ", got ", w2_scale.sizes());
  int64_t E_global = E;
  if (expert_map.has_value()) {
    check_same_device(*expert_map, x, "expert_map", "x");
    check_dtype(*expert_map, at::kInt, "expert_map");
    check_dim(*expert_map, 1, "expert_map", "[E_global]");
    check_contiguous(*expert_map, "expert_map");
    E_global = expert_map->size(0);
    TORCH_CHECK(E_global >= 1, "dsv4: expert_map must not be empty");
  }
  TORCH_CHECK(!swiglu_limit.has_value() || *swiglu_limit > 0, "dsv4: swiglu_limit must be positive, got ",
              swiglu_limit.value_or(0.0));
  check_same_device(out, x, "out", "x");
  check_dtype(out, at::kBFloat16, "out");
  check_contiguous(out, "out");
  TORCH_CHECK(out.dim() == 2 && out.size(0) == M && out.size(1) == K, "dsv4: out must have shape [M=", M, ", K=", K,
              "], got ", out.sizes());
  return Mxfp4MoeShape{M, K, N, E, E_global, topk};
}

// ---------------------------------------------------------------------------------
// (c) workspace
// ---------------------------------------------------------------------------------

// ints (slot_pos | row_slot | tile_expert | num_tiles | error_flag | group_ready) |
// xq | xs | hq | hs | y. rp: the fields that routing and combine read.
void layout_workspace(Carver& w, moe::MoeParams& rp, w4a8::W4A8Params& p, const Mxfp4MoeShape& c,
                      int64_t max_tiles) {
  const int64_t S = c.M * c.topk, rows = max_tiles * w4a8::kBN, G1 = c.K / 128, G2 = (c.N + 127) / 128;
  rp.slot_pos = w.region<int>(S);
  rp.row_slot = w.next<int>(rows);
  rp.tile_expert = w.next<int>(max_tiles);
  rp.num_tiles = w.next<int>(1);
  rp.error_flag = w.next<int>(1);
  rp.group_ready = w.next<int>(max_tiles);
  p.xq = w.region<uint8_t>(c.M * c.K);
  p.xs = w.region<float>(c.M * G1);
  p.hq = w.region<uint8_t>(rows * c.N);
  p.hs = w.region<float>(rows * G2);
  p.y = w.region<__nv_bfloat16>(rows * c.K);
}

// ---------------------------------------------------------------------------------
// (d) the op: parameters and launch
// ---------------------------------------------------------------------------------

void mxfp4_moe(const at::Tensor& x, const at::Tensor& topk_ids, const at::Tensor& topk_weights, const at::Tensor& w13,
               const at::Tensor& w13_scale, const at::Tensor& w2, const at::Tensor& w2_scale,
               const std::optional<at::Tensor>& expert_map, std::optional<double> swiglu_limit,
               c10::string_view activation, bool ue8m0, const at::Tensor& out) {
  const Mxfp4MoeShape c = check_inputs(x, topk_ids, topk_weights, w13, w13_scale, w2, w2_scale, expert_map,
                                       swiglu_limit, activation, out);
  if (c.M == 0) return;

  const c10::cuda::CUDAGuard guard(x.device());
  cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const env::Switches& sw = env::switches();
  const Mxfp4MoeConfig cfg = moe::get_best_config(c);

  moe::MoeParams rp{};  // the fields routing and combine read
  rp.M = int(c.M);
  rp.topk = int(c.topk);
  rp.E = int(c.E);
  rp.E_global = int(c.E_global);
  rp.K = int(c.K);
  rp.N = int(c.N);
  rp.block_n = w4a8::kBN;
  rp.max_tiles = cfg.max_tiles;
  rp.max_rows = cfg.max_tiles * w4a8::kBN;
  rp.topk_ids = topk_ids.data_ptr<int>();
  rp.topk_weights = topk_weights.data_ptr<float>();
  rp.expert_map = expert_map.has_value() ? expert_map->data_ptr<int>() : nullptr;

  w4a8::W4A8Params p{};
  at::Tensor ws;
  const int64_t ws_bytes = count_then_carve([&](Carver& w) { layout_workspace(w, rp, p, c, cfg.max_tiles); },
                                            [&](int64_t bytes) {
                                              ws = at::empty({bytes}, x.options().dtype(at::kByte));
                                              return ws.data_ptr<uint8_t>();
                                            });
  if (sw.print_config) moe::print_config(c, cfg, ws_bytes);

  p.M = int(c.M);
  p.topk = int(c.topk);
  p.K = int(c.K);
  p.N = int(c.N);
  p.ue8m0 = ue8m0 ? 1 : 0;
  p.has_limit = swiglu_limit.has_value() ? 1 : 0;
  p.swiglu_limit = swiglu_limit.has_value() ? float(*swiglu_limit) : 0.0f;
  p.row_slot = rp.row_slot;
  p.tile_expert = rp.tile_expert;
  p.num_tiles = rp.num_tiles;
  p.x = reinterpret_cast<const __nv_bfloat16*>(x.data_ptr());
  p.w13 = w13.data_ptr<uint8_t>();
  p.w13_scale = w13_scale.data_ptr<uint8_t>();
  p.w2 = w2.data_ptr<uint8_t>();
  p.w2_scale = w2_scale.data_ptr<uint8_t>();
  rp.y = p.y;
  rp.out = reinterpret_cast<__nv_bfloat16*>(out.data_ptr());

  moe::launch_routing(rp, false, stream);  // one CTA
  w4a8::launch_w4a8_decode(p, cfg.max_tiles, stream);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  moe::launch_combine(rp, cfg.combine_ctas, false, stream);
}

}  // namespace
}  // namespace dsv4

TORCH_LIBRARY_IMPL(dsv4, CUDA, m) { m.impl("mxfp4_moe", &dsv4::mxfp4_moe); }
