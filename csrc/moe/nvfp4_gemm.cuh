// Grouped GEMMs of the NVFP4 MoE at decode sizes and as the one-warpgroup fallback
// (prefill sizes run nvfp4_gemm_ws.cuh, which shares the epilogues below). "Swap AB":
// the NVFP4 weights are the MMA A operand (64 weight rows per CTA, dequantized
// e2m1 -> bf16 in registers, dequant.cuh), the tokens routed to the expert are the B
// operand (block_n tokens per CTA, bf16 in shared memory, 128-byte swizzle).
// Accumulation in fp32; the global scales are applied in the epilogue.
//
// One warpgroup per CTA and a ring of STAGES 64-wide K steps in shared memory, grouped
// into slots: thread 0 fetches a slot's weight codes and scales with two bulk copies
// counted on the slot's mbarrier, every thread copies its part of the token tile with
// cp.async (see gemm_segment). Decode tiles (block_n 8 or 16) multiply with warp-level
// mma.sync, the 64-token tile with wgmma (see mma_step). Grids: classic
// (moe_gemm_kernel) or split-K on a persistent grid (moe_gemm_splitk_kernel); see the
// comment above gemm_grid_dependencies.
//
// GEMM1 (kGemm1): rows of w13 (interleaved gate/up, see params.cuh), K = hidden;
//   epilogue gemm1_epilogue (clamped SwiGLU, bf16 or NVFP4 h).
// GEMM2: rows of w2 (output hidden dims), K = intermediate; epilogue gemm2_epilogue.
#pragma once

#include "common/cvt.cuh"
#include "common/mma/mma_sync.cuh"
#include "common/mma/wgmma.cuh"
#include "common/nvfp4.cuh"
#include "common/ptx/memory.cuh"
#include "common/ptx/pdl.cuh"
#include "common/ptx/regs.cuh"
#include "common/ptx/sync.cuh"
#include "moe/dequant.cuh"
#include "moe/params.cuh"
#include "moe/swiglu.cuh"

