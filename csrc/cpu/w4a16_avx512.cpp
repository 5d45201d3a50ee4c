// hf_w4 W4A16: AVX-512 kernels (the avx512 level of common/cpu_features.h: F/BW/VL/DQ/VNNI; VBMI where the CPU has
// it). Raw pointers only, no torch headers; only called when that level was chosen at run time. Design:
// docs/cpu-kernels.md.
#include "common/cpu_features.h"
#if HF_W4_X86
#ifndef HF_W4_EMULATE_AVX512  // (the test-only emulated build: common/simd512.h)
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,fma,f16c,bmi2")
#endif
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include "common/simd512.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "common/cpu_features.h"
#include "w4a16.h"
#include "w4a16_common.h"
#include "w4a16_avx512_util.h"

namespace hf_w4 {
namespace {

// The small-M int16 kernels (1-6 rows) prefetch the weight stream into L1 and, except on AMD, also far ahead into
// L2: on Zen 5 the hardware prefetchers stream it faster without the far prefetch (M = 1, 1 thread: ~10 % in huge
// pages), on the Xeon it helped (docs/cpu-kernels.md, "Tuning notes").
const bool kFarPrefetch = !cpu_caps().amd;

__m512 f32_lut(int mode) {
  alignas(64) float t[16];
  for (int c = 0; c < 16; ++c) t[c] = w4_code_value(mode, c);
  return _mm512_load_ps(t);
}

// MR fp32 activation rows x one 32-column panel, all K; result fp32 [MR][32] into res.
// Per k-pair, 32 bytes -> 4 vectors of 16 fp32 weights whose lanes are (column, k parity):
//   v0: bytes 0..15 low nibbles  = columns 0..7,   v1: bytes 0..15 high nibbles  = columns 16..23,
//   v2: bytes 16..31 low nibbles = columns 8..15,  v3: bytes 16..31 high nibbles = columns 24..31;
// the activation pair (x[k], x[k+1]) is broadcast as 64 bits, fp32 FMA (faster than a vdpbf16ps formulation:
// docs/cpu-kernels.md, "Tuning notes"). Group partial sums are scaled once per group;
// the pair lanes are folded at the end.
template <int MR, int MODE>
void panel_rows(const W4Gemm& g, const uint8_t* q, const float* x, int64_t ldx, const float* xsum, int64_t p,
                const __m512 lut, float* res) {
  // NVFP4 (group 16) with >= 3 rows: scale the 4 weight vectors per k-pair (e2m1 x e4m3 is exact in fp32)
  // and accumulate straight into the output registers - cheaper than flushing a partial sum per row every
  // 8 k-pairs (break-even ~2.7 rows). Otherwise: scale each group's partial sum once per row.
  constexpr bool kScaleW = MODE == W4_NVFP4 && MR >= 3;
  const int64_t G = g.G, kpg = g.gs / 2;
  const __m512i dupA = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
  const __m512i dupB = _mm512_add_epi32(dupA, _mm512_set1_epi32(8));
  alignas(64) float acc[MR][64];
  if (!kScaleW) std::memset(acc, 0, sizeof(acc));
  __m512 t[MR][4];
  for (int m = 0; m < MR; ++m) t[m][0] = t[m][1] = t[m][2] = t[m][3] = _mm512_setzero_ps();
  for (int64_t gi = 0; gi < G; ++gi) {
    const int64_t so = (p * G + gi) * W4_NP;
    __m512 s0, s1;
    load_scales<MODE>(g, so, s0, s1);
    const __m512 sd[4] = {_mm512_permutexvar_ps(dupA, s0), _mm512_permutexvar_ps(dupA, s1),
                          _mm512_permutexvar_ps(dupB, s0), _mm512_permutexvar_ps(dupB, s1)};
    if (!kScaleW)
      for (int m = 0; m < MR; ++m) t[m][0] = t[m][1] = t[m][2] = t[m][3] = _mm512_setzero_ps();
    const uint8_t* qq = q + gi * kpg * W4_NP;
    const float* xg = x + gi * g.gs;
#pragma GCC unroll 2
    for (int64_t j = 0; j < kpg; ++j) {
      _mm_prefetch(reinterpret_cast<const char*>(qq + j * W4_NP + kW4PrefetchBytes), _MM_HINT_T0);
      // vpermps only reads index bits 3:0, so the low nibble needs no mask
      const __m512i b0 = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qq + j * W4_NP)));
      const __m512i b1 = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qq + j * W4_NP + 16)));
      __m512 w0 = _mm512_permutexvar_ps(b0, lut);
      __m512 w1 = _mm512_permutexvar_ps(_mm512_srli_epi32(b0, 4), lut);
      __m512 w2 = _mm512_permutexvar_ps(b1, lut);
      __m512 w3 = _mm512_permutexvar_ps(_mm512_srli_epi32(b1, 4), lut);
      if (kScaleW) {
        w0 = _mm512_mul_ps(w0, sd[0]); w1 = _mm512_mul_ps(w1, sd[1]);
        w2 = _mm512_mul_ps(w2, sd[2]); w3 = _mm512_mul_ps(w3, sd[3]);
      }
      for (int m = 0; m < MR; ++m) {
        double d;
        std::memcpy(&d, xg + m * ldx + 2 * j, 8);
        const __m512 xv = _mm512_castpd_ps(_mm512_set1_pd(d));
        t[m][0] = _mm512_fmadd_ps(w0, xv, t[m][0]);
        t[m][1] = _mm512_fmadd_ps(w1, xv, t[m][1]);
        t[m][2] = _mm512_fmadd_ps(w2, xv, t[m][2]);
        t[m][3] = _mm512_fmadd_ps(w3, xv, t[m][3]);
      }
    }
    if (kScaleW) continue;
    if (MODE == W4_ASYM) {
      // zero point on the even (k parity 0) lane of each column pair only
      const __m512 z0 = _mm512_loadu_ps(g.zs + so), z1 = _mm512_loadu_ps(g.zs + so + 16);
      const __mmask16 ev = 0x5555;
      const __m512 zd[4] = {_mm512_maskz_permutexvar_ps(ev, dupA, z0), _mm512_maskz_permutexvar_ps(ev, dupA, z1),
                            _mm512_maskz_permutexvar_ps(ev, dupB, z0), _mm512_maskz_permutexvar_ps(ev, dupB, z1)};
      for (int m = 0; m < MR; ++m) {
        const __m512 xs = _mm512_set1_ps(xsum[m * G + gi]);
        for (int v = 0; v < 4; ++v) {
          const __m512 a = _mm512_fmadd_ps(t[m][v], sd[v], _mm512_load_ps(acc[m] + 16 * v));
          _mm512_store_ps(acc[m] + 16 * v, _mm512_fnmadd_ps(zd[v], xs, a));
        }
      }
    } else {
      for (int m = 0; m < MR; ++m)
        for (int v = 0; v < 4; ++v)
          _mm512_store_ps(acc[m] + 16 * v, _mm512_fmadd_ps(t[m][v], sd[v], _mm512_load_ps(acc[m] + 16 * v)));
    }
  }
  if (kScaleW)
    for (int m = 0; m < MR; ++m)
      for (int v = 0; v < 4; ++v) _mm512_store_ps(acc[m] + 16 * v, t[m][v]);
  // fold (column, parity) lanes: columns 0..15 from v0 (0..7) and v2 (8..15), 16..31 from v1 and v3
  const __m512i ev = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
  const __m512i od = _mm512_add_epi32(ev, _mm512_set1_epi32(1));
  for (int m = 0; m < MR; ++m) {
    const __m512 v0 = _mm512_load_ps(acc[m]), v1 = _mm512_load_ps(acc[m] + 16);
    const __m512 v2 = _mm512_load_ps(acc[m] + 32), v3 = _mm512_load_ps(acc[m] + 48);
    _mm512_storeu_ps(res + m * W4_NP, _mm512_add_ps(_mm512_permutex2var_ps(v0, ev, v2), _mm512_permutex2var_ps(v0, od, v2)));
    _mm512_storeu_ps(res + m * W4_NP + 16,
                     _mm512_add_ps(_mm512_permutex2var_ps(v1, ev, v3), _mm512_permutex2var_ps(v1, od, v3)));
  }
}

constexpr int kMR = 6;

template <int MODE>
void fused_impl(const W4Gemm& g, const float* x, int64_t M, const float* xsum, int64_t p0, int64_t p1) {
  const int64_t K = g.K, G = g.G, R = M;
  const __m512 lut = f32_lut(MODE);
  std::vector<float> res(R * W4_NP);
  for (int64_t p = p0; p < p1; ++p) {
    const uint8_t* q = g.qpack + p * (K / 2) * W4_NP;
    for (int64_t r0 = 0; r0 < R; r0 += kMR) {
      const int64_t mr = R - r0 < kMR ? R - r0 : kMR;
      const float* x0 = x + r0 * K;
      const float* xs0 = xsum ? xsum + r0 * G : nullptr;
      float* rr = res.data() + r0 * W4_NP;
      with_rows<1, 2, 3, 4, 5, 6>(mr, [&](auto r) { panel_rows<decltype(r)::value, MODE>(g, q, x0, K, xs0, p, lut, rr); });
    }
    for (int64_t m = 0; m < M; ++m) store_row_avx512(g, m, p * W4_NP, res.data() + m * W4_NP, W4_NP);
  }
}

