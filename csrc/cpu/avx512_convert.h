// AVX-512 fp32 -> 16-bit conversions shared by the W4A16 and int8 kernels.
// static inline with its own target attribute, so it inlines into any caller built for AVX-512 F/BW.
#pragma once
#include "simd512.h"

namespace hf_w4 {

// 16 fp32 -> bf16 bits, round to nearest even, NaN -> quiet NaN: bit for bit the scalar f32_to_bf16_bits
// (w4a16_common.h), denormals included (vcvtneps2bf16 would flush those)
HF_W4_TARGET_AVX512BW __attribute__((always_inline)) static inline __m256i f32x16_to_bf16(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb);
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  r = _mm512_mask_mov_epi32(r, nan, _mm512_or_si512(u, _mm512_set1_epi32(0x400000)));
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16));
}

}  // namespace hf_w4