namespace dsv4 {
namespace moe {

// Epilogue staging: 128 bytes per token row (GEMM1: 32 fp32, GEMM2: 64 bf16), groups
// of 8 columns XOR-swizzled by token row so that a warp's fragment writes hit distinct
// banks while each group stays contiguous for vector reads.
__device__ __forceinline__ int stage1_index(int tok, int col) { return tok * 32 + (col ^ (((tok >> 1) & 3) << 3)); }
__device__ __forceinline__ int stage2_index(int tok, int col) { return tok * 64 + (col ^ (((tok >> 1) & 3) << 3)); }

template <int BN, int STAGES>
struct GemmSmem {
  // Decode tiles multiply with mma.sync and split the STAGES K steps into two ring slots
  // (fewer slots of more steps: fewer barriers, copies and waits per K step); larger
  // tiles multiply with wgmma and take 2 steps per slot (two steps' A fragments live
  // through one commit/wait).
  static constexpr bool kWarpMma = BN <= 16;
  static constexpr int kSteps = kWarpMma ? STAGES / 2 : 2;
  static constexpr int kSlots = STAGES / kSteps;
  static_assert(STAGES % kSteps == 0 && kSlots >= 2, "a ring of at least two slots");
  static_assert(kSteps % 2 == 0, "the token copies take every other step of a slot (gemm_segment)");
  static constexpr int kB = BN * 128;  // one 64-wide K slice of BN token rows
  static constexpr int kPipe = STAGES * (kB + kCodeTileBytes + kScaleTileBytes);
  static constexpr int kStaging = BN * 128;
  static constexpr int kMax = kPipe > kStaging ? kPipe : kStaging;
  static constexpr int kBytes = kMax + 1024;  // + alignment slack
};

// Epilogues of one 64-row weight tile x BN tokens, run by the warpgroup that holds
// the accumulators (tid = its thread index, 0..127). stg: shared staging of BN * 128
// bytes (stage1_index / stage2_index), private to the warpgroup; sync() orders
// the warpgroup's staging writes and reads (the classic kernels' CTA is the
// warpgroup: __syncthreads; the warp-specialized kernel: a named barrier). kTiled:
// h is written in the tiled layout (act_offset) that the prefill kernel reads.
//
// GEMM1: clamped SwiGLU of (gate, up) held by the same thread, then either bf16 h, or
// NVFP4 (codes + e4m3 scales, the Blackwell rule of common/nvfp4.cuh) plus its bf16
// expansion code * block scale, which is what GEMM2 reads as its B operand (the
// global scale a2 goes in GEMM2's epilogue).
template <int BN, bool kTiled, typename Sync>
__device__ __forceinline__ void gemm1_epilogue(const MoeParams& p, const float (&acc)[BN / 2], float* stg, int e,
                                               int row0, int rt, int tid, Sync sync) {
  const int warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const float ag = p.act_nvfp4 ? __ldg(p.a13_scale + (p.a13_per_expert ? e : 0)) : 1.0f;
  const float sg = __ldg(p.w13_scale_2 + 2 * e) * 128.0f * ag;
  const float su = __ldg(p.w13_scale_2 + 2 * e + 1) * 128.0f * ag;
  const float L = p.swiglu_limit;
#pragma unroll
  for (int c = 0; c < BN / 8; ++c) {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      float gate = acc[4 * c + i] * sg;
      float up = acc[4 * c + 2 + i] * su;
      if (p.has_limit) {
        gate = fminf(gate, L);
        up = fminf(fmaxf(up, -L), L);
      }
      stg[stage1_index(8 * c + 2 * t + i, 8 * warp + g)] = silu(gate) * up;
    }
  }
  sync();
  const int N = p.N;
  if (!p.act_nvfp4) {
    for (int idx = tid; idx < BN * 4; idx += kThreads) {
      const int tok = idx >> 2, ch = idx & 3;
      const uint4 o = pack_bf16x8(stg + stage1_index(tok, ch * 8));
      *reinterpret_cast<uint4*>(p.h + act_offset<kTiled>(row0 + tok, rt * 4 + ch, N)) = o;
    }
  } else {
    const Nvfp4Encoder enc = nvfp4_encoder(__ldg(p.a2_scale + (p.a2_per_expert ? e : 0)));
    for (int idx = tid; idx < BN * 2; idx += kThreads) {
      const int tok = idx >> 1, blk = idx & 1;
      const float* vlo = stg + stage1_index(tok, blk * 16);
      const float* vhi = stg + stage1_index(tok, blk * 16 + 8);
      float lo[8], hi[8];
      float amax = 0.0f;
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        lo[i] = vlo[i];
        hi[i] = vhi[i];
        amax = fmaxf(amax, fmaxf(fabsf(lo[i]), fabsf(hi[i])));
      }
      const __nv_fp8_e4m3 s8 = nvfp4_block_scale(amax, enc);
      const float sf = float(s8), r = nvfp4_block_recip(sf, enc);
      const uint32_t clo = nvfp4_encode8(lo, r);
      const uint32_t chi = nvfp4_encode8(hi, r);
      const size_t row = size_t(row0 + tok);
      *reinterpret_cast<uint2*>(p.hq + row * (N / 2) + rt * 16 + blk * 8) = make_uint2(clo, chi);
      p.hs[row * (N / 16) + rt * 2 + blk] = s8;
      // bf16 expansion code * block scale (exact) for GEMM2's B operand.
      uint32_t w[8];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        w[i] = pack_bf16x2(e2m1_value(clo >> (8 * i)) * sf, e2m1_value(clo >> (8 * i + 4)) * sf);
        w[4 + i] = pack_bf16x2(e2m1_value(chi >> (8 * i)) * sf, e2m1_value(chi >> (8 * i + 4)) * sf);
      }
      *reinterpret_cast<uint4*>(p.h + act_offset<kTiled>(row0 + tok, rt * 4 + blk * 2, N)) =
          make_uint4(w[0], w[1], w[2], w[3]);
      *reinterpret_cast<uint4*>(p.h + act_offset<kTiled>(row0 + tok, rt * 4 + blk * 2 + 1, N)) =
          make_uint4(w[4], w[5], w[6], w[7]);
    }
  }
  if (p.h_debug != nullptr) {
    for (int idx = tid; idx < BN * 32; idx += kThreads) {
      const int tok = idx >> 5, n = idx & 31;
      p.h_debug[size_t(row0 + tok) * N + rt * 32 + n] = stg[stage1_index(tok, n)];
    }
  }
}

// GEMM2: y (bf16, row-major) per padded row, to be combined into token order by
// moe_combine_kernel. Staged as bf16 (the one rounding of acc * scale).
template <int BN, typename Sync>
__device__ __forceinline__ void gemm2_epilogue(const MoeParams& p, const float (&acc)[BN / 2], __nv_bfloat16* stg,
                                               int e, int row0, int rt, int tid, Sync sync) {
  const int warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const float ag = p.act_nvfp4 ? __ldg(p.a2_scale + (p.a2_per_expert ? e : 0)) : 1.0f;
  const float sc = __ldg(p.w2_scale_2 + e) * 128.0f * ag;
#pragma unroll
  for (int c = 0; c < BN / 8; ++c) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int tok = 8 * c + 2 * t + (i & 1);
      const int kk = 16 * warp + g + 8 * (i >> 1);
      stg[stage2_index(tok, kk)] = __float2bfloat16_rn(acc[4 * c + i] * sc);
    }
  }
  sync();
  const int K = p.K;
  for (int idx = tid; idx < BN * 8; idx += kThreads) {
    const int tok = idx >> 3, ch = idx & 7;
    const uint4 o = *reinterpret_cast<const uint4*>(stg + stage2_index(tok, ch * 8));
    *reinterpret_cast<uint4*>(p.y + size_t(row0 + tok) * K + rt * 64 + ch * 8) = o;
  }
}

