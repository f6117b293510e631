// Sparse MQA attention forward for DeepSeek V4 on Hopper (sm_90a). Torch-free.
//
// Work item = one query token x 64 heads x one split of the token's 64-key tiles, taken in
// pairs: in round r, buffer 0 holds tile 2r and buffer 1 tile 2r + 1. CTAs are persistent
// (one per SM) and walk the items with a grid stride.
// 384 threads = 3 warpgroups:
//   WG0  producer: gathers the KV rows by slot id, each buffer as two halves (d < 256 and
//        d >= 256) with their own ready / free mbarriers, in the order the consumers need
//        them (0L, 1R, 0R, 1L). fp8_ds_mla rows are dequantized to bf16 with their UE8M0
//        power-of-two scales (exact); bf16 rows go by cp.async, the producer never waits for
//        them. Skipped entries become zero rows and a cleared bit of the buffer's mask.
//        The next round's fp8 rows are prefetched into L2 (bf16 rows only under
//        DSV4_ATTN_ROW_PREFETCH=1).
//   WG1, WG2  consumers c = 0, 1 ("seesaw"): consumer c computes S_c = Q K_c^T of buffer c
//        over the full d, runs the online softmax for that tile and owns half the output,
//        O[:, 256c : 256c + 256] += P_c V_c (P from registers) + P_other V_other (P from
//        smem). The running max goes 0 -> 1 through smem within a round and back, so both
//        end the round at the same max; 0 rescales its P before handing it over. While one
//        consumer does its softmax the other's GEMMs keep the tensor cores busy, and every
//        exponential is computed once.
// smem tile layout (Q, KV buffers): 8 column blocks of 64 d (8 KB each), each block 64 rows
// x 128 B with the 128-byte swizzle (16-byte chunk j of row r at j ^ (r % 8)); the P
// tiles are one such block (64 heads x 64 keys).
//
// Files by role: sparse_mqa_layout.cuh (thread counts, smem offsets, barrier ids, register
// budgets), sparse_mqa_schedule.cuh (token tiles, work items, index -> slot),
// sparse_mqa_producer.cuh (paged sources, row offsets, fp8 / bf16 loaders),
// sparse_mqa_first_round.cuh (round 0 of a CTA's first item by all warpgroups),
// sparse_mqa_softmax.cuh (the consumers' softmax arithmetic on S / P / O fragments, shared
// with the ring32 kernel), sparse_mqa_item.cuh (a consumer's start and end of a work item:
// sinks, state reset, row sums, output; shared too), sparse_mqa_combine.cuh (split-KV
// merge); the kernel and its consumers are here.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "attention/sparse_mqa_combine.cuh"
#include "attention/sparse_mqa_item.cuh"
#include "attention/sparse_mqa_first_round.cuh"
#include "attention/sparse_mqa_layout.cuh"
#include "attention/sparse_mqa_params.cuh"
#include "attention/sparse_mqa_producer.cuh"
#include "attention/sparse_mqa_schedule.cuh"
#include "attention/sparse_mqa_softmax.cuh"
#include "common/cvt.cuh"
#include "common/mma/mma_sync.cuh"
#include "common/mma/wgmma.cuh"
#include "common/ptx/math.cuh"
#include "common/ptx/memory.cuh"
#include "common/ptx/pdl.cuh"
#include "common/ptx/regs.cuh"
#include "common/ptx/sync.cuh"

