// Run-time value -> compile-time template argument, for the kernels' row-block templates (the W4A16 weight mode:
// with_mode in w4a16.h).
// No torch headers, no ISA-specific code: the callable is inlined into the (target-attributed) caller.
#pragma once
#include <cstdint>
#include <type_traits>

namespace hf_w4 {

template <int V>
using IntC = std::integral_constant<int, V>;

// f(IntC<R>{}) for the first R of Rows... equal to r; the last of Rows when none is (list it as the fallback).
// Replaces `switch (mr) { case 1: kernel<1>(...); ... default: kernel<4>(...); }`.
template <int R, int... Rest, class F>
__attribute__((always_inline)) inline void with_rows(int64_t r, F&& f) {
  if constexpr (sizeof...(Rest) == 0) {
    f(IntC<R>{});
  } else {
    if (r == R) f(IntC<R>{});
    else with_rows<Rest...>(r, static_cast<F&&>(f));
  }
}

}  // namespace hf_w4
