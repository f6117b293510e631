// Compute-loop probe for a warp-specialized MXFP4 W4A8 prefill GEMM (issue 33): how fast can
// the consumer loop of mxfp4_gemm.cuh (chunk_fragments -> 4 e4m3 wgmmas -> wait -> promotion)
// run when its token tile is widened, its A fragments converted ahead or its partial sums
// double-buffered, before any of that is built into mxfp4_moe
// (docs/perf-history/2026-12-06-mxfp4-w4a8-ws-loop-probe.md). Random bytes, no epilogue, no
// routing: only the K loop and the ring that feeds it, on every SM, timed by CUDA events.
//
//   nvcc -gencode arch=compute_90a,code=sm_90a -O3 -std=c++17 -I csrc -Xptxas -v \
//        -o /tmp/w4a8_loop_probe scripts/w4a8_loop_probe.cu
//   /tmp/w4a8_loop_probe [units per CTA (8)]
//
// Variants (one kernel instance each; TFLOP/s counts 2 * rows * tokens * 128 per chunk):
//   pair      the main pair kernel's loop (mxfp4_gemm1_pair_kernel): 128 threads, 4 CTAs per
//             SM, 64 weight rows x 2 tiles of 64 tokens, a 2-slot ring filled by its own warps
//   ws        a producer warpgroup (one thread issues bulk copies into a kStages ring) and C
//             consumer warpgroups of 64 weight rows each over the same NT tokens, with
//             setmaxnreg; PN = the wgmma's N (NT / PN passes, each waited for and promoted)
//   +rb       the promotion without the per-row multiply (acc += part * s_x: one weight base per
//             row, applied at the end; docs/perf-history/2026-12-05-mxfp4-w4a8-row-base.md)
//   +pa       the next chunk's A fragments converted while this chunk's wgmmas run
//   +dp       two partial sums: chunk c's wgmmas issued before chunk c - 1's promotion (as
//             compiled: ptxas serializes the wgmmas, C7514; see the note)
//   +dp2      two partial sums per pair of chunks, both issued before either promotion
//   +st       the tokens stay in shared memory (only weights stream): the L2 feed taken out
//   ss        a converter warpgroup writes each chunk's e4m3 weight tile (128 rows) to shared
//             memory once for 128 tokens; two MMA warpgroups run SS wgmma m64n128k32 on it
//             (tokens as A), as a DeepGEMM-style FP8 GEMM with the conversion beside it (H200:
//             0.82x the pair loop, the converter warp the bottleneck; dropped, see the note)
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "common/ptx/regs.cuh"
#include "moe/mxfp4_gemm.cuh"

using namespace dsv4;
using namespace dsv4::moe;
using namespace dsv4::moe::w4a8;

namespace probe {

constexpr int KT = 56;  // K chunks per unit: V4-Pro GEMM1, K = 7168

// Random bytes: e4m3 bytes below 2 in magnitude (no NaN), fp32 words finite, any e2m1 codes.
__global__ void fill(uint32_t* p, size_t n, uint32_t seed) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    uint32_t x = uint32_t(i) * 2654435761u ^ seed;
    x ^= x >> 15;
    x *= 2246822519u;
    x ^= x >> 13;
    p[i] = x & 0x3F3F3F3Fu;
  }
}

struct Bufs {
  const uint8_t* wq;   // weight code tiles (kCodeTile each)
  const uint8_t* wsc;  // their scale tiles (kScaleTile each)
  const uint8_t* tok;  // token chunks: rows of 128 FP8 bytes
  const float* tsx;    // token scales
  size_t wtiles;       // weight tiles in wq / wsc
  size_t trows;        // token rows in tok / tsx
  float* out;
};

// The promotion of pass P (PN tokens) into acc: mxfp4_gemm.cuh's chunk_promote, or without the
// per-row multiply (kRB).
template <int NT, int PN, int P, bool kRB>
__device__ __forceinline__ void promote(float (&acc)[NT / 2], const float (&part)[PN / 2], uint2 sw, const uint8_t* sx,
                                        int t) {
  const float f_lo = chunk_base(sw.x), f_hi = chunk_base(sw.y);
#pragma unroll
  for (int h = 0; h < PN / 8; ++h) {
    const float2 x = *reinterpret_cast<const float2*>(sx + (P * PN + 8 * h + 2 * t) * 4);
    float* d = acc + P * PN / 2 + 4 * h;
    if constexpr (kRB) {
      d[0] = fmaf(part[4 * h + 0], x.x, d[0]);
      d[1] = fmaf(part[4 * h + 1], x.y, d[1]);
      d[2] = fmaf(part[4 * h + 2], x.x, d[2]);
      d[3] = fmaf(part[4 * h + 3], x.y, d[3]);
    } else {
      d[0] = fmaf(part[4 * h + 0], f_lo * x.x, d[0]);
      d[1] = fmaf(part[4 * h + 1], f_lo * x.y, d[1]);
      d[2] = fmaf(part[4 * h + 2], f_hi * x.x, d[2]);
      d[3] = fmaf(part[4 * h + 3], f_hi * x.y, d[3]);
    }
  }
}