namespace dsv4 {
namespace attention {

// A round's exponentials are taken against a reference max that only moves when a tile's
// max exceeds it by more than this (log2 units): P <= 2^8 stays exact enough in bf16 and the
// fp32 sums, and the O rescale (128 FMUL per thread) is skipped in most rounds
// (conditional rescaling, as in FlashAttention-4).
constexpr float kMaxSlack = 8.f;

// Q [64 heads x 512] of a work item -> smem (swizzled), by the consumer threads (128..383)
// only, so that the producer's gathers overlap it; cp.async keeps all 16 chunks per thread
// in flight at once. Waited for (cp_async_wait_all + kBarQ) when the item starts.
// Thread ct takes elements d .. d + 7, d = 8 (ct % 64), of heads r0 + 4k, r0 = ct / 64 < 4,
// k < 16: head r0 + 4k sits at tile_offset(r0 + 4 (k % 2), d) + 1024 (k / 2), so two
// swizzled offsets and one pointer step serve all 16 copies (about 4 instructions each; a
// tile_offset and a 64-bit multiply per copy were ~20, fetched cold on the first item).
__device__ __forceinline__ void load_q_tile(const SparseMqaParams& p, const WorkItem& wi, uint8_t* smem) {
  static_assert(kHeadsPerCta == 64 && kHeadDim == 512, "16 copies of 16 bytes per consumer thread");
  const int ct = threadIdx.x - 128;
  const int r0 = ct >> 6, d = (ct & 63) * 8;
  const uint16_t* src = p.q + wi.b * p.q_stride_b + wi.i * p.q_stride_q +
                        (static_cast<int64_t>(wi.hb) * kHeadsPerCta + r0) * p.q_stride_h + d;
  const int64_t step = 4 * p.q_stride_h;
  const uint32_t s0 = smem_u32(smem + kOffQ) + tile_offset(r0, d), s1 = smem_u32(smem + kOffQ) + tile_offset(r0 + 4, d);
#pragma unroll
  for (int k = 0; k < 16; ++k) cp_async_16(((k & 1) ? s1 : s0) + (k >> 1) * 1024, src + k * step);
}

// kNumSrc: 1 for calls with one source (SWA layers, prefill), 2 for any call
// (sparse_mqa_schedule.cuh, token_tiles). kCoopWgs (fp8 only): round 0 of the CTA's first
// item is gathered cooperatively (sparse_mqa_first_round.cuh, DSV4_ATTN_COOP_ROUND) by all
// three warpgroups (3) or by the two consumer warpgroups while the producer starts on round 1
// (2, DSV4_ATTN_PRODUCER_AHEAD); 0: the producer fills every round.
// kPair (fp8, 128 heads, no cooperative round; DSV4_ATTN_CROSSOVER): launched in clusters of
// two CTAs, the two head blocks of each (token, split): with an even grid stride, CTA x
// always takes head block x % 2 = its cluster rank, and both walk the same (token, split)
// sequence (work_item). Each producer dequantizes half the rows of every tile into both CTAs
// (load_half_fp8_pair), so a tile's gather is paid once, not twice: a half is ready when
// the local producer's rows are (ready) and the peer's st.async bytes have landed
// (ready_remote); masks count both producers (mask_ready), frees both CTAs' consumers
// (freed); no CTA starts before its peer's barriers exist or leaves while its peer may
// still store or arrive into it.
template <bool kFp8, int kNumSrc, int kCoopWgs, bool kPair = false>
__global__ void __launch_bounds__(kThreads, 1) sparse_mqa_fwd_kernel(const __grid_constant__ SparseMqaParams p) {
  static_assert(kCoopWgs == 0 || kCoopWgs == 2 || kCoopWgs == 3, "no, two or three warpgroups");
  static_assert(kFp8 || kCoopWgs == 0, "the cooperative first round gathers fp8_ds_mla rows");
  static_assert(!kPair || (kFp8 && kCoopWgs == 0), "the crossover: fp8_ds_mla rows, the producer's rounds only");
  constexpr bool kCoop = kCoopWgs > 0;
  extern __shared__ uint8_t smem_raw[];
  // By pointer arithmetic (align_smem_1024), so that the compiler sees shared memory: the
  // maxima, sums, masks and P tiles go by LDS / STS, not by generic LD / ST through the
  // 64-bit address window (docs/perf-history/2026-12-04-attention-racecheck.md).
  uint8_t* smem = align_smem_1024(smem_raw);
  uint64_t* ready = reinterpret_cast<uint64_t*>(smem + kOffBar);  // [2 * buf + half]
  uint64_t* freed = ready + 4;
  uint64_t* mask_ready = ready + 8;                               // [buf]
  uint16_t* mask16 = reinterpret_cast<uint16_t*>(smem + kOffMask);  // [buf][producer warp]

  if (threadIdx.x == 0) {
    for (int k = 0; k < 4; ++k) mbar_init(&ready[k], 128);
    for (int k = 4; k < 8; ++k) mbar_init(&ready[k], kPair ? 256 : 128);
    mbar_init(&mask_ready[0], kPair ? 8 : 4);
    mbar_init(&mask_ready[1], kPair ? 8 : 4);
    if (kPair) {
      for (int k = 0; k < 4; ++k) mbar_init(&ready[kBarReadyRemote + k], 1);  // the peer's expect_tx
    }
    mbar_init_fence();
  }
  if (kPair) {
    cluster_sync();  // the peer's barriers are initialized before any arrival on them
  } else {
    __syncthreads();
  }

  // Persistent CTAs (one per SM) walk the work items with a grid stride. Producer and
  // consumers visit the same items, and the ring's barrier phases count rounds over all of
  // them, so the producer fills the next item's first round while the consumers finish the
  // current one, and the next item's Q loads during the current item's output stores.
  // The grid is at most the item count (sparse_mqa.cu), so every CTA has a first item.
  // Programmatic dependent launch (sparse_mqa.cu, DSV4_ATTN_MAIN_PDL): up to here the CTA
  // has read only its parameters and written only shared memory, so this ran while the
  // kernel before it drained. q, the indices, the lengths, the caches and the sink may be
  // that kernel's outputs, and the output buffers its inputs: every global access comes
  // after the wait (a no-op without the launch attribute). The work items are decoded
  // per item below, not once up here: a decoded item carried through the loop costs
  // registers that the consumers do not have (it spilled), and from `item` the compiler
  // recomputes it where the epilogue needs it.
  pdl_wait();
  const int wg = threadIdx.x >> 7;
  // (wg broadcast from lane 0: a branch the compiler sees as warp-uniform; on wg itself it moved
  // the consumers' item decode out of the uniform datapath, and knowing that every consumer
  // thread ran the block, carried its decoded item into their loop: both spilled at 208.)
  const int wg_coop = __shfl_sync(0xffffffffu, wg, 0);
  if (kCoopWgs == 3 || (kCoopWgs == 2 && wg_coop > 0)) {
    // The first item's round 0 by every thread (kCoopWgs = 2: every consumer thread); the
    // consumer threads issue its Q's copies right after their row loads (both fly together,
    // and the row loads, the longer chain, do not wait for Q's code). The role loops decode
    // the item again (per item, see above).
    const WorkItem wi = work_item(p, blockIdx.x);
    const TokenTiles tt = token_tiles<kNumSrc>(p, wi.b, wi.split);
    const auto q_copies = [&] {
      if (wg > 0) load_q_tile(p, wi, smem);
    };
    if (tt.t1 > tt.t0) {
      first_round_fp8<kNumSrc, kCoopWgs == 2 ? 2 : 3>(p, tt, wi.b, wi.i, smem, q_copies);
    } else {
      q_copies();
    }
  }
  if (wg == 0) {
    setmaxnreg_dec<kProducerRegs>();
    // Counted in each role, after its setmaxnreg: counted once above and held across the
    // first round and the register reallocation, it was spilled.
    const int num_items = num_work_items(p);
    int round_base = 0;
    for (int item = blockIdx.x; item < num_items; item += gridDim.x) {
      const WorkItem wi = work_item(p, item);
      const TokenTiles tt = token_tiles<kNumSrc>(p, wi.b, wi.split);
      if (kFp8) {
        // After a cooperative first round the producer starts at round 1: the same loop over
        // the item's tiles from t0 + 2, its barrier phases one round on (a select, not a
        // second inlined loop nor a flag inside it: at 88 registers either spilled).
        const bool skip = kCoop && item == static_cast<int>(blockIdx.x);
        TokenTiles from = tt;
        from.t0 += skip ? 2 : 0;
        producer_loop_fp8<kNumSrc, kPair>(p, from, wi.b, wi.i, smem, round_base + (skip ? 1 : 0));
      } else {
        producer_loop_bf16<kNumSrc>(p, tt, wi.b, wi.i, smem, round_base);
      }
      round_base += token_rounds(tt);
    }
    if (kPair) cluster_sync();  // see the kernel's end
    return;
  }
  setmaxnreg_inc<kConsumerRegs>();
  const int num_items = num_work_items(p);

  // This consumer's buffer (S, softmax) and O half. Broadcast from lane 0 so the compiler
  // sees a warp-uniform value: wgmma under a branch it thinks divergent gets serialized.
  const int g = __shfl_sync(0xffffffffu, wg - 1, 0);
  const int t = threadIdx.x & 127;
  const int w = t >> 5, lane = t & 31, quad = lane & 3;
  const int r0 = 16 * w + (lane >> 2);  // this thread's accumulator rows: r0 and r0 + 8

  const uint32_t q_base = smem_u32(smem + kOffQ);
  const uint32_t kv_mine = smem_u32(smem + kOffKV + g * kBufBytes);
  const uint32_t kv_other = smem_u32(smem + kOffKV + (1 - g) * kBufBytes);
  uint8_t* p_mine = smem + kOffP + g * kPBytes;
  const uint32_t p_other = smem_u32(smem + kOffP + (1 - g) * kPBytes);
  float* smax_fw = reinterpret_cast<float*>(smem + kOffMax);            // [parity][64]: 0 -> 1
  float* smax_bw = reinterpret_cast<float*>(smem + kOffMax + 2 * 64 * 4);  // [parity][64]: 1 -> 0
  // Buffer halves: consumer 0 starts on the left (d < 256) half, consumer 1 on the right.
  const int first = g, second = 1 - g;  // half indices in load order for this consumer
  uint64_t* ready_first = &ready[2 * g + first];
  uint64_t* ready_second = &ready[2 * g + second];
  // A half read by this consumer's wgmmas is free again; kPair: for the peer's producer too,
  // which stores into this CTA's buffers (freed counts both CTAs' consumers: 128 local
  // arrivals, and one of 32 per peer warp once the warp's reads retired).
  const uint32_t peer_off = kPair ? mapa_u32(smem_u32(smem), (blockIdx.x & 1) ^ 1) - smem_u32(smem) : 0;
  const auto release_half = [&](int hb) {
    mbar_arrive(&freed[hb]);
    if (kPair) {
      __syncwarp();
      if ((threadIdx.x & 31) == 0) mbar_arrive_remote_count(smem_u32(&freed[hb]) + peer_off, 32);
    }
  };
  // A half is ready when the local producer's rows are (ready) and, kPair, the peer's
  // st.async bytes have landed (ready_remote, the same index + kBarReadyRemote).
  const auto wait_ready = [&](uint64_t* bar, uint32_t phase) {
    mbar_wait(bar, phase);
    if (kPair) mbar_wait(bar + kBarReadyRemote, phase);
  };
  // The crossover's peer rows came by st.async: the consumer's proxy fence after its wait,
  // as for the bf16 rows' cp.async (the producer fenced its local stores).
  constexpr bool kFenceAfterWait = !kFp8 || kPair;

  float o[128];
  float m0, m1;  // running max (log2 domain) of rows r0, r0 + 8
  float l0, l1;  // this thread's share of the row sums of its own P
  float s[32];                           // S, then P, of this consumer's tile
  uint32_t pa[16];                       // bf16 P as the A operand of the local PV

  // S = Q K^T over the d columns of one half (4 blocks x 4 k-steps of 16).
  auto issue_s_half = [&](int half, bool zero) {
    uint64_t dq = wgmma_desc_sw128(q_base + 4 * half * 8192, 16, 1024);
    uint64_t dk = wgmma_desc_sw128(kv_mine + 4 * half * 8192, 16, 1024);
    // Descriptors advance by adding (byte offset >> 4); the opaque copies keep the compiler
    // from hoisting 32 precomputed descriptors into registers.
    asm volatile("" : "+l"(dq));
    asm volatile("" : "+l"(dk));
#pragma unroll
    for (int kk = 0; kk < 16; ++kk) {
      const uint32_t off = ((kk >> 2) * 8192 + (kk & 3) * 32) >> 4;
      WgmmaSS<64>::mma(s, dq + off, dk + off, (zero && kk == 0) ? 0 : 1);
    }
  };
  // Both halves of this round's S; the second half's wait overlaps the first half's GEMMs.
  auto compute_s = [&](uint32_t phase) {
    fence_regs(s);
    wait_ready(ready_first, phase);
    if (kFenceAfterWait) fence_proxy_async_smem();  // cp.async (generic proxy) writes -> wgmma reads
    wgmma_fence();
    issue_s_half(first, true);
    wgmma_commit();
    wait_ready(ready_second, phase);
    if (kFenceAfterWait) fence_proxy_async_smem();
    issue_s_half(second, false);
    wgmma_commit();
  };
  // O[:, my half] += P V, P [64 x 64 keys] from registers, V = one half of a buffer;
  // scale_d = 0: O = P V (the item's first PV sets O, see `fresh` below).
  auto pv_regs = [&](uint32_t kv, int scale_d) {
    fence_regs(o);
    fence_regs(pa);
    wgmma_fence();
    uint64_t dv = wgmma_desc_sw128(kv + 4 * g * 8192, 8192, 1024);
    asm volatile("" : "+l"(dv));
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) WgmmaRS<256, true>::mma(o, &pa[4 * kk], dv + ((kk * 2048) >> 4), kk ? 1 : scale_d);
    wgmma_commit();
  };
  // Same with P from smem (the other consumer's tile).
  auto pv_smem = [&](uint32_t p_tile, uint32_t kv) {
    fence_regs(o);
    wgmma_fence();
    uint64_t dv = wgmma_desc_sw128(kv + 4 * g * 8192, 8192, 1024);
    uint64_t dp = wgmma_desc_sw128(p_tile, 16, 1024);
    asm volatile("" : "+l"(dv));
    asm volatile("" : "+l"(dp));
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) WgmmaSS<256, true>::mma(o, dp + ((kk * 32) >> 4), dv + ((kk * 2048) >> 4), 1);
    wgmma_commit();
  };
  // S with skipped keys at -inf (unscaled: softmax applies the scale in the FFMA of its
  // exponent); returns the row maxima of the tile as scaled log2 logits, max(S) * scale being
  // max(S * scale) exactly (scale > 0, and rounding keeps order).
  // Thread holds rows r0, r0 + 8 and keys 8j + 2*quad + {0, 1}, j = 0..7.
  auto mask_and_max = [&](uint32_t phase, float& mx0, float& mx1) {
    ring_wait<kPair>(&mask_ready[g], phase);
    const uint64_t valid = *reinterpret_cast<const volatile uint64_t*>(mask16 + 4 * g);
    // A tile with every key valid (all but the last of most tokens) skips the per-key
    // select (~64 instructions per thread); the branch is uniform (one mask per tile).
    if (valid != ~uint64_t(0)) mask_skipped_keys(s, valid, quad);
    row_max_scaled(s, p.scale_log2, mx0, mx1);
  };
  // The online softmax (sparse_mqa_softmax.cuh), the rescale of O alone (the seesaw's
  // correction), P packed as the local PV's A operand and stored as the other's.
  // fresh: the item's round 0 with O set by its first PV: O holds nothing of this item, so
  // no rescale.
  auto rescale_o = [&](float f0, float f1) { rescale_rows(o, f0, f1); };
  auto softmax = [&](float mn0, float mn1, bool fresh) {
    online_softmax(s, o, m0, m1, l0, l1, mn0, mn1, p.scale_log2, fresh);
  };
  auto pack_p = [&](float c0, float c1) { pack_p_frag(pa, s, c0, c1); };
  const int st_i = lane >> 3, st_r = lane & 7;
  const uint32_t st_row = smem_u32(p_mine) + (16 * w + st_r + 8 * (st_i & 1)) * 128;
  auto store_p = [&]() { store_p_frag(st_row, st_i, st_r, pa); };

