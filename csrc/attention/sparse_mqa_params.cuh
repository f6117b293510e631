// Parameters of the sparse MQA attention family (torch-free).
//
// One query token t = b * s_q + i sees up to two index lists (main + extra), each a
// list of slot ids into its own KV source. Per list, entry e of token t is used iff
// e < length[b] (or e < topk without lengths) and 0 <= slot < num_slots.
#pragma once

#include <cstdint>

#include "common/fast_divmod.cuh"

namespace dsv4 {
namespace attention {

constexpr int kHeadDim = 512;     // K = V = 512 (448 no-rope + 64 rope)
constexpr int kHeadsPerCta = 64;  // heads packed into the wgmma M dimension
constexpr int kTileKeys = 64;     // keys per pipeline stage
constexpr int kMaxSplits = 64;
// Batch-invariant decode: every split covers this many pairs of 64-key tiles (512 keys),
// so a token's split boundaries depend on key positions only, never on the batch.
constexpr int kInvariantPairsPerSplit = 4;

// One KV source: a paged cache (fp8_ds_mla or bf16) plus its per-token index list.
struct SparseMqaSource {
  const uint8_t* base;      // byte address of block 0
  int64_t block_stride;     // bytes between blocks
  int64_t num_slots;        // num_blocks * block_size; slots outside [0, num_slots) are skipped
  int block_size;           // tokens per block
  FastDivmod block_div;     // slot -> (block, offset in block)
  int topk;                 // entries per token in `indices`
  const int32_t* indices;   // [B, s_q, topk] (unit stride along topk)
  int64_t idx_stride_b;     // elements
  int64_t idx_stride_q;     // elements
  const int32_t* lengths;   // [B] or nullptr (= topk)
};

struct SparseMqaParams {
  const uint16_t* q;        // bf16 [B, s_q, H, 512], unit stride along d
  int64_t q_stride_b, q_stride_q, q_stride_h;  // elements
  SparseMqaSource src[2];
  int num_src;              // 1 or 2
  const float* sink;        // [H] or nullptr
  float scale_log2;         // softmax_scale * log2(e)
  uint16_t* out;            // bf16 [B, s_q, H, 512], unit stride along d
  int64_t out_stride_b, out_stride_q, out_stride_h;  // elements
  float* lse;               // fp32 [B * s_q, H] contiguous
  float* part_o;            // fp32 [num_splits, B * s_q, H, 512] (num_splits > 1 only)
  float* part_lse;          // fp32 [num_splits, B * s_q, H]       (num_splits > 1 only)
  int batch, s_q, num_heads, num_splits;
  int pairs_per_split;      // > 0: batch-invariant splits of this many tile pairs; 0: num_splits equal parts
  FastDivmod splits_div;    // by num_splits  (set by the launcher with num_splits: the work-item
  FastDivmod sq_div;        // by s_q          decode runs before a CTA's first load, divisions cost)
  // Development switches read by the kernel as uniform values (no extra kernel instances;
  // csrc/common/env.h, README "Environment variables"):
  bool coop_prefetch;     // the cooperative round also sends round 1's rows into L2 (DSV4_ATTN_COOP_PREFETCH)
  bool first_pv_init;       // O set by each item's first PV (scale-d = 0), not cleared (DSV4_ATTN_FIRST_PV_INIT)
  bool row_prefetch;        // bf16 rows: the next round's rows sent to L2 a round ahead (DSV4_ATTN_ROW_PREFETCH)
  bool tile_splits;         // the ring's default-mode splits at whole tiles (DSV4_ATTN_TILE_SPLITS; token_tiles)
};

}  // namespace attention
}  // namespace dsv4
