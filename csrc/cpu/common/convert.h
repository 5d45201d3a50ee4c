// Float conversions shared by every CPU kernel: fp32 <-> bf16 and fp32 <-> fp16 bits, scalar, AVX2 and AVX-512,
// all bit for bit the same: round to nearest even, NaN kept (as a quiet NaN), denormals kept (vcvtneps2bf16 would
// flush them, so the vector versions round by integer arithmetic). The SIMD versions carry their own target
// attributes and inline into any caller built for that ISA.
#pragma once
#include <cstdint>
#include <cstring>

#if defined(__x86_64__) || defined(_M_X64)
#include "simd512.h"
#endif

namespace hf_w4 {

inline uint16_t f32_to_bf16_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

inline float bf16_bits_to_f32(uint16_t h) {
  const uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline float f16_bits_to_f32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
  const uint32_t e = (h >> 10) & 31, m = h & 1023;
  uint32_t u;
  if (e == 0) {
    if (m == 0) {
      u = sign;
    } else {  // subnormal: normalize
      int sh = 0;
      uint32_t mm = m;
      while (!(mm & 1024)) { mm <<= 1; ++sh; }
      u = sign | (static_cast<uint32_t>(127 - 15 + 1 - sh) << 23) | ((mm & 1023) << 13);
    }
  } else if (e == 31) {
    u = sign | 0x7f800000u | (m << 13);
  } else {
    u = sign | ((e + 127 - 15) << 23) | (m << 13);
  }
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t f32_to_f16_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000);
  const uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return sign | 0x7e00;
  if (a >= 0x477ff000u) return sign | 0x7c00;  // rounds to inf
  if (a < 0x38800000u) {                       // subnormal or zero in fp16
    if (a < 0x33000000u) return sign;          // < 2^-25 -> 0 (2^-25 exactly ties to even 0)
    const uint32_t e = a >> 23, m = (a & 0x7fffff) | 0x800000;
    const int shift = 126 - static_cast<int>(e);  // value = m * 2^(e-150); fp16 subnormal unit 2^-24
    uint32_t r = m >> shift;
    const uint32_t rem = m & ((1u << shift) - 1), half = 1u << (shift - 1);
    if (rem > half || (rem == half && (r & 1))) ++r;
    return sign | static_cast<uint16_t>(r);
  }
  uint32_t r = a - 0x38000000u;  // rebias the exponent by (127 - 15) << 23
  r += 0xfffu + ((r >> 13) & 1u);
  return sign | static_cast<uint16_t>(r >> 13);
}

#if defined(__x86_64__) || defined(_M_X64)

// 8 fp32 -> 8 bf16 bits (f32_to_bf16_bits per lane)
__attribute__((target("avx2"), always_inline)) static inline __m128i f32x8_to_bf16(__m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  r = _mm256_blendv_epi8(r, _mm256_or_si256(u, _mm256_set1_epi32(0x400000)), nan);
  r = _mm256_srli_epi32(r, 16);
  return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}

// 16 fp32 -> 16 bf16 bits (f32_to_bf16_bits per lane)
HF_W4_TARGET_AVX512BW __attribute__((always_inline)) static inline __m256i f32x16_to_bf16(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb);
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  r = _mm512_mask_mov_epi32(r, nan, _mm512_or_si512(u, _mm512_set1_epi32(0x400000)));
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16));
}

#endif

}  // namespace hf_w4
