// The kernels of the MXFP4 W4A8 MoE (dsv4::mxfp4_moe, launched by mxfp4_moe.cu), on the
// NVFP4 decode skeleton (nvfp4_gemm.cuh): "swap AB" grouped GEMMs whose A operand is 64
// weight rows per CTA, converted e2m1 -> e4m3 in registers, and whose B operand is the
// token tile (block_n = 8, 16 or 64 FP8 token rows in shared memory), multiplied with
// wgmma.m64nNk32.e4m3 with A from registers (native FP8: on sm_90a ptxas emulates an
// e4m3 mma.sync through f16 MMAs, 12 conversions + 2 HMMA + 4 FADD per m16n8k32, which is
// why the decode tiles here are not on mma.sync as the NVFP4 ones are); a ring of
// 128-wide K chunks in shared memory (weights by two bulk copies per ring slot, token
// rows and their scales by two more, from GEMM-ready tiles); a classic grid
// (mxfp4_gemm_kernel) or split-K on a persistent grid (mxfp4_gemm_splitk_kernel) with a
// deterministic fixup; PDL.
//
// Chain (mxfp4_moe.cu): routing (routing.cuh) -> mxfp4_quant_x_kernel -> GEMM1 -> GEMM2.
//
// Numerics (docs/design.md section 2; dsv4.reference.mxfp4_moe, activation "fp8"):
//   GEMM1 input x: per token and per 128 of K, vLLM's per_token_group_quant_fp8:
//     s = max(amax, 1e-10) / 448, rounded up to a power of two when ue8m0,
//     q = e4m3_rn_satfinite(x / s)                        (mxfp4_quant_x_kernel)
//   weights: per row and per 128 of K a base b (fp32 2^b), a block of scale byte e as the
//     e4m3 values code * 2^(e - 127 - b), exact (dsv4/formats/mxfp4_w4a8.py).
//   each 128-chunk accumulates on the tensor cores in fp32 (the first wgmma overwrites), then
//     acc += partial * (2^b[row] * s_x[token])                 (the promotion)
//   split-K: the chunks' fp32 sums added in chunk order by the item's last CTA.
//   GEMM1 epilogue: h = silu(min(g, L)) * clamp(u, -L, L) in fp32 (the fast-division
//     silu of swiglu.cuh), stored fp32; the last of the (up to) four CTAs of a 128-column
//     group quantizes it per token by Humming's rule: s = max(amax / 448, 1e-30),
//     q = e4m3_rn_satfinite(h * (1 / s)) (IEEE division and reciprocal).
//   GEMM2 epilogue: y = acc rounded to bf16 per padded row (as the NVFP4 path and the
//     earlier W4A8 kernel); the last GEMM2 CTA of a token's 64 output columns sums
//     topk_weights[m, j] * y over the token's slots in slot order in fp32 (moe_combine_kernel's
//     arithmetic, without its launch and without atomics on the data) and writes out.
//
// Fragment order. In a 128-chunk, thread T = 32w + 4g + t (warp w, lane 4g + t) holds
// MXFP4 block t of weight rows 16w + g and 16w + g + 8: in step s (of 4) the block's
// elements 8s .. 8s + 3 where the PTX m16n8k32 layout says k = 4t .. 4t + 3 (a0, a1) and
// 8s + 4 .. 8s + 7 where it says 16 + 4t .. (a2, a3). A k32 step's dot product does not
// depend on which k a position holds as long as A and B agree, so the activations are
// stored in the same order: chunk position p = 32s + 16hh + 4t + i holds element
// 32t + 8s + 4hh + i (dsv4.formats.mxfp4_w4a8.chunk_position). Then a thread's
// 16-byte load of one row's codes is exactly its A fragments of 4 steps, it needs one
// shift table per row and chunk, and the wgmma reads B from token rows in MMA order.
// (The wgmma A register fragment of m64nNk32 with 8-bit inputs is, per warp, the one of
// mma.sync m16n8k32; its accumulators are laid out as mma.sync's per n8 block.)
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <stdint.h>

#include "common/cvt.cuh"
#include "common/mma/wgmma.cuh"
#include "common/nvfp4.cuh"  // e2m1_value
#include "common/ptx/memory.cuh"
#include "common/ptx/pdl.cuh"
#include "common/ptx/regs.cuh"
#include "common/ptx/sync.cuh"
#include "moe/params.cuh"
#include "moe/swiglu.cuh"

