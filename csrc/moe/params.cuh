// The parameter structs of the MoE family (kernel family C of docs/design.md) and the
// prepared NVFP4 weight layout:
//   MoeParams: dsv4::nvfp4_moe (nvfp4_moe.cu): routing, gather, the grouped GEMMs
//     (nvfp4_gemm.cuh, nvfp4_gemm_ws.cuh) and combine. Its routing and combine fields
//     also serve dsv4::mxfp4_moe, whose routing and combine are the same kernels
//     (routing.cuh, launched through routing.h).
//   w4a8::W4A8Params: the MXFP4 W4A8 kernels of dsv4::mxfp4_moe (mxfp4_gemm.cuh) and
//     the constants of their prepared weight tiles.
// Host and device code include it (config.h reads the tile constants).
//
// Prepared weight layout (dsv4.formats.nvfp4_moe_layout writes it, through
// dsv4.prepare_nvfp4_moe_weights):
//   A projection with R output rows and reduction length Kd is cut into 64 x 64
//   tiles, stored [E, R/64, Kd/64, 2048] bytes of e2m1 codes and [E, R/64, Kd/64, 256]
//   e4m3 block scales. Inside a code tile, thread T = 32*w + 4*g + t of the consumer
//   warpgroup owns bytes [16T, 16T+16): four little-endian words, word j = k16 step j,
//   holding exactly the 8 elements of its A fragment (the same for wgmma and for the
//   warp-level mma.sync m16n8k16 of the decode tiles: rows 16w+g and 16w+g+8,
//   columns 2t, 2t+1, 2t+8, 2t+9 of that k16 step). Fragment register p (p = 0..3:
//   (row g, col 2t), (row g+8, col 2t), (row g, col 2t+8), (row g+8, col 2t+8)) holds an
//   (even, odd) element pair whose 8 code bits sit where dequant_kstep
//   (dequant.cuh) expands them with 1-3 integer instructions.
//   Inside a scale tile, thread (w, g) reads 8 bytes at 8*(8w+g): byte 2j = scale of
//   row 16w+g, byte 2j+1 = scale of row 16w+g+8, for k16 step j.
//   w13 rows are interleaved so that one warp holds gate and up of the same
//   intermediate column: tile row 16w + r is gate row 32*rt + 8w + r for r < 8 and up
//   row 32*rt + 8w + r - 8 otherwise (rt = the 64-row tile index).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <stdint.h>

#include <type_traits>  // std::integral_constant (with_tile_width)

namespace dsv4 {
namespace moe {

constexpr int kTileRows = 64;     // weight rows per tile (one wgmma M; four mma.sync m16)
constexpr int kTileK = 64;        // reduction elements per pipeline stage
constexpr int kCodeTileBytes = kTileRows * kTileK / 2;   // 2048
constexpr int kScaleTileBytes = kTileRows * kTileK / 16; // 256
constexpr int kThreads = 128;     // one warpgroup: the CTA of the nvfp4_gemm.cuh kernels

// Largest prefill group (moe_route_kernel's group_tile list): 6 halves of 32 token rows,
// the widest unit the prefill kernel's consumers hold accumulators for (n192).
constexpr int kGroupHalves = 6;

// mxfp4_route_quant_kernel (mxfp4_gemm.cuh) at decode sizes, chosen by config.h: the slots
// it routes in shared memory, and the padded rows it tracks there.
constexpr int kFusedRouteSlots = 128;
constexpr int kFusedRouteRows = 2048;

struct MoeParams {
  // shapes
  int M;         // tokens
  int topk;      // slots per token
  int E;         // local experts
  int E_global;  // size of expert_map (== E without a map)
  int K;         // hidden size
  int N;         // intermediate size
  int block_n;   // token tile of the grouped GEMMs (rows per tile)
  int tile_pairs;  // 1: each expert's tile count rounded up to even (mxfp4_gemm1_pair_kernel), the extra tile empty
  int max_tiles; // grid bound on the number of token tiles
  int max_rows;  // max_tiles * block_n

