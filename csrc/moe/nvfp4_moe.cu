// C++ entries of the NVFP4 MoE: dsv4::nvfp4_moe and the test-only
// dsv4_testing::nvfp4_moe_gemm1_debug (schema in csrc/testing/testing_ops.cpp). A call is
// four steps, one section each below:
//   (a) checks: every argument validated, a `dsv4:` error naming it otherwise;
//   (b) kernel choice: get_best_config (config.h), a pure function of the shapes, what
//       is known about the device (device_facts below, queried once per device) and the
//       development overrides (csrc/common/env.h); DSV4_PRINT_CONFIG=1 prints its result;
//   (c) workspace: one layout function, run once to count and once to carve a single
//       allocation (worst case M*topk + experts*(block_n-1) padded rows, from shapes only);
//   (d) launch: routing -> gather (unless GEMM1 reads x itself) -> GEMM1 -> GEMM2 ->
//       combine on the current stream; routing, gather and combine through routing.h,
//       the GEMMs of nvfp4_gemm.cuh (decode tiles, split-K) and nvfp4_gemm_ws.cuh
//       (prefill) from here.
// No host sync, no value-dependent allocation: CUDA-graph capturable.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <mutex>
#include <optional>
#include <string>

#include "common/checks.h"
#include "common/dynamic_smem.h"  // kMaxDevices
#include "common/env.h"
#include "common/launch.h"
#include "common/workspace.h"
#include "moe/config.h"
#include "moe/nvfp4_gemm.cuh"
#include "moe/nvfp4_gemm_ws.cuh"
#include "moe/routing.h"