// ---- 16-bit integer activations (w4a16_fused_i16_avx512): the codes stay integers and meet the activations in
// vpdpwssd (2 x int16 products summed into int32 lanes), so one k-pair row of 32 bytes costs a widening load,
// one and / shift (int4) or a LUT (NVFP4: vpermw, or vpermb with VBMI) and two dot instructions - about half the
// vector uops of the fp32 LUT + FMA formulation above, whose vpermps / vpmovzxbd traffic on port 5 is what bounds
// M=1.
// Zero-extended to 16-bit lanes, word i of a k-pair row is byte i = (column i/2, k parity i%2): each 32-bit lane
// is one column's pair (k, k+1), which is exactly vpdpwssd's pairing, so no shuffles are needed: the low nibbles
// give columns 0..15, the high nibbles columns 16..31. Per activation block (ag k) the int32 sums are converted
// once and scaled by weight scale x activation scale.
// Decoders of the int16 path: the 64 bytes of k-pairs j, j + 1 -> the 16-bit weights of each pair's low nibbles
// (columns 0..15) and high nibbles (columns 16..31), word i = byte i of the pair row.
// int4: the codes themselves (vpmovzxbw, and / shift); NVFP4: 2 x e2m1 through a vpermw LUT (index bits 4:0; the
// LUT repeats, so no mask for the low nibble).
template <int MODE>
struct WordDecode {
  __m512i lut;
  WordDecode() {
    alignas(64) int16_t lt[32];
    for (int c = 0; c < 32; ++c) lt[c] = static_cast<int16_t>(2.0f * kE2M1[c & 15]);  // doubled e2m1: integers
    lut = _mm512_load_si512(lt);
  }
  __attribute__((always_inline)) void operator()(const uint8_t* src, __m512i wl[2], __m512i wh[2]) const {
    for (int u = 0; u < 2; ++u) {
      const __m512i w = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + 32 * u)));
      if (MODE == W4_NVFP4) {
        wl[u] = _mm512_permutexvar_epi16(w, lut);
        wh[u] = _mm512_permutexvar_epi16(_mm512_srli_epi16(w, 4), lut);
      } else {
        wl[u] = _mm512_and_si512(w, _mm512_set1_epi16(15));
        wh[u] = _mm512_srli_epi16(w, 4);
      }
    }
  }
};

// Inline asm for the 8-row dot loops of the int16 kernels (panel_rows_i16's int4 blocks, rows_i16). GCC 12 compiled
// them with ~18 register-to-register copies of the 16 int32 accumulators and 2 stack stores per 32 vpdpwssd (it
// renames the accumulators every iteration), which bound the loop by the 6-wide rename rather than by the 2 vpdpwssd
// ports. In asm the accumulators are the outputs a0-7 / b0-7 (columns 0..15 / 16..31 of rows 0-7), zeroed first;
// the flushes stay in C++. Same integers: bit-identical. A row step: broadcast the row's k-pair of x (byte offset
// XOFF + k from the row's pointer) and two vpdpwssd with the pair's weights in zmm WL / WH.
// The emulated build (common/simd512.h) cannot run asm: there the C++ loops stand in (same integers).
#ifndef HF_W4_EMULATE_AVX512
constexpr bool kAsmLoops = true;
#else
constexpr bool kAsmLoops = false;
#endif
#define HF_I16_ZERO2(A, B) "vpxord %[" A "], %[" A "], %[" A "]\n\tvpxord %[" B "], %[" B "], %[" B "]\n\t"
#define HF_I16_ZERO8                                                                                        \
  HF_I16_ZERO2("a0", "b0") HF_I16_ZERO2("a1", "b1") HF_I16_ZERO2("a2", "b2") HF_I16_ZERO2("a3", "b3") \
  HF_I16_ZERO2("a4", "b4") HF_I16_ZERO2("a5", "b5") HF_I16_ZERO2("a6", "b6") HF_I16_ZERO2("a7", "b7")
#define HF_I16_ROW(XOFF, X, WL, WH, A, B)                         \
  "vpbroadcastd " XOFF "(%[" X "],%[k],1), %%zmm27\n\t"         \
  "vpdpwssd %%zmm27, %%zmm" WL ", %[" A "]\n\t"                 \
  "vpdpwssd %%zmm27, %%zmm" WH ", %[" B "]\n\t"
#define HF_I16_ROWS8(XOFF, WL, WH)                                                                              \
  HF_I16_ROW(XOFF, "x0", WL, WH, "a0", "b0") HF_I16_ROW(XOFF, "x1", WL, WH, "a1", "b1")                        \
  HF_I16_ROW(XOFF, "x2", WL, WH, "a2", "b2") HF_I16_ROW(XOFF, "x3", WL, WH, "a3", "b3")                        \
  HF_I16_ROW(XOFF, "x4", WL, WH, "a4", "b4") HF_I16_ROW(XOFF, "x5", WL, WH, "a5", "b5")                        \
  HF_I16_ROW(XOFF, "x6", WL, WH, "a6", "b6") HF_I16_ROW(XOFF, "x7", WL, WH, "a7", "b7")
// NVFP4 with activation blocks of ag = 16 nb k (below kNvFoldMinM rows): per 16-k block the int32 sums times the
// block's column scales go into fp32 partial sums t (one FMA per row and column half), and t times the activation
// scale into res once per activation block. With ag = 16 it took a multiply and an FMA per 16-k block and row: on
// Zen 5 these kernels are bound by the multiply pipes that vpdpwssd shares (5-15 % faster at M = 2-4).
template <int MR, class Decode>
__attribute__((always_inline)) inline void panel_rows_i16_nvwide(const W4Gemm& g, const uint8_t* q,
                                                                 const int16_t* xq, int64_t ldx, const float* xs,
                                                                 int64_t ag, int64_t p, const Decode& decode,
                                                                 float* res) {
  const int64_t nab = g.K / ag;
  const int nb = static_cast<int>(ag / 16);
  const uint8_t* sp = static_cast<const uint8_t*>(g.scales) + p * g.G * W4_NP;
  for (int m = 0; m < MR; ++m) {
    _mm512_storeu_ps(res + m * W4_NP, _mm512_setzero_ps());
    _mm512_storeu_ps(res + m * W4_NP + 16, _mm512_setzero_ps());
  }
  constexpr int U = MR <= 2 ? 2 : 1;  // even and odd k-pairs in separate chains (latency bound otherwise)
  for (int64_t b = 0; b < nab; ++b) {
    __m512 t[MR][2];
    for (int m = 0; m < MR; ++m) t[m][0] = t[m][1] = _mm512_setzero_ps();
    for (int i = 0; i < nb; ++i) {
      // the block's scales / 2^8 (fp8x32_to_ps without its multiply; the 2^7 goes into the activation scale)
      const __m512i h = fp8x32_to_ph_bits(sp + (b * nb + i) * W4_NP);
      const __m512 s0 = _mm512_cvtph_ps(_mm512_castsi512_si256(h)), s1 = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(h, 1));
      __m512i a[U][MR][2];
      for (int u = 0; u < U; ++u)
        for (int m = 0; m < MR; ++m) a[u][m][0] = a[u][m][1] = _mm512_setzero_si512();
      const uint8_t* qq = q + (b * nb + i) * 8 * W4_NP;
      const int16_t* xb = xq + b * ag + 16 * i;
      for (int j = 0; j < 8; j += 2) {
        _mm_prefetch(reinterpret_cast<const char*>(qq + j * W4_NP + kW4PrefetchBytes), _MM_HINT_T0);
        if (kFarPrefetch) _mm_prefetch(reinterpret_cast<const char*>(qq + j * W4_NP + kW4PrefetchFarBytes), _MM_HINT_T1);
        __m512i wl[2], wh[2];
        decode(qq + j * W4_NP, wl, wh);
        for (int u = 0; u < 2; ++u)
          for (int m = 0; m < MR; ++m) {
            int32_t xp;
            std::memcpy(&xp, xb + m * ldx + 2 * (j + u), 4);
            const __m512i xv = _mm512_set1_epi32(xp);
            __m512i* am = a[U == 2 ? u : 0][m];
            am[0] = _mm512_dpwssd_epi32(am[0], wl[u], xv);
            am[1] = _mm512_dpwssd_epi32(am[1], wh[u], xv);
          }
      }
      for (int m = 0; m < MR; ++m) {
        if (U == 2) {
          a[0][m][0] = _mm512_add_epi32(a[0][m][0], a[U - 1][m][0]);
          a[0][m][1] = _mm512_add_epi32(a[0][m][1], a[U - 1][m][1]);
        }
        t[m][0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a[0][m][0]), s0, t[m][0]);
        t[m][1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a[0][m][1]), s1, t[m][1]);
      }
    }
    for (int m = 0; m < MR; ++m) {
      const __m512 xsv = _mm512_set1_ps(xs[m * nab + b] * 0x1p7f);  // 2^8 / 2 (the LUT holds 2 x e2m1)
      float* r = res + m * W4_NP;
      _mm512_storeu_ps(r, _mm512_fmadd_ps(t[m][0], xsv, _mm512_loadu_ps(r)));
      _mm512_storeu_ps(r + 16, _mm512_fmadd_ps(t[m][1], xsv, _mm512_loadu_ps(r + 16)));
    }
  }
}