template <int PN>
__device__ __forceinline__ void issue_mmas(float (&part)[PN / 2], const uint32_t (&a)[4][4], uint64_t desc) {
  wgmma_fence();
#pragma unroll
  for (int s = 0; s < 4; ++s) WgmmaRsE4m3<PN>::mma(part, a[s], desc + 2 * s, s);
  wgmma_commit();
}

// ------------------------------------------------------------------ the pair loop ---
template <bool kStatic>
__global__ void __launch_bounds__(128, 4) pair_kernel(Bufs b, int units) {
  using S = PairSmem;
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = align_smem_1024(smem_raw);
  __shared__ uint64_t full[S::kSlots];
  __shared__ __align__(16) uint8_t lut[kLutBytes];
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  build_lut(lut);
  if (tid == 0) {
    for (int i = 0; i < S::kSlots; ++i) mbar_init(full + i, 1);
    mbar_init_fence();
  }
  __syncthreads();
  constexpr uint32_t kTx = kCodeTile + kScaleTile + (kStatic ? 0 : 2 * (S::kB + S::kSx));
  float acc0[32], acc1[32], part[32];
#pragma unroll
  for (int i = 0; i < 32; ++i) acc0[i] = acc1[i] = 0.0f;
  const uint32_t rd_w = smem_u32(smem) + S::kOffW + tid * 16;
  const uint32_t rd_s = smem_u32(smem) + S::kOffS + (warp * 8 + g) * 8;
  const uint64_t desc0 = wgmma_desc_sw128(smem_u32(smem), 16, 1024);
  const uint32_t lut_base = smem_u32(lut);
  const uint32_t rot = (4 * t - 3) & 31;
  int ring = 0;
  uint32_t phase = 0;
  for (int u = 0; u < units; ++u) {
    const size_t w0 = (size_t(blockIdx.x) * 97 + size_t(u) * 13 * KT) % (b.wtiles - KT);
    const size_t r0 = ((size_t(blockIdx.x) * 31 + size_t(u) * 7) * 128) % (b.trows - 128 * KT);
    auto load = [&](int c, int slot) {
      if (c >= KT || lane != 0) return;
      const uint32_t base = smem_u32(smem) + slot * S::kSlotBytes;
      uint64_t* bar = full + slot;
      if (warp == 0) {
        mbar_arrive_expect_tx(bar, kTx);
        bulk_g2s(base + S::kOffW, b.wq + (w0 + c) * kCodeTile, kCodeTile, bar);
      } else if (warp == 1) {
        bulk_g2s(base + S::kOffS, b.wsc + (w0 + c) * kScaleTile, kScaleTile, bar);
      } else if (!kStatic) {
        const int j = warp - 2;
        const size_t r = r0 + size_t(c) * 128 + 64 * j;
        bulk_g2s(base + j * S::kOffB1, b.tok + r * 128, S::kB, bar);
        bulk_g2s(base + S::kOffX0 + j * S::kSx, b.tsx + r, S::kSx, bar);
      }
    };
    __syncthreads();
    load(0, ring);
#pragma unroll 1
    for (int c = 0; c < KT; ++c) {
      __syncthreads();
      load(c + 1, ring ^ 1);
      mbar_wait(full + ring, phase);
      const uint32_t so = ring * S::kSlotBytes;
      uint32_t a[4][4];
      const uint2 sw = chunk_fragments(a, rd_w + so, rd_s + so, lut_base, rot);
      const uint64_t d0 = desc0 + (so >> 4);
      const uint8_t* sx0 = smem + so + S::kOffX0;
      chunk_wgmmas<64>(part, a, d0);
      chunk_promote<64>(acc0, part, sw, sx0, t);
      chunk_wgmmas<64>(part, a, d0 + (S::kOffB1 >> 4));
      chunk_promote<64>(acc1, part, sw, sx0 + S::kSx, t);
      ring_advance<S::kSlots>(ring, phase);
    }
  }
  float sum = 0.0f;
#pragma unroll
  for (int i = 0; i < 32; ++i) sum += acc0[i] + acc1[i];
  b.out[blockIdx.x * blockDim.x + tid] = sum;
}