namespace dsv4 {
namespace {

using moe::DeviceFacts;
using moe::GemmOccupancy;
using moe::MoeParams;
using moe::Nvfp4MoeConfig;
using moe::Nvfp4MoeShape;

// ---------------------------------------------------------------------------------
// (a) checks
// ---------------------------------------------------------------------------------

void check_act_scale(const std::optional<at::Tensor>& s, const char* name, const at::Tensor& x, int64_t E) {
  TORCH_CHECK(s.has_value(), "dsv4: ", name, " is required when activation=\"nvfp4\"");
  check_same_device(*s, x, name, "x");
  check_dtype(*s, at::kFloat, name);
  check_contiguous(*s, name);
  TORCH_CHECK(s->numel() == 1 || (s->dim() == 1 && s->size(0) == E), "dsv4: ", name,
              " must hold 1 element or have shape [", E, "] (one per local expert), got shape ", s->sizes());
}

Nvfp4MoeShape check_inputs(const at::Tensor& x, const at::Tensor& topk_ids, const at::Tensor& topk_weights,
                     const at::Tensor& w13, const at::Tensor& w13_scale, const at::Tensor& w13_scale_2,
                     const at::Tensor& w2, const at::Tensor& w2_scale, const at::Tensor& w2_scale_2,
                     const std::optional<at::Tensor>& a13_scale, const std::optional<at::Tensor>& a2_scale,
                     const std::optional<at::Tensor>& expert_map, c10::string_view activation,
                     int64_t cta_mode, bool need_w2) {
  Nvfp4MoeShape c{};
  check_cuda(x, "x");
  check_dtype(x, at::kBFloat16, "x");
  check_dim(x, 2, "x", "[M, K]");
  check_contiguous(x, "x");
  c.M = x.size(0);
  c.K = x.size(1);
  TORCH_CHECK(c.K > 0 && c.K % 64 == 0, "dsv4: x.shape[1] (K, hidden size) must be a positive multiple of 64, got ", c.K);
  check_aligned(x, 16, "x");

  check_same_device(topk_ids, x, "topk_ids", "x");
  check_dtype(topk_ids, at::kInt, "topk_ids");
  check_dim(topk_ids, 2, "topk_ids", "[M, k]");
  check_contiguous(topk_ids, "topk_ids");
  TORCH_CHECK(topk_ids.size(0) == c.M, "dsv4: topk_ids must have shape [M=", c.M, ", k], got ", topk_ids.sizes());
  c.topk = topk_ids.size(1);
  TORCH_CHECK(c.topk >= 1, "dsv4: topk_ids must have at least one column (k >= 1), got ", topk_ids.sizes());
  check_same_device(topk_weights, x, "topk_weights", "x");
  check_dtype(topk_weights, at::kFloat, "topk_weights");
  check_contiguous(topk_weights, "topk_weights");
  TORCH_CHECK(topk_weights.dim() == 2 && topk_weights.size(0) == c.M && topk_weights.size(1) == c.topk,
              "dsv4: topk_weights must have shape [M=", c.M, ", k=", c.topk, "] like topk_ids, got ",
              topk_weights.sizes());

  const char* prep = " (pass the output of dsv4.prepare_nvfp4_moe_weights)";
  check_same_device(w13, x, "w13", "x");
  check_dtype(w13, at::kByte, "w13");
  TORCH_CHECK(w13.dim() == 4 && w13.size(3) == moe::kCodeTileBytes, "dsv4: w13 must be the prepared layout [E, 2N/64, K/64, 2048]",
              prep, ", got shape ", w13.sizes());
  check_contiguous(w13, "w13");
  c.E = w13.size(0);
  c.N = w13.size(1) * 32;
  TORCH_CHECK(c.E >= 1, "dsv4: w13 must hold at least one expert");
  TORCH_CHECK(w13.size(2) * 64 == c.K, "dsv4: w13 has K/64 = ", w13.size(2), " tiles but x has K = ", c.K);
  TORCH_CHECK(c.N % 64 == 0, "dsv4: the intermediate size N = ", c.N, " must be a multiple of 64");
  check_same_device(w13_scale, x, "w13_scale", "x");
  check_dtype(w13_scale, at::kByte, "w13_scale");
  check_contiguous(w13_scale, "w13_scale");
  TORCH_CHECK(w13_scale.dim() == 4 && w13_scale.size(0) == c.E && w13_scale.size(1) == w13.size(1) &&
                  w13_scale.size(2) == w13.size(2) && w13_scale.size(3) == moe::kScaleTileBytes,
              "dsv4: w13_scale must have the prepared shape [", c.E, ", ", w13.size(1), ", ", w13.size(2), ", 256]", prep,
              ", got ", w13_scale.sizes());
  check_same_device(w13_scale_2, x, "w13_scale_2", "x");
  check_dtype(w13_scale_2, at::kFloat, "w13_scale_2");
  check_contiguous(w13_scale_2, "w13_scale_2");
  TORCH_CHECK(w13_scale_2.dim() == 2 && w13_scale_2.size(0) == c.E && w13_scale_2.size(1) == 2,
              "dsv4: w13_scale_2 must have the prepared shape [", c.E, ", 2]", prep, ", got ", w13_scale_2.sizes());
  if (need_w2) {
    check_same_device(w2, x, "w2", "x");
    check_dtype(w2, at::kByte, "w2");
    check_contiguous(w2, "w2");
    TORCH_CHECK(w2.dim() == 4 && w2.size(0) == c.E && w2.size(1) * 64 == c.K && w2.size(2) * 64 == c.N &&
                    w2.size(3) == moe::kCodeTileBytes,
                "dsv4: w2 must have the prepared shape [", c.E, ", ", c.K / 64, ", ", c.N / 64, ", 2048]", prep,
                ", got ", w2.sizes());
    check_same_device(w2_scale, x, "w2_scale", "x");
    check_dtype(w2_scale, at::kByte, "w2_scale");
    check_contiguous(w2_scale, "w2_scale");
    TORCH_CHECK(w2_scale.dim() == 4 && w2_scale.size(0) == c.E && w2_scale.size(1) * 64 == c.K &&
                    w2_scale.size(2) * 64 == c.N && w2_scale.size(3) == moe::kScaleTileBytes,
                "dsv4: w2_scale must have the prepared shape [", c.E, ", ", c.K / 64, ", ", c.N / 64, ", 256]", prep,
                ", got ", w2_scale.sizes());
    check_same_device(w2_scale_2, x, "w2_scale_2", "x");
    check_dtype(w2_scale_2, at::kFloat, "w2_scale_2");
    check_contiguous(w2_scale_2, "w2_scale_2");
    TORCH_CHECK(w2_scale_2.dim() == 1 && w2_scale_2.size(0) == c.E, "dsv4: w2_scale_2 must have shape [", c.E,
                "], got ", w2_scale_2.sizes());
  }

  TORCH_CHECK(activation == "bf16" || activation == "nvfp4", "dsv4: activation must be \"bf16\" or \"nvfp4\", got \"",
              std::string(activation), "\"");
  c.nvfp4 = activation == "nvfp4";
  if (c.nvfp4) {
    check_act_scale(a13_scale, "a13_scale", x, c.E);
    check_act_scale(a2_scale, "a2_scale", x, c.E);
  }
  c.E_global = c.E;
  if (expert_map.has_value()) {
    check_same_device(*expert_map, x, "expert_map", "x");
    check_dtype(*expert_map, at::kInt, "expert_map");
    check_dim(*expert_map, 1, "expert_map", "[E_global]");
    check_contiguous(*expert_map, "expert_map");
    c.E_global = expert_map->size(0);
    TORCH_CHECK(c.E_global >= 1, "dsv4: expert_map must not be empty");
  }
  TORCH_CHECK(cta_mode == 0 || cta_mode == 1 || cta_mode == 2, "dsv4: cta_mode must be 0 (auto), 1 or 2, got ", cta_mode);
  TORCH_CHECK(c.M * c.topk < (int64_t(1) << 30), "dsv4: M * k = ", c.M * c.topk, " slots is too large");
  return c;
}

// ---------------------------------------------------------------------------------
// (b) kernel choice: the device facts it reads (the rules: config.h)
// ---------------------------------------------------------------------------------

// K steps of shared-memory ring per token-tile width, for the classic grid and the
// split-K grid. Decode tiles (mma.sync, two ring slots): the split-K grid's few CTAs run
// long K loops and gain from 8-step slots; the classic grid, with up to 8 CTAs per SM,
// from 4-step slots that leave room for more CTAs
// (docs/perf-history/2026-12-01-nvfp4-moe-decode-mma-sync.md).
template <int BN>
struct RingStages {
  static constexpr int kClassic = BN <= 16 ? 8 : 6;
  static constexpr int kSplitK = BN <= 16 ? 16 : 6;
};

// The one-warpgroup GEMM kernels of one token tile (classic and split-K grids): the
// shared-memory opt-in and how many CTAs fit per SM.
template <int BN>
GemmOccupancy gemm_setup() {
  constexpr int STAGES = RingStages<BN>::kClassic, SK_STAGES = RingStages<BN>::kSplitK;
  using S = moe::GemmSmem<BN, STAGES>;
  using SK = moe::GemmSmem<BN, SK_STAGES>;
  auto k1 = moe::moe_gemm_splitk_kernel<BN, SK_STAGES, true>;
  auto k2 = moe::moe_gemm_splitk_kernel<BN, SK_STAGES, false>;
  for (auto k : {k1, k2})
    C10_CUDA_CHECK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, SK::kBytes));
  for (auto k : {moe::moe_gemm_kernel<BN, STAGES, true>, moe::moe_gemm_kernel<BN, STAGES, false>,
                 moe::moe_gemm_kernel<BN, STAGES, true, true>})
    C10_CUDA_CHECK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, S::kBytes));
  if constexpr (BN == 64) {
    for (auto k : {moe::moe_gemm2_resident_kernel<2>, moe::moe_gemm2_resident_kernel<4>,
                   moe::moe_gemm2_resident_kernel<8>})
      C10_CUDA_CHECK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                          moe::ResidentSmem::bytes(moe::ResidentSmem::kMaxSteps)));
  }
  GemmOccupancy o{};
  C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&o.gemm1, k1, moe::kThreads, SK::kBytes));
  C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&o.gemm2, k2, moe::kThreads, SK::kBytes));
  C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&o.classic1, moe::moe_gemm_kernel<BN, STAGES, true>,
                                                               moe::kThreads, S::kBytes));
  TORCH_CHECK(o.gemm1 > 0 && o.gemm2 > 0 && o.classic1 > 0, "dsv4: nvfp4_moe GEMM kernels do not fit on this device");
  return o;
}

