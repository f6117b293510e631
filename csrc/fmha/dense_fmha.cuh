// Dense masked FMHA over [compressed | window] KV per sequence (docs/design.md 3B) for head
// dims 64-256 with GQA/MQA: the masks are computed in the kernel from positions, so
// the KV rows are read as contiguous tiles (no index lists). One CTA = one sequence x
// 64 query rows x one query head; 4 warps of 16 rows; mma.sync m16n8k16 (bf16 in,
// fp32 accumulate), K/V tiles of 64 rows double-buffered with cp.async.
//
// Each query row sees two contiguous column ranges of its sequence's KV rows: the
// compressed columns [0, n_vis(p)) and the window columns [n_comp + jlo(p),
// n_comp + jhi(p)]. The CTA walks the union of its rows' ranges in two passes (so a
// column is never counted twice) and masks per element.
#pragma once

#include <cuda_bf16.h>
#include <stdint.h>

#include "common/cvt.cuh"
#include "common/mma/mma_sync.cuh"
#include "common/ptx/memory.cuh"

namespace dsv4 {
namespace fmha {

struct DenseFmhaParams {
  const __nv_bfloat16* q;  // [Tq, Hq, D]
  const __nv_bfloat16* k;  // [Nkv, Hkv, D]
  const __nv_bfloat16* v;  // [Nkv, Hkv, D]
  __nv_bfloat16* out;      // [Tq, Hq, D]
  float* lse;              // [Tq, Hq], natural log, sink excluded
  const int32_t* cu_seqlens_q;
  const int32_t* cu_seqlens_kv;
  const int32_t* n_comp;
  const int32_t* seq_start_pos;  // nullable: all zero
  const float* sink;             // nullable: no sink
  int64_t q_row, q_head, k_row, k_head, v_row, v_head, o_row, o_head;  // strides, elements
  int num_heads, group;  // Hq, Hq / Hkv
  int window, ratio;
  bool causal;
  float scale_log2;  // softmax_scale * log2(e)
  // Split-KV (decode: too few query tiles to fill the GPU): split s of a query tile
  // walks a contiguous 1/num_splits of its KV tiles and writes unnormalized partials
  // (o, row max m in log2 units, row sum l) instead of out / lse;
  // dense_fmha_combine_kernel merges them and applies the sink once.
  int num_splits;
  int64_t total_rows;  // Tq * Hq: stride of one split in the partial buffers
  float* part_o;       // [num_splits, Tq, Hq, D]
  float* part_ml;      // [num_splits, Tq, Hq, 2]
};

constexpr int kRows = 64, kCols = 64, kThreads = 128;

template <int D>
constexpr int smem_bytes() {
  return (kRows + 4 * kCols) * D * 2;  // Q + 2 stages x (K, V)
}

// Byte offset of 16-byte chunk c of row r in a [rows][D] bf16 tile. The XOR keeps
// the 8 rows an ldmatrix reads at one logical chunk in 8 different bank groups.
template <int D>
__device__ __forceinline__ uint32_t tile_offset(int r, int c) {
  return uint32_t(r * (D * 2) + ((c ^ (r & 7)) << 4));
}

__device__ __forceinline__ int floor_div(int a, int b) { return a >= 0 ? a / b : -((-a + b - 1) / b); }

// Copies rows [row0, row0 + kCols) of one head of a [N, H, D] tensor into a tile;
// rows at or past row_end become zeros.
template <int D>
__device__ __forceinline__ void load_tile(uint8_t* tile, const __nv_bfloat16* base, int64_t row_stride, int row0,
                                          int row_end) {
  constexpr int kChunks = D / 8;  // 16-byte chunks per row
#pragma unroll
  for (int i = 0; i < kCols * kChunks / kThreads; ++i) {
    const int id = threadIdx.x + i * kThreads, r = id / kChunks, c = id % kChunks;
    const bool valid = row0 + r < row_end;
    const __nv_bfloat16* src = valid ? base + int64_t(row0 + r) * row_stride + c * 8 : base;
    cp_async_16(smem_u32(tile) + tile_offset<D>(r, c), src, valid);
  }
}

template <int D>
__global__ void __launch_bounds__(kThreads) dense_fmha_kernel(const DenseFmhaParams p) {
  constexpr int kTile = kCols * D * 2, kDBlocks = D / 8;
  extern __shared__ __align__(128) uint8_t smem[];
  uint8_t* q_tile = smem;
  uint8_t* kv_tiles = smem + kRows * D * 2;  // stage s: K at 2s, V at 2s + 1

  const int seq = blockIdx.y, head = blockIdx.z, kv_head = head / p.group;
  const int split = blockIdx.x % p.num_splits;
  const int q0 = p.cu_seqlens_q[seq], tq = p.cu_seqlens_q[seq + 1] - q0;
  const int i0 = (blockIdx.x / p.num_splits) * kRows;
  if (i0 >= tq) return;
  const int kv0 = p.cu_seqlens_kv[seq], kv_len = p.cu_seqlens_kv[seq + 1] - kv0;
  const int nc = p.n_comp[seq], lw = kv_len - nc;
  const int start = p.seq_start_pos != nullptr ? p.seq_start_pos[seq] : 0;
  const int i_last = min(i0 + kRows, tq) - 1;

  // Column ranges of the two passes (union over this CTA's rows).
  int comp_end, win_begin, win_end;  // pass 0: [0, comp_end); pass 1: [win_begin, win_end)
  if (p.causal) {
    const int p_first = start + lw - tq + i0, p_last = start + lw - tq + i_last;
    comp_end = max(0, min(nc, floor_div(p_last + 1, p.ratio)));
    const int jlo = p.window > 0 ? max(0, p_first - p.window + 1 - start) : 0;
    const int jhi = min(lw - 1, p_last - start);
    win_begin = nc + jlo;
    win_end = max(win_begin, nc + jhi + 1);
  } else {
    comp_end = kv_len;  // one pass over every row
    win_begin = win_end = kv_len;
  }
  const int tiles0 = (comp_end + kCols - 1) / kCols;
  const int all_tiles = tiles0 + (win_end - win_begin + kCols - 1) / kCols;
  const int per_split = (all_tiles + p.num_splits - 1) / p.num_splits;
  const int t_begin = min(all_tiles, split * per_split), tiles = min(all_tiles, t_begin + per_split);

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  // This thread's two rows (r and r + 8 of its warp's 16) and their visible columns.
  int vis_comp[2], vis_lo[2], vis_hi[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int i = i0 + warp * 16 + lane / 4 + 8 * h;
    if (i >= tq) {
      vis_comp[h] = 0, vis_lo[h] = 1, vis_hi[h] = 0;
    } else if (p.causal) {
      const int pos = start + lw - tq + i;
      vis_comp[h] = max(0, min(nc, floor_div(pos + 1, p.ratio)));
      vis_lo[h] = nc + (p.window > 0 ? max(0, pos - p.window + 1 - start) : 0);
      vis_hi[h] = nc + min(lw - 1, pos - start);
    } else {
      vis_comp[h] = kv_len, vis_lo[h] = 1, vis_hi[h] = 0;
    }
  }

  const __nv_bfloat16* k_base = p.k + int64_t(kv0) * p.k_row + int64_t(kv_head) * p.k_head;
  const __nv_bfloat16* v_base = p.v + int64_t(kv0) * p.v_row + int64_t(kv_head) * p.v_head;
  const auto tile_start = [&](int t) { return t < tiles0 ? t * kCols : win_begin + (t - tiles0) * kCols; };
  const auto tile_end = [&](int t) { return t < tiles0 ? comp_end : win_end; };
  const auto load_kv = [&](int t) {
    const int c0 = tile_start(t), c1 = tile_end(t);
    uint8_t* stage = kv_tiles + (t & 1) * 2 * kTile;
    load_tile<D>(stage, k_base, p.k_row, c0, c1);
    load_tile<D>(stage + kTile, v_base, p.v_row, c0, c1);
  };

  load_tile<D>(q_tile, p.q + int64_t(q0) * p.q_row + int64_t(head) * p.q_head, p.q_row, i0, tq);
  if (t_begin < tiles) load_kv(t_begin);
  cp_async_commit();

  float o[kDBlocks][4];
#pragma unroll
  for (int d = 0; d < kDBlocks; ++d) o[d][0] = o[d][1] = o[d][2] = o[d][3] = 0.0f;
  float row_max[2] = {-INFINITY, -INFINITY}, row_sum[2] = {0.0f, 0.0f};
  const uint32_t q_addr = smem_u32(q_tile);

  for (int t = t_begin; t < tiles; ++t) {
    if (t + 1 < tiles) load_kv(t + 1);
    cp_async_commit();
    cp_async_wait<1>();
    __syncthreads();
    const uint32_t k_addr = smem_u32(kv_tiles + (t & 1) * 2 * kTile), v_addr = k_addr + kTile;

    // S = Q K^T for this warp's 16 rows x 64 columns
    float s[kCols / 8][4];
#pragma unroll
    for (int n = 0; n < kCols / 8; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.0f;
#pragma unroll 2
    for (int kb = 0; kb < D / 16; ++kb) {
      uint32_t a[4];
      ldmatrix_x4(a, q_addr + tile_offset<D>(warp * 16 + (lane & 15), kb * 2 + (lane >> 4)));
#pragma unroll
      for (int n2 = 0; n2 < kCols / 16; ++n2) {
        uint32_t b[4];
        ldmatrix_x4(b, k_addr + tile_offset<D>(n2 * 16 + ((lane >> 4) << 3) + (lane & 7), kb * 2 + ((lane >> 3) & 1)));
        mma_m16n8k16_bf16(s[2 * n2], a, b[0], b[1]);
        mma_m16n8k16_bf16(s[2 * n2 + 1], a, b[2], b[3]);
      }
    }

    // masks, online softmax (log2 domain)
    const int c0 = tile_start(t);
    const bool pass0 = t < tiles0;
    float tile_max[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int n = 0; n < kCols / 8; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int h = e / 2, col = c0 + n * 8 + (lane % 4) * 2 + (e % 2);
        const bool vis = pass0 ? col < vis_comp[h] : (col >= vis_lo[h] && col <= vis_hi[h]);
        const float x = vis ? s[n][e] * p.scale_log2 : -INFINITY;
        s[n][e] = x;
        tile_max[h] = fmaxf(tile_max[h], x);
      }
    }
    float alpha[2], base[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      tile_max[h] = fmaxf(tile_max[h], __shfl_xor_sync(0xffffffffu, tile_max[h], 1));
      tile_max[h] = fmaxf(tile_max[h], __shfl_xor_sync(0xffffffffu, tile_max[h], 2));
      const float m_new = fmaxf(row_max[h], tile_max[h]);
      base[h] = m_new == -INFINITY ? 0.0f : m_new;  // an all-masked row so far: keep zeros, no NaN
      alpha[h] = exp2f(row_max[h] - base[h]);
      row_max[h] = m_new;
      row_sum[h] *= alpha[h];
    }
#pragma unroll
    for (int n = 0; n < kCols / 8; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float pe = exp2f(s[n][e] - base[e / 2]);
        s[n][e] = pe;
        row_sum[e / 2] += pe;
      }
    }
#pragma unroll
    for (int d = 0; d < kDBlocks; ++d) {
      o[d][0] *= alpha[0], o[d][1] *= alpha[0];
      o[d][2] *= alpha[1], o[d][3] *= alpha[1];
    }

    // O += P V (P straight from the S accumulators, rounded to bf16)
#pragma unroll
    for (int kb = 0; kb < kCols / 16; ++kb) {
      const uint32_t a[4] = {pack_bf16x2(s[2 * kb][0], s[2 * kb][1]), pack_bf16x2(s[2 * kb][2], s[2 * kb][3]),
                             pack_bf16x2(s[2 * kb + 1][0], s[2 * kb + 1][1]),
                             pack_bf16x2(s[2 * kb + 1][2], s[2 * kb + 1][3])};
#pragma unroll
      for (int d2 = 0; d2 < D / 16; ++d2) {
        uint32_t b[4];
        ldmatrix_x4_trans(b, v_addr + tile_offset<D>(kb * 16 + ((lane >> 3) & 1) * 8 + (lane & 7), d2 * 2 + (lane >> 4)));
        mma_m16n8k16_bf16(o[2 * d2], a, b[0], b[1]);
        mma_m16n8k16_bf16(o[2 * d2 + 1], a, b[2], b[3]);
      }
    }
    __syncthreads();  // the next iteration's prefetch overwrites this stage
  }
  cp_async_wait<0>();

#pragma unroll
  for (int h = 0; h < 2; ++h) {
    row_sum[h] += __shfl_xor_sync(0xffffffffu, row_sum[h], 1);
    row_sum[h] += __shfl_xor_sync(0xffffffffu, row_sum[h], 2);
  }
  if (p.num_splits > 1) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int i = i0 + warp * 16 + lane / 4 + 8 * h;
      if (i >= tq) continue;
      const int64_t row = (int64_t(split) * p.total_rows + int64_t(q0 + i) * p.num_heads + head);
      float* dst = p.part_o + row * D + (lane % 4) * 2;
#pragma unroll
      for (int d = 0; d < kDBlocks; ++d) *reinterpret_cast<float2*>(dst + d * 8) = make_float2(o[d][2 * h], o[d][2 * h + 1]);
      if (lane % 4 == 0) *reinterpret_cast<float2*>(p.part_ml + row * 2) = make_float2(row_max[h], row_sum[h]);
    }
    return;
  }

  // normalization with the sink (denominator only); lse excludes it
  const float sink2 = p.sink != nullptr ? p.sink[head] * 1.4426950408889634f : -INFINITY;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int i = i0 + warp * 16 + lane / 4 + 8 * h;
    const bool empty = row_max[h] == -INFINITY;
    const float denom = empty ? 1.0f : row_sum[h] + exp2f(sink2 - row_max[h]);
    const float inv = empty ? 0.0f : 1.0f / denom;  // sink = +inf: inv = 0, output 0
    if (i < tq) {
      __nv_bfloat16* dst = p.out + int64_t(q0 + i) * p.o_row + int64_t(head) * p.o_head + (lane % 4) * 2;
#pragma unroll
      for (int d = 0; d < kDBlocks; ++d)
        *reinterpret_cast<__nv_bfloat162*>(dst + d * 8) = __floats2bfloat162_rn(o[d][2 * h] * inv, o[d][2 * h + 1] * inv);
      if (lane % 4 == 0)
        p.lse[int64_t(q0 + i) * p.num_heads + head] =
            empty ? -INFINITY : (row_max[h] + log2f(row_sum[h])) * 0.6931471805599453f;
    }
  }
}

