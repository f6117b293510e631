// The one compilation of the MoE's routing, gather and combine kernels (routing.cuh)
// and their host launchers (routing.h), shared by dsv4::nvfp4_moe and dsv4::mxfp4_moe.
#include "moe/routing.h"

#include <c10/cuda/CUDAException.h>

#include "common/launch.h"
#include "moe/routing.cuh"

namespace dsv4 {
namespace moe {

void launch_routing(const MoeParams& p, bool multi_cta, cudaStream_t stream) {
  const size_t route_smem = size_t(4 * p.E + 1) * sizeof(int);  // see moe_route_kernel
  if (route_smem > 48 * 1024)
    C10_CUDA_CHECK(cudaFuncSetAttribute(moe_route_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(route_smem)));
  if (multi_cta) {  // count -> tables -> place (see moe_count_kernel)
    const unsigned ctas = unsigned((int64_t(p.M) * p.topk + kRouteSlotsPerCta - 1) / kRouteSlotsPerCta);
    const size_t count_smem = size_t(p.E) * sizeof(int);
    if (count_smem > 48 * 1024)
      C10_CUDA_CHECK(cudaFuncSetAttribute(moe_count_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(count_smem)));
    C10_CUDA_CHECK(cudaMemsetAsync(p.error_flag, 0, size_t(1 + p.E) * sizeof(int), stream));  // + route_counts
    moe_count_kernel<<<ctas, kRouteThreads, count_smem, stream>>>(p);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    moe_route_kernel<<<1, kRouteThreads, route_smem, stream>>>(p);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    moe_place_kernel<<<ctas, kRouteThreads, 0, stream>>>(p);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  } else {
    moe_route_kernel<<<1, kRouteThreads, route_smem, stream>>>(p);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
}

void launch_gather(const MoeParams& p, int ctas, bool pdl, cudaStream_t stream) {
  launch_kernel(p.act_nvfp4 ? moe_gather_kernel<true> : moe_gather_kernel<false>, dim3(unsigned(ctas)), dim3(256),
                    0, stream, pdl, p);
}

void launch_combine(const MoeParams& p, int ctas, bool pdl, cudaStream_t stream) {
  launch_kernel(moe_combine_kernel, dim3(unsigned(ctas)), dim3(256), 0, stream, pdl, p);
}

}  // namespace moe
}  // namespace dsv4
