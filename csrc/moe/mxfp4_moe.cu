// C++ entry of the MXFP4 W4A8 MoE: dsv4::mxfp4_moe (CUDA). Validates every argument,
// sizes the workspace from shapes only, and launches on the current stream: routing
// (moe_route_kernel of the NVFP4 MoE, 8-token tiles) -> FP8 quantization of x -> GEMM1
// with the SwiGLU + FP8 epilogue -> GEMM2 -> the weighted combine (moe_combine_kernel).
// No host sync, no value-dependent allocation: CUDA-graph capturable. The kernels
// (moe/mxfp4_w4a8.cuh) are the small-batch path only, used at every M for now.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <algorithm>
#include <optional>

#include "common/checks.h"
#include "moe/moe_params.cuh"
#include "moe/mxfp4_w4a8.cuh"

namespace dsv4 {
namespace moe {
// Defined in moe_routing.cuh and compiled in nvfp4_moe.cu's translation unit (a second
// definition here would clash at link time); launched from here through their host
// stubs, which needs no relocatable device code. Keep the launch bounds in step.
constexpr int kW4a8RouteThreads = 1024;  // moe_routing.cuh kRouteThreads
__global__ void __launch_bounds__(kW4a8RouteThreads) moe_route_kernel(const MoeParams p);
__global__ void __launch_bounds__(256) moe_combine_kernel(const MoeParams p);
}  // namespace moe

namespace {

namespace w4a8 = moe::w4a8;

void mxfp4_moe(const at::Tensor& x, const at::Tensor& topk_ids, const at::Tensor& topk_weights, const at::Tensor& w13,
               const at::Tensor& w13_scale, const at::Tensor& w2, const at::Tensor& w2_scale,
               const std::optional<at::Tensor>& expert_map, std::optional<double> swiglu_limit,
               c10::string_view activation, bool ue8m0, const at::Tensor& out) {
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
  if (M == 0) return;

  const c10::cuda::CUDAGuard guard(x.device());
  cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  constexpr int BN = w4a8::kBN;
  const int64_t S = M * topk;
  const int64_t max_tiles = std::max<int64_t>(1, (S + std::min<int64_t>(E, S) * (BN - 1)) / BN);
  TORCH_CHECK(max_tiles <= 65535, "dsv4: mxfp4_moe's GEMM grid takes at most 65535 token tiles, got ", max_tiles,
              " (M * k = ", S, " slots); call it on fewer tokens at a time");
  const int64_t max_rows = max_tiles * BN, G1 = K / 128, G2 = (N + 127) / 128;

  // One allocation: ints (slot_pos | row_slot | tile_expert | num_tiles | error_flag |
  // group_ready) | xq | xs | hq | hs | y, each part 256-byte aligned.
  auto up = [](int64_t b) { return (b + 255) / 256 * 256; };
  const int64_t n_ints = S + max_rows + max_tiles + 2 + max_tiles;
  const int64_t b_ints = up(n_ints * 4), b_xq = up(M * K), b_xs = up(M * G1 * 4), b_hq = up(max_rows * N),
                b_hs = up(max_rows * G2 * 4), b_y = up(max_rows * K * 2);
  at::Tensor ws = at::empty({b_ints + b_xq + b_xs + b_hq + b_hs + b_y}, x.options().dtype(at::kByte));
  uint8_t* base = ws.data_ptr<uint8_t>();
  int* ip = reinterpret_cast<int*>(base);

  moe::MoeParams rp{};  // the fields routing and combine read
  rp.M = int(M);
  rp.topk = int(topk);
  rp.E = int(E);
  rp.E_global = int(E_global);
  rp.K = int(K);
  rp.N = int(N);
  rp.block_n = BN;
  rp.max_tiles = int(max_tiles);
  rp.max_rows = int(max_rows);
  rp.topk_ids = topk_ids.data_ptr<int>();
  rp.topk_weights = topk_weights.data_ptr<float>();
  rp.expert_map = expert_map.has_value() ? expert_map->data_ptr<int>() : nullptr;
  rp.slot_pos = ip;
  rp.row_slot = ip + S;
  rp.tile_expert = rp.row_slot + max_rows;
  rp.num_tiles = rp.tile_expert + max_tiles;
  rp.error_flag = rp.num_tiles + 1;
  rp.group_ready = rp.error_flag + 1;
  uint8_t* cur = base + b_ints;

  w4a8::W4A8Params p{};
  p.M = int(M);
  p.topk = int(topk);
  p.K = int(K);
  p.N = int(N);
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
  p.xq = cur;
  cur += b_xq;
  p.xs = reinterpret_cast<float*>(cur);
  cur += b_xs;
  p.hq = cur;
  cur += b_hq;
  p.hs = reinterpret_cast<float*>(cur);
  cur += b_hs;
  p.y = reinterpret_cast<__nv_bfloat16*>(cur);
  rp.y = p.y;
  rp.out = reinterpret_cast<__nv_bfloat16*>(out.data_ptr());

  const size_t route_smem = size_t(4 * E + 1) * sizeof(int);  // see moe_route_kernel
  if (route_smem > 48 * 1024)
    C10_CUDA_CHECK(cudaFuncSetAttribute(moe::moe_route_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        int(route_smem)));
  moe::moe_route_kernel<<<1, moe::kW4a8RouteThreads, route_smem, stream>>>(rp);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  w4a8::launch_w4a8_decode(p, int(max_tiles), stream);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  moe::moe_combine_kernel<<<unsigned(std::min<int64_t>(M, 4096)), 256, 0, stream>>>(rp);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace
}  // namespace dsv4

TORCH_LIBRARY_IMPL(dsv4, CUDA, m) { m.impl("mxfp4_moe", &dsv4::mxfp4_moe); }