namespace dsv4 {
namespace moe {
namespace w4a8 {

constexpr int kShiftMin = -8;       // code * 2^d is e4m3 for every code iff -8 <= d <= 6
constexpr int kShifts = 15;         // shift indices d + 8 = 0 .. 14
constexpr int kLutBytes = 16 * 8;   // 16 entries of 8 bytes (the last unused)
constexpr int kSplitMinChunks = 4;  // fewest K chunks per split (512 of K, as nvfp4_gemm.cuh's kSplitMinSteps)

// ------------------------------------------------------------ weight conversion ---

// Entry idx (8 bytes): the e4m3 bytes of |e2m1 code c| * 2^(idx - 8) for c = 0 .. 7, all
// exact (subnormals included). All threads call it; the caller syncs before use.
__device__ __forceinline__ void build_lut(uint8_t* lut) {
  for (int i = threadIdx.x; i < kLutBytes; i += blockDim.x) {
    const int idx = i >> 3;
    lut[i] = idx < kShifts ? e4m3_rn_satfinite(ldexpf(e2m1_value(uint32_t(i & 7)), idx + kShiftMin)).__x : 0;
  }
}

__device__ __forceinline__ uint32_t prmt(uint32_t a, uint32_t b, uint32_t sel) {
  uint32_t d;
  asm("prmt.b32 %0, %1, %2, %3;\n" : "=r"(d) : "r"(a), "r"(b), "r"(sel));
  return d;
}

// One prepared word (8 codes: magnitudes at bits 4j .. 4j+2, signs at 8j+7 for j < 4 and
// 8(j-4)+3 for j >= 4) -> the e4m3 bytes of elements 0..3 (lo) and 4..7 (hi) through
// the row's shift table (lut.x: codes 0-3, lut.y: codes 4-7). The selector nibbles'
// bit 3 must be clear (PRMT would read it as "replicate the sign"), which is where the
// signs sit: one mask clears all eight. 7 integer instructions per 8 weights.
__device__ __forceinline__ void e2m1x8_to_e4m3(uint32_t w, uint2 lut, uint32_t& lo, uint32_t& hi) {
  const uint32_t sel = w & 0x77777777u;
  lo = prmt(lut.x, lut.y, sel) | (w & 0x80808080u);
  hi = prmt(lut.x, lut.y, sel >> 16) | ((w << 4) & 0x80808080u);
}

// Byte offset of block t's shift table in the LUT, from a row's scale word (nibble t =
// shift index): a rotate by 4t - 3 puts the nibble at bits 3..6.
__device__ __forceinline__ uint32_t lut_offset(uint32_t scale_word, uint32_t rot) {
  return __funnelshift_r(scale_word, scale_word, rot) & 0x78u;
}

// 2^b of a row's chunk: the scale word's bits 23..30 are its fp32 exponent field.
__device__ __forceinline__ float chunk_base(uint32_t scale_word) { return __uint_as_float(scale_word & 0x7F800000u); }

// Position in a 128-chunk (MMA order) of the word holding elements 4q .. 4q + 3.
__device__ __forceinline__ int chunk_word_pos(int q) { return 32 * ((q >> 1) & 3) + 16 * (q & 1) + 4 * (q >> 3); }

// ------------------------------------------------------------ GEMM1's input (x) ---

// The activations of a GEMM (GEMM1's x, GEMM2's h) are stored per token tile and K chunk
// as the ring reads them, one bulk copy each: [tile][chunk][row (block_n)][128 bytes]
// FP8 in MMA order with 16-byte piece c of row r at c ^ (r % 8) (the 128-byte swizzle the
// wgmma's B descriptor reads), and their scales [tile][chunk][row] fp32.
__device__ __forceinline__ size_t act_row(int tile, int kc, int KC, int BN, int r) {
  return ((size_t(tile) * KC + kc) * BN + r) * kChunk;
}
__device__ __forceinline__ int act_word(int r, int pos) { return (((pos >> 4) ^ (r & 7)) << 4) | (pos & 15); }

// Slot j of token t (routing's slot_pos: its padded row, -1 = not local), -1 past top-k.
__device__ __forceinline__ int slot_lookup(const W4A8Params& p, int t, int j) {
  return j < p.topk ? __ldg(p.slot_pos + size_t(t) * p.topk + j) : -1;
}

// Token tkn's group grp of x (warp-wide): the lane's 4 bf16 (elements 4 lane .. 4 lane + 3).
__device__ __forceinline__ uint2 load_group(const W4A8Params& p, int tkn, int grp, int lane) {
  return __ldg(reinterpret_cast<const uint2*>(p.x + size_t(tkn) * p.K + grp * kChunk + lane * 4));
}

// A group's scale by vLLM's rule from its amax: s = max(amax, 1e-10) / 448, rounded up to a
// power of two when ue8m0 (then x / s = x * (1 / s) exactly, r = 1 / s). The one place
// both quantizers of GEMM1's input take it from; kUe8m0 fixed at compile time where the
// kernel is instantiated per mode (mxfp4_quant_x_kernel), the int form for the others.
template <bool kUe8m0>
__device__ __forceinline__ float group_scale(float amax, float& r) {
  float s = __fdiv_rn(fmaxf(amax, 1e-10f), 448.0f);
  r = 0.0f;
  if constexpr (kUe8m0) {  // the exact ceil to a power of two (s is normal: >= 1e-10 / 448)
    const uint32_t b = __float_as_uint(s);
    s = __uint_as_float((b & 0x7F800000u) + ((b & 0x007FFFFFu) ? 0x00800000u : 0u));
    r = __frcp_rn(s);
  }
  return s;
}

__device__ __forceinline__ float group_scale(int ue8m0, float amax, float& r) {
  return ue8m0 ? group_scale<true>(amax, r) : group_scale<false>(amax, r);
}

// Four elements of a group -> their word of e4m3 (element i in byte i), by group_scale's s, r.
template <bool kUe8m0>
__device__ __forceinline__ uint32_t quantize_word(const float (&v)[4], float s, float r) {
  float a[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) a[i] = kUe8m0 ? v[i] * r : __fdiv_rn(v[i], s);
  return e4m3x2_rn_satfinite(a[0], a[1]) | (e4m3x2_rn_satfinite(a[2], a[3]) << 16);
}

__device__ __forceinline__ uint32_t quantize_word(int ue8m0, const float (&v)[4], float s, float r) {
  return ue8m0 ? quantize_word<true>(v, s, r) : quantize_word<false>(v, s, r);
}

// A group of x (load_group, warp-wide) -> the lane's word of 4 e4m3 and the group's scale.
__device__ __forceinline__ void quantize_raw(const W4A8Params& p, uint2 raw, uint32_t& q, float& s) {
  const __nv_bfloat162* h2 = reinterpret_cast<const __nv_bfloat162*>(&raw);
  const float2 f0 = __bfloat1622float2(h2[0]), f1 = __bfloat1622float2(h2[1]);
  const float v[4] = {f0.x, f0.y, f1.x, f1.y};
  float amax = fmaxf(fmaxf(fabsf(v[0]), fabsf(v[1])), fmaxf(fabsf(v[2]), fabsf(v[3])));
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, o));
  float r;
  s = group_scale(p.ue8m0, amax, r);
  q = quantize_word(p.ue8m0, v, s, r);
}

// After GEMM1's input (both quantizers, the whole grid): zero the padding rows of the
// token tiles (finite tokens; padding(r): row r < rows holds no slot) and set the
// counters of GEMM1's epilogue (group_left).
template <class Padding>
__device__ __forceinline__ void pad_rows_and_counters(const W4A8Params& p, int rows, Padding padding) {
  const int G1 = p.K / kChunk, BN = p.block_n;
  const int lg_bn = __ffs(BN) - 1;
  const int lane = threadIdx.x & 31;
  const int nwarps = int(gridDim.x * blockDim.x) >> 5;
  const int warp0 = int(blockIdx.x * blockDim.x + threadIdx.x) >> 5;
  for (int r = warp0; r < rows; r += nwarps) {
    if (!padding(r)) continue;
    const int tile = r >> lg_bn, rr = r & (BN - 1);
    for (int i = lane; i < G1 * 8; i += 32) {
      const size_t row = act_row(tile, i >> 3, G1, BN, rr);
      reinterpret_cast<uint4*>(p.xg + row)[i & 7] = make_uint4(0, 0, 0, 0);
      if ((i & 7) == 0) p.xgs[row / kChunk] = 0.0f;
    }
  }
  const int tid = int(blockIdx.x * blockDim.x + threadIdx.x), nthreads = int(gridDim.x * blockDim.x);
  const int RT1 = p.N / 32;
  for (int i = tid; i < p.max_tiles * p.G2; i += nthreads) p.group_left[i] = min(4, RT1 - 4 * (i % p.G2));
}

// GEMM1's input at decode sizes (mxfp4_route_quant_kernel): a warp quantizes one 128-group
// of one token and writes it to the token tile rows of the token's local slots (xg, xgs);
// then zero padding rows, and reset the counters of the GEMMs' epilogues. The warp's first
// group is quantized before `route()` returns the routing: slot_pos(i), the padded row of
// slot i (-1: not local), rows(), num_tiles * block_n, and padding(r), row r < rows holds
// no slot. At these sizes every group has a warp of its own (config.h's quant_ctas), so the
// group's latency is all the kernel pays; mxfp4_quant_x_kernel is the form for many tokens.
template <class Route, class SlotPos, class Rows, class Padding>
__device__ __forceinline__ void quantize_x(const W4A8Params& p, Route route, SlotPos slot_pos, Rows rows_of,
                                           Padding padding) {
  const int G1 = p.K / kChunk, BN = p.block_n;
  const int lg_bn = __ffs(BN) - 1;  // block_n is a power of two (8, 16)
  const int lane = threadIdx.x & 31;
  const int nwarps = int(gridDim.x * blockDim.x) >> 5;
  const int warp0 = int(blockIdx.x * blockDim.x + threadIdx.x) >> 5;
  const int units = p.M * G1;
  const size_t chunk_stride = size_t(BN) * kChunk;  // bytes from one 128-group of a tile row to the next
  uint32_t q = 0;
  float s = 0.0f;
  if (warp0 < units) quantize_raw(p, load_group(p, warp0 / G1, warp0 % G1, lane), q, s);
  route();
  for (int u = warp0; u < units; u += nwarps) {
    const int tkn = u / G1, grp = u - tkn * G1;
    if (u != warp0) quantize_raw(p, load_group(p, tkn, grp, lane), q, s);
    for (int j = 0; j < p.topk; ++j) {
      const int pos = slot_pos(tkn * p.topk + j);
      if (pos < 0) continue;
      const int tile = pos >> lg_bn, r = pos & (BN - 1);
      const size_t row = act_row(tile, 0, G1, BN, r) + size_t(grp) * chunk_stride;
      *reinterpret_cast<uint32_t*>(p.xg + row + act_word(r, chunk_word_pos(lane))) = q;
      if (lane == 0) p.xgs[row / kChunk] = s;
    }
  }
  pad_rows_and_counters(p, rows_of(), padding);
  const int tid = int(blockIdx.x * blockDim.x + threadIdx.x), nthreads = int(gridDim.x * blockDim.x);
  const int RT2 = p.K / kTileRows;
  for (int i = tid; i < p.M * RT2; i += nthreads) {
    const int tkn = i / RT2, rt = i - tkn * RT2;
    int local = 0;
    for (int j = 0; j < p.topk; ++j) local += slot_pos(tkn * p.topk + j) >= 0;
    p.combine_left[i] = local;
    if (local == 0) {  // no GEMM2 CTA writes this token: its output is zero
      uint4* o = reinterpret_cast<uint4*>(p.out + size_t(tkn) * p.K + rt * kTileRows);
#pragma unroll
      for (int c = 0; c < kTileRows / 8; ++c) o[c] = make_uint4(0, 0, 0, 0);
    }
  }
}

// GEMM1's input after the routing kernel (every call that does not route in
// mxfp4_route_quant_kernel). A warp step is 8 consecutive 128-groups of one token, 4 lanes
// per group: lane 4g + a loads 16-byte pieces a, a + 4, a + 8, a + 12 of group g (elements
// 32i + 8a .. 32i + 8a + 7, i = 0..3), which in MMA order (chunk_word_pos) are exactly the
// 32 bytes at 32a: piece 2a + b holds the 4 words i of half b of the lane's loads. So a
// lane writes two 16-byte stores per local slot instead of one 4-byte word per lane and
// group, the group's amax takes 2 shuffles instead of 5, and the group's scale and the
// token's slot lookups are paid once per 32 elements of a lane instead of once per 4 (the
// earlier form, a warp per group with 4 elements per lane, took 112 us at M = 8192 for ~25 us
// of traffic on the H100, docs/perf-history/2026-12-05-mxfp4-w4a8-quant-x.md; decode sizes
// keep it in the fused kernel, quantize_x). The warps stride over the M * ceil(G1 / 8)
// steps (a window of consecutive tokens at a time), the next step's loads in flight while
// it converts one; the first step's loads are issued before the routing grid is done
// (PDL). The warp of a token's first step also writes its combine_left entries and zeroes
// its output row when it has no local slot (where GEMM1 runs on pairs, GEMM1 writes those
// rows: zero_remote_rows). A group's arithmetic is quantize_raw's
// (group_scale, quantize_word), so xg and xgs are the same bit for bit.
template <bool kUe8m0>
__global__ void __launch_bounds__(256, kQuantXCtasPerSm) mxfp4_quant_x_kernel(const W4A8Params p) {
  pdl_launch_dependents();
  const int G1 = p.K / kChunk, BN = p.block_n, topk = p.topk;
  const int lg_bn = __ffs(BN) - 1;  // block_n is a power of two (8, 16, 64)
  const int lane = threadIdx.x & 31, a = lane & 3, gl = lane >> 2;
  const int q[2] = {(a & 1) ? 2 * a - 1 : 2 * a, (a & 1) ? 2 * a + 1 : 2 * a + 2};  // the pieces this lane stores
  const int nwarps = int(gridDim.x * blockDim.x) >> 5;
  const int warp = int(blockIdx.x * blockDim.x + threadIdx.x) >> 5;
  // Steps in 32 bits: M * ceil(K / 1024) < 2^31 for any x that fits in memory.
  const int spt = (G1 + 7) / 8;  // steps per token
  const int steps = p.M * spt;
  // Warp w takes steps w, w + nwarps, ...: at any time the grid works on one window of
  // consecutive tokens, whose slots the routing placed in runs of consecutive rows of each
  // expert's tiles, so the stores of a window land in runs of whole lines per tile and
  // 128-group rather than scattered over all of xg (with a contiguous range per warp, the
  // tokens in flight were ~M / nwarps apart: docs/perf-history/2026-12-05-mxfp4-w4a8-quant-window.md).
  // (token, step) of warp, then advanced by (dq, dr) per iteration: no division in the loop.
  const int dq = nwarps / spt, dr = nwarps - dq * spt;
  int tkn = warp / spt, step = warp - tkn * spt;
  auto load = [&](int t, int st, uint4 (&raw)[4]) {
    const int grp = st * 8 + gl;
    if (grp < G1) {
      const uint4* src = reinterpret_cast<const uint4*>(p.x + size_t(t) * p.K + size_t(grp) * kChunk) + a;
#pragma unroll
      for (int i = 0; i < 4; ++i) raw[i] = __ldg(src + 4 * i);
    }
  };
  // The token's slot positions j0 .. j0 + 31 (lane j: slot j0 + j, -1 past top-k or not
  // local); the first 32 looked up two steps ahead (below), so neither the step's x loads
  // nor its stores wait for the lookup.
  auto lookup = [&](int t, int j0 = 0) { return slot_lookup(p, t, j0 + lane); };
  // Under expert parallelism many tokens have no local slot (45% at EP8, top-6 of 384),
  // and neither their x nor its conversion is needed: a step's first 32 slot positions
  // are looked up two steps ahead, so the warp knows whether the next step's token has a
  // local slot before it issues that step's x loads, and skips them and the conversion
  // when it has none (docs/perf-history/2026-12-06-mxfp4-w4a8-quant-skip.md). With more
  // than 32 slots per token the first 32 do not tell: every step is converted.
  auto needed = [&](int pos) { return topk > 32 || __ballot_sync(0xFFFFFFFFu, pos >= 0) != 0; };
  auto advance = [&](int& t, int& st) {
    st += dr, t += dq;
    if (st >= spt) st -= spt, ++t;
  };
  int tkn1 = tkn, step1 = step;  // the next step's (token, step), then the one after it
  advance(tkn1, step1);
  uint4 cur[4];
  if (warp < steps) load(tkn, step, cur);  // before the routing is known: x is the call's input
  pdl_wait();  // the routing's tables from here on
  // The zero rows of tokens without a local slot: here, unless GEMM1's pair kernel writes
  // them (late_zero), which it does only where a token tile exists.
  const bool zero_here = !p.late_zero || __ldg(p.num_tiles) == 0;
  int pos_cur = warp < steps ? lookup(tkn) : -1;
  int pos_nxt = warp < steps - nwarps ? lookup(tkn1) : -1;
  const int RT2 = p.K / kTileRows;
  const size_t chunk_stride = size_t(BN) * kChunk;  // bytes from one 128-group of a tile row to the next
  for (int u = warp; u < steps; u += nwarps) {
    int tkn2 = tkn1, step2 = step1;
    advance(tkn2, step2);
    const bool more = u < steps - nwarps;  // no overflow of u + nwarps
    const bool more2 = u < steps - 2 * nwarps;
    uint4 nxt[4];
    const bool need_nxt = more && needed(pos_nxt);
    if (need_nxt) load(tkn1, step1, nxt);
    const int pos_nn = more2 ? lookup(tkn2) : -1;
    const int grp = step * 8 + gl;
    // The group's words: word i of half b holds elements 32i + 8a + 4b .. + 3. The floats
    // are converted from the bf16 twice (for the amax, then for the words) rather than
    // kept: 32 live floats beside both steps' x (32 registers) would not fit the launch
    // bounds' 80 registers.
    uint32_t w[2][4];
    float s, inv_s;
    if (needed(pos_cur)) {  // else no slot of the token is local: nothing is stored
      float amax = 0.0f;
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const __nv_bfloat162* h2 = reinterpret_cast<const __nv_bfloat162*>(&cur[i]);
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          const float2 f = __bfloat1622float2(h2[k]);
          amax = fmaxf(amax, fmaxf(fabsf(f.x), fabsf(f.y)));
        }
      }
      amax = fmaxf(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, 1));
      amax = fmaxf(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, 2));
      s = group_scale<kUe8m0>(amax, inv_s);
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const __nv_bfloat162* h2 = reinterpret_cast<const __nv_bfloat162*>(&cur[i]);
#pragma unroll
        for (int b = 0; b < 2; ++b) {
          const float2 f0 = __bfloat1622float2(h2[2 * b]), f1 = __bfloat1622float2(h2[2 * b + 1]);
          const float e[4] = {f0.x, f0.y, f1.x, f1.y};
          w[b][i] = quantize_word<kUe8m0>(e, s, inv_s);
        }
      }
      // Whole 32-byte sectors per store instruction: a lane's pieces 2a and 2a + 1 (w[0],
      // w[1]) share one sector of the row wherever the swizzle puts them, so the even lane
      // of a pair stores its piece 2a and its partner's piece 2a + 2, the odd lane its
      // partner's piece 2a - 1 and its own 2a + 1; each instruction then fills two sectors
      // of a group's row instead of half of four (one exchange a step, the same bytes).
      const bool odd = a & 1;
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const uint32_t got = __shfl_xor_sync(0xFFFFFFFFu, odd ? w[0][i] : w[1][i], 1);
        if (odd) w[0][i] = got; else w[1][i] = got;
      }
    }
    // The token's local slots, 32 at a time: each lane looks one up, the warp walks the ballot.
    int local = 0;
    for (int j0 = 0; j0 < topk; j0 += 32) {
      const int pos = j0 == 0 ? pos_cur : lookup(tkn, j0);
      uint32_t mask = __ballot_sync(0xFFFFFFFFu, pos >= 0);
      local += __popc(mask);
      while (mask != 0) {
        const int j = __ffs(mask) - 1;
        mask &= mask - 1;
        const int sp = __shfl_sync(0xFFFFFFFFu, pos, j);
        if (grp < G1) {
          const int tile = sp >> lg_bn, r = sp & (BN - 1);
          const size_t row = act_row(tile, 0, G1, BN, r) + size_t(grp) * chunk_stride;
#pragma unroll
          for (int b = 0; b < 2; ++b)  // pieces q[b] (above: 2a, 2a + 2 even; 2a - 1, 2a + 1 odd)
            *reinterpret_cast<uint4*>(p.xg + row + ((q[b] ^ (r & 7)) << 4)) =
                make_uint4(w[b][0], w[b][1], w[b][2], w[b][3]);
          if (a == 0) p.xgs[row / kChunk] = s;
        }
      }
    }
    if (step == 0) {  // once per token: GEMM2's combine counters, and a zero output without local slots
      for (int rt = lane; rt < RT2; rt += 32) p.combine_left[size_t(tkn) * RT2 + rt] = local;
      if (local == 0 && zero_here) {  // no GEMM2 CTA writes this token
        uint4* o = reinterpret_cast<uint4*>(p.out + size_t(tkn) * p.K);
        for (int c = lane; c < p.K / 8; c += 32) o[c] = make_uint4(0, 0, 0, 0);
      }
    }
    if (need_nxt) {
#pragma unroll
      for (int i = 0; i < 4; ++i) cur[i] = nxt[i];
    }
    pos_cur = pos_nxt;
    pos_nxt = pos_nn;
    tkn = tkn1, step = step1;
    tkn1 = tkn2, step1 = step2;
  }
  const int* row_slot = p.row_slot;
  pad_rows_and_counters(p, __ldg(p.num_tiles) * BN, [=](int r) { return __ldg(row_slot + r) < 0; });
}

