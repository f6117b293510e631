// A workspace in one allocation, laid out by one function that runs twice: first over
// no memory, where it only counts the bytes, then over the allocation of that size,
// where it hands out the pointers. The size and the layout come from the same calls,
// so they cannot disagree.
#pragma once

#include <cstdint>

namespace dsv4 {

class Carver {
 public:
  static constexpr int64_t kAlign = 256;  // every region starts on a 256-byte boundary

  explicit Carver(uint8_t* base = nullptr) : base_(base) {}

  // A region of `count` T starting on a kAlign boundary.
  template <class T>
  T* region(int64_t count) {
    return take<T>(count, kAlign);
  }
  // `count` T right after what was taken before (packed arrays of one region).
  template <class T>
  T* next(int64_t count) {
    return take<T>(count, alignof(T));
  }
  // Bytes that the layout needs, a whole number of kAlign blocks.
  int64_t bytes() const { return round_up(offset_, kAlign); }

 private:
  static int64_t round_up(int64_t v, int64_t a) { return (v + a - 1) / a * a; }
  template <class T>
  T* take(int64_t count, int64_t align) {
    offset_ = round_up(offset_, align);
    T* p = base_ != nullptr ? reinterpret_cast<T*>(base_ + offset_) : nullptr;
    offset_ += count * int64_t(sizeof(T));
    return p;
  }

  uint8_t* base_;
  int64_t offset_ = 0;
};

// Runs layout(Carver&) over no memory to count, alloc(bytes) -> uint8_t* for the memory,
// then layout again over it. Returns the byte count.
template <class Layout, class Alloc>
int64_t count_then_carve(Layout&& layout, Alloc&& alloc) {
  Carver counter;
  layout(counter);
  Carver carver(alloc(counter.bytes()));
  layout(carver);
  return counter.bytes();
}

}  // namespace dsv4
