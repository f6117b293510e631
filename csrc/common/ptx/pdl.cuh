// Programmatic dependent launch (griddepcontrol, sm_90). A kernel launched with the
// programmatic-stream-serialization attribute may start while its predecessor drains:
// pdl_wait() blocks until the predecessor grid has completed and its memory is visible,
// pdl_launch_dependents() lets the successor launch. Both are no-ops in a kernel
// launched without the attribute. Torch-free.
#pragma once

namespace dsv4 {

__device__ __forceinline__ void pdl_wait() { asm volatile("griddepcontrol.wait;\n" ::: "memory"); }
__device__ __forceinline__ void pdl_launch_dependents() { asm volatile("griddepcontrol.launch_dependents;\n" :::); }

}  // namespace dsv4
