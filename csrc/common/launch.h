// One host helper for every dsv4 kernel launch that needs launch attributes: programmatic
// stream serialization (PDL: the kernel may be scheduled while its predecessor in the
// stream drains; the kernel side is common/ptx/pdl.cuh) and thread-block clusters.
// cudaLaunchKernelEx is captured into CUDA graphs like a plain launch (a programmatic edge
// where `pdl`).
#pragma once

#include <c10/cuda/CUDAException.h>
#include <cuda_runtime.h>

namespace dsv4 {

template <typename Params>
void launch_kernel(void (*kernel)(Params), dim3 grid, dim3 block, size_t smem, cudaStream_t stream, bool pdl,
                   const Params& p, int cluster = 1) {
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

// CTAs of `kernel` resident at once in clusters of `cluster` along x (a GPC with free SMs
// left over leaves them idle): cluster x cudaOccupancyMaxActiveClusters for `threads`
// threads and `smem` bytes of dynamic shared memory (set beforehand). `ctas` bounds the
// grid the runtime is asked about (a multiple of the cluster is taken).
template <typename Params>
int max_cluster_ctas(void (*kernel)(Params), int ctas, int threads, size_t smem, int cluster) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(unsigned(ctas / cluster * cluster));
  cfg.blockDim = dim3(unsigned(threads));
  cfg.dynamicSmemBytes = smem;
  cudaLaunchAttribute attr;
  attr.id = cudaLaunchAttributeClusterDimension;
  attr.val.clusterDim.x = unsigned(cluster);
  attr.val.clusterDim.y = 1;
  attr.val.clusterDim.z = 1;
  cfg.attrs = &attr;
  cfg.numAttrs = 1;
  int clusters = 0;
  C10_CUDA_CHECK(cudaOccupancyMaxActiveClusters(&clusters, kernel, &cfg));
  return clusters * cluster;
}

}  // namespace dsv4