// K steps q .. q + N - 1 of a one-warpgroup GEMM as one wgmma group: every step's A
// fragments dequantized first, then the steps' wgmmas, one commit and one wait, and the
// sums fenced for the code after (gemm_segment's slots, moe_gemm2_resident_kernel's row
// tiles). dequant_step(q, a) and mma_step(q, a) are the caller's, a[4][4] per step.
template <int N, class Dequant, class Mma, int A>
__device__ __forceinline__ void wgmma_step_group(int q, Dequant& dequant_step, Mma& mma_step, float (&acc)[A]) {
  uint32_t a[N][4][4];
#pragma unroll
  for (int i = 0; i < N; ++i) dequant_step(q + i, a[i]);
  wgmma_fence();
#pragma unroll
  for (int i = 0; i < N; ++i) mma_step(q + i, a[i]);
  wgmma_commit();
  wgmma_wait<0>();
  fence_regs(acc);
}

// Minimum K steps per split-K chunk: fewer and the pipeline prologue and the partial
// round trip cost more than the extra parallelism gives.
constexpr int kSplitMinSteps = 8;

// K steps [kb, ke) of item (tile, rt), then its epilogue. With splits > 1 the item's
// K range is cut into `splits` equal chunks (this is chunk `chunk`, item index `item`):
// the fp32 partial goes to slot item * splits + chunk, and the CTA that completes the
// item's arrival count adds the chunks' partials in chunk order (its own from
// registers) and runs the epilogue. No CTA waits for another, and a row's sums do not
// depend on which tile the (atomics-ordered) routing put it in, so results are
// deterministic.
//
// The K loop goes in slots of S::kSteps 64-wide steps (one barrier per slot; wgmma:
// one commit/wait per slot) over a ring of S::kSlots slots. An item's weight codes (and
// scales) are one contiguous run in the prepared layout, so thread 0 fetches each slot
// with two bulk copies counted on the slot's mbarrier; the token tile (rows gathered by
// the routing, 128-byte swizzled) goes by cp.async, one 16-byte chunk per thread per
// BN/8 rows and every other step. At decode sizes the kernel is issue-bound (ncu: issue
// slots 65-78 % busy), and per-thread cp.async of the weights was as many instructions
// as the dequant; decode tiles amortize the per-slot bookkeeping (barrier, copies,
// waits, addresses) over 4 or 8 steps instead of 2.
// kX: the instance may read GEMM1's token rows from x itself (p.direct_x decides at run
// time); decode tiles always may, 64-token tiles in an instance of their own
// (moe_gemm_kernel's kX), so that the gather path's code is the same as without it.
template <int BN, int STAGES, bool kGemm1, int kN = BN, bool kX = (BN <= 16), typename BeforeTokens>
__device__ __forceinline__ void gemm_segment(const MoeParams& p, uint8_t* smem, uint64_t* full, int& ring,
                                             uint32_t& phase, int tile, int rt, int kb, int ke, int item, int splits,
                                             int chunk, int tid, BeforeTokens before_tokens) {
  const int e = __ldcg(p.tile_expert + tile);  // L2: GEMM2 reads it before any grid wait
  const int row0 = tile * BN;
  const int kdim = kGemm1 ? p.K : p.N;
  const int KT = kdim / kTileK;
  const int RT = gemm_row_tiles<kGemm1>(p);
  const int nk = ke - kb;
  using S = GemmSmem<BN, STAGES>;
  constexpr int kSteps = S::kSteps, kSlots = S::kSlots;
  const int nslots = (nk + kSteps - 1) / kSteps;  // slots this segment fills
  const size_t tile_index = (size_t(e) * RT + rt) * KT + kb;
  const uint8_t* wq = (kGemm1 ? p.w13 : p.w2) + tile_index * kCodeTileBytes;
  const uint8_t* wsc = (kGemm1 ? p.w13_scale : p.w2_scale) + tile_index * kScaleTileBytes;

  uint8_t* sB = smem;
  uint8_t* sW = sB + STAGES * S::kB;
  uint8_t* sS = sW + STAGES * kCodeTileBytes;

  const int warp = tid >> 5, g = (tid & 31) >> 2;

  // Token-tile chunks of this thread, fixed over the K loop: rows r0 + 8i (i < BN/8),
  // steps q0, q0 + 2, ... of each slot, 16-byte chunk c0 (stored at c0 ^ (row & 7), the
  // same for every i).
  constexpr int kBIters = BN / 8;
  const int r0 = tid >> 4, q0 = (tid >> 3) & 1, c0 = tid & 7;
  uint32_t sB_dst = smem_u32(sB) + q0 * S::kB + r0 * 128 + ((c0 ^ r0) << 4);
  asm("" : "+r"(sB_dst));  // opaque: kept in a register, not recomputed from tid per slot
  const __nv_bfloat16* b_src[kBIters];
  uint32_t b_zero[kBIters];
#pragma unroll
  for (int i = 0; i < kBIters; ++i) {
    b_src[i] = (kGemm1 ? p.xg : p.h) + size_t(row0 + r0 + 8 * i) * kdim;
    b_zero[i] = 0;
  }
  // Padding rows (no slot) are zero-filled by the copy itself, so the gather kernel skips
  // them (moe_gather_kernel: only for these kernels; the prefill kernel's bulk copies read
  // xg whole). At 64-token tiles that are partly filled (M ~ 1000-4000) most of xg can be
  // padding: V4.1-Flash at tensor parallel 8, M = 2048, has 12,288 slots in 36,480 rows.
  // In bf16 mode (direct_x, config.h) the token rows may come straight from x (no gather kernel).
  if constexpr (kGemm1) {
    const bool direct = kX && p.direct_x;
#pragma unroll
    for (int i = 0; i < kBIters; ++i) {
      const int slot = p.row_slot[row0 + r0 + 8 * i];
      b_zero[i] = slot < 0;
      if (direct) b_src[i] = p.x + size_t(slot >= 0 ? slot / p.topk : 0) * kdim;
    }
  }
#pragma unroll
  for (int i = 0; i < kBIters; ++i) b_src[i] += size_t(kb + q0) * kTileK + c0 * 8;

  auto load_weights = [&](int si, int slot) {
    if (si < nslots && tid == 0) {
      const int k0 = kSteps * si;
      const int steps = min(kSteps, nk - k0);
      mbar_arrive_expect_tx(full + slot, steps * (kCodeTileBytes + kScaleTileBytes));
      bulk_g2s(smem_u32(sW) + slot * kSteps * kCodeTileBytes, wq + size_t(k0) * kCodeTileBytes,
               steps * kCodeTileBytes, full + slot);
      bulk_g2s(smem_u32(sS) + slot * kSteps * kScaleTileBytes, wsc + size_t(k0) * kScaleTileBytes,
               steps * kScaleTileBytes, full + slot);
    }
  };
  // One commit group per slot (empty past the end), so group counts stay exact.
  auto load_tokens = [&](int si, int slot) {
    if (si < nslots) {
      const int steps = min(kSteps, nk - kSteps * si);
      const uint32_t dst = sB_dst + slot * (kSteps * S::kB);
      const size_t k0 = size_t(kSteps * si) * kTileK;
      auto copy_step = [&](int q) {
#pragma unroll
        for (int i = 0; i < kBIters; ++i)
          cp_async_16_unordered(dst + q * S::kB + i * 8 * 128, b_src[i] + k0 + q * kTileK, b_zero[i]);
      };
      if (steps == kSteps) {  // every slot but a segment's last: no per-step checks
#pragma unroll
        for (int q = 0; q < kSteps; q += 2) copy_step(q);
      } else {
#pragma unroll
        for (int q = 0; q < kSteps; q += 2)
          if (q0 + q < steps) copy_step(q);
      }
    }
    cp_async_commit();
  };

  // Prefetch distance kSlots - 1: the slot refilled in slot step si was read in si - 1,
  // whose reads every warp finished (mma.sync: ldmatrix; wgmma: wait_group<0>) before
  // this slot's barrier.
  // (Overlapping the dequant of the next slot with the MMAs of this one inside one
  // warpgroup makes ptxas serialize the wgmmas, C7513; the overlap comes from the 2-8
  // CTAs that share an SM instead.) The ring position (slot `ring`, mbarrier parity
  // `phase`) carries over between the segments of a persistent CTA. The weights of the
  // first slots go out before before_tokens() (GEMM2: the wait for GEMM1's h), the
  // token rows after it.
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

  const uint32_t sB_base = smem_u32(sB);
  const uint32_t sW_rd = smem_u32(sW) + tid * 16;
  const uint32_t sS_rd = smem_u32(sS) + (warp * 8 + g) * 8;

  // Decode tiles (BN <= 16) multiply with warp-level mma.sync m16n8k16: its A fragment
  // is the wgmma one of the warp's 16 rows and its accumulators are laid out alike, but
  // the four warps need not meet at every MMA (ncu, Flash M=64: 14 % of the stalls were
  // warps waiting at the first wgmma of a pair for the warpgroup's slowest dequant).
  // B (8 token rows x 64 of K per n8 block) comes in by ldmatrix: lanes 8m..8m+7 address
  // token row (lane & 7), K chunk 4q + m of the swizzled row.
  const int lane = tid & 31;
  const uint32_t ld_off0 = (lane & 7) * 128 + (((lane >> 3) ^ (lane & 7)) << 4);
  const uint32_t ld_off1 = (lane & 7) * 128 + (((4 + (lane >> 3)) ^ (lane & 7)) << 4);
  auto dequant_step = [&](int st, uint32_t(&af)[4][4]) {
    dequant_tile(lds_v4(sW_rd + st * kCodeTileBytes), lds_v2(sS_rd + st * kScaleTileBytes), af);
  };
  auto mma_step = [&](int st, const uint32_t(&af)[4][4]) {
    if constexpr (S::kWarpMma) {
      const uint32_t tb = sB_base + st * S::kB;
#pragma unroll
      for (int h = 0; h < BN / 8; ++h) {
        uint32_t b[2][4];
        ldmatrix_x4(b[0], tb + h * 1024 + ld_off0);
        ldmatrix_x4(b[1], tb + h * 1024 + ld_off1);
        float(&d)[4] = *reinterpret_cast<float(*)[4]>(acc + 4 * h);  // n8 block h's accumulators
#pragma unroll
        for (int j = 0; j < 4; ++j) mma_m16n8k16_bf16(d, af[j], b[j >> 1][2 * (j & 1)], b[j >> 1][2 * (j & 1) + 1]);
      }
    } else {
      // K-major token rows of 128 bytes (64 bf16), 8-row groups 1024 bytes apart.
      // A partly filled 64-row tile multiplies its first kN rows only (with_tile_width): the
      // accumulators of m64nN are acc's first kN / 2.
      const uint64_t desc = wgmma_desc_sw128(sB_base + st * S::kB, 16, 1024);
      static_assert(kN <= BN, "a width within the tile");
      float(&d)[kN / 2] = *reinterpret_cast<float(*)[kN / 2]>(&acc);
#pragma unroll
      for (int j = 0; j < 4; ++j) WgmmaRS<kN>::mma(d, af[j], desc + 2 * j, 1);
    }
  };
  // Slot step si ready: this thread's token copies landed (and, for wgmma, are fenced
  // for the async proxy: cp.async writes through the generic proxy, the wgmmas read
  // through the async one; ldmatrix reads through the generic one), everyone's are
  // visible (and done with the slot refilled next), the weight bytes arrived.
  auto enter_slot = [&](int si) {
    cp_async_wait<kAhead - 1>();
    if constexpr (!S::kWarpMma) fence_proxy_async_smem();
    __syncthreads();
    load_weights(si + kAhead, slot_after(ring, kAhead));
    load_tokens(si + kAhead, slot_after(ring, kAhead));
    mbar_wait(full + ring, phase);
  };

  const int full_slots = nk / kSteps;
  for (int si = 0; si < full_slots; ++si) {
    enter_slot(si);
    const int st = kSteps * ring;
    if constexpr (S::kWarpMma) {
#pragma unroll
      for (int q = 0; q < kSteps; ++q) {
        uint32_t a[4][4];
        dequant_step(st + q, a);
        mma_step(st + q, a);
      }
    } else {
      static_assert(kSteps == 2, "wgmma slots hold two steps' A fragments");
      wgmma_step_group<2>(st, dequant_step, mma_step, acc);
    }
    ring_advance<kSlots>(ring, phase);
  }
  if (const int rest = nk - full_slots * kSteps) {  // the last 1 .. kSteps - 1 steps
    enter_slot(full_slots);
    const int st = kSteps * ring;
    for (int q = 0; q < rest; ++q) {
      if constexpr (S::kWarpMma) {
        uint32_t a[4][4];
        dequant_step(st + q, a);
        mma_step(st + q, a);
      } else {
        wgmma_step_group<1>(st + q, dequant_step, mma_step, acc);
      }
    }
    ring_advance<kSlots>(ring, phase);
  }
  cp_async_wait<0>();
  __syncthreads();

  // Partials are stored thread-major ([i][tid]) so the owner's same thread reads
  // back exactly its own fragment layout with coalesced accesses. GEMM1 and GEMM2 have a
  // half of the buffer each: GEMM2 runs while GEMM1's last items are still being summed
  // (see gemm_grid_dependencies), and its split count, hence which of its items write
  // which slots, can differ from GEMM1's, so a shared buffer would let a GEMM2 chunk
  // overwrite a GEMM1 partial before its owner has read it.
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

  auto cta_sync = [] { __syncthreads(); };
  if constexpr (kGemm1) {
    gemm1_epilogue<BN, false>(p, acc, reinterpret_cast<float*>(smem), e, row0, rt, tid, cta_sync);
    // Publish this weight-row tile of the token tile's h to GEMM2 (gemm2_wait_h).
    __threadfence();
    __syncthreads();
    if (tid == 0) atomicAdd(p.group_ready + tile, 1);
  } else {
    gemm2_epilogue<BN>(p, acc, reinterpret_cast<__nv_bfloat16*>(smem), e, row0, rt, tid, cta_sync);
  }
}

