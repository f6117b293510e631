// The silu of the MoE's clamped SwiGLU, silu(min(gate, L)) * clamp(up, -L, L), which
// both GEMM1 epilogues compute (nvfp4_gemm.cuh gemm1_epilogue, mxfp4_gemm.cuh
// w4a8_gemm1_kernel).
#pragma once

namespace dsv4 {
namespace moe {

// The fast division (2 ulp) instead of the IEEE one, whose refinement steps and range
// check cost 8 % of GEMM1's time in the prefill kernel: its three consumer warpgroups
// run the epilogue at once while the tensor cores idle
// (docs/perf-history/2026-12-01-nvfp4-moe-prefill-time.md). A denominator past 2^126
// (v below about -87) gives 0, the limit of silu there.
__device__ __forceinline__ float silu(float v) { return __fdividef(v, 1.0f + __expf(-v)); }

}  // namespace moe
}  // namespace dsv4
