// hf_w4 int8 kernel: AVX-512 (F/BW/VL/DQ + VNNI) path. No torch headers; target attributes per function
// so the rest of the library stays baseline x86-64.
#include "int8_gemm.h"

#if defined(__x86_64__) || defined(__i386__)
#include "common/simd512.h"

#include <cstring>

#include "common/amx_tiles.h"
#include "common/cpu_features.h"
#include "common/convert.h"
#include "common/dispatch.h"
#include "int8_gemm.h"

#ifndef HF_W4_EMULATE_AVX512
#define HF_T512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c,bmi,bmi2")))
#else  // the test-only emulated build (common/simd512.h)
#define HF_T512
#endif
#define HF_T512I HF_T512 __attribute__((always_inline)) inline
// software prefetch distance of the weight stream (bytes): int4 nibble panels (HF_PF) and int8 panels (HF_PF8,
// twice the bytes per weight); the best of 2, 4 and 8 KiB at M = 1-6 (docs/cpu-kernels.md, "Tuning notes").
#ifndef HF_PF
#define HF_PF 2048
#endif
#ifndef HF_PF8
#define HF_PF8 4096
#endif
// Also prefetched into L2 HF_PFF bytes ahead (int8 panels: twice that), as the W4A16 int16 kernel does
// (kW4PrefetchFarBytes): 3-10 % faster at M = 1-4.
// Only where no row tile prefetches the next block (TileArgs::pfn == 0: one row tile): with several, the far
// prefetch of the first tile only duplicated theirs and held fill buffers (5-10 % slower with it).
#ifndef HF_PFF
#define HF_PFF 32768
#endif

