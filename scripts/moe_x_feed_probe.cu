// Feed probe for the NVFP4 prefill GEMM1 reading its token rows from x (issue 33,
// docs/perf-history/2026-12-07-moe-x-producer-feed.md): how fast can a producer fill a ring of
// 192-row x 64-column bf16 stages in the swizzled layout the wgmmas read (act_offset: row r at
// (r / 64) * 8 KB + (r % 64) * 128, 16-byte chunk c at c ^ (r % 8)), with no consumer work, by
//   bulk    one thread, three 8 KB bulk copies of pre-tiled rows (the gather path's xg)
//   cp      96 threads, 16-byte cp.async of x rows + cp.async.mbarrier.arrive.noinc (the
//           scheme of moe_gemm_ws_kernel's ws_producer_x), each row's token read per copy;
//           the consumer warps fence the async proxy after each wait
//   cpnf    the same without the consumers' fence
//   tma     one warp, one tensor copy per row (a tensor map over x [M, K], box 64 x 1, 128-byte
//           swizzle: the swizzle follows the shared-memory address, so a lone row lands where
//           the bulk copies of xg place it), completion by transaction bytes
//   tma1    the same copies issued by one thread
//   cpreg   cp with the rows' offsets in registers, read once per unit (as ws_producer_x)
//   cp128   cpreg with 128 threads
//   ldst    96 threads load their 16 chunks to registers, store them to shared memory, fence
//           the async proxy and arrive (the generic path)
//   bulkrow one warp, one plain 128-byte bulk copy per row (no swizzle, rows without a token
//           read token 0: the wrong layout, timed only for the copy engine's cost per small copy)
// and does the tensor copy of a lone row land in that layout at the row's 128-byte offset
// (check, against the host's placement; rows without a token, coordinate -1, zero-filled)?
// Units as the prefill kernel walks them: CTA b takes units b, b + grid, ...; unit u reads the
// 192 token rows of group u / upg (random tokens of x, 1/16 of them without a slot) over K.
//
//   nvcc -gencode arch=compute_90a,code=sm_90a -O3 -std=c++17 -I csrc -o /tmp/moe_x_feed_probe \
//        scripts/moe_x_feed_probe.cu
//   /tmp/moe_x_feed_probe [M (8192)] [K (4096)] [units per group (21)] [units per CTA (4)]
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "common/ptx/memory.cuh"
#include "common/ptx/sync.cuh"
#include "moe/params.cuh"  // act_offset

using namespace dsv4;

#define CK(x)                                                                                   \
  do {                                                                                          \
    cudaError_t e_ = (x);                                                                       \
    if (e_ != cudaSuccess) {                                                                    \
      printf("CUDA error %s at %s:%d\n", cudaGetErrorString(e_), __FILE__, __LINE__);          \
      exit(1);                                                                                  \
    }                                                                                           \
  } while (0)

constexpr int kStages = 5, kRows = 192, kBlock = 8192, kStageBytes = 3 * kBlock;
constexpr int kSmem = kStages * kStageBytes + 2 * kStages * 8 + 1024;
enum Mode { kBulk, kCp, kCpNoFence, kTma, kTma1, kCpReg, kCp128, kLdSt, kBulkRow };

__device__ __forceinline__ void tma_row(uint32_t dst, const CUtensorMap* map, int k0, int row, uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], "
      "[%4];\n" ::"r"(dst),
      "l"(map), "r"(k0), "r"(row), "r"(smem_u32(bar))
      : "memory");
}

// Byte offset in a stage of chunk c of row r: the prefill kernel's layout (params.cuh act_offset,
// a stage being 64 columns wide), and of the row's 128-byte line (where a copy that swizzles
// by address, the tensor copy, is aimed).
__host__ __device__ __forceinline__ uint32_t row_place(int r, int c) {
  return uint32_t(2 * moe::act_offset<true>(r, c, 64));
}
__device__ __forceinline__ uint32_t row_line(int r) { return uint32_t(r) * 128; }  // 8 KB blocks of 64 lines