  // inputs
  const __nv_bfloat16* x;      // [M, K]
  const int* topk_ids;         // [M, topk]
  const float* topk_weights;   // [M, topk]
  const int* expert_map;       // [E_global] or nullptr
  const uint8_t* w13;          // prepared codes [E, 2N/64, K/64, 2048]
  const uint8_t* w13_scale;    // prepared e4m3 bytes (uint8 tensor) [E, 2N/64, K/64, 256]
  const float* w13_scale_2;    // [E, 2] (gate, up)
  const uint8_t* w2;           // prepared codes [E, K/64, N/64, 2048]
  const uint8_t* w2_scale;     // prepared e4m3 [E, K/64, N/64, 256]
  const float* w2_scale_2;     // [E]
  const float* a13_scale;      // nvfp4 mode: [1] or [E]; else nullptr
  const float* a2_scale;       // nvfp4 mode: [1] or [E]; else nullptr
  int a13_per_expert;
  int a2_per_expert;
  int act_nvfp4;               // 0: bf16 activations, 1: NVFP4 activations
  int has_limit;
  float swiglu_limit;

  // workspace (sized from shapes only)
  int* slot_pos;     // [M*topk]  padded row of each (token, slot), -1 = not local
  int* row_slot;     // [max_rows] slot index of each padded row, -1 = padding
  int* tile_expert;  // [max_tiles]
  int* num_tiles;    // [1]
  int* error_flag;   // [1] set to 1 when an expert id was out of range (no host reads it:
                     // the wrappers check ids on the host when they may sync)
  int* route_counts; // [E] multi-CTA routing (prefill sizes): slots per expert, else nullptr
  int* route_tile_off; // [E + 1] multi-CTA routing: first tile of each expert
  __nv_bfloat16* xg; // [max_rows, K]  GEMM1 B operand (nvfp4 mode: code * block scale); unused with direct_x
  __nv_bfloat16* h;  // [max_rows, N]  GEMM2 B operand (nvfp4 mode: code * block scale)
  uint8_t* hq;       // nvfp4 mode: [max_rows, N/2] packed codes of the SwiGLU output
  __nv_fp8_e4m3* hs; // nvfp4 mode: [max_rows, N/16] block scales
  float* h_debug;    // optional [max_rows, N] fp32 SwiGLU output (debug op)
  // Split-K grouped GEMMs (splitk = 1; see moe_gemm_splitk_kernel): a persistent grid
  // of at most sk_ctas CTAs; an item split in chunks is finished by the CTA whose chunk
  // arrives last.
  int splitk;
  int direct_x;      // GEMM1 reads x through row_slot (bf16 mode, where config.h pick_direct_x has it); no xg
  int sk_ctas;       // >= either GEMM's grid; bounds the number of split items and chunks
  float* sk_partial; // [2, sk_ctas, 64 * block_n] fp32 (GEMM1, GEMM2), one per (item, chunk) of a split item
  int* sk_count;     // [2, sk_ctas] (GEMM1, GEMM2): chunks done per item; zeroed by routing
  // Prefill (ws = 1, nvfp4_gemm_ws.cuh): xg and h are stored tiled (act_offset) so
  // that each 64-row x 64-column block is one contiguous, pre-swizzled 8 KB bulk copy;
  // the GEMMs walk groups of 32 to 192 token rows of one expert.
  int ws;
  int* group_tile;   // [max_tiles] group -> first tile * 8 + (32-row halves in the group - 1)
  int* num_groups;   // [1]
  int* group_ready;  // [max_tiles] GEMM1 weight-row tiles whose h is written, per group (ws)
                     // or per token tile (nvfp4_gemm.cuh); GEMM2 starts on one as soon as
                     // it is complete. Zeroed by the routing kernel.
  __nv_bfloat16* y;  // [max_rows, K]  GEMM2 output per padded row
  __nv_bfloat16* out;// [M, K]
};

// The routing's rules for one slot (routing.cuh resolve_experts, mxfp4_gemm.cuh
// mxfp4_route_quant_kernel): an expert id is valid in [0, expert_id_bound); a map entry
// is a local expert in [0, E) or -1 (not on this rank). Anything else marks the call bad
// and the slot not local.
__device__ __forceinline__ int expert_id_bound(const MoeParams& p) {
  return p.expert_map != nullptr ? p.E_global : p.E;  // ids index the map, else the local experts
}
__device__ __forceinline__ bool map_entry_bad(const MoeParams& p, int ev) { return ev < -1 || ev >= p.E; }

// 64-wide K steps and 64-row weight tiles of GEMM1 (w13: 2N rows over K) or GEMM2
// (w2: K rows over N).
template <bool kGemm1>
__device__ __forceinline__ int gemm_k_steps(const MoeParams& p) {
  return (kGemm1 ? p.K : p.N) / kTileK;
}
template <bool kGemm1>
__device__ __forceinline__ int gemm_row_tiles(const MoeParams& p) {
  return kGemm1 ? 2 * p.N / kTileRows : p.K / kTileRows;
}

// Element offset of 16-byte chunk `chunk` (8 bf16) of padded row `row` in an activation
// buffer (xg or h) with `cols` columns: row-major, or tiled (ws = 1) as
// [row / 64][col / 64][row % 64][128 bytes, chunk c at c ^ (row % 8)], i.e. each
// 64 x 64 block is 8 KB in the 128-byte-swizzled K-major layout wgmma reads.
template <bool kTiled>
__host__ __device__ __forceinline__ size_t act_offset(int row, int chunk, int cols) {
  if constexpr (!kTiled) return size_t(row) * cols + size_t(chunk) * 8;
  return ((size_t(row >> 6) * (cols >> 6) + (chunk >> 3)) * 64 + (row & 63)) * 64 + (((chunk & 7) ^ (row & 7)) << 3);
}

#ifdef __CUDACC__
// The rows of a 64-row token tile that hold a slot (the routing fills an expert's tiles from
// their first row, so it is the count of rows with one; row_slot: -1 = padding). Each warp
// counts all 64 itself (two loads and ballots, through L2 as the GEMMs' other reads of the
// routing's tables), so every warp gets the same value and a branch on it keeps a
// warpgroup's wgmmas together.
__device__ __forceinline__ int tile_rows(const int* row_slot, int tile) {
  const int lane = threadIdx.x & 31;
  const int* rs = row_slot + tile * 64;
  const uint32_t lo = __ballot_sync(0xFFFFFFFFu, __ldcg(rs + lane) >= 0);
  const uint32_t hi = __ballot_sync(0xFFFFFFFFu, __ldcg(rs + 32 + lane) >= 0);
  return __popc(lo) + __popc(hi);
}

// The MMA width for a 64-row token tile of `rows` rows: an expert's partly filled last tile
// multiplies only its first kMin, 2 kMin, ... rows (the smallest that holds them, up to 64).
// A wgmma m64nN's accumulators are m64n64's first N / 2 per thread (n8 blocks in order) and
// the rows past N are padding, whose sums are zero either way, so a tile's outputs are the
// same bit for bit at every width; its tensor work and promotion shrink
// (docs/perf-history/2026-12-06-mxfp4-w4a8-narrow-tiles.md). f(std::integral_constant<int, N>{}).
template <int kMin, class F>
__device__ __forceinline__ void with_tile_width(int rows, F&& f) {
  static_assert(kMin == 16 || kMin == 32, "widths 16, 32, 64 or 32, 64");
  if (kMin == 16 && rows <= 16)
    f(std::integral_constant<int, kMin>{});
  else if (rows <= 32)
    f(std::integral_constant<int, 32>{});
  else
    f(std::integral_constant<int, 64>{});
}
#endif  // __CUDACC__

namespace w4a8 {

// The prepared W4A8 weight tiles (dsv4.formats.mxfp4_w4a8 writes them; the layout is
// documented there and in mxfp4_gemm.cuh): 64 weight rows x 128 of K per tile.
constexpr int kChunk = 128;                         // K per step: one FP8 activation group, 4 MXFP4 blocks
constexpr int kCodeTile = kTileRows * kChunk / 2;   // 4096 bytes of e2m1 codes
constexpr int kScaleTile = kTileRows * 4;           // 256 bytes: one scale word per row
// mxfp4_quant_x_kernel's CTAs of 256 per SM: its launch bounds and config.h's one-wave grid.
// 3 gives it 80 registers, so its two steps of x in flight are not spilled (at 4 CTAs and 64
// registers they were: docs/perf-history/2026-12-05-mxfp4-w4a8-quant-lean.md).
constexpr int kQuantXCtasPerSm = 3;

// The MXFP4 W4A8 GEMMs' parameters (mxfp4_gemm.cuh). The routing tables are the ones
// moe_route_kernel (routing.cuh) builds in MoeParams' workspace fields with the same
// block_n; group_ready and sk_count are zeroed by it, group_left and combine_left by
// mxfp4_quant_x_kernel.
struct W4A8Params {
  int M, topk, K, N;                // N: the padded intermediate size (multiple of 64)
  int G2;                           // ceil(N / 128): GEMM2's K chunks, h's FP8 groups
  int block_n;                      // token tile (8, 16 or 64)
  int max_tiles;
  int ue8m0, has_limit;
  float swiglu_limit;
  int sk_ctas;                      // split-K: bound on either GEMM's grid (0: classic grids)
  int late_zero;                    // 1: the zero rows of tokens without a local slot by GEMM1's pair kernel
                                    // (zero_remote_rows), not by mxfp4_quant_x_kernel (config.h late_zero)
  // routing (routing.cuh)
  const int* slot_pos;              // [M * topk] padded row of each slot, -1 = not local
  const int* row_slot;              // [max_tiles * block_n] slot of each padded row, -1 = padding
  const int* tile_expert;           // [max_tiles]
  const int* num_tiles;             // [1]
  const float* topk_weights;        // [M, topk]
  // inputs
  const __nv_bfloat16* x;           // [M, K]
  const uint8_t* w13;               // [E, 2N/64, K/128, 4096]
  const uint8_t* w13_scale;         // [E, 2N/64, K/128, 256]
  const uint8_t* w2;                // [E, K/64, G2, 4096]
  const uint8_t* w2_scale;          // [E, K/64, G2, 256]
  // workspace
  // GEMM inputs, tiled (mxfp4_gemm.cuh act_row): [tile][chunk][row][128] e4m3 in MMA order,
  // 128-byte swizzled; scales [tile][chunk][row]
  uint8_t* xg;                      // [max_tiles, K/128, block_n, 128] GEMM1's input, by mxfp4_quant_x_kernel
  float* xgs;                       // [max_tiles, K/128, block_n]
  float* hf;                        // [max_rows, N] fp32 SwiGLU output (GEMM1 -> its FP8 quantization)
  uint8_t* hq;                      // [max_tiles, G2, block_n, 128] GEMM2's input, by GEMM1's epilogue
  float* hs;                        // [max_tiles, G2, block_n]
  int* group_left;                  // [max_tiles, G2] GEMM1 row tiles of an h group still to write
  int* group_ready;                 // [max_tiles] h groups quantized (GEMM2 reads a tile at G2)
  int* combine_left;                // [M, K/64] local slots of a token whose GEMM2 row tile is still to come
  int* sk_count;                    // [2, sk_ctas] (GEMM1, GEMM2) split chunks done per item
  float* sk_partial;                // [2, sk_ctas, 64 * block_n] fp32 partials (GEMM1, GEMM2)
  __nv_bfloat16* y;                 // [max_rows, K] GEMM2 output per padded row (bf16, as the NVFP4 path)
  __nv_bfloat16* out;               // [M, K]
};

}  // namespace w4a8

}  // namespace moe
}  // namespace dsv4
