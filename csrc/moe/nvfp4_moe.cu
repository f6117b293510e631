// C++ entries of the NVFP4 MoE: dsv4::nvfp4_moe and dsv4::nvfp4_moe_gemm1_debug.
// Validate every argument, size the workspace from shapes only (worst case
// M*topk + experts*(block_n-1) padded rows), launch route -> gather -> GEMM1 ->
// GEMM2 -> combine on the current stream. No host sync, no value-dependent
// allocation: CUDA-graph capturable.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <optional>
#include <string>

#include "common/checks.h"
#include "moe/moe_gemm.cuh"
#include "moe/moe_gemm_ws.cuh"
#include "moe/moe_routing.cuh"

namespace dsv4 {
namespace {

using moe::MoeParams;

struct Checked {
  int64_t M, K, N, E, E_global, topk;
  bool nvfp4;
};

void check_act_scale(const std::optional<at::Tensor>& s, const char* name, const at::Tensor& x, int64_t E) {
  TORCH_CHECK(s.has_value(), "dsv4: ", name, " is required when activation=\"nvfp4\"");
  check_same_device(*s, x, name, "x");
  check_dtype(*s, at::kFloat, name);
  check_contiguous(*s, name);
  TORCH_CHECK(s->numel() == 1 || (s->dim() == 1 && s->size(0) == E), "dsv4: ", name,
              " must hold 1 element or have shape [", E, "] (one per local expert), got shape ", s->sizes());
}

Checked check_inputs(const at::Tensor& x, const at::Tensor& topk_ids, const at::Tensor& topk_weights,
                     const at::Tensor& w13, const at::Tensor& w13_scale, const at::Tensor& w13_scale_2,
                     const at::Tensor& w2, const at::Tensor& w2_scale, const at::Tensor& w2_scale_2,
                     const std::optional<at::Tensor>& a13_scale, const std::optional<at::Tensor>& a2_scale,
                     const std::optional<at::Tensor>& expert_map, c10::string_view activation,
                     int64_t cta_mode, bool need_w2) {
  Checked c{};
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

// Token tile of the grouped GEMMs from shapes only: expected tokens per local
// expert under uniform routing over the global experts. 64 is the prefill tile (the
// warp-specialized kernel groups up to three of them into one unit).
int pick_block_n(int64_t M, int64_t topk, int64_t E_global) {
  const double per_expert = double(M) * double(topk) / double(E_global);
  if (per_expert <= 4.0) return 8;
  if (per_expert <= 24.0) return 16;
  return 64;
}

struct GemmOccupancy {
  int gemm1, gemm2;                  // resident split-K CTAs per SM
  int classic1;                      // resident classic GEMM1 CTAs per SM
};

// K steps of shared-memory ring per token-tile width, for the classic grid and the
// split-K grid. Decode tiles (mma.sync, two ring slots): the split-K grid's few CTAs run
// long K loops and gain from 8-step slots; the classic grid, 8 CTAs per SM, from 4-step
// slots that leave room for more CTAs (docs/perf.md, nvfp4_moe stop 16).
template <int BN>
struct RingStages {
  static constexpr int kClassic = BN <= 16 ? 8 : 6;
  static constexpr int kSplitK = BN <= 16 ? 16 : 6;
};

template <int BN>
GemmOccupancy gemm_setup() {
  constexpr int STAGES = RingStages<BN>::kClassic, SK_STAGES = RingStages<BN>::kSplitK;
  using S = moe::GemmSmem<BN, STAGES>;
  using SK = moe::GemmSmem<BN, SK_STAGES>;
  static std::atomic<int> cached[64];  // gemm1 | gemm2 << 8 | classic1 << 16 per device, 0 = not yet
  int dev = 0;
  C10_CUDA_CHECK(cudaGetDevice(&dev));
  std::atomic<int>& slot = cached[dev & 63];
  int v = slot.load(std::memory_order_acquire);
  if (v == 0) {
    auto k1 = moe::moe_gemm_splitk_kernel<BN, SK_STAGES, true>;
    auto k2 = moe::moe_gemm_splitk_kernel<BN, SK_STAGES, false>;
    for (auto k : {k1, k2})
      C10_CUDA_CHECK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, SK::kBytes));
    for (auto k : {moe::moe_gemm_kernel<BN, STAGES, true>, moe::moe_gemm_kernel<BN, STAGES, false>})
      C10_CUDA_CHECK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, S::kBytes));
    int o1 = 0, o2 = 0, oc = 0;
    C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&o1, k1, moe::kThreads, SK::kBytes));
    C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&o2, k2, moe::kThreads, SK::kBytes));
    C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&oc, moe::moe_gemm_kernel<BN, STAGES, true>,
                                                                 moe::kThreads, S::kBytes));
    TORCH_CHECK(o1 > 0 && o2 > 0 && oc > 0, "dsv4: nvfp4_moe GEMM kernels do not fit on this device");
    v = o1 | (o2 << 8) | (oc << 16);
    slot.store(v, std::memory_order_release);
  }
  return GemmOccupancy{v & 0xFF, (v >> 8) & 0xFF, v >> 16};
}