template <int MR, int MODE, class Decode>
__attribute__((always_inline)) inline void panel_rows_i16(const W4Gemm& g, const uint8_t* q, const int16_t* xq,
                                                          int64_t ldx, const float* xs, const int32_t* xd, int64_t ag,
                                                          int64_t p, const Decode& decode, float* res) {
  if constexpr (MODE == W4_NVFP4 && MR <= 6)
    if (ag > 16) return panel_rows_i16_nvwide<MR>(g, q, xq, ldx, xs, ag, p, decode, res);
  const int64_t nab = g.K / ag, bpg = g.gs / ag, pairs = ag / 2;
  // MR = 8 (int4): the fp32 sums live in res (L1) instead of registers, which the int32 sums of 8 rows fill
  constexpr bool kMem = MR > 6;
  __m512 o[kMem ? 1 : MR][2];
  for (int m = 0; m < (kMem ? 1 : MR); ++m) o[m][0] = o[m][1] = _mm512_setzero_ps();
  if constexpr (kMem)
    for (int m = 0; m < MR; ++m) {
      _mm512_storeu_ps(res + m * W4_NP, _mm512_setzero_ps());
      _mm512_storeu_ps(res + m * W4_NP + 16, _mm512_setzero_ps());
    }
  __m512 s0 = _mm512_setzero_ps(), s1 = s0, z0 = s0, z1 = s0;
  for (int64_t b = 0, gi = 0, left = 0; b < nab; ++b) {
    if (left == 0) {  // a new weight group (no division per block: NVFP4 has one per 16 k)
      const int64_t so = (p * g.G + gi++) * W4_NP;
      left = bpg;
      // NVFP4: 2^8 / 2 (the LUT holds 2 x e2m1)
      if (MODE == W4_NVFP4) fp8x32_to_ps(static_cast<const uint8_t*>(g.scales) + so, 0x1p7f, s0, s1);
      else load_scales<MODE>(g, so, s0, s1);
      if (MODE == W4_ASYM) { z0 = _mm512_loadu_ps(g.zs + so); z1 = _mm512_loadu_ps(g.zs + so + 16); }
    }
    --left;
    // MR <= 2: even and odd k-pairs in separate accumulators (the vpdpwssd chains are latency bound otherwise)
    constexpr int U = MR <= 2 ? 2 : 1;
    __m512i a[U][MR][2];
    for (int u = 0; u < U; ++u)
      for (int m = 0; m < MR; ++m) a[u][m][0] = a[u][m][1] = _mm512_setzero_si512();
    const uint8_t* qq = q + b * pairs * W4_NP;
    const int16_t* xb = xq + b * ag;
    if constexpr (kAsmLoops && MR == 8 && MODE != W4_NVFP4) {
      // int4, 8 rows: the loop in inline asm (see HF_I16_ROW), a few % faster than the compiler's. k = 4 x the
      // k-pair index: the byte offset into each row of x, and (scaled by 8) into the codes.
      static_assert(kW4PrefetchBytes == 8192 && kW4PrefetchFarBytes == 32768, "the asm spells both distances");
      int64_t k = 0;
      asm volatile(
          HF_I16_ZERO8 "1:\n\t"
          "vpmovzxbw (%[q],%[k],8), %%zmm30\n\t"
          "vpmovzxbw 32(%[q],%[k],8), %%zmm31\n\t"
          "prefetcht0 8192(%[q],%[k],8)\n\t"
          "prefetcht1 32768(%[q],%[k],8)\n\t"
          "vpsrlw $4, %%zmm30, %%zmm29\n\t"
          "vpandd %[m15], %%zmm30, %%zmm30\n\t"
          "vpsrlw $4, %%zmm31, %%zmm28\n\t"
          "vpandd %[m15], %%zmm31, %%zmm31\n\t"
          HF_I16_ROWS8("", "30", "29") HF_I16_ROWS8("4", "31", "28")
          "add $8, %[k]\n\t"
          "cmp %[n], %[k]\n\t"
          "jl 1b\n\t"
          : [a0] "=&v"(a[0][0][0]), [b0] "=&v"(a[0][0][1]), [a1] "=&v"(a[0][1][0]), [b1] "=&v"(a[0][1][1]),
            [a2] "=&v"(a[0][2][0]), [b2] "=&v"(a[0][2][1]), [a3] "=&v"(a[0][3][0]), [b3] "=&v"(a[0][3][1]),
            [a4] "=&v"(a[0][4][0]), [b4] "=&v"(a[0][4][1]), [a5] "=&v"(a[0][5][0]), [b5] "=&v"(a[0][5][1]),
            [a6] "=&v"(a[0][6][0]), [b6] "=&v"(a[0][6][1]), [a7] "=&v"(a[0][7][0]), [b7] "=&v"(a[0][7][1]),
            [k] "+r"(k)
          : [q] "r"(qq), [x0] "r"(xb), [x1] "r"(xb + ldx), [x2] "r"(xb + 2 * ldx), [x3] "r"(xb + 3 * ldx),
            [x4] "r"(xb + 4 * ldx), [x5] "r"(xb + 5 * ldx), [x6] "r"(xb + 6 * ldx), [x7] "r"(xb + 7 * ldx),
            [n] "r"(4 * pairs), [m15] "v"(_mm512_set1_epi16(15))
          : "xmm27", "xmm28", "xmm29", "xmm30", "xmm31", "cc", "memory");
    } else
    for (int64_t j = 0; j < pairs; j += 2) {  // pairs is even: one 64-byte line per iteration
      _mm_prefetch(reinterpret_cast<const char*>(qq + j * W4_NP + kW4PrefetchBytes), _MM_HINT_T0);
      if (kFarPrefetch) _mm_prefetch(reinterpret_cast<const char*>(qq + j * W4_NP + kW4PrefetchFarBytes), _MM_HINT_T1);
      __m512i wl[2], wh[2];
      decode(qq + j * W4_NP, wl, wh);
#pragma GCC unroll 2
      for (int u = 0; u < 2; ++u) {
        const int64_t jj = j + u;
        for (int m = 0; m < MR; ++m) {
          int32_t xp;
          std::memcpy(&xp, xb + m * ldx + 2 * jj, 4);
          const __m512i xv = _mm512_set1_epi32(xp);
          __m512i* am = a[U == 2 ? u : 0][m];
          am[0] = _mm512_dpwssd_epi32(am[0], wl[u], xv);
          am[1] = _mm512_dpwssd_epi32(am[1], wh[u], xv);
        }
      }
    }
    if (U == 2)
      for (int m = 0; m < MR; ++m) {
        a[0][m][0] = _mm512_add_epi32(a[0][m][0], a[U - 1][m][0]);
        a[0][m][1] = _mm512_add_epi32(a[0][m][1], a[U - 1][m][1]);
      }
    for (int m = 0; m < MR; ++m) {
      __m512i* am = a[0][m];
      const int64_t i = m * nab + b;
      if (MODE == W4_SYM) {  // codes carry +8: subtract 8 * sum(D) exactly, in int32
        const __m512i c8 = _mm512_set1_epi32(8 * xd[i]);
        am[0] = _mm512_sub_epi32(am[0], c8);
        am[1] = _mm512_sub_epi32(am[1], c8);
      }
      const __m512 xsv = _mm512_set1_ps(xs[i]);
      float* r = res + m * W4_NP;
      __m512 o0, o1;
      if constexpr (kMem) {
        o0 = _mm512_loadu_ps(r);
        o1 = _mm512_loadu_ps(r + 16);
      } else {
        o0 = o[m][0];
        o1 = o[m][1];
      }
      o0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(am[0]), _mm512_mul_ps(s0, xsv), o0);
      o1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(am[1]), _mm512_mul_ps(s1, xsv), o1);
      if (MODE == W4_ASYM) {  // - zero*scale * sum(x)
        const __m512 xsum = _mm512_set1_ps(xs[i] * static_cast<float>(xd[i]));
        o0 = _mm512_fnmadd_ps(z0, xsum, o0);
        o1 = _mm512_fnmadd_ps(z1, xsum, o1);
      }
      if constexpr (kMem) {
        _mm512_storeu_ps(r, o0);
        _mm512_storeu_ps(r + 16, o1);
      } else {
        o[m][0] = o0;
        o[m][1] = o1;
      }
    }
  }
  if constexpr (!kMem)
    for (int m = 0; m < MR; ++m) {
      _mm512_storeu_ps(res + m * W4_NP, o[m][0]);
      _mm512_storeu_ps(res + m * W4_NP + 16, o[m][1]);
    }
}

