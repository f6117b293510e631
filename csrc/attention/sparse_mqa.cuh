// Sparse MQA attention forward for DeepSeek V4 on Hopper (sm_90a). Torch-free.
//
// One CTA = one query token x 64 heads x one split of the token's key tiles.
// 384 threads = 3 warpgroups:
//   WG0  producer: gathers 64 KV rows per tile by slot id into a 2-stage smem ring
//        (fp8_ds_mla -> bf16 dequant with the UE8M0 power-of-two scales, exact; or a
//        plain bf16 copy), zero rows for skipped entries, a 64-bit validity mask per
//        tile, mbarrier handshake; prefetches the next tile's rows into L2.
//   WG1, WG2  consumers: WG1+g computes the partial S = Q K^T over d in [256g, 256g+256)
//        (wgmma m64n64k16, Q and K from smem), the two partials are summed through smem
//        (both consumers then hold the identical S), both run the same online softmax,
//        and WG1+g accumulates O[:, 256g : 256g+256] = P V (wgmma m64n256k16, P from
//        registers, V = the same smem tile read MN-major). The consumers also load Q
//        (cp.async), so the producer's first gather overlaps it.
// kKeySplit (flag 8, measured slower, docs/perf.md v1) splits S by keys instead: 32 keys per
// consumer over the full d, only row maxima and bf16 P halves cross warpgroups.
// The smem tile layout (Q and KV alike): 8 column blocks of 64 d (8 KB each), each block
// 64 rows x 128 B with the 128-byte swizzle (16-byte chunk j of row r at j ^ (r % 8)).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>

#include "attention/sm90_utils.cuh"
#include "attention/sparse_mqa_params.cuh"

namespace dsv4 {
namespace attention {

constexpr int kThreads = 384;
constexpr int kQBytes = kHeadsPerCta * kHeadDim * 2;  // 64 KB
constexpr int kStageBytes = kTileKeys * kHeadDim * 2;  // 64 KB
constexpr int kStages = 2;
constexpr int kSxBytes = 64 * 64 * 4;                   // one fp32 partial S
constexpr int kOffQ = 0;
constexpr int kOffKV = kOffQ + kQBytes;
constexpr int kOffSx = kOffKV + kStages * kStageBytes;
// Key-split consumers use the same region for the shared bf16 P tile and the row-max buffer.
constexpr int kOffP = kOffSx;
constexpr int kOffRed = kOffP + kHeadsPerCta * kTileKeys * 2;
constexpr int kOffBar = kOffSx + 2 * kSxBytes;
constexpr int kOffMask = kOffBar + 4 * 8;
constexpr int kSmemBytes = kOffMask + kStages * 8 + 1024;  // + alignment slack

constexpr int kProducerRegs = 72;
constexpr int kConsumerRegs = 216;

constexpr uint32_t kFp8RowBytes = 576;   // 448 fp8 + 64 bf16
constexpr uint32_t kBf16RowBytes = 1024;

// Byte offset inside a swizzled [64 rows x 512] bf16 tile of the 16-byte chunk that
// holds elements d .. d+7 of row r (d a multiple of 8).
__device__ __forceinline__ uint32_t tile_offset(int r, int d) {
  const int c = d >> 6, j = (d >> 3) & 7;
  return c * 8192 + (r >> 3) * 1024 + (r & 7) * 128 + ((j ^ (r & 7)) << 4);
}

__device__ __forceinline__ uint32_t pack_bf16(float a, float b) {
  __nv_bfloat162 v = __floats2bfloat162_rn(a, b);
  return *reinterpret_cast<uint32_t*>(&v);
}

// 4 fp8 e4m3 (one 32-bit word) * scale -> 2 words of bf16x2 (exact for UE8M0 scales).
__device__ __forceinline__ void fp8x4_to_bf16x4(uint32_t w, float sc, uint32_t& lo, uint32_t& hi) {
  __half2_raw h0 = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(w & 0xFFFF), __NV_E4M3);
  __half2_raw h1 = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(w >> 16), __NV_E4M3);
  float2 f0 = __half22float2(*reinterpret_cast<__half2*>(&h0));
  float2 f1 = __half22float2(*reinterpret_cast<__half2*>(&h1));
  lo = pack_bf16(f0.x * sc, f0.y * sc);
  hi = pack_bf16(f1.x * sc, f1.y * sc);
}

// 4 fp8 e4m3 (one word) -> 2 words of bf16x2 by moving bit fields: byte s.eeee.mmm becomes
// bf16 s.0000eeee.mmm0000, whose value is the e4m3 value * 2^-120 for normal and subnormal
// codes alike (both formats are subnormal at exponent field 0). No conversion instructions;
// the e4m3 NaN codes (0x7F, 0xFF) come out as finite numbers (the cache writer never stores them).
__device__ __forceinline__ void fp8x4_to_bf16x4_bits(uint32_t w, uint32_t& lo, uint32_t& hi) {
  const uint32_t sg = w & 0x80808080u, mg = w & 0x7F7F7F7Fu;
  lo = (__byte_perm(mg, 0, 0x4140) << 4) + __byte_perm(sg, 0, 0x1404);
  hi = (__byte_perm(mg, 0, 0x4342) << 4) + __byte_perm(sg, 0, 0x3424);
}

