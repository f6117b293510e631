// Synchronization (raw PTX), shared by every kernel family: mbarriers, proxy fences,
// named barriers, device-scope flags and clusters (sm_90). Torch-free.
#pragma once

#include <cstdint>

#include "common/ptx/memory.cuh"  // smem_u32

namespace dsv4 {

// ---- mbarrier --------------------------------------------------------------------
__device__ __forceinline__ void mbar_init(uint64_t* bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_u32(bar)), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_init_fence() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
  asm volatile(
      "{\n.reg .b64 st;\nmbarrier.arrive.release.cta.shared::cta.b64 st, [%0];\n}\n" ::"r"(smem_u32(bar))
      : "memory");
}
// The one expected arrival of a barrier whose phase also waits for `bytes` of bulk
// copies (complete_tx) to land.
__device__ __forceinline__ void mbar_arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile(
      "{\n.reg .b64 st;\nmbarrier.arrive.expect_tx.release.cta.shared::cta.b64 st, [%0], %1;\n}\n" ::"r"(
          smem_u32(bar)),
      "r"(bytes)
      : "memory");
}
// Arrival on the barrier at the same shared-memory offset in CTA `cta` of the cluster
// (this CTA included). Default (.release.cta) semantics: the arrival only says that
// this warp's reads of the stage retired (wgmma wait); a cluster-scope release would
// fence every arrival.
__device__ __forceinline__ void mbar_arrive_cluster(uint64_t* bar, uint32_t cta) {
  asm volatile(
      "{\n.reg .b32 remote;\n"
      "mapa.shared::cluster.u32 remote, %0, %1;\n"
      "mbarrier.arrive.shared::cluster.b64 _, [remote];\n}\n" ::"r"(smem_u32(bar)),
      "r"(cta)
      : "memory");
}
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
  asm volatile(
      "{\n.reg .pred done;\n"
      "WAIT_%=:\n"
      "mbarrier.try_wait.parity.acquire.cta.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT_%=;\n}\n" ::"r"(smem_u32(bar)),
      "r"(parity)
      : "memory");
}

// The waits of barriers that CTAs of the cluster also arrive on with a cluster-scope
// release (mbar_arrive_remote): an acquire at cluster scope, so that what the remote thread
// wrote before its arrival is visible here.
__device__ __forceinline__ void mbar_wait_cluster(uint64_t* bar, uint32_t parity) {
  asm volatile(
      "{\n.reg .pred done;\n"
      "WAIT_%=:\n"
      "mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT_%=;\n}\n" ::"r"(smem_u32(bar)),
      "r"(parity)
      : "memory");
}
// Arrival on a barrier of another CTA of the cluster (remote: its shared::cluster address,
// mapa_u32) that releases this thread's earlier writes, its stores into that CTA's shared
// memory included, at cluster scope.
__device__ __forceinline__ void mbar_arrive_remote(uint32_t remote) {
  asm volatile("mbarrier.arrive.release.cluster.shared::cluster.b64 _, [%0];\n" ::"r"(remote) : "memory");
}

// The one expected arrival of a barrier of another CTA of the cluster (remote: its
// shared::cluster address) whose phase also waits for `bytes` of st_async_v4 stores.
__device__ __forceinline__ void mbar_arrive_expect_tx_remote(uint32_t remote, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.release.cluster.shared::cluster.b64 _, [%0], %1;\n" ::"r"(remote),
               "r"(bytes)
               : "memory");
}
// `count` arrivals on a barrier of another CTA of the cluster with the default (.release.cta)
// semantics, as mbar_arrive_cluster: they only say that reads of a stage retired.
__device__ __forceinline__ void mbar_arrive_remote_count(uint32_t remote, uint32_t count) {
  asm volatile("mbarrier.arrive.shared::cluster.b64 _, [%0], %1;\n" ::"r"(remote), "r"(count) : "memory");
}

// A ring of kSlots mbarrier-guarded slots: the next slot, and the parity its mbarrier
// completes with next (it flips each time the ring wraps).
template <int kSlots>
__device__ __forceinline__ void ring_advance(int& slot, uint32_t& phase) {
  if (++slot == kSlots) {
    slot = 0;
    phase ^= 1;
  }
}

// ---- proxy fences ----------------------------------------------------------------
// Generic-proxy smem writes -> visible to wgmma and bulk copies (async proxy).
__device__ __forceinline__ void fence_proxy_async_smem() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}
// Orders this thread's earlier generic-proxy global accesses (an acquire that observed
// another kernel's or CTA's plain stores) before its later bulk copies (async proxy).
__device__ __forceinline__ void fence_proxy_async_global() {
  asm volatile("fence.proxy.async.global;\n" ::: "memory");
}

// ---- named barriers --------------------------------------------------------------
__device__ __forceinline__ void named_bar_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
// Signals a named barrier without waiting (the other side waits with named_bar_sync).
__device__ __forceinline__ void named_bar_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// ---- flags between CTAs and kernels ------------------------------------------------
// Spins until *flag >= target (acquire, device scope).
__device__ __forceinline__ void wait_flag_geq(const int* flag, int target) {
  int v;
  while (true) {
    asm volatile("ld.acquire.gpu.global.b32 %0, [%1];\n" : "=r"(v) : "l"(flag) : "memory");
    if (v >= target) break;
    __nanosleep(256);
  }
}

// ---- clusters --------------------------------------------------------------------
__device__ __forceinline__ uint32_t cluster_cta_rank() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
  return r;
}
// The shared::cluster address of shared-memory address `addr` (a 32-bit shared::cta one) in
// CTA `cta` of the cluster. A CTA's shared memory is one contiguous window of the cluster's,
// so offsets add to the result as to addr.
__device__ __forceinline__ uint32_t mapa_u32(uint32_t addr, uint32_t cta) {
  uint32_t r;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(r) : "r"(addr), "r"(cta));
  return r;
}
// All threads of all CTAs of the cluster (release / acquire).
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}

}  // namespace dsv4