// Rows go in blocks of 8 (int4) or 6 (NVFP4; 8 when exactly 8 are left), the rest in blocks of 4 and one of 1-3: each
// block decodes the panel's codes once, so larger blocks spread the decode over more rows. 8 rows keep their fp32 sums
// in res (the int32 sums fill the registers; int4 flushes once per group); NVFP4 flushes every 16 k, so its 6-row
// blocks keep them in registers. Bit-identical to blocks of 4, 10-20 % faster from M = 8 (docs/cpu-kernels.md,
// "Tuning notes"); larger blocks spill registers. On a CPU with AMX this path takes only M <= 4.
template <int MODE, class Decode>
__attribute__((always_inline)) inline void fused_i16_impl(const W4Gemm& g, const int16_t* xq, const float* xs,
                                                          const int32_t* xd, int64_t M, int64_t ag, int64_t p0,
                                                          int64_t p1, const Decode& decode) {
  const int64_t K = g.K, nab = K / ag;
  alignas(64) float res[8 * W4_NP];
  constexpr bool nv = MODE == W4_NVFP4;
  for (int64_t p = p0; p < p1; ++p) {
    const uint8_t* q = g.qpack + p * (K / 2) * W4_NP;
    for (int64_t r0 = 0, mr; r0 < M; r0 += mr) {
      const int64_t left = M - r0;
      mr = left >= 8 && (!nv || left == 8) ? 8 : nv && left >= 6 ? 6 : left < 4 ? left : 4;
      const int16_t* x0 = xq + r0 * K;
      const float* s0 = xs + r0 * nab;
      const int32_t* d0 = xd + r0 * nab;
      // a switch, not with_rows: a lambda gets the target options of the place it is written, outside the VBMI
      // region, and the VBMI caller's decoder would then be called out of line for every k-pair (~1.4x slower)
      switch (mr) {
        case 8: panel_rows_i16<8, MODE>(g, q, x0, K, s0, d0, ag, p, decode, res); break;
        case 6: panel_rows_i16<6, MODE>(g, q, x0, K, s0, d0, ag, p, decode, res); break;
        case 1: panel_rows_i16<1, MODE>(g, q, x0, K, s0, d0, ag, p, decode, res); break;
        case 2: panel_rows_i16<2, MODE>(g, q, x0, K, s0, d0, ag, p, decode, res); break;
        case 3: panel_rows_i16<3, MODE>(g, q, x0, K, s0, d0, ag, p, decode, res); break;
        default: panel_rows_i16<4, MODE>(g, q, x0, K, s0, d0, ag, p, decode, res); break;
      }
      for (int64_t m = 0; m < mr; ++m) store_row_avx512(g, r0 + m, p * W4_NP, res + m * W4_NP, W4_NP);
    }
  }
}

// MR int16 activation rows x nf * pf k-pairs of decoded int16 weights w (4 vectors per 2 k-pairs: pair j's columns
// 0..15 and 16..31, then pair j + 1's), flushed into the fp32 sums o [MR][32] every pf k-pairs with the column
// scales cs + 32 f and the activation scale xs[m * nab]. MR <= 2 splits even and odd k-pairs into two accumulator
// chains (latency bound otherwise).
template <int MR>
__attribute__((always_inline)) inline void rows_i16(const int16_t* w, int64_t pf, int nf, const int16_t* x,
                                                    int64_t ldx, const float* cs, const float* xs, int64_t nab,
                                                    float* o) {
  constexpr int U = MR <= 2 ? 2 : 1;
  for (int fi = 0; fi < nf; ++fi) {
    __m512i a0[MR], a1[MR], b0[MR], b1[MR];  // columns 0..15 / 16..31; b: the odd k-pairs when U = 2
    for (int m = 0; m < MR; ++m) a0[m] = a1[m] = b0[m] = b1[m] = _mm512_setzero_si512();
    const int16_t* wf = w + fi * pf * 2 * W4_NP;
    const int16_t* xf = x + 2 * fi * pf;
    if constexpr (kAsmLoops && MR == 8) {
      // in inline asm, as panel_rows_i16's int4 loop (a few % faster than the compiler's)
      int64_t k = 0;
      const int16_t* wp = wf;
      asm volatile(
          HF_I16_ZERO8 "1:\n\t"
          "vmovdqa64 (%[w]), %%zmm30\n\t"
          "vmovdqa64 64(%[w]), %%zmm29\n\t"
          "vmovdqa64 128(%[w]), %%zmm31\n\t"
          "vmovdqa64 192(%[w]), %%zmm28\n\t"
          HF_I16_ROWS8("", "30", "29") HF_I16_ROWS8("4", "31", "28")
          "add $256, %[w]\n\t"
          "add $8, %[k]\n\t"
          "cmp %[n], %[k]\n\t"
          "jl 1b\n\t"
          : [a0] "=&v"(a0[0]), [b0] "=&v"(a1[0]), [a1] "=&v"(a0[1]), [b1] "=&v"(a1[1]), [a2] "=&v"(a0[2]),
            [b2] "=&v"(a1[2]), [a3] "=&v"(a0[3]), [b3] "=&v"(a1[3]), [a4] "=&v"(a0[4]), [b4] "=&v"(a1[4]),
            [a5] "=&v"(a0[5]), [b5] "=&v"(a1[5]), [a6] "=&v"(a0[6]), [b6] "=&v"(a1[6]), [a7] "=&v"(a0[7]),
            [b7] "=&v"(a1[7]), [w] "+r"(wp), [k] "+r"(k)
          : [x0] "r"(xf), [x1] "r"(xf + ldx), [x2] "r"(xf + 2 * ldx), [x3] "r"(xf + 3 * ldx), [x4] "r"(xf + 4 * ldx),
            [x5] "r"(xf + 5 * ldx), [x6] "r"(xf + 6 * ldx), [x7] "r"(xf + 7 * ldx), [n] "r"(4 * pf)
          : "xmm27", "xmm28", "xmm29", "xmm30", "xmm31", "cc", "memory");
    } else
    for (int64_t j = 0; j < pf; j += 2) {
#pragma GCC unroll 2
      for (int u = 0; u < 2; ++u) {
        const __m512i l = _mm512_load_si512(wf + 64 * (j + u)), h = _mm512_load_si512(wf + 64 * (j + u) + 32);
        for (int m = 0; m < MR; ++m) {
          int32_t xp;
          std::memcpy(&xp, xf + m * ldx + 2 * (j + u), 4);
          const __m512i xv = _mm512_set1_epi32(xp);
          if (U == 2 && u == 1) {
            b0[m] = _mm512_dpwssd_epi32(b0[m], l, xv);
            b1[m] = _mm512_dpwssd_epi32(b1[m], h, xv);
          } else {
            a0[m] = _mm512_dpwssd_epi32(a0[m], l, xv);
            a1[m] = _mm512_dpwssd_epi32(a1[m], h, xv);
          }
        }
      }
    }
    const __m512 c0 = _mm512_load_ps(cs + W4_NP * fi), c1 = _mm512_load_ps(cs + W4_NP * fi + 16);
    for (int m = 0; m < MR; ++m) {
      if (U == 2) {
        a0[m] = _mm512_add_epi32(a0[m], b0[m]);
        a1[m] = _mm512_add_epi32(a1[m], b1[m]);
      }
      const __m512 xsv = _mm512_set1_ps(xs[m * nab]);
      float* r = o + m * W4_NP;
      _mm512_store_ps(r, _mm512_fmadd_ps(_mm512_cvtepi32_ps(a0[m]), _mm512_mul_ps(c0, xsv), _mm512_load_ps(r)));
      _mm512_store_ps(r + 16,
                      _mm512_fmadd_ps(_mm512_cvtepi32_ps(a1[m]), _mm512_mul_ps(c1, xsv), _mm512_load_ps(r + 16)));
    }
  }
}

#pragma GCC push_options
#ifndef HF_W4_EMULATE_AVX512
#pragma GCC target("avx512vbmi")
#endif
// NVFP4 with AVX512-VBMI: the e2m1 LUT applied to the bytes (vpermb, one uop for 64 codes; index bits 5:0 and the
// LUT repeats every 16, so no masks - the word shift's stray bits land in bits 4..7 of the low bytes), then the
// results sign-extended to words, instead of a vpermw per 32 codes (two uops on Intel): 9 uops per two k-pairs
// instead of 12, a few % faster at M = 1-4. Same integers: bit-identical results.
// operator() is plain inline: GCC inlines it once fused_i16_impl sits in the VBMI caller (always_inline would be
// checked against fused_i16_impl's own target first and fail).
struct ByteLutDecode {
  __m512i lut;
  ByteLutDecode() {
    alignas(64) int8_t lt[64];
    for (int c = 0; c < 64; ++c) lt[c] = static_cast<int8_t>(2.0f * kE2M1[c & 15]);
    lut = _mm512_load_si512(lt);
  }
  inline void operator()(const uint8_t* src, __m512i wl[2], __m512i wh[2]) const {
    const __m512i raw = _mm512_loadu_si512(src);
    const __m512i lo = _mm512_permutexvar_epi8(raw, lut);
    const __m512i hi = _mm512_permutexvar_epi8(_mm512_srli_epi16(raw, 4), lut);
    wl[0] = _mm512_cvtepi8_epi16(_mm512_castsi512_si256(lo));
    wl[1] = _mm512_cvtepi8_epi16(_mm512_extracti64x4_epi64(lo, 1));
    wh[0] = _mm512_cvtepi8_epi16(_mm512_castsi512_si256(hi));
    wh[1] = _mm512_cvtepi8_epi16(_mm512_extracti64x4_epi64(hi, 1));
  }
};