// The ring's mbarriers (one expected arrival each: thread 0's, with the bytes).
template <int NBARS>
__device__ __forceinline__ void init_ring(uint64_t (&full)[NBARS]) {
  if (threadIdx.x == 0) {
#pragma unroll
    for (int j = 0; j < NBARS; ++j) mbar_init(full + j, 1);
    mbar_init_fence();
  }
  __syncthreads();
}

// GEMM2 does not wait for GEMM1's grid (see moe_gemm_kernel): before reading a token
// tile's h it waits until all 2N/64 GEMM1 row tiles of that tile were published.
__device__ __forceinline__ void gemm2_wait_h(const MoeParams& p, int tile) {
  if (threadIdx.x == 0) wait_flag_geq(p.group_ready + tile, gemm_row_tiles<true>(p));
  __syncthreads();
}

// Grids. Classic (moe_gemm_kernel): x = 64-row weight tile, y = token tile (rows
// [tile * BN, tile * BN + BN) of the padded, expert-sorted activation buffer; all belong
// to expert tile_expert[tile]; CTAs past *num_tiles exit at once). The weight-row tile
// varies fastest, so the CTAs of one token tile run together and its h is complete
// early: GEMM2 CTAs, launched in the same order, find their tiles ready while GEMM1's
// last tiles still run.
// Split-K (moe_gemm_splitk_kernel): a persistent grid of occupancy x SMs CTAs; each
// item (tile, weight-row tile) is cut into `splits` equal K chunks, splits chosen on
// device so that items * splits fills the grid at most once (capped at KT /
// kSplitMinSteps). For few tokens (one expert = 64 items per GEMM at M = 1) the
// classic grid leaves most SMs idle while each CTA runs a latency-bound K loop.
// Launch order and waits: GEMM1 waits for the routing grid (pdl_wait) before it lets
// GEMM2 launch, so when any GEMM2 CTA runs the routing tables are complete. GEMM2
// (programmatic launch) never waits for GEMM1's grid: its CTAs take the slots GEMM1's
// finished CTAs leave, stream their first weight slots, and wait per token tile for h
// (gemm2_wait_h) - GEMM2 fills GEMM1's tail instead of starting after it. All GEMM1
// CTAs are resident or done when GEMM2 launches, so the waits cannot deadlock.
template <bool kGemm1>
__device__ __forceinline__ void gemm_grid_dependencies() {
  if constexpr (kGemm1) pdl_wait();
  pdl_launch_dependents();
}