// 16 fp8 values of one row (one 64-column scale block) times the block's UE8M0 scale
// 2^(e-127) -> 16 bf16. Exact: a power-of-two scale only moves the exponent (results that
// leave the bf16 range round or overflow like the float32 reference rounded to bf16).
template <bool kBits>
__device__ __forceinline__ void dequant_fp8x16(const uint4& v, uint32_t e, uint4& o0, uint4& o1) {
  if (kBits) {
    // Two bf16 products, both exact: * 2^120 undoes the bit move, * 2^(e-127) is the scale
    // (e = 0: the bf16 subnormal 2^-127; e = 255: inf, as in the float path below).
    constexpr uint32_t k2p120 = 0x7B807B80u;
    const uint32_t sb = e == 0 ? 0x00400040u : (e << 7) * 0x10001u;
    fp8x4_to_bf16x4_bits(v.x, o0.x, o0.y);
    fp8x4_to_bf16x4_bits(v.y, o0.z, o0.w);
    fp8x4_to_bf16x4_bits(v.z, o1.x, o1.y);
    fp8x4_to_bf16x4_bits(v.w, o1.z, o1.w);
    o0.x = mul_bf16x2(mul_bf16x2(o0.x, k2p120), sb);
    o0.y = mul_bf16x2(mul_bf16x2(o0.y, k2p120), sb);
    o0.z = mul_bf16x2(mul_bf16x2(o0.z, k2p120), sb);
    o0.w = mul_bf16x2(mul_bf16x2(o0.w, k2p120), sb);
    o1.x = mul_bf16x2(mul_bf16x2(o1.x, k2p120), sb);
    o1.y = mul_bf16x2(mul_bf16x2(o1.y, k2p120), sb);
    o1.z = mul_bf16x2(mul_bf16x2(o1.z, k2p120), sb);
    o1.w = mul_bf16x2(mul_bf16x2(o1.w, k2p120), sb);
  } else {
    // 2^(e-127) as fp32: e = 0 is the subnormal 2^-127, e = 255 gives inf.
    const float sc = e == 0 ? __int_as_float(0x00400000) : __int_as_float(static_cast<int>(e << 23));
    fp8x4_to_bf16x4(v.x, sc, o0.x, o0.y);
    fp8x4_to_bf16x4(v.y, sc, o0.z, o0.w);
    fp8x4_to_bf16x4(v.z, sc, o1.x, o1.y);
    fp8x4_to_bf16x4(v.w, sc, o1.z, o1.w);
  }
}

template <bool kBits>
__device__ __forceinline__ void dequant_store_fp8x16(uint8_t* tile_smem, int row, int col, const uint4& v, uint32_t e) {
  uint4 o0, o1;
  dequant_fp8x16<kBits>(v, e, o0, o1);
  *reinterpret_cast<uint4*>(tile_smem + tile_offset(row, col)) = o0;
  *reinterpret_cast<uint4*>(tile_smem + tile_offset(row, col + 8)) = o1;
}

// Per-token geometry shared by all threads of the CTA.
struct TokenTiles {
  int len[2];    // valid prefix of each list
  int ntile[2];  // tiles of each list
  int t0, t1;    // this split's tile range [t0, t1) over the concatenated lists
};

__device__ __forceinline__ TokenTiles token_tiles(const SparseMqaParams& p, int b, int split) {
  TokenTiles tt;
#pragma unroll
  for (int k = 0; k < 2; ++k) {
    int len = 0;
    if (k < p.num_src) {
      len = p.src[k].topk;
      if (p.src[k].lengths != nullptr) {
        const int l = p.src[k].lengths[b];
        len = l < 0 ? 0 : (l < len ? l : len);
      }
    }
    tt.len[k] = len;
    tt.ntile[k] = (len + kTileKeys - 1) / kTileKeys;
  }
  const int n = tt.ntile[0] + tt.ntile[1];
  tt.t0 = static_cast<int>((static_cast<int64_t>(n) * split) / p.num_splits);
  tt.t1 = static_cast<int>((static_cast<int64_t>(n) * (split + 1)) / p.num_splits);
  return tt;
}

// Slot of row `row` of concatenated tile `tile`, or -1 when that entry is skipped.
__device__ __forceinline__ int tile_slot(const SparseMqaParams& p, const TokenTiles& tt, int b, int i, int tile,
                                         int row, int& list) {
  list = tile < tt.ntile[0] ? 0 : 1;
  const bool l0 = list == 0;
  const int pos = (l0 ? tile : tile - tt.ntile[0]) * kTileKeys + row;
  if (pos >= (l0 ? tt.len[0] : tt.len[1])) return -1;
  const int32_t* idx = l0 ? p.src[0].indices : p.src[1].indices;
  const int64_t sb = l0 ? p.src[0].idx_stride_b : p.src[1].idx_stride_b;
  const int64_t sq = l0 ? p.src[0].idx_stride_q : p.src[1].idx_stride_q;
  const int64_t ns = l0 ? p.src[0].num_slots : p.src[1].num_slots;
  const int v = idx[b * sb + i * sq + pos];
  return (v >= 0 && static_cast<int64_t>(v) < ns) ? v : -1;
}

