// C++ entry for dsv4::quantize_nvfp4: validates, allocates, launches.
#include <ATen/ATen.h>
#include <torch/library.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include "common/checks.h"
#include "quantize/quantize_nvfp4.cuh"

namespace dsv4 {

std::tuple<at::Tensor, at::Tensor> quantize_nvfp4(const at::Tensor& x, const at::Tensor& global_scale) {
  check_cuda(x, "x");
  check_dtype(x, at::kBFloat16, "x");
  check_dim(x, 2, "x", "[M, K]");
  check_same_device(global_scale, x, "global_scale", "x");
  check_dtype(global_scale, at::kFloat, "global_scale");
  TORCH_CHECK(global_scale.numel() == 1, "dsv4: global_scale must hold exactly 1 element, got shape ",
              global_scale.sizes());
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(K > 0 && K % 16 == 0, "dsv4: x.shape[1] (K) must be a positive multiple of 16, got ", K);
  TORCH_CHECK(M == 0 || x.stride(1) == 1, "dsv4: x must have unit stride along K, got strides ", x.strides());
  TORCH_CHECK(M <= 1 || x.stride(0) % 8 == 0, "dsv4: x row stride must be a multiple of 8 elements (16 bytes), got ",
              x.stride(0));
  if (M > 0) check_aligned(x, 16, "x");

  const at::cuda::OptionalCUDAGuard guard(x.device());
  at::Tensor codes = at::empty({M, K / 2}, x.options().dtype(at::kByte));
  at::Tensor scales = at::empty({M, K / 16}, x.options().dtype(at::kFloat8_e4m3fn));
  if (M == 0) return {codes, scales};

  QuantizeNvfp4Params p;
  p.x = reinterpret_cast<const __nv_bfloat16*>(x.data_ptr());
  p.global_scale = global_scale.data_ptr<float>();
  p.codes = reinterpret_cast<uint32_t*>(codes.data_ptr());
  p.scales = reinterpret_cast<__nv_fp8_e4m3*>(scales.data_ptr());
  const int64_t nblocks = M * (K / 16);
  TORCH_CHECK(nblocks < (int64_t(1) << 32) - (int64_t(1) << 24), "dsv4: x has ", M * K,
              " elements; quantize_nvfp4 supports fewer than 2^36");
  p.blocks = uint32_t(nblocks);
  p.blocks_per_row = FastDivmod(uint32_t(K / 16));
  p.x_row_stride = M > 1 ? x.stride(0) : K;

  // 512 x 1 with 2 resident CTAs per SM (56 registers) was the fastest of the
  // thread/unroll/grid combinations measured with the threshold encoder
  // (docs/perf-history/2026-11-30-quantize-nvfp4.md)
  constexpr int kThreads = 512, kUnroll = 1;
  const int64_t per_cta = int64_t(kThreads) * kUnroll;
  const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const int64_t blocks = std::min<int64_t>((nblocks + per_cta - 1) / per_cta, int64_t(sms) * 4);
  const auto stream = at::cuda::getCurrentCUDAStream();
  if (p.x_row_stride == K)
    quantize_nvfp4_kernel<kThreads, kUnroll, true><<<dim3(unsigned(blocks)), kThreads, 0, stream>>>(p);
  else
    quantize_nvfp4_kernel<kThreads, kUnroll, false><<<dim3(unsigned(blocks)), kThreads, 0, stream>>>(p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {codes, scales};
}

}  // namespace dsv4

TORCH_LIBRARY_IMPL(dsv4, CUDA, m) { m.impl("quantize_nvfp4", &dsv4::quantize_nvfp4); }