// At decode sizes (M * k <= kFusedRouteSlots slots, token tiles of 8 or 16 rows:
// config.h's fused_route), the routing and GEMM1's input quantization in one kernel: every
// CTA routes the few slots itself in shared memory (the same tables in every CTA), CTA 0
// publishes them for the GEMMs, and no second kernel boundary (the one-CTA routing kernel,
// then mxfp4_quant_x_kernel waiting for it) sits before GEMM1. The tables are
// moe_route_kernel's (routing.cuh): tiles in expert order, an expert's rows padded to
// block_n; only the order of the rows inside an expert differs (slot order here, shared
// atomics there), and every row is computed on its own and combined by slot, so the
// outputs are bitwise the same. Launched without PDL, as the routing kernel it replaces.
// Bounds: params.cuh (kFusedRouteSlots, kFusedRouteRows; config.h keeps calls within them).
__global__ void __launch_bounds__(256) mxfp4_route_quant_kernel(const MoeParams rp, const W4A8Params p) {
  pdl_launch_dependents();
  __shared__ int s_ev[kFusedRouteSlots];     // local expert of each slot, -1: not local
  __shared__ int s_rank[kFusedRouteSlots];   // rank among the expert's slots (slot order)
  __shared__ int s_tiles[kFusedRouteSlots];  // the expert's tiles at its first slot, else 0
  __shared__ int s_pos[kFusedRouteSlots];    // padded row, -1: not local
  __shared__ uint8_t s_used[kFusedRouteRows];
  __shared__ int s_bad, s_num_tiles;
  auto route = [&] {
    const int tid = threadIdx.x, S = p.M * p.topk, BN = p.block_n;
    // The slots' local experts (params.cuh's rules, as routing.cuh resolve_experts: an id
    // or a map entry out of range marks the call bad and the slot not local).
    if (tid == 0) s_bad = 0;
    __syncthreads();
    if (tid < S) {
      const int n_ids = expert_id_bound(rp);
      const int id = __ldg(rp.topk_ids + tid);
      bool bad = id < 0 || id >= n_ids;
      int ev = bad ? -1 : id;
      if (rp.expert_map != nullptr && ev >= 0) {
        ev = __ldg(rp.expert_map + ev);
        if (map_entry_bad(rp, ev)) {
          bad = true;
          ev = -1;
        }
      }
      if (bad) atomicOr(&s_bad, 1);  // a shared atomic: racecheck sees no write-write hazard
      s_ev[tid] = ev;
    }
    for (int r = tid; r < kFusedRouteRows; r += blockDim.x) s_used[r] = 0;
    __syncthreads();
    if (tid < S) {  // rank within the expert, and the expert's tiles at its first slot
      const int ev = s_ev[tid];
      int rank = 0, cnt = 0;
      for (int j = 0; j < S; ++j) {
        const bool same = ev >= 0 && s_ev[j] == ev;
        cnt += same;
        rank += same && j < tid;
      }
      s_rank[tid] = rank;
      s_tiles[tid] = ev >= 0 && rank == 0 ? (cnt + BN - 1) / BN : 0;
    }
    __syncthreads();
    int tile0 = 0;  // this slot's expert's first tile (tiles in expert order)
    if (tid < S) {
      const int ev = s_ev[tid];
      int total = 0;
      for (int j = 0; j < S; ++j) {
        const int t = s_tiles[j];
        total += t;
        tile0 += s_ev[j] < ev ? t : 0;  // s_tiles is 0 at slots that are not local
      }
      const int pos = ev >= 0 ? tile0 * BN + s_rank[tid] : -1;
      s_pos[tid] = pos;
      if (pos >= 0) s_used[pos] = 1;
      if (tid == 0) s_num_tiles = total;
    }
    __syncthreads();
    if (blockIdx.x == 0) {  // the tables and counters the GEMMs read (moe_route_kernel's)
      const int rows = s_num_tiles * BN;
      for (int r = tid; r < rows; r += blockDim.x) rp.row_slot[r] = -1;
      if (tid == 0) {
        *rp.num_tiles = s_num_tiles;
        *rp.error_flag = s_bad;
      }
      if (rp.splitk)
        for (int i = tid; i < 2 * rp.sk_ctas; i += blockDim.x) rp.sk_count[i] = 0;
      for (int i = tid; i < p.max_tiles; i += blockDim.x) rp.group_ready[i] = 0;
      __syncthreads();  // the -1 fill before the slots' rows
      if (tid < S) {
        const int pos = s_pos[tid];
        rp.slot_pos[tid] = pos;
        if (pos >= 0) rp.row_slot[pos] = tid;
        for (int t = 0; t < s_tiles[tid]; ++t) rp.tile_expert[tile0 + t] = s_ev[tid];
      }
    }
  };
  quantize_x(
      p, route, [&](int i) { return s_pos[i]; }, [&] { return s_num_tiles * p.block_n; },
      [&](int r) { return s_used[r] == 0; });
}

// ------------------------------------------------------------------ the GEMMs ------

// A token tile with no slot: the second tile of an odd count under tile_pairs (tiles fill
// from their first row, so its first row tells). Read through L2: GEMM2 reads it before
// any grid wait, as tile_expert.
template <int BN>
__device__ __forceinline__ bool tile_empty(const W4A8Params& p, int tile) {
  return __ldcg(p.row_slot + tile * BN) < 0;
}