template <bool kFp8>
__device__ __forceinline__ void producer_loop(const SparseMqaParams& p, const TokenTiles& tt, int b, int i,
                                              uint8_t* smem, uint64_t* full, uint64_t* empty, uint16_t* mask16) {
  const int warp = (threadIdx.x >> 5) & 3;
  const int lane = threadIdx.x & 31;
  const int row_lane = warp * 16 + (lane & 15);  // the row whose slot this lane resolves
  constexpr uint32_t kRowBytes = kFp8RowBytes;

  const bool bits = (p.flags & kFlagFp8BitDequant) != 0;
  int list_next = 0;
  int slot_next = (tt.t0 < tt.t1 && lane < 16) ? tile_slot(p, tt, b, i, tt.t0, row_lane, list_next) : -1;

  for (int tile = tt.t0; tile < tt.t1; ++tile) {
    const int it = tile - tt.t0;
    const int stage = it & 1;
    const int slot = slot_next;
    const int list = list_next;
    // Next tile: resolve its slots now and start pulling its rows into L2.
    slot_next = -1;
    if (tile + 1 < tt.t1 && lane < 16) slot_next = tile_slot(p, tt, b, i, tile + 1, row_lane, list_next);
    if (slot_next >= 0) {
      const bool l0 = list_next == 0;
      const int bsz = l0 ? p.src[0].block_size : p.src[1].block_size;
      const uint8_t* blk = (l0 ? p.src[0].base : p.src[1].base) +
                           static_cast<int64_t>(slot_next / bsz) * (l0 ? p.src[0].block_stride : p.src[1].block_stride);
      const int off = slot_next % bsz;
      if (kFp8) {
        prefetch_l2_bulk(blk + static_cast<int64_t>(off) * kRowBytes, kRowBytes);
        prefetch_l2_bulk(blk + ((static_cast<int64_t>(bsz) * kRowBytes + off * 8) & ~int64_t(15)), 16);
      } else {
        prefetch_l2_bulk(blk + static_cast<int64_t>(off) * kBf16RowBytes, kBf16RowBytes);
      }
    }

    // Byte offsets of this lane's row (lanes 0..15), -1 when skipped.
    int64_t data_off = -1, scale_off = 0;
    if (slot >= 0) {
      const bool l0 = list == 0;
      const int bsz = l0 ? p.src[0].block_size : p.src[1].block_size;
      const int64_t blk = static_cast<int64_t>(slot / bsz) * (l0 ? p.src[0].block_stride : p.src[1].block_stride);
      const int off = slot % bsz;
      if (kFp8) {
        data_off = blk + static_cast<int64_t>(off) * kRowBytes;
        scale_off = blk + static_cast<int64_t>(bsz) * kRowBytes + off * 8;
      } else {
        data_off = blk + static_cast<int64_t>(off) * kBf16RowBytes;
      }
    }
    const unsigned valid = __ballot_sync(0xffffffffu, slot >= 0) & 0xFFFFu;
    // list is warp-uniform (a tile holds one list), but only lanes 0..15 computed it.
    const int list_w = __shfl_sync(0xffffffffu, list, 0);
    const uint8_t* base = list_w == 0 ? p.src[0].base : p.src[1].base;

    if (it >= kStages) mbar_wait(&empty[stage], ((it >> 1) - 1) & 1);
    if (lane == 0) mask16[stage * 4 + warp] = static_cast<uint16_t>(valid);
    uint8_t* tile_smem = smem + kOffKV + stage * kStageBytes;

    if (!kFp8 && (p.flags & kFlagCpAsyncBf16)) {
      // bf16 rows: 16 rows x 1 KB per warp in flight at once, no register staging.
      const uint32_t tile_u32 = smem_u32(tile_smem);
#pragma unroll 4
      for (int r = 0; r < 16; ++r) {
        const int64_t doff = __shfl_sync(0xffffffffu, data_off, r);
        const int row = warp * 16 + r;
        if (doff >= 0) {
          const uint8_t* src = base + doff + lane * 32;
          cp_async_16(tile_u32 + tile_offset(row, lane * 16), src);
          cp_async_16(tile_u32 + tile_offset(row, lane * 16 + 8), src + 16);
        } else {
          *reinterpret_cast<uint4*>(tile_smem + tile_offset(row, lane * 16)) = make_uint4(0, 0, 0, 0);
          *reinterpret_cast<uint4*>(tile_smem + tile_offset(row, lane * 16 + 8)) = make_uint4(0, 0, 0, 0);
        }
      }
      cp_async_wait_all();
      fence_proxy_async_smem();
      mbar_arrive(&full[stage]);
      continue;
    }

    if (kFp8 && (p.flags & kFlagFp8Wide)) {
      // 8 rows per warp in flight: lane l < 28 loads fp8 chunk l (16 B) of each of the
      // 8 rows; the 8 x 8 rope chunks are spread over all 32 lanes (2 each); lane j < 8
      // loads row j's 8 scale bytes and hands them out by shuffle.
#pragma unroll 1
      for (int r0 = 0; r0 < 16; r0 += 8) {
        uint4 v[8], rope[2];
#pragma unroll
        for (int m = 0; m < 8; ++m) {
          const int64_t doff = __shfl_sync(0xffffffffu, data_off, r0 + m);
          v[m] = make_uint4(0, 0, 0, 0);
          if (lane < 28 && doff >= 0) v[m] = ldg_nc_v4(base + doff + lane * 16);
        }
#pragma unroll
        for (int m = 0; m < 2; ++m) {
          const int64_t doff = __shfl_sync(0xffffffffu, data_off, r0 + (lane >> 3) + 4 * m);
          rope[m] = make_uint4(0, 0, 0, 0);
          if (doff >= 0) rope[m] = ldg_nc_v4(base + doff + 448 + (lane & 7) * 16);
        }
        uint2 sw = make_uint2(0x7f7f7f7fu, 0x7f7f7f7fu);
        {
          const int64_t doff = __shfl_sync(0xffffffffu, data_off, r0 + (lane & 7));
          const int64_t soff = __shfl_sync(0xffffffffu, scale_off, r0 + (lane & 7));
          if (lane < 8 && doff >= 0) sw = ldg_nc_v2(base + soff);
        }
#pragma unroll
        for (int m = 0; m < 2; ++m) {
          const int row = warp * 16 + r0 + (lane >> 3) + 4 * m;
          *reinterpret_cast<uint4*>(tile_smem + tile_offset(row, 448 + (lane & 7) * 8)) = rope[m];
        }
        const int grp = (lane >> 2) & 7;
#pragma unroll
        for (int m = 0; m < 8; ++m) {
          const uint32_t lo = __shfl_sync(0xffffffffu, sw.x, m);
          const uint32_t hi = __shfl_sync(0xffffffffu, sw.y, m);
          if (lane < 28) {
            const uint32_t e = (grp < 4 ? lo >> (8 * grp) : hi >> (8 * (grp - 4))) & 0xFFu;
            const int row = warp * 16 + r0 + m;
            if (bits) {
              dequant_store_fp8x16<true>(tile_smem, row, lane * 16, v[m], e);
            } else {
              dequant_store_fp8x16<false>(tile_smem, row, lane * 16, v[m], e);
            }
          }
        }
      }
      fence_proxy_async_smem();
      mbar_arrive(&full[stage]);
      continue;
    }

    constexpr int kBatch = 4;
#pragma unroll 1
    for (int r0 = 0; r0 < 16; r0 += kBatch) {
      uint4 v0[kBatch], v1[kBatch];
      uint32_t e[kBatch];
#pragma unroll
      for (int k = 0; k < kBatch; ++k) {
        const int64_t doff = __shfl_sync(0xffffffffu, data_off, r0 + k);
        const int64_t soff = __shfl_sync(0xffffffffu, scale_off, r0 + k);
        v0[k] = make_uint4(0, 0, 0, 0);
        v1[k] = make_uint4(0, 0, 0, 0);
        e[k] = 127;
        if (doff >= 0) {
          const uint8_t* row = base + doff;
          if (kFp8) {
            if (lane < 28) {
              v0[k] = ldg_nc_v4(row + lane * 16);
              e[k] = ldg_nc_u8(base + soff + (lane >> 2));
            } else {
              v0[k] = ldg_nc_v4(row + 448 + (lane - 28) * 32);
              v1[k] = ldg_nc_v4(row + 448 + (lane - 28) * 32 + 16);
            }
          } else {
            v0[k] = ldg_nc_v4(row + lane * 32);
            v1[k] = ldg_nc_v4(row + lane * 32 + 16);
          }
        }
      }
#pragma unroll
      for (int k = 0; k < kBatch; ++k) {
        const int r = warp * 16 + r0 + k;
        if (kFp8 && lane < 28) {
          if (bits) {
            dequant_store_fp8x16<true>(tile_smem, r, lane * 16, v0[k], e[k]);
          } else {
            dequant_store_fp8x16<false>(tile_smem, r, lane * 16, v0[k], e[k]);
          }
        } else {
          *reinterpret_cast<uint4*>(tile_smem + tile_offset(r, lane * 16)) = v0[k];
          *reinterpret_cast<uint4*>(tile_smem + tile_offset(r, lane * 16 + 8)) = v1[k];
        }
      }
    }
    fence_proxy_async_smem();
    mbar_arrive(&full[stage]);
  }
}