GemmOccupancy gemm_setup_for(int block_n) {
  switch (block_n) {
    case 8: return gemm_setup<8>();
    case 16: return gemm_setup<16>();
    default: return gemm_setup<64>();
  }
}

// The prefill kernel (moe_gemm_ws.cuh) runs at the 64-token tile when cta_mode is given
// (1 or 2) or, in auto mode, from kWsMinTokensPerExpert expected tokens per local expert:
// below that most groups are one partly filled tile and the one-warpgroup kernel, with
// 2-3 CTAs per SM, measured as fast or faster (the prefill kernel at 32-48 tokens:
// 0.82-1.0x of it; at 64-72: 1.21-1.49x; docs/perf.md, nvfp4_moe v5b). DSV4_MOE_WS=0
// always keeps the one-warpgroup kernel (A/B runs and tests).
constexpr double kWsMinTokensPerExpert = 60.0;

double tokens_per_expert(const Checked& c) { return double(c.M) * double(c.topk) / double(c.E_global); }

bool use_ws(const Checked& c, int block_n, bool splitk, int64_t cta_mode) {
  const char* env = std::getenv("DSV4_MOE_WS");
  if (env != nullptr && env[0] == '0') return false;
  if (block_n != 64 || splitk) return false;
  return cta_mode != 0 || tokens_per_expert(c) >= kWsMinTokensPerExpert;
}

// CTAs per cluster of the prefill kernel: cta_mode 1 or 2; auto: 1. With the modes timed
// round-robin, pairs measured 0.97-0.99x of single CTAs at every prefill size (the kernel
// is bound by dequant and MMA issue, not by the L2 traffic that multicasting the token
// rows halves; docs/perf.md, nvfp4_moe v5b).
int ws_cluster(int64_t cta_mode) { return cta_mode != 0 ? int(cta_mode) : 1; }

// Split-K (persistent grid, items cut into K chunks) or the classic grid (one CTA
// per token tile x weight-row tile, hardware-scheduled). Split-K when the expected
// classic GEMM1 grid (touched experts under uniform routing x weight-row tiles) does
// not fill one wave: then most SMs idle while each CTA runs a latency-bound K loop.
// Above that the classic grid measured as fast or faster (v4 in docs/perf.md).
// DSV4_MOE_SPLITK=0/1 forces either (benchmarks and tests).
bool use_splitk(const Checked& c, int block_n, int sms) {
  const char* env = std::getenv("DSV4_MOE_SPLITK");
  if (env != nullptr && env[0] != '\0') return env[0] != '0';
  if (block_n > 16) return false;
  const double local_slots = double(c.M) * double(c.topk) * double(c.E) / double(c.E_global);
  const double touched = double(c.E) * (1.0 - std::pow(1.0 - 1.0 / double(c.E), local_slots));
  const double items = touched * double(2 * c.N / moe::kTileRows);
  return items < double(gemm_setup_for(block_n).classic1) * sms;
}

