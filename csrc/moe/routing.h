// Host launchers of the kernels around the MoE's grouped GEMMs (routing.cuh; their one
// compilation is routing.cu), called by both ops: dsv4::nvfp4_moe (nvfp4_moe.cu) and
// dsv4::mxfp4_moe (mxfp4_moe.cu). Each launches on `stream`; none syncs the host.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>

#include "moe/params.cuh"

namespace dsv4 {
namespace moe {

// Routing prep (moe_route_kernel): per local expert its slots' padded rows (slot_pos,
// row_slot), the tile -> expert table (tile_expert, num_tiles), with p.ws the prefill
// groups (group_tile, num_groups); zeroes error_flag, sk_count and group_ready.
// multi_cta: count -> route -> place on one CTA per kRouteSlotsPerCta slots
// (route_counts, route_tile_off must be set), else one CTA.
void launch_routing(const MoeParams& p, bool multi_cta, cudaStream_t stream);

// GEMM1's B operand rows (xg) from x: bf16, or NVFP4 code * block scale when
// p.act_nvfp4 (moe_gather_kernel); `ctas` CTAs of 256 threads.
void launch_gather(const MoeParams& p, int ctas, bool pdl, cudaStream_t stream);

// out[t] = sum_j topk_weights[t, j] * y[slot_pos[t, j]] (moe_combine_kernel); `ctas`
// CTAs of 256 threads.
void launch_combine(const MoeParams& p, int ctas, bool pdl, cudaStream_t stream);

}  // namespace moe
}  // namespace dsv4
