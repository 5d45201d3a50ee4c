// A growable 64-byte-aligned buffer for per-thread (thread_local) kernel workspaces, shared by the W4A16 and int8
// kernels. No torch headers, no ISA-specific code.
#pragma once
#include <cstddef>
#include <cstdlib>
#include <new>

namespace hf_w4 {

// get(n) returns room for at least n elements, 64-byte aligned (tile and vector rows must not straddle cache
// lines: a std::vector's large allocation starts 16 bytes into its page); the allocation is rounded up to whole
// 4 KiB pages and only ever grows; its contents are not kept when it grows.
template <typename T>
struct AlignedBuf {
  T* p = nullptr;
  size_t n = 0;
  AlignedBuf() = default;
  AlignedBuf(const AlignedBuf&) = delete;
  AlignedBuf& operator=(const AlignedBuf&) = delete;
  ~AlignedBuf() { std::free(p); }
  T* get(size_t count) {
    if (count > n) {
      std::free(p);
      n = 0;
      const size_t bytes = (count * sizeof(T) + 4095) & ~static_cast<size_t>(4095);
      p = static_cast<T*>(std::aligned_alloc(64, bytes));
      if (!p) throw std::bad_alloc();
      n = bytes / sizeof(T);
    }
    return p;
  }
};

}  // namespace hf_w4
