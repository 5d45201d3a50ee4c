// hf_w4 int8 kernel: AVX2 path, with AVX-VNNI (vpdpbusd on ymm) when present, else exact emulations of
// vpdpbusd: vpmaddubsw with int16 accumulation for 4-bit weights, vpmaddwd for int8 weights. No torch headers;
// target attributes per function.
#include "int8_gemm.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>

#include <cstring>

#include "common/convert.h"
#include "common/dispatch.h"
#include "int8_gemm.h"

#define HF_TAVX2 __attribute__((target("avx2,fma,f16c,bmi,bmi2")))
#define HF_TAVX2I HF_TAVX2 __attribute__((always_inline)) inline
#define HF_TVNNI __attribute__((target("avx2,fma,f16c,bmi,bmi2,avxvnni")))
#define HF_TVNNII HF_TVNNI __attribute__((always_inline)) inline

namespace hf_w4_int8 {
namespace {

HF_TAVX2I __m256i bcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

// exact u8 x s8 quad dot (no saturation): even/odd bytes widened to 16 bit, vpmaddwd
HF_TAVX2I __m256i dp_emul(__m256i acc, __m256i b, __m256i a) {
  const __m256i m = _mm256_set1_epi16(0x00ff);
  const __m256i be = _mm256_and_si256(b, m), bo = _mm256_srli_epi16(b, 8);
  const __m256i ae = _mm256_srai_epi16(_mm256_slli_epi16(a, 8), 8), ao = _mm256_srai_epi16(a, 8);
  return _mm256_add_epi32(acc, _mm256_add_epi32(_mm256_madd_epi16(be, ae), _mm256_madd_epi16(bo, ao)));
}

// the 4 lines of a 256-byte weight step 2 KiB ahead
HF_TAVX2I void prefetch4(const uint8_t* p) {
  for (int i = 0; i < 4; ++i) _mm_prefetch((const char*)p + 2048 + 64 * i, _MM_HINT_T0);
}

#define HF2_ROWS(X) X(0) X(1) X(2)
#define HF2_DECL(r) __m256i c##r##0, c##r##1, c##r##2, c##r##3;
#define HF2_INIT(r)                                                                         \
  if constexpr (MR > r) {                                                                   \
    if (load_ci) {                                                                          \
      c##r##0 = _mm256_loadu_si256((const __m256i*)(a.ci + r * NR + 32 * h));               \
      c##r##1 = _mm256_loadu_si256((const __m256i*)(a.ci + r * NR + 32 * h + 8));           \
      c##r##2 = _mm256_loadu_si256((const __m256i*)(a.ci + r * NR + 32 * h + 16));          \
      c##r##3 = _mm256_loadu_si256((const __m256i*)(a.ci + r * NR + 32 * h + 24));          \
    } else {                                                                                \
      c##r##0 = c##r##1 = c##r##2 = c##r##3 = _mm256_setzero_si256();                       \
    }                                                                                       \
  }
#define HF2_SAVE(r)                                                                         \
  if constexpr (MR > r) {                                                                   \
    _mm256_storeu_si256((__m256i*)(dst + r * NR + 32 * h), c##r##0);                        \
    _mm256_storeu_si256((__m256i*)(dst + r * NR + 32 * h + 8), c##r##1);                    \
    _mm256_storeu_si256((__m256i*)(dst + r * NR + 32 * h + 16), c##r##2);                   \
    _mm256_storeu_si256((__m256i*)(dst + r * NR + 32 * h + 24), c##r##3);                   \
  }
#define HF2_A(r) const __m256i a##r = (MR > r) ? bcast4(AQ + r * 4) : _mm256_setzero_si256();
#define HF2_DP(r, J, BV) if constexpr (MR > r) c##r##J = DPF(c##r##J, BV, a##r);
#define HF2_J(J, BV) HF2_DP(0, J, BV) HF2_DP(1, J, BV) HF2_DP(2, J, BV)

#define HF2_TILE(NAME, TGT)                                                            \
  template <int MR, bool OTF>                                                               \
  TGT __attribute__((noinline)) void NAME(const TileArgs& a) {                              \
    const int64_t Gp = a.Gp;                                                                \
    const __m256i mask = _mm256_set1_epi8(0x0f);                                            \
    alignas(64) int32_t accm[MR * NR];                                                      \
    for (int64_t g = a.s0 / Gp; g * Gp < a.s1; ++g) {                                       \
      const int64_t gs0 = g * Gp > a.s0 ? g * Gp : a.s0;                                    \
      const int64_t gs1 = (g + 1) * Gp < a.s1 ? (g + 1) * Gp : a.s1;                        \
      const bool load_ci = gs0 % Gp != 0, store_ci = gs1 % Gp != 0;                         \
      int32_t* dst = store_ci ? a.ci : accm;                                                \
      for (int h = 0; h < 2; ++h) {                                                         \
        HF2_ROWS(HF2_DECL)                                                                  \
        HF2_ROWS(HF2_INIT)                                                                  \
        const int8_t* A = a.a + (gs0 / 4) * a.qs;                                        \
        const bool pf = a.stream && h == 0;  /* the first half pulls the weights from memory */  \
        if constexpr (!OTF) {                                                               \
          const uint8_t* B = a.b + (gs0 - a.kb0) * NR + 128 * h;                            \
          const int64_t nq = (gs1 - gs0) / 4;                                               \
          for (int64_t q = 0; q < nq; ++q) {                                                \
            if (pf) prefetch4(B);                                                           \
            const int8_t* AQ = A;                                                           \
            HF2_ROWS(HF2_A)                                                                 \
            __m256i b = _mm256_loadu_si256((const __m256i*)B);                              \
            HF2_J(0, b)                                                                     \
            b = _mm256_loadu_si256((const __m256i*)(B + 32));                               \
            HF2_J(1, b)                                                                     \
            b = _mm256_loadu_si256((const __m256i*)(B + 64));                               \
            HF2_J(2, b)                                                                     \
            b = _mm256_loadu_si256((const __m256i*)(B + 96));                               \
            HF2_J(3, b)                                                                     \
            A += a.qs;                                                                   \
            B += 256;                                                                       \
          }                                                                                 \
        } else {                                                                            \
          const uint8_t* B = a.b + (gs0 - a.kb0) * (NR / 2) + 128 * h;                      \
          const int64_t nq2 = (gs1 - gs0) / 8;                                              \
          for (int64_t q2 = 0; q2 < nq2; ++q2) {                                            \
            if (pf) prefetch4(B);                                                           \
            {                                                                               \
              const int8_t* AQ = A;                                                         \
              HF2_ROWS(HF2_A)                                                               \
              for (int j = 0; j < 4; ++j) {                                                 \
                const __m256i b = _mm256_and_si256(                                         \
                    _mm256_loadu_si256((const __m256i*)(B + 32 * j)), mask);                \
                if (j == 0) { HF2_J(0, b) } else if (j == 1) { HF2_J(1, b) }                \
                else if (j == 2) { HF2_J(2, b) } else { HF2_J(3, b) }                       \
              }                                                                             \
            }                                                                               \
            {                                                                               \
              const int8_t* AQ = A + a.qs;                                               \
              HF2_ROWS(HF2_A)                                                               \
              for (int j = 0; j < 4; ++j) {                                                 \
                const __m256i b = _mm256_and_si256(                                         \
                    _mm256_srli_epi16(_mm256_loadu_si256((const __m256i*)(B + 32 * j)), 4), mask); \
                if (j == 0) { HF2_J(0, b) } else if (j == 1) { HF2_J(1, b) }                \
                else if (j == 2) { HF2_J(2, b) } else { HF2_J(3, b) }                       \
              }                                                                             \
            }                                                                               \
            A += 2 * a.qs;                                                               \
            B += 256;                                                                       \
          }                                                                                 \
        }                                                                                   \
        HF2_ROWS(HF2_SAVE)                                                                  \
      }                                                                                     \
      if (store_ci) continue;                                                               \
      epilogue_avx2<MR>(a, g, accm);                                                        \
    }                                                                                       \
  }

template <int MR>
HF_TAVX2I void epilogue_avx2(const TileArgs& a, int64_t g, const int32_t* accm) {
  const float* sc = a.scales + g * NR;
  const int32_t* zp = a.zeros ? a.zeros + g * NR : nullptr;
  for (int r = 0; r < MR; ++r) {
    const int32_t as = a.asum[r * a.G + g];
    const __m256i asv = _mm256_set1_epi32(as), comp = _mm256_set1_epi32(a.zconst * as);
    const __m256 sx = _mm256_set1_ps(a.ascale ? a.ascale[r * a.G + g] : 1.f);
    float* c = a.cf + r * NR;
    for (int j = 0; j < 8; ++j) {
      const __m256i acc = _mm256_load_si256((const __m256i*)(accm + r * NR + 8 * j));
      const __m256i t = zp ? _mm256_sub_epi32(acc, _mm256_mullo_epi32(_mm256_loadu_si256((const __m256i*)(zp + 8 * j)), asv))
                           : _mm256_sub_epi32(acc, comp);
      const __m256 v = _mm256_cvtepi32_ps(t);
      __m256 s = _mm256_loadu_ps(sc + 8 * j);
      if (a.ascale) s = _mm256_mul_ps(s, sx);
      if (g == 0) _mm256_storeu_ps(c + 8 * j, _mm256_mul_ps(v, s));
      else _mm256_storeu_ps(c + 8 * j, _mm256_fmadd_ps(v, s, _mm256_loadu_ps(c + 8 * j)));
    }
  }
}

HF_TVNNII __m256i dp_vnni(__m256i acc, __m256i b, __m256i a) { return _mm256_dpbusd_avx_epi32(acc, b, a); }

#define DPF dp_vnni
HF2_TILE(tile_vnni, HF_TVNNI)
#undef DPF
#define DPF dp_emul
HF2_TILE(tile_plain, HF_TAVX2)
#undef DPF

// 4-bit weights without VNNI: codes u8 0..15 x activations s8 by vpmaddubsw (a pair sums to at most 2 x 15 x 128 =
// 3840, so no saturation), the int16 pair sums accumulated over 8 quads (at most 30720 < 32767), then widened by
// vpmaddwd with ones: ~2.25 vector ops per 32 products and row where dp_emul takes ~4 (its widening of both operands).
// Exact: the same integers as vpdpbusd, so the same results bit for bit.
constexpr int kNibQuads = 8;  // quads per int16 accumulation (the bound above)

template <int MR>
HF_TAVX2I void nib_quad(const __m256i (&b)[4], const int8_t* AQ, __m256i (&s)[MR][4]) {
  for (int r = 0; r < MR; ++r) {
    const __m256i ar = bcast4(AQ + r * 4);
    for (int j = 0; j < 4; ++j) s[r][j] = _mm256_add_epi16(s[r][j], _mm256_maddubs_epi16(b[j], ar));
  }
}

template <int MR>
HF_TAVX2I void nib_flush(__m256i (&s)[MR][4], __m256i (&c)[MR][4]) {
  const __m256i ones = _mm256_set1_epi16(1);
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < 4; ++j) {
      c[r][j] = _mm256_add_epi32(c[r][j], _mm256_madd_epi16(s[r][j], ones));
      s[r][j] = _mm256_setzero_si256();
    }
}

template <int MR, bool OTF>
HF_TAVX2 __attribute__((noinline)) void tile_nib(const TileArgs& a) {
  const int64_t Gp = a.Gp;
  const __m256i mask = _mm256_set1_epi8(0x0f);
  alignas(64) int32_t accm[MR * NR];
  for (int64_t g = a.s0 / Gp; g * Gp < a.s1; ++g) {
    const int64_t gs0 = g * Gp > a.s0 ? g * Gp : a.s0;
    const int64_t gs1 = (g + 1) * Gp < a.s1 ? (g + 1) * Gp : a.s1;
    const bool load_ci = gs0 % Gp != 0, store_ci = gs1 % Gp != 0;
    int32_t* dst = store_ci ? a.ci : accm;
    for (int h = 0; h < 2; ++h) {
      __m256i c[MR][4], s[MR][4];
      for (int r = 0; r < MR; ++r)
        for (int j = 0; j < 4; ++j) {
          c[r][j] = load_ci ? _mm256_loadu_si256((const __m256i*)(a.ci + r * NR + 32 * h + 8 * j))
                            : _mm256_setzero_si256();
          s[r][j] = _mm256_setzero_si256();
        }
      const int8_t* A = a.a + (gs0 / 4) * a.qs;
      const bool pf = a.stream && h == 0;  // the first half pulls the weights from memory
      const int64_t nq = (gs1 - gs0) / 4;  // even: Gp and block bounds are multiples of 8
      if constexpr (!OTF) {
        const uint8_t* B = a.b + (gs0 - a.kb0) * NR + 128 * h;
        for (int64_t q = 0; q < nq; q += kNibQuads) {
          const int64_t qe = q + kNibQuads < nq ? q + kNibQuads : nq;
          for (int64_t i = q; i < qe; ++i) {
            if (pf) prefetch4(B);
            const __m256i b[4] = {_mm256_loadu_si256((const __m256i*)B), _mm256_loadu_si256((const __m256i*)(B + 32)),
                                  _mm256_loadu_si256((const __m256i*)(B + 64)),
                                  _mm256_loadu_si256((const __m256i*)(B + 96))};
            nib_quad<MR>(b, A, s);
            A += a.qs;
            B += 256;
          }
          nib_flush<MR>(s, c);
        }
      } else {  // quad pairs: the low nibbles are quad 2i, the high nibbles quad 2i + 1
        const uint8_t* B = a.b + (gs0 - a.kb0) * (NR / 2) + 128 * h;
        for (int64_t q = 0; q < nq; q += kNibQuads) {
          const int64_t qe = q + kNibQuads < nq ? q + kNibQuads : nq;
          for (int64_t i = q; i < qe; i += 2) {
            if (pf) prefetch4(B);
            __m256i raw[4], b[4];
            for (int j = 0; j < 4; ++j) {
              raw[j] = _mm256_loadu_si256((const __m256i*)(B + 32 * j));
              b[j] = _mm256_and_si256(raw[j], mask);
            }
            nib_quad<MR>(b, A, s);
            for (int j = 0; j < 4; ++j) b[j] = _mm256_and_si256(_mm256_srli_epi16(raw[j], 4), mask);
            nib_quad<MR>(b, A + a.qs, s);
            A += 2 * a.qs;
            B += 256;
          }
          nib_flush<MR>(s, c);
        }
      }
      for (int r = 0; r < MR; ++r)
        for (int j = 0; j < 4; ++j) _mm256_storeu_si256((__m256i*)(dst + r * NR + 32 * h + 8 * j), c[r][j]);
    }
    if (store_ci) continue;
    epilogue_avx2<MR>(a, g, accm);
  }
}

template <int MR, bool OTF, bool VNNI>
inline void tile_avx2(const TileArgs& a) {
  if constexpr (VNNI) tile_vnni<MR, OTF>(a);
  else if (a.w4) tile_nib<MR, OTF>(a);
  else tile_plain<MR, OTF>(a);
}

template <bool VNNI>
struct TAvx2 {
  static constexpr int MR = VNNI ? 3 : 2;
  static constexpr bool kFusedDecode = false;
  static constexpr int64_t kKcInt8 = KC;
  static void tile(const TileArgs& a) {
    hf_w4::with_rows<1, 2, MR>(a.mr, [&](auto r) {
      if (a.otf) tile_avx2<decltype(r)::value, true, VNNI>(a);
      else tile_avx2<decltype(r)::value, false, VNNI>(a);
    });
  }
  HF_TAVX2 static void decode(const uint8_t* src, uint8_t* dst, int64_t nq2) {
    const __m256i mask = _mm256_set1_epi8(0x0f);
    for (int64_t q2 = 0; q2 < nq2; ++q2)
      for (int j = 0; j < 8; ++j) {
        const __m256i raw = _mm256_loadu_si256((const __m256i*)(src + q2 * 256 + 32 * j));
        _mm256_storeu_si256((__m256i*)(dst + q2 * 512 + 32 * j), _mm256_and_si256(raw, mask));
        _mm256_storeu_si256((__m256i*)(dst + q2 * 512 + 256 + 32 * j),
                            _mm256_and_si256(_mm256_srli_epi16(raw, 4), mask));
      }
  }
  HF_TAVX2 static void store_rows(const float* cf, int64_t rows, char* out, int64_t ldo, int ot, int64_t ncols,
                                  const float* afinal, const float* bias) {
    for (int64_t r = 0; r < rows; ++r) {
      const float sxs = afinal ? afinal[r] : 1.f;
      const __m256 sx = _mm256_set1_ps(sxs);
      int64_t n = 0;
      for (; n + 8 <= ncols; n += 8) {
        __m256 v = _mm256_mul_ps(_mm256_loadu_ps(cf + r * NR + n), sx);
        if (bias) v = _mm256_add_ps(v, _mm256_loadu_ps(bias + n));
        if (ot == OUT_F32) _mm256_storeu_ps((float*)out + r * ldo + n, v);
        else if (ot == OUT_BF16) _mm_storeu_si128((__m128i*)((uint16_t*)out + r * ldo + n), hf_w4::f32x8_to_bf16(v));
        else _mm_storeu_si128((__m128i*)((uint16_t*)out + r * ldo + n),
                              _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
      }
      for (; n < ncols; ++n) {
        float v = cf[r * NR + n] * sxs;
        if (bias) v += bias[n];
        if (ot == OUT_F32) ((float*)out)[r * ldo + n] = v;
        else if (ot == OUT_BF16) ((uint16_t*)out)[r * ldo + n] = f32_to_bf16_bits(v);
        else ((uint16_t*)out)[r * ldo + n] = f32_to_f16_bits(v);
      }
    }
  }
};

HF_TAVX2I __m256 load8(const void* x, int t, int64_t i) {
  if (t == OUT_F32) return _mm256_loadu_ps((const float*)x + i);
  const __m128i h = _mm_loadu_si128((const __m128i*)((const uint16_t*)x + i));
  if (t == OUT_BF16) return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  return _mm256_cvtph_ps(h);
}

HF_TAVX2I int32_t hsum8(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
  return _mm_cvtsi128_si32(s);
}

inline float x1(const char* xr, int t, int64_t c) {
  return t == OUT_F32 ? ((const float*)xr)[c]
         : t == OUT_BF16 ? bf16_bits_to_f32(((const uint16_t*)xr)[c]) : f16_bits_to_f32(((const uint16_t*)xr)[c]);
}

// the abs_bits maximum of p[0..n) (see act_scale)
HF_TAVX2I uint32_t amax_bits(const float* p, int64_t n) {
  const __m256i mag = _mm256_set1_epi32(0x7fffffff);
  __m256i mx = _mm256_setzero_si256();
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) mx = _mm256_max_epi32(mx, _mm256_and_si256(_mm256_loadu_si256((const __m256i*)(p + j)), mag));
  __m128i m = _mm_max_epi32(_mm256_castsi256_si128(mx), _mm256_extracti128_si256(mx, 1));
  m = _mm_max_epi32(m, _mm_shuffle_epi32(m, 0x4e));
  m = _mm_max_epi32(m, _mm_shuffle_epi32(m, 0xb1));
  uint32_t m1 = (uint32_t)_mm_cvtsi128_si32(m);
  for (; j < n; ++j) m1 = std::max(m1, abs_bits(p[j]));
  return m1;
}

HF_TAVX2 void quant_tiles_impl(const QuantArgs& q, int64_t t0, int64_t t1) {
  const Geometry& g = q.g;
  const int64_t K = g.K, gs = g.gs, Gp = g.Gp;
  float* buf = (float*)thread_scratch(3, (size_t)(K + 8) * 4);
  const __m256 lo = _mm256_set1_ps(-128.f), hi = _mm256_set1_ps(127.f);
  const int es = q.in_type == OUT_F32 ? 4 : 2;
  for (int64_t t = t0; t < t1; ++t) {
    int8_t* At = q.A + t * MRA * g.Kp;
    for (int r = 0; r < MRA; ++r) {
      const int64_t m = t * MRA + r;
      if (m >= q.M) break;
      int8_t* Ar = At + r * 4;
      const int64_t QS = 4 * tile_rows(t, q.M);
      const char* xr = (const char*)q.x + m * q.ldx * es;
      if (q.perm) {
        for (int64_t j = 0; j < K; ++j) buf[j] = x1(xr, q.in_type, q.perm[j]);
      } else {
        int64_t j = 0;
        for (; j + 8 <= K; j += 8) _mm256_storeu_ps(buf + j, load8(xr, q.in_type, j));
        for (; j < K; ++j) buf[j] = x1(xr, q.in_type, j);
      }
      float s_tok = 0.f;
      if (!q.act_group) {
        s_tok = act_scale(amax_bits(buf, K));
        q.ascale[m] = s_tok;
      }
      for (int64_t gi = 0; gi < g.G; ++gi) {
        const float* xg = buf + gi * gs;
        float s = s_tok;
        if (q.act_group) {
          s = act_scale(amax_bits(xg, gs));
          q.ascale[m * g.G + gi] = s;
        }
        const __m256 sv = _mm256_set1_ps(s);
        __m256i vsum = _mm256_setzero_si256();
        int64_t j = 0;
        for (; j + 8 <= gs; j += 8) {
          __m256 v = _mm256_div_ps(_mm256_loadu_ps(xg + j), sv);
          v = _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
          v = _mm256_min_ps(_mm256_max_ps(v, lo), hi);
          const __m256i qi = _mm256_cvtps_epi32(v);
          vsum = _mm256_add_epi32(vsum, qi);
          const __m128i p16 = _mm_packs_epi32(_mm256_castsi256_si128(qi), _mm256_extracti128_si256(qi, 1));
          const __m128i p8 = _mm_packs_epi16(p16, p16);
          alignas(16) int8_t tmp[16];
          _mm_store_si128((__m128i*)tmp, p8);
          const int64_t kp = gi * Gp + j;  // multiple of 4 (Gp % 8 == 0, j % 8 == 0)
          std::memcpy(Ar + (kp / 4) * QS, tmp, 4);
          std::memcpy(Ar + (kp / 4 + 1) * QS, tmp + 4, 4);
        }
        int32_t sum = hsum8(vsum);
        for (; j < Gp; ++j) {
          const int64_t kp = gi * Gp + j;
          int8_t v = 0;
          if (j < gs) v = q8(xg[j], s);
          sum += v;
          Ar[(kp / 4) * QS + kp % 4] = v;
        }
        q.asum[m * g.G + gi] = sum;
      }
    }
  }
}

}  // namespace

void gemm_items_avx2(const Plan& p, int64_t i0, int64_t i1, bool vnni) {
  if (vnni) run_items<TAvx2<true>>(p, i0, i1);
  else run_items<TAvx2<false>>(p, i0, i1);
}
void quant_tiles_avx2(const QuantArgs& q, int64_t t0, int64_t t1) { quant_tiles_impl(q, t0, t1); }

}  // namespace hf_w4_int8

#else  // not x86: the portable path stands in
namespace hf_w4_int8 {
void gemm_items_avx2(const Plan& p, int64_t i0, int64_t i1, bool) { gemm_items_generic(p, i0, i1); }
void quant_tiles_avx2(const QuantArgs& q, int64_t t0, int64_t t1) { quant_tiles_generic(q, t0, t1); }
}  // namespace hf_w4_int8
#endif
