// Data movement (raw PTX), shared by every kernel family: shared-memory addressing,
// vector loads and stores, L2 prefetch, cp.async (sm_80+) and bulk async copies
// (sm_90, no tensor map). Torch-free.
#pragma once

#include <cstdint>

namespace dsv4 {

// ---- shared-memory addresses -------------------------------------------------------
__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// The first 1024-byte-aligned address in dynamic shared memory, by pointer arithmetic:
// a round trip through an integer would hide from the compiler that later accesses
// are to shared memory (generic 64-bit loads and stores instead of LDS/STS).
__device__ __forceinline__ uint8_t* align_smem_1024(uint8_t* p) {
  return p + ((1024u - (smem_u32(p) & 1023u)) & 1023u);
}

// ---- vector loads and stores -------------------------------------------------------
__device__ __forceinline__ uint4 lds_v4(uint32_t addr) {
  uint4 v;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(addr));
  return v;
}
__device__ __forceinline__ uint2 lds_v2(uint32_t addr) {
  uint2 v;
  asm volatile("ld.shared.v2.u32 {%0, %1}, [%2];\n" : "=r"(v.x), "=r"(v.y) : "r"(addr));
  return v;
}
__device__ __forceinline__ void sts_v4(uint32_t addr, const uint4& v) {
  asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
               : "memory");
}

// Stores into the shared memory of a CTA of the cluster: addr is a shared::cluster address
// (mapa_u32, common/ptx/sync.cuh).
// 16 bytes into the shared memory of a CTA of the cluster that complete 16 bytes of the
// transaction count of that CTA's mbarrier at shared::cluster address `mbar` (both from
// mapa_u32): the bytes are visible to the threads that see the barrier's phase complete,
// with no fence or release of the storing thread.
__device__ __forceinline__ void st_async_v4(uint32_t addr, const uint4& v, uint32_t mbar) {
  asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.b32 [%0], {%1, %2, %3, %4}, [%5];\n" ::"r"(addr),
               "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w), "r"(mbar)
               : "memory");
}
__device__ __forceinline__ void sts_cluster_u8(uint32_t addr, uint32_t v) {
  asm volatile("st.shared::cluster.u8 [%0], %1;\n" ::"r"(addr), "r"(v) : "memory");
}

// Read-only global loads (non-coherent path); the 16-byte one does not allocate in L1
// (rows read once).
__device__ __forceinline__ uint4 ldg_nc_v4(const void* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}
__device__ __forceinline__ uint2 ldg_nc_v2(const void* p) {
  uint2 v;
  asm volatile("ld.global.nc.v2.u32 {%0, %1}, [%2];\n" : "=r"(v.x), "=r"(v.y) : "l"(p));
  return v;
}

// One cache line into L2 (a per-lane address: no uniform-operand loop as with the bulk form).
__device__ __forceinline__ void prefetch_l2(const void* p) {
  asm volatile("prefetch.global.L2 [%0];\n" ::"l"(p) : "memory");
}

// ---- cp.async (sm_80+) --------------------------------------------------------------
// 16-byte global -> shared copy that bypasses registers and L1. valid = false reads nothing
// and fills the 16 bytes with zeros (src-size 0), so skipped rows need no separate store.
__device__ __forceinline__ void cp_async_16(uint32_t smem_dst, const void* gmem_src, bool valid = true) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_dst), "l"(gmem_src),
               "r"(valid ? 16 : 0)
               : "memory");
}
// The same copy with the ignore-src predicate: zero != 0 writes 16 zero bytes instead of
// reading src (which must still be a valid address). No memory clobber: the compiler may
// move other memory accesses across it (the MoE GEMMs' token copies are ordered by the
// cp.async group waits and barriers alone). Those copies written with cp_async_16 compile
// to different code (docs/perf-history/2026-12-01-device-helpers.md).
__device__ __forceinline__ void cp_async_16_unordered(uint32_t smem_dst, const void* gmem_src, uint32_t zero) {
  asm volatile(
      "{\n.reg .pred z;\nsetp.ne.b32 z, %2, 0;\ncp.async.cg.shared.global [%0], [%1], 16, z;\n}\n" ::"r"(smem_dst),
      "l"(gmem_src), "r"(zero));
}
// The same, zero-filled when key < 0: one signed compare where a 0/1 flag computed from the
// key takes a shift and a compare (the prefill GEMM1's x producer, nvfp4_gemm_ws.cuh).
__device__ __forceinline__ void cp_async_16_unordered_zero_if_negative(uint32_t smem_dst, const void* gmem_src,
                                                                       int key) {
  asm volatile(
      "{\n.reg .pred z;\nsetp.lt.s32 z, %2, 0;\ncp.async.cg.shared.global [%0], [%1], 16, z;\n}\n" ::"r"(smem_dst),
      "l"(gmem_src), "r"(key));
}
// A 4-byte copy through L1 (.ca: the only form below 16 bytes), zero-filled when zero != 0
// (src must still be a valid address); ordered like cp_async_16_unordered.
__device__ __forceinline__ void cp_async_4_unordered(uint32_t smem_dst, const void* gmem_src, uint32_t zero) {
  asm volatile(
      "{\n.reg .pred z;\nsetp.ne.b32 z, %2, 0;\ncp.async.ca.shared.global [%0], [%1], 4, z;\n}\n" ::"r"(smem_dst),
      "l"(gmem_src), "r"(zero));
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

// ---- bulk copies (cp.async.bulk, sm_90, no tensor map) -------------------------------
// `bytes` (a multiple of 16) from global to this CTA's shared memory; completion is
// counted on `bar` (complete_tx).
__device__ __forceinline__ void bulk_g2s(uint32_t dst, const void* src, uint32_t bytes, uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(dst),
      "l"(src), "r"(bytes), "r"(smem_u32(bar))
      : "memory");
}
// The same copy into the same shared-memory offset of every CTA in `cta_mask`, each
// counting it on its own barrier at `bar`'s offset.
__device__ __forceinline__ void bulk_g2s_multicast(uint32_t dst, const void* src, uint32_t bytes, uint64_t* bar,
                                                   uint16_t cta_mask) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster [%0], [%1], %2, [%3], "
      "%4;\n" ::"r"(dst),
      "l"(src), "r"(bytes), "r"(smem_u32(bar)), "h"(cta_mask)
      : "memory");
}

}  // namespace dsv4