void fused_i16_nvfp4_vbmi(const W4Gemm& g, const int16_t* xq, const float* xs, const int32_t* xd, int64_t M,
                          int64_t ag, int64_t p0, int64_t p1) {
  fused_i16_impl<W4_NVFP4>(g, xq, xs, xd, M, ag, p0, p1, ByteLutDecode());
}
// ---- NVFP4 on the int16 path with the block scales folded into the weights (w4a16_fused_i16_avx512, M >= 8 with VBMI):
// one fp32 flush per activation block of L = 16 * nb k (up to 128) instead of one per 16-k block. An e4m3 scale is
// mt * 2^(ee - 10) with the integer mantissa mt (8..15, or 0..7 for the denormals, ee = 1), and the doubled e2m1 value
// 2w is an integer up to 12. So with eref = (largest ee of the column over the nb blocks) - kNvFoldD each weight is
// exactly (2w) * (mt << (ee - eref)) * 2^(eref - 11): an int16 (|.| <= 12 * 15 * 2^kNvFoldD = 2880), the doubled
// e2m1 value times a multiplier of at most 240 (one vpmaddubsw per 32 codes), and one column scale
// 2^(eref - 11) per activation block. A block whose ee lies more than kNvFoldD
// below the largest would lose bits: when any of the 32 columns has such a pair of nonzero blocks, that activation
// block of the panel flushes once per 16-k block instead (multiplier mt, scale 2^(ee - 11)), the same arithmetic as
// without folding. Exact in both cases; the int32 sums stay below 2^31 because the activation quantizer bounds each
// block's sum of |xq| by kNvFoldL1 (w4a16.h). Each activation block's codes are decoded once, by the first 8-row block
// (rows8_nvfp4_codes, in registers, among its dot products) into an L1 buffer that the other row blocks then read, so
// the decode, the multiplies and the fold are shared by the M rows. Faster than the per-16-k kernel from M = 8 on
// Zen 5 (by ~25 % at M = 16-32 before rows8_nvfp4_codes, which took another 5-14 %); slower up to M = 6, which keeps
// the per-16-k kernel. What is left against int4 (docs/cpu-kernels.md, "Small
// M on Zen 5") is the decode beyond int4's and / shift (its multiplies on the pipes of vpdpwssd) and the fold of the
// scales once per panel and activation block.
struct NvFold {
  alignas(64) int16_t mult[8][2][32];  // [16-k block][column half]: each column's multiplier in both words of its lane
  alignas(64) float cs[8][W4_NP];      // column scales: [0] for the activation block, or one per 16-k block
  bool one;                            // one flush per activation block
};

// Folds the block scales of one panel and activation block (nb <= 8 blocks of 32 bytes from sp) in bytes, with
// vpermi2b tables over the 7-bit scale byte v (sign clear):
//   tee: v -> ee (0 for v = 0, so a zero block leaves the maximum alone); tmin: the same with v = 0 -> 63;
//   tden: v -> (v & 7) | (v < 8) << 6; tmul: (v & 7) | sh << 3 | (v < 8) << 6 -> mt << sh (mt = 8 + (v & 7), or
//   v & 7 for denormals and 0 for v = 0; sh <= kNvFoldD, so at most 240).
struct NvFolder {
  alignas(64) uint8_t tb[4][128];  // tee, tmin, tden, tmul
  alignas(64) uint8_t dup[4][64];
  NvFolder() {
    for (int v = 0; v < 128; ++v) {
      const int ee = std::max(v >> 3, 1), m = v & 7, sh = (v >> 3) & 7;
      tb[0][v] = static_cast<uint8_t>(v == 0 ? 0 : ee);
      tb[1][v] = static_cast<uint8_t>(v == 0 ? 63 : ee);
      tb[2][v] = static_cast<uint8_t>(m | (v < 8 ? 64 : 0));
      tb[3][v] = static_cast<uint8_t>(sh <= kNvFoldD ? ((v & 64) ? m : 8 + m) << sh : 0);  // index (m, sh, denormal)
    }
    // dup[2 * (b % 2) + h]: word i <- byte 32 (b % 2) + 16 h + i / 2 (the odd bytes are zeroed by the mask)
    for (int k = 0; k < 4; ++k)
      for (int i = 0; i < 64; ++i) dup[k][i] = static_cast<uint8_t>(32 * (k / 2) + 16 * (k % 2) + i / 4);
  }
  // The tables are loaded at each use on purpose: hoisted out of the loops, their 12 registers pushed the
  // accumulators of rows_i16 onto the stack.
  static __m512i lut(const uint8_t* t, __m512i v) {
    return _mm512_permutex2var_epi8(_mm512_load_si512(t), v, _mm512_load_si512(t + 64));
  }
  inline void operator()(const uint8_t* sp, int nb, NvFold& f) const {
    const uint8_t* t = tb[0];
    asm("" : "+r"(t));  // not loop-invariant to the compiler (see lut)
    const __mmask64 even = 0x5555555555555555ull;
    const int nv = (nb + 1) / 2;  // vectors of two blocks
    __m512i v[4], ee[4], mx = _mm512_setzero_si512(), mn = _mm512_set1_epi8(63);
    for (int i = 0; i < nv; ++i) {
      v[i] = _mm512_maskz_loadu_epi8(nb >= 2 * i + 2 ? ~0ull : 0xffffffffull, sp + 64 * i);
      ee[i] = lut(t, v[i]);
      mx = _mm512_max_epu8(mx, ee[i]);
      mn = _mm512_min_epu8(mn, lut(t + 128, v[i]));
    }
    mx = _mm512_max_epu8(mx, _mm512_shuffle_i64x2(mx, mx, 0x4e));  // both 256-bit halves: the 32 columns
    mn = _mm512_min_epu8(mn, _mm512_shuffle_i64x2(mn, mn, 0x4e));
    // a column whose nonzero blocks' exponents spread over more than kNvFoldD (mn = 63 if all are zero)
    f.one = _mm512_cmpgt_epi8_mask(_mm512_sub_epi8(mx, mn), _mm512_set1_epi8(kNvFoldD)) == 0;
    const __m512i eref = _mm512_sub_epi8(mx, _mm512_set1_epi8(kNvFoldD));
    const __m512i bias = _mm512_set1_epi32(116);
    for (int i = 0; i < nv; ++i) {
      // sh = ee - eref into bits 5:3 (zero blocks: any sh, their entries are 0); without folding sh = 0
      __m512i idx = lut(t + 256, v[i]);
      if (f.one)
        idx = _mm512_ternarylogic_epi32(idx, _mm512_slli_epi16(_mm512_sub_epi8(ee[i], eref), 3), _mm512_set1_epi8(0x38),
                                        0xf8);  // idx | (sh & 0x38)
      const __m512i mu = lut(t + 384, idx);
      for (int k = 0; k < 4 && 2 * i + k / 2 < nb; ++k)
        _mm512_store_si512(f.mult[2 * i + k / 2][k % 2],
                           _mm512_maskz_permutexvar_epi8(even, _mm512_load_si512(t + 512 + 64 * k), mu));
      if (!f.one)
        for (int k = 0; k < 2 && 2 * i + k < nb; ++k)
          for (int h = 0; h < 2; ++h) {
            const __m512i e32 = _mm512_cvtepu8_epi32(_mm512_extracti32x4_epi32(ee[i], 2 * k + h));
            _mm512_store_si512(f.cs[2 * i + k] + 16 * h, _mm512_slli_epi32(_mm512_add_epi32(e32, bias), 23));
          }
    }
    if (f.one)
      for (int h = 0; h < 2; ++h) {
        const __m512i e32 = _mm512_cvtepi8_epi32(_mm512_extracti32x4_epi32(eref, h));
        _mm512_store_si512(f.cs[0] + 16 * h, _mm512_slli_epi32(_mm512_add_epi32(e32, bias), 23));
      }
  }
};