namespace hf_w4_int8 {
namespace {
// AMD (Zen 5): a single row tile streams its int8 weights fastest with the hardware prefetcher alone at 1-2 rows,
// and with only an 8 KiB prefetch into L2 at 3-6 rows; the 4 KiB (L1) + 64 KiB (L2) prefetches made M = 1 10-25 %
// slower there (docs/cpu-kernels.md, "Tuning notes")
const bool kHwStream8 = hf_w4::cpu_caps().amd;
constexpr int64_t kHwStreamFar = 8192;

HF_T512I __m512i bcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

// accumulators as named registers (GCC keeps arrays of vectors in memory inside hot loops)
#define HF_ROWS(X) X(0) X(1) X(2) X(3) X(4) X(5)
#define HF_DECL(r) __m512i c##r##0, c##r##1, c##r##2, c##r##3;
// a group's accumulators start at -zero * sum(a) (the u8 offset / zero point compensation), so the epilogue is
// a plain convert + scale
#define HF_INIT(r)                                                                   \
  if constexpr (MR > r) {                                                            \
    if (load_ci) {                                                                   \
      c##r##0 = _mm512_loadu_si512(a.ci + r * NR);                                   \
      c##r##1 = _mm512_loadu_si512(a.ci + r * NR + 16);                              \
      c##r##2 = _mm512_loadu_si512(a.ci + r * NR + 32);                              \
      c##r##3 = _mm512_loadu_si512(a.ci + r * NR + 48);                              \
    } else if (zp) {                                                                 \
      const __m512i nas = _mm512_set1_epi32(-a.asum[r * a.G + g]);                   \
      c##r##0 = _mm512_mullo_epi32(_mm512_loadu_si512(zp), nas);                     \
      c##r##1 = _mm512_mullo_epi32(_mm512_loadu_si512(zp + 16), nas);                \
      c##r##2 = _mm512_mullo_epi32(_mm512_loadu_si512(zp + 32), nas);                \
      c##r##3 = _mm512_mullo_epi32(_mm512_loadu_si512(zp + 48), nas);                \
    } else {                                                                         \
      c##r##0 = c##r##1 = c##r##2 = c##r##3 = _mm512_set1_epi32(-a.zconst * a.asum[r * a.G + g]); \
    }                                                                                \
  }
#define HF_EPI1(r, J)                                                                \
  {                                                                                  \
    const __m512 v = _mm512_cvtepi32_ps(c##r##J);                                    \
    const __m512 s = a.ascale ? _mm512_mul_ps(sv##J, sx) : sv##J;                    \
    float* cp = a.cf + r * NR + 16 * J;                                              \
    _mm512_storeu_ps(cp, first ? _mm512_mul_ps(v, s) : _mm512_fmadd_ps(v, s, _mm512_loadu_ps(cp))); \
  }
#define HF_EPI(r)                                                                    \
  if constexpr (MR > r) {                                                            \
    const __m512 sx = _mm512_set1_ps(a.ascale ? a.ascale[r * a.G + g] : 1.f);        \
    HF_EPI1(r, 0) HF_EPI1(r, 1) HF_EPI1(r, 2) HF_EPI1(r, 3)                          \
  }
#define HF_SAVE(r)                                                                   \
  if constexpr (MR > r) {                                                            \
    _mm512_store_si512(dst + r * NR, c##r##0);                                       \
    _mm512_store_si512(dst + r * NR + 16, c##r##1);                                  \
    _mm512_store_si512(dst + r * NR + 32, c##r##2);                                  \
    _mm512_store_si512(dst + r * NR + 48, c##r##3);                                  \
  }
#define HF_STEP4(r)                                                                  \
  if constexpr (MR > r) {                                                            \
    const __m512i av = bcast4(A + r * 4);                                            \
    c##r##0 = _mm512_dpbusd_epi32(c##r##0, b0, av);                                  \
    c##r##1 = _mm512_dpbusd_epi32(c##r##1, b1, av);                                  \
    c##r##2 = _mm512_dpbusd_epi32(c##r##2, b2, av);                                  \
    c##r##3 = _mm512_dpbusd_epi32(c##r##3, b3, av);                                  \
  }
// The on-the-fly int4 loop decodes two of a quad pair's four 64-byte vectors (J, J + 1) at a time, then runs every
// row: each broadcast activation quad serves two dot products. Decoding one vector at a time, GCC held the quad
// pair's 12 activation quads in general registers and broadcast them again for every vector (12 vpbroadcastd from
// a GPR per 12 vpdpbusd, on the same two vector ports), and the first row tile of a block, which decodes, took
// twice as long as the next (two at a time: 3-7 % faster).
#define HF_OTF_DEC(J, LO, HI)                                                        \
  const __m512i raw##J = _mm512_loadu_si512(B + 64 * J);                            \
  const __m512i LO = _mm512_and_si512(raw##J, mask);                                 \
  const __m512i HI = _mm512_and_si512(_mm512_srli_epi16(raw##J, 4), mask);           \
  if (D) {                                                                           \
    _mm512_store_si512(D + 64 * J, LO);                                              \
    _mm512_store_si512(D + 256 + 64 * J, HI);                                        \
  }
#define HF_OTF_ROW2(r, J, J1)                                                        \
  if constexpr (MR > r) {                                                            \
    const __m512i al = bcast4(A + r * 4);                                            \
    c##r##J = _mm512_dpbusd_epi32(c##r##J, lo0, al);                                 \
    c##r##J1 = _mm512_dpbusd_epi32(c##r##J1, lo1, al);                               \
    const __m512i ah = bcast4(A + qs + r * 4);                                       \
    c##r##J = _mm512_dpbusd_epi32(c##r##J, hi0, ah);                                 \
    c##r##J1 = _mm512_dpbusd_epi32(c##r##J1, hi1, ah);                               \
  }
#define HF_OTF_JP(J, J1)                                                             \
  {                                                                                  \
    HF_OTF_DEC(J, lo0, hi0)                                                          \
    HF_OTF_DEC(J1, lo1, hi1)                                                         \
    HF_OTF_ROW2(0, J, J1) HF_OTF_ROW2(1, J, J1) HF_OTF_ROW2(2, J, J1)                \
    HF_OTF_ROW2(3, J, J1) HF_OTF_ROW2(4, J, J1) HF_OTF_ROW2(5, J, J1)                \
  }

// one line per K step of the tile's share of the next weight block (TileArgs::pf), until it is all requested. The
// share can be longer than the tile's steps (the decoding tile has half as many, W8A8's blocks are twice as long):
// the lines left are then not prefetched, and that measured 5-15 % faster than a rate that covers them (and than 4
// lines per step, or one every other step).
// the software prefetch of one 256-byte step of a weight stream at src: its 4 lines `near` bytes ahead into L1 and,
// with far > 0, `far` bytes ahead into L2 (no ISA attribute: the AMX conversion uses it too)
__attribute__((always_inline)) inline void prefetch_weights(const void* src, int64_t near, int64_t far) {
  const char* c = static_cast<const char*>(src);
  if (near > 0)
    for (int j = 0; j < 4; ++j) _mm_prefetch(c + near + 64 * j, _MM_HINT_T0);
  if (far > 0)
    for (int j = 0; j < 4; ++j) _mm_prefetch(c + far + 64 * j, _MM_HINT_T1);
}

HF_T512I void prefetch_share(const char*& pf, const char* pfe) {
  if (pf < pfe) {
    _mm_prefetch(pf, _MM_HINT_T1);
    pf += 64;
  }
}

template <int MR, bool OTF>
HF_T512 __attribute__((noinline)) void tile512(const TileArgs& a) {
  const int64_t Gp = a.Gp, qs = a.qs;
  const __m512i mask = _mm512_set1_epi8(0x0f);
  const char* pf = a.pf;
  const char* const pfe = a.pf + 64 * a.pfn;
  for (int64_t g = a.s0 / Gp; g * Gp < a.s1; ++g) {
    const int64_t gs0 = g * Gp > a.s0 ? g * Gp : a.s0;
    const int64_t gs1 = (g + 1) * Gp < a.s1 ? (g + 1) * Gp : a.s1;
    const bool load_ci = gs0 % Gp != 0, store_ci = gs1 % Gp != 0;
    const int32_t* zp = a.zeros ? a.zeros + g * NR : nullptr;
    HF_ROWS(HF_DECL)
    HF_ROWS(HF_INIT)
    const int8_t* A = a.a + (gs0 / 4) * qs;
    if constexpr (!OTF) {
      const uint8_t* B = a.b + (gs0 - a.kb0) * NR;
      const int64_t nq = (gs1 - gs0) / 4;
      // the weight prefetch of a tile that streams the block from memory (TileArgs::stream): near into L1 and,
      // with one row tile, far into L2; see kHwStream8
      const bool one = a.stream && !a.pfn;
      const int64_t near = a.stream && !(one && kHwStream8) ? HF_PF8 : 0;
      const int64_t far = !one ? 0 : !kHwStream8 ? 2 * HF_PFF : MR >= 3 ? kHwStreamFar : 0;
      // two quads per iteration (a group of 128 is 32 quads; 4 measured the same as 2; ~5 % faster than 1)
#define HF_Q8_LOOP(PREFETCH)                                                              \
  _Pragma("GCC unroll 2") for (int64_t q = 0; q < nq; ++q) {                              \
    PREFETCH                                                                              \
    const __m512i b0 = _mm512_loadu_si512(B), b1 = _mm512_loadu_si512(B + 64);           \
    const __m512i b2 = _mm512_loadu_si512(B + 128), b3 = _mm512_loadu_si512(B + 192);    \
    HF_ROWS(HF_STEP4)                                                                     \
    A += qs;                                                                              \
    B += 256;                                                                             \
  }
      if (near == 0 && far == 0 && pf >= pfe) {  // no prefetch: the loop without its tests
        HF_Q8_LOOP()
      } else {
        HF_Q8_LOOP(prefetch_weights(B, near, far); prefetch_share(pf, pfe);)
      }
#undef HF_Q8_LOOP
    } else {
      const uint8_t* B = a.b + (gs0 - a.kb0) * (NR / 2);
      uint8_t* D = a.dec ? a.dec + (gs0 - a.kb0) * NR : nullptr;
      const int64_t nq2 = (gs1 - gs0) / 8;
      // one row tile on AMD streams int4 panels fastest with the near prefetch below 3 rows and only an 8 KiB one
      // into L2 from 3 rows, as its int8 panels (kHwStream8; Zen 5, W4A8 1 thread: M = 1-6 4-21 % faster)
      const bool amd_one = kHwStream8 && !a.pfn;
      const int64_t near = amd_one && MR >= 3 ? 0 : HF_PF;
      const int64_t far = a.pfn ? 0 : !kHwStream8 ? HF_PFF : MR >= 3 ? kHwStreamFar : 0;
      for (int64_t q2 = 0; q2 < nq2; ++q2) {
        prefetch_weights(B, near, far);
        prefetch_share(pf, pfe);
        HF_OTF_JP(0, 1)
        // the second pair re-reads the activation quads: broadcasts from memory (load ports only), not from GPRs
        asm volatile("" ::: "memory");
        HF_OTF_JP(2, 3)
        A += 2 * qs;
        B += 256;
        if (D) D += 512;
      }
    }
    if (store_ci) {
      int32_t* dst = a.ci;  // 64-byte aligned scratch rows
      HF_ROWS(HF_SAVE)
      continue;
    }
    const float* sc = a.scales + g * NR;
    const __m512 sv0 = _mm512_loadu_ps(sc), sv1 = _mm512_loadu_ps(sc + 16);
    const __m512 sv2 = _mm512_loadu_ps(sc + 32), sv3 = _mm512_loadu_ps(sc + 48);
    const bool first = g == 0;
    HF_ROWS(HF_EPI)
  }
}

HF_T512I __m512 load16(const void* x, int t, int64_t i) {
  if (t == OUT_F32) return _mm512_loadu_ps((const float*)x + i);
  const __m256i h = _mm256_loadu_si256((const __m256i*)((const uint16_t*)x + i));
  if (t == OUT_BF16) return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  return _mm512_cvtph_ps(h);
}

struct T512 {
  static constexpr int MR = MRA;
  static constexpr bool kFusedDecode = true;
  // int8 blocks of 4096 k (256 KiB, read from L2 by every row tile) rather than 512 (32 KiB, from L1): a tile
  // call then covers 8x the k steps and, for K <= 4096, no group is split across blocks (no int32 partials
  // stored and reloaded). Zen 5, 1 thread, W8A8: M = 16 15 % faster, M = 256-1024 3-4 % (docs/cpu-kernels.md)
  static constexpr int64_t kKcInt8 = 4096;
  static void tile(const TileArgs& a) {
    hf_w4::with_rows<1, 2, 3, 4, 5, 6>(a.mr, [&](auto r) {
      if (a.otf) tile512<decltype(r)::value, true>(a);
      else tile512<decltype(r)::value, false>(a);
    });
  }
  HF_T512 static void decode(const uint8_t* src, uint8_t* dst, int64_t nq2) {
    const __m512i mask = _mm512_set1_epi8(0x0f);
    for (int64_t q2 = 0; q2 < nq2; ++q2) {
      prefetch_weights(src + q2 * 256, HF_PF, 0);
      for (int j = 0; j < 4; ++j) {
        const __m512i raw = _mm512_loadu_si512(src + q2 * 256 + 64 * j);
        _mm512_storeu_si512(dst + q2 * 512 + 64 * j, _mm512_and_si512(raw, mask));
        _mm512_storeu_si512(dst + q2 * 512 + 256 + 64 * j, _mm512_and_si512(_mm512_srli_epi16(raw, 4), mask));
      }
    }
  }
  HF_T512 static void store_rows(const float* cf, int64_t rows, char* out, int64_t ldo, int ot, int64_t ncols,
                                 const float* afinal, const float* bias) {
    for (int64_t r = 0; r < rows; ++r) {
      const __m512 sx = _mm512_set1_ps(afinal ? afinal[r] : 1.f);
      for (int64_t n = 0; n < ncols; n += 16) {
        const int64_t rem = ncols - n;
        const __mmask16 m = rem >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << rem) - 1);
        __m512 v = _mm512_mul_ps(_mm512_loadu_ps(cf + r * NR + n), sx);
        if (bias) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(m, bias + n));
        if (ot == OUT_F32) {
          _mm512_mask_storeu_ps((float*)out + r * ldo + n, m, v);
        } else {
          const __m256i h = ot == OUT_BF16 ? hf_w4::f32x16_to_bf16(v)
                                           : _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
          _mm256_mask_storeu_epi16((uint16_t*)out + r * ldo + n, m, h);
        }
      }
    }
  }
};

// AMX activation layout: offset of packed column kp inside a row (row base = block base + 64 * row)
inline int64_t amx_aoff(int64_t kp) { return (kp >> 6) * 1024 + (kp & 63); }

// max(mx, abs_bits of the 16 lanes of v) (see act_scale)
HF_T512I __m512i max_abs_bits(__m512i mx, __m512 v) {
  return _mm512_max_epu32(mx, _mm512_and_si512(_mm512_castps_si512(v), _mm512_set1_epi32(0x7fffffff)));
}

HF_T512 void quant_tiles_impl(const QuantArgs& q, int64_t t0, int64_t t1) {
  const Geometry& g = q.g;
  const int64_t K = g.K, gs = g.gs, Gp = g.Gp;
  float* buf = (float*)thread_scratch(3, (size_t)(K + 16) * 4);
  const __m512 absmask = _mm512_castsi512_ps(_mm512_set1_epi32(0x7fffffff));
  const __m512 lo = _mm512_set1_ps(-128.f), hi = _mm512_set1_ps(127.f);
  const int es = q.in_type == OUT_F32 ? 4 : 2;
  for (int64_t t = t0; t < t1; ++t) {
    int8_t* At = q.A + t * MRA * g.Kp;
    for (int r = 0; r < MRA; ++r) {
      const int64_t m = t * MRA + r;
      // VNNI layout: quad stride 4 * tile_rows inside the tile. AMX layout (q.rowmajor): blocks of 16 rows, each
      // a run of 16x64-byte tiles (tile kt of block b at A + b*16*Kp + kt*1024, row r at +64r), see amx_aoff
      if (m >= q.M) break;
      int8_t* Ar = q.rowmajor ? q.A + (m / 16) * 16 * g.Kp + (m % 16) * 64 : At + r * 4;
      const int64_t QS = 4 * tile_rows(t, q.M);
      const char* xr = (const char*)q.x + m * q.ldx * es;
      // row -> fp32 buffer (gathered through the act-order permutation)
      if (q.perm) {
        for (int64_t j = 0; j < K; ++j) {
          const int64_t c = q.perm[j];
          buf[j] = q.in_type == OUT_F32 ? ((const float*)xr)[c]
                   : q.in_type == OUT_BF16 ? bf16_bits_to_f32(((const uint16_t*)xr)[c])
                                           : f16_bits_to_f32(((const uint16_t*)xr)[c]);
        }
      }
      // max |x| of the vector part (abs_bits), fused into the copy when there is no perm
      __m512i mx = _mm512_setzero_si512();
      bool have_mx = false;
      if (!q.perm) {
        int64_t j = 0;
        __m512i mx1 = _mm512_setzero_si512();
        for (; j + 32 <= K; j += 32) {
          const __m512 v0 = load16(xr, q.in_type, j), v1 = load16(xr, q.in_type, j + 16);
          _mm512_storeu_ps(buf + j, v0);
          _mm512_storeu_ps(buf + j + 16, v1);
          mx = max_abs_bits(mx, v0);
          mx1 = max_abs_bits(mx1, v1);
        }
        for (; j + 16 <= K; j += 16) {
          const __m512 v0 = load16(xr, q.in_type, j);
          _mm512_storeu_ps(buf + j, v0);
          mx = max_abs_bits(mx, v0);
        }
        mx = _mm512_max_epu32(mx, mx1);
        have_mx = true;
        for (; j < K; ++j)
          buf[j] = q.in_type == OUT_F32 ? ((const float*)xr)[j]
                   : q.in_type == OUT_BF16 ? bf16_bits_to_f32(((const uint16_t*)xr)[j])
                                           : f16_bits_to_f32(((const uint16_t*)xr)[j]);
      }
      float s_tok = 0.f;
      if (!q.act_group) {
        int64_t j = 0;
        if (have_mx) j = K / 16 * 16;
        else
          for (; j + 16 <= K; j += 16) mx = max_abs_bits(mx, _mm512_loadu_ps(buf + j));
        uint32_t m1 = _mm512_reduce_max_epu32(mx);
        for (; j < K; ++j) m1 = std::max(m1, abs_bits(buf[j]));
        s_tok = act_scale(m1);
        q.ascale[m] = s_tok;
      }
      for (int64_t gi = 0; gi < g.G; ++gi) {
        const float* xg = buf + gi * gs;
        float s = s_tok;
        if (q.act_group) {
          __m512i mx = _mm512_setzero_si512();
          int64_t j = 0;
          for (; j + 16 <= gs; j += 16) mx = max_abs_bits(mx, _mm512_loadu_ps(xg + j));
          uint32_t m1 = _mm512_reduce_max_epu32(mx);
          for (; j < gs; ++j) m1 = std::max(m1, abs_bits(xg[j]));
          s = act_scale(m1);
          q.ascale[m * g.G + gi] = s;
        }
        // x / s (correctly rounded) then round half to even. vdivps is slow, so the quotient comes from x * (1/s),
        // which is within 2^-15 of the correctly rounded one (|x/s| <= 128: two roundings of 2^-24 relative):
        // both round to the same integer unless the product lies within 2^-10 of a .5 boundary (or is not
        // finite); those lanes (rare) are divided exactly.
        const __m512 sv = _mm512_set1_ps(s), inv = _mm512_set1_ps(1.f / s);
        const __m512 half = _mm512_set1_ps(0.5f), eps = _mm512_set1_ps(1.f / 1024);
        __m512i vsum = _mm512_setzero_si512();
        int32_t sum = 0;
        int64_t j = 0;
        for (; j + 16 <= gs; j += 16) {
          const __m512 xv = _mm512_loadu_ps(xg + j);
          __m512 v = _mm512_mul_ps(xv, inv);
          const __m512 fr = _mm512_sub_ps(v, _mm512_roundscale_ps(v, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC));
          const __mmask16 tie = _mm512_cmp_ps_mask(_mm512_and_ps(_mm512_sub_ps(fr, half), absmask), eps, _CMP_NGE_UQ);
          if (tie) v = _mm512_mask_div_ps(v, tie, xv, sv);
          v = _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
          v = _mm512_min_ps(_mm512_max_ps(v, lo), hi);
          const __m512i qi = _mm512_cvtps_epi32(v);
          vsum = _mm512_add_epi32(vsum, qi);
          const __m128i q8 = _mm512_cvtepi32_epi8(qi);
          const int64_t kp = gi * Gp + j;  // multiple of 4 when gs % 4 == 0 ... handled generally below
          alignas(16) int8_t tmp[16];
          _mm_store_si128((__m128i*)tmp, q8);
          if (q.rowmajor) {
            if ((kp & 15) == 0) std::memcpy(Ar + amx_aoff(kp), tmp, 16);  // always so: Gp % 64 == 0 on AMX
            else
              for (int e = 0; e < 16; ++e) Ar[amx_aoff(kp + e)] = tmp[e];
          } else if ((kp & 3) == 0) {
            int8_t* d = Ar + (kp / 4) * QS;
            std::memcpy(d, tmp, 4);
            std::memcpy(d + QS, tmp + 4, 4);
            std::memcpy(d + 2 * QS, tmp + 8, 4);
            std::memcpy(d + 3 * QS, tmp + 12, 4);
          } else {
            for (int e = 0; e < 16; ++e) {
              const int64_t k2 = kp + e;
              Ar[(k2 / 4) * QS + k2 % 4] = tmp[e];
            }
          }
        }
        sum = _mm512_reduce_add_epi32(vsum);
        for (; j < Gp; ++j) {
          const int64_t kp = gi * Gp + j;
          int8_t v = 0;
          if (j < gs) v = q8(xg[j], s);
          sum += v;
          Ar[q.rowmajor ? amx_aoff(kp) : (kp / 4) * QS + kp % 4] = v;
        }
        q.asum[m * g.G + gi] = sum;
      }
    }
  }
}

// ---- activation quantizer for the VNNI tile layout without a permutation (every call but act-order and AMX)
// Reads x directly (no fp32 copy of the row), finds each row's (or group's) abs maximum on the raw bits, and
// quantizes a tile's rows 16 k at a time: the rows' 4-byte quads are interleaved in registers (vpermt2d) and
// stored as one run of 16 * rows bytes instead of 4 scattered stores per row. Bit-identical to quant_tiles_impl
// (same quotient, same near-tie fallback, same clamp). Zen 5, M = 1024, K = 4096, N = 64 (where quantizing is
// half the call): 1.34-1.46 -> 1.27-1.29 ms per call.

// the abs_bits maximum (see act_scale) of x[i0, i0 + n) of a row of type t. bf16 / fp16 order by their 15 low
// bits as fp32 does by its 31 (nan above inf above every finite value), so the maximum is taken on the raw bits
HF_T512 uint32_t amax_bits_x(const char* xr, int t, int64_t i0, int64_t n) {
  int64_t j = 0;
  if (t == OUT_F32) {
    const float* p = (const float*)xr + i0;
    const __m512i am = _mm512_set1_epi32(0x7fffffff);
    __m512i m0 = _mm512_setzero_si512(), m1 = m0;
    for (; j + 32 <= n; j += 32) {
      m0 = _mm512_max_epu32(m0, _mm512_and_si512(_mm512_loadu_si512(p + j), am));
      m1 = _mm512_max_epu32(m1, _mm512_and_si512(_mm512_loadu_si512(p + j + 16), am));
    }
    for (; j + 16 <= n; j += 16) m0 = _mm512_max_epu32(m0, _mm512_and_si512(_mm512_loadu_si512(p + j), am));
    uint32_t m = _mm512_reduce_max_epu32(_mm512_max_epu32(m0, m1));
    for (; j < n; ++j) m = std::max(m, abs_bits(p[j]));
    return m;
  }
  const uint16_t* p = (const uint16_t*)xr + i0;
  const __m512i am = _mm512_set1_epi16(0x7fff);
  __m512i m0 = _mm512_setzero_si512(), m1 = m0;
  for (; j + 64 <= n; j += 64) {
    m0 = _mm512_max_epu16(m0, _mm512_and_si512(_mm512_loadu_si512(p + j), am));
    m1 = _mm512_max_epu16(m1, _mm512_and_si512(_mm512_loadu_si512(p + j + 32), am));
  }
  for (; j + 32 <= n; j += 32) m0 = _mm512_max_epu16(m0, _mm512_and_si512(_mm512_loadu_si512(p + j), am));
  m0 = _mm512_max_epu16(m0, m1);
  const __m256i h = _mm256_max_epu16(_mm512_castsi512_si256(m0), _mm512_extracti64x4_epi64(m0, 1));
  const __m128i h2 = _mm_max_epu16(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
  // max of 8 u16 = ~min of their complements (phminposuw)
  uint16_t mb = (uint16_t)~_mm_extract_epi16(_mm_minpos_epu16(_mm_xor_si128(h2, _mm_set1_epi32(-1))), 0);
  for (; j < n; ++j) mb = std::max<uint16_t>(mb, p[j] & 0x7fff);
  return t == OUT_BF16 ? (uint32_t)mb << 16 : abs_bits(f16_bits_to_f32(mb));
}

inline float load_x1(const char* xr, int t, int64_t i) {
  if (t == OUT_F32) return ((const float*)xr)[i];
  if (t == OUT_BF16) return bf16_bits_to_f32(((const uint16_t*)xr)[i]);
  return f16_bits_to_f32(((const uint16_t*)xr)[i]);
}

template <int R>
HF_T512 void quant_tile_fast(const QuantArgs& q, int64_t t) {
  const Geometry& g = q.g;
  const int64_t gs = g.gs, Gp = g.Gp, G = g.G, QS = 4 * R;
  const int es = q.in_type == OUT_F32 ? 4 : 2;
  int8_t* At = q.A + t * MRA * g.Kp;
  const char* xr[R];
  float s_tok[R];
  for (int r = 0; r < R; ++r) {
    const int64_t m = t * MRA + r;
    xr[r] = (const char*)q.x + m * q.ldx * es;
    if (!q.act_group) q.ascale[m] = s_tok[r] = act_scale(amax_bits_x(xr[r], q.in_type, 0, g.K));
  }
  // 16 k of R rows = R x 4 dwords (row r's in lanes 4r..4r+3 of a (r < 4) or 4(r-4).. of b) -> 4R dwords in
  // tile order (quad j, row r at dword R j + r): lane o of the result takes row o % R, quad o / R
  alignas(64) int32_t idx[32];
  for (int o = 0; o < 32; ++o) {
    const int r = o % R, j = o / R;
    idx[o] = j < 4 ? (r < 4 ? 4 * r + j : 16 + 4 * (r - 4) + j) : 0;
  }
  const __m512i idx0 = _mm512_load_si512(idx), idx1 = _mm512_load_si512(idx + 16);
  const __mmask16 st0 = 4 * R >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (4 * R)) - 1);
  const __mmask16 st1 = 4 * R > 16 ? (__mmask16)((1u << (4 * R - 16)) - 1) : 0;
  const __m512 absmask = _mm512_castsi512_ps(_mm512_set1_epi32(0x7fffffff));
  const __m512 lo = _mm512_set1_ps(-128.f), hi = _mm512_set1_ps(127.f);
  const __m512 thr = _mm512_set1_ps(0.5f - 1.f / 1024);
  for (int64_t gi = 0; gi < G; ++gi) {
    float s[R], inv[R];
    __m512i vsum[R];
    for (int r = 0; r < R; ++r) {
      const int64_t m = t * MRA + r;
      s[r] = q.act_group ? (q.ascale[m * G + gi] = act_scale(amax_bits_x(xr[r], q.in_type, gi * gs, gs))) : s_tok[r];
      inv[r] = 1.f / s[r];
      vsum[r] = _mm512_setzero_si512();
    }
    int64_t j = 0;
    for (; j + 16 <= gs; j += 16) {
      __m128i qv[R];
#pragma GCC unroll 6
      for (int r = 0; r < R; ++r) {
        // x / s (correctly rounded) then round half to even: the quotient from x * (1/s) is within 2^-15 of the
        // correctly rounded one (|x/s| <= 128), so both round alike unless it lies within 2^-10 of a .5 boundary
        // (or is not finite); those lanes (rare) are divided exactly
        const __m512 xv = load16(xr[r], q.in_type, gi * gs + j);
        __m512 v = _mm512_mul_ps(xv, _mm512_set1_ps(inv[r]));
        __m512 rv = _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        const __mmask16 tie = _mm512_cmp_ps_mask(_mm512_and_ps(_mm512_sub_ps(v, rv), absmask), thr, _CMP_NLE_UQ);
        if (tie) {
          v = _mm512_mask_div_ps(v, tie, xv, _mm512_set1_ps(s[r]));
          rv = _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        }
        const __m512i qi = _mm512_cvtps_epi32(_mm512_min_ps(_mm512_max_ps(rv, lo), hi));
        vsum[r] = _mm512_add_epi32(vsum[r], qi);
        qv[r] = _mm512_cvtepi32_epi8(qi);
      }
      __m512i a = _mm512_castsi128_si512(qv[0]), b = _mm512_setzero_si512();
      if constexpr (R > 1) a = _mm512_inserti32x4(a, qv[1], 1);
      if constexpr (R > 2) a = _mm512_inserti32x4(a, qv[2], 2);
      if constexpr (R > 3) a = _mm512_inserti32x4(a, qv[3], 3);
      if constexpr (R > 4) b = _mm512_castsi128_si512(qv[4]);
      if constexpr (R > 5) b = _mm512_inserti32x4(b, qv[5], 1);
      int8_t* d = At + ((gi * Gp + j) / 4) * QS;  // gi * Gp + j is a multiple of 4 (Gp % 8 == 0)
      _mm512_mask_storeu_epi32(d, st0, _mm512_permutex2var_epi32(a, idx0, b));
      if constexpr (4 * R > 16) _mm512_mask_storeu_epi32(d + 64, st1, _mm512_permutex2var_epi32(a, idx1, b));
    }
    for (int r = 0; r < R; ++r) {
      int32_t sum = _mm512_reduce_add_epi32(vsum[r]);
      for (int64_t jj = j; jj < Gp; ++jj) {
        const int64_t kp = gi * Gp + jj;
        const int8_t v = jj < gs ? q8(load_x1(xr[r], q.in_type, gi * gs + jj), s[r]) : 0;
        sum += v;
        At[(kp / 4) * QS + r * 4 + kp % 4] = v;
      }
      q.asum[(t * MRA + r) * G + gi] = sum;
    }
  }
}


// ------------------------------------------------------------------------------------------------
// AMX-INT8 (Intel Sapphire Rapids and later). Work item = (row chunk starting at a multiple of 16, 64-column
// panel). Per K slice of kc packed columns the panel's weights are converted once into signed int8 B tiles
// (int8: u8 ^ 0x80 = w; int4: code - zero, which fits int8 for zeros in [-112, 128]: the zero point is folded
// into the integer dot, which stays exact, so a group's epilogue is a plain convert + scale), laid out
// [k tile][column tile j][16 quads][64 B] in an L1-resident buffer. Pairs of 16-row blocks then run 2 x 2
// register blocking over each half of the panel (4 tile loads per 4 TDPBSSD), a single block 1 x 4 (5 loads).
// A finished group goes through an 8 KiB int32 buffer (two of them) into the fp32 row accumulators; that
// epilogue runs in shares during the K steps of the next group, so the vector units work while the AMX unit
// computes. While a slice is computed, the next one is converted in small pieces between the K steps (two slice
// buffers), which keeps the weight stream going at small M. Activations come in 16-row tile blocks (quant_tiles
// with rowmajor). Results are bit-identical to the AVX-512 path (same exact integers, same fp32 operations in the
// same order).
// With two row blocks a step's shares run between its tile loads and its TDPs rather than after the TDPs: tile
// loads wait for older vector stores (stand-alone, 1 thread: 32 64-byte stores then 3 tile loads + 2 TDPs per
// iteration took 22 ns against 14 and 9 for each alone, while stores next to TDPs alone overlap), so the shares'
// stores now have the TDPs' run to drain before the next step's loads (~2 % faster). Batched epilogues, one-burst
// slice conversion, other row-chunk and K-slice sizes all measured slower.
// Used only when the CPU and the OS allow it (cpu_caps().amx_int8).

#define HF_TAMX __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c,amx-tile,amx-int8")))

// Packed-K slice converted at a time: 512 (32 KiB of B tiles) for row chunks of more than 32 rows, 128 (8 KiB)
// for up to 32. With one or two 16-row blocks every B tile is used once or twice, and the two 32 KiB slice buffers
// plus the activations pushed the tile loads out to L2; with 8 KiB slices the B tiles are read from L1.
// (128-k slices: 10-35 % faster up to M = 48; from M = 64 the 512 slices are faster.)
constexpr int64_t AMX_KC = 512;
constexpr int64_t AMX_KC_SMALL = 128;

struct AmxEpi {  // a finished group whose int32 results wait in the tile buffer
  float* cf;     // fp32 accumulators of the block's first row (stride 64)
  int64_t m, nr, g;
  bool live;
};

// ZC: zeros not folded into the weights (out of int8 range): subtract zero * asum here
template <bool ZC>
HF_TAMX __attribute__((always_inline)) inline void amx_epilogue(const Plan& p, const int32_t* cb, const float* Sp,
                                                                const int32_t* Zp, const AmxEpi& e, int64_t r0,
                                                                int64_t r1) {
  const int64_t G = p.g.G, g = e.g;
  const float* sc = Sp + g * NR;
  const __m512 s0 = _mm512_loadu_ps(sc), s1 = _mm512_loadu_ps(sc + 16);
  const __m512 s2 = _mm512_loadu_ps(sc + 32), s3 = _mm512_loadu_ps(sc + 48);
  __m512i z0 = _mm512_setzero_si512(), z1 = z0, z2 = z0, z3 = z0;
  if constexpr (ZC) {
    z0 = _mm512_loadu_si512(Zp + g * NR);
    z1 = _mm512_loadu_si512(Zp + g * NR + 16);
    z2 = _mm512_loadu_si512(Zp + g * NR + 32);
    z3 = _mm512_loadu_si512(Zp + g * NR + 48);
  }
  const bool first = g == 0;
  if (r1 > e.nr) r1 = e.nr;
  for (int64_t r = r0; r < r1; ++r) {
    const int64_t m = e.m + r;
    __m512 t0 = s0, t1 = s1, t2 = s2, t3 = s3;
    if (p.act_group) {
      const __m512 sx = _mm512_set1_ps(p.ascale[m * G + g]);
      t0 = _mm512_mul_ps(t0, sx);
      t1 = _mm512_mul_ps(t1, sx);
      t2 = _mm512_mul_ps(t2, sx);
      t3 = _mm512_mul_ps(t3, sx);
    }
    __m512i d0 = _mm512_load_si512(cb + r * NR), d1 = _mm512_load_si512(cb + r * NR + 16);
    __m512i d2 = _mm512_load_si512(cb + r * NR + 32), d3 = _mm512_load_si512(cb + r * NR + 48);
    if constexpr (ZC) {
      const __m512i as = _mm512_set1_epi32(p.asum[m * G + g]);
      d0 = _mm512_sub_epi32(d0, _mm512_mullo_epi32(z0, as));
      d1 = _mm512_sub_epi32(d1, _mm512_mullo_epi32(z1, as));
      d2 = _mm512_sub_epi32(d2, _mm512_mullo_epi32(z2, as));
      d3 = _mm512_sub_epi32(d3, _mm512_mullo_epi32(z3, as));
    }
    float* c = e.cf + r * NR;
    if (first) {
      _mm512_storeu_ps(c, _mm512_mul_ps(_mm512_cvtepi32_ps(d0), t0));
      _mm512_storeu_ps(c + 16, _mm512_mul_ps(_mm512_cvtepi32_ps(d1), t1));
      _mm512_storeu_ps(c + 32, _mm512_mul_ps(_mm512_cvtepi32_ps(d2), t2));
      _mm512_storeu_ps(c + 48, _mm512_mul_ps(_mm512_cvtepi32_ps(d3), t3));
    } else {
      _mm512_storeu_ps(c, _mm512_fmadd_ps(_mm512_cvtepi32_ps(d0), t0, _mm512_loadu_ps(c)));
      _mm512_storeu_ps(c + 16, _mm512_fmadd_ps(_mm512_cvtepi32_ps(d1), t1, _mm512_loadu_ps(c + 16)));
      _mm512_storeu_ps(c + 32, _mm512_fmadd_ps(_mm512_cvtepi32_ps(d2), t2, _mm512_loadu_ps(c + 32)));
      _mm512_storeu_ps(c + 48, _mm512_fmadd_ps(_mm512_cvtepi32_ps(d3), t3, _mm512_loadu_ps(c + 48)));
    }
  }
}

// packed columns [k0, k1) of a panel -> signed int8 B tiles (see above). fold: subtract the zero point.
// (dst holds the slice starting at packed column kbase). Besides the near prefetch, each source line is
// prefetched into L2 `far` bytes ahead (one slice: it is converted during the next slice's work, so the
// memory stream stays deep even when the conversion is spread thinly over many row blocks).
HF_TAMX void amx_convert(const Plan& p, const uint8_t* Bp, const int32_t* Zp, bool fold, int64_t k0, int64_t k1,
                         int8_t* dst, int64_t kbase, int64_t far) {
  const int64_t q0 = kbase / 4;
  if (p.g.wtype == W_INT8) {
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    for (int64_t q = k0 / 4; q < k1 / 4; ++q) {
      const uint8_t* src = Bp + q * 256;
      prefetch_weights(src, HF_PF, far);
      int8_t* d = dst + ((q - q0) >> 4) * 4096 + ((q - q0) & 15) * 64;
      for (int j = 0; j < 4; ++j) _mm512_store_si512(d + j * 1024, _mm512_xor_si512(_mm512_loadu_si512(src + 64 * j), flip));
    }
    return;
  }
  const __m512i mask = _mm512_set1_epi8(0x0f);
  const int64_t Gp = p.g.Gp;
  __m512i zb0 = _mm512_setzero_si512(), zb1 = zb0, zb2 = zb0, zb3 = zb0;
  int64_t gcur = -1;
  for (int64_t q2 = k0 / 8; q2 < k1 / 8; ++q2) {
    const int64_t gi = q2 * 8 / Gp;
    if (gi != gcur) {
      gcur = gi;
      if (!fold) {
        zb0 = zb1 = zb2 = zb3 = _mm512_setzero_si512();
      } else if (Zp) {  // zero of column n replicated in the 4 bytes of its quad
        const __m512i lo8 = _mm512_set1_epi32(0xff), rep = _mm512_set1_epi32(0x01010101);
        zb0 = _mm512_mullo_epi32(_mm512_and_si512(_mm512_loadu_si512(Zp + gi * NR), lo8), rep);
        zb1 = _mm512_mullo_epi32(_mm512_and_si512(_mm512_loadu_si512(Zp + gi * NR + 16), lo8), rep);
        zb2 = _mm512_mullo_epi32(_mm512_and_si512(_mm512_loadu_si512(Zp + gi * NR + 32), lo8), rep);
        zb3 = _mm512_mullo_epi32(_mm512_and_si512(_mm512_loadu_si512(Zp + gi * NR + 48), lo8), rep);
      } else {
        zb0 = zb1 = zb2 = zb3 = _mm512_set1_epi8((char)p.zconst);
      }
    }
    const uint8_t* src = Bp + q2 * 256;
    prefetch_weights(src, HF_PF, far);
    const int64_t ql = 2 * q2 - q0;  // even: quads ql, ql + 1 share a k tile
    int8_t* d = dst + (ql >> 4) * 4096 + (ql & 15) * 64;
#define HF_CVT4(J)                                                                                  \
    {                                                                                               \
      const __m512i raw = _mm512_loadu_si512(src + 64 * J);                                         \
      _mm512_store_si512(d + J * 1024, _mm512_sub_epi8(_mm512_and_si512(raw, mask), zb##J));        \
      _mm512_store_si512(d + J * 1024 + 64,                                                         \
                         _mm512_sub_epi8(_mm512_and_si512(_mm512_srli_epi16(raw, 4), mask), zb##J)); \
    }
    HF_CVT4(0) HF_CVT4(1) HF_CVT4(2) HF_CVT4(3)
#undef HF_CVT4
  }
}

template <bool ZC>
HF_TAMX void amx_item(const Plan& p, int64_t item) {
  const Geometry& g = p.g;
  const int64_t Kp = g.Kp, Gp = g.Gp;
  const int64_t mc = item / g.P, pn = item % g.P;
  const int64_t m0 = mc * p.mchunk, m1 = (m0 + p.mchunk < p.M) ? m0 + p.mchunk : p.M;
  const int64_t rows = m1 - m0, nb = (rows + 15) / 16;
  const uint8_t* Bp = p.B + pn * p.panel_bytes;
  const float* Sp = p.scales + pn * g.G * NR;
  const int32_t* Zp = p.zeros ? p.zeros + pn * g.G * NR : nullptr;
  const int64_t kcx = rows <= 32 ? AMX_KC_SMALL : AMX_KC;
  const int64_t kc = Gp <= kcx ? kcx / Gp * Gp : kcx;
  float* Cf = (float*)thread_scratch(0, (size_t)nb * 16 * NR * 4);
  int32_t* Ci = kc % Gp ? (int32_t*)thread_scratch(1, (size_t)nb * 16 * NR * 4) : nullptr;
  // two slice buffers: the next slice is converted (streamed from memory) while the AMX unit works on this one
  int8_t* bufs = (int8_t*)thread_scratch(2, (size_t)2 * kc * NR);
  // finished groups of a 32-row pair wait here (two buffers: one is being filled while the other's epilogue runs)
  alignas(64) int32_t cb[2][32 * NR];
  int cbi = 0;
  AmxEpi pend{nullptr, 0, 0, 0, false};
  const int8_t* Ab = p.A + m0 * Kp;  // m0 % 16 == 0: the chunk's first 16-row block
  // source bytes of one slice, at least HF_PFF (int8: twice that; a 128-k int4 slice is only 4 KiB)
  const int64_t far =
      g.wtype == W_INT8 ? std::max<int64_t>(kc * NR, 2 * HF_PFF) : std::max<int64_t>(kc * NR / 2, HF_PFF);
  amx_convert(p, Bp, Zp, !ZC, 0, kc < Kp ? kc : Kp, bufs, 0, far);
  for (int64_t k0 = 0, sl = 0; k0 < Kp; k0 += kc, ++sl) {
    const int64_t k1 = k0 + kc < Kp ? k0 + kc : Kp;
    const int8_t* buf = bufs + (sl & 1) * kc * NR;
    int8_t* nbuf = bufs + ((sl + 1) & 1) * kc * NR;
    // the next slice [k1, k2) in nn k-tile chunks, spread evenly over this slice's nsteps k steps
    const int64_t k2 = k1 + kc < Kp ? k1 + kc : Kp, nn = (k2 - k1) / 64;
    const int64_t nsteps = nb * ((k1 - k0) / 64);
    int64_t step = 0, done = 0;
    // A pair of 16-row blocks takes 2 x 2 register blocking per half of the panel: A tiles 4, 5 x B tiles 6, 7
    // (column tiles 2h, 2h + 1) -> C tiles 0, 1 (rows 0..15) and 2, 3 (rows 16..31), 4 tile loads per 4 TDPs
    // (~10 % faster than 1 x 4). A single block (M <= 16, an odd last block)
    // keeps 1 x 4: A tile 4 x B tiles 5, 6, 7, 5 -> C tiles 0..3, 5 loads per 4 TDPs instead of 6.
    for (int64_t rb = 0; rb < nb; rb += 2) {
      const bool two = rb + 1 < nb;
      const int nh = two ? 2 : 1;
      const int8_t* A0 = Ab + rb * 16 * Kp;
      const int8_t* A1 = A0 + 16 * Kp;
      for (int64_t gs0 = k0, gs1; gs0 < k1; gs0 = gs1) {
        const int64_t gi = gs0 / Gp;
        gs1 = (gi + 1) * Gp < k1 ? (gi + 1) * Gp : k1;
        const int64_t kt0 = gs0 / 64, ntk = gs1 / 64 - kt0;
        const bool cont = gs0 % Gp != 0, ends = gs1 % Gp == 0;
        for (int h = 0; h < nh; ++h) {
          // C tile t of this pass: rows 16 * (t / 2) (pair) or 0, columns 32h + 16 * (t % 2) (pair) or 16t
          const int64_t co[4] = {0, 16, two ? 16 * NR : 32, two ? 16 * NR + 16 : 48};
          int32_t* ci = Ci ? Ci + rb * 16 * NR + 32 * h : nullptr;
          if (cont) {
            HF_TILE_LOAD(0, ci + co[0], NR * 4);
            HF_TILE_LOAD(1, ci + co[1], NR * 4);
            HF_TILE_LOAD(2, ci + co[2], NR * 4);
            HF_TILE_LOAD(3, ci + co[3], NR * 4);
          } else {
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
          }
          for (int64_t kt = kt0; kt < gs1 / 64; ++kt) {
            const int8_t* Bk = buf + (kt - k0 / 64) * 4096 + 2048 * h;
            // this k step's shares of the next slice's conversion and of the previous group's epilogue
            auto shares = [&]() HF_TAMX {
              if (nn) {
                const int64_t upto = ++step * nn / nsteps;
                if (upto > done) {
                  amx_convert(p, Bp, Zp, !ZC, k1 + done * 64, k1 + upto * 64, nbuf, k1, far);
                  done = upto;
                }
              }
              if (pend.live) {
                const int64_t i = h * ntk + kt - kt0, n = nh * ntk;
                amx_epilogue<ZC>(p, cb[cbi ^ 1], Sp, Zp, pend, 32 * i / n, 32 * (i + 1) / n);
              }
            };
            HF_TILE_LOAD(4, A0 + kt * 1024, 64);
            if (two) {
              HF_TILE_LOAD(6, Bk, 64);
              HF_TILE_LOAD(7, Bk + 1024, 64);
              HF_TILE_LOAD(5, A1 + kt * 1024, 64);
              shares();
              _tile_dpbssd(0, 4, 6);
              _tile_dpbssd(1, 4, 7);
              _tile_dpbssd(2, 5, 6);
              _tile_dpbssd(3, 5, 7);
            } else {
              HF_TILE_LOAD(5, Bk, 64);
              _tile_dpbssd(0, 4, 5);
              HF_TILE_LOAD(6, Bk + 1024, 64);
              _tile_dpbssd(1, 4, 6);
              HF_TILE_LOAD(7, Bk + 2048, 64);
              _tile_dpbssd(2, 4, 7);
              HF_TILE_LOAD(5, Bk + 3072, 64);
              _tile_dpbssd(3, 4, 5);
              shares();
            }
          }
          int32_t* dst = ends ? cb[cbi] + 32 * h : ci;
          HF_TILE_STORE(0, dst + co[0], NR * 4);
          HF_TILE_STORE(1, dst + co[1], NR * 4);
          HF_TILE_STORE(2, dst + co[2], NR * 4);
          HF_TILE_STORE(3, dst + co[3], NR * 4);
        }
        pend.live = false;
        if (ends) {
          const int64_t nr = rows - rb * 16 < 32 ? rows - rb * 16 : 32;
          pend = AmxEpi{Cf + rb * 16 * NR, m0 + rb * 16, nr, gi, true};
          cbi ^= 1;
        }
      }
    }
  }
  if (pend.live) amx_epilogue<ZC>(p, cb[cbi ^ 1], Sp, Zp, pend, 0, 32);
  const int64_t ncols = (g.N - pn * NR < NR) ? g.N - pn * NR : NR;
  const int64_t es = p.out_type == OUT_F32 ? 4 : 2;
  T512::store_rows(Cf, rows, (char*)p.out + (m0 * p.ldo + pn * NR) * es, p.ldo, p.out_type, ncols,
                   p.act_group ? nullptr : p.ascale + m0, p.bias ? p.bias + pn * NR : nullptr);
}

// asymmetric int4: can code - zero be held in int8 for every column and group of the panel?
HF_TAMX bool amx_zeros_fold(const int32_t* Zp, int64_t n) {
  __m512i lo = _mm512_set1_epi32(-112), hi = _mm512_set1_epi32(128);
  __mmask16 bad = 0;
  for (int64_t i = 0; i < n; i += 16) {
    const __m512i z = _mm512_loadu_si512(Zp + i);
    bad |= _mm512_cmplt_epi32_mask(z, lo) | _mm512_cmpgt_epi32_mask(z, hi);
  }
  return bad == 0;
}

HF_TAMX void amx_items(const Plan& p, int64_t i0, int64_t i1) {
  hf_w4::TileCfg cfg = hf_w4::tile_config();
  for (int t = 0; t < 8; ++t) {
    cfg.colsb[t] = 64;
    cfg.rows[t] = 16;
  }
  hf_w4::load_tile_config(cfg);
  for (int64_t it = i0; it < i1; ++it) {
    const int64_t pn = it % p.g.P;
    if (p.zeros && !amx_zeros_fold(p.zeros + pn * p.g.G * NR, p.g.G * NR)) amx_item<true>(p, it);
    else amx_item<false>(p, it);
  }
  _tile_release();
}

}  // namespace

void gemm_items_amx(const Plan& p, int64_t i0, int64_t i1) { amx_items(p, i0, i1); }

void gemm_items_avx512(const Plan& p, int64_t i0, int64_t i1) { run_items<T512>(p, i0, i1); }
void quant_tiles_avx512(const QuantArgs& q, int64_t t0, int64_t t1) {
  if (q.perm || q.rowmajor) return quant_tiles_impl(q, t0, t1);
  for (int64_t t = t0; t < t1; ++t)
    hf_w4::with_rows<1, 2, 3, 4, 5, 6>(tile_rows(t, q.M), [&](auto r) { quant_tile_fast<decltype(r)::value>(q, t); });
}

}  // namespace hf_w4_int8

#else  // not x86: the portable path stands in
namespace hf_w4_int8 {
void gemm_items_avx512(const Plan& p, int64_t i0, int64_t i1) { gemm_items_generic(p, i0, i1); }
void quant_tiles_avx512(const QuantArgs& q, int64_t t0, int64_t t1) { quant_tiles_generic(q, t0, t1); }
void gemm_items_amx(const Plan& p, int64_t i0, int64_t i1) { gemm_items_generic(p, i0, i1); }
}  // namespace hf_w4_int8
#endif