// bf16 mode at decode token tiles: GEMM1 loads x rows itself (see gemm_segment).
// DSV4_MOE_DIRECT_X=0 keeps the gather kernel (benchmarks and tests).
bool use_direct_x() {
  const char* env = std::getenv("DSV4_MOE_DIRECT_X");
  return env == nullptr || env[0] != '0';
}

// Launch with programmatic stream serialization (see pdl_wait in moe_device.cuh):
// the kernel may be scheduled while its predecessor in the stream drains, which
// hides the launch gap between the five kernels of a (decode-sized) call.
// On by default at decode token tiles (<= 16), where it saved ~3 us per call; at
// prefill the same-process A/B was within its +-5-9 % noise either way (v4b in
// docs/perf.md), so prefill keeps plain launches. DSV4_MOE_PDL=0/1 forces either.
bool use_pdl(int block_n) {
  const char* env = std::getenv("DSV4_MOE_PDL");
  if (env != nullptr && env[0] != '\0') return env[0] != '0';
  return block_n <= 16;
}

void launch(void (*kernel)(MoeParams), dim3 grid, dim3 block, size_t smem, cudaStream_t stream, bool pdl,
            const MoeParams& p, int cluster = 1) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[2];
  int n = 0;
  if (pdl) {
    attr[n].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[n].val.programmaticStreamSerializationAllowed = 1;
    ++n;
  }
  if (cluster > 1) {
    attr[n].id = cudaLaunchAttributeClusterDimension;
    attr[n].val.clusterDim.x = unsigned(cluster);
    attr[n].val.clusterDim.y = 1;
    attr[n].val.clusterDim.z = 1;
    ++n;
  }
  cfg.attrs = attr;
  cfg.numAttrs = n;
  C10_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, p));
}

// The prefill kernels (moe_gemm_ws.cuh), once per device: the shared-memory opt-in,
// and the CTAs of the persistent grid in 2-CTA mode: as many clusters as can be
// resident at once (fewer than SMs / 2 when a GPC has an odd number of free SMs; a
// cluster that does not fit would run after the others, doubling the time; 0 when
// none fits). 1-CTA mode runs one CTA per SM.
int ws_setup(int sms) {
  static std::atomic<int> cached[64];  // 1 + the 2-CTA grid per device, 0 = not yet
  int dev = 0;
  C10_CUDA_CHECK(cudaGetDevice(&dev));
  int n = cached[dev & 63].load(std::memory_order_acquire);
  if (n == 0) {
    for (auto k : {moe::moe_gemm_ws_kernel<true, 1>, moe::moe_gemm_ws_kernel<false, 1>,
                   moe::moe_gemm_ws_kernel<true, 2>, moe::moe_gemm_ws_kernel<false, 2>})
      C10_CUDA_CHECK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, moe::WsConfig::kBytes));
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3(unsigned(sms / 2 * 2));
    cfg.blockDim = dim3(moe::WsConfig::kThreads);
    cfg.dynamicSmemBytes = moe::WsConfig::kBytes;
    cudaLaunchAttribute attr;
    attr.id = cudaLaunchAttributeClusterDimension;
    attr.val.clusterDim.x = 2;
    attr.val.clusterDim.y = 1;
    attr.val.clusterDim.z = 1;
    cfg.attrs = &attr;
    cfg.numAttrs = 1;
    int clusters = 0;
    C10_CUDA_CHECK(cudaOccupancyMaxActiveClusters(&clusters, moe::moe_gemm_ws_kernel<true, 2>, &cfg));
    n = 1 + std::min(clusters, sms / 2) * 2;
    cached[dev & 63].store(n, std::memory_order_release);
  }
  return n - 1;
}