// tok[g * 192 + r]: token of row r of group g, -1 without a slot. xg: [groups, K / 64, 3, 8 KB] pre-tiled.
template <int kMode>
__global__ void __launch_bounds__(256, 1)
    feed_kernel(const __grid_constant__ CUtensorMap map, const __nv_bfloat16* x, const uint8_t* xg, const int* tok,
                int K, int units, int upg, unsigned long long* sink) {
  extern __shared__ uint8_t raw[];
  uint8_t* smem = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(raw) + 1023) & ~uintptr_t(1023));
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + kStages * kStageBytes);
  uint64_t* empty = full + kStages;
  const int KT = K / 64;
  const bool cp = kMode == kCp || kMode == kCpNoFence || kMode == kCpReg;
  const int nthr = kMode == kCp128 ? 128 : kMode == kLdSt ? 96 : cp ? 96 : 1;
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      mbar_init(full + s, nthr);
      mbar_init(empty + s, 4);
    }
    mbar_init_fence();
  }
  __syncthreads();
  const uint32_t ring = smem_u32(smem);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  int s = 0;
  uint32_t phase = 0;
  if (warp < 4) {  // producer warps
    bool mine = warp == 0 && lane == 0;  // bulk, tma1
    if (kMode == kCp128) mine = true;
    else if (cp || kMode == kLdSt) mine = warp != 1;
    else if (kMode == kTma || kMode == kBulkRow) mine = warp == 0;
    if (!mine) return;
    const int q = kMode == kCp128 ? int(threadIdx.x) : warp == 0 ? lane : threadIdx.x - 64;  // 0..95 (0..127)
    constexpr int kT = kMode == kCp128 ? 128 : 96, kRP = kT / 8, kPass = kRows / kRP;
    int off[kPass];
    for (int u = blockIdx.x; u < units; u += gridDim.x) {
      const int g = u / upg;
      if constexpr (kMode == kCpReg || kMode == kCp128 || kMode == kLdSt) {
#pragma unroll
        for (int j = 0; j < kPass; ++j) off[j] = __ldg(tok + g * kRows + (q >> 3) + kRP * j) * K;
      }
      for (int kt = 0; kt < KT; ++kt) {
        mbar_wait(empty + s, phase ^ 1);
        const uint32_t st = ring + s * kStageBytes;
        if constexpr (kMode == kBulk) {
          mbar_arrive_expect_tx(full + s, kStageBytes);
          for (int j = 0; j < 3; ++j)
            bulk_g2s(st + j * kBlock, xg + ((size_t(g) * KT + kt) * 3 + j) * kBlock, kBlock, full + s);
        } else if constexpr (kMode == kBulkRow) {
          if (lane == 0) mbar_arrive_expect_tx(full + s, kRows * 128);
          __syncwarp();
          for (int r = lane; r < kRows; r += 32) {
            const int t = __ldg(tok + g * kRows + r);
            bulk_g2s(st + row_line(r), x + size_t(max(t, 0)) * K + kt * 64, 128, full + s);
          }
        } else if constexpr (kMode == kTma || kMode == kTma1) {
          if (lane == 0) mbar_arrive_expect_tx(full + s, kRows * 128);
          __syncwarp(kMode == kTma ? 0xffffffffu : 1u);
          for (int r = kMode == kTma ? lane : 0; r < kRows; r += kMode == kTma ? 32 : 1)
            tma_row(st + row_line(r), &map, kt * 64, __ldg(tok + g * kRows + r), full + s);
        } else if constexpr (kMode == kCpReg || kMode == kCp128) {
          const int c = q & 7;
          const __nv_bfloat16* xk = x + kt * 64 + c * 8;
#pragma unroll
          for (int j = 0; j < kPass; ++j) {
            const int r = (q >> 3) + kRP * j;
            cp_async_16_unordered(st + row_place(r, c), xk + max(off[j], 0), off[j] < 0);
          }
          cp_async_mbar_arrive_noinc(full + s);
        } else if constexpr (kMode == kLdSt) {
          const int c = q & 7;
          const __nv_bfloat16* xk = x + kt * 64 + c * 8;
          uint4 v[kPass];
#pragma unroll
          for (int j = 0; j < kPass; ++j)
            v[j] = off[j] < 0 ? make_uint4(0, 0, 0, 0) : __ldg(reinterpret_cast<const uint4*>(xk + off[j]));
#pragma unroll
          for (int j = 0; j < kPass; ++j) {
            const int r = (q >> 3) + kRP * j;
            *reinterpret_cast<uint4*>(smem + s * kStageBytes + row_place(r, c)) = v[j];
          }
          fence_proxy_async_smem();
          mbar_arrive(full + s);
        } else {
          const int c = q & 7;
          for (int r = q >> 3; r < kRows; r += 12) {
            const int t = __ldg(tok + g * kRows + r);
            cp_async_16_unordered(st + row_place(r, c), x + size_t(max(t, 0)) * K + kt * 64 + c * 8, t < 0);
          }
          cp_async_mbar_arrive_noinc(full + s);
        }
        if (++s == kStages) {
          s = 0;
          phase ^= 1;
        }
      }
    }
    if (cp || kMode == kCp128) cp_async_wait_all();
  } else {  // consumer warps: wait, touch one word, release
    unsigned long long acc = 0;
    for (int u = blockIdx.x; u < units; u += gridDim.x) {
      for (int kt = 0; kt < KT; ++kt) {
        mbar_wait(full + s, phase);
        if (kMode == kCp) fence_proxy_async_smem();
        acc += *reinterpret_cast<const uint32_t*>(smem + s * kStageBytes + threadIdx.x * 64);
        __syncwarp();
        if (lane == 0) mbar_arrive(empty + s);
        if (++s == kStages) {
          s = 0;
          phase ^= 1;
        }
      }
    }
    if (acc == 0x123456789ull) *sink = acc;
  }
}