  if (!kCoop && blockIdx.x < num_items) load_q_tile(p, work_item(p, blockIdx.x), smem);
  int round_base = 0;  // rounds of the CTA's earlier items: the barrier phases continue
  for (int item = blockIdx.x; item < num_items; item += gridDim.x) {
    const WorkItem wi = work_item(p, item);
    const int rounds = token_rounds(token_tiles<kNumSrc>(p, wi.b, wi.split));
    const int h0 = wi.hb * kHeadsPerCta + r0, h1 = h0 + 8;
    float sink0, sink1;
    start_item(p, rounds, h0, h1, o, m0, m1, l0, l1, sink0, sink1);
    cp_async_wait_all();
    fence_proxy_async_smem();
    named_bar_sync(kBarQ, 256);

    if (g == 0) {
      if (rounds > 0) {
        compute_s(round_base & 1);
        wgmma_wait<0>();
      }
      for (int r = 0; r < rounds; ++r) {
        const uint32_t ph = (round_base + r) & 1;
        fence_regs(s);
        float mx0, mx1;
        mask_and_max(ph, mx0, mx1);
        const float mn0 = fmaxf(m0, mx0), mn1 = fmaxf(m1, mx1);
        if (quad == 0) {
          smax_fw[64 * ph + r0] = mn0;
          smax_fw[64 * ph + r0 + 8] = mn1;
        }
        named_bar_arrive(kBarMax0, 256);
        // Own reference: the running max unless this tile exceeds it by more than the slack
        // (consumer 1 then moves the round's max at least as far, so c0, c1 below are <= 1).
        const float t0 = mx0 > m0 + kMaxSlack ? mn0 : m0, t1 = mx1 > m1 + kMaxSlack ? mn1 : m1;
        const bool fresh = r == 0 && p.first_pv_init;
        softmax(t0, t1, fresh);
        pack_p(1.f, 1.f);
        pv_regs(kv_mine, fresh ? 0 : 1);  // O_left (+)= P_0 V_0,left
        wgmma_wait<0>();
        fence_regs(o);
        release_half(0);

        // The round's max (consumer 1's): rescale P_0 for consumer 1, and O and the sums.
        named_bar_sync(kBarMax1, 256);
        const float mf0 = smax_bw[64 * ph + r0], mf1 = smax_bw[64 * ph + r0 + 8];
        const float c0 = ex2_approx_ftz(t0 - (mf0 == -INFINITY ? 0.f : mf0));
        const float c1 = ex2_approx_ftz(t1 - (mf1 == -INFINITY ? 0.f : mf1));
        m0 = mf0;
        m1 = mf1;
        l0 *= c0;
        l1 *= c1;
        if (!__all_sync(0xffffffffu, c0 == 1.f && c1 == 1.f)) pack_p(c0, c1);  // else pa holds P_0 already
        store_p();
        named_bar_arrive(kBarP0, 256);
        rescale_o(c0, c1);
        named_bar_sync(kBarP1, 256);
        pv_smem(p_other, kv_other);  // O_left += P_1 V_1,left
        if (r + 1 < rounds) {
          // Next S behind the PV: its left half as soon as it lands, then release buffer 1's
          // left half once the PV that reads it is done.
          fence_regs(s);
          wait_ready(ready_first, ph ^ 1);
          if (kFenceAfterWait) fence_proxy_async_smem();
          wgmma_fence();
          issue_s_half(first, true);
          wgmma_commit();
          wgmma_wait<1>();
          release_half(2);
          wait_ready(ready_second, ph ^ 1);
          if (kFenceAfterWait) fence_proxy_async_smem();
          issue_s_half(second, false);
          wgmma_commit();
          wgmma_wait<0>();
        } else {
          wgmma_wait<0>();
          release_half(2);
        }
        fence_regs(o);
      }
    } else {
      for (int r = 0; r < rounds; ++r) {
        const uint32_t ph = (round_base + r) & 1;
        compute_s(ph);
        wgmma_wait<0>();
        fence_regs(s);
        float mx0, mx1;
        mask_and_max(ph, mx0, mx1);
        named_bar_sync(kBarMax0, 256);
        // The round's max so far, and its reference: the running max unless a tile of this
        // round exceeds it by more than the slack.
        const float mn0 = fmaxf(smax_fw[64 * ph + r0], mx0), mn1 = fmaxf(smax_fw[64 * ph + r0 + 8], mx1);
        const float t0 = mn0 > m0 + kMaxSlack ? mn0 : m0, t1 = mn1 > m1 + kMaxSlack ? mn1 : m1;
        // The hand-off to consumer 0, which compute-sanitizer racecheck reports as a RAW hazard
        // (this store against consumer 0's load after its named_bar_sync(kBarMax1)). It is
        // ordered: the store precedes this thread's bar.arrive, and "a bar.arrive operation
        // synchronizes with a bar.sync operation executed on the same barrier" (PTX ISA,
        // memory consistency model, synchronizes-with), which consumer 0 executes before its
        // load; the barrier completes only with these 128 arrivals. The slot's previous reader
        // (consumer 0, two rounds earlier: the buffers alternate by round parity) loaded it
        // before its bar.arrive(kBarP0), which this consumer's bar.sync(kBarP0) of that round
        // waited for. racecheck reports the same hand-off alone (scripts/racecheck_named_barrier.cu,
        // its plain variant included): the tool does not model bar.arrive as a release, so the
        // report is its limit, not a race (docs/perf-history/2026-12-04-attention-racecheck.md).
        if (quad == 0) {
          smax_bw[64 * ph + r0] = t0;
          smax_bw[64 * ph + r0 + 8] = t1;
        }
        named_bar_arrive(kBarMax1, 256);
        const bool fresh = r == 0 && p.first_pv_init;
        softmax(t0, t1, fresh);
        pack_p(1.f, 1.f);
        pv_regs(kv_mine, fresh ? 0 : 1);  // O_right (+)= P_1 V_1,right
        store_p();
        named_bar_arrive(kBarP1, 256);
        named_bar_sync(kBarP0, 256);
        pv_smem(p_other, kv_other);  // O_right += P_0 V_0,right
        wgmma_wait<1>();
        release_half(3);
        wgmma_wait<0>();
        fence_regs(o);
        release_half(1);
      }
    }

    reduce_row_sums(l0, l1, smem, g, r0, quad);
    // Both consumers are past their last S of this item, so Q's smem is free: the next item's
    // Q loads while this one's output is stored.
    if (item + static_cast<int>(gridDim.x) < num_items) load_q_tile(p, work_item(p, item + gridDim.x), smem);

    // ---- epilogue ----
    // The CTA's last item: let the combine (launched with programmatic stream serialization
    // when the call splits) get its CTAs scheduled and run its prologue during these stores.
    if (item + static_cast<int>(gridDim.x) >= num_items) pdl_launch_dependents();
    store_item_output(p, wi, o, l0, l1, m0, m1, sink0, sink1, h0, h1, g, quad);
    round_base += rounds;
  }  // work items
  // kPair: no CTA leaves while its peer's consumers may still arrive on its freed barriers
  // (their last rounds' frees, which no producer waits for).
  if (kPair) cluster_sync();
}

}  // namespace attention
}  // namespace dsv4