// The prefill kernels (nvfp4_gemm_ws.cuh): the shared-memory opt-in, and the CTAs of the
// persistent grid in 2-CTA mode: as many clusters as can be resident at once (fewer
// than SMs / 2 when a GPC has an odd number of free SMs; a cluster that does not fit
// would run after the others, doubling the time; 0 when none fits). 1-CTA mode runs
// one CTA per SM.
int ws_setup(int sms) {
  for (auto k : {moe::moe_gemm_ws_kernel<true, 1>, moe::moe_gemm_ws_kernel<true, 1, true>,
                 moe::moe_gemm_ws_kernel<false, 1>, moe::moe_gemm_ws_kernel<true, 2>,
                 moe::moe_gemm_ws_kernel<false, 2>})
    C10_CUDA_CHECK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, moe::WsConfig::kBytes));
  return std::min(max_cluster_ctas(moe::moe_gemm_ws_kernel<true, 2>, sms, moe::WsConfig::kThreads,
                                   moe::WsConfig::kBytes, 2),
                  sms / 2 * 2);
}

// Once per device (the shared-memory opt-in is per device): set up every GEMM kernel
// and record what the kernel choice reads.
const DeviceFacts& device_facts() {
  static std::once_flag once[kMaxDevices];
  static DeviceFacts facts[kMaxDevices];
  int dev = 0;
  C10_CUDA_CHECK(cudaGetDevice(&dev));
  TORCH_CHECK(dev >= 0 && dev < kMaxDevices, "dsv4: nvfp4_moe runs on CUDA devices 0..", kMaxDevices - 1,
              ", got device ", dev);
  std::call_once(once[dev], [dev] {
    DeviceFacts f{};
    f.sms = at::cuda::getDeviceProperties(dev)->multiProcessorCount;
    f.occ[0] = gemm_setup<8>();
    f.occ[1] = gemm_setup<16>();
    f.occ[2] = gemm_setup<64>();
    f.ws_grid2 = ws_setup(f.sms);
    facts[dev] = f;
  });
  return facts[dev];
}