template <bool kFp8, bool kKeySplit>
__global__ void __launch_bounds__(kThreads, 1) sparse_mqa_fwd_kernel(const __grid_constant__ SparseMqaParams p) {
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + kOffBar);
  uint64_t* empty = full + 2;
  uint16_t* mask16 = reinterpret_cast<uint16_t*>(smem + kOffMask);

  const int hblocks = p.num_heads / kHeadsPerCta;
  int bid = blockIdx.x;
  const int hb = bid % hblocks;
  bid /= hblocks;
  const int split = bid % p.num_splits;
  const int token = bid / p.num_splits;
  const int b = token / p.s_q, i = token % p.s_q;

  if (threadIdx.x == 0) {
    mbar_init(&full[0], 128);
    mbar_init(&full[1], 128);
    mbar_init(&empty[0], 256);
    mbar_init(&empty[1], 256);
    mbar_init_fence();
  }
  const TokenTiles tt = token_tiles(p, b, split);
  __syncthreads();

  const int wg = threadIdx.x >> 7;
  if (wg == 0) {
    setmaxnreg_dec<kProducerRegs>();
    producer_loop<kFp8>(p, tt, b, i, smem, full, empty, mask16);
    return;
  }
  setmaxnreg_inc<kConsumerRegs>();

  const int g = wg - 1;
  const int t = threadIdx.x & 127;   // thread in warpgroup
  const int w = t >> 5, lane = t & 31, quad = lane & 3;
  const int r0 = 16 * w + (lane >> 2);  // this thread's accumulator rows: r0 and r0 + 8

  // Q [64 heads x 512] -> smem (swizzled), by the consumers only so that the producer's first
  // gather overlaps it; cp.async keeps all 16 chunks per thread in flight at once.
  {
    const uint16_t* qg = p.q + b * p.q_stride_b + i * p.q_stride_q + static_cast<int64_t>(hb) * kHeadsPerCta * p.q_stride_h;
    const uint32_t q_u32 = smem_u32(smem + kOffQ);
    const int ct = threadIdx.x - 128;
#pragma unroll
    for (int k = 0; k < kHeadsPerCta * (kHeadDim / 8) / 256; ++k) {
      const int c = ct + 256 * k;
      const int r = c >> 6, d = (c & 63) * 8;
      cp_async_16(q_u32 + tile_offset(r, d), qg + r * p.q_stride_h + d);
    }
    cp_async_wait_all();
    fence_proxy_async_smem();
    named_bar_sync(3, 256);
  }
  const uint32_t q_base = smem_u32(smem + kOffQ);

  float o[128];
