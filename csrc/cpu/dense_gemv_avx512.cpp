// hf_w4 dense GEMV (dense_gemv.h), AVX-512: 32 weights (one cache line) per row and step, widened to fp32 and
// multiplied with fp32 FMAs - the layer is bound by its weight stream, so no bf16 dot products are needed and every
// AVX-512 CPU runs the same code.
#include "common/cpu_features.h"
#if HF_W4_X86
#ifndef HF_W4_EMULATE_AVX512  // (the test-only emulated build: common/simd512.h)
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,fma,f16c")
#endif
// (gcc 12 flags _mm512_reduce_add_ps and _mm512_setzero_ps internals: its headers, not this code)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#include "common/simd512.h"
#include "dense_gemv_impl.h"

namespace hf_w4 {
namespace {

struct V512 {
  using F = __m512;
  static constexpr int W = 32;
  static F zero() { return _mm512_setzero_ps(); }
  // 32 values: bf16 -> the even ones (low halves of the dwords, shifted up) and the odd ones (high halves, masked):
  // two plain ALU operations, no lane-crossing widening; fp16 -> the two halves through vcvtph2ps
  template <bool BF16>
  static void widen(const uint16_t* p, F (&v)[2]) {
    if constexpr (BF16) {
      const __m512i d = _mm512_loadu_si512(p);
      v[0] = _mm512_castsi512_ps(_mm512_slli_epi32(d, 16));
      v[1] = _mm512_castsi512_ps(_mm512_and_si512(d, _mm512_set1_epi32(int(0xffff0000u))));
    } else {
      v[0] = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
      v[1] = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 16)));
    }
  }
  static F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static float sum(F v) { return _mm512_reduce_add_ps(v); }
};

}  // namespace

void dense_gemv_avx512(const DenseGemv& g, int64_t n0, int64_t n1) { dense_gemv_v<V512>(g, n0, n1); }

}  // namespace hf_w4

#else  // not x86: never called (cpu_caps() reports no AVX-512)
#include <stdexcept>

#include "dense_gemv.h"

namespace hf_w4 {
void dense_gemv_avx512(const DenseGemv&, int64_t, int64_t) {
  throw std::runtime_error("hf_w4: the AVX-512 dense GEMV is not built for this CPU architecture");
}
}  // namespace hf_w4
#endif
