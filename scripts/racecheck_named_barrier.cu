// The named-barrier hand-off of sparse_mqa_fwd_kernel's consumers (csrc/attention/sparse_mqa.cuh,
// the running maxima smax_fw / smax_bw) in a kernel of its own, in 64 variants, for
// compute-sanitizer racecheck (issue 34: racecheck reports RAW hazards on smax_bw between
// consumer 1's store and consumer 0's load across bar.arrive / bar.sync of kBarMax1).
//
//   nvcc -arch=sm_90a -O3 -lineinfo -o /tmp/racecheck_named_barrier scripts/racecheck_named_barrier.cu
//   compute-sanitizer --tool racecheck --racecheck-report all /tmp/racecheck_named_barrier
//
// Each variant is its own kernel instance, race_kernel<V>, so a report names the variant.
// The hand-off is the kernel's, per round r with parity ph = r & 1 (256 consumer threads,
// 128 per warpgroup; row r0 = 16 warp + lane / 4 and r0 + 8):
//   consumer 0: store fw[ph][rows]; bar.arrive 2; ...; bar.sync 3; load bw[ph][rows];
//               bar.arrive 4; bar.sync 5
//   consumer 1: bar.sync 2; load fw[ph][rows]; store bw[ph][rows]; ...; bar.arrive 3;
//               bar.arrive 5; bar.sync 4
// Every load is ordered after the store it reads by one bar.arrive -> bar.sync pair, and
// every store of a buffer after the last load of it (two rounds earlier) through barrier 4
// or 5: no race. The variant bits add one difference each between this kernel and the
// earlier minimal kernel (which gave 0 hazards):
//   1  kGeneric: shared memory through a generic pointer (the kernel aligns its dynamic
//      smem with an integer round trip, so ptxas emits LD.E / ST.E instead of LDS / STS)
//   2  kLate: consumer 1 works ~4000 cycles between its store and its bar.arrive, so consumer
//      0 is already waiting in bar.sync (in the kernel's SASS, ptxas moves the softmax's
//      exponentials between the st and the bar.arrive)
//   4  kQuad: only lanes with lane % 4 == 0 store (the kernel's `quad == 0`)
//   8  kMbar: consumer 0 arrives on an mbarrier right before its bar.sync 3 (the kernel's
//      freed[0] arrive, SYNCS.ARRIVE just before BAR.SYNC 0x3)
//  16  kProducer: a third warpgroup (threads 0-127) that takes part in the first
//      __syncthreads and exits early (the kernel's producer); without it 256 threads
//  32  kItems: 3 work items of 3 rounds each, the barrier phases continuing (one item of one
//      round otherwise, like tests/test_attention.py -k single_block)
#include <cstdio>
#include <cstdint>

#include <cuda_runtime.h>

namespace {

constexpr int kGeneric = 1, kLate = 2, kQuad = 4, kMbar = 8, kProducer = 16, kItems = 32;

__device__ __forceinline__ void bar_sync(int id) { asm volatile("bar.sync %0, 256;\n" ::"r"(id) : "memory"); }
__device__ __forceinline__ void bar_arrive(int id) { asm volatile("bar.arrive %0, 256;\n" ::"r"(id) : "memory"); }
__device__ __forceinline__ void mbar_init(uint64_t* bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(static_cast<uint32_t>(__cvta_generic_to_shared(bar))),
               "r"(count)
               : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
  asm volatile("{\n.reg .b64 st;\nmbarrier.arrive.release.cta.shared::cta.b64 st, [%0];\n}\n" ::"r"(
                   static_cast<uint32_t>(__cvta_generic_to_shared(bar)))
               : "memory");
}
__device__ __forceinline__ void spin(long long cycles) {
  const long long t0 = clock64();
  while (clock64() - t0 < cycles) {
  }
}

template <int V>
__global__ void __launch_bounds__(384, 1) race_kernel(float* out) {
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = (V & kGeneric)
                      ? reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023))
                      : smem_raw;
  float* fw = reinterpret_cast<float*>(smem);              // [parity][64]
  float* bw = reinterpret_cast<float*>(smem + 2 * 64 * 4);  // [parity][64]
  uint64_t* freed = reinterpret_cast<uint64_t*>(smem + 4 * 64 * 4);
  const int base = (V & kProducer) ? 128 : 0;
  if (threadIdx.x == 0) {
    mbar_init(freed, 128);
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();
  if (static_cast<int>(threadIdx.x) < base) return;  // the producer warpgroup
  const int t = threadIdx.x - base;
  const int g = __shfl_sync(0xffffffffu, t >> 7, 0), lt = t & 127;  // warp-uniform, as in the kernel
  const int w = lt >> 5, lane = lt & 31, quad = lane & 3;
  const int r0 = 16 * w + (lane >> 2);
  const bool store = !(V & kQuad) || quad == 0;
  const int items = (V & kItems) ? 3 : 1, rounds = (V & kItems) ? 3 : 1;
  float acc = 0.f;
  int round_base = 0;
  for (int item = 0; item < items; ++item) {
    for (int r = 0; r < rounds; ++r) {
      const int ph = (round_base + r) & 1;
      if (g == 0) {
        if (store) {
          fw[64 * ph + r0] = acc + r;
          fw[64 * ph + r0 + 8] = acc - r;
        }
        bar_arrive(2);
        if (V & kMbar) mbar_arrive(freed);
        bar_sync(3);
        acc += bw[64 * ph + r0] + bw[64 * ph + r0 + 8];
        bar_arrive(4);
        bar_sync(5);
      } else {
        bar_sync(2);
        const float a = fw[64 * ph + r0], b = fw[64 * ph + r0 + 8];
        if (store) {
          bw[64 * ph + r0] = a + 1.f;
          bw[64 * ph + r0 + 8] = b + 1.f;
        }
        if (V & kLate) spin(4000);
        bar_arrive(3);
        acc += a - b;
        bar_arrive(5);
        bar_sync(4);
      }
    }
    round_base += rounds;
    bar_sync(6);  // the epilogue's row-sum exchange (both consumers)
  }
  out[blockIdx.x * 256 + t] = acc;
}

template <int V>
void launch_all(float* out) {
  if constexpr (V < 64) {
    const int threads = (V & kProducer) ? 384 : 256;
    race_kernel<V><<<2, threads, 4096>>>(out);
    launch_all<V + 1>(out);
  }
}

}  // namespace

int main() {
  float* out = nullptr;
  if (cudaMalloc(&out, 2 * 256 * sizeof(float)) != cudaSuccess) return 1;
  launch_all<0>(out);
  const cudaError_t e = cudaDeviceSynchronize();
  std::printf("racecheck_named_barrier: 64 variants ran: %s\n", cudaGetErrorString(e));
  cudaFree(out);
  return e == cudaSuccess ? 0 : 1;
}