// ---------------------------------------------------------------------------------
// (c) parameters and workspace
// ---------------------------------------------------------------------------------

// The workspace layout, for counting and for carving (common/workspace.h): one region
// of ints (slot_pos | row_slot | tile_expert | num_tiles | error_flag | route_counts |
// route_tile_off | sk_count | group_tile | num_groups | group_ready; error_flag and
// route_counts adjacent: one memset zeroes both), then xg | h | [hq | hs] | [y] |
// [split-K partials].
void layout_workspace(Carver& w, MoeParams& p, const Nvfp4MoeShape& c, const Nvfp4MoeConfig& cfg, bool full) {
  const int64_t S = c.M * c.topk, rows = p.max_rows;
  p.slot_pos = w.region<int>(S);
  p.row_slot = w.next<int>(rows);
  p.tile_expert = w.next<int>(cfg.max_tiles);
  p.num_tiles = w.next<int>(1);
  p.error_flag = w.next<int>(1);
  if (cfg.multi_cta_route) {
    p.route_counts = w.next<int>(c.E);
    p.route_tile_off = w.next<int>(c.E + 1);
  }
  p.sk_count = w.next<int>(2 * int64_t(cfg.sk_ctas));
  p.group_tile = w.next<int>(cfg.max_tiles);
  p.num_groups = w.next<int>(1);
  p.group_ready = w.next<int>(cfg.max_tiles);
  p.xg = cfg.direct_x ? nullptr : w.region<__nv_bfloat16>(rows * c.K);
  p.h = w.region<__nv_bfloat16>(rows * c.N);
  if (c.nvfp4) {
    p.hq = w.region<uint8_t>(rows * c.N / 2);
    p.hs = w.region<__nv_fp8_e4m3>(rows * c.N / 16);
  }
  if (full) p.y = w.region<__nv_bfloat16>(rows * c.K);
  if (cfg.splitk) p.sk_partial = w.region<float>(2 * int64_t(cfg.sk_ctas) * moe::kTileRows * cfg.block_n);
}

