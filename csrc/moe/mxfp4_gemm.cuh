// The GEMMs of the MXFP4 W4A8 MoE on FP8 tensor cores (warp-level
// mma.sync.m16n8k32.e4m3), launched by dsv4::mxfp4_moe (mxfp4_moe.cu): one small-batch
// path at every M (8-token tiles, no split over K, no wgmma prefill kernel yet).
// Compiles for sm_90a with no spills; its GPU tests (tests/test_mxfp4.py -m gpu -k w4a8)
// pass on the H200 (docs/perf.md, "GPU test status"). Speed: 0.13-0.39x of Humming W4A8 at
// every M (docs/perf-history/2026-12-02-mxfp4-vs-humming.md). What remains: see the end
// of the file.
//
// Numerics (docs/design.md section 2, dsv4.reference.mxfp4_moe activation="fp8"):
//   GEMM1 input  x: per token, per 128 of K, vLLM's per_token_group_quant_fp8
//     s = max(amax, 1e-10) / 448, rounded up to a power of two when ue8m0,
//     q = e4m3_rn_satfinite(x / s)                         (w4a8_quant_x_kernel)
//   weights: code * 2^(e - 127) = (code * 2^(e - b)) * 2^b, e4m3 * fp32, exactly, with
//     one base b = gmax - 6 per row and per 128 of K (gmax: the largest scale byte of the
//     4 blocks; prepare (dsv4.formats.mxfp4.fit_fp8_operand) makes every block fit, e - b >= -8,
//     and sets the bytes of all-zero blocks to 0 so that they never raise gmax).
//   accumulate each 128-wide K chunk in fp32 on the tensor cores, then
//     acc += partial * (2^b[row] * s_x[token])                 (the promotion)
//   GEMM1 epilogue: h = silu(min(g, L)) * clamp(u, -L, L) in fp32, then per token and
//     per 128 columns of h, Humming's rule: s = max(amax / 448, 1e-30),
//     q = e4m3_rn_satfinite(h * (1 / s))                       (IEEE division, reciprocal)
//   GEMM2 the same with h, writing bf16 y per padded row; moe_combine_kernel
//     (routing.cuh) then sums the slots in fp32.
//
// Layouts: the weights as dsv4.Mxfp4MoeWeights holds them (vLLM's stacked layout,
// N padded to a multiple of 64): w13 [E, 2N, K/2] (gate rows, then up rows), w13_scale
// [E, 2N, K/32], w2 [E, K, N/2], w2_scale [E, K, N/32]. Token tiles of 8 rows from the
// MoE's routing (routing.cuh: moe_route_kernel with block_n = kBN = 8 fills row_slot,
// tile_expert, num_tiles).
//
// Fragment order: the dot product of one k32 step does not depend on which k each
// fragment position holds, so A and B use the same permutation: in step s of a
// 128-wide chunk, thread (g, t) (g = lane / 4, t = lane % 4) holds the chunk's elements
// 32t + 8s + 0..3 where the PTX layout says k = 4t..4t+3 (a0, a1, b0) and 32t + 8s + 4..7
// where it says 16 + 4t.. (a2, a3, b1). So a thread's 16-byte load of one weight row is
// exactly one MXFP4 block (one scale byte), and its B pieces of a chunk are 32
// contiguous bytes of one token row.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <stdint.h>

#include "common/cvt.cuh"
#include "common/mma/mma_sync.cuh"
#include "common/nvfp4.cuh"  // e2m1_value
#include "moe/params.cuh"
#include "moe/swiglu.cuh"

