// The AVX-512 intrinsics of the AVX-512 kernels (w4a16_avx512.cpp, int8_avx512.cpp, w4a16_avx512_util.h).
//
// Normally just <immintrin.h>. In the test-only build with HF_W4_EMULATE_AVX512 defined
// (tests/test_avx512_emulated.py), the same kernel sources run on an AVX2 CPU: the _mm512_* names resolve to
// SIMDe's portable versions (https://github.com/simd-everywhere/simde, headers only, fetched by .ci/setup from
// Debian's libsimde-dev; never part of a normal build), and the few intrinsics SIMDe 0.7 lacks or rounds
// differently from the hardware are written out below after Intel's pseudocode (AVX2 halves or element loops). This is how
// the AVX-512 paths get tested on CI machines without AVX-512; it checks their logic, not their speed.
#pragma once

#ifndef HF_W4_EMULATE_AVX512
#include <immintrin.h>
#define HF_W4_TARGET_AVX512BW __attribute__((target("avx512f,avx512bw")))
#else
// The emulated build is compiled with -mavx2 -mfma -mf16c -mbmi -mbmi2 as a whole (g++ does not let a
// #pragma GCC target switch SIMDe to its native AVX2 code), so the kernels need no target attributes there.
#define HF_W4_TARGET_AVX512BW
#define SIMDE_ENABLE_NATIVE_ALIASES
#include <simde/x86/avx512.h>

#include <cmath>
#include <cstdint>
#include <cstring>

