// C++ entries for dsv4::sparse_mqa_decode and dsv4::sparse_mqa_prefill: validate every
// argument, pick the split count from shapes only (CUDA-graph safe, sparse_mqa_splits.h),
// launch. Development switches (csrc/common/env.h, README "Environment variables"):
// DSV4_ATTN_PRICED_SPLITS, DSV4_ATTN_PDL, DSV4_ATTN_SPECIALIZE, DSV4_ATTN_MAIN_PDL,
// DSV4_ATTN_COOP_ROUND, DSV4_ATTN_PRODUCER_AHEAD, DSV4_ATTN_COOP_PREFETCH,
// DSV4_ATTN_FIRST_PV_INIT, DSV4_ATTN_CROSSOVER, DSV4_ATTN_ROW_PREFETCH, DSV4_ATTN_RING32,
// DSV4_ATTN_TILE_SPLITS.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <optional>
#include <string>
#include <tuple>

#include "attention/sparse_mqa.cuh"
#include "attention/sparse_mqa_ring32.cuh"
#include "attention/sparse_mqa_splits.h"
#include "common/checks.h"
#include "common/dynamic_smem.h"
#include "common/env.h"
#include "common/launch.h"

namespace dsv4 {
namespace {

using attention::SparseMqaParams;
using attention::SparseMqaSource;

constexpr int64_t kFp8ViewLastDim = 584;  // vLLM's uint8 view of a fp8_ds_mla block row

enum class CacheKind { kFp8, kBf16 };

// Validates a paged cache ([nb, bs, 584] uint8 / [nb, bs, 512] bf16, optionally with a unit
// dim before the last) and fills the source geometry.
CacheKind check_cache(const at::Tensor& c, const char* name, const at::Tensor& q, SparseMqaSource& s) {
  check_cuda(c, name);
  check_same_device(c, q, name, "q");
  TORCH_CHECK(c.dim() == 3 || (c.dim() == 4 && c.size(2) == 1), "dsv4: ", name,
              " must be [num_blocks, block_size, D] or [num_blocks, block_size, 1, D], got shape ", c.sizes());
  const int64_t last = c.size(-1);
  CacheKind kind;
  if (c.scalar_type() == at::kByte) {
    kind = CacheKind::kFp8;
    TORCH_CHECK(last == kFp8ViewLastDim, "dsv4: ", name, " is a uint8 (fp8_ds_mla) cache and must have last dim ",
                kFp8ViewLastDim, ", got shape ", c.sizes());
  } else if (c.scalar_type() == at::kBFloat16) {
    kind = CacheKind::kBf16;
    TORCH_CHECK(last == 512, "dsv4: ", name, " is a bf16 cache and must have last dim 512, got shape ", c.sizes());
  } else {
    TORCH_CHECK(false, "dsv4: ", name, " must be uint8 (fp8_ds_mla layout) or bfloat16 (bf16 layout), got dtype ",
                c.scalar_type());
  }
  const int64_t nb = c.size(0), bs = c.size(1);
  TORCH_CHECK(bs > 0, "dsv4: ", name, " must have block_size (dim 1) > 0, got shape ", c.sizes());
  TORCH_CHECK(c.stride(-1) == 1, "dsv4: ", name, " must have unit stride along its last dim, got strides ",
              c.strides());
  TORCH_CHECK(bs == 1 || c.stride(1) == last, "dsv4: ", name, " must have stride(1) == ", last,
              " (rows of one block packed), got strides ", c.strides());
  const int64_t elem = kind == CacheKind::kFp8 ? 1 : 2;
  const int64_t block_stride = (nb > 1 ? c.stride(0) : bs * last) * elem;
  TORCH_CHECK(nb <= 1 || c.stride(0) >= bs * last, "dsv4: ", name, " block stride (stride(0)) ", c.stride(0),
              " is smaller than block_size * ", last);
  // A one-block cache has no block stride to align (only block 0 is ever addressed):
  // e.g. [1, 69, 584] is a valid cache whose shape-derived "stride" is 40,296 bytes.
  TORCH_CHECK(nb <= 1 || block_stride % 16 == 0, "dsv4: ", name, " block stride must be a multiple of 16 bytes, got ",
              block_stride, " bytes");
  if (kind == CacheKind::kFp8) {
    TORCH_CHECK(nb <= 1 || block_stride >= bs * kFp8ViewLastDim, "dsv4: ", name,
                " (fp8_ds_mla) block stride must be >= block_size * 584 bytes");
  }
  if (c.numel() > 0) check_aligned(c, 16, name);
  TORCH_CHECK(nb * bs < (int64_t(1) << 31), "dsv4: ", name, " holds more than 2^31 slots");
  s.base = reinterpret_cast<const uint8_t*>(c.data_ptr());
  s.block_stride = block_stride;
  s.block_size = static_cast<int>(bs);
  s.block_div = FastDivmod(static_cast<uint32_t>(bs));
  s.num_slots = nb * bs;
  return kind;
}

// indices [B, s_q, topk] int32 (decode) or [T, topk] / [T, 1, topk] (prefill, B = T, s_q = 1).
void check_indices(const at::Tensor& idx, const char* name, const at::Tensor& q, int64_t B, int64_t s_q,
                   SparseMqaSource& s) {
  check_cuda(idx, name);
  check_same_device(idx, q, name, "q");
  check_dtype(idx, at::kInt, name);
  TORCH_CHECK(idx.dim() == 3 && idx.size(0) == B && idx.size(1) == s_q, "dsv4: ", name, " must be [", B, ", ", s_q,
              ", topk], got shape ", idx.sizes());
  const int64_t topk = idx.size(2);
  TORCH_CHECK(topk < (int64_t(1) << 30), "dsv4: ", name, " topk too large: ", topk);
  TORCH_CHECK(topk <= 1 || idx.stride(2) == 1, "dsv4: ", name, " must have unit stride along topk, got strides ",
              idx.strides());
  s.topk = static_cast<int>(topk);
  s.indices = idx.data_ptr<int32_t>();
  s.idx_stride_b = idx.stride(0);
  s.idx_stride_q = idx.stride(1);
  s.lengths = nullptr;
}

void check_lengths(const std::optional<at::Tensor>& len, const char* name, const at::Tensor& q, int64_t B,
                   SparseMqaSource& s) {
  if (!len.has_value()) return;
  const at::Tensor& l = *len;
  check_cuda(l, name);
  check_same_device(l, q, name, "q");
  check_dtype(l, at::kInt, name);
  TORCH_CHECK(l.dim() == 1 && l.size(0) == B, "dsv4: ", name, " must be [", B, "], got shape ", l.sizes());
  TORCH_CHECK(l.is_contiguous(), "dsv4: ", name, " must be contiguous, got strides ", l.strides());
  s.lengths = l.data_ptr<int32_t>();
}

// q / out [B, s_q, H, 512] bf16 (strided, unit stride along d, 16-byte aligned rows).
void check_qo(const at::Tensor& t, const char* name, const char* shape) {
  check_cuda(t, name);
  check_dtype(t, at::kBFloat16, name);
  check_dim(t, 4, name, shape);
  TORCH_CHECK(t.size(3) == 512, "dsv4: ", name, " head dim must be 512, got shape ", t.sizes());
  TORCH_CHECK(t.stride(3) == 1, "dsv4: ", name, " must have unit stride along the head dim, got strides ",
              t.strides());
  for (int d = 0; d < 3; ++d) {
    TORCH_CHECK(t.size(d) <= 1 || t.stride(d) % 8 == 0, "dsv4: ", name,
                " strides must be multiples of 8 elements (16 bytes), got strides ", t.strides());
  }
  if (t.numel() > 0) check_aligned(t, 16, name);
}

// The main kernel. With `pdl` it is launched with programmatic stream serialization: its
// CTAs may be scheduled while the kernel before it in the stream (or the CUDA graph) drains,
// and run their barrier setup and first work-item decode before griddepcontrol.wait; every
// read of q, the indices, the lengths, the caches and the sink, and every global write, comes
// after it (sparse_mqa.cuh). Without a programmatic predecessor (the first kernel of a graph,
// or after a copy) the attribute changes nothing; a predecessor that never signals
// (launch_dependents) lets it launch when its last CTA exits, and the wait still holds it
// until that grid has completed and its writes are visible.
// kPair (the crossover): clusters of two CTAs; `grid` is even.
template <bool kFp8, int kNumSrc, int kCoopWgs = 0, bool kPair = false>
void launch_main(const SparseMqaParams& p, int64_t grid, cudaStream_t stream, bool pdl) {
  constexpr auto kernel = attention::sparse_mqa_fwd_kernel<kFp8, kNumSrc, kCoopWgs, kPair>;
  ensure_max_dynamic_smem<kernel>(attention::kSmemBytes);
  launch_kernel(kernel, dim3(static_cast<unsigned>(grid)), dim3(attention::kThreads), attention::kSmemBytes, stream,
                pdl, p, kPair ? 2 : 1);
}

// The two-round ring of 32-key tiles (DSV4_ATTN_RING32, sparse_mqa_ring32.cuh): a kernel of
// its own, so that the instances above are untouched; fp8 caches, 128 heads.
template <int kNumSrc, int kLoadsAhead>
void launch_ring32(const SparseMqaParams& p, int64_t grid, cudaStream_t stream, bool pdl) {
  constexpr auto kernel = attention::sparse_mqa_fwd_ring32_kernel<kNumSrc, kLoadsAhead>;
  ensure_max_dynamic_smem<kernel>(attention::kSmemBytesRing32);
  launch_kernel(kernel, dim3(static_cast<unsigned>(grid)), dim3(attention::kThreads), attention::kSmemBytesRing32,
                stream, pdl, p);
}

// The crossover's resident CTAs: twice the two-CTA clusters the device holds at once with
// one CTA per SM (a GPC with an odd count of free SMs leaves one idle), asked of the runtime
// once per device. The persistent grid and the split rule's wave use it instead of the SM count.
template <int kNumSrc>
int pair_ctas(int sms) {
  static std::atomic<int> cached[kMaxDevices];
  const int dev = current_device();
  int n = cached[dev].load(std::memory_order_acquire);
  if (n > 0) return n;
  constexpr auto kernel = attention::sparse_mqa_fwd_kernel<true, kNumSrc, 0, true>;
  ensure_max_dynamic_smem<kernel>(attention::kSmemBytes);
  n = max_cluster_ctas(kernel, sms, attention::kThreads, attention::kSmemBytes, 2);
  TORCH_CHECK(n > 0, "dsv4: the device runs no two-CTA cluster of the sparse MQA kernel (DSV4_ATTN_CROSSOVER=1)");
  cached[dev].store(n, std::memory_order_release);
  return n;
}

// The combine, one CTA per (token, head). With `pdl` it is launched with programmatic
// stream serialization: its CTAs are scheduled once every main CTA has reached its last
// item's epilogue (pdl_launch_dependents), and wait for the main grid only before reading
// the partials (sparse_mqa_combine.cuh), so its launch and prologue overlap the main
// kernel's tail instead of following it. Captured into CUDA graphs as a programmatic edge.
void launch_combine(const SparseMqaParams& p, int64_t ctas, cudaStream_t stream, bool pdl) {
  launch_kernel(attention::sparse_mqa_combine_kernel, dim3(static_cast<unsigned>(ctas)), dim3(128), 0, stream, pdl, p);
}

// Shared body: q4/out4 are [B, s_q, H, 512]; idx are [B, s_q, topk].
at::Tensor run(const at::Tensor& q4, const at::Tensor& out4, SparseMqaParams& p, CacheKind kind,
               const std::optional<at::Tensor>& attn_sink, double softmax_scale, bool batch_invariant) {
  const int64_t B = q4.size(0), s_q = q4.size(1), H = q4.size(2);
  TORCH_CHECK(H == 64 || H == 128, "dsv4: q must have 64 or 128 heads (pad other head counts with sink = -inf), got ",
              H);
  TORCH_CHECK(out4.sizes() == q4.sizes(), "dsv4: out must have the shape of q ", q4.sizes(), ", got ", out4.sizes());
  check_same_device(out4, q4, "out", "q");
  TORCH_CHECK(std::isfinite(softmax_scale) && softmax_scale > 0, "dsv4: softmax_scale must be finite and > 0, got ",
              softmax_scale);
  p.sink = nullptr;
  if (attn_sink.has_value()) {
    const at::Tensor& s = *attn_sink;
    check_cuda(s, "attn_sink");
    check_same_device(s, q4, "attn_sink", "q");
    check_dtype(s, at::kFloat, "attn_sink");
    TORCH_CHECK(s.dim() == 1 && s.size(0) == H, "dsv4: attn_sink must be [", H, "] (one logit per head), got shape ",
                s.sizes());
    check_contiguous(s, "attn_sink");
    p.sink = s.data_ptr<float>();
  }
  const int64_t tokens = B * s_q;
  TORCH_CHECK(tokens * H / 64 < (int64_t(1) << 31) / attention::kMaxSplits, "dsv4: too many query tokens: ", tokens);

  const at::cuda::OptionalCUDAGuard guard(q4.device());
  at::Tensor lse = at::empty({B, s_q, H}, q4.options().dtype(at::kFloat));
  if (tokens == 0) return lse;

  p.q = reinterpret_cast<const uint16_t*>(q4.data_ptr());
  p.q_stride_b = q4.stride(0);
  p.q_stride_q = q4.stride(1);
  p.q_stride_h = q4.stride(2);
  p.out = reinterpret_cast<uint16_t*>(out4.data_ptr());
  p.out_stride_b = out4.stride(0);
  p.out_stride_q = out4.stride(1);
  p.out_stride_h = out4.stride(2);
  p.lse = lse.data_ptr<float>();
  p.scale_log2 = static_cast<float>(softmax_scale * 1.4426950408889634);
  p.batch = static_cast<int>(B);
  p.s_q = static_cast<int>(s_q);
  p.num_heads = static_cast<int>(H);
  int64_t max_tiles = 0;
  for (int k = 0; k < p.num_src; ++k) max_tiles += (p.src[k].topk + attention::kTileKeys - 1) / attention::kTileKeys;
  const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const int64_t base = tokens * (H / 64);
  // One-source calls (SWA layers, prefill) run the instance that reads one list: less code
  // on the cold path of a small batch. DSV4_ATTN_SPECIALIZE=0: the general instance for all.
  const bool one = p.num_src == 1 && env::switches().attn_specialize.value_or(true);
  // The crossover at 128 heads (fp8 caches): the two head blocks of a (token, split) in one
  // cluster, each producer gathering half the rows for both (sparse_mqa.cuh, kPair).
  // DSV4_ATTN_CROSSOVER=1; off by default: 1.05-1.20x slower than the unpaired kernel at
  // every V4-Pro case measured (docs/perf-history/2026-12-05-attention-crossover-plan.md).
  const bool pair = kind == CacheKind::kFp8 && H == 128 && env::switches().attn_crossover.value_or(false);
  // Resident CTAs: the persistent grid's bound and the split rule's wave.
  const int ctas = pair ? (one ? pair_ctas<1>(sms) : pair_ctas<2>(sms)) : sms;
  // Calls the ring of 32-key tiles may run (fp8 rows, 128 heads, unpaired; see below).
  const bool ring32_kind = kind == CacheKind::kFp8 && H == 128 && !pair;
  int ring32_planned = -1;  // set by plan_ring32 (DSV4_ATTN_TILE_SPLITS=1, default mode)
  // DSV4_ATTN_TILE_SPLITS=1: the ring's default-mode splits take whole tiles, and their count is
  // priced so (attention::plan_ring32); off by default until measured
  // (docs/perf-history/2026-12-08-attention-ring32-tile-splits.md).
  p.tile_splits = env::switches().attn_tile_splits.value_or(false);
  if (batch_invariant) {
    // Splits of a fixed number of key pairs each, and always the split path (partials +
    // the ordered combine, in which empty splits add nothing), so that a token's result
    // depends on its own lists only: not on the batch size, the other sequences, the
    // list widths or the GPU's SM count.
    const int64_t max_pairs = attention::tile_pairs(max_tiles);
    const int64_t splits = (max_pairs + attention::kInvariantPairsPerSplit - 1) / attention::kInvariantPairsPerSplit;
    TORCH_CHECK(splits <= attention::kMaxSplits, "dsv4: batch_invariant decode takes index lists of at most ",
                attention::kMaxSplits * attention::kInvariantPairsPerSplit * 2 * attention::kTileKeys,
                " entries in all (kv + extra), got ", max_tiles * attention::kTileKeys, " (rounded to 64-key tiles)");
    p.pairs_per_split = attention::kInvariantPairsPerSplit;
    p.num_splits = static_cast<int>(std::max<int64_t>(2, splits));
  } else {
    // The cost model's count (sparse_mqa_splits.h), or DSV4_ATTN_SPLITS's, clamped to the tile
    // pairs; under DSV4_ATTN_TILE_SPLITS=1, for a call the ring of 32-key tiles may run, with
    // the ring's kernel choice (attention::plan_ring32).
    p.pairs_per_split = 0;
    const bool priced = env::switches().attn_priced_splits.value_or(true);
    if (ring32_kind && p.tile_splits) {
      const attention::Ring32Plan plan = attention::plan_ring32(base, max_tiles, ctas, priced, env::switches().attn_splits,
                                                                env::switches().attn_ring32);
      p.num_splits = plan.splits;
      ring32_planned = plan.ring32;
    } else {
      p.num_splits = attention::choose_splits(base, max_tiles, ctas, priced, env::switches().attn_splits);
    }
  }
  p.splits_div = FastDivmod(static_cast<uint32_t>(p.num_splits));
  p.sq_div = FastDivmod(static_cast<uint32_t>(s_q));
  at::Tensor part_o, part_lse;
  p.part_o = nullptr;
  p.part_lse = nullptr;
  if (p.num_splits > 1) {
    part_o = at::empty({p.num_splits, tokens, H, 512}, q4.options().dtype(at::kFloat));
    part_lse = at::empty({p.num_splits, tokens, H}, q4.options().dtype(at::kFloat));
    p.part_o = part_o.data_ptr<float>();
    p.part_lse = part_lse.data_ptr<float>();
  }
  cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  // Persistent CTAs: one per SM (the kernel's smem allows one), each walking work items
  // (kPair: base is even, and so is ctas).
  const int64_t grid = std::min<int64_t>(base * p.num_splits, ctas);
  const bool pdl = env::switches().attn_main_pdl.value_or(true);
  // fp8 caches: round 0 of each CTA's first item gathered by all warpgroups at once
  // (sparse_mqa_first_round.cuh). DSV4_ATTN_COOP_ROUND=0: by the producer alone.
  const bool coop = env::switches().attn_coop_round.value_or(true);
  // Uniform run-time switches (no kernel instances of their own): round 1's rows into L2 during
  // the cooperative round; O set by each item's first PV instead of cleared in registers.
  p.coop_prefetch = env::switches().attn_coop_prefetch.value_or(true);
  p.first_pv_init = env::switches().attn_first_pv_init.value_or(true);
  // bf16 rows (prefill, bf16 caches): no L2 prefetch of the next round's rows by default; over a
  // workspace larger than L2 it made the DRAM re-read rows it had already fetched. The fp8
  // producer's prefetch stays: in decode it pays (both in
  // docs/perf-history/2026-12-06-attention-prefill-row-prefetch.md).
  p.row_prefetch = env::switches().attn_row_prefetch.value_or(false);
  // Items of two or more rounds (the longest split's pairs > 1): the cooperative round by the
  // consumers alone, the producer starting on round 1 at once (its cold path, index, scale and
  // row loads overlap round 0); one-round items (SWA, small splits) keep all three warpgroups
  // on round 0. DSV4_ATTN_PRODUCER_AHEAD=0: all three always.
  const int64_t all_pairs = attention::tile_pairs(max_tiles);
  const int64_t split_pairs = p.pairs_per_split > 0 ? std::min<int64_t>(p.pairs_per_split, all_pairs)
                                                    : (all_pairs + p.num_splits - 1) / p.num_splits;
  const bool ahead = split_pairs > 1 && env::switches().attn_producer_ahead.value_or(true);
  // fp8 rows at 128 heads (V4-Pro), not paired: the ring of 32-key tiles, two rounds deep
  // (sparse_mqa_ring32.cuh); every round, round 0 included, by the producer (the cooperative
  // first round and DSV4_ATTN_PRODUCER_AHEAD do not apply). DSV4_ATTN_RING32=1, or 2 for the
  // same kernel with the producer's loads one half-step ahead (kLoadsAhead, bitwise the same
  // results). Unset: attention::pick_ring32's rule (sparse_mqa_splits.h), value 2 where the
  // longest work item has at most 9 tiles of 64 keys, today's kernel otherwise (the look-back
  // of docs/perf-history/2026-12-07-attention-ring32.md); under DSV4_ATTN_TILE_SPLITS=1 in
  // default mode, with the split count plan_ring32 chose with it. 64-head calls keep the
  // kernel above.
  const int ring32 = !ring32_kind           ? 0
                     : ring32_planned >= 0 ? ring32_planned
                                           : attention::pick_ring32(max_tiles, p.num_splits, env::switches().attn_ring32);
  if (pair) {
    one ? launch_main<true, 1, 0, true>(p, grid, stream, pdl) : launch_main<true, 2, 0, true>(p, grid, stream, pdl);
  } else if (ring32 == 2) {  // the producer's loads one half-step ahead (same results as 1)
    one ? launch_ring32<1, 1>(p, grid, stream, pdl) : launch_ring32<2, 1>(p, grid, stream, pdl);
  } else if (ring32 == 1) {
    one ? launch_ring32<1, 0>(p, grid, stream, pdl) : launch_ring32<2, 0>(p, grid, stream, pdl);
  } else if (kind == CacheKind::kFp8 && coop && ahead) {
    one ? launch_main<true, 1, 2>(p, grid, stream, pdl) : launch_main<true, 2, 2>(p, grid, stream, pdl);
  } else if (kind == CacheKind::kFp8 && coop) {
    one ? launch_main<true, 1, 3>(p, grid, stream, pdl) : launch_main<true, 2, 3>(p, grid, stream, pdl);
  } else if (kind == CacheKind::kFp8) {
    one ? launch_main<true, 1>(p, grid, stream, pdl) : launch_main<true, 2>(p, grid, stream, pdl);
  } else {
    one ? launch_main<false, 1>(p, grid, stream, pdl) : launch_main<false, 2>(p, grid, stream, pdl);
  }
  if (p.num_splits > 1) launch_combine(p, tokens * H, stream, env::switches().attn_pdl.value_or(true));
  return lse;
}

at::Tensor sparse_mqa_decode(const at::Tensor& q, const at::Tensor& kv_cache, const at::Tensor& indices,
                             const std::optional<at::Tensor>& topk_length, const std::optional<at::Tensor>& attn_sink,
                             double softmax_scale, const std::optional<at::Tensor>& extra_kv_cache,
                             const std::optional<at::Tensor>& extra_indices,
                             const std::optional<at::Tensor>& extra_topk_length, at::Tensor out,
                             bool batch_invariant) {
  check_qo(q, "q", "[B, s_q, H, 512]");
  check_qo(out, "out", "[B, s_q, H, 512]");
  const int64_t B = q.size(0), s_q = q.size(1);
  SparseMqaParams p{};
  const CacheKind kind = check_cache(kv_cache, "kv_cache", q, p.src[0]);
  check_indices(indices, "indices", q, B, s_q, p.src[0]);
  check_lengths(topk_length, "topk_length", q, B, p.src[0]);
  p.num_src = 1;
  TORCH_CHECK(extra_kv_cache.has_value() == extra_indices.has_value(),
              "dsv4: extra_kv_cache and extra_indices must be given together");
  TORCH_CHECK(extra_kv_cache.has_value() || !extra_topk_length.has_value(),
              "dsv4: extra_topk_length given without extra_kv_cache / extra_indices");
  if (extra_kv_cache.has_value()) {
    const CacheKind k2 = check_cache(*extra_kv_cache, "extra_kv_cache", q, p.src[1]);
    TORCH_CHECK(k2 == kind, "dsv4: extra_kv_cache must have the same layout (dtype) as kv_cache: got ",
                extra_kv_cache->scalar_type(), " and ", kv_cache.scalar_type());
    check_indices(*extra_indices, "extra_indices", q, B, s_q, p.src[1]);
    check_lengths(extra_topk_length, "extra_topk_length", q, B, p.src[1]);
    p.num_src = 2;
  }
  return run(q, out, p, kind, attn_sink, softmax_scale, batch_invariant);
}

at::Tensor sparse_mqa_prefill(const at::Tensor& q, const at::Tensor& kv, const at::Tensor& indices,
                              const std::optional<at::Tensor>& topk_length, const std::optional<at::Tensor>& attn_sink,
                              double softmax_scale, at::Tensor out) {
  check_cuda(q, "q");
  check_dim(q, 3, "q", "[T, H, 512]");
  check_dim(out, 3, "out", "[T, H, 512]");
  const int64_t T = q.size(0);
  // kv [N, 512] (or [N, 1, 512]) bf16 = a bf16 "paged cache" with block_size 1.
  check_cuda(kv, "kv");
  check_same_device(kv, q, "kv", "q");
  check_dtype(kv, at::kBFloat16, "kv");
  TORCH_CHECK(kv.dim() == 2 || (kv.dim() == 3 && kv.size(1) == 1), "dsv4: kv must be [N, 512] or [N, 1, 512], got shape ",
              kv.sizes());
  TORCH_CHECK(kv.size(-1) == 512, "dsv4: kv head dim must be 512, got shape ", kv.sizes());
  at::Tensor kv3 = kv.dim() == 2 ? kv.unsqueeze(1) : kv;  // [N, 1, 512]
  at::Tensor idx = indices;
  TORCH_CHECK(idx.dim() == 2 || (idx.dim() == 3 && idx.size(1) == 1),
              "dsv4: indices must be [T, topk] or [T, 1, topk], got shape ", idx.sizes());
  if (idx.dim() == 2) idx = idx.unsqueeze(1);
  SparseMqaParams p{};
  check_cache(kv3, "kv", q, p.src[0]);
  at::Tensor q4 = q.unsqueeze(1), out4 = out.unsqueeze(1);
  check_qo(q4, "q", "[T, H, 512]");
  check_qo(out4, "out", "[T, H, 512]");
  check_indices(idx, "indices", q, T, 1, p.src[0]);
  check_lengths(topk_length, "topk_length", q, T, p.src[0]);
  p.num_src = 1;
  at::Tensor lse = run(q4, out4, p, CacheKind::kBf16, attn_sink, softmax_scale, false);
  return lse.squeeze(1);
}

}  // namespace
}  // namespace dsv4