namespace dsv4 {
namespace moe {
namespace w4a8 {

constexpr int kChunk = 128;        // K elements per promotion (the activation group)
constexpr int kThreads = 128;      // 4 warps
constexpr int kShiftMin = -8;      // code * 2^d is e4m3 for every code iff -8 <= d <= 6
constexpr int kShiftMax = 6;
constexpr int kShifts = kShiftMax - kShiftMin + 1;

// ------------------------------------------------------------------ conversions ---

// e4m3 bits of a finite float, round to nearest even, saturating (cvt.rn.satfinite).
__device__ __forceinline__ uint32_t e4m3_bits(float v) {
  return uint32_t(e4m3_rn_satfinite(v).__x);
}

// Four e4m3 bytes of four e2m1 codes (nibbles of the low 16 bits, element i in nibble i)
// times 2^d, from the two words of the shift's table (byte c = e4m3 of |e2m1(c)| * 2^d):
// one PRMT looks the magnitudes up (selector bit 3, the e2m1 sign, masked off: PRMT
// would read it as "replicate the sign"), the nibbles spread to bytes give the signs.
__device__ __forceinline__ uint32_t e2m1x4_to_e4m3x4(uint32_t q, uint32_t lut_lo, uint32_t lut_hi) {
  const uint32_t mag = __byte_perm(lut_lo, lut_hi, q & 0x7777u);
  uint32_t x = (q | (q << 8)) & 0x00FF00FFu;
  x = (x | (x << 4)) & 0x0F0F0F0Fu;  // byte i = nibble i
  return mag | ((x & 0x08080808u) << 4);
}

// The shift tables in shared memory: 8 bytes per shift d in [-8, 6], built with the
// float conversion (every entry is exact). All threads of the CTA call it, then sync.
__device__ __forceinline__ void build_shift_tables(uint32_t (*lut)[2]) {
  uint8_t* bytes = reinterpret_cast<uint8_t*>(lut);
  for (int i = threadIdx.x; i < kShifts * 8; i += blockDim.x) {
    const int d = i / 8 + kShiftMin;
    bytes[i] = uint8_t(e4m3_bits(ldexpf(e2m1_value(uint32_t(i % 8)), d)));
  }
}

__device__ __forceinline__ float quad_max(float v) {
  v = fmaxf(v, __shfl_xor_sync(0xFFFFFFFFu, v, 1));
  return fmaxf(v, __shfl_xor_sync(0xFFFFFFFFu, v, 2));
}

// ------------------------------------------------- GEMM1's input (x) quantization ---

// One warp per (token, 128-wide group), 4 elements per lane.
__global__ void __launch_bounds__(256) w4a8_quant_x_kernel(const W4A8Params p) {
  const int groups = p.K / kChunk;
  const int warp = (blockIdx.x * blockDim.x + threadIdx.x) >> 5, lane = threadIdx.x & 31;
  if (warp >= p.M * groups) return;
  const int tkn = warp / groups, grp = warp % groups;
  const size_t off = size_t(tkn) * p.K + grp * kChunk + lane * 4;
  const uint2 raw = *reinterpret_cast<const uint2*>(p.x + off);
  const __nv_bfloat162* h2 = reinterpret_cast<const __nv_bfloat162*>(&raw);
  const float2 f0 = __bfloat1622float2(h2[0]), f1 = __bfloat1622float2(h2[1]);
  const float v[4] = {f0.x, f0.y, f1.x, f1.y};
  float amax = fmaxf(fmaxf(fabsf(v[0]), fabsf(v[1])), fmaxf(fabsf(v[2]), fabsf(v[3])));
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, o));
  float s = __fdiv_rn(fmaxf(amax, 1e-10f), 448.0f);
  if (p.ue8m0) {  // the exact ceil to a power of two (s is normal: >= 1e-10 / 448)
    const uint32_t b = __float_as_uint(s);
    s = __uint_as_float((b & 0x7F800000u) + ((b & 0x007FFFFFu) ? 0x00800000u : 0u));
  }
  uint32_t q = 0;
#pragma unroll
  for (int i = 0; i < 4; ++i) q |= e4m3_bits(__fdiv_rn(v[i], s)) << (8 * i);
  *reinterpret_cast<uint32_t*>(p.xq + off) = q;
  if (lane == 0) p.xs[size_t(tkn) * groups + grp] = s;
}

// ------------------------------------------------------------- the GEMM mainloop ---

// kTiles m16 weight tiles (rows row0[i] .. + 15 of one expert matrix with `ld` bytes per
// row and `lds` scale bytes per row) x the 8 token rows of a tile, over the 128-wide K
// chunks [0, kd): acc[i] += the chunk's partial sums times 2^b[row] * act_scale[token].
// act: [rows, kd] e4m3 bytes of the tile's tokens (row tok_row[j], -1 = padding: zero);
// act_scale: [rows, ceil(kd / 128)]. kd is a multiple of 32: a last chunk of fewer
// blocks leaves threads t >= its block count without codes.
template <int kTiles>
__device__ __forceinline__ void w4a8_mainloop(float (&acc)[kTiles][4], const uint8_t* w, const uint8_t* ws,
                                              const int (&row0)[kTiles], int ld, int lds, int kd,
                                              const uint8_t* act, const float* act_scale, int act_ld,
                                              int tok_b, int tok_c0, int tok_c1, const uint32_t (*lut)[2]) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int chunks = (kd + kChunk - 1) / kChunk, groups = chunks;
  for (int ch = 0; ch < chunks; ++ch) {
    const int blocks = min(4, (kd - ch * kChunk) / 32);
    const bool have = t < blocks;
    // B: token g's 32 bytes at 32t of the chunk (zeros for padding rows / missing blocks)
    uint4 b_lo = make_uint4(0, 0, 0, 0), b_hi = make_uint4(0, 0, 0, 0);
    if (have && tok_b >= 0) {
      const uint4* src = reinterpret_cast<const uint4*>(act + size_t(tok_b) * act_ld + ch * kChunk + 32 * t);
      b_lo = src[0];
      b_hi = src[1];
    }
    const uint32_t bw[8] = {b_lo.x, b_lo.y, b_lo.z, b_lo.w, b_hi.x, b_hi.y, b_hi.z, b_hi.w};
    const float sx0 = tok_c0 >= 0 ? act_scale[size_t(tok_c0) * groups + ch] : 0.0f;
    const float sx1 = tok_c1 >= 0 ? act_scale[size_t(tok_c1) * groups + ch] : 0.0f;
#pragma unroll
    for (int i = 0; i < kTiles; ++i) {
      // rows row0 + g and row0 + g + 8: one block each
      uint4 c[2] = {make_uint4(0, 0, 0, 0), make_uint4(0, 0, 0, 0)};
      int e[2] = {0, 0};
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const size_t row = size_t(row0[i] + g + 8 * h);
        if (have) {
          c[h] = *reinterpret_cast<const uint4*>(w + row * ld + ch * (kChunk / 2) + 16 * t);
          e[h] = ws[row * lds + ch * 4 + t];
        }
      }
      const int gmax0 = int(quad_max(float(e[0]))), gmax1 = int(quad_max(float(e[1])));
      const int d0 = min(max(e[0] - gmax0 + kShiftMax, kShiftMin), kShiftMax) - kShiftMin;
      const int d1 = min(max(e[1] - gmax1 + kShiftMax, kShiftMin), kShiftMax) - kShiftMin;
      const uint32_t l0 = lut[d0][0], h0 = lut[d0][1], l1 = lut[d1][0], h1 = lut[d1][1];
      const uint32_t w0[4] = {c[0].x, c[0].y, c[0].z, c[0].w}, w1[4] = {c[1].x, c[1].y, c[1].z, c[1].w};
      float part[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
      for (int s = 0; s < 4; ++s) {
        const uint32_t a[4] = {e2m1x4_to_e4m3x4(w0[s] & 0xFFFFu, l0, h0), e2m1x4_to_e4m3x4(w1[s] & 0xFFFFu, l1, h1),
                               e2m1x4_to_e4m3x4(w0[s] >> 16, l0, h0), e2m1x4_to_e4m3x4(w1[s] >> 16, l1, h1)};
        mma_m16n8k32_e4m3(part, a, bw[2 * s], bw[2 * s + 1]);
      }
      // 2^b with b = gmax - 127 - 6, folded into the token scale exactly
      const int b0 = gmax0 - 127 - kShiftMax, b1 = gmax1 - 127 - kShiftMax;
      acc[i][0] = fmaf(part[0], ldexpf(sx0, b0), acc[i][0]);
      acc[i][1] = fmaf(part[1], ldexpf(sx1, b0), acc[i][1]);
      acc[i][2] = fmaf(part[2], ldexpf(sx0, b1), acc[i][2]);
      acc[i][3] = fmaf(part[3], ldexpf(sx1, b1), acc[i][3]);
    }
  }
}