#pragma unroll
  for (int k = 0; k < 128; ++k) o[k] = 0.f;
  float m0 = -INFINITY, m1 = -INFINITY;  // running max (log2 domain) of rows r0, r0 + 8
  float l0 = 0.f, l1 = 0.f;              // this thread's share of the running row sums

  if constexpr (kKeySplit) {
    // Consumer g owns keys [32g, 32g + 32) of every tile for S and softmax (no duplicated
    // work), and O[:, 256g : 256g + 256] for PV over all 64 keys. Only the row maxima
    // (64 floats per warpgroup) and the bf16 P halves (4 KB each) cross warpgroups.
    uint8_t* p_smem = smem + kOffP;
    const uint32_t p_base = smem_u32(p_smem);
    float* red = reinterpret_cast<float*>(smem + kOffRed);
    // With kFlagOverlapS, S of tile j+1 is issued right behind PV of tile j, so the tensor
    // pipe runs both back to back; stage j is released once PV(j) is known complete.
    const bool overlap = (p.flags & kFlagOverlapS) != 0;
    const int ntiles = tt.t1 - tt.t0;
    float s[16];
    // S[:, my 32 keys] of tile `it` over the full d = 512, left in flight.
    auto issue_s = [&](int it) {
      const uint32_t kv_base = smem_u32(smem + kOffKV + (it & 1) * kStageBytes);
      mbar_wait(&full[it & 1], (it >> 1) & 1);
#pragma unroll
      for (int k = 0; k < 16; ++k) fence_operand(s[k]);
      wgmma_fence();
      // Descriptors advance by adding (byte offset >> 4) to the start-address field; the
      // opaque copies keep the compiler from hoisting 32 precomputed descriptors.
      uint64_t dq = gmma_desc_sw128(q_base, 16, 1024);
      uint64_t dk = gmma_desc_sw128(kv_base + 4096 * g, 16, 1024);  // rows 32g.. of each 8 KB block
      asm volatile("" : "+l"(dq));
      asm volatile("" : "+l"(dk));
#pragma unroll
      for (int kk = 0; kk < 32; ++kk) {
        const uint32_t off = ((kk >> 2) * 8192 + (kk & 3) * 32) >> 4;
        wgmma_m64n32k16_ss(s, dq + off, dk + off, kk > 0 ? 1 : 0);
      }
      wgmma_commit();
    };
    // Pin the zeroed O before S(0) goes in flight: ptxas serializes every wgmma when
    // accumulator registers are written while any wgmma is pending.
#pragma unroll
    for (int k = 0; k < 128; ++k) fence_operand(o[k]);
    if (ntiles > 0) issue_s(0);
    for (int it = 0; it < ntiles; ++it) {
      const int stage = it & 1;
      const uint32_t kv_base = smem_u32(smem + kOffKV + stage * kStageBytes);
      if (overlap && it > 0) {
        wgmma_wait<1>();  // PV(it - 1) done; S(it) may still run
#pragma unroll
        for (int k = 0; k < 128; ++k) fence_operand(o[k]);
        mbar_arrive(&empty[stage ^ 1]);
      }
      wgmma_wait<0>();
#pragma unroll
      for (int k = 0; k < 16; ++k) fence_operand(s[k]);

      // Thread holds rows r0, r0 + 8 and local keys 8j + 2*quad + {0, 1}, j = 0..3.
      const uint32_t valid = reinterpret_cast<const volatile uint32_t*>(mask16 + stage * 4)[g];
      float mx0 = -INFINITY, mx1 = -INFINITY;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int key = 8 * j + 2 * quad + (e & 1);
          const float v = s[4 * j + e] * p.scale_log2;
          s[4 * j + e] = ((valid >> key) & 1u) ? v : -INFINITY;
        }
        mx0 = fmaxf(mx0, fmaxf(s[4 * j], s[4 * j + 1]));
        mx1 = fmaxf(mx1, fmaxf(s[4 * j + 2], s[4 * j + 3]));
      }
      mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 1));
      mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 2));
      mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 1));
      mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 2));
      // Both warpgroups must use the same running max (they share P); the other one read my
      // previous maxima before it passed the last barrier 2, so one buffer suffices.
      if (quad == 0) {
        red[g * 64 + r0] = mx0;
        red[g * 64 + r0 + 8] = mx1;
      }
      named_bar_sync(1, 256);
      mx0 = fmaxf(mx0, red[(1 - g) * 64 + r0]);
      mx1 = fmaxf(mx1, red[(1 - g) * 64 + r0 + 8]);
      const float mn0 = fmaxf(m0, mx0), mn1 = fmaxf(m1, mx1);
      const float ms0 = mn0 == -INFINITY ? 0.f : mn0;
      const float ms1 = mn1 == -INFINITY ? 0.f : mn1;
      const float a0 = ex2(m0 - ms0), a1 = ex2(m1 - ms1);
      m0 = mn0;
      m1 = mn1;
      float sum0 = 0.f, sum1 = 0.f;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        s[4 * j] = ex2(s[4 * j] - ms0);
        s[4 * j + 1] = ex2(s[4 * j + 1] - ms0);
        s[4 * j + 2] = ex2(s[4 * j + 2] - ms1);
        s[4 * j + 3] = ex2(s[4 * j + 3] - ms1);
        sum0 += s[4 * j] + s[4 * j + 1];
        sum1 += s[4 * j + 2] + s[4 * j + 3];
      }
      l0 = l0 * a0 + sum0;
      l1 = l1 * a1 + sum1;
      uint32_t pa[8];