// Fills the kernel parameters and returns the workspace they point into (one allocation
// per call: fewer allocator calls per step).
at::Tensor fill_params(MoeParams& p, const Nvfp4MoeShape& c, const Nvfp4MoeConfig& cfg, const at::Tensor& x,
                       const at::Tensor& topk_ids, const at::Tensor& topk_weights, const at::Tensor& w13,
                       const at::Tensor& w13_scale, const at::Tensor& w13_scale_2, const at::Tensor* w2,
                       const at::Tensor* w2_scale, const at::Tensor* w2_scale_2,
                       const std::optional<at::Tensor>& a13_scale, const std::optional<at::Tensor>& a2_scale,
                       const std::optional<at::Tensor>& expert_map, std::optional<double> swiglu_limit, bool full) {
  p = MoeParams{};
  p.M = int(c.M);
  p.topk = int(c.topk);
  p.E = int(c.E);
  p.E_global = int(c.E_global);
  p.K = int(c.K);
  p.N = int(c.N);
  p.block_n = cfg.block_n;
  p.max_tiles = cfg.max_tiles;
  p.max_rows = cfg.max_tiles * cfg.block_n;
  p.splitk = cfg.splitk ? 1 : 0;
  p.sk_ctas = cfg.sk_ctas;
  p.direct_x = cfg.direct_x ? 1 : 0;
  p.ws = cfg.ws ? 1 : 0;

  at::Tensor ws;
  count_then_carve([&](Carver& w) { layout_workspace(w, p, c, cfg, full); },
                   [&](int64_t bytes) {
                     ws = at::empty({bytes}, x.options().dtype(at::kByte));
                     return ws.data_ptr<uint8_t>();
                   });

  p.x = reinterpret_cast<const __nv_bfloat16*>(x.data_ptr());
  p.topk_ids = topk_ids.data_ptr<int>();
  p.topk_weights = topk_weights.defined() ? topk_weights.data_ptr<float>() : nullptr;
  p.expert_map = expert_map.has_value() ? expert_map->data_ptr<int>() : nullptr;
  p.w13 = w13.data_ptr<uint8_t>();
  p.w13_scale = reinterpret_cast<const uint8_t*>(w13_scale.data_ptr());
  p.w13_scale_2 = w13_scale_2.data_ptr<float>();
  if (w2 != nullptr) {
    p.w2 = w2->data_ptr<uint8_t>();
    p.w2_scale = reinterpret_cast<const uint8_t*>(w2_scale->data_ptr());
    p.w2_scale_2 = w2_scale_2->data_ptr<float>();
  }
  p.act_nvfp4 = c.nvfp4 ? 1 : 0;
  if (c.nvfp4) {
    p.a13_scale = a13_scale->data_ptr<float>();
    p.a2_scale = a2_scale->data_ptr<float>();
    p.a13_per_expert = a13_scale->numel() > 1 ? 1 : 0;
    p.a2_per_expert = a2_scale->numel() > 1 ? 1 : 0;
  }
  p.has_limit = swiglu_limit.has_value() ? 1 : 0;
  p.swiglu_limit = swiglu_limit.has_value() ? float(*swiglu_limit) : 0.0f;
  return ws;
}