// ---------------------------------------------------------- the warp-specialized loop ---
template <int C, int NT, int PN, int STAGES, bool kRB, bool kPA, int kDP, bool kStatic>
struct Ws {
  static constexpr int kThreads = 128 * (1 + C);
  static constexpr int kOffX = NT * 128;
  static constexpr int kOffW = kOffX + NT * 4;
  static constexpr int kOffS = kOffW + C * kCodeTile;
  static constexpr int kStage = (kOffS + C * kScaleTile + 1023) / 1024 * 1024;
  static constexpr int kBytes = STAGES * kStage + 1024;
  static constexpr int kProducerRegs = C == 2 ? 40 : 24;
  static constexpr int kConsumerRegs = (65536 - 128 * kProducerRegs) / (128 * C) / 8 * 8 > 232
                                           ? 232
                                           : (65536 - 128 * kProducerRegs) / (128 * C) / 8 * 8;
  static_assert(NT % PN == 0 && (!kDP || PN == NT) && !(kDP && kPA), "variant");
  static_assert(kBytes <= 227 * 1024, "shared memory");
};

template <int C, int NT, int PN, int STAGES, bool kRB, bool kPA, int kDP, bool kStatic>
__global__ void __launch_bounds__(128 * (1 + C), 1) ws_kernel(Bufs b, int units) {
  using W = Ws<C, NT, PN, STAGES, kRB, kPA, kDP, kStatic>;
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = align_smem_1024(smem_raw);
  __shared__ uint64_t full[STAGES], empty[STAGES];
  __shared__ __align__(16) uint8_t lut[kLutBytes];
  build_lut(lut);
  if (threadIdx.x == 0) {
    for (int i = 0; i < STAGES; ++i) {
      mbar_init(full + i, 1);
      mbar_init(empty + i, 4 * C);
    }
    mbar_init_fence();
  }
  __syncthreads();
  const int n = units * KT;  // chunks of this CTA, units of KT
  const int wg = threadIdx.x / 128;
  if (wg == 0) {
    setmaxnreg_dec<W::kProducerRegs>();
    if (threadIdx.x != 0) return;
    constexpr uint32_t kTx = C * (kCodeTile + kScaleTile) + (kStatic ? 0 : NT * 132);
    for (int i = 0; i < n; ++i) {
      const int s = i % STAGES, u = i / KT, c = i % KT;
      if (i >= STAGES) mbar_wait(empty + s, ((i / STAGES) - 1) & 1);
      const uint32_t base = smem_u32(smem) + s * W::kStage;
      uint64_t* bar = full + s;
      mbar_arrive_expect_tx(bar, kTx);
      if (!kStatic) {
        const size_t r0 = ((size_t(blockIdx.x) * 31 + size_t(u) * 7) * NT) % (b.trows - size_t(NT) * KT);
        const size_t r = r0 + size_t(c) * NT;
        bulk_g2s(base, b.tok + r * 128, NT * 128, bar);
        bulk_g2s(base + W::kOffX, b.tsx + r, NT * 4, bar);
      }
      for (int w = 0; w < C; ++w) {
        const size_t wt = (size_t(blockIdx.x) * 97 + (size_t(u) * C + w) * 13 * KT) % (b.wtiles - KT) + c;
        bulk_g2s(base + W::kOffW + w * kCodeTile, b.wq + wt * kCodeTile, kCodeTile, bar);
        bulk_g2s(base + W::kOffS + w * kScaleTile, b.wsc + wt * kScaleTile, kScaleTile, bar);
      }
    }
    return;
  }
  setmaxnreg_inc<W::kConsumerRegs>();
  const int w = wg - 1, tid = threadIdx.x & 127, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const uint32_t rd_w = smem_u32(smem) + W::kOffW + w * kCodeTile + tid * 16;
  const uint32_t rd_s = smem_u32(smem) + W::kOffS + w * kScaleTile + (warp * 8 + g) * 8;
  const uint64_t desc0 = wgmma_desc_sw128(smem_u32(smem), 16, 1024);
  const uint32_t lut_base = smem_u32(lut);
  const uint32_t rot = (4 * t - 3) & 31;
  float acc[NT / 2];
#pragma unroll
  for (int i = 0; i < NT / 2; ++i) acc[i] = 0.0f;
  auto so = [&](int i) { return uint32_t((i % STAGES) * W::kStage); };
  auto ready = [&](int i) { mbar_wait(full + i % STAGES, (i / STAGES) & 1); };
  auto release = [&](int i) {
    __syncwarp();
    if (lane == 0) mbar_arrive(empty + i % STAGES);
  };
  auto frags = [&](uint32_t (&a)[4][4], int i) {
    return chunk_fragments(a, rd_w + so(i), rd_s + so(i), lut_base, rot);
  };
  auto passes = [&](float (&part)[PN / 2], const uint32_t (&a)[4][4], uint2 sw, int i) {
    const uint8_t* sx = smem + so(i) + W::kOffX;
    const uint64_t d = desc0 + (so(i) >> 4);
    issue_mmas<PN>(part, a, d);
    wgmma_wait<0>();
    fence_regs(part);
    promote<NT, PN, 0, kRB>(acc, part, sw, sx, t);
    if constexpr (NT / PN > 1) {
      issue_mmas<PN>(part, a, d + ((PN * 128) >> 4));
      wgmma_wait<0>();
      fence_regs(part);
      promote<NT, PN, 1, kRB>(acc, part, sw, sx, t);
    }
    if constexpr (NT / PN > 2) {
      issue_mmas<PN>(part, a, d + ((2 * PN * 128) >> 4));
      wgmma_wait<0>();
      fence_regs(part);
      promote<NT, PN, 2, kRB>(acc, part, sw, sx, t);
    }
    static_assert(NT / PN <= 3, "passes");
  };
  if constexpr (kDP == 1) {
    // Chunk i's wgmmas in flight while chunk i - 1's partial is promoted (wait_group 1). The
    // first promotion is of zeros (no peeled first chunk: its copies of in-flight accumulators
    // into the loop's registers made ptxas serialize the wgmmas, C7514).
    float p0[NT / 2], p1[NT / 2];
#pragma unroll
    for (int j = 0; j < NT / 2; ++j) p1[j] = 0.0f;
    uint32_t a0[4][4], a1[4][4];
    uint2 sw0, sw1 = make_uint2(0, 0);
#pragma unroll 1
    for (int i = 0; i < n; i += 2) {
      ready(i);
      sw0 = frags(a0, i);
      issue_mmas<NT>(p0, a0, desc0 + (so(i) >> 4));
      wgmma_wait<1>();
      fence_regs(p1);
      promote<NT, NT, 0, kRB>(acc, p1, sw1, smem + so(i > 0 ? i - 1 : i) + W::kOffX, t);
      if (i > 0) release(i - 1);
      ready(i + 1);
      sw1 = frags(a1, i + 1);
      issue_mmas<NT>(p1, a1, desc0 + (so(i + 1) >> 4));
      wgmma_wait<1>();
      fence_regs(p0);
      promote<NT, NT, 0, kRB>(acc, p0, sw0, smem + so(i) + W::kOffX, t);
      release(i);
    }
    wgmma_wait<0>();
    fence_regs(p1);
    promote<NT, NT, 0, kRB>(acc, p1, sw1, smem + so(n - 1) + W::kOffX, t);
    release(n - 1);
  } else if constexpr (kDP == 2) {
    // Chunks in pairs, both partials issued before either promotion; nothing in flight at the
    // loop's back edge: chunk i + 1's A converted during chunk i's wgmmas, chunk i promoted
    // during chunk i + 1's; chunk i + 1's promotion and chunk i + 2's conversion alone.
    float p0[NT / 2], p1[NT / 2];
    uint32_t a0[4][4], a1[4][4];
#pragma unroll 1
    for (int i = 0; i < n; i += 2) {
      ready(i);
      const uint2 sw0 = frags(a0, i);
      issue_mmas<NT>(p0, a0, desc0 + (so(i) >> 4));
      ready(i + 1);
      const uint2 sw1 = frags(a1, i + 1);
      issue_mmas<NT>(p1, a1, desc0 + (so(i + 1) >> 4));
      wgmma_wait<1>();
      fence_regs(p0);
      promote<NT, NT, 0, kRB>(acc, p0, sw0, smem + so(i) + W::kOffX, t);
      release(i);
      wgmma_wait<0>();
      fence_regs(p1);
      promote<NT, NT, 0, kRB>(acc, p1, sw1, smem + so(i + 1) + W::kOffX, t);
      release(i + 1);
    }
  } else if constexpr (kPA) {
    float part[PN / 2];
    uint32_t a0[4][4], a1[4][4];
    uint2 sw0, sw1;
    ready(0);
    sw0 = frags(a0, 0);
    // chunk i's wgmmas, then chunk i + 1's fragments while they run, then the wait and promotion
    auto step = [&](uint32_t (&ac)[4][4], uint2 swc, uint32_t (&an)[4][4], uint2& swn, int i) {
      const uint8_t* sx = smem + so(i) + W::kOffX;
      issue_mmas<PN>(part, ac, desc0 + (so(i) >> 4));
      if (i + 1 < n) {
        ready(i + 1);
        swn = frags(an, i + 1);
      }
      wgmma_wait<0>();
      fence_regs(part);
      promote<NT, PN, 0, kRB>(acc, part, swc, sx, t);
      release(i);
    };
    static_assert(PN == NT, "one pass with kPA");
#pragma unroll 1
    for (int i = 0; i < n; i += 2) {
      step(a0, sw0, a1, sw1, i);
      step(a1, sw1, a0, sw0, i + 1);
    }
  } else {
    float part[PN / 2];
#pragma unroll 1
    for (int i = 0; i < n; ++i) {
      ready(i);
      uint32_t a[4][4];
      const uint2 sw = frags(a, i);
      passes(part, a, sw, i);
      release(i);
    }
  }
  float sum = 0.0f;
#pragma unroll
  for (int i = 0; i < NT / 2; ++i) sum += acc[i];
  b.out[blockIdx.x * blockDim.x + threadIdx.x] = sum;
}