// Merges the num_splits partials of one (query row, head) per warp: lanes stride over
// head_dim. Splits that saw nothing have m = -inf and l = 0 and drop out.
template <int D>
__global__ void __launch_bounds__(128) dense_fmha_combine_kernel(const DenseFmhaParams p) {
  const int64_t row = int64_t(blockIdx.x) * 4 + threadIdx.x / 32;  // q_row * Hq + head
  if (row >= p.total_rows) return;
  const int lane = threadIdx.x % 32, head = int(row % p.num_heads);
  const int64_t q_row = row / p.num_heads;
  float m = -INFINITY;
  for (int s = 0; s < p.num_splits; ++s) m = fmaxf(m, p.part_ml[(s * p.total_rows + row) * 2]);
  const float base = m == -INFINITY ? 0.0f : m;
  float l = 0.0f;
  float acc[D / 32];
#pragma unroll
  for (int j = 0; j < D / 32; ++j) acc[j] = 0.0f;
  for (int s = 0; s < p.num_splits; ++s) {
    const float2 ml = *reinterpret_cast<const float2*>(p.part_ml + (s * p.total_rows + row) * 2);
    const float w = exp2f(ml.x - base);  // 0 for an empty split
    l += ml.y * w;
    const float* src = p.part_o + (s * p.total_rows + row) * D;
#pragma unroll
    for (int j = 0; j < D / 32; ++j) acc[j] += w * src[lane + 32 * j];
  }
  const float sink2 = p.sink != nullptr ? p.sink[head] * 1.4426950408889634f : -INFINITY;
  const bool empty = m == -INFINITY;
  const float inv = empty ? 0.0f : 1.0f / (l + exp2f(sink2 - m));
  __nv_bfloat16* dst = p.out + q_row * p.o_row + int64_t(head) * p.o_head;
#pragma unroll
  for (int j = 0; j < D / 32; ++j) dst[lane + 32 * j] = __float2bfloat16_rn(acc[j] * inv);
  if (lane == 0) p.lse[row] = empty ? -INFINITY : (m + log2f(l)) * 0.6931471805599453f;
}

}  // namespace fmha
}  // namespace dsv4