template <int BN, int CHUNKS>
struct Smem {
  // Two ring slots of CHUNKS / 2 chunks (as the NVFP4 decode tiles: one barrier, one set
  // of copies and one wait per slot).
  static constexpr int kSteps = CHUNKS / 2;
  static constexpr int kSlots = 2;
  static_assert(CHUNKS % 2 == 0, "two ring slots");
  static constexpr int kB = BN * kChunk;  // one 128-chunk of BN FP8 token rows
  static constexpr int kSx = BN * 4;      // their fp32 scales
  static constexpr int kPipe = CHUNKS * (kB + kCodeTile + kScaleTile + kSx);
  static constexpr int kStaging = BN * 128;  // GEMM1: 32 fp32 columns, GEMM2: 64 bf16
  static constexpr int kMax = kPipe > kStaging ? kPipe : kStaging;
  static constexpr int kBytes = kMax + 1024;  // + alignment slack
};

// Epilogue staging (as nvfp4_gemm.cuh): 128 bytes per token row, 8-column groups
// XOR-swizzled by row so that a warp's fragment writes hit distinct banks.
__device__ __forceinline__ int stage1_index(int tok, int col) { return tok * 32 + (col ^ (((tok >> 1) & 3) << 3)); }
__device__ __forceinline__ int stage2_index(int tok, int col) { return tok * 64 + (col ^ (((tok >> 1) & 3) << 3)); }

// GEMM1 epilogue of item (tile, rt): the SwiGLU of the 32 columns 32rt .. 32rt + 31 (warp
// w: columns 8w + g, gate in the accumulators of row g, up in those of row g + 8) for the
// tile's BN rows, to hf; the last CTA of the 128-column group quantizes the group to FP8
// (hq, hs) and publishes it to GEMM2 (group_ready).
template <int BN>
__device__ __forceinline__ void gemm1_epilogue(const W4A8Params& p, const float (&acc)[BN / 2], float* stg, int tile,
                                               int rt, int tid) {
  const int warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const float L = p.swiglu_limit;
#pragma unroll
  for (int c = 0; c < BN / 8; ++c) {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      float gate = acc[4 * c + i], up = acc[4 * c + 2 + i];
      if (p.has_limit) {
        gate = fminf(gate, L);
        up = fminf(fmaxf(up, -L), L);
      }
      stg[stage1_index(8 * c + 2 * t + i, 8 * warp + g)] = silu(gate) * up;
    }
  }
  __syncthreads();
  const int N = p.N, row0 = tile * BN;
  for (int idx = tid; idx < BN * 8; idx += kThreads) {
    const int tok = idx >> 3, ch = idx & 7;
    const float4 v = *reinterpret_cast<const float4*>(stg + stage1_index(tok, ch * 4));
    __stcg(reinterpret_cast<float4*>(p.hf + size_t(row0 + tok) * N + rt * 32 + ch * 4), v);
  }
  __threadfence();
  __syncthreads();
  const int j = rt >> 2;
  __shared__ int s_last_group;
  if (tid == 0) s_last_group = atomicSub(p.group_left + tile * p.G2 + j, 1) == 1;
  __syncthreads();
  if (!s_last_group) return;
  __threadfence();
  // Token tok, elements 8u .. 8u + 7 of the group (u = 0..15): 16 lanes per token. Every
  // iteration's loads first (the group's hf rows come from L2: the other CTAs wrote them):
  // behind the hq stores, which may alias hf for the compiler, they were one L2 round trip
  // per iteration, 8 at 64-token tiles, in the last CTA of every group
  // (docs/perf-history/2026-12-04-mxfp4-w4a8-fused-route.md).
  const int ncols = min(kChunk, N - kChunk * j);
  constexpr int kIters = BN * 16 / kThreads;
  static_assert(kIters * kThreads == BN * 16, "whole iterations of the group's 16 lanes per token");
  float4 ld[kIters][2];
#pragma unroll
  for (int it = 0; it < kIters; ++it) {
    const int idx = tid + it * kThreads, tok = idx >> 4, u = idx & 15;
    ld[it][0] = ld[it][1] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);  // past N: zero columns (w2's padded K)
    if (8 * u < ncols) {
      const float* src = p.hf + size_t(row0 + tok) * N + kChunk * j + 8 * u;
      ld[it][0] = __ldcg(reinterpret_cast<const float4*>(src));
      ld[it][1] = __ldcg(reinterpret_cast<const float4*>(src + 4));
    }
  }
#pragma unroll
  for (int it = 0; it < kIters; ++it) {
    const int idx = tid + it * kThreads, tok = idx >> 4, u = idx & 15;
    const float4 a = ld[it][0], b = ld[it][1];
    const float v[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
    float amax = 0.0f;
#pragma unroll
    for (int i = 0; i < 8; ++i) amax = fmaxf(amax, fabsf(v[i]));
#pragma unroll
    for (int o = 1; o < 16; o <<= 1) amax = fmaxf(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, o));
    const float s = fmaxf(__fdiv_rn(amax, 448.0f), 1e-30f);
    const float r = __frcp_rn(s);
    uint32_t q[2] = {0, 0};
#pragma unroll
    for (int i = 0; i < 8; ++i) q[i >> 2] |= uint32_t(e4m3_rn_satfinite(__fmul_rn(v[i], r)).__x) << (8 * (i & 3));
    const size_t row = act_row(tile, j, p.G2, BN, tok);
    *reinterpret_cast<uint32_t*>(p.hq + row + act_word(tok, chunk_word_pos(2 * u))) = q[0];
    *reinterpret_cast<uint32_t*>(p.hq + row + act_word(tok, chunk_word_pos(2 * u + 1))) = q[1];
    if (u == 0) p.hs[row / kChunk] = s;
  }
  __threadfence();
  __syncthreads();
  if (tid == 0) atomicAdd(p.group_ready + tile, 1);
}

// GEMM2 epilogue of item (tile, rt), first half: y (bf16) of the output columns
// 64rt .. 64rt + 63 for the tile's rows (staged through shared memory: 16-byte stores).
template <int BN>
__device__ __forceinline__ void gemm2_store_y(const W4A8Params& p, const float (&acc)[BN / 2], __nv_bfloat16* stg,
                                              int tile, int rt, int tid) {
  const int warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int c = 0; c < BN / 8; ++c) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int tok = 8 * c + 2 * t + (i & 1);
      const int kk = 16 * warp + g + 8 * (i >> 1);
      stg[stage2_index(tok, kk)] = __float2bfloat16_rn(acc[4 * c + i]);
    }
  }
  __syncthreads();
  const int K = p.K, row0 = tile * BN;
  for (int idx = tid; idx < BN * 8; idx += kThreads) {
    const int tok = idx >> 3, ch = idx & 7;
    const uint4 o = *reinterpret_cast<const uint4*>(stg + stage2_index(tok, ch * 8));
    __stcg(reinterpret_cast<uint4*>(p.y + size_t(row0 + tok) * K + rt * kTileRows + ch * 8), o);
  }
}

// sum[0..7] = sum_j topk_weights[m, j] * y[slot_pos[m, j], col .. col + 7] over token m's
// local slots (slot_pos >= 0) in slot order, fp32 fmaf from zero (moe_combine_kernel's
// arithmetic), kSlots slots at a time with their positions, weights and rows in flight
// together. With kSlots = 1 it is the plain loop: one dependent pair of loads (slot_pos,
// then y) after another, 6 round trips per column chunk at top-6; the GEMM2 CTAs of
// several weight tiles (mxfp4_gemm2_rows_kernel, _resident_kernel: few warps per SM in
// their epilogue to hide that) take 8 (docs/perf-history/2026-12-04-mxfp4-w4a8-fused-route.md),
// the others keep 1 (their registers: the 8-slot batch costs ~40, which took the 8-token
// classic GEMM2 from 46 to 80 and the 64-token split-K GEMM2 over its cap of 128). y is read
// through L2 (__ldcg): other CTAs of the same grid wrote it.
template <int kSlots>
__device__ __forceinline__ void slot_sum8(const int* slot_pos, const float* topk_weights, const __nv_bfloat16* y,
                                          int K, int topk, int m, int col, float (&sum)[8]) {
#pragma unroll
  for (int i = 0; i < 8; ++i) sum[i] = 0.0f;
  for (int j0 = 0; j0 < topk; j0 += kSlots) {
    int pos[kSlots];
#pragma unroll
    for (int i = 0; i < kSlots; ++i) pos[i] = j0 + i < topk ? __ldg(slot_pos + m * topk + j0 + i) : -1;
    float w[kSlots];
    uint4 raw[kSlots];
#pragma unroll
    for (int i = 0; i < kSlots; ++i) {
      if (pos[i] < 0) continue;
      w[i] = __ldg(topk_weights + m * topk + j0 + i);
      raw[i] = __ldcg(reinterpret_cast<const uint4*>(y + size_t(pos[i]) * K + col));
    }
#pragma unroll
    for (int i = 0; i < kSlots; ++i)
      if (pos[i] >= 0) fma_bf16x8(sum, w[i], raw[i]);
  }
}

// GEMM2 epilogue, second half, once this CTA stored its y of the R row tiles rt0 .. rt0 + R - 1
// (output columns 64rt0 .. 64(rt0 + R) - 1): for each tile row whose token now has all its
// local slots' y of these columns, out = sum_j topk_weights[m, j] * y[slot_pos[m, j]] in slot
// order (fp32, one bf16 rounding), by the CTA that completed the token's count. One count per
// token and group of R row tiles: combine_left[m, rt0] (every CTA of a call covers the same
// groups, so the other R - 1 counters of a group stay unused).
template <int BN, int R>
__device__ __forceinline__ void gemm2_combine(const W4A8Params& p, int tile, int rt0, int tid) {
  __threadfence();
  __syncthreads();
  const int K = p.K, row0 = tile * BN, RT2 = K / kTileRows;
  static_assert(BN <= kThreads, "one thread per token tile row");
  __shared__ int s_token[BN];  // token whose count this CTA completed, per tile row; -1 = none
  if (tid < BN) {
    const int slot = p.row_slot[row0 + tid];
    int m = -1;
    if (slot >= 0) {
      const int tkn = slot / p.topk;
      if (atomicSub(p.combine_left + tkn * RT2 + rt0, 1) == 1) m = tkn;
    }
    s_token[tid] = m;
  }
  __syncthreads();
  __threadfence();
  for (int idx = tid; idx < BN * 8 * R; idx += kThreads) {
    const int m = s_token[idx / (8 * R)], col = rt0 * kTileRows + (idx % (8 * R)) * 8;
    if (m < 0) continue;
    float sum[8];
    slot_sum8<(R > 1 ? 8 : 1)>(p.slot_pos, p.topk_weights, p.y, K, p.topk, m, col, sum);
    *reinterpret_cast<uint4*>(p.out + size_t(m) * K + col) = pack_bf16x8(sum);
  }
}