TORCH_LIBRARY_IMPL(dsv4, CUDA, m) {
  m.impl("sparse_mqa_decode", &dsv4::sparse_mqa_decode);
  m.impl("sparse_mqa_prefill", &dsv4::sparse_mqa_prefill);
}

namespace {

// The test ops' shared argument checks; each error names the op and the argument.
void check_split_shape(const char* op, int64_t base_ctas, int64_t max_tiles, int64_t sms) {
  TORCH_CHECK(base_ctas > 0 && max_tiles >= 0 && sms > 0, "dsv4: ", op, " takes base_ctas > 0, max_tiles >= 0, sms > 0, got ",
              base_ctas, ", ", max_tiles, ", ", sms);
}
// An optional override argument (None: unset) in [lo, hi], written `range` in the error, as the
// std::optional<int> the host rules take.
std::optional<int> checked_override(const char* op, const char* arg, std::optional<int64_t> v, int64_t lo, int64_t hi,
                                    const std::string& range) {
  if (!v.has_value()) return std::nullopt;
  TORCH_CHECK(*v >= lo && *v <= hi, "dsv4: ", op, " takes ", arg, " in ", range, " or None, got ", *v);
  return static_cast<int>(*v);
}
const std::string kSplitsRange = "[1, " + std::to_string(dsv4::attention::kMaxSplits) + "]";
const std::string kRing32Range = "{0, 1, 2}";

}  // namespace

