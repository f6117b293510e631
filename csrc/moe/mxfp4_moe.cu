// C++ entry of the MXFP4 W4A8 MoE: dsv4::mxfp4_moe (CUDA). Laid out as the NVFP4 entry
// (nvfp4_moe.cu): (a) checks, (b) the kernel choice (get_best_config in config.h, from
// the shapes and the device facts measured here once per device; DSV4_PRINT_CONFIG=1
// prints it), (c) a workspace laid out by one function that counts, then carves one
// allocation (common/workspace.h; sized from shapes only), (d) the launch on the current
// stream: routing (routing.h, the kernels the NVFP4 op runs too) -> FP8 quantization of
// x -> GEMM1 with the SwiGLU + FP8 epilogue -> GEMM2 with the weighted combine
// (mxfp4_gemm.cuh), chained by programmatic dependent launches.
// No host sync, no value-dependent allocation: CUDA-graph capturable.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <mutex>
#include <optional>
#include <string>

#include "common/checks.h"
#include "common/dynamic_smem.h"  // kMaxDevices
#include "common/env.h"
#include "common/launch.h"
#include "common/workspace.h"
#include "moe/config.h"
#include "moe/mxfp4_gemm.cuh"
#include "moe/params.cuh"
#include "moe/routing.h"

namespace dsv4 {
namespace {

namespace w4a8 = moe::w4a8;
using moe::GemmOccupancy;
using moe::Mxfp4DeviceFacts;
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
  TORCH_CHECK(M * topk < (int64_t(1) << 30), "dsv4: M * k = ", M * topk, " slots is too large");

  // The prepared tiles (dsv4.formats.mxfp4_w4a8; check_w4a8_layout there has the same rules).
  for (auto [t, name] : {std::pair{&w13, "w13"}, {&w13_scale, "w13_scale"}, {&w2, "w2"}, {&w2_scale, "w2_scale"}}) {
    check_same_device(*t, x, name, "x");
    check_dtype(*t, at::kByte, name);
    check_dim(*t, 4, name, "[E, row tiles, K chunks, bytes]");
    check_contiguous(*t, name);
    check_aligned(*t, 16, name);
  }
  TORCH_CHECK(w13.size(0) >= 1 && w13.size(3) == w4a8::kCodeTile, "dsv4: w13 must be the prepared layout [E, 2N/64, "
              "K/128, 4096]", prep, ", got shape ", w13.sizes());
  const int64_t E = w13.size(0), N = w13.size(1) * 32, G2 = (N + 127) / 128;
  TORCH_CHECK(w13.size(2) * 128 == K, "dsv4: w13 has K/128 = ", w13.size(2), " chunks but x has K = ", K);
  auto check_shape = [&](const at::Tensor& t, const char* name, int64_t d1, int64_t d2, int64_t d3) {
    TORCH_CHECK(t.size(0) == E && t.size(1) == d1 && t.size(2) == d2 && t.size(3) == d3, "dsv4: ", name,
                " must have shape [", E, ", ", d1, ", ", d2, ", ", d3, "] (the prepared layout for E = ", E, ", N = ",
                N, ", K = ", K, ")", prep, ", got ", t.sizes());
  };
  check_shape(w13_scale, "w13_scale", 2 * N / 64, K / 128, w4a8::kScaleTile);
  check_shape(w2, "w2", K / 64, G2, w4a8::kCodeTile);
  check_shape(w2_scale, "w2_scale", K / 64, G2, w4a8::kScaleTile);
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
  check_aligned(out, 16, "out");
  return Mxfp4MoeShape{M, K, N, E, E_global, topk};
}

// ---------------------------------------------------------------------------------
// (b) kernel choice: the device facts it reads (the rules: config.h)
// ---------------------------------------------------------------------------------

// 128-K chunks of shared-memory ring per grid: the classic grid 4 (two slots of two:
// 512 of K in flight, as the NVFP4 classic grid's 8 x 64), the split-K grid 8 (its few
// CTAs run long K loops; as the NVFP4 split-K grid's 16 x 64).
constexpr int kClassicChunks = 4;
constexpr int kSplitKChunks = 8;

template <int BN>
GemmOccupancy gemm_setup() {
  using S = w4a8::Smem<BN, kClassicChunks>;
  using SK = w4a8::Smem<BN, kSplitKChunks>;
  auto k1 = w4a8::mxfp4_gemm_splitk_kernel<BN, kSplitKChunks, true>;
  auto k2 = w4a8::mxfp4_gemm_splitk_kernel<BN, kSplitKChunks, false>;
  auto c1 = w4a8::mxfp4_gemm_kernel<BN, kClassicChunks, true>;
  auto c2 = w4a8::mxfp4_gemm_kernel<BN, kClassicChunks, false>;
  for (auto k : {k1, k2}) C10_CUDA_CHECK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, SK::kBytes));
  for (auto k : {c1, c2}) C10_CUDA_CHECK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, S::kBytes));
  if constexpr (BN == 64) {
    for (auto k : {w4a8::mxfp4_gemm2_rows_kernel<BN, kClassicChunks, 2>, w4a8::mxfp4_gemm2_rows_kernel<BN, kClassicChunks, 4>,
                   w4a8::mxfp4_gemm2_rows_kernel<BN, kClassicChunks, 8>})
      C10_CUDA_CHECK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, S::kBytes));
    C10_CUDA_CHECK(cudaFuncSetAttribute(w4a8::mxfp4_gemm1_pair_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        w4a8::PairSmem::kBytes));
    for (auto k : {w4a8::mxfp4_gemm2_pair_kernel<1>, w4a8::mxfp4_gemm2_pair_kernel<2>, w4a8::mxfp4_gemm2_pair_kernel<4>})
      C10_CUDA_CHECK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, w4a8::PairSmem::kBytes));
    using RS = w4a8::ResidentSmem<BN>;
    for (auto k : {w4a8::mxfp4_gemm2_resident_kernel<BN, 2>, w4a8::mxfp4_gemm2_resident_kernel<BN, 4>,
                   w4a8::mxfp4_gemm2_resident_kernel<BN, 8>})
      C10_CUDA_CHECK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, RS::bytes(RS::kMaxG2)));
  }
  GemmOccupancy o{};
  C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&o.gemm1, k1, moe::kThreads, SK::kBytes));
  C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&o.gemm2, k2, moe::kThreads, SK::kBytes));
  C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&o.classic1, c1, moe::kThreads, S::kBytes));
  TORCH_CHECK(o.gemm1 > 0 && o.gemm2 > 0 && o.classic1 > 0, "dsv4: mxfp4_moe GEMM kernels do not fit on this device");
  return o;
}