// ---------------------------------------------------------------------------------
// (d) launch
// ---------------------------------------------------------------------------------

// Persistent prefill GEMMs (a whole number of clusters).
void launch_ws_gemms(const Nvfp4MoeConfig& cfg, const MoeParams& p, bool gemm2, cudaStream_t stream) {
  using C = moe::WsConfig;
  const dim3 grid(unsigned(cfg.ws_ctas));
  auto k1 = cfg.cluster == 2 ? moe::moe_gemm_ws_kernel<true, 2>
            : cfg.direct_x    ? moe::moe_gemm_ws_kernel<true, 1, true>
                              : moe::moe_gemm_ws_kernel<true, 1>;
  auto k2 = cfg.cluster == 2 ? moe::moe_gemm_ws_kernel<false, 2> : moe::moe_gemm_ws_kernel<false, 1>;
  launch_kernel(k1, grid, C::kThreads, C::kBytes, stream, cfg.pdl, p, cfg.cluster);
  // Always programmatic: GEMM2 overlaps GEMM1's tail (see moe_gemm_ws_kernel).
  if (gemm2) launch_kernel(k2, grid, C::kThreads, C::kBytes, stream, true, p, cfg.cluster);
}

template <int BN>
void launch_gemms(const Nvfp4MoeConfig& cfg, const MoeParams& p, bool gemm2, cudaStream_t stream) {
  constexpr int STAGES = RingStages<BN>::kClassic, SK_STAGES = RingStages<BN>::kSplitK;
  using S = moe::GemmSmem<BN, STAGES>;
  using SK = moe::GemmSmem<BN, SK_STAGES>;
  if (cfg.splitk) {
    launch_kernel(moe::moe_gemm_splitk_kernel<BN, SK_STAGES, true>, dim3(unsigned(cfg.gemm1_ctas)),
                           moe::kThreads, SK::kBytes, stream, cfg.pdl, p);
    if (gemm2)
      launch_kernel(moe::moe_gemm_splitk_kernel<BN, SK_STAGES, false>, dim3(unsigned(cfg.gemm2_ctas)),
                             moe::kThreads, SK::kBytes, stream, cfg.pdl, p);
    return;
  }
  const dim3 g1(unsigned(2 * p.N / moe::kTileRows), unsigned(p.max_tiles));
  const dim3 g2(unsigned(p.K / moe::kTileRows), unsigned(p.max_tiles));
  // x rows read by GEMM1 at 64-token tiles: its own instance (see gemm_segment's kX)
  auto k1 = cfg.direct_x ? moe::moe_gemm_kernel<BN, STAGES, true, true> : moe::moe_gemm_kernel<BN, STAGES, true>;
  launch_kernel(k1, g1, moe::kThreads, S::kBytes, stream, cfg.pdl, p);
  if (!gemm2) return;
  if constexpr (BN == 64) {
    if (cfg.gemm2_rows > 1) {  // a resident token tile, gemm2_rows weight-row tiles per CTA
      const dim3 gr(unsigned(p.K / moe::kTileRows / cfg.gemm2_rows), unsigned(p.max_tiles));
      const int bytes = moe::ResidentSmem::bytes(p.N / moe::kTileK);
      auto k = cfg.gemm2_rows == 2 ? moe::moe_gemm2_resident_kernel<2>
               : cfg.gemm2_rows == 4 ? moe::moe_gemm2_resident_kernel<4>
                                     : moe::moe_gemm2_resident_kernel<8>;
      launch_kernel(k, gr, moe::kThreads, bytes, stream, cfg.pdl, p);
      return;
    }
  }
  launch_kernel(moe::moe_gemm_kernel<BN, STAGES, false>, g2, moe::kThreads, S::kBytes, stream, cfg.pdl, p);
}