// Persistent prefill GEMMs (a whole number of clusters).
void launch_ws_gemms(const MoeParams& p, bool gemm2, cudaStream_t stream, int sms, bool pdl, int cluster) {
  using C = moe::WsConfig;
  const int grid2 = ws_setup(sms);
  TORCH_CHECK(cluster == 1 || grid2 > 0, "dsv4: nvfp4_moe's 2-CTA prefill kernel does not fit on this device (cta_mode=2)");
  const dim3 grid(unsigned(cluster == 2 ? grid2 : sms));
  auto k1 = cluster == 2 ? moe::moe_gemm_ws_kernel<true, 2> : moe::moe_gemm_ws_kernel<true, 1>;
  auto k2 = cluster == 2 ? moe::moe_gemm_ws_kernel<false, 2> : moe::moe_gemm_ws_kernel<false, 1>;
  launch(k1, grid, C::kThreads, C::kBytes, stream, pdl, p, cluster);
  // Always programmatic: GEMM2 overlaps GEMM1's tail (see moe_gemm_ws_kernel).
  if (gemm2) launch(k2, grid, C::kThreads, C::kBytes, stream, true, p, cluster);
}

template <int BN>
void launch_gemms(const MoeParams& p, bool gemm2, cudaStream_t stream, int sms, bool pdl) {
  constexpr int STAGES = RingStages<BN>::kClassic, SK_STAGES = RingStages<BN>::kSplitK;
  using S = moe::GemmSmem<BN, STAGES>;
  using SK = moe::GemmSmem<BN, SK_STAGES>;
  const GemmOccupancy occ = gemm_setup<BN>();
  if (p.splitk) {
    launch(moe::moe_gemm_splitk_kernel<BN, SK_STAGES, true>, dim3(unsigned(occ.gemm1 * sms)), moe::kThreads,
           SK::kBytes, stream, pdl, p);
    if (gemm2)
      launch(moe::moe_gemm_splitk_kernel<BN, SK_STAGES, false>, dim3(unsigned(occ.gemm2 * sms)), moe::kThreads,
             SK::kBytes, stream, pdl, p);
    return;
  }
  TORCH_CHECK(p.max_tiles <= 65535, "dsv4: nvfp4_moe's one-warpgroup GEMM grid takes at most 65535 token tiles, got ",
              p.max_tiles, " (M * k = ", int64_t(p.M) * p.topk, " slots); call it on fewer tokens at a time");
  const dim3 g1(unsigned(2 * p.N / moe::kTileRows), unsigned(p.max_tiles));
  const dim3 g2(unsigned(p.K / moe::kTileRows), unsigned(p.max_tiles));
  launch(moe::moe_gemm_kernel<BN, STAGES, true>, g1, moe::kThreads, S::kBytes, stream, pdl, p);
  if (gemm2) launch(moe::moe_gemm_kernel<BN, STAGES, false>, g2, moe::kThreads, S::kBytes, stream, pdl, p);
}

// Above this many slots (M * k) the routing runs on many CTAs (moe_count_kernel); below
// it one CTA is faster (one launch instead of three, plus a memset).
constexpr int64_t kMultiCtaRouteSlots = 8192;