// The 64 code bytes of k-pairs j, j + 1 -> their folded int16 weights w[0..3] (pair j's columns 0..15 and 16..31,
// then pair j + 1's) for the multipliers ml / mh of the 16-k block (NvFold::mult: a u8 in the low byte of each
// word, 0 in the high one): the codes zero-extended to words, each nibble's doubled e2m1 value by vpshufb (the
// word's high byte, 0, looks up entry 0, which is 0) and vpmaddubsw (u8 x s8 pairs summed into a word: here
// multiplier x value, sign-extended). On Zen 5 vpshufb runs beside vpdpwssd where vpermb and the byte-to-word
// sign extensions of ByteLutDecode (+ vpmullw) take issue slots from it (a loop of 32 vpdpwssd: +14 % time with this
// decode, +20 % with that one).
__attribute__((always_inline)) inline void nv_fold_decode(const uint8_t* src, __m512i lut, __m512i ml, __m512i mh,
                                                          __m512i w[4]) {
  for (int u = 0; u < 2; ++u) {
    const __m512i c = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + 32 * u)));
    w[2 * u] = _mm512_maddubs_epi16(ml, _mm512_shuffle_epi8(lut, _mm512_and_si512(c, _mm512_set1_epi16(15))));
    w[2 * u + 1] = _mm512_maddubs_epi16(mh, _mm512_shuffle_epi8(lut, _mm512_srli_epi16(c, 4)));
  }
}

// 8 rows x one activation block (nb 16-k blocks of the codes qb), decoded in registers (nv_fold_decode) straight
// into the dot products, instead of in a pass of its own into the L1 buffer that rows_i16 reads: the same integers,
// with the decode among the dot products (where vpdpwssd leaves it room) instead of before them. Flushed into the fp32
// sums o [8][32] as rows_i16 does (once per activation block, or per 16-k block where the fold is not one):
// bit-identical.
// Bytes 8 h .. 8 h + 7 of the doubled e2m1 table (2 x kE2M1, int8) as a little-endian qword.
constexpr uint64_t e2m1x2_qword(int h) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = v << 8 | static_cast<uint8_t>(static_cast<int8_t>(2.0f * kE2M1[8 * h + i]));
  return v;
}

// The asm loop of rows8_nvfp4_codes; STORE: the decoded weights also into the buffer at w (rows_i16's layout).
#define HF_NV_ROWS8(STORE)                               \
  HF_I16_ZERO8                                           \
  "movl $0x000f000f, %%eax\n\t"                          \
  "vpbroadcastd %%eax, %%zmm24\n\t"                      \
  "movabs $0x0c08060403020100, %%rax\n\t"                \
  "vmovq %%rax, %%xmm23\n\t"                             \
  "movabs $0xf4f8fafcfdfeff00, %%rax\n\t"                \
  "vpinsrq $1, %%rax, %%xmm23, %%xmm23\n\t"              \
  "vshufi32x4 $0, %%zmm23, %%zmm23, %%zmm23\n\t"         \
  "1:\n\t"                                               \
  "vmovdqa64 (%[mp],%[k],4), %%zmm25\n\t"                \
  "vmovdqa64 64(%[mp],%[k],4), %%zmm26\n\t"              \
  "2:\n\t"                                               \
  "vpmovzxbw (%[q],%[k],8), %%zmm28\n\t"                 \
  "vpmovzxbw 32(%[q],%[k],8), %%zmm31\n\t"               \
  "prefetcht0 8192(%[q],%[k],8)\n\t"                     \
  "prefetcht1 32768(%[q],%[k],8)\n\t"                    \
  "vpsrlw $4, %%zmm28, %%zmm29\n\t"                      \
  "vpsrlw $4, %%zmm31, %%zmm30\n\t"                      \
  "vpandd %%zmm24, %%zmm28, %%zmm28\n\t"                 \
  "vpandd %%zmm24, %%zmm31, %%zmm31\n\t"                 \
  "vpshufb %%zmm28, %%zmm23, %%zmm28\n\t"                \
  "vpshufb %%zmm29, %%zmm23, %%zmm29\n\t"                \
  "vpshufb %%zmm31, %%zmm23, %%zmm31\n\t"                \
  "vpshufb %%zmm30, %%zmm23, %%zmm30\n\t"                \
  "vpmaddubsw %%zmm28, %%zmm25, %%zmm28\n\t"             \
  "vpmaddubsw %%zmm29, %%zmm26, %%zmm29\n\t"             \
  "vpmaddubsw %%zmm31, %%zmm25, %%zmm31\n\t"             \
  "vpmaddubsw %%zmm30, %%zmm26, %%zmm30\n\t"             \
  STORE                                                  \
  HF_I16_ROWS8("", "28", "29") HF_I16_ROWS8("4", "31", "30") \
  "add $8, %[k]\n\t"                                     \
  "test $31, %[k]\n\t"                                   \
  "jnz 2b\n\t"                                           \
  "test %[k], %[k]\n\t"                                  \
  "jnz 1b\n\t"
#define HF_NV_STORE                                      \
  "vmovdqa64 %%zmm28, (%[w])\n\t"                        \
  "vmovdqa64 %%zmm29, 64(%[w])\n\t"                      \
  "vmovdqa64 %%zmm31, 128(%[w])\n\t"                     \
  "vmovdqa64 %%zmm30, 192(%[w])\n\t"                     \
  "add $256, %[w]\n\t"
#define HF_NV_OUTS                                                                                               \
  [a0] "=&v"(a0[0]), [b0] "=&v"(a1[0]), [a1] "=&v"(a0[1]), [b1] "=&v"(a1[1]), [a2] "=&v"(a0[2]),             \
  [b2] "=&v"(a1[2]), [a3] "=&v"(a0[3]), [b3] "=&v"(a1[3]), [a4] "=&v"(a0[4]), [b4] "=&v"(a1[4]),             \
  [a5] "=&v"(a0[5]), [b5] "=&v"(a1[5]), [a6] "=&v"(a0[6]), [b6] "=&v"(a1[6]), [a7] "=&v"(a0[7]),             \
  [b7] "=&v"(a1[7]), [k] "+r"(k)
#define HF_NV_INS                                                                                             \
  [q] "r"(qe), [mp] "r"(me), [x0] "r"(xe), [x1] "r"(xe + 2 * ldx), [x2] "r"(xe + 4 * ldx),                  \
  [x3] "r"(xe + 6 * ldx), [x4] "r"(xe + 8 * ldx), [x5] "r"(xe + 10 * ldx), [x6] "r"(xe + 12 * ldx),          \
  [x7] "r"(xe + 14 * ldx)
#define HF_NV_CLOBBERS "rax", "xmm23", "xmm24", "xmm25", "xmm26", "xmm27", "xmm28", "xmm29", "xmm30", "xmm31", "cc", "memory"
// With STORE (more rows than these 8) the decoded weights also go to w (pairs x 64 int16, rows_i16's layout) for
// the other row blocks: the decode then runs among the dot products of this block instead of in a pass of its own
// before them.
template <bool STORE>
__attribute__((always_inline)) inline void rows8_nvfp4_codes(const uint8_t* qb, const NvFold& f, int nb, __m512i lut,
                                                             const int16_t* x, int64_t ldx, const float* xs,
                                                             int64_t nab, float* o, int16_t* w) {
  const int bpf = f.one ? nb : 1;  // 16-k blocks per flush
  for (int fi = 0; fi < (f.one ? 1 : nb); ++fi) {
    __m512i a0[8], a1[8];  // columns 0..15 / 16..31
    const uint8_t* qf = qb + fi * bpf * 8 * W4_NP;
    const int16_t* xf = x + 16 * fi * bpf;
    const int16_t* mp = f.mult[fi * bpf][0];
    int16_t* wf = w + fi * bpf * 8 * 2 * W4_NP;
    if constexpr (kAsmLoops) {
      // nv_fold_decode and the 8-row dot loop of panel_rows_i16's int4 blocks in inline asm. k = 4 x the k-pair
      // index, counted from -4 x the pairs up to 0 (the pointers qe, xe, me are at the end: no bound operand; an asm
      // statement takes at most 30, and the table is built inside for the same reason); a 16-k block every 32 k, its
      // multipliers (128 bytes) at me + 4 k; zmm23 = the doubled e2m1 table in each 16-byte lane, zmm24 = 15 in each
      // word.
      static_assert(kW4PrefetchBytes == 8192 && kW4PrefetchFarBytes == 32768, "the asm spells both distances");
      static_assert(e2m1x2_qword(0) == 0x0c08060403020100ull && e2m1x2_qword(1) == 0xf4f8fafcfdfeff00ull,
                    "the asm spells the table");
      const int64_t n = 32 * bpf;
      int64_t k = -n;
      const char* qe = reinterpret_cast<const char*>(qf) + 8 * n;
      const char* xe = reinterpret_cast<const char*>(xf) + n;
      const char* me = reinterpret_cast<const char*>(mp) + 4 * n;
      if constexpr (STORE)
        asm volatile(HF_NV_ROWS8(HF_NV_STORE) : HF_NV_OUTS, [w] "+r"(wf) : HF_NV_INS : HF_NV_CLOBBERS);
      else
        asm volatile(HF_NV_ROWS8("") : HF_NV_OUTS : HF_NV_INS : HF_NV_CLOBBERS);
    } else {
      for (int m = 0; m < 8; ++m) a0[m] = a1[m] = _mm512_setzero_si512();
      for (int b = 0; b < bpf; ++b) {
        const __m512i ml = _mm512_load_si512(mp + 64 * b), mh = _mm512_load_si512(mp + 64 * b + 32);
        for (int j = 0; j < 8; j += 2) {
          __m512i wv[4];
          nv_fold_decode(qf + (8 * b + j) * W4_NP, lut, ml, mh, wv);
          if (STORE)
            for (int i = 0; i < 4; ++i) _mm512_store_si512(wf + (2 * (8 * b + j) + i) * W4_NP, wv[i]);
          for (int u = 0; u < 2; ++u)
            for (int m = 0; m < 8; ++m) {
              int32_t xp;
              std::memcpy(&xp, xf + m * ldx + 16 * b + 2 * (j + u), 4);
              const __m512i xv = _mm512_set1_epi32(xp);
              a0[m] = _mm512_dpwssd_epi32(a0[m], wv[2 * u], xv);
              a1[m] = _mm512_dpwssd_epi32(a1[m], wv[2 * u + 1], xv);
            }
        }
      }
    }
    const __m512 c0 = _mm512_load_ps(f.cs[fi]), c1 = _mm512_load_ps(f.cs[fi] + 16);
    for (int m = 0; m < 8; ++m) {
      const __m512 xsv = _mm512_set1_ps(xs[m * nab]);
      float* r = o + m * W4_NP;
      _mm512_store_ps(r, _mm512_fmadd_ps(_mm512_cvtepi32_ps(a0[m]), _mm512_mul_ps(c0, xsv), _mm512_load_ps(r)));
      _mm512_store_ps(r + 16,
                      _mm512_fmadd_ps(_mm512_cvtepi32_ps(a1[m]), _mm512_mul_ps(c1, xsv), _mm512_load_ps(r + 16)));
    }
  }
}

