// Shared-memory addressing and cp.async (sm_80+) helpers used by the attention and
// fmha kernels. Torch-free.
#pragma once

#include <cstdint>

namespace dsv4 {

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// The first 1024-byte-aligned address in dynamic shared memory, by pointer arithmetic:
// a round trip through an integer would hide from the compiler that later accesses
// are to shared memory (generic 64-bit loads and stores instead of LDS/STS).
__device__ __forceinline__ uint8_t* align_smem_1024(uint8_t* p) {
  return p + ((1024u - (smem_u32(p) & 1023u)) & 1023u);
}

// 16-byte global -> shared copy that bypasses registers and L1. valid = false reads nothing
// and fills the 16 bytes with zeros (src-size 0), so skipped rows need no separate store.
__device__ __forceinline__ void cp_async_16(uint32_t smem_dst, const void* gmem_src, bool valid = true) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_dst), "l"(gmem_src),
               "r"(valid ? 16 : 0)
               : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;\n" ::: "memory"); }

// One of the mbarrier's expected arrivals, made when this thread's earlier cp.async copies
// have landed (.noinc: the arrival is not added to the expected count), so the producer
// never blocks on its own copies.
__device__ __forceinline__ void cp_async_mbar_arrive_noinc(uint64_t* bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(smem_u32(bar)) : "memory");
}

}  // namespace dsv4