#pragma unroll
      for (int kk = 0; kk < 2; ++kk) {
        pa[4 * kk + 0] = pack_bf16(s[8 * kk + 0], s[8 * kk + 1]);
        pa[4 * kk + 1] = pack_bf16(s[8 * kk + 2], s[8 * kk + 3]);
        pa[4 * kk + 2] = pack_bf16(s[8 * kk + 4], s[8 * kk + 5]);
        pa[4 * kk + 3] = pack_bf16(s[8 * kk + 6], s[8 * kk + 7]);
      }
      // My P half -> the shared [64 x 64] bf16 P tile (K-major, 128-byte swizzle) for the
      // other warpgroup, whose wgmma finished reading the previous P before barrier 1.
      {
        uint8_t* prow = p_smem + r0 * 128 + 4 * quad;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const int chunk = ((4 * g + j) ^ (r0 & 7)) << 4;
          const uint32_t lo = (j & 1) ? pa[4 * (j >> 1) + 2] : pa[4 * (j >> 1) + 0];
          const uint32_t hi = (j & 1) ? pa[4 * (j >> 1) + 3] : pa[4 * (j >> 1) + 1];
          *reinterpret_cast<uint32_t*>(prow + chunk) = lo;
          *reinterpret_cast<uint32_t*>(prow + 1024 + chunk) = hi;
        }
      }
      fence_proxy_async_smem();
      if (!(p.flags & kFlagLazyRescale) || a0 != 1.f || a1 != 1.f) {
#pragma unroll
        for (int j = 0; j < 32; ++j) {
          o[4 * j] *= a0;
          o[4 * j + 1] *= a0;
          o[4 * j + 2] *= a1;
          o[4 * j + 3] *= a1;
        }
      }

      // O[:, 256g : 256g + 256] += P V: my own keys from registers first (no need to wait for
      // the other warpgroup), then the other half of P from smem.
#pragma unroll
      for (int k = 0; k < 128; ++k) fence_operand(o[k]);