// ------------------------------------------------------ the dequant-to-shared loop ---
// 512 threads: warpgroup 0's thread 0 issues the bulk copies (a raw ring: 128 token rows and
// their scales, two 64-row code tiles and their scale tiles per chunk); warpgroup 1 converts
// the codes to e4m3 once per chunk for all 128 tokens (chunk_fragments), into a swizzled
// K-major tile of the 128 weight rows plus each row's base (fp32) in a second ring;
// warpgroups 2 and 3 multiply 64 tokens each with all 128 rows (SS wgmma m64n128k32, tokens
// as A), then promote acc += part * (s_x[token] * 2^b[row]) (kRB: without the multiply).
// D[64 x N] (+)= A[64 x 32] * B[32 x N], e4m3 x e4m3 -> f32, A and B K-major from shared
// memory (FP8 has no transposed form); scale_d = 0 overwrites D. Here, not in
// common/mma/wgmma.cuh: only the ss variant (measured and dropped) uses it.
template <int N>
struct WgmmaSsE4m3;

template <>
struct WgmmaSsE4m3<128> {
  __device__ __forceinline__ static void mma(float (&d)[64], uint64_t desc_a, uint64_t desc_b, int scale_d) {
    asm volatile(
        "{\n.reg .pred p;\n"
        "setp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21,"
        "%22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41,"
        "%42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61,"
        "%62, %63"
        "}, %64, %65, p, 1, 1;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
          "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
          "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
          "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "l"(desc_a), "l"(desc_b), "r"(scale_d));
  }
};

template <bool kRB>
struct Ss {
  static constexpr int kRaw = 4, kDq = 3;
  static constexpr int kOffX = 128 * kChunk;     // 16 KB of token rows, then their scales
  static constexpr int kOffW = kOffX + 128 * 4;  // two code tiles, then two scale tiles
  static constexpr int kOffS = kOffW + 2 * kCodeTile;
  static constexpr int kRawStage = (kOffS + 2 * kScaleTile + 1023) / 1024 * 1024;
  static constexpr int kDqAt = kRaw * kRawStage;
  static constexpr int kDqBase = 128 * kChunk;  // after the e4m3 tile: the rows' bases
  static constexpr int kDqStage = (kDqBase + 128 * 4 + 1023) / 1024 * 1024;
  static constexpr int kBytes = kDqAt + kDq * kDqStage + 1024;
};


template <bool kRB>
__global__ void __launch_bounds__(512, 1) ss_kernel(Bufs b, int units) {
  using L = Ss<kRB>;
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = align_smem_1024(smem_raw);
  __shared__ uint64_t full[L::kRaw], empty[L::kRaw], dfull[L::kDq], dempty[L::kDq];
  __shared__ __align__(16) uint8_t lut[kLutBytes];
  build_lut(lut);
  if (threadIdx.x == 0) {
    for (int i = 0; i < L::kRaw; ++i) {
      mbar_init(full + i, 1);
      mbar_init(empty + i, 4 + 8);  // the converter's warps and the MMA warps
    }
    for (int i = 0; i < L::kDq; ++i) {
      mbar_init(dfull + i, 128);
      mbar_init(dempty + i, 8);
    }
    mbar_init_fence();
  }
  __syncthreads();
  const int n = units * KT;
  const int wg = threadIdx.x / 128, tid = threadIdx.x & 127, warp = tid >> 5, lane = tid & 31, g = lane >> 2,
            t = lane & 3;
  if (wg == 0) {
    setmaxnreg_dec<24>();
    if (threadIdx.x != 0) return;
    constexpr uint32_t kTx = 128 * (kChunk + 4) + 2 * (kCodeTile + kScaleTile);
    for (int i = 0; i < n; ++i) {
      const int s = i % L::kRaw, u = i / KT, c = i % KT;
      if (i >= L::kRaw) mbar_wait(empty + s, ((i / L::kRaw) - 1) & 1);
      const uint32_t base = smem_u32(smem) + s * L::kRawStage;
      uint64_t* bar = full + s;
      mbar_arrive_expect_tx(bar, kTx);
      const size_t r0 = ((size_t(blockIdx.x) * 31 + size_t(u) * 7) * 128) % (b.trows - size_t(128) * KT);
      const size_t r = r0 + size_t(c) * 128;
      bulk_g2s(base, b.tok + r * 128, 128 * kChunk, bar);
      bulk_g2s(base + L::kOffX, b.tsx + r, 128 * 4, bar);
      for (int w = 0; w < 2; ++w) {
        const size_t wt = (size_t(blockIdx.x) * 97 + (size_t(u) * 2 + w) * 13 * KT) % (b.wtiles - KT) + c;
        bulk_g2s(base + L::kOffW + w * kCodeTile, b.wq + wt * kCodeTile, kCodeTile, bar);
        bulk_g2s(base + L::kOffS + w * kScaleTile, b.wsc + wt * kScaleTile, kScaleTile, bar);
      }
    }
    return;
  }
  if (wg == 1) {  // the converter
    setmaxnreg_dec<88>();
    const uint32_t lut_base = smem_u32(lut), rot = (4 * t - 3) & 31;
#pragma unroll 1
    for (int i = 0; i < n; ++i) {
      const int s = i % L::kRaw, d = i % L::kDq;
      mbar_wait(full + s, (i / L::kRaw) & 1);
      if (i >= L::kDq) mbar_wait(dempty + d, ((i / L::kDq) - 1) & 1);
      const uint32_t so = smem_u32(smem) + s * L::kRawStage;
      uint8_t* dst = smem + L::kDqAt + d * L::kDqStage;
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        uint32_t a[4][4];
        const uint2 sw = chunk_fragments(a, so + L::kOffW + j * kCodeTile + tid * 16,
                                         so + L::kOffS + j * kScaleTile + (warp * 8 + g) * 8, lut_base, rot);
        const int lo = 64 * j + 16 * warp + g, hi = lo + 8;
        // The m16n8k32 A fragment (k = 4t.. in a0, a1; 16 + 4t.. in a2, a3) into rows of 128 bytes
        // swizzled as the token rows (act_word), so both wgmma operands read K in the same order.
#pragma unroll
        for (int st = 0; st < 4; ++st) {
          const int p0 = 32 * st + 4 * t;
          *reinterpret_cast<uint32_t*>(dst + lo * kChunk + act_word(lo, p0)) = a[st][0];
          *reinterpret_cast<uint32_t*>(dst + hi * kChunk + act_word(hi, p0)) = a[st][1];
          *reinterpret_cast<uint32_t*>(dst + lo * kChunk + act_word(lo, p0 + 16)) = a[st][2];
          *reinterpret_cast<uint32_t*>(dst + hi * kChunk + act_word(hi, p0 + 16)) = a[st][3];
        }
        if (t == 0) {
          reinterpret_cast<float*>(dst + L::kDqBase)[lo] = chunk_base(sw.x);
          reinterpret_cast<float*>(dst + L::kDqBase)[hi] = chunk_base(sw.y);
        }
      }
      fence_proxy_async_smem();  // the generic stores, visible to the wgmmas
      mbar_arrive(dfull + d);
      __syncwarp();
      if (lane == 0) mbar_arrive(empty + s);
    }
    return;
  }
  setmaxnreg_inc<200>();  // 128 x (24 + 88) + 256 x 200 = 64K
  const int m = wg - 2;
  float acc[64], part[64];
#pragma unroll
  for (int i = 0; i < 64; ++i) acc[i] = 0.0f;
#pragma unroll 1
  for (int i = 0; i < n; ++i) {
    const int s = i % L::kRaw, d = i % L::kDq;
    mbar_wait(full + s, (i / L::kRaw) & 1);
    mbar_wait(dfull + d, (i / L::kDq) & 1);
    const uint64_t da = wgmma_desc_sw128(smem_u32(smem) + s * L::kRawStage + m * 64 * kChunk, 16, 1024);
    const uint64_t db = wgmma_desc_sw128(smem_u32(smem) + L::kDqAt + d * L::kDqStage, 16, 1024);
    wgmma_fence();
#pragma unroll
    for (int st = 0; st < 4; ++st) WgmmaSsE4m3<128>::mma(part, da + 2 * st, db + 2 * st, st);
    wgmma_commit();
    wgmma_wait<0>();
    fence_regs(part);
    const float* sx = reinterpret_cast<const float*>(smem + s * L::kRawStage + L::kOffX) + 64 * m + 16 * warp + g;
    const float x0 = sx[0], x1 = sx[8];
    const float* bs = reinterpret_cast<const float*>(smem + L::kDqAt + d * L::kDqStage + L::kDqBase);
#pragma unroll
    for (int h = 0; h < 16; ++h) {  // rows (tokens) g, g + 8; columns (weight rows) 8h + 2t, + 1
      if constexpr (kRB) {
        acc[4 * h + 0] = fmaf(part[4 * h + 0], x0, acc[4 * h + 0]);
        acc[4 * h + 1] = fmaf(part[4 * h + 1], x0, acc[4 * h + 1]);
        acc[4 * h + 2] = fmaf(part[4 * h + 2], x1, acc[4 * h + 2]);
        acc[4 * h + 3] = fmaf(part[4 * h + 3], x1, acc[4 * h + 3]);
      } else {
        const float2 f = *reinterpret_cast<const float2*>(bs + 8 * h + 2 * t);
        acc[4 * h + 0] = fmaf(part[4 * h + 0], x0 * f.x, acc[4 * h + 0]);
        acc[4 * h + 1] = fmaf(part[4 * h + 1], x0 * f.y, acc[4 * h + 1]);
        acc[4 * h + 2] = fmaf(part[4 * h + 2], x1 * f.x, acc[4 * h + 2]);
        acc[4 * h + 3] = fmaf(part[4 * h + 3], x1 * f.y, acc[4 * h + 3]);
      }
    }
    __syncwarp();
    if (lane == 0) {
      mbar_arrive(empty + s);
      mbar_arrive(dempty + d);
    }
  }
  float sum = 0.0f;
#pragma unroll
  for (int i = 0; i < 64; ++i) sum += acc[i];
  b.out[blockIdx.x * blockDim.x + threadIdx.x] = sum;
}

}  // namespace probe