// The chain on the current stream; with full unset it stops after GEMM1 (debug op).
void launch_chain(const Nvfp4MoeConfig& cfg, const MoeParams& p, bool full) {
  cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  moe::launch_routing(p, cfg.multi_cta_route, stream);
  if (!cfg.direct_x) moe::launch_gather(p, cfg.gather_ctas, cfg.pdl, stream);
  if (cfg.ws) {
    launch_ws_gemms(cfg, p, full, stream);
  } else {
    switch (cfg.block_n) {
      case 8: launch_gemms<8>(cfg, p, full, stream); break;
      case 16: launch_gemms<16>(cfg, p, full, stream); break;
      default: launch_gemms<64>(cfg, p, full, stream); break;
    }
  }
  if (!full) return;
  moe::launch_combine(p, cfg.combine_ctas, cfg.pdl, stream);
}

// ---------------------------------------------------------------------------------
// The ops
// ---------------------------------------------------------------------------------

void nvfp4_moe(const at::Tensor& x, const at::Tensor& topk_ids, const at::Tensor& topk_weights, const at::Tensor& w13,
               const at::Tensor& w13_scale, const at::Tensor& w13_scale_2, const at::Tensor& w2,
               const at::Tensor& w2_scale, const at::Tensor& w2_scale_2, const std::optional<at::Tensor>& a13_scale,
               const std::optional<at::Tensor>& a2_scale, const std::optional<at::Tensor>& expert_map,
               std::optional<double> swiglu_limit, c10::string_view activation, int64_t cta_mode, at::Tensor& out) {
  const Nvfp4MoeShape c = check_inputs(x, topk_ids, topk_weights, w13, w13_scale, w13_scale_2, w2, w2_scale, w2_scale_2,
                                 a13_scale, a2_scale, expert_map, activation, cta_mode, true);
  TORCH_CHECK(!swiglu_limit.has_value() || (std::isfinite(*swiglu_limit) && *swiglu_limit > 0),
              "dsv4: swiglu_limit must be positive and finite, got ", swiglu_limit.value_or(0.0));
  check_same_device(out, x, "out", "x");
  check_dtype(out, at::kBFloat16, "out");
  check_contiguous(out, "out");
  TORCH_CHECK(out.dim() == 2 && out.size(0) == c.M && out.size(1) == c.K, "dsv4: out must have shape [M=", c.M,
              ", K=", c.K, "], got ", out.sizes());
  if (c.M == 0) return;
  check_aligned(out, 16, "out");
  const at::cuda::OptionalCUDAGuard guard(x.device());
  const env::Switches& sw = env::switches();
  const DeviceFacts& d = device_facts();
  const Nvfp4MoeConfig cfg = moe::get_best_config(c, cta_mode, d, sw);
  MoeParams p;
  const at::Tensor ws = fill_params(p, c, cfg, x, topk_ids, topk_weights, w13, w13_scale, w13_scale_2, &w2, &w2_scale,
                                    &w2_scale_2, a13_scale, a2_scale, expert_map, swiglu_limit, true);
  if (sw.print_config) moe::print_config("nvfp4_moe", c, cta_mode, d, cfg, ws.numel());
  p.out = reinterpret_cast<__nv_bfloat16*>(out.data_ptr());
  launch_chain(cfg, p, true);
}

// A view of `count` elements of the workspace `ws` starting at `ptr` (which points into it).
at::Tensor workspace_view(const at::Tensor& ws, const void* ptr, int64_t count) {
  const int64_t at = static_cast<const uint8_t*>(ptr) - ws.data_ptr<uint8_t>();
  return ws.slice(0, at, at + count);
}