// One stage of group 0 at K step kt by tensor copies, written back raw.
__global__ void check_kernel(const __grid_constant__ CUtensorMap map, const int* tok, int kt, uint8_t* out) {
  extern __shared__ uint8_t raw[];
  uint8_t* smem = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(raw) + 1023) & ~uintptr_t(1023));
  uint64_t* bar = reinterpret_cast<uint64_t*>(smem + kStageBytes);
  if (threadIdx.x == 0) {
    mbar_init(bar, 1);
    mbar_init_fence();
  }
  __syncthreads();
  if (threadIdx.x < 32) {
    if (threadIdx.x == 0) mbar_arrive_expect_tx(bar, kRows * 128);
    __syncwarp();
    for (int r = threadIdx.x; r < kRows; r += 32)
      tma_row(smem_u32(smem) + row_line(r), &map, kt * 64, tok[r], bar);
  }
  mbar_wait(bar, 0);
  for (int i = threadIdx.x; i < kStageBytes; i += blockDim.x) out[i] = smem[i];
}

int main(int argc, char** argv) {
  const int M = argc > 1 ? atoi(argv[1]) : 8192, K = argc > 2 ? atoi(argv[2]) : 4096;
  const int upg = argc > 3 ? atoi(argv[3]) : 21, per_cta = argc > 4 ? atoi(argv[4]) : 4;
  int sms = 0;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  const int units = sms * per_cta, groups = (units + upg - 1) / upg, KT = K / 64;
  std::vector<__nv_bfloat16> hx(size_t(M) * K);
  srand(7);
  for (auto& v : hx) v = __float2bfloat16(float(rand() % 2001 - 1000) / 64.0f);
  std::vector<int> htok(size_t(groups) * kRows);
  for (auto& t : htok) t = rand() % 16 == 0 ? -1 : rand() % M;
  // xg: each group's rows pre-tiled as the gather kernel writes them
  std::vector<uint8_t> hxg(size_t(groups) * KT * kStageBytes, 0);
  for (int g = 0; g < groups; ++g)
    for (int kt = 0; kt < KT; ++kt)
      for (int r = 0; r < kRows; ++r)
        for (int c = 0; c < 8; ++c) {
          const int t = htok[g * kRows + r];
          uint8_t* d = &hxg[(size_t(g) * KT + kt) * kStageBytes + row_place(r, c)];
          if (t < 0) memset(d, 0, 16);
          else memcpy(d, &hx[size_t(t) * K + kt * 64 + c * 8], 16);
        }
  __nv_bfloat16* x;
  uint8_t *xg, *out;
  int* tok;
  unsigned long long* sink;
  CK(cudaMalloc(&x, hx.size() * 2));
  CK(cudaMalloc(&xg, hxg.size()));
  CK(cudaMalloc(&tok, htok.size() * 4));
  CK(cudaMalloc(&out, kStageBytes));
  CK(cudaMalloc(&sink, 8));
  CK(cudaMemcpy(x, hx.data(), hx.size() * 2, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(xg, hxg.data(), hxg.size(), cudaMemcpyHostToDevice));
  CK(cudaMemcpy(tok, htok.data(), htok.size() * 4, cudaMemcpyHostToDevice));

  PFN_cuTensorMapEncodeTiled_v12000 encode = nullptr;
  cudaDriverEntryPointQueryResult qr;
  CK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", reinterpret_cast<void**>(&encode), 12000,
                                      cudaEnableDefault, &qr));
  CUtensorMap map;
  cuuint64_t dims[2] = {cuuint64_t(K), cuuint64_t(M)};
  cuuint64_t strides[1] = {cuuint64_t(K) * 2};
  cuuint32_t box[2] = {64, 1}, es[2] = {1, 1};
  CUresult cr = encode(&map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, x, dims, strides, box, es,
                       CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                       CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (cr != CUDA_SUCCESS) {
    printf("cuTensorMapEncodeTiled failed: %d\n", int(cr));
    return 1;
  }

  // check: a lone row's tensor copy lands at its place in the swizzled layout
  CK(cudaFuncSetAttribute(check_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kStageBytes + 2048));
  int bad = 0;
  for (int kt : {0, KT / 2, KT - 1}) {
    check_kernel<<<1, 128, kStageBytes + 2048>>>(map, tok, kt, out);
    CK(cudaDeviceSynchronize());
    std::vector<uint8_t> ho(kStageBytes);
    CK(cudaMemcpy(ho.data(), out, kStageBytes, cudaMemcpyDeviceToHost));
    if (memcmp(ho.data(), &hxg[size_t(kt) * kStageBytes], kStageBytes) != 0) ++bad;
  }
  printf("check: tensor copies of lone rows %s the gather's tiled layout (3 K steps, %d zero rows)\n",
         bad ? "DIFFER from" : "match", int(std::count(htok.begin(), htok.begin() + kRows, -1)));

  auto run = [&](auto kernel, const char* name) {
    CK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem));
    cudaEvent_t a, b;
    CK(cudaEventCreate(&a));
    CK(cudaEventCreate(&b));
    kernel<<<sms, 256, kSmem>>>(map, x, xg, tok, K, units, upg, sink);
    CK(cudaEventRecord(a));
    const int reps = 5;
    for (int i = 0; i < reps; ++i) kernel<<<sms, 256, kSmem>>>(map, x, xg, tok, K, units, upg, sink);
    CK(cudaEventRecord(b));
    CK(cudaEventSynchronize(b));
    float ms = 0;
    CK(cudaEventElapsedTime(&ms, a, b));
    const double us = 1e3 * ms / reps, stages = double(per_cta) * KT;
    printf("%-6s %8.1f us  %6.3f us per stage per SM  %6.2f TB/s into shared memory\n", name, us, us / stages,
           double(units) * KT * kStageBytes / (us * 1e-6) / 1e12);
  };
  printf("M %d K %d, %d SMs, units per group %d, %d units per CTA (%d stages of 24 KB each)\n", M, K, sms, upg,
         per_cta, per_cta * KT);
  run(feed_kernel<kBulk>, "bulk");
  run(feed_kernel<kCp>, "cp");
  run(feed_kernel<kCpNoFence>, "cpnf");
  run(feed_kernel<kTma>, "tma");
  run(feed_kernel<kCpReg>, "cpreg");
  run(feed_kernel<kCp128>, "cp128");
  run(feed_kernel<kLdSt>, "ldst");
  run(feed_kernel<kBulkRow>, "bulkrow");
  return 0;
}