// Rows in chunks of kNvRowChunk: all of them per activation block would read x with a stride of K per row and keep
// M x 32 fp32 sums (no-AMX benchmark, 4096x4096, time / int4 at M = 256 and 1024: all rows 1.28 / 1.44, chunks of
// 32 rows 1.15 / 1.17, of 64 rows 1.17 / 1.51).
constexpr int64_t kNvRowChunk = 32;

// Per panel and activation block: fold the scales, decode the block's codes once into int16 weights (8 KiB for
// L = 128, kept in L1) while the first 8 rows run over them, then run the other row blocks over the buffer - the
// decode is shared by the rows of a chunk (chunks of 1-7 rows, the last of M = 33-39 say, decode into it first).
void fused_i16_nvfp4_folded_vbmi(const W4Gemm& g, const int16_t* xq0, const float* xs0, int64_t M0, int64_t L,
                                 int64_t p0, int64_t p1) {
  const int64_t K = g.K, nab = K / L, pairs = L / 2;
  const int nb = static_cast<int>(L / 16);
  thread_local AlignedBuf<float> obuf;
  thread_local AlignedBuf<int16_t> wbuf;
  float* o = obuf.get(static_cast<size_t>(kNvRowChunk) * W4_NP);
  int16_t* w = wbuf.get(static_cast<size_t>(pairs) * 2 * W4_NP);
  NvFold f;
  static const NvFolder fold;
  const __m512i lut = ByteLutDecode().lut;  // the doubled e2m1 values in every 16-byte lane (vpshufb)
  for (int64_t p = p0; p < p1; ++p)
  for (int64_t c0 = 0; c0 < M0; c0 += kNvRowChunk) {
    const int64_t M = std::min(kNvRowChunk, M0 - c0);
    const int16_t* xq = xq0 + c0 * K;
    const float* xs = xs0 + c0 * nab;
    const uint8_t* q = g.qpack + p * (K / 2) * W4_NP;
    std::memset(o, 0, sizeof(float) * M * W4_NP);
    for (int64_t blk = 0; blk < nab; ++blk) {
      const uint8_t* sp = static_cast<const uint8_t*>(g.scales) + (p * g.G + blk * nb) * W4_NP;
      for (int i = 0; i < nb; i += 2) _mm_prefetch(reinterpret_cast<const char*>(sp + 1024 + 32 * i), _MM_HINT_T0);
      fold(sp, nb, f);
      const uint8_t* qb = q + blk * pairs * W4_NP;
      // the first 8 rows decode in registers (rows8_nvfp4_codes), with more rows also into the buffer for the rest
      // (Zen 5, 1 thread, against decoding into the buffer first: 10-14 % faster at M = 8, 7-11 % at M = 9-16, 5-10 %
      // at M = 24-32)
      if (M >= 8) {
        if (M == 8) rows8_nvfp4_codes<false>(qb, f, nb, lut, xq + blk * L, K, xs + blk, nab, o, w);
        else rows8_nvfp4_codes<true>(qb, f, nb, lut, xq + blk * L, K, xs + blk, nab, o, w);
      } else {  // a chunk of 1-7 rows: the block decoded into the buffer first
        for (int b = 0; b < nb; ++b) {
          const __m512i ml = _mm512_load_si512(f.mult[b][0]), mh = _mm512_load_si512(f.mult[b][1]);
          for (int j = 8 * b; j < 8 * b + 8; j += 2) {
            _mm_prefetch(reinterpret_cast<const char*>(qb + j * W4_NP + kW4PrefetchBytes), _MM_HINT_T0);
            _mm_prefetch(reinterpret_cast<const char*>(qb + j * W4_NP + kW4PrefetchFarBytes), _MM_HINT_T1);
            __m512i wv[4];
            nv_fold_decode(qb + j * W4_NP, lut, ml, mh, wv);
            for (int i = 0; i < 4; ++i) _mm512_store_si512(w + (2 * j + i) * W4_NP, wv[i]);
          }
        }
      }
      const int64_t pf = f.one ? pairs : 8;
      const int nf = f.one ? 1 : nb;
      for (int64_t r0 = M >= 8 ? 8 : 0, mr; r0 < M; r0 += mr) {
        const int64_t left = M - r0;
        mr = left >= 8 ? 8 : left >= 4 ? 4 : left;
        const int16_t* x0 = xq + r0 * K + blk * L;
        const float* s0 = xs + r0 * nab + blk;
        float* o0 = o + r0 * W4_NP;
        with_rows<8, 4, 3, 2, 1>(mr, [&](auto r) { rows_i16<decltype(r)::value>(w, pf, nf, x0, K, f.cs[0], s0, nab, o0); });
      }
    }
    for (int64_t m = 0; m < M; ++m) store_row_avx512(g, c0 + m, p * W4_NP, o + m * W4_NP, W4_NP);
  }
}
#undef HF_I16_ZERO2
#undef HF_I16_ZERO8
#undef HF_I16_ROW
#undef HF_I16_ROWS8
#undef HF_NV_ROWS8
#undef HF_NV_STORE
#undef HF_NV_OUTS
#undef HF_NV_INS
#undef HF_NV_CLOBBERS
#pragma GCC pop_options

// ---- dequantize to a dense transposed weight Wt [K][ldd] (k-rows, columns contiguous), scales folded
// 32 fp32 (lo: columns 0..15, hi: 16..31) -> 32 bf16 (common/convert.h rounding; needs no AVX512-BF16)
inline __m512i bf16x32(__m512 lo, __m512 hi) {
  return _mm512_inserti64x4(_mm512_castsi256_si512(f32x16_to_bf16(lo)), f32x16_to_bf16(hi), 1);
}

