// Sparse MQA forward: the CTA's layout (torch-free). Thread counts, register budgets,
// shared-memory offsets, named-barrier ids and the swizzled smem tile addressing, shared by
// the producer (sparse_mqa_producer.cuh) and the consumers (sparse_mqa.cuh).
#pragma once

#include <cstdint>

#include "attention/sparse_mqa_params.cuh"

namespace dsv4 {
namespace attention {

constexpr int kThreads = 384;
constexpr int kQBytes = kHeadsPerCta * kHeadDim * 2;    // 64 KB
constexpr int kBufBytes = kTileKeys * kHeadDim * 2;     // 64 KB per buffer
constexpr int kPBytes = kHeadsPerCta * kTileKeys * 2;   // 8 KB bf16 P tile
constexpr int kOffQ = 0;
constexpr int kOffKV = kOffQ + kQBytes;
constexpr int kOffP = kOffKV + 2 * kBufBytes;
// Running maxima handed between the consumers, [direction][round parity][64 rows]: 0 -> 1
// (consumer 0's tile max), 1 -> 0 (the round's max). Separate buffers per direction and
// round, so a write never targets a location the other consumer may still be reading.
constexpr int kOffMax = kOffP + 2 * kPBytes;
constexpr int kOffSum = kOffMax + 2 * 2 * 64 * 4;  // 2 x 64 floats: row sums, epilogue
constexpr int kOffMask = kOffSum + 2 * 64 * 4;  // 2 x 64-bit key validity masks
// ready[4], free[4], mask_ready[2], then (the crossover) ready_remote[4]: each half's rows
// from the peer CTA, by st.async bytes
constexpr int kOffBar = kOffMask + 2 * 8;
constexpr int kBarReadyRemote = 10;
constexpr int kSmemBytes = kOffBar + 14 * 8 + 1024;  // + alignment slack

// setmaxnreg budgets (128 x 88 + 256 x 208 = the launch's 384 x 168). At 200 consumer
// registers ptxas serializes the wgmmas (C7512); the producer's fp8 gather fits in 88.
constexpr int kProducerRegs = 88;
constexpr int kConsumerRegs = 208;

// Named barriers between the two consumer warpgroups (0 is __syncthreads).
constexpr int kBarQ = 1;      // Q is in smem
constexpr int kBarMax0 = 2;   // consumer 0 published its tile's max
constexpr int kBarMax1 = 3;   // consumer 1 published the round's max
constexpr int kBarP0 = 4;     // P_0 (rescaled to the round's max) is in smem
constexpr int kBarP1 = 5;     // P_1 is in smem
constexpr int kBarSum = 6;    // row sums exchanged (epilogue)

// Byte offset inside a swizzled [64 rows x 512] bf16 tile of the 16-byte chunk that
// holds elements d .. d+7 of row r (d a multiple of 8).
__device__ __forceinline__ uint32_t tile_offset(int r, int d) {
  const int c = d >> 6, j = (d >> 3) & 7;
  return c * 8192 + (r >> 3) * 1024 + (r & 7) * 128 + ((j ^ (r & 7)) << 4);
}

}  // namespace attention
}  // namespace dsv4