template <int BN, int STAGES, bool kGemm1, bool kX = (BN <= 16)>
__global__ void __launch_bounds__(kThreads) moe_gemm_kernel(const MoeParams p) {
  gemm_grid_dependencies<kGemm1>();
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = align_smem_1024(smem_raw);
  __shared__ uint64_t full[GemmSmem<BN, STAGES>::kSlots];
  const int KT = gemm_k_steps<kGemm1>(p);
  const int tile = blockIdx.y;
  if (tile >= __ldcg(p.num_tiles)) return;
  init_ring(full);
  int ring = 0;
  uint32_t phase = 0;
  auto run = [&](auto width) {
    gemm_segment<BN, STAGES, kGemm1, decltype(width)::value, kX>(p, smem, full, ring, phase, tile, blockIdx.x, 0, KT,
                                                                 0, 1, 0, threadIdx.x, [&] {
                                                                   if constexpr (!kGemm1) gemm2_wait_h(p, tile);
                                                                 });
  };
  // GEMM1 only: narrower wgmmas for a partly filled 64-row tile measured 2-3% faster there
  // at M = 2048 (V4-Pro 608.3 -> 594.3 us, V4.1-Flash local-48 350.0 -> 341.0) and 0-2%
  // slower in GEMM2 (V4-Pro 329.7 -> 336.9; docs/perf-history/2026-12-06-mxfp4-w4a8-narrow-tiles.md).
  if constexpr (BN == 64 && kGemm1)
    with_tile_width<32>(tile_rows(p.row_slot, tile), run);
  else
    run(std::integral_constant<int, BN>{});
}