namespace hf_w4_emu {

template <class T, int N, class V>
inline void get(T (&a)[N], const V& v) {
  static_assert(sizeof(a) == sizeof(v));
  std::memcpy(a, &v, sizeof(v));
}
template <class V, class T, int N>
inline V put(const T (&a)[N]) {
  static_assert(sizeof(a) == sizeof(V));
  V v;
  std::memcpy(&v, a, sizeof(v));
  return v;
}

template <class T, int N>
inline void masked_load(T (&a)[N], uint64_t k, const void* p) {
  for (int i = 0; i < N; ++i)
    if ((k >> i) & 1) std::memcpy(&a[i], static_cast<const char*>(p) + i * sizeof(T), sizeof(T));
    else a[i] = T(0);
}
template <class T, int N>
inline void masked_store(void* p, uint64_t k, const T (&a)[N]) {
  for (int i = 0; i < N; ++i)
    if ((k >> i) & 1) std::memcpy(static_cast<char*>(p) + i * sizeof(T), &a[i], sizeof(T));
}

inline simde__m256i maskz_loadu_epi16_256(simde__mmask16 k, const void* p) {
  int16_t a[16]; masked_load(a, k, p); return put<simde__m256i>(a);
}
inline void mask_storeu_epi16_256(void* p, simde__mmask16 k, simde__m256i v) {
  int16_t a[16]; get(a, v); masked_store(p, k, a);
}
inline void mask_storeu_epi16(void* p, simde__mmask32 k, simde__m512i v) {
  int16_t a[32]; get(a, v); masked_store(p, k, a);
}
inline void mask_storeu_ps(void* p, simde__mmask16 k, simde__m512 v) {
  float a[16]; get(a, v); masked_store(p, k, a);
}
inline void mask_storeu_epi32(void* p, simde__mmask16 k, simde__m512i v) {
  int32_t a[16]; get(a, v); masked_store(p, k, a);
}
inline simde__m512i maskz_loadu_epi8(simde__mmask64 k, const void* p) {
  int8_t a[64]; masked_load(a, k, p); return put<simde__m512i>(a);
}
inline simde__m512 maskz_loadu_ps(simde__mmask16 k, const void* p) {
  float a[16]; masked_load(a, k, p); return put<simde__m512>(a);
}
inline simde__mmask16 cmplt_epi32_mask(simde__m512i x, simde__m512i y) {
  int32_t a[16], b[16]; get(a, x); get(b, y);
  simde__mmask16 k = 0;
  for (int i = 0; i < 16; ++i) k |= static_cast<simde__mmask16>((a[i] < b[i]) << i);
  return k;
}
// vcvtps2dq with the default rounding (nearest even); nan and out of range give 0x80000000
inline simde__m512i cvtps_epi32(simde__m512 v) {
  float a[16]; get(a, v); int32_t r[16];
  for (int i = 0; i < 16; ++i)
    r[i] = a[i] >= -2147483648.0f && a[i] < 2147483648.0f ? static_cast<int32_t>(std::nearbyint(a[i])) : INT32_MIN;
  return put<simde__m512i>(r);
}
// element-wise static_cast: vpmovzx / vpmovsx (widen), vpmovdw / vpmovdb (truncate), vcvtdq2ps (exact or nearest)
template <class S, class D, int N, class VS, class VD>
inline VD convert(VS v) {
  S a[N]; get(a, v); D r[N];
  for (int i = 0; i < N; ++i) r[i] = static_cast<D>(a[i]);
  return put<VD>(r);
}
// fp16 <-> fp32 on the two 256-bit halves with F16C (the emulated build is compiled for AVX2 + FMA + F16C)
inline simde__m512 cvtph_ps(simde__m256i h) {
  __m128i a[2]; get(a, h); __m256 r[2] = {_mm256_cvtph_ps(a[0]), _mm256_cvtph_ps(a[1])};
  return put<simde__m512>(r);
}
#define hf_w4_emu_cvtps_ph(v, imm)                                                                     \
  ([](simde__m512 v_) {                                                                                 \
    __m256 a_[2]; hf_w4_emu::get(a_, v_);                                                               \
    __m128i r_[2] = {_mm256_cvtps_ph(a_[0], (imm)), _mm256_cvtps_ph(a_[1], (imm))};                     \
    return hf_w4_emu::put<simde__m256i>(r_);                                                            \
  }(v))
// vrndscaleps without scaling (imm bits 7:4 zero, as the kernels use it) and vcmpps into a mask: AVX's vroundps /
// vcmpps on the two halves (the same imm encodings)
#define hf_w4_emu_roundscale_ps(v, imm)                                                                \
  ([](simde__m512 v_) {                                                                                 \
    static_assert(((imm) & 0xf0) == 0, "emulated vrndscaleps: scale bits unsupported");                 \
    __m256 a_[2]; hf_w4_emu::get(a_, v_);                                                               \
    __m256 r_[2] = {_mm256_round_ps(a_[0], (imm)), _mm256_round_ps(a_[1], (imm))};                      \
    return hf_w4_emu::put<simde__m512>(r_);                                                             \
  }(v))
#define hf_w4_emu_cmp_ps_mask(a, b, imm)                                                               \
  ([](simde__m512 x_, simde__m512 y_) {                                                                 \
    __m256 a_[2], b_[2]; hf_w4_emu::get(a_, x_); hf_w4_emu::get(b_, y_);                                \
    return static_cast<simde__mmask16>(_mm256_movemask_ps(_mm256_cmp_ps(a_[0], b_[0], (imm))) |        \
                                       _mm256_movemask_ps(_mm256_cmp_ps(a_[1], b_[1], (imm))) << 8);   \
  }(a, b))
template <class T, int N>
inline T sum(const T (&a)[N]) {  // vector-halving order, as GCC's _mm512_reduce_add_* does
  T t[N];
  std::memcpy(t, a, sizeof(t));
  for (int w = N / 2; w >= 1; w /= 2)
    for (int i = 0; i < w; ++i) t[i] = t[i] + t[i + w];
  return t[0];
}
inline int32_t reduce_add_epi32(simde__m512i v) { int32_t a[16]; get(a, v); uint32_t s = 0; for (int32_t x : a) s += static_cast<uint32_t>(x); return static_cast<int32_t>(s); }
inline float reduce_add_ps(simde__m512 v) { float a[16]; get(a, v); return sum(a); }
inline uint32_t reduce_max_epu32(simde__m512i v) {
  uint32_t a[16]; get(a, v); uint32_t m = 0;
  for (uint32_t x : a) m = x > m ? x : m;
  return m;
}
// vandps with the sign mask (SIMDe 0.7 keeps -0.0 negative)
inline simde__m512 abs_ps(simde__m512 v) {
  uint32_t a[16]; get(a, v);
  for (uint32_t& x : a) x &= 0x7fffffffu;
  return put<simde__m512>(a);
}
// vshufi64x2: 128-bit lanes 0, 1 from a and 2, 3 from b, each picked by two bits of imm
inline simde__m512i shuffle_i64x2(simde__m512i a, simde__m512i b, int imm) {
  __m128i x[4], y[4], r[4]; get(x, a); get(y, b);
  for (int i = 0; i < 4; ++i) r[i] = (i < 2 ? x : y)[(imm >> (2 * i)) & 3];
  return put<simde__m512i>(r);
}
// the hardware's DAZ / FTZ (vdpbf16ps, vcvtne2ps2bf16 ignore MXCSR): a denormal counts as a zero of its sign
inline __m256 flush8(__m256 v) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  const __m256 tiny = _mm256_cmp_ps(_mm256_andnot_ps(sign, v), _mm256_set1_ps(0x1p-126f), _CMP_LT_OQ);
  return _mm256_blendv_ps(v, _mm256_and_ps(v, sign), tiny);
}
// vcvtne2ps2bf16: b -> elements 0..15, a -> 16..31; nearest even, denormal in -> signed zero, nan -> quiet
inline __m256i to_bf16x8_hw(__m256 v) {  // in the low 16 bits of each 32-bit lane
  const __m256i u = _mm256_castps_si256(flush8(v));
  const __m256i r = _mm256_srli_epi32(
      _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)),
                       _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1))), 16);
  const __m256i qnan = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
  return _mm256_blendv_epi8(r, qnan, _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
}
inline simde__m512bh cvtne2ps_pbh(simde__m512 a, simde__m512 b) {
  __m256 x[2], y[2]; get(x, a); get(y, b);
  const __m256 src[4] = {y[0], y[1], x[0], x[1]};
  uint32_t w[32]; uint16_t r[32];
  for (int h = 0; h < 4; ++h) _mm256_storeu_si256(reinterpret_cast<__m256i*>(w + 8 * h), to_bf16x8_hw(src[h]));
  for (int i = 0; i < 32; ++i) r[i] = static_cast<uint16_t>(w[i]);
  return put<simde__m512bh>(r);
}
// vdpbf16ps: per fp32 lane, += the odd pair's product, then += the even pair's (Intel's order), DAZ / FTZ (the
// bf16 x bf16 products are exact in fp32)
inline simde__m512 dpbf16_ps(simde__m512 src, simde__m512bh a, simde__m512bh b) {
  __m256 s[2]; __m256i x[2], y[2]; get(s, src); get(x, a); get(y, b);
  const __m256i hi = _mm256_set1_epi32(static_cast<int>(0xffff0000u));
  for (int h = 0; h < 2; ++h) {
    const __m256 xo = flush8(_mm256_castsi256_ps(_mm256_and_si256(x[h], hi)));
    const __m256 yo = flush8(_mm256_castsi256_ps(_mm256_and_si256(y[h], hi)));
    const __m256 xe = flush8(_mm256_castsi256_ps(_mm256_slli_epi32(x[h], 16)));
    const __m256 ye = flush8(_mm256_castsi256_ps(_mm256_slli_epi32(y[h], 16)));
    s[h] = flush8(_mm256_add_ps(flush8(s[h]), _mm256_mul_ps(xo, yo)));
    s[h] = flush8(_mm256_add_ps(s[h], _mm256_mul_ps(xe, ye)));
  }
  return put<simde__m512>(s);
}

}  // namespace hf_w4_emu