// Test-only (dsv4_testing): GEMM1 only. Per (token, slot) the fp32 SwiGLU output h
// [M*k, N] that the epilogue computed, its NVFP4 encoding (nvfp4 mode; zeros otherwise)
// and whether the slot is local.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> nvfp4_moe_gemm1_debug(
    const at::Tensor& x, const at::Tensor& topk_ids, const at::Tensor& w13, const at::Tensor& w13_scale,
    const at::Tensor& w13_scale_2, const std::optional<at::Tensor>& a13_scale, const std::optional<at::Tensor>& a2_scale,
    const std::optional<at::Tensor>& expert_map, std::optional<double> swiglu_limit, c10::string_view activation,
    int64_t cta_mode) {
  at::Tensor none;
  const Nvfp4MoeShape c = check_inputs(x, topk_ids, topk_ids.to(at::kFloat), w13, w13_scale, w13_scale_2, none, none, none,
                                 a13_scale, a2_scale, expert_map, activation, cta_mode, false);
  const int64_t S = c.M * c.topk;
  auto opt = x.options();
  at::Tensor h = at::zeros({S, c.N}, opt.dtype(at::kFloat));
  at::Tensor hq = at::zeros({S, c.N / 2}, opt.dtype(at::kByte));
  at::Tensor hs = at::zeros({S, c.N / 16}, opt.dtype(at::kByte));
  at::Tensor local = at::zeros({S}, opt.dtype(at::kBool));
  if (S == 0) return {h, hq, hs.view(at::kFloat8_e4m3fn), local};
  const at::cuda::OptionalCUDAGuard guard(x.device());
  const env::Switches& sw = env::switches();
  const DeviceFacts& d = device_facts();
  const Nvfp4MoeConfig cfg = moe::get_best_config(c, cta_mode, d, sw);
  MoeParams p;
  at::Tensor tw;  // undefined: GEMM1 does not read the routing weights
  const at::Tensor ws = fill_params(p, c, cfg, x, topk_ids, tw, w13, w13_scale, w13_scale_2, nullptr, nullptr, nullptr,
                                    a13_scale, a2_scale, expert_map, swiglu_limit, false);
  if (sw.print_config) moe::print_config("nvfp4_moe_gemm1_debug", c, cta_mode, d, cfg, ws.numel());
  at::Tensor h_rows = at::zeros({p.max_rows, c.N}, opt.dtype(at::kFloat));
  p.h_debug = h_rows.data_ptr<float>();
  launch_chain(cfg, p, false);
  at::Tensor pos = workspace_view(ws, p.slot_pos, S * int64_t(sizeof(int))).view(at::kInt).to(at::kLong);
  local = pos >= 0;
  at::Tensor idx = pos.clamp_min(0);
  h = h_rows.index_select(0, idx) * local.unsqueeze(1);
  if (c.nvfp4) {
    const int64_t rows = p.max_rows;
    at::Tensor all_hq = workspace_view(ws, p.hq, rows * c.N / 2).view({rows, c.N / 2});
    at::Tensor all_hs = workspace_view(ws, p.hs, rows * c.N / 16).view({rows, c.N / 16});
    hq = all_hq.index_select(0, idx) * local.unsqueeze(1).to(at::kByte);
    hs = all_hs.index_select(0, idx) * local.unsqueeze(1).to(at::kByte);
  }
  return {h, hq, hs.view(at::kFloat8_e4m3fn), local};
}

}  // namespace
}  // namespace dsv4

TORCH_LIBRARY_IMPL(dsv4, CUDA, m) { m.impl("nvfp4_moe", &dsv4::nvfp4_moe); }

// Test-only op; its schema: csrc/testing/testing_ops.cpp.
TORCH_LIBRARY_IMPL(dsv4_testing, CUDA, m) { m.impl("nvfp4_moe_gemm1_debug", &dsv4::nvfp4_moe_gemm1_debug); }
