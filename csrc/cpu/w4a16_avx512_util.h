// AVX-512 helpers shared by the W4A16 AVX-512 and AMX kernels. Include only from files compiled with an AVX-512
// `#pragma GCC target` (and after <immintrin.h>); internal linkage, so each file keeps its own copy.
#pragma once
#include <immintrin.h>
#include <cstdint>

namespace hf_w4 {
namespace {

// 16 fp8-e4m3 bytes -> fp32 (exact; NVFP4 scales are non-negative, the sign is kept anyway)
inline __m512 fp8x16_to_ps(const uint8_t* p) {
  const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m512i mag = _mm512_slli_epi32(_mm512_and_si512(b, _mm512_set1_epi32(0x7f)), 20);
  const __m512i sgn = _mm512_slli_epi32(_mm512_and_si512(b, _mm512_set1_epi32(0x80)), 24);
  return _mm512_mul_ps(_mm512_castsi512_ps(_mm512_or_si512(mag, sgn)), _mm512_set1_ps(0x1p120f));
}

}  // namespace
}  // namespace hf_w4