// Token of padded row j of tile tl, or -1.
__device__ __forceinline__ int tile_token(const W4A8Params& p, int tl, int j) {
  const int slot = p.row_slot[tl * kBN + j];
  return slot < 0 ? -1 : slot / p.topk;
}

// ----------------------------------------------------------------------- GEMM1 ------

// grid (ceil(N / 128), max_tiles): one CTA = 128 columns of h (gate rows n0 .. n0+127 and
// the up rows N + n0 ..) x one token tile; warp w: columns n0 + 32w .. + 31 (two m16 tiles
// of gate rows and the two of up rows with the same columns, so the thread that holds a
// gate value holds its up value). The CTA sees every column of its 128-wide group of
// h: the FP8 quantization of GEMM2's input happens here.
__global__ void __launch_bounds__(kThreads) w4a8_gemm1_kernel(const W4A8Params p) {
  __shared__ uint32_t lut[kShifts][2];
  __shared__ float red[4][kBN];
  const int tl = blockIdx.y;
  if (tl >= *p.num_tiles) return;
  build_shift_tables(lut);
  __syncthreads();
  const int e = p.tile_expert[tl];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int n0 = blockIdx.x * kChunk + 32 * warp;
  const bool live = n0 < p.N;
  const int tok_b = tile_token(p, tl, g), tok_c0 = tile_token(p, tl, 2 * t), tok_c1 = tile_token(p, tl, 2 * t + 1);
  float acc[4][4] = {};
  if (live) {
    const int rows[4] = {n0, n0 + 16, p.N + n0, p.N + n0 + 16};
    w4a8_mainloop<4>(acc, p.w13 + size_t(e) * 2 * p.N * (p.K / 2), p.w13_scale + size_t(e) * 2 * p.N * (p.K / 32),
                     rows, p.K / 2, p.K / 32, p.K, p.xq, p.xs, p.K, tok_b, tok_c0, tok_c1, lut);
  }
  // SwiGLU: value v of tile i: column n0 + 16i + g + 8 (v / 2), token 2t + v % 2
  float h[2][4];
  float amax[2] = {0.0f, 0.0f};
#pragma unroll
  for (int i = 0; i < 2; ++i) {
#pragma unroll
    for (int v = 0; v < 4; ++v) {
      float gate = acc[i][v], up = acc[2 + i][v];
      if (p.has_limit) {
        gate = fminf(gate, p.swiglu_limit);
        up = fminf(fmaxf(up, -p.swiglu_limit), p.swiglu_limit);
      }
      h[i][v] = live ? silu(gate) * up : 0.0f;
      amax[v & 1] = fmaxf(amax[v & 1], fabsf(h[i][v]));
    }
  }
  // per token: max over the warp's 8 g lanes, then over the 4 warps
#pragma unroll
  for (int j = 0; j < 2; ++j) {
#pragma unroll
    for (int o = 4; o < 32; o <<= 1) amax[j] = fmaxf(amax[j], __shfl_xor_sync(0xFFFFFFFFu, amax[j], o));
  }
  if (g == 0) {
    red[warp][2 * t] = amax[0];
    red[warp][2 * t + 1] = amax[1];
  }
  __syncthreads();
  const int groups = (p.N + kChunk - 1) / kChunk;
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    const int tok = 2 * t + j;
    const float m = fmaxf(fmaxf(red[0][tok], red[1][tok]), fmaxf(red[2][tok], red[3][tok]));
    const float s = fmaxf(__fdiv_rn(m, 448.0f), 1e-30f);
    const float r = __frcp_rn(s);
    const size_t row = size_t(tl) * kBN + tok;
    if (live) {
#pragma unroll
      for (int i = 0; i < 2; ++i) {
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
          const int col = n0 + 16 * i + g + 8 * hh;
          p.hq[row * p.N + col] = uint8_t(e4m3_bits(__fmul_rn(h[i][2 * hh + j], r)));
        }
      }
    }
    if (warp == 0 && g == 0) p.hs[row * groups + blockIdx.x] = s;
  }
}

