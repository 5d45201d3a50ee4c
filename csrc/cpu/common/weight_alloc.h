// Packed weights in transparent huge pages (ATen side only). At decode a kernel streams its layer's packed weights
// from memory once per token; on 4 KiB pages every 4 KiB of the stream is a TLB miss and a stop for the hardware
// prefetchers, which do not cross pages. In 2 MiB pages one core streams them 10-20 % faster (Zen 5, M = 1,
// docs/cpu-kernels.md, "Weights in huge pages"). Linux gives an anonymous mapping huge pages where it is marked
// MADV_HUGEPAGE before its first touch (THP mode "madvise", the common default, or "always"), so the repack ops
// allocate their outputs from such a mapping instead of torch's allocator (whose memory may already have been
// touched). HF_W4_HUGE_PAGES=0 turns this off.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <c10/util/accumulate.h>

#include <cstdint>
#include <fstream>
#include <string>

#if defined(__linux__)
#include <sys/mman.h>
#endif

#include "cpu_features.h"

namespace hf_w4 {

constexpr size_t kHugePage = size_t(2) << 20;

// Whether weight buffers go into huge pages: Linux with THP not "never", and HF_W4_HUGE_PAGES not 0 (read once).
inline bool huge_pages_on() {
  static const bool v = [] {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
    if (env_switched_off("HF_W4_HUGE_PAGES")) return false;
    std::ifstream f("/sys/kernel/mm/transparent_hugepage/enabled");
    std::string s;
    std::getline(f, s);
    return f.good() && s.find("[never]") == std::string::npos;
#else
    return false;
#endif
  }();
  return v;
}

// An uninitialised CPU tensor for packed weights: from at least one huge page (2 MiB) on, a private anonymous
// mapping aligned to 2 MiB and marked MADV_HUGEPAGE (its last partial huge page stays in 4 KiB pages), freed with
// the tensor; smaller ones, or where that is off or fails, from torch's allocator.
inline at::Tensor empty_weight(at::IntArrayRef sizes, at::ScalarType dtype) {
  const auto options = at::TensorOptions().dtype(dtype).device(at::kCPU);
  const size_t bytes = static_cast<size_t>(c10::multiply_integers(sizes)) * c10::elementSize(dtype);
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  if (bytes >= kHugePage && huge_pages_on()) {
    const size_t len = (bytes + 4095) & ~size_t(4095);
    void* raw = mmap(nullptr, len + kHugePage, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (raw != MAP_FAILED) {
      // keep exactly [start, start + len): the head before the 2 MiB boundary and the tail after it go back
      const uintptr_t r = reinterpret_cast<uintptr_t>(raw);
      const uintptr_t start = (r + kHugePage - 1) & ~(uintptr_t(kHugePage) - 1);
      if (start > r) munmap(raw, start - r);
      munmap(reinterpret_cast<void*>(start + len), r + kHugePage - start);  // start < r + kHugePage: never empty
      void* p = reinterpret_cast<void*>(start);
      madvise(p, len, MADV_HUGEPAGE);  // only a hint: without it the mapping still works, in 4 KiB pages
      return at::from_blob(p, sizes, [len](void* q) { munmap(q, len); }, options);
    }
  }
#endif
  return at::empty(sizes, options);
}

}  // namespace hf_w4