// GEMM2 does not wait for GEMM1's grid: before reading a token tile's h it waits until
// all G2 FP8 groups of that tile were published (as nvfp4_gemm.cuh's gemm2_wait_h), then
// orders that acquire before its bulk copies of them (async proxy).
__device__ __forceinline__ void gemm2_wait_h(const W4A8Params& p, int tile) {
  if (threadIdx.x == 64 || threadIdx.x == 96) {  // the threads that copy the token tiles (gemm_segment's issuers 2, 3)
    wait_flag_geq(p.group_ready + tile, p.G2);
    fence_proxy_async_global();
  }
  __syncthreads();  // reconverge: the K loop's ring bookkeeping stays on the uniform datapath
}

// A chunk's A fragments: this thread's codes of rows g and g + 8 (w_rd, w_rd + 2048) and
// their scale words (s_rd, returned for the promotion) -> the 16 e4m3 words of the chunk's
// 4 k32 steps, all computed and fenced before the first wgmma (else ptxas splits the group
// to re-fence registers written between the wgmmas, C7519).
__device__ __forceinline__ uint2 chunk_fragments(uint32_t (&a)[4][4], uint32_t w_rd, uint32_t s_rd, uint32_t lut_base,
                                                 uint32_t rot) {
  const uint4 c_lo = lds_v4(w_rd);         // row g: steps 0..3
  const uint4 c_hi = lds_v4(w_rd + 2048);  // row g + 8
  const uint2 sw = lds_v2(s_rd);
  const uint2 t_lo = lds_v2(lut_base + lut_offset(sw.x, rot));
  const uint2 t_hi = lds_v2(lut_base + lut_offset(sw.y, rot));
  const uint32_t w_lo[4] = {c_lo.x, c_lo.y, c_lo.z, c_lo.w}, w_hi[4] = {c_hi.x, c_hi.y, c_hi.z, c_hi.w};
#pragma unroll
  for (int s = 0; s < 4; ++s) {
    e2m1x8_to_e4m3(w_lo[s], t_lo, a[s][0], a[s][2]);
    e2m1x8_to_e4m3(w_hi[s], t_hi, a[s][1], a[s][3]);
  }
#pragma unroll
  for (int s = 0; s < 4; ++s) fence_regs(a[s]);
  return sw;
}

// The chunk's 4 wgmmas into part (the first overwrites), waited for.
template <int BN>
__device__ __forceinline__ void chunk_wgmmas(float (&part)[BN / 2], const uint32_t (&a)[4][4], uint64_t desc) {
  wgmma_fence();
#pragma unroll
  for (int s = 0; s < 4; ++s) WgmmaRsE4m3<BN>::mma(part, a[s], desc + 2 * s, s);
  wgmma_commit();
  wgmma_wait<0>();
  fence_regs(part);
}

// The promotion: acc += part * (2^b[row] * s_x[token]), rows' bases from the scale words sw,
// token scales at sx.
template <int BN>
__device__ __forceinline__ void chunk_promote(float (&acc)[BN / 2], const float (&part)[BN / 2], uint2 sw,
                                              const uint8_t* sx, int t) {
  const float f_lo = chunk_base(sw.x), f_hi = chunk_base(sw.y);
#pragma unroll
  for (int h = 0; h < BN / 8; ++h) {
    const float2 x = *reinterpret_cast<const float2*>(sx + (8 * h + 2 * t) * 4);
    acc[4 * h + 0] = fmaf(part[4 * h + 0], f_lo * x.x, acc[4 * h + 0]);
    acc[4 * h + 1] = fmaf(part[4 * h + 1], f_lo * x.y, acc[4 * h + 1]);
    acc[4 * h + 2] = fmaf(part[4 * h + 2], f_hi * x.x, acc[4 * h + 2]);
    acc[4 * h + 3] = fmaf(part[4 * h + 3], f_hi * x.y, acc[4 * h + 3]);
  }
}

// One 128-chunk (chunk_fragments, chunk_wgmmas, chunk_promote; the pair kernels call the
// three themselves): the A fragments of its 4 k32 steps (16 words: this thread's codes of rows
// g and g + 8 at w_rd and w_rd + 2048, their scale words at s_rd), 4 wgmmas into part, then
// the promotion into acc (acc += part * 2^b[row] * s_x[token], token scales at sx). B: the
// chunk's BN token rows, K-major, 128-byte swizzled (8-row groups 1024 bytes apart; desc);
// a k32 step advances 32 bytes (2 in the descriptor's address field).
template <int BN>
__device__ __forceinline__ void chunk_mma(float (&acc)[BN / 2], float (&part)[BN / 2], uint32_t w_rd, uint32_t s_rd,
                                          uint32_t lut_base, uint32_t rot, uint64_t desc, const uint8_t* sx, int t) {
  uint32_t a[4][4];
  const uint2 sw = chunk_fragments(a, w_rd, s_rd, lut_base, rot);
  chunk_wgmmas<BN>(part, a, desc);
  chunk_promote<BN>(acc, part, sw, sx, t);
}

// K chunks [kb, ke) of item (tile, rt) (chunk `chunk` of `splits`, item index `item`),
// then its epilogue (GEMM2 without kCombine: the y stores only, the caller combines);
// split-K fixup as nvfp4_gemm.cuh's gemm_segment (the CTA that completes the item's count
// adds the partials in chunk order). lut: the shift tables.
// Every operand of a ring slot is one contiguous run (weight codes and scales in the
// prepared layout, token rows and their scales in the tiled activation layout), so a
// slot comes in by four bulk copies counted on its mbarrier; no thread copies, and
// nothing written through the generic proxy is read by the wgmmas.
template <int BN, int CHUNKS, bool kGemm1, bool kCombine = true, typename BeforeTokens>
__device__ __forceinline__ void gemm_segment(const W4A8Params& p, uint8_t* smem, uint64_t* full, const uint8_t* lut,
                                             int& ring, uint32_t& phase, int tile, int rt, int kb, int ke, int item,
                                             int splits, int chunk, int tid, BeforeTokens before_tokens) {
  const int e = __ldcg(p.tile_expert + tile);  // L2: GEMM2 reads it before any grid wait
  const int KT = kGemm1 ? p.K / kChunk : p.G2;
  const int RT = kGemm1 ? p.N / 32 : p.K / kTileRows;
  const int nk = ke - kb;
  using S = Smem<BN, CHUNKS>;
  constexpr int kSteps = S::kSteps, kSlots = S::kSlots;
  const int nslots = (nk + kSteps - 1) / kSteps;
  const size_t tile_index = (size_t(e) * RT + rt) * KT + kb;
  const uint8_t* wq = (kGemm1 ? p.w13 : p.w2) + tile_index * kCodeTile;
  const uint8_t* wsc = (kGemm1 ? p.w13_scale : p.w2_scale) + tile_index * kScaleTile;
  const size_t act_index = size_t(tile) * KT + kb;
  const uint8_t* bq = (kGemm1 ? p.xg : p.hq) + act_index * S::kB;
  const float* bs = (kGemm1 ? p.xgs : p.hs) + act_index * BN;

  uint8_t* sB = smem;
  uint8_t* sW = sB + CHUNKS * S::kB;
  uint8_t* sS = sW + CHUNKS * kCodeTile;
  uint8_t* sX = sS + CHUNKS * kScaleTile;

  const int warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;

  // The slot's expected bytes are set with its weights; the four copies are issued by
  // lane 0 of four warps (a bulk copy is ~15 instructions of uniform-operand setup: one
  // warp issuing all four would lag the others, which meet it at every wgmma). A copy
  // may complete before the expect_tx (the tx-count goes negative; the phase still needs
  // the arrival), so the token copies may also follow later (GEMM2: after the wait for h).
  const int issuer = lane == 0 ? warp : -1;  // lane 0 of warp 0, 1 (weights), 2, 3 (tokens)
  auto load_weights = [&](int si, int slot) {
    if (si < nslots && (issuer == 0 || issuer == 1)) {
      const int k0 = kSteps * si;
      const int steps = min(kSteps, nk - k0);
      if (issuer == 0) {
        mbar_arrive_expect_tx(full + slot, steps * (kCodeTile + kScaleTile + S::kB + S::kSx));
        bulk_g2s(smem_u32(sW) + slot * kSteps * kCodeTile, wq + size_t(k0) * kCodeTile, steps * kCodeTile,
                 full + slot);
      } else {
        bulk_g2s(smem_u32(sS) + slot * kSteps * kScaleTile, wsc + size_t(k0) * kScaleTile, steps * kScaleTile,
                 full + slot);
      }
    }
  };
  auto load_tokens = [&](int si, int slot) {
    if (si < nslots && (issuer == 2 || issuer == 3)) {
      const int k0 = kSteps * si;
      const int steps = min(kSteps, nk - k0);
      if (issuer == 2)
        bulk_g2s(smem_u32(sB) + slot * kSteps * S::kB, bq + size_t(k0) * S::kB, steps * S::kB, full + slot);
      else
        bulk_g2s(smem_u32(sX) + slot * kSteps * S::kSx, bs + size_t(k0) * BN, steps * S::kSx, full + slot);
    }
  };

  // Prefetch distance kSlots - 1: the slot refilled in slot step si was read in si - 1,
  // whose reads every warp finished (wgmma_wait<0>) before this slot's barrier. The ring
  // position (slot `ring`, mbarrier parity `phase`) carries over between the segments of
  // a persistent CTA.
  constexpr int kAhead = kSlots - 1;
  auto slot_after = [](int slot, int n) { return slot + n >= kSlots ? slot + n - kSlots : slot + n; };
#pragma unroll
  for (int j = 0; j < kAhead; ++j) load_weights(j, slot_after(ring, j));
  before_tokens();
#pragma unroll
  for (int j = 0; j < kAhead; ++j) load_tokens(j, slot_after(ring, j));

  float acc[BN / 2];
#pragma unroll
  for (int i = 0; i < BN / 2; ++i) acc[i] = 0.0f;

  const uint64_t desc0 = wgmma_desc_sw128(smem_u32(sB), 16, 1024);  // the address field advances by bytes >> 4
  const uint32_t sW_rd = smem_u32(sW) + tid * 16;
  const uint32_t sS_rd = smem_u32(sS) + (warp * 8 + g) * 8;
  const uint32_t lut_base = smem_u32(lut);
  const uint32_t rot = (4 * t - 3) & 31;
  float part[BN / 2];  // one chunk's sums (each chunk's first wgmma overwrites them)
#pragma unroll
  for (int i = 0; i < BN / 2; ++i) part[i] = 0.0f;

  auto chunk_at = [&](int st) {
    chunk_mma<BN>(acc, part, sW_rd + st * kCodeTile, sS_rd + st * kScaleTile, lut_base, rot,
                  desc0 + uint32_t(st * (S::kB >> 4)), sX + st * S::kSx, t);
  };

  // Slot step si ready: everyone is done with the slot refilled next, the slot's bytes arrived.
  auto enter_slot = [&](int si) {
    __syncthreads();
    load_weights(si + kAhead, slot_after(ring, kAhead));
    load_tokens(si + kAhead, slot_after(ring, kAhead));
    mbar_wait(full + ring, phase);
  };

  const int full_slots = nk / kSteps;
  for (int si = 0; si < full_slots; ++si) {
    enter_slot(si);
    const int st = kSteps * ring;
#pragma unroll
    for (int q = 0; q < kSteps; ++q) chunk_at(st + q);
    ring_advance<kSlots>(ring, phase);
  }
  if (const int rest = nk - full_slots * kSteps) {  // the last 1 .. kSteps - 1 chunks
    enter_slot(full_slots);
    const int st = kSteps * ring;
    for (int q = 0; q < rest; ++q) chunk_at(st + q);
    ring_advance<kSlots>(ring, phase);
  }
  __syncthreads();

  // Split-K fixup (as nvfp4_gemm.cuh): partials thread-major; GEMM2's in the second half
  // of the buffer (the two GEMMs overlap in time).
  constexpr int kPartial = kTileRows * BN;
  if (splits > 1) {
    float* part = p.sk_partial + (kGemm1 ? 0 : size_t(p.sk_ctas) * kPartial) + size_t(item) * splits * kPartial + tid;
#pragma unroll
    for (int i = 0; i < BN / 2; ++i) __stcg(part + chunk * kPartial + i * kThreads, acc[i]);
    __threadfence();
    __syncthreads();
    int* arrivals = p.sk_count + (kGemm1 ? 0 : p.sk_ctas) + item;
    __shared__ int s_last;
    if (tid == 0) {
      s_last = atomicAdd(arrivals, 1) == splits - 1;
      __threadfence();
    }
    __syncthreads();
    if (!s_last) return;
    float own[BN / 2];
#pragma unroll
    for (int i = 0; i < BN / 2; ++i) {
      own[i] = acc[i];
      acc[i] = 0.0f;
    }
    for (int j = 0; j < splits; ++j) {
#pragma unroll
      for (int i = 0; i < BN / 2; ++i) acc[i] += j == chunk ? own[i] : __ldcg(part + j * kPartial + i * kThreads);
    }
  }

  if constexpr (kGemm1)
    gemm1_epilogue<BN>(p, acc, reinterpret_cast<float*>(smem), tile, rt, tid);
  else {
    gemm2_store_y<BN>(p, acc, reinterpret_cast<__nv_bfloat16*>(smem), tile, rt, tid);
    if constexpr (kCombine) gemm2_combine<BN, 1>(p, tile, rt, tid);
  }
}