#pragma unroll
      for (int k = 0; k < 8; ++k) fence_operand(pa[k]);
      wgmma_fence();
      {
        uint64_t dv = gmma_desc_sw128(kv_base + 4 * g * 8192, 8192, 1024);
        uint64_t dp = gmma_desc_sw128(p_base, 16, 1024);
        asm volatile("" : "+l"(dv));
        asm volatile("" : "+l"(dp));
#pragma unroll
        for (int kk = 0; kk < 2; ++kk)
          wgmma_m64n256k16_rs_tb(o, &pa[4 * kk], dv + (((2 * g + kk) * 2048) >> 4));
        named_bar_sync(2, 256);  // the other half of P is in smem
#pragma unroll
        for (int kk = 0; kk < 2; ++kk) {
          const int kg = 2 * (1 - g) + kk;
          wgmma_m64n256k16_ss_tb(o, dp + ((kg * 32) >> 4), dv + ((kg * 2048) >> 4));
        }
      }
      wgmma_commit();
      if (!overlap) {
        wgmma_wait<0>();
#pragma unroll
        for (int k = 0; k < 128; ++k) fence_operand(o[k]);
        mbar_arrive(&empty[stage]);
      }
      if (it + 1 < ntiles) issue_s(it + 1);
    }
    if (overlap && ntiles > 0) {
      wgmma_wait<0>();
#pragma unroll
      for (int k = 0; k < 128; ++k) fence_operand(o[k]);
      mbar_arrive(&empty[(ntiles - 1) & 1]);
    }
    // Row sums: quad, then the other warpgroup's keys. The other one read my last maxima
    // before the last barrier 2 (and with no tiles there were none), so `red` is free.
    l0 += __shfl_xor_sync(0xffffffffu, l0, 1);
    l0 += __shfl_xor_sync(0xffffffffu, l0, 2);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 1);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 2);
    if (quad == 0) {
      red[g * 64 + r0] = l0;
      red[g * 64 + r0 + 8] = l1;
    }
    named_bar_sync(1, 256);
    l0 += red[(1 - g) * 64 + r0];
    l1 += red[(1 - g) * 64 + r0 + 8];
  } else {
    // Consumer g computes the partial S over d in [256g, 256g + 256); the partials are
    // summed through smem, both run the same softmax, g accumulates O[:, 256g : 256g + 256].
    float* sx_mine = reinterpret_cast<float*>(smem + kOffSx + g * kSxBytes);
    const float* sx_other = reinterpret_cast<const float*>(smem + kOffSx + (1 - g) * kSxBytes);
    for (int tile = tt.t0; tile < tt.t1; ++tile) {
      const int it = tile - tt.t0;
      const int stage = it & 1;
      const uint32_t kv_base = smem_u32(smem + kOffKV + stage * kStageBytes);
      mbar_wait(&full[stage], (it >> 1) & 1);

      float s[32];
#pragma unroll
      for (int k = 0; k < 32; ++k) s[k] = 0.f;
#pragma unroll
      for (int k = 0; k < 32; ++k) fence_operand(s[k]);
      wgmma_fence();
      {
        uint64_t dq = gmma_desc_sw128(q_base + 4 * g * 8192, 16, 1024);
        uint64_t dk = gmma_desc_sw128(kv_base + 4 * g * 8192, 16, 1024);
        asm volatile("" : "+l"(dq));
        asm volatile("" : "+l"(dk));
#pragma unroll
        for (int kk = 0; kk < 16; ++kk) {
          const uint32_t off = ((kk >> 2) * 8192 + (kk & 3) * 32) >> 4;
          wgmma_m64n64k16_ss(s, dq + off, dk + off, kk > 0 ? 1 : 0);
        }
      }
      wgmma_commit();
      wgmma_wait<0>();
#pragma unroll
      for (int k = 0; k < 32; ++k) fence_operand(s[k]);

      named_bar_sync(1, 256);  // the other warpgroup is done reading my buffer
#pragma unroll
      for (int k = 0; k < 8; ++k)
        reinterpret_cast<float4*>(sx_mine)[k * 128 + t] = make_float4(s[4 * k], s[4 * k + 1], s[4 * k + 2], s[4 * k + 3]);
      named_bar_sync(2, 256);
#pragma unroll
      for (int k = 0; k < 8; ++k) {
        const float4 v = reinterpret_cast<const float4*>(sx_other)[k * 128 + t];
        s[4 * k] += v.x;
        s[4 * k + 1] += v.y;
        s[4 * k + 2] += v.z;
        s[4 * k + 3] += v.w;
      }

      // Thread holds rows r0, r0 + 8 and keys 8j + 2*quad + {0, 1}, j = 0..7.
      const uint64_t valid = *reinterpret_cast<const volatile uint64_t*>(mask16 + stage * 4);
      float mx0 = -INFINITY, mx1 = -INFINITY;
#pragma unroll
      for (int j = 0; j < 8; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int key = 8 * j + 2 * quad + (e & 1);
          float v = s[4 * j + e] * p.scale_log2;
          v = ((valid >> key) & 1) ? v : -INFINITY;
          s[4 * j + e] = v;
        }
        mx0 = fmaxf(mx0, fmaxf(s[4 * j], s[4 * j + 1]));
        mx1 = fmaxf(mx1, fmaxf(s[4 * j + 2], s[4 * j + 3]));
      }
      mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 1));
      mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 2));
      mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 1));
      mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 2));
      const float mn0 = fmaxf(m0, mx0), mn1 = fmaxf(m1, mx1);
      const float ms0 = mn0 == -INFINITY ? 0.f : mn0;
      const float ms1 = mn1 == -INFINITY ? 0.f : mn1;
      const float a0 = ex2(m0 - ms0), a1 = ex2(m1 - ms1);
      m0 = mn0;
      m1 = mn1;
      float sum0 = 0.f, sum1 = 0.f;
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        s[4 * j] = ex2(s[4 * j] - ms0);
        s[4 * j + 1] = ex2(s[4 * j + 1] - ms0);
        s[4 * j + 2] = ex2(s[4 * j + 2] - ms1);
        s[4 * j + 3] = ex2(s[4 * j + 3] - ms1);
        sum0 += s[4 * j] + s[4 * j + 1];
        sum1 += s[4 * j + 2] + s[4 * j + 3];
      }
      l0 = l0 * a0 + sum0;
      l1 = l1 * a1 + sum1;
      uint32_t pa[16];
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) {
        pa[4 * kk + 0] = pack_bf16(s[8 * kk + 0], s[8 * kk + 1]);
        pa[4 * kk + 1] = pack_bf16(s[8 * kk + 2], s[8 * kk + 3]);
        pa[4 * kk + 2] = pack_bf16(s[8 * kk + 4], s[8 * kk + 5]);
        pa[4 * kk + 3] = pack_bf16(s[8 * kk + 6], s[8 * kk + 7]);
      }
      if (!(p.flags & kFlagLazyRescale) || a0 != 1.f || a1 != 1.f) {
#pragma unroll
        for (int j = 0; j < 32; ++j) {
          o[4 * j] *= a0;
          o[4 * j + 1] *= a0;
          o[4 * j + 2] *= a1;
          o[4 * j + 3] *= a1;
        }
      }
#pragma unroll
      for (int k = 0; k < 128; ++k) fence_operand(o[k]);
#pragma unroll
      for (int k = 0; k < 16; ++k) fence_operand(pa[k]);
      wgmma_fence();
      {
        uint64_t dv = gmma_desc_sw128(kv_base + 4 * g * 8192, 8192, 1024);
        asm volatile("" : "+l"(dv));
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) wgmma_m64n256k16_rs_tb(o, &pa[4 * kk], dv + ((kk * 2048) >> 4));
      }
      wgmma_commit();
      wgmma_wait<0>();