// Shared memory of moe_gemm2_resident_kernel (64-token tiles; GEMM2 of KT = N / 64 <=
// kMaxSteps K steps): the token tile's KT steps (resident), two weight slots of KT steps
// (codes, then scales), then the y staging of one 64-row weight tile.
struct ResidentSmem {
  static constexpr int kB = 64 * 128;  // one 64-wide K step of 64 token rows (bf16)
  static constexpr int kMaxSteps = 8;  // N <= 512 (V4.1-Flash at tensor parallel 8: N = 320, 5 steps)
  static constexpr int kStaging = 64 * 128;
  __host__ __device__ static constexpr int slot(int KT) { return KT * (kCodeTileBytes + kScaleTileBytes); }
  __host__ __device__ static constexpr int bytes(int KT) { return KT * kB + 2 * slot(KT) + kStaging + 1024; }
};

// GEMM2 at 64-token tiles where its K (= N) is short, R weight-row tiles per CTA: the token
// tile comes in once and stays, and the weights of row tile r + 1 (one slot ahead) arrive
// while row tile r is multiplied and its y stored. The classic kernel (moe_gemm_kernel)
// runs one row tile per CTA: at N = 320 that is 5 K steps behind a fetch of the whole
// 64 x 320 bf16 token tile (4x the weight bytes) per 64 output columns, and its CTAs are
// mostly prologue (docs/perf-history/2026-12-06-moe-token-tile-crossover.md: 45,600 CTAs,
// DRAM at 45%, at V4.1-Flash TP8 M = 2048). Each row tile's K loop is the classic one
// (steps two at a time, one wgmma commit / wait per pair, the last odd step alone; the
// same dequant and wgmmas) and its epilogue is gemm2_epilogue, so y is bitwise the
// classic kernel's.
template <int R>
__global__ void __launch_bounds__(kThreads) moe_gemm2_resident_kernel(const MoeParams p) {
  using S = ResidentSmem;
  gemm_grid_dependencies<false>();
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = align_smem_1024(smem_raw);
  __shared__ uint64_t full[2];  // weight slot s
  const int tile = blockIdx.y;
  if (tile >= __ldcg(p.num_tiles)) return;
  init_ring(full);
  const int tid = threadIdx.x, warp = tid >> 5, g = (tid & 31) >> 2;
  const int KT = p.N / kTileK, RT = p.K / kTileRows, rt0 = blockIdx.x * R;
  const int e = __ldcg(p.tile_expert + tile);
  const int row0 = tile * 64;
  uint8_t* const sB = smem;
  // slot s at slot0 + s * slot_bytes (arithmetic, not an array: a runtime index into a
  // local array puts it on the stack)
  uint8_t* const slot0 = sB + KT * S::kB;
  const int slot_bytes = S::slot(KT);
  __nv_bfloat16* const stg = reinterpret_cast<__nv_bfloat16*>(slot0 + 2 * slot_bytes);

  // Row tile r's codes and scales into slot s: two bulk copies by thread 0.
  auto load_w = [&](int r, int s) {
    if (r >= R || tid != 0) return;
    const size_t first = (size_t(e) * RT + rt0 + r) * KT;
    uint8_t* d = slot0 + s * slot_bytes;
    mbar_arrive_expect_tx(full + s, KT * (kCodeTileBytes + kScaleTileBytes));
    bulk_g2s(smem_u32(d), p.w2 + first * kCodeTileBytes, KT * kCodeTileBytes, full + s);
    bulk_g2s(smem_u32(d + KT * kCodeTileBytes), p.w2_scale + first * kScaleTileBytes, KT * kScaleTileBytes,
             full + s);
  };
  load_w(0, 0);
  load_w(1, 1);
  gemm2_wait_h(p, tile);
  // The token tile, stored as gemm_segment stores it: row r of step q at q * kB + r * 128,
  // its 16-byte chunk c at (c ^ (r & 7)) << 4. Thread: chunk tid & 7 of rows
  // (tid >> 3) + 16 i.
  {
    const int c = tid & 7, r0 = tid >> 3;
    const __nv_bfloat16* src = p.h + size_t(row0 + r0) * p.N + c * 8;
    const uint32_t dst = smem_u32(sB) + r0 * 128 + ((c ^ (r0 & 7)) << 4);
#pragma unroll 1
    for (int q = 0; q < KT; ++q) {
#pragma unroll
      for (int i = 0; i < 4; ++i)
        cp_async_16_unordered(dst + q * S::kB + i * 16 * 128, src + size_t(16 * i) * p.N + q * kTileK, 0);
    }
    cp_async_commit();
    cp_async_wait<0>();
    fence_proxy_async_smem();  // written through the generic proxy, read by the wgmmas
    __syncthreads();
  }

  const uint64_t desc0 = wgmma_desc_sw128(smem_u32(sB), 16, 1024);
  auto cta_sync = [] { __syncthreads(); };
#pragma unroll 1
  for (int r = 0; r < R; ++r) {
    const int s = r & 1;
    uint8_t* const slot = slot0 + s * slot_bytes;
    const uint32_t sW_rd = smem_u32(slot) + tid * 16;
    const uint32_t sS_rd = smem_u32(slot + KT * kCodeTileBytes) + (warp * 8 + g) * 8;
    auto dequant_step = [&](int q, uint32_t(&af)[4][4]) {
      dequant_tile(lds_v4(sW_rd + q * kCodeTileBytes), lds_v2(sS_rd + q * kScaleTileBytes), af);
    };
    float acc[32];
#pragma unroll
    for (int i = 0; i < 32; ++i) acc[i] = 0.0f;
    auto mma_step = [&](int q, const uint32_t(&af)[4][4]) {
      const uint64_t desc = desc0 + uint32_t(q * (S::kB >> 4));
#pragma unroll
      for (int j = 0; j < 4; ++j) WgmmaRS<64>::mma(acc, af[j], desc + 2 * j, 1);
    };
    mbar_wait(full + s, (r >> 1) & 1);
    int q = 0;
#pragma unroll 1
    for (; q + 2 <= KT; q += 2) wgmma_step_group<2>(q, dequant_step, mma_step, acc);
    if (q < KT) wgmma_step_group<1>(q, dequant_step, mma_step, acc);
    // Every warp is done with slot s's weights (refilled below) and with the staging
    // reads of the previous row tile's epilogue (written again in this one).
    __syncthreads();
    load_w(r + 2, s);
    gemm2_epilogue<64>(p, acc, stg, e, row0, rt0 + r, tid, cta_sync);
  }
}