// The ring's mbarriers and the shift tables (all threads), then one barrier.
template <int NBARS>
__device__ __forceinline__ void init_cta(uint64_t (&full)[NBARS], uint8_t* lut) {
  build_lut(lut);
  if (threadIdx.x == 0) {
#pragma unroll
    for (int j = 0; j < NBARS; ++j) mbar_init(full + j, 1);
    mbar_init_fence();
  }
  __syncthreads();
}

// Launch order and waits as nvfp4_gemm.cuh (gemm_grid_dependencies): GEMM1 waits for the
// quantization grid (which waited for the routing grid) before it lets GEMM2 launch;
// GEMM2 never waits for GEMM1's grid, only per token tile for its h (gemm2_wait_h).
template <bool kGemm1>
__device__ __forceinline__ void gemm_grid_dependencies() {
  if constexpr (kGemm1) pdl_wait();
  pdl_launch_dependents();
}

// Classic grid: x = 64-row weight tile (fastest, so a token tile's h completes early),
// y = token tile. At 64-token tiles gridDim.y is config.h's grid_tiles, the tiles expected
// under uniform routing with a margin, not the host's bound max_tiles (every slot local,
// so ~7 CTAs that only read *num_tiles and exit for each working one at M = 8192 under
// EP8, docs/perf-history/2026-12-05-mxfp4-w4a8-quant-x.md): a CTA takes the tiles
// blockIdx.y, + gridDim.y, ... below *num_tiles one after the other, each tile's sums as
// before. At 8- and 16-token tiles (decode, where the bound is near the tiles that exist)
// the grid has max_tiles rows and a CTA one tile: there the loop cost 7-34 registers.
// CTAs past *num_tiles exit at once.
template <int BN, int CHUNKS, bool kGemm1>
__global__ void __launch_bounds__(kThreads) mxfp4_gemm_kernel(const W4A8Params p) {
  gemm_grid_dependencies<kGemm1>();
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = align_smem_1024(smem_raw);
  __shared__ uint64_t full[Smem<BN, CHUNKS>::kSlots];
  __shared__ __align__(16) uint8_t lut[kLutBytes];
  const int num_tiles = __ldcg(p.num_tiles);
  if (int(blockIdx.y) >= num_tiles) return;
  init_cta(full, lut);
  int ring = 0;
  uint32_t phase = 0;
  const int KT = kGemm1 ? p.K / kChunk : p.G2;
  auto run = [&](int tile) {
    gemm_segment<BN, CHUNKS, kGemm1>(p, smem, full, lut, ring, phase, tile, blockIdx.x, 0, KT, 0, 1, 0, threadIdx.x,
                                     [&] {
                                       if constexpr (!kGemm1) gemm2_wait_h(p, tile);
                                     });
  };
  if constexpr (BN == 64) {
#pragma unroll 1
    for (int tile = blockIdx.y; tile < num_tiles; tile += gridDim.y) {
      // GEMM2 skips the empty second tile of an odd count (tile_pairs); GEMM1's pair
      // kernel published nothing for it
      if (kGemm1 || !tile_empty<BN>(p, tile)) run(tile);
      if (tile + int(gridDim.y) < num_tiles) {  // the epilogue's staging is the next tile's ring
        fence_proxy_async_smem();
        __syncthreads();
      }
    }
  } else {
    run(blockIdx.y);
  }
}

// ------------------------------------------------------ GEMM1 on pairs of tiles ---

// The zero output rows of tokens without a local slot, where GEMM1's pair kernel writes them
// (config.h late_zero; mxfp4_quant_x_kernel elsewhere). Working CTA `unit` of `units` takes
// kZeroTokens consecutive tokens (unit * kZeroTokens, then + units * kZeroTokens, ...), so
// the first waves do it all: at V4-Pro M = 8192 under a tenth of the CTAs, one slot lookup
// round trip each at its start (a warp looks up its tokens' slots together). At the start,
// not beside the K loop: there the same code cost the loop two spilled registers (SASS).
// Ordering: the stores precede the CTA's epilogue, whose __threadfence precedes its count
// of its h groups (gemm1_epilogue); GEMM2, every CTA of which acquires the h it reads,
// therefore finishes after them, and so does the op. Streaming stores (evict first): the
// rows are not read again in the op.
constexpr int kZeroTokens = 16;

__device__ __forceinline__ void zero_remote_rows(const W4A8Params& p, int unit, int units, int tid) {
  constexpr int kPerWarp = kZeroTokens / (kThreads / 32);
  const int warp = tid >> 5, lane = tid & 31;
  for (int base = unit * kZeroTokens; base < p.M; base += units * kZeroTokens) {
    int pos[kPerWarp];
#pragma unroll
    for (int i = 0; i < kPerWarp; ++i) {
      const int t = base + warp * kPerWarp + i;
      pos[i] = t < p.M ? slot_lookup(p, t, lane) : -1;
    }
#pragma unroll
    for (int i = 0; i < kPerWarp; ++i) {
      const int t = base + warp * kPerWarp + i;
      bool local = __ballot_sync(0xFFFFFFFFu, pos[i] >= 0) != 0;
      for (int j0 = 32; !local && j0 < p.topk; j0 += 32)  // more than 32 slots per token
        local = __ballot_sync(0xFFFFFFFFu, slot_lookup(p, t, j0 + lane) >= 0) != 0;
      if (t < p.M && !local) {
        uint4* o = reinterpret_cast<uint4*>(p.out + size_t(t) * p.K);
        for (int c = lane; c < p.K / 8; c += 32) __stcs(o + c, make_uint4(0, 0, 0, 0));
      }
    }
  }
}

// GEMM1 at 64-token tiles, a CTA per 64-row weight tile and PAIR of token tiles of one
// expert (routing with tile_pairs: every expert has an even number of tiles, the second
// of an odd count empty). Why: the one-tile kernel spends 228 instructions per 128-chunk
// and warp (the weights' conversion ~75, the promotion 64, ~70 of bookkeeping) on four
// m64n64k32 wgmmas, and its time follows each warp's chain per chunk (slot wait,
// conversion, wgmmas, their wait, promotion), hidden only by the SM's other warps (ncu at
// M = 8192 under EP8, docs/perf-history/2026-12-05-mxfp4-w4a8-pairs.md).
// Here a chunk's A fragments are converted once and multiplied with both tiles (4
// wgmmas each), so the conversion and the bookkeeping are paid once per 128 tokens. Each
// tile's sums, promotions and epilogue are the one-tile kernel's (the same four k32
// wgmmas from zero, the same fmaf order, gemm1_epilogue), so the outputs are bitwise the
// same. Ring: two slots of one chunk (the weights, both tiles' rows and scales); 128
// registers, 4 CTAs per SM as the one-tile kernel. Measured 1.01-1.10x the op at
// M >= 8192, 0.92-1.0x at M = 2048 where most pairs are half empty (H100; same note).
struct PairSmem {
  static constexpr int kB = 64 * kChunk;  // one tile's chunk of FP8 rows
  static constexpr int kSx = 64 * 4;
  // per slot: rows of tile 0, of tile 1 (1024-aligned for the swizzled B reads), codes, scale words, scales 0, 1
  static constexpr int kOffB1 = kB, kOffW = 2 * kB, kOffS = kOffW + kCodeTile, kOffX0 = kOffS + kScaleTile,
                       kOffX1 = kOffX0 + kSx;
  static constexpr int kSlotBytes = ((kOffX1 + kSx + 1023) / 1024) * 1024;
  static constexpr int kSlots = 2;
  static constexpr int kBytes = kSlots * kSlotBytes + 1024;
  static_assert(64 * 128 <= kSlotBytes, "the epilogue's staging fits a slot");
};