#pragma unroll
      for (int k = 0; k < 128; ++k) fence_operand(o[k]);
      mbar_arrive(&empty[stage]);
    }
    // Both warpgroups saw the same S: the quad holds the whole row sum.
    l0 += __shfl_xor_sync(0xffffffffu, l0, 1);
    l0 += __shfl_xor_sync(0xffffffffu, l0, 2);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 1);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 2);
  }

  // ---- epilogue ----
  const int h0 = hb * kHeadsPerCta + r0, h1 = h0 + 8;
  constexpr float kLn2 = 0.6931471805599453f;
  constexpr float kLog2e = 1.4426950408889634f;
  const float lse0 = l0 > 0.f ? (m0 + __log2f(l0)) * kLn2 : -INFINITY;
  const float lse1 = l1 > 0.f ? (m1 + __log2f(l1)) * kLn2 : -INFINITY;
  const int dcol = 256 * g + 2 * quad;
  if (p.num_splits == 1) {
    float inv0 = 0.f, inv1 = 0.f;
    if (l0 > 0.f) {
      const float sk = p.sink != nullptr ? p.sink[h0] * kLog2e : -INFINITY;
      inv0 = 1.f / (l0 + ex2(sk - m0));
    }
    if (l1 > 0.f) {
      const float sk = p.sink != nullptr ? p.sink[h1] * kLog2e : -INFINITY;
      inv1 = 1.f / (l1 + ex2(sk - m1));
    }
    uint16_t* ob = p.out + b * p.out_stride_b + i * p.out_stride_q;
    uint16_t* o0p = ob + h0 * p.out_stride_h + dcol;
    uint16_t* o1p = ob + h1 * p.out_stride_h + dcol;
#pragma unroll
    for (int j = 0; j < 32; ++j) {
      *reinterpret_cast<uint32_t*>(o0p + 8 * j) = pack_bf16(o[4 * j] * inv0, o[4 * j + 1] * inv0);
      *reinterpret_cast<uint32_t*>(o1p + 8 * j) = pack_bf16(o[4 * j + 2] * inv1, o[4 * j + 3] * inv1);
    }
    if (g == 0 && quad == 0) {
      p.lse[static_cast<int64_t>(token) * p.num_heads + h0] = lse0;
      p.lse[static_cast<int64_t>(token) * p.num_heads + h1] = lse1;
    }
  } else {
    const float inv0 = l0 > 0.f ? 1.f / l0 : 0.f;
    const float inv1 = l1 > 0.f ? 1.f / l1 : 0.f;
    const int64_t row = (static_cast<int64_t>(split) * p.batch * p.s_q + token) * p.num_heads;
    float* o0p = p.part_o + (row + h0) * kHeadDim + dcol;
    float* o1p = p.part_o + (row + h1) * kHeadDim + dcol;
#pragma unroll
    for (int j = 0; j < 32; ++j) {
      *reinterpret_cast<float2*>(o0p + 8 * j) = make_float2(o[4 * j] * inv0, o[4 * j + 1] * inv0);
      *reinterpret_cast<float2*>(o1p + 8 * j) = make_float2(o[4 * j + 2] * inv1, o[4 * j + 3] * inv1);
    }
    if (g == 0 && quad == 0) {
      p.part_lse[row + h0] = lse0;
      p.part_lse[row + h1] = lse1;
    }
  }
}

// Merges the split partials of one (token, head): 128 threads x 4 columns.
__global__ void __launch_bounds__(128) sparse_mqa_combine_kernel(const __grid_constant__ SparseMqaParams p) {
  const int token = blockIdx.x / p.num_heads;
  const int h = blockIdx.x % p.num_heads;
  const int b = token / p.s_q, i = token % p.s_q;
  const int64_t tokens = static_cast<int64_t>(p.batch) * p.s_q;
  const int64_t split_stride = tokens * p.num_heads;
  const int64_t row = static_cast<int64_t>(token) * p.num_heads + h;
  float mx = -INFINITY;
  for (int s = 0; s < p.num_splits; ++s) mx = fmaxf(mx, p.part_lse[s * split_stride + row]);
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
  float lsum = 0.f;
  if (mx != -INFINITY) {
    for (int s = 0; s < p.num_splits; ++s) {
      const float ls = p.part_lse[s * split_stride + row];
      if (ls == -INFINITY) continue;
      const float wgt = __expf(ls - mx);
      lsum += wgt;
      const float4 v = reinterpret_cast<const float4*>(p.part_o + (s * split_stride + row) * kHeadDim)[threadIdx.x];
      acc.x += wgt * v.x;
      acc.y += wgt * v.y;
      acc.z += wgt * v.z;
      acc.w += wgt * v.w;
    }
  }
  float inv = 0.f, lse = -INFINITY;
  if (lsum > 0.f) {
    const float sk = p.sink != nullptr ? p.sink[h] : -INFINITY;
    inv = 1.f / (lsum + __expf(sk - mx));
    lse = mx + __logf(lsum);
  }
  uint16_t* op = p.out + b * p.out_stride_b + i * p.out_stride_q + h * p.out_stride_h + threadIdx.x * 4;
  uint2 packed;
  packed.x = pack_bf16(acc.x * inv, acc.y * inv);
  packed.y = pack_bf16(acc.z * inv, acc.w * inv);
  *reinterpret_cast<uint2*>(op) = packed;
  if (threadIdx.x == 0) p.lse[row] = lse;
}

}  // namespace attention
}  // namespace dsv4