template <int MODE>
void dequant_impl(const W4Gemm& g, void* dst, int dst_dtype, int64_t ldd, int64_t p0, int64_t p1) {
  const int64_t K = g.K, G = g.G, kpg = g.gs / 2;
  const __m512 lut = f32_lut(MODE);
  const __m512i dupA = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
  const __m512i dupB = _mm512_add_epi32(dupA, _mm512_set1_epi32(8));
  const __m512i ev = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
  const __m512i od = _mm512_add_epi32(ev, _mm512_set1_epi32(1));
  const __m512 gsv = _mm512_set1_ps(g.gscale);
  const bool bf = dst_dtype == DT_BF16;
  // k-blocks outermost so that the rows being written stay few (TLB / cache friendly)
  constexpr int64_t JB = 32;
  for (int64_t jb = 0; jb < K / 2; jb += JB) {
  const int64_t je = jb + JB < K / 2 ? jb + JB : K / 2;
  for (int64_t p = p0; p < p1; ++p) {
    const uint8_t* q = g.qpack + p * (K / 2) * W4_NP;
    const int64_t col0 = (p - p0) * W4_NP;
    const int64_t ncol = g.N - p * W4_NP < W4_NP ? g.N - p * W4_NP : W4_NP;
    const __mmask16 mk0 = ncol >= 16 ? 0xffff : static_cast<__mmask16>((1u << ncol) - 1);
    const __mmask16 mk1 = ncol >= 32 ? 0xffff : ncol <= 16 ? 0 : static_cast<__mmask16>((1u << (ncol - 16)) - 1);
    const __mmask32 mkb = ncol >= 32 ? 0xffffffffu : static_cast<__mmask32>((1ull << ncol) - 1);
    int64_t cur_g = -1, gend = 0;  // group of k-pair j, tracked without a 64-bit division per k-pair
    __m512 sd[4], zd[4];
    for (int64_t j = jb; j < je; ++j) {
      if (j >= gend || cur_g < 0) {
        const int64_t gi = j / kpg;
        gend = (gi + 1) * kpg;
        cur_g = gi;
        const int64_t so = (p * G + gi) * W4_NP;
        __m512 s0, s1;
        load_scales<MODE>(g, so, s0, s1);
        s0 = _mm512_mul_ps(s0, gsv);
        s1 = _mm512_mul_ps(s1, gsv);
        sd[0] = _mm512_permutexvar_ps(dupA, s0); sd[1] = _mm512_permutexvar_ps(dupA, s1);
        sd[2] = _mm512_permutexvar_ps(dupB, s0); sd[3] = _mm512_permutexvar_ps(dupB, s1);
        if (MODE == W4_ASYM) {
          const __m512 z0 = _mm512_mul_ps(_mm512_loadu_ps(g.zs + so), gsv);
          const __m512 z1 = _mm512_mul_ps(_mm512_loadu_ps(g.zs + so + 16), gsv);
          zd[0] = _mm512_permutexvar_ps(dupA, z0); zd[1] = _mm512_permutexvar_ps(dupA, z1);
          zd[2] = _mm512_permutexvar_ps(dupB, z0); zd[3] = _mm512_permutexvar_ps(dupB, z1);
        }
      }
      {
        const __m512i b0 = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + j * W4_NP)));
        const __m512i b1 = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + j * W4_NP + 16)));
        __m512 v[4] = {_mm512_permutexvar_ps(b0, lut),
                       _mm512_permutexvar_ps(_mm512_srli_epi32(b0, 4), lut),
                       _mm512_permutexvar_ps(b1, lut),
                       _mm512_permutexvar_ps(_mm512_srli_epi32(b1, 4), lut)};
        for (int i = 0; i < 4; ++i) {
          v[i] = MODE == W4_ASYM ? _mm512_fmsub_ps(v[i], sd[i], zd[i]) : _mm512_mul_ps(v[i], sd[i]);
        }
        // k = 2j: even lanes; k = 2j+1: odd lanes. columns 0..15 from v0|v2, 16..31 from v1|v3
        const __m512 e0 = _mm512_permutex2var_ps(v[0], ev, v[2]), o0 = _mm512_permutex2var_ps(v[0], od, v[2]);
        const __m512 e1 = _mm512_permutex2var_ps(v[1], ev, v[3]), o1 = _mm512_permutex2var_ps(v[1], od, v[3]);
        if (bf) {
          uint16_t* d = static_cast<uint16_t*>(dst) + 2 * j * ldd + col0;
          _mm512_mask_storeu_epi16(d, mkb, bf16x32(e0, e1));
          _mm512_mask_storeu_epi16(d + ldd, mkb, bf16x32(o0, o1));
        } else {
          float* d = static_cast<float*>(dst) + 2 * j * ldd + col0;
          _mm512_mask_storeu_ps(d, mk0, e0);
          _mm512_mask_storeu_ps(d + 16, mk1, e1);
          _mm512_mask_storeu_ps(d + ldd, mk0, o0);
          _mm512_mask_storeu_ps(d + ldd + 16, mk1, o1);
        }
      }
    }
  }
  }
}

}  // namespace

void w4a16_fused_avx512(const W4Gemm& g, const float* x, int64_t M, const float* xsum, int64_t p0, int64_t p1) {
  with_mode(g.mode, [&](auto m) { fused_impl<decltype(m)::value>(g, x, M, xsum, p0, p1); });
}

// HF_W4_VBMI=0 in the environment (read once): the vpermw kernel, as on AVX-512 CPUs without VBMI (Cooper Lake)
bool w4a16_vbmi_enabled() {
  static const bool vbmi = !env_switched_off("HF_W4_VBMI") && cpu_caps().avx512_vbmi;
  return vbmi;
}

void w4a16_fused_i16_avx512(const W4Gemm& g, const int16_t* xq, const float* xs, const int32_t* xd, int64_t M,
                            int64_t ag, int64_t p0, int64_t p1) {
  const bool vbmi = w4a16_vbmi_enabled();
  if (g.mode == W4_NVFP4 && ag > 16 && M >= kNvFoldMinM) {  // block scales folded in (w4a16.h, kNvFoldMinM)
    fused_i16_nvfp4_folded_vbmi(g, xq, xs, M, ag, p0, p1);
    return;
  }
  if (g.mode == W4_NVFP4 && vbmi) fused_i16_nvfp4_vbmi(g, xq, xs, xd, M, ag, p0, p1);
  else with_mode(g.mode, [&](auto m) { fused_i16_impl<decltype(m)::value>(g, xq, xs, xd, M, ag, p0, p1, WordDecode<decltype(m)::value>()); });
}

bool w4a16_quant_x16_avx512(const void* x, int dtype, int64_t M, int64_t K, int64_t ag, int64_t l1max, int16_t* xq,
                            float* xs, int32_t* xd) {
  const int64_t nab = K / ag;
  auto load = [&](int64_t i, __mmask16 mk) -> __m512 {
    if (dtype == DT_BF16) {
      const __m256i h = _mm256_maskz_loadu_epi16(mk, static_cast<const uint16_t*>(x) + i);
      return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    if (dtype == DT_F16) return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mk, static_cast<const uint16_t*>(x) + i));
    return _mm512_maskz_loadu_ps(mk, static_cast<const float*>(x) + i);
  };
  auto mask = [](int64_t left) -> __mmask16 { return left >= 16 ? 0xffff : static_cast<__mmask16>((1u << left) - 1); };
  for (int64_t m = 0; m < M; ++m)
    for (int64_t b = 0; b < nab; ++b) {
      const int64_t i0 = m * K + b * ag;
      __m512i mx = _mm512_setzero_si512();
      __m512 sm = _mm512_setzero_ps();
      for (int64_t i = 0; i < ag; i += 16) {
        const __m512 v = _mm512_abs_ps(load(i0 + i, mask(ag - i)));
        mx = _mm512_max_epu32(mx, _mm512_castps_si512(v));  // as integers: a nan is never lost (vmaxps drops it)
        if (l1max > 0) sm = _mm512_add_ps(sm, v);
      }
      const int s = quant_x16_exponent(_mm512_reduce_max_epu32(mx), _mm512_reduce_add_ps(sm), ag, l1max);
      if (s == INT32_MIN) return false;
      const __m512 inv = _mm512_set1_ps(std::ldexp(1.0f, -s));
      xs[m * nab + b] = std::ldexp(1.0f, s);
      __m512i sum = _mm512_setzero_si512();
      for (int64_t i = 0; i < ag; i += 16) {
        const __mmask16 mk = mask(ag - i);
        // round to nearest even; saturated before the sum, as stored (fp32 x can round up to 32768)
        const __m512i d = _mm512_min_epi32(_mm512_max_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(load(i0 + i, mk), inv)),
                                                            _mm512_set1_epi32(-32768)),
                                           _mm512_set1_epi32(32767));
        sum = _mm512_add_epi32(sum, d);
        _mm256_mask_storeu_epi16(xq + i0 + i, mk, _mm512_cvtepi32_epi16(d));
      }
      xd[m * nab + b] = _mm512_reduce_add_epi32(sum);
    }
  return true;
}

void w4a16_dequant_avx512(const W4Gemm& g, void* dst, int dst_dtype, int64_t ldd, int64_t p0, int64_t p1) {
  with_mode(g.mode, [&](auto m) { dequant_impl<decltype(m)::value>(g, dst, dst_dtype, ldd, p0, p1); });
}

}  // namespace hf_w4

#else  // not x86: stubs, never called (cpu_caps() reports no AVX-512)
#include <stdexcept>

#include "w4a16.h"

namespace hf_w4 {
[[noreturn]] static void no_avx512() {
  throw std::runtime_error("hf_w4: the AVX-512 W4A16 kernels are not built for this CPU architecture");
}
void w4a16_fused_avx512(const W4Gemm&, const float*, int64_t, const float*, int64_t, int64_t) { no_avx512(); }
bool w4a16_vbmi_enabled() { return false; }
void w4a16_fused_i16_avx512(const W4Gemm&, const int16_t*, const float*, const int32_t*, int64_t, int64_t, int64_t,
                            int64_t) { no_avx512(); }
bool w4a16_quant_x16_avx512(const void*, int, int64_t, int64_t, int64_t, int64_t, int16_t*, float*, int32_t*) {
  no_avx512();
}
void w4a16_dequant_avx512(const W4Gemm&, void*, int, int64_t, int64_t, int64_t) { no_avx512(); }
}  // namespace hf_w4
#endif
