// A per-thread scratch buffer, 64-byte aligned, grown as needed and kept across calls: a kernel
// that packs operands per call (AMX activation tiles, AVX2 weight panels) would otherwise fault
// fresh pages in on every call.
#pragma once

#include <cstddef>
#include <cstdlib>

namespace emoe {

template <typename T>
class AlignedBuffer {
 public:
  AlignedBuffer() = default;
  AlignedBuffer(const AlignedBuffer&) = delete;
  AlignedBuffer& operator=(const AlignedBuffer&) = delete;
  ~AlignedBuffer() { std::free(data_); }

  // Room for `num` values, or nullptr when memory runs out (the caller falls back).
  T* get(size_t num) {
    if (num > size_) {
      std::free(data_);
      data_ = static_cast<T*>(std::aligned_alloc(64, (num * sizeof(T) + 63) / 64 * 64));
      size_ = data_ != nullptr ? num : 0;
    }
    return data_;
  }

 private:
  T* data_ = nullptr;
  size_t size_ = 0;
};

}  // namespace emoe