// Register caps of the split-K kernel at decode tiles: without them the unit loop's
// state pushed GEMM1 to ~83-121 registers (5 or fewer CTAs per SM instead of the
// classic kernel's 7). The caps are the tightest that ptxas meets without spills. They
// were set for the 8-step ring; the 16-step ring this grid runs now fits 4 CTAs per
// SM by shared memory (3 for 16-token tiles), so they are tighter than occupancy needs
// (kept as measured: the A/B that adopted the 16-step ring ran with them).
template <int BN, bool kGemm1>
constexpr int kSplitMinCtas = BN <= 8 ? (kGemm1 ? 6 : 7) : (BN <= 16 ? 6 : 1);

template <int BN, int STAGES, bool kGemm1>
__global__ void __launch_bounds__(kThreads, kSplitMinCtas<BN, kGemm1>) moe_gemm_splitk_kernel(const MoeParams p) {
  gemm_grid_dependencies<kGemm1>();
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = align_smem_1024(smem_raw);
  const int num_tiles = __ldcg(p.num_tiles);
  const int KT = gemm_k_steps<kGemm1>(p);
  const int RT = gemm_row_tiles<kGemm1>(p);
  const int items = num_tiles * RT;
  const int P = gridDim.x;
  const int splits = items >= P || items == 0 ? 1 : max(1, min(P / items, KT / kSplitMinSteps));
  const int units = items * splits;
  if (units == 0) return;
  __shared__ uint64_t full[GemmSmem<BN, STAGES>::kSlots];
  init_ring(full);
  int ring = 0;
  uint32_t phase = 0;
#pragma unroll 1
  for (int u = blockIdx.x; u < units; u += P) {
    // Opaque, so that per-thread addresses are recomputed per unit instead of being
    // hoisted out of the loop (and held through the epilogue).
    int tid = threadIdx.x;
    asm volatile("" : "+r"(tid));
    const int item = u / splits;
    const int chunk = u - item * splits;
    const int tile = item / RT;
    gemm_segment<BN, STAGES, kGemm1>(p, smem, full, ring, phase, tile, item - tile * RT, KT * chunk / splits,
                                     KT * (chunk + 1) / splits, item, splits, chunk, tid, [&] {
                                       if constexpr (!kGemm1) gemm2_wait_h(p, tile);
                                     });
    if (u + P < units) __syncthreads();  // the epilogue's staging smem is the next prologue's ring
  }
}

}  // namespace moe
}  // namespace dsv4
