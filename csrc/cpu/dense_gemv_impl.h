// The dense GEMV loop (dense_gemv.h), written once over a vector type V that each ISA file supplies under its own
// target: V::F (an fp32 vector), V::W (values per step: two vectors' worth), zero, widen<BF16> (V::W bf16 / fp16
// values -> two fp32 vectors, exact; any split of the values into the two, as long as x and w are split alike), fma,
// sum.
#pragma once
#include <algorithm>
#include <cstdint>

#include "common/convert.h"
#include "dense_gemv.h"

namespace hf_w4 {

#ifndef HF_W4_DENSE_PREFETCH
#define HF_W4_DENSE_PREFETCH 16384
#endif
constexpr int64_t kDensePrefetch = HF_W4_DENSE_PREFETCH;

template <bool BF16>
inline float dense_f32(uint16_t h) { return BF16 ? bf16_bits_to_f32(h) : f16_bits_to_f32(h); }

// R weight rows from row n against all M activation rows: M x R accumulators, each a dependency chain of its own
// (R = 8 at M = 1, 4 above: 8-16 chains keep both FMA pipes busy while the weights stream in).
template <class V, bool BF16, int M, int R>
inline void dense_rows(const DenseGemv& g, int64_t n) {
  typename V::F acc[M][R];
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < R; ++r) acc[m][r] = V::zero();
  const int64_t K = g.K, kv = K - K % V::W;
  const uint16_t* w = g.w + n * g.ldw;
  // the R rows are read as R interleaved streams, too many for the hardware prefetcher to run far enough ahead of
  // at one core's bandwidth. So software prefetches walk the weights linearly, R x V::W x 2 bytes per step (what a
  // step reads), one block of R rows ahead (at least kDensePrefetch bytes): over a block's steps they request the
  // next block whole, row after row. (Prefetching each row of this block a fixed distance ahead instead was 15-25 %
  // slower at K = 4096 on Zen 5: docs/cpu-kernels.md, "Dense layers at decode".)
  const char* pf = reinterpret_cast<const char*>(w) + std::max<int64_t>(kDensePrefetch, R * g.ldw * 2);
  for (int64_t k = 0; k < kv; k += V::W) {
    for (int r = 0; r < R * V::W * 2; r += 64) __builtin_prefetch(pf + r, 0, 3);
    pf += R * V::W * 2;
    typename V::F xv[M][2];
    for (int m = 0; m < M; ++m) V::template widen<BF16>(g.x + m * K + k, xv[m]);
    for (int r = 0; r < R; ++r) {
      typename V::F wv[2];
      V::template widen<BF16>(w + r * g.ldw + k, wv);
      for (int m = 0; m < M; ++m) acc[m][r] = V::fma(xv[m][1], wv[1], V::fma(xv[m][0], wv[0], acc[m][r]));
    }
  }
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < R; ++r) {
      float s = V::sum(acc[m][r]);
      for (int64_t k = kv; k < K; ++k) s += dense_f32<BF16>(g.x[m * K + k]) * dense_f32<BF16>(w[r * g.ldw + k]);
      if (g.bias) s += dense_f32<BF16>(g.bias[n + r]);
      g.y[m * g.N + n + r] = BF16 ? f32_to_bf16_bits(s) : f32_to_f16_bits(s);
    }
}

template <class V, bool BF16, int M>
inline void dense_range(const DenseGemv& g, int64_t n0, int64_t n1) {
  constexpr int R = M == 1 ? 8 : 4;
  int64_t n = n0;
  for (; n + R <= n1; n += R) dense_rows<V, BF16, M, R>(g, n);
  for (; n < n1; ++n) dense_rows<V, BF16, M, 1>(g, n);
}

template <class V, bool BF16>
inline void dense_range_m(const DenseGemv& g, int64_t n0, int64_t n1) {
  switch (g.M) {
    case 1: return dense_range<V, BF16, 1>(g, n0, n1);
    case 2: return dense_range<V, BF16, 2>(g, n0, n1);
    case 3: return dense_range<V, BF16, 3>(g, n0, n1);
    default: return dense_range<V, BF16, 4>(g, n0, n1);
  }
}

template <class V>
inline void dense_gemv_v(const DenseGemv& g, int64_t n0, int64_t n1) {
  if (g.bf16) dense_range_m<V, true>(g, n0, n1);
  else dense_range_m<V, false>(g, n0, n1);
}

}  // namespace hf_w4