// Runs the chain; with debug_h set it stops after GEMM1.
void run_moe(MoeParams& p, const Checked& c, int64_t cta_mode, const at::Tensor& x, bool full) {
  cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const size_t route_smem = size_t(4 * c.E + 1) * sizeof(int);  // see moe_route_kernel
  if (route_smem > 48 * 1024)
    C10_CUDA_CHECK(cudaFuncSetAttribute(moe::moe_route_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(route_smem)));
  if (p.route_counts != nullptr) {  // count -> tables -> place (see moe_count_kernel)
    const unsigned ctas = unsigned((c.M * c.topk + moe::kRouteSlotsPerCta - 1) / moe::kRouteSlotsPerCta);
    const size_t count_smem = size_t(c.E) * sizeof(int);
    if (count_smem > 48 * 1024)
      C10_CUDA_CHECK(cudaFuncSetAttribute(moe::moe_count_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(count_smem)));
    C10_CUDA_CHECK(cudaMemsetAsync(p.error_flag, 0, size_t(1 + c.E) * sizeof(int), stream));  // + route_counts
    moe::moe_count_kernel<<<ctas, moe::kRouteThreads, count_smem, stream>>>(p);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    moe::moe_route_kernel<<<1, moe::kRouteThreads, route_smem, stream>>>(p);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    moe::moe_place_kernel<<<ctas, moe::kRouteThreads, 0, stream>>>(p);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  } else {
    moe::moe_route_kernel<<<1, moe::kRouteThreads, route_smem, stream>>>(p);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  const unsigned gather_blocks = unsigned(std::min<int64_t>(p.max_rows, int64_t(sms) * 8));
  const bool pdl = use_pdl(p.block_n);
  if (!p.direct_x)
    launch(c.nvfp4 ? moe::moe_gather_kernel<true> : moe::moe_gather_kernel<false>, dim3(gather_blocks), dim3(256), 0,
           stream, pdl, p);
  if (p.ws) {
    launch_ws_gemms(p, full, stream, sms, pdl, ws_cluster(cta_mode));
  } else {
    switch (p.block_n) {
      case 8: launch_gemms<8>(p, full, stream, sms, pdl); break;
      case 16: launch_gemms<16>(p, full, stream, sms, pdl); break;
      default: launch_gemms<64>(p, full, stream, sms, pdl); break;
    }
  }
  if (!full) return;
  const unsigned combine_blocks = unsigned(std::min<int64_t>(c.M, int64_t(sms) * 16));
  launch(moe::moe_combine_kernel, dim3(combine_blocks), dim3(256), 0, stream, pdl, p);
}

struct Workspace {
  at::Tensor bytes, ints, hq, hs;  // hq/hs: uint8 views (nvfp4 mode)
};

Workspace fill_params(MoeParams& p, const Checked& c, int64_t cta_mode, const at::Tensor& x, const at::Tensor& topk_ids,
                      const at::Tensor& topk_weights, const at::Tensor& w13, const at::Tensor& w13_scale,
                      const at::Tensor& w13_scale_2, const at::Tensor* w2, const at::Tensor* w2_scale,
                      const at::Tensor* w2_scale_2, const std::optional<at::Tensor>& a13_scale,
                      const std::optional<at::Tensor>& a2_scale, const std::optional<at::Tensor>& expert_map,
                      std::optional<double> swiglu_limit, bool full) {
  p = MoeParams{};
  p.M = int(c.M);
  p.topk = int(c.topk);
  p.E = int(c.E);
  p.E_global = int(c.E_global);
  p.K = int(c.K);
  p.N = int(c.N);
  p.block_n = pick_block_n(c.M, c.topk, c.E_global);
  const int64_t S = c.M * c.topk;
  const int64_t busy = std::min<int64_t>(c.E, S);
  const int64_t max_tiles = std::max<int64_t>(1, (S + busy * (p.block_n - 1)) / p.block_n);
  p.max_tiles = int(max_tiles);
  p.max_rows = int(max_tiles * p.block_n);
  const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  p.splitk = use_splitk(c, p.block_n, sms) ? 1 : 0;
  p.direct_x = !c.nvfp4 && p.block_n <= 16 && use_direct_x() ? 1 : 0;
  p.ws = use_ws(c, p.block_n, p.splitk, cta_mode) ? 1 : 0;
  if (p.splitk) {
    const GemmOccupancy occ = gemm_setup_for(p.block_n);
    p.sk_ctas = std::max(occ.gemm1, occ.gemm2) * sms;
  }

  // One allocation for the whole workspace (fewer allocator calls per step):
  // ints | xg | h | [hq | hs] | [y] | [split-K partials], each part 256-byte aligned.
  // ints: slot_pos | row_slot | tile_expert | num_tiles | error_flag | route_counts |
  // route_tile_off | sk_count | group_tile | num_groups | group_ready.
  Workspace ws;
  auto opt = x.options();
  const bool multi_cta_route = S > kMultiCtaRouteSlots;
  const int64_t n_route = multi_cta_route ? 2 * c.E + 1 : 0;
  const int64_t n_ints = S + p.max_rows + max_tiles + 2 + n_route + 2 * int64_t(p.sk_ctas) + 2 * max_tiles + 1;
  auto up = [](int64_t b) { return (b + 255) / 256 * 256; };
  const int64_t b_ints = up(n_ints * 4), b_xg = p.direct_x ? 0 : up(int64_t(p.max_rows) * c.K * 2), b_h = up(int64_t(p.max_rows) * c.N * 2);
  const int64_t b_hq = c.nvfp4 ? up(int64_t(p.max_rows) * c.N / 2) : 0;
  const int64_t b_hs = c.nvfp4 ? up(int64_t(p.max_rows) * c.N / 16) : 0;
  const int64_t b_y = full ? up(int64_t(p.max_rows) * c.K * 2) : 0;
  const int64_t b_part = up(int64_t(p.sk_ctas) * moe::kTileRows * p.block_n * 4);
  ws.bytes = at::empty({b_ints + b_xg + b_h + b_hq + b_hs + b_y + b_part}, opt.dtype(at::kByte));
  uint8_t* base = ws.bytes.data_ptr<uint8_t>();
  ws.ints = ws.bytes.slice(0, 0, n_ints * 4).view(at::kInt);
  int* ip = reinterpret_cast<int*>(base);
  p.slot_pos = ip;
  p.row_slot = ip + S;
  p.tile_expert = ip + S + p.max_rows;
  p.num_tiles = ip + S + p.max_rows + max_tiles;
  p.error_flag = p.num_tiles + 1;
  if (multi_cta_route) {
    p.route_counts = p.error_flag + 1;
    p.route_tile_off = p.route_counts + c.E;
  }
  p.sk_count = p.error_flag + 1 + n_route;
  p.group_tile = p.sk_count + 2 * p.sk_ctas;
  p.num_groups = p.group_tile + max_tiles;
  p.group_ready = p.num_groups + 1;
  uint8_t* cur = base + b_ints;
  p.xg = reinterpret_cast<__nv_bfloat16*>(cur);
  cur += b_xg;
  p.h = reinterpret_cast<__nv_bfloat16*>(cur);
  cur += b_h;
  if (c.nvfp4) {
    p.hq = cur;
    ws.hq = ws.bytes.slice(0, cur - base, cur - base + int64_t(p.max_rows) * c.N / 2).view({p.max_rows, c.N / 2});
    cur += b_hq;
    p.hs = reinterpret_cast<__nv_fp8_e4m3*>(cur);
    ws.hs = ws.bytes.slice(0, cur - base, cur - base + int64_t(p.max_rows) * c.N / 16).view({p.max_rows, c.N / 16});
    cur += b_hs;
  }
  if (full) p.y = reinterpret_cast<__nv_bfloat16*>(cur);
  cur += b_y;
  if (p.splitk) p.sk_partial = reinterpret_cast<float*>(cur);

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

void nvfp4_moe(const at::Tensor& x, const at::Tensor& topk_ids, const at::Tensor& topk_weights, const at::Tensor& w13,
               const at::Tensor& w13_scale, const at::Tensor& w13_scale_2, const at::Tensor& w2,
               const at::Tensor& w2_scale, const at::Tensor& w2_scale_2, const std::optional<at::Tensor>& a13_scale,
               const std::optional<at::Tensor>& a2_scale, const std::optional<at::Tensor>& expert_map,
               std::optional<double> swiglu_limit, c10::string_view activation, int64_t cta_mode, at::Tensor& out) {
  const Checked c = check_inputs(x, topk_ids, topk_weights, w13, w13_scale, w13_scale_2, w2, w2_scale, w2_scale_2,
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
  MoeParams p;
  Workspace ws = fill_params(p, c, cta_mode, x, topk_ids, topk_weights, w13, w13_scale, w13_scale_2, &w2, &w2_scale,
                             &w2_scale_2, a13_scale, a2_scale, expert_map, swiglu_limit, true);
  p.out = reinterpret_cast<__nv_bfloat16*>(out.data_ptr());
  run_moe(p, c, cta_mode, x, true);
}

// GEMM1 only, for tests: per (token, slot) the fp32 SwiGLU output h [M*k, N] that the
// epilogue computed, its NVFP4 encoding (nvfp4 mode; zeros otherwise) and whether the
// slot is local.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> nvfp4_moe_gemm1_debug(
    const at::Tensor& x, const at::Tensor& topk_ids, const at::Tensor& w13, const at::Tensor& w13_scale,
    const at::Tensor& w13_scale_2, const std::optional<at::Tensor>& a13_scale, const std::optional<at::Tensor>& a2_scale,
    const std::optional<at::Tensor>& expert_map, std::optional<double> swiglu_limit, c10::string_view activation,
    int64_t cta_mode) {
  at::Tensor none;
  const Checked c = check_inputs(x, topk_ids, topk_ids.to(at::kFloat), w13, w13_scale, w13_scale_2, none, none, none,
                                 a13_scale, a2_scale, expert_map, activation, cta_mode, false);
  const int64_t S = c.M * c.topk;
  auto opt = x.options();
  at::Tensor h = at::zeros({S, c.N}, opt.dtype(at::kFloat));
  at::Tensor hq = at::zeros({S, c.N / 2}, opt.dtype(at::kByte));
  at::Tensor hs = at::zeros({S, c.N / 16}, opt.dtype(at::kByte));
  at::Tensor local = at::zeros({S}, opt.dtype(at::kBool));
  if (S == 0) return {h, hq, hs.view(at::kFloat8_e4m3fn), local};
  const at::cuda::OptionalCUDAGuard guard(x.device());
  MoeParams p;
  at::Tensor tw;  // undefined: GEMM1 does not read the routing weights
  Workspace ws = fill_params(p, c, cta_mode, x, topk_ids, tw, w13, w13_scale, w13_scale_2, nullptr, nullptr, nullptr,
                             a13_scale, a2_scale, expert_map, swiglu_limit, false);
  at::Tensor h_rows = at::zeros({p.max_rows, c.N}, opt.dtype(at::kFloat));
  p.h_debug = h_rows.data_ptr<float>();
  run_moe(p, c, cta_mode, x, false);
  at::Tensor pos = ws.ints.slice(0, 0, S).to(at::kLong);
  local = pos >= 0;
  at::Tensor idx = pos.clamp_min(0);
  h = h_rows.index_select(0, idx) * local.unsqueeze(1);
  if (c.nvfp4) {
    hq = ws.hq.index_select(0, idx) * local.unsqueeze(1).to(at::kByte);
    hs = ws.hs.index_select(0, idx) * local.unsqueeze(1).to(at::kByte);
  }
  return {h, hq, hs.view(at::kFloat8_e4m3fn), local};
}

}  // namespace
}  // namespace dsv4

TORCH_LIBRARY_IMPL(dsv4, CUDA, m) {
  m.impl("nvfp4_moe", &dsv4::nvfp4_moe);
  m.impl("nvfp4_moe_gemm1_debug", &dsv4::nvfp4_moe_gemm1_debug);
}