// GEMM2's wait for h (gemm2_wait_h) for both tiles of a pair: the same two threads (they
// issue the token copies, pair_segment's issuers 2 and 3), the same acquire and fence.
__device__ __forceinline__ void gemm2_wait_h_pair(const W4A8Params& p, int t0, bool two) {
  if (threadIdx.x == 64 || threadIdx.x == 96) {
    wait_flag_geq(p.group_ready + t0, p.G2);
    if (two) wait_flag_geq(p.group_ready + t0 + 1, p.G2);
    fence_proxy_async_global();
  }
  __syncthreads();
}

// One weight tile rt over the pair of token tiles t0, t0 + 1 (kTwo; else t0 alone), for
// GEMM1 (kGemm1: w13, xg / xgs at K / 128 chunks, then gemm1_epilogue per tile) or GEMM2
// (w2, hq / hs at G2 chunks, then each tile's y by gemm2_store_y, staged in a ring slot of
// its own: 8 KB of a slot's 21 KB, so the second tile's staging writes need no barrier after
// the first tile's reads). GEMM2's wait_h: the CTA's first tile, whose token copies wait for
// both tiles' h (the weight copies of its first chunk go before the wait).
template <bool kGemm1, bool kTwo>
__device__ __forceinline__ void pair_segment(const W4A8Params& p, uint8_t* smem, uint64_t* full, const uint8_t* lut,
                                             int& ring, uint32_t& phase, int t0, int rt, int tid,
                                             bool wait_h = false) {
  using S = PairSmem;
  const int e = __ldcg(p.tile_expert + t0);  // L2: read before any grid wait (as gemm_segment)
  const int KT = kGemm1 ? p.K / kChunk : p.G2;
  const int RT = kGemm1 ? p.N / 32 : p.K / kTileRows;
  const size_t tile_index = (size_t(e) * RT + rt) * KT;
  const uint8_t* wq = (kGemm1 ? p.w13 : p.w2) + tile_index * kCodeTile;
  const uint8_t* wsc = (kGemm1 ? p.w13_scale : p.w2_scale) + tile_index * kScaleTile;
  const uint8_t* bq0 = (kGemm1 ? p.xg : p.hq) + size_t(t0) * KT * S::kB;  // tile t0 + 1 follows: KT chunks later
  const float* bs0 = (kGemm1 ? p.xgs : p.hs) + size_t(t0) * KT * 64;
  const int warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const int issuer = lane == 0 ? warp : -1;  // warp 0: codes (+ expected bytes), 1: scale words, 2: tile 0, 3: tile 1
  constexpr uint32_t kTx = kCodeTile + kScaleTile + (kTwo ? 2 : 1) * (S::kB + S::kSx);
  auto load = [&](int c, int slot) {
    if (c >= KT || issuer < 0) return;
    const uint32_t base = smem_u32(smem) + slot * S::kSlotBytes;
    uint64_t* bar = full + slot;
    if (issuer == 0) {
      mbar_arrive_expect_tx(bar, kTx);
      bulk_g2s(base + S::kOffW, wq + size_t(c) * kCodeTile, kCodeTile, bar);
    } else if (issuer == 1) {
      bulk_g2s(base + S::kOffS, wsc + size_t(c) * kScaleTile, kScaleTile, bar);
    } else if (issuer == 2 || kTwo) {
      const int j = issuer - 2;  // the tile
      bulk_g2s(base + j * S::kOffB1, bq0 + (size_t(j) * KT + c) * S::kB, S::kB, bar);
      bulk_g2s(base + S::kOffX0 + j * S::kSx, bs0 + (size_t(j) * KT + c) * 64, S::kSx, bar);
    }
  };
  auto slot_after = [](int slot) { return slot + 1 == S::kSlots ? 0 : slot + 1; };
  if (!kGemm1 && wait_h) {  // a thread's load issues only its own copies: issuers 0, 1 the weights, 2, 3 the token rows
    if (issuer < 2) load(0, ring);
    gemm2_wait_h_pair(p, t0, kTwo);
    if (issuer >= 2) load(0, ring);
  } else {
    load(0, ring);
  }

  float acc0[32], acc1[32], part[32];
#pragma unroll
  for (int i = 0; i < 32; ++i) acc0[i] = acc1[i] = part[i] = 0.0f;
  const uint32_t rd_w = smem_u32(smem) + S::kOffW + tid * 16;
  const uint32_t rd_s = smem_u32(smem) + S::kOffS + (warp * 8 + g) * 8;
  const uint64_t desc0 = wgmma_desc_sw128(smem_u32(smem), 16, 1024);
  const uint32_t lut_base = smem_u32(lut);
  const uint32_t rot = (4 * t - 3) & 31;

#pragma unroll 1
  for (int c = 0; c < KT; ++c) {
    __syncthreads();  // everyone is done with the slot refilled next (read in chunk c - 1)
    load(c + 1, slot_after(ring));
    mbar_wait(full + ring, phase);
    const uint32_t so = ring * S::kSlotBytes;
    uint32_t a[4][4];
    const uint2 sw = chunk_fragments(a, rd_w + so, rd_s + so, lut_base, rot);
    const uint64_t d0 = desc0 + (so >> 4);
    const uint8_t* sx0 = smem + so + S::kOffX0;
    // One set of chunk sums for both tiles: tile 1's wgmmas after tile 0's promotion. Two
    // sets (tile 1's wgmmas during tile 0's promotion) took 168 registers and 3 CTAs per
    // SM and measured no faster than the one-tile kernel (docs/perf-history/2026-12-05-mxfp4-w4a8-pairs.md):
    // the warps resident hide each warp's chain per chunk, so 4 CTAs per SM matter more.
    chunk_wgmmas<64>(part, a, d0);
    chunk_promote<64>(acc0, part, sw, sx0, t);
    if constexpr (kTwo) {
      chunk_wgmmas<64>(part, a, d0 + (S::kOffB1 >> 4));
      chunk_promote<64>(acc1, part, sw, sx0 + S::kSx, t);
    }
    ring_advance<S::kSlots>(ring, phase);
  }
  __syncthreads();  // every chunk's reads done: the staging overwrites the ring
  if constexpr (kGemm1) {
    gemm1_epilogue<64>(p, acc0, reinterpret_cast<float*>(smem), t0, rt, tid);
    if constexpr (kTwo) gemm1_epilogue<64>(p, acc1, reinterpret_cast<float*>(smem), t0 + 1, rt, tid);
  } else {
    gemm2_store_y<64>(p, acc0, reinterpret_cast<__nv_bfloat16*>(smem), t0, rt, tid);
    if constexpr (kTwo)
      gemm2_store_y<64>(p, acc1, reinterpret_cast<__nv_bfloat16*>(smem + S::kSlotBytes), t0 + 1, rt, tid);
  }
}

// Grid: x = 64-row weight tile, y = pairs of token tiles (config.h's grid_pairs), a CTA
// taking the pairs blockIdx.y, + gridDim.y, ... below *num_tiles / 2 in turn.
__global__ void __launch_bounds__(kThreads, 4) mxfp4_gemm1_pair_kernel(const W4A8Params p) {
  gemm_grid_dependencies<true>();
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = align_smem_1024(smem_raw);
  __shared__ uint64_t full[PairSmem::kSlots];
  __shared__ __align__(16) uint8_t lut[kLutBytes];
  const int num_pairs = __ldcg(p.num_tiles) / 2;
  if (int(blockIdx.y) >= num_pairs) return;
  // the working CTAs (blockIdx.y < num_pairs) share the zero rows
  if (p.late_zero)
    zero_remote_rows(p, blockIdx.y * gridDim.x + blockIdx.x, int(gridDim.x) * min(int(gridDim.y), num_pairs),
                     threadIdx.x);
  init_cta(full, lut);
  int ring = 0;
  uint32_t phase = 0;
#pragma unroll 1
  for (int pr = blockIdx.y; pr < num_pairs; pr += gridDim.y) {
    const int t0 = 2 * pr;
    if (!tile_empty<64>(p, t0 + 1))
      pair_segment<true, true>(p, smem, full, lut, ring, phase, t0, blockIdx.x, threadIdx.x);
    else
      pair_segment<true, false>(p, smem, full, lut, ring, phase, t0, blockIdx.x, threadIdx.x);
    if (pr + int(gridDim.y) < num_pairs) {  // the epilogue's staging is the next pair's ring
      fence_proxy_async_smem();
      __syncthreads();
    }
  }
}

// GEMM2 on a classic grid whose CTA covers R consecutive 64-row weight tiles of one token
// tile (x = group of R row tiles, y = token tile), at 64-token tiles (R by config.h's
// pick_gemm2_rows: 8 at few K chunks, e.g. V4.1-Flash at tensor parallel 8 with G2 = 3;
// 4 at the expert-parallel shapes). A classic CTA pays ~8 us of fixed cost (its launch, the
// shift tables, the wait for h, the ring fill, the fence, the count and the combine's
// dependent loads) against ~1 us per chunk
// (docs/perf-history/2026-12-04-mxfp4-w4a8-gemm2-rows.md), so at 3 chunks most of GEMM2
// was fixed cost. Here the tables, the wait for h, the fence, the count and the combine
// are paid once per R tiles; the ring runs on across the tiles (the token rows come in
// again per tile, from L2), and the tiles' y are combined together. Each tile's sums and
// y are the classic kernel's, so the outputs are bitwise the same for every R.
template <int BN, int CHUNKS, int R>
__global__ void __launch_bounds__(kThreads) mxfp4_gemm2_rows_kernel(const W4A8Params p) {
  gemm_grid_dependencies<false>();
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = align_smem_1024(smem_raw);
  __shared__ uint64_t full[Smem<BN, CHUNKS>::kSlots];
  __shared__ __align__(16) uint8_t lut[kLutBytes];
  const int tile = blockIdx.y;
  if (tile >= __ldcg(p.num_tiles) || tile_empty<BN>(p, tile)) return;
  init_cta(full, lut);
  int ring = 0;
  uint32_t phase = 0;
  const int rt0 = blockIdx.x * R;
#pragma unroll 1
  for (int r = 0; r < R; ++r) {
    gemm_segment<BN, CHUNKS, false, false>(p, smem, full, lut, ring, phase, tile, rt0 + r, 0, p.G2, 0, 1, 0,
                                           threadIdx.x, [&] {
                                             if (r == 0) gemm2_wait_h(p, tile);
                                           });
    if (r + 1 < R) {  // the y staging smem is the next tile's ring, refilled by bulk copies
      fence_proxy_async_smem();
      __syncthreads();
    }
  }
  gemm2_combine<BN, R>(p, tile, rt0, threadIdx.x);
}