// ----------------------------------------------------------------------- GEMM2 ------

// grid (K / 256, max_tiles): one CTA = 256 output rows (w2 rows) x one token tile; warp
// w: rows 256 * blockIdx.x + 64w .. + 63 (four m16 tiles). The reduction runs over the
// N columns of h in 128-wide groups (the last one may hold 1..3 blocks: N = 320 for
// V4.1-Flash at TP 8). y is bf16 per padded row (2-byte stores: see the notes below).
__global__ void __launch_bounds__(kThreads) w4a8_gemm2_kernel(const W4A8Params p) {
  __shared__ uint32_t lut[kShifts][2];
  const int tl = blockIdx.y;
  if (tl >= *p.num_tiles) return;
  build_shift_tables(lut);
  __syncthreads();
  const int e = p.tile_expert[tl];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int r0 = blockIdx.x * 256 + 64 * warp;
  if (r0 >= p.K) return;
  // GEMM2's B rows are the tile's padded rows themselves (hq row = tile row)
  const int rb = tl * kBN;
  const int tok_b = p.row_slot[rb + g] < 0 ? -1 : rb + g;
  const int tok_c0 = p.row_slot[rb + 2 * t] < 0 ? -1 : rb + 2 * t;
  const int tok_c1 = p.row_slot[rb + 2 * t + 1] < 0 ? -1 : rb + 2 * t + 1;
  float acc[4][4] = {};
  const int rows[4] = {r0, r0 + 16, r0 + 32, r0 + 48};
  w4a8_mainloop<4>(acc, p.w2 + size_t(e) * p.K * (p.N / 2), p.w2_scale + size_t(e) * p.K * (p.N / 32), rows,
                   p.N / 2, p.N / 32, p.N, p.hq, p.hs, p.N, tok_b, tok_c0, tok_c1, lut);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
#pragma unroll
    for (int v = 0; v < 4; ++v) {
      const int col = rows[i] + g + 8 * (v >> 1);
      const size_t row = size_t(rb) + 2 * t + (v & 1);
      p.y[row * p.K + col] = __float2bfloat16_rn(acc[i][v]);
    }
  }
}