// ------------------------------------------------------------------------- host ---
#define CK(x)                                                                   \
  do {                                                                          \
    cudaError_t e_ = (x);                                                       \
    if (e_ != cudaSuccess) {                                                    \
      fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      exit(1);                                                                  \
    }                                                                           \
  } while (0)

struct Variant {
  const char* name;
  void (*kernel)(probe::Bufs, int);
  int threads, smem, ctas_per_sm;
  double rows, tokens;  // per CTA and chunk
};

template <int C, int NT, int PN, int ST, bool RB, bool PA, int DP, bool STAT>
Variant ws(const char* name) {
  using W = probe::Ws<C, NT, PN, ST, RB, PA, DP, STAT>;
  return {name, probe::ws_kernel<C, NT, PN, ST, RB, PA, DP, STAT>, W::kThreads, W::kBytes, 1, 64.0 * C, double(NT)};
}

int main(int argc, char** argv) {
  const double target_gflop = argc > 1 ? atof(argv[1]) : 500.0;
  int sms = 0;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  const size_t wtiles = 8192, trows = 64 * 1024;  // 32 MB of codes, 8 MB of token rows
  uint32_t *wq, *wsc, *tok, *tsx;
  float* out;
  CK(cudaMalloc(&wq, wtiles * kCodeTile));
  CK(cudaMalloc(&wsc, wtiles * kScaleTile));
  CK(cudaMalloc(&tok, trows * 128));
  CK(cudaMalloc(&tsx, trows * 4));
  CK(cudaMalloc(&out, size_t(4) * sms * 512 * 4));
  probe::fill<<<1024, 256>>>(wq, wtiles * kCodeTile / 4, 1);
  probe::fill<<<1024, 256>>>(wsc, wtiles * kScaleTile / 4, 2);
  probe::fill<<<1024, 256>>>(tok, trows * 128 / 4, 3);
  probe::fill<<<1024, 256>>>(tsx, trows, 4);
  CK(cudaDeviceSynchronize());
  probe::Bufs b{reinterpret_cast<uint8_t*>(wq), reinterpret_cast<uint8_t*>(wsc), reinterpret_cast<uint8_t*>(tok),
                reinterpret_cast<float*>(tsx), wtiles, trows, out};
  std::vector<Variant> vs = {
      {"pair (main's loop)", probe::pair_kernel<false>, 128, PairSmem::kBytes, 4, 64, 128},
      {"pair +st", probe::pair_kernel<true>, 128, PairSmem::kBytes, 4, 64, 128},
      ws<2, 192, 64, 5, false, false, false, false>("ws C2 NT192 PN64 (old ws)"),
      ws<2, 192, 192, 5, false, false, false, false>("ws C2 NT192 PN192"),
      ws<2, 192, 192, 5, true, false, false, false>("ws C2 NT192 PN192 +rb"),
      ws<2, 192, 192, 5, false, false, false, true>("ws C2 NT192 PN192 +st"),
      ws<2, 192, 192, 5, false, true, false, false>("ws C2 NT192 PN192 +pa"),
      ws<2, 128, 128, 6, false, false, false, false>("ws C2 NT128 PN128"),
      ws<2, 128, 128, 6, false, true, false, false>("ws C2 NT128 PN128 +pa"),
      ws<2, 128, 128, 6, true, false, false, false>("ws C2 NT128 PN128 +rb"),
      ws<2, 128, 128, 6, false, false, true, false>("ws C2 NT128 +dp"),
      ws<2, 128, 128, 6, true, false, true, false>("ws C2 NT128 +dp +rb"),
      ws<2, 128, 128, 6, false, false, true, true>("ws C2 NT128 +dp +st"),
      ws<2, 96, 96, 6, false, false, true, false>("ws C2 NT96 +dp"),
      ws<2, 128, 128, 6, false, false, 2, false>("ws C2 NT128 +dp2"),
      ws<2, 128, 128, 6, true, false, 2, false>("ws C2 NT128 +dp2 +rb"),
      ws<2, 96, 96, 6, false, false, 2, false>("ws C2 NT96 +dp2"),
      ws<3, 128, 128, 5, false, false, false, false>("ws C3 NT128 PN128"),
      ws<3, 96, 96, 6, false, false, 2, false>("ws C3 NT96 +dp2"),
      {"ss (dequant to smem)", probe::ss_kernel<false>, 512, probe::Ss<false>::kBytes, 1, 128, 128},
      {"ss +rb", probe::ss_kernel<true>, 512, probe::Ss<true>::kBytes, 1, 128, 128},
  };
  printf("%s, %d SMs; %.0f GFLOP per launch (2 x rows x tokens x 128 per chunk)\n", prop.name, sms, target_gflop);
  printf("%-28s %5s %6s %5s %9s %9s\n", "variant", "regs", "local", "grid", "us", "TFLOP/s");
  for (const Variant& v : vs) {
    cudaFuncAttributes fa;
    CK(cudaFuncGetAttributes(&fa, v.kernel));
    CK(cudaFuncSetAttribute(v.kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, v.smem));
    const int grid = sms * v.ctas_per_sm;
    const double per_unit = 2.0 * v.rows * v.tokens * 128 * probe::KT * grid;
    const int units = std::max(1, int(target_gflop * 1e9 / per_unit + 0.5));
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    std::vector<float> ts;
    for (int r = 0; r < 9; ++r) {
      CK(cudaEventRecord(e0));
      v.kernel<<<grid, v.threads, v.smem>>>(b, units);
      CK(cudaEventRecord(e1));
      CK(cudaEventSynchronize(e1));
      CK(cudaGetLastError());
      float ms = 0;
      CK(cudaEventElapsedTime(&ms, e0, e1));
      if (r >= 2) ts.push_back(ms);
    }
    std::sort(ts.begin(), ts.end());
    const double us = ts[ts.size() / 2] * 1e3;
    printf("%-28s %5d %6zu %5d %9.1f %9.1f\n", v.name, fa.numRegs, fa.localSizeBytes, grid, us,
           per_unit * units / (us * 1e-6) / 1e12);
  }
  return 0;
}