// Test-only (dsv4_testing, tests/test_attention.py): the split count a default-mode call
// gets, without a GPU: `priced` stands for DSV4_ATTN_PRICED_SPLITS, `forced` for
// DSV4_ATTN_SPLITS (None: unset; any count >= 1 here), both given, never read from the
// environment. No tensor argument: the function is the op's only kernel.
TORCH_LIBRARY_FRAGMENT(dsv4_testing, m) {
  m.def("sparse_mqa_num_splits(int base_ctas, int max_tiles, int sms, bool priced, int? forced=None) -> int",
        [](int64_t base_ctas, int64_t max_tiles, int64_t sms, bool priced, std::optional<int64_t> forced) -> int64_t {
          constexpr const char* op = "sparse_mqa_num_splits";
          check_split_shape(op, base_ctas, max_tiles, sms);
          const std::optional<int> f = checked_override(op, "forced", forced, 1, dsv4::attention::kMaxSplits, kSplitsRange);
          return dsv4::attention::choose_splits(base_ctas, max_tiles, static_cast<int>(sms), priced, f);
        });
  // attention::plan_ring32: (split count, DSV4_ATTN_RING32 value) of a default-mode 128-head fp8
  // call (not paired); the arguments stand for DSV4_ATTN_PRICED_SPLITS, DSV4_ATTN_SPLITS and
  // DSV4_ATTN_RING32, never read from the environment.
  m.def("sparse_mqa_ring32_plan(int base_ctas, int max_tiles, int sms, bool priced, int? forced_splits=None, "
        "int? forced_ring32=None) -> (int, int)",
        [](int64_t base_ctas, int64_t max_tiles, int64_t sms, bool priced, std::optional<int64_t> forced_splits,
           std::optional<int64_t> forced_ring32) -> std::tuple<int64_t, int64_t> {
          constexpr const char* op = "sparse_mqa_ring32_plan";
          check_split_shape(op, base_ctas, max_tiles, sms);
          const std::optional<int> fs =
              checked_override(op, "forced_splits", forced_splits, 1, dsv4::attention::kMaxSplits, kSplitsRange);
          const std::optional<int> fr = checked_override(op, "forced_ring32", forced_ring32, 0, 2, kRing32Range);
          const auto plan = dsv4::attention::plan_ring32(base_ctas, max_tiles, static_cast<int>(sms), priced, fs, fr);
          return {plan.splits, plan.ring32};
        });
  // The DSV4_ATTN_RING32 value a 128-head fp8 call (not paired) runs with, for `max_tiles`
  // and `num_splits` as the launcher computes them; `forced` stands for DSV4_ATTN_RING32
  // (None: unset, the rule), never read from the environment.
  m.def("sparse_mqa_ring32(int max_tiles, int num_splits, int? forced=None) -> int",
        [](int64_t max_tiles, int64_t num_splits, std::optional<int64_t> forced) -> int64_t {
          TORCH_CHECK(max_tiles >= 0 && num_splits >= 1 && num_splits <= dsv4::attention::kMaxSplits,
                      "dsv4: sparse_mqa_ring32 takes max_tiles >= 0, num_splits in [1, ", dsv4::attention::kMaxSplits,
                      "], got ", max_tiles, ", ", num_splits);
          const std::optional<int> f = checked_override("sparse_mqa_ring32", "forced", forced, 0, 2, kRing32Range);
          return dsv4::attention::pick_ring32(max_tiles, static_cast<int>(num_splits), f);
        });
}