// --------------------------------------------------------------------- launches -----

// Order (mxfp4_moe.cu): routing (moe_route_kernel, block_n = kBN), then these three,
// then moe_combine_kernel. max_tiles: the routing's bound on token tiles.
inline void launch_w4a8_decode(const W4A8Params& p, int max_tiles, cudaStream_t stream) {
  const int groups = p.M * (p.K / kChunk);
  if (groups > 0) w4a8_quant_x_kernel<<<(groups + 7) / 8, 256, 0, stream>>>(p);
  w4a8_gemm1_kernel<<<dim3((p.N + kChunk - 1) / kChunk, max_tiles), kThreads, 0, stream>>>(p);
  w4a8_gemm2_kernel<<<dim3((p.K + 255) / 256, max_tiles), kThreads, 0, stream>>>(p);
}

// What remains (docs/perf-history/2026-12-02-mxfp4-vs-humming.md, look-back):
// * speed at small M: a split over N and K so that at least one wave of CTAs streams
//   weights (the NVFP4 path's split-K grid is the model). Also: weight loads are plain
//   16-byte global loads without a pipeline (cp.async / bulk-copy ring as in
//   nvfp4_gemm.cuh), h and y are written with byte / 2-byte stores (stage through
//   shared memory), every CTA rebuilds the 120-byte shift table, the tile is fixed at 8
//   tokens, routing is one CTA.
// * the prefill path: wgmma m64nNk32 e4m3 with A from registers (the same conversion)
//   and B (tokens) from shared memory, per-128 promotion into a second accumulator set.
// * the grids assume K % 128 == 0 (checked by the entry; every V4 shape) and N % 64 == 0
//   (prepare pads); GEMM1's last CTA of N = 288 -> 320 runs 2 live warps of 4 (`live`).
// * GEMM2 reads hq / hs by tile row (GEMM1 writes them per padded row), so both GEMMs
//   must run on the same routing (they do).

}  // namespace w4a8
}  // namespace moe
}  // namespace dsv4