// Once per device (the shared-memory opt-in is per device).
const Mxfp4DeviceFacts& device_facts() {
  static std::once_flag once[kMaxDevices];
  static Mxfp4DeviceFacts facts[kMaxDevices];
  int dev = 0;
  C10_CUDA_CHECK(cudaGetDevice(&dev));
  TORCH_CHECK(dev >= 0 && dev < kMaxDevices, "dsv4: mxfp4_moe runs on CUDA devices 0..", kMaxDevices - 1,
              ", got device ", dev);
  std::call_once(once[dev], [dev] {
    Mxfp4DeviceFacts f{};
    f.sms = at::cuda::getDeviceProperties(dev)->multiProcessorCount;
    f.occ[0] = gemm_setup<8>();
    f.occ[1] = gemm_setup<16>();
    f.occ[2] = gemm_setup<64>();
    facts[dev] = f;
  });
  return facts[dev];
}

// ---------------------------------------------------------------------------------
// (c) workspace
// ---------------------------------------------------------------------------------

// ints (slot_pos | row_slot | tile_expert | num_tiles | error_flag | route_counts |
// route_tile_off | sk_count | group_ready | group_left | combine_left) | xg | xgs | hf |
// hq | hs | y | [split-K partials]. rp: the fields that routing reads.
void layout_workspace(Carver& w, moe::MoeParams& rp, w4a8::W4A8Params& p, const Mxfp4MoeShape& c,
                      const Mxfp4MoeConfig& cfg) {
  const int64_t S = c.M * c.topk, rows = int64_t(cfg.max_tiles) * cfg.block_n, G1 = c.K / 128, G2 = (c.N + 127) / 128;
  rp.slot_pos = w.region<int>(S);
  rp.row_slot = w.next<int>(rows);
  rp.tile_expert = w.next<int>(cfg.max_tiles);
  rp.num_tiles = w.next<int>(1);
  rp.error_flag = w.next<int>(1);
  if (cfg.multi_cta_route) {
    rp.route_counts = w.next<int>(c.E);
    rp.route_tile_off = w.next<int>(c.E + 1);
  }
  rp.sk_count = w.next<int>(2 * int64_t(cfg.sk_ctas));
  rp.group_ready = w.next<int>(cfg.max_tiles);
  p.group_left = w.next<int>(int64_t(cfg.max_tiles) * G2);
  p.combine_left = w.next<int>(c.M * (c.K / 64));
  p.xg = w.region<uint8_t>(rows * c.K);
  p.xgs = w.region<float>(rows * G1);
  p.hf = w.region<float>(rows * c.N);
  p.hq = w.region<uint8_t>(rows * G2 * 128);
  p.hs = w.region<float>(rows * G2);
  p.y = w.region<__nv_bfloat16>(rows * c.K);
  if (cfg.splitk) p.sk_partial = w.region<float>(2 * int64_t(cfg.sk_ctas) * moe::kTileRows * cfg.block_n);
}