// ------------------------------------------------------ GEMM2 on pairs of tiles ---

// GEMM2 at 64-token tiles on pairs of an expert's token tiles (routing with tile_pairs, as
// GEMM1's pair kernel: the second tile of an odd count empty), R consecutive 64-row weight
// tiles per CTA (x = group of R row tiles, y = pair). Why (docs/perf-history/
// 2026-12-07-mxfp4-w4a8-gemm2-rate-study.md): the rows kernel converts each weight chunk
// for one 64-token tile, so a warp's chain per chunk (barrier, slot wait, conversion, four
// wgmmas, their wait, promotion) carries 64 tokens of MMA; here, as in GEMM1's pair kernel,
// it carries 128. An earlier GEMM2 pair kernel ran R = 4 (2x the rows kernel's work per CTA,
// half its CTAs: 3.6 waves at V4-Pro M = 8192) and measured 0.94-1.06x the rows kernel
// (docs/perf-history/2026-12-05-mxfp4-w4a8-pairs.md); config.h runs this one at R = half the
// rows kernel's, so that a CTA does the rows kernel's work (R x 2 tiles x G2 chunks) and the
// grid has as many CTAs. Ring: PairSmem, two slots of one chunk; 4 CTAs per SM. The combine
// is gemm2_combine per tile (one count per token and group of R row tiles), so the outputs
// are bitwise those of the rows kernel at any R.
template <int R>
__global__ void __launch_bounds__(kThreads, 4) mxfp4_gemm2_pair_kernel(const W4A8Params p) {
  gemm_grid_dependencies<false>();
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = align_smem_1024(smem_raw);
  __shared__ uint64_t full[PairSmem::kSlots];
  __shared__ __align__(16) uint8_t lut[kLutBytes];
  const int t0 = 2 * int(blockIdx.y);  // the first tile of a pair always holds a slot (tile_pairs)
  if (t0 >= __ldcg(p.num_tiles)) return;
  const bool two = !tile_empty<64>(p, t0 + 1);
  init_cta(full, lut);
  int ring = 0;
  uint32_t phase = 0;
  const int rt0 = blockIdx.x * R;
#pragma unroll 1
  for (int r = 0; r < R; ++r) {
    if (two)
      pair_segment<false, true>(p, smem, full, lut, ring, phase, t0, rt0 + r, threadIdx.x, r == 0);
    else
      pair_segment<false, false>(p, smem, full, lut, ring, phase, t0, rt0 + r, threadIdx.x, r == 0);
    if (r + 1 < R) {  // the y staging smem is the next tile's ring, refilled by bulk copies
      fence_proxy_async_smem();
      __syncthreads();
    }
  }
#pragma unroll 1
  for (int j = 0; j < (two ? 2 : 1); ++j) gemm2_combine<64, R>(p, t0 + j, rt0, threadIdx.x);
}

// Shared memory of mxfp4_gemm2_resident_kernel for G2 K chunks: the token tile's G2 chunks
// of FP8 rows and their scales (resident), then two weight slots of G2 chunks (codes, then
// scale words), each also the y staging of the tile it held (8 KB for 64 tokens: G2 >= 2).
template <int BN>
struct ResidentSmem {
  static constexpr int kB = BN * kChunk, kSx = BN * 4;
  static constexpr int kMaxG2 = 4;
  __host__ __device__ static constexpr int tokens(int G2) { return G2 * (kB + kSx); }
  __host__ __device__ static constexpr int slot(int G2) { return G2 * (kCodeTile + kScaleTile); }
  __host__ __device__ static constexpr int bytes(int G2) { return tokens(G2) + 2 * slot(G2) + 1024; }
  static_assert(BN * 128 <= 2 * (kCodeTile + kScaleTile), "the y staging fits a slot of two chunks");
};

// GEMM2 of few K chunks (2 <= G2 <= 4: the tensor-parallel shapes, e.g. V4.1-Flash at TP8,
// G2 = 3) with R weight tiles per CTA as mxfp4_gemm2_rows_kernel, but the token tile comes
// in once and stays, and the weights of tile r + 1 (one slot ahead) arrive while tile r is
// multiplied and its y stored: the rows kernel fetches the token rows again per tile and
// starts a tile's copies only after the previous tile's y stores (the staging is its ring).
// Each tile's chunk sums, promotions and y are the classic kernel's (chunk_mma, same chunk
// order), and the combine is gemm2_combine, so the outputs are bitwise those of R = 1.
template <int BN, int R>
__global__ void __launch_bounds__(kThreads) mxfp4_gemm2_resident_kernel(const W4A8Params p) {
  using S = ResidentSmem<BN>;
  gemm_grid_dependencies<false>();
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = align_smem_1024(smem_raw);
  __shared__ uint64_t bar[3];  // 0: the token tile, 1 + s: weight slot s
  __shared__ __align__(16) uint8_t lut[kLutBytes];
  const int tile = blockIdx.y;
  if (tile >= __ldcg(p.num_tiles) || tile_empty<BN>(p, tile)) return;
  init_cta(bar, lut);
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const int G2 = p.G2, RT = p.K / kTileRows, rt0 = blockIdx.x * R;
  const int e = __ldcg(p.tile_expert + tile);
  uint8_t* sB = smem;
  uint8_t* sX = sB + G2 * S::kB;
  // slot s at slot0 + s * slot(G2) (arithmetic, not an array: a runtime index into a local
  // array puts it on the stack)
  uint8_t* const slot0 = smem + S::tokens(G2);
  const int slot_bytes = S::slot(G2);

  // Weights of tile r into slot s: codes by lane 0 of warp 0 (with the expected bytes),
  // scale words by lane 0 of warp 1.
  auto load_w = [&](int r, int s) {
    if (r >= R || lane != 0 || warp > 1) return;
    const size_t first = (size_t(e) * RT + rt0 + r) * G2;
    uint8_t* d = slot0 + s * slot_bytes;
    if (warp == 0) {
      mbar_arrive_expect_tx(bar + 1 + s, G2 * (kCodeTile + kScaleTile));
      bulk_g2s(smem_u32(d), p.w2 + first * kCodeTile, G2 * kCodeTile, bar + 1 + s);
    } else {
      bulk_g2s(smem_u32(d + G2 * kCodeTile), p.w2_scale + first * kScaleTile, G2 * kScaleTile, bar + 1 + s);
    }
  };
  load_w(0, 0);
  load_w(1, 1);
  gemm2_wait_h(p, tile);  // threads 64 and 96, which copy the token tile
  if (tid == 64) {
    mbar_arrive_expect_tx(bar, S::tokens(G2));
    bulk_g2s(smem_u32(sB), p.hq + size_t(tile) * G2 * S::kB, G2 * S::kB, bar);
  } else if (tid == 96) {
    bulk_g2s(smem_u32(sX), p.hs + size_t(tile) * G2 * BN, G2 * S::kSx, bar);
  }

  const uint64_t desc0 = wgmma_desc_sw128(smem_u32(sB), 16, 1024);
  const uint32_t lut_base = smem_u32(lut);
  const uint32_t rot = (4 * t - 3) & 31;
  float part[BN / 2];
#pragma unroll
  for (int i = 0; i < BN / 2; ++i) part[i] = 0.0f;
  mbar_wait(bar, 0);
#pragma unroll 1
  for (int r = 0; r < R; ++r) {
    const int s = r & 1;
    uint8_t* const slot = slot0 + s * slot_bytes;
    const uint32_t w_rd = smem_u32(slot) + tid * 16;
    const uint32_t s_rd = smem_u32(slot + G2 * kCodeTile) + (warp * 8 + g) * 8;
    mbar_wait(bar + 1 + s, (r >> 1) & 1);
    float acc[BN / 2];
#pragma unroll
    for (int i = 0; i < BN / 2; ++i) acc[i] = 0.0f;
#pragma unroll 1
    for (int c = 0; c < G2; ++c)
      chunk_mma<BN>(acc, part, w_rd + c * kCodeTile, s_rd + c * kScaleTile, lut_base, rot,
                    desc0 + uint32_t(c * (S::kB >> 4)), sX + c * S::kSx, t);
    __syncthreads();  // every warp is done with the slot's weights: it becomes the y staging
    gemm2_store_y<BN>(p, acc, reinterpret_cast<__nv_bfloat16*>(slot), tile, rt0 + r, tid);
    if (r + 2 < R) {  // the staging read back, in the generic proxy, before the copies refill the slot
      fence_proxy_async_smem();
      __syncthreads();
      load_w(r + 2, s);
    }
  }
  gemm2_combine<BN, R>(p, tile, rt0, tid);
}

// Split-K on a persistent grid (as nvfp4_gemm.cuh's moe_gemm_splitk_kernel): items
// (tile, weight-row tile) cut into `splits` equal K chunks, splits chosen on device so
// that items * splits fills the grid at most once (at most KT / kSplitMinChunks).
template <int BN, int CHUNKS, bool kGemm1>
__global__ void __launch_bounds__(kThreads, 4) mxfp4_gemm_splitk_kernel(const W4A8Params p) {
  gemm_grid_dependencies<kGemm1>();
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = align_smem_1024(smem_raw);
  const int num_tiles = __ldcg(p.num_tiles);
  const int KT = kGemm1 ? p.K / kChunk : p.G2;
  const int RT = kGemm1 ? p.N / 32 : p.K / kTileRows;
  const int items = num_tiles * RT;
  const int P = gridDim.x;
  const int splits = items >= P || items == 0 ? 1 : max(1, min(P / items, KT / kSplitMinChunks));
  const int units = items * splits;
  if (units == 0) return;
  __shared__ uint64_t full[Smem<BN, CHUNKS>::kSlots];
  __shared__ __align__(16) uint8_t lut[kLutBytes];
  init_cta(full, lut);
  int ring = 0;
  uint32_t phase = 0;
#pragma unroll 1
  for (int u = blockIdx.x; u < units; u += P) {
    const int tid = threadIdx.x;
    const int item = u / splits;
    const int chunk = u - item * splits;
    const int tile = item / RT;
    gemm_segment<BN, CHUNKS, kGemm1>(p, smem, full, lut, ring, phase, tile, item - tile * RT, KT * chunk / splits,
                                     KT * (chunk + 1) / splits, item, splits, chunk, tid, [&] {
                                       if constexpr (!kGemm1) gemm2_wait_h(p, tile);
                                     });
    if (u + P < units) {  // the epilogue's staging smem is the next prologue's ring, refilled by bulk copies
      fence_proxy_async_smem();
      __syncthreads();
    }
  }
}

}  // namespace w4a8
}  // namespace moe
}  // namespace dsv4
