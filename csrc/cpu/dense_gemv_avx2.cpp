// hf_w4 dense GEMV (dense_gemv.h), AVX2: 16 weights per row and step, widened to fp32 and multiplied with fp32
// FMAs.
#include "common/cpu_features.h"
#if HF_W4_X86
#pragma GCC target("avx2,fma,f16c")
#include <immintrin.h>

#include "dense_gemv_impl.h"

namespace hf_w4 {
namespace {

struct V256 {
  using F = __m256;
  static constexpr int W = 16;
  static F zero() { return _mm256_setzero_ps(); }
  // 16 values: bf16 -> the even ones (low halves of the dwords, shifted up) and the odd ones (high halves, masked);
  // fp16 -> the two halves through vcvtph2ps
  template <bool BF16>
  static void widen(const uint16_t* p, F (&v)[2]) {
    if constexpr (BF16) {
      const __m256i d = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
      v[0] = _mm256_castsi256_ps(_mm256_slli_epi32(d, 16));
      v[1] = _mm256_castsi256_ps(_mm256_and_si256(d, _mm256_set1_epi32(int(0xffff0000u))));
    } else {
      v[0] = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
      v[1] = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)));
    }
  }
  static F fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static float sum(F v) {  // ((0+4) + (2+6)) + ((1+5) + (3+7))
    const __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 b = _mm_add_ps(a, _mm_movehl_ps(a, a));
    return _mm_cvtss_f32(_mm_add_ss(b, _mm_movehdup_ps(b)));
  }
};

}  // namespace

void dense_gemv_avx2(const DenseGemv& g, int64_t n0, int64_t n1) { dense_gemv_v<V256>(g, n0, n1); }

}  // namespace hf_w4

#else  // not x86: never called (cpu_caps() reports no AVX2)
#include <stdexcept>

#include "dense_gemv.h"

namespace hf_w4 {
void dense_gemv_avx2(const DenseGemv&, int64_t, int64_t) {
  throw std::runtime_error("hf_w4: the AVX2 dense GEMV is not built for this CPU architecture");
}
}  // namespace hf_w4
#endif