// ---------------------------------------------------------------------------------
// (d) the op: parameters and launch
// ---------------------------------------------------------------------------------

template <int BN>
void launch_gemms(const Mxfp4MoeConfig& cfg, const w4a8::W4A8Params& p, cudaStream_t stream) {
  const dim3 block(moe::kThreads);
  if (cfg.splitk) {
    using SK = w4a8::Smem<BN, kSplitKChunks>;
    launch_kernel(w4a8::mxfp4_gemm_splitk_kernel<BN, kSplitKChunks, true>, dim3(unsigned(cfg.gemm1_ctas)), block,
                  SK::kBytes, stream, cfg.pdl, p);
    launch_kernel(w4a8::mxfp4_gemm_splitk_kernel<BN, kSplitKChunks, false>, dim3(unsigned(cfg.gemm2_ctas)), block,
                  SK::kBytes, stream, cfg.pdl, p);
    return;
  }
  using S = w4a8::Smem<BN, kClassicChunks>;
  if (cfg.gemm1_pairs)  // config.h: at 64-token tiles on the classic grid only
    launch_kernel(w4a8::mxfp4_gemm1_pair_kernel, dim3(unsigned(p.N / 32), unsigned(cfg.grid_pairs)), block,
                  w4a8::PairSmem::kBytes, stream, cfg.pdl, p);
  else
    launch_kernel(w4a8::mxfp4_gemm_kernel<BN, kClassicChunks, true>, dim3(unsigned(p.N / 32), unsigned(cfg.grid_tiles)),
                  block, S::kBytes, stream, cfg.pdl, p);
  // config.h: GEMM2 rows (and the resident variant, which implies them) only at 64-token
  // tiles on the classic grid
  if constexpr (BN == 64) {
    if (cfg.gemm2_pairs) {  // config.h: gemm2_rows > 1 and tile_pairs (max_tiles even); R = gemm2_rows / 2
      const int R = cfg.gemm2_rows / 2;
      auto k = R == 1   ? w4a8::mxfp4_gemm2_pair_kernel<1>
               : R == 2 ? w4a8::mxfp4_gemm2_pair_kernel<2>
                        : w4a8::mxfp4_gemm2_pair_kernel<4>;
      launch_kernel(k, dim3(unsigned(p.K / 64 / R), unsigned(cfg.max_tiles / 2)), block, w4a8::PairSmem::kBytes, stream,
                    cfg.pdl, p);
      return;
    }
    if (cfg.gemm2_rows > 1) {
      const dim3 grid(unsigned(p.K / 64 / cfg.gemm2_rows), unsigned(cfg.max_tiles));
      if (cfg.gemm2_resident) {
        auto k = cfg.gemm2_rows == 2   ? w4a8::mxfp4_gemm2_resident_kernel<BN, 2>
                 : cfg.gemm2_rows == 4 ? w4a8::mxfp4_gemm2_resident_kernel<BN, 4>
                                       : w4a8::mxfp4_gemm2_resident_kernel<BN, 8>;
        launch_kernel(k, grid, block, w4a8::ResidentSmem<BN>::bytes(p.G2), stream, cfg.pdl, p);
        return;
      }
      auto k = cfg.gemm2_rows == 2   ? w4a8::mxfp4_gemm2_rows_kernel<BN, kClassicChunks, 2>
               : cfg.gemm2_rows == 4 ? w4a8::mxfp4_gemm2_rows_kernel<BN, kClassicChunks, 4>
                                     : w4a8::mxfp4_gemm2_rows_kernel<BN, kClassicChunks, 8>;
      launch_kernel(k, grid, block, S::kBytes, stream, cfg.pdl, p);
      return;
    }
  }
  launch_kernel(w4a8::mxfp4_gemm_kernel<BN, kClassicChunks, false>, dim3(unsigned(p.K / 64), unsigned(cfg.grid_tiles)),
                block, S::kBytes, stream, cfg.pdl, p);
}

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
  const Mxfp4DeviceFacts& d = device_facts();
  const Mxfp4MoeConfig cfg = moe::get_best_config(c, d, sw);

  moe::MoeParams rp{};  // the fields routing reads
  rp.M = int(c.M);
  rp.topk = int(c.topk);
  rp.E = int(c.E);
  rp.E_global = int(c.E_global);
  rp.K = int(c.K);
  rp.N = int(c.N);
  rp.block_n = cfg.block_n;
  rp.tile_pairs = cfg.gemm1_pairs ? 1 : 0;
  rp.max_tiles = cfg.max_tiles;
  rp.max_rows = cfg.max_tiles * cfg.block_n;
  rp.splitk = cfg.splitk ? 1 : 0;
  rp.sk_ctas = cfg.sk_ctas;
  rp.topk_ids = topk_ids.data_ptr<int>();
  rp.topk_weights = topk_weights.data_ptr<float>();
  rp.expert_map = expert_map.has_value() ? expert_map->data_ptr<int>() : nullptr;

  w4a8::W4A8Params p{};
  at::Tensor ws;
  const int64_t ws_bytes = count_then_carve([&](Carver& w) { layout_workspace(w, rp, p, c, cfg); },
                                            [&](int64_t bytes) {
                                              ws = at::empty({bytes}, x.options().dtype(at::kByte));
                                              return ws.data_ptr<uint8_t>();
                                            });
  if (sw.print_config) moe::print_config(c, d, cfg, ws_bytes);

  p.M = int(c.M);
  p.topk = int(c.topk);
  p.K = int(c.K);
  p.N = int(c.N);
  p.G2 = int((c.N + 127) / 128);
  p.block_n = cfg.block_n;
  p.max_tiles = cfg.max_tiles;
  p.ue8m0 = ue8m0 ? 1 : 0;
  p.has_limit = swiglu_limit.has_value() ? 1 : 0;
  p.swiglu_limit = swiglu_limit.has_value() ? float(*swiglu_limit) : 0.0f;
  p.sk_ctas = cfg.sk_ctas;
  p.late_zero = cfg.late_zero ? 1 : 0;
  p.slot_pos = rp.slot_pos;
  p.row_slot = rp.row_slot;
  p.tile_expert = rp.tile_expert;
  p.num_tiles = rp.num_tiles;
  p.topk_weights = rp.topk_weights;
  p.x = reinterpret_cast<const __nv_bfloat16*>(x.data_ptr());
  p.w13 = w13.data_ptr<uint8_t>();
  p.w13_scale = w13_scale.data_ptr<uint8_t>();
  p.w2 = w2.data_ptr<uint8_t>();
  p.w2_scale = w2_scale.data_ptr<uint8_t>();
  p.group_ready = rp.group_ready;
  p.sk_count = rp.sk_count;
  p.out = reinterpret_cast<__nv_bfloat16*>(out.data_ptr());

  if (cfg.fused_route) {  // config.h: decode sizes; launched as the routing kernel it replaces (no PDL)
    w4a8::mxfp4_route_quant_kernel<<<unsigned(cfg.quant_ctas), 256, 0, stream>>>(rp, p);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  } else {
    moe::launch_routing(rp, cfg.multi_cta_route, stream);
    launch_kernel(p.ue8m0 ? w4a8::mxfp4_quant_x_kernel<true> : w4a8::mxfp4_quant_x_kernel<false>,
                  dim3(unsigned(cfg.quant_ctas)), dim3(256), 0, stream, cfg.pdl, p);
  }
  switch (cfg.block_n) {
    case 8: launch_gemms<8>(cfg, p, stream); break;
    case 16: launch_gemms<16>(cfg, p, stream); break;
    default: launch_gemms<64>(cfg, p, stream); break;
  }
}

}  // namespace
}  // namespace dsv4

TORCH_LIBRARY_IMPL(dsv4, CUDA, m) { m.impl("mxfp4_moe", &dsv4::mxfp4_moe); }
