// AVX-512 helpers shared by the W4A16 AVX-512 and AMX kernels. Include only from files compiled with an AVX-512
// `#pragma GCC target`; internal linkage, so each file keeps its own copy.
#pragma once
#include "common/simd512.h"
#include <cstdint>

#include "common/convert.h"
#include "w4a16.h"

namespace hf_w4 {
namespace {

// 32 fp8-e4m3 block scales of the kernel layout (sign bit clear, see w4a16.h) -> their fp16 bit patterns, value /
// 2^8, exact: e4m3 is fp16 with the exponent bias 8 lower and 7 fewer mantissa bits, so b << 7 is the fp16 pattern
// (denormals included). vcvtph2ps then converts fp16 denormals exactly whatever MXCSR.DAZ says (building the fp32
// denormal and multiplying it up returned 0 for the e4m3 denormals, scales below 2^-6, under
// torch.set_flush_denormal(True)).
inline __m512i fp8x32_to_ph_bits(const uint8_t* p) {
  return _mm512_slli_epi16(_mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 7);
}

// 32 such bytes -> fp32 (columns 0..15, 16..31) times factor / 2^8
inline void fp8x32_to_ps(const uint8_t* p, float factor, __m512& s0, __m512& s1) {
  const __m512i h = fp8x32_to_ph_bits(p);
  const __m512 f = _mm512_set1_ps(factor);
  s0 = _mm512_mul_ps(_mm512_cvtph_ps(_mm512_castsi512_si256(h)), f);
  s1 = _mm512_mul_ps(_mm512_cvtph_ps(_mm512_extracti64x4_epi64(h, 1)), f);
}

// the 32 columns' group scales at offset so of g.scales (fp32, or NVFP4 fp8 bytes) -> columns 0..15, 16..31
template <int MODE>
inline void load_scales(const W4Gemm& g, int64_t so, __m512& s0, __m512& s1) {
  if (MODE == W4_NVFP4) {
    fp8x32_to_ps(static_cast<const uint8_t*>(g.scales) + so, 256.0f, s0, s1);
  } else {
    const float* p = static_cast<const float*>(g.scales) + so;
    s0 = _mm512_loadu_ps(p);
    s1 = _mm512_loadu_ps(p + 16);
  }
}

// w4a16_store_row (w4a16_common.h) vectorized, with the same result bit for bit: v[0..cnt) * gscale + bias of
// output row m, columns n0.. (clipped at N), converted to the output dtype. The AMX epilogue stores every output
// element through here (per element, the scalar version cost ~10-20% of a 2048x2048 M=1024 call).
inline void store_row_avx512(const W4Gemm& g, int64_t m, int64_t n0, const float* v, int64_t cnt) {
  if (n0 + cnt > g.N) cnt = g.N - n0;
  const __m512 gs = _mm512_set1_ps(g.gscale);
  for (int64_t i = 0; i < cnt; i += 16) {
    const int64_t left = cnt - i;
    const __mmask16 mk = left >= 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << left) - 1);
    // mul, then add (+0 without a bias, which turns -0 into +0): no FMA, as in the scalar
    const __m512 y = _mm512_add_ps(_mm512_mul_ps(_mm512_maskz_loadu_ps(mk, v + i), gs),
                                   g.bias ? _mm512_maskz_loadu_ps(mk, g.bias + n0 + i) : _mm512_setzero_ps());
    const int64_t off = m * g.ldo + n0 + i;
    if (g.out_dtype == DT_F32) {
      _mm512_mask_storeu_ps(static_cast<float*>(g.out) + off, mk, y);
    } else {
      const __m256i h = g.out_dtype == DT_BF16 ? f32x16_to_bf16(y)
                                               : _mm512_cvtps_ph(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      _mm256_mask_storeu_epi16(static_cast<uint16_t*>(g.out) + off, mk, h);
    }
  }
}

}  // namespace
}  // namespace hf_w4
