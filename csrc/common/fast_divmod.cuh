// Division by a run-time invariant 32-bit divisor with one multiply-high and a
// shift (Granlund & Montgomery), because integer division in an inner loop costs
// dozens of instructions and memory-bound kernels cannot hide that.
#pragma once

#include <stdint.h>

namespace dsv4 {

struct FastDivmod {
  uint32_t divisor = 1, multiplier = 1, shift = 0;

  FastDivmod() = default;
  // Host side; divisor >= 1.
  explicit FastDivmod(uint32_t d) : divisor(d) {
    while ((uint64_t(1) << shift) < d) ++shift;  // shift = ceil(log2(d))
    multiplier = uint32_t((uint64_t(1) << 32) * ((uint64_t(1) << shift) - d) / d + 1);
  }

  // Exact for every n < 2^32.
  __device__ __forceinline__ uint32_t div(uint32_t n) const {
    return uint32_t((uint64_t(__umulhi(n, multiplier)) + n) >> shift);
  }
  __device__ __forceinline__ void divmod(uint32_t n, uint32_t& q, uint32_t& r) const {
    q = div(n);
    r = n - q * divisor;
  }
};

}  // namespace dsv4