#define _mm256_maskz_loadu_epi16(k, p) hf_w4_emu::maskz_loadu_epi16_256(k, p)
#define _mm256_mask_storeu_epi16(p, k, v) hf_w4_emu::mask_storeu_epi16_256(p, k, v)
#define _mm512_mask_storeu_epi16(p, k, v) hf_w4_emu::mask_storeu_epi16(p, k, v)
#define _mm512_mask_storeu_ps(p, k, v) hf_w4_emu::mask_storeu_ps(p, k, v)
#define _mm512_mask_storeu_epi32(p, k, v) hf_w4_emu::mask_storeu_epi32(p, k, v)
#define _mm512_maskz_loadu_epi8(k, p) hf_w4_emu::maskz_loadu_epi8(k, p)
#define _mm512_maskz_loadu_ps(k, p) hf_w4_emu::maskz_loadu_ps(k, p)
#define _mm512_cmplt_epi32_mask(a, b) hf_w4_emu::cmplt_epi32_mask(a, b)
#define _mm512_cvtepi32_epi16(v) hf_w4_emu::convert<int32_t, int16_t, 16, simde__m512i, simde__m256i>(v)
#define _mm512_cvtepi32_epi8(v) hf_w4_emu::convert<int32_t, int8_t, 16, simde__m512i, simde__m128i>(v)
#define _mm512_cvtepi32_ps(v) hf_w4_emu::convert<int32_t, float, 16, simde__m512i, simde__m512>(v)
#define _mm512_cvtps_epi32(v) hf_w4_emu::cvtps_epi32(v)
#define _mm512_cvtepi8_epi32(v) hf_w4_emu::convert<int8_t, int32_t, 16, simde__m128i, simde__m512i>(v)
#define _mm512_cvtepu8_epi32(v) hf_w4_emu::convert<uint8_t, int32_t, 16, simde__m128i, simde__m512i>(v)
#define _mm512_cvtepu8_epi16(v) hf_w4_emu::convert<uint8_t, int16_t, 32, simde__m256i, simde__m512i>(v)
#define _mm512_cvtepu16_epi32(v) hf_w4_emu::convert<uint16_t, int32_t, 16, simde__m256i, simde__m512i>(v)
#define _mm512_cvtph_ps(v) hf_w4_emu::cvtph_ps(v)
#define _mm512_cvtps_ph(v, imm) hf_w4_emu_cvtps_ph(v, imm)
#define _mm512_reduce_add_epi32(v) hf_w4_emu::reduce_add_epi32(v)
#define _mm512_reduce_add_ps(v) hf_w4_emu::reduce_add_ps(v)
#define _mm512_reduce_max_epu32(v) hf_w4_emu::reduce_max_epu32(v)
#undef _mm512_roundscale_ps
#define _mm512_roundscale_ps(v, imm) hf_w4_emu_roundscale_ps(v, imm)
#undef _mm512_cmp_ps_mask
#define _mm512_cmp_ps_mask(a, b, imm) hf_w4_emu_cmp_ps_mask(a, b, imm)
#undef _mm512_abs_ps
#define _mm512_abs_ps(v) hf_w4_emu::abs_ps(v)
#define _mm512_shuffle_i64x2(a, b, imm) hf_w4_emu::shuffle_i64x2(a, b, imm)
#define _mm512_cvtne2ps_pbh(a, b) hf_w4_emu::cvtne2ps_pbh(a, b)
#undef _mm512_dpbf16_ps
#define _mm512_dpbf16_ps(s, a, b) hf_w4_emu::dpbf16_ps(s, a, b)
#endif
