// hf_w4 W4A16: AVX2 kernels (the avx2 level of common/cpu_features.h). Raw pointers only, no torch headers; only
// called when that level was chosen at run time. Design: docs/cpu-kernels.md.
#include "common/cpu_features.h"
#if HF_W4_X86
#pragma GCC target("avx2,fma,f16c,bmi2")
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "w4a16.h"
#include "w4a16_common.h"

namespace hf_w4 {
namespace {

// 8 fp8-e4m3 block scales of the kernel layout (sign bit clear, see w4a16.h) -> fp32 through the fp16 bit pattern
// b << 7 (exact, denormals included, whatever MXCSR.DAZ says)
inline __m256 fp8x8_to_ps(const uint8_t* p) {
  int64_t v;
  std::memcpy(&v, p, 8);
  const __m128i h = _mm_slli_epi16(_mm_cvtepu8_epi16(_mm_cvtsi64_si128(v)), 7);
  return _mm256_mul_ps(_mm256_cvtph_ps(h), _mm256_set1_ps(256.0f));
}

inline __m256i load8_u8_epi32(const uint8_t* p) {
  int64_t v;
  std::memcpy(&v, p, 8);
  return _mm256_cvtepu8_epi32(_mm_cvtsi64_si128(v));
}

// codes (0..15 in 32-bit lanes) -> fp32 values. int4: the code itself (the -8 / zero point is applied
// through the per-group activation sums); nvfp4: e2m1 via two 8-entry permutes.
template <int MODE>
inline __m256 decode(__m256i idx, __m256 lut0, __m256 lut1) {
  if (MODE == W4_NVFP4) {
    const __m256 a = _mm256_permutevar8x32_ps(lut0, idx);
    const __m256 b = _mm256_permutevar8x32_ps(lut1, idx);
    return _mm256_blendv_ps(a, b, _mm256_castsi256_ps(_mm256_slli_epi32(idx, 28)));
  }
  return _mm256_cvtepi32_ps(idx);
}

// MR fp32 rows, one 8-byte column chunk c (16 columns: 4c..4c+3 and 16+4c..16+4c+3, both k parities),
// one K-group: returns partial sums in lanes (column, parity)
template <int MR, int MODE>
inline void chunk_group(const uint8_t* qq, int64_t kpg, const float* x, int64_t ldx, __m256 lut0, __m256 lut1,
                        __m256 pl[MR], __m256 ph[MR]) {
  const __m256i m15 = _mm256_set1_epi32(15);
  for (int m = 0; m < MR; ++m) pl[m] = ph[m] = _mm256_setzero_ps();
  for (int64_t j = 0; j < kpg; ++j) {
    const __m256i b = load8_u8_epi32(qq + j * W4_NP);
    const __m256 wl = decode<MODE>(_mm256_and_si256(b, m15), lut0, lut1);
    const __m256 wh = decode<MODE>(_mm256_srli_epi32(b, 4), lut0, lut1);
    for (int m = 0; m < MR; ++m) {
      double d;
      std::memcpy(&d, x + m * ldx + 2 * j, 8);
      const __m256 xv = _mm256_castpd_ps(_mm256_set1_pd(d));
      pl[m] = _mm256_fmadd_ps(wl, xv, pl[m]);
      ph[m] = _mm256_fmadd_ps(wh, xv, ph[m]);
    }
  }
}

template <int MR, int MODE>
void panel_rows(const W4Gemm& g, const uint8_t* q, const float* x, int64_t ldx, const float* xsum, int64_t p,
                float* res /*[MR][32]*/) {
  const int64_t G = g.G, kpg = g.gs / 2;
  alignas(32) float lt[16];
  for (int c = 0; c < 16; ++c) lt[c] = kE2M1[c];
  const __m256 lut0 = _mm256_load_ps(lt), lut1 = _mm256_load_ps(lt + 8);
  const __m256i dup = _mm256_set_epi32(3, 3, 2, 2, 1, 1, 0, 0);
  alignas(32) float acc[MR][64];    // lanes: [chunk c][half h][8]: column h*16 + 4c + l/2, parity l%2
  alignas(32) float corr[MR][32];   // per column: zero-point correction
  std::memset(acc, 0, sizeof(acc));
  std::memset(corr, 0, sizeof(corr));
  for (int64_t gi = 0; gi < G; ++gi) {
    const int64_t so = (p * G + gi) * W4_NP;
    alignas(32) float s[32];
    if (MODE == W4_NVFP4) {
      const uint8_t* sp = static_cast<const uint8_t*>(g.scales) + so;
      for (int i = 0; i < 4; ++i) _mm256_store_ps(s + 8 * i, fp8x8_to_ps(sp + 8 * i));
    } else {
      std::memcpy(s, static_cast<const float*>(g.scales) + so, sizeof(s));
    }
    const uint8_t* qq = q + gi * kpg * W4_NP;
    for (int c = 0; c < 4; ++c) {
      __m256 pl[MR], ph[MR];
      chunk_group<MR, MODE>(qq + 8 * c, kpg, x + gi * g.gs, ldx, lut0, lut1, pl, ph);
      const __m256 sl = _mm256_permutevar8x32_ps(_mm256_castps128_ps256(_mm_load_ps(s + 4 * c)), dup);
      const __m256 sh = _mm256_permutevar8x32_ps(_mm256_castps128_ps256(_mm_load_ps(s + 16 + 4 * c)), dup);
      for (int m = 0; m < MR; ++m) {
        float* a = acc[m] + 16 * c;
        _mm256_store_ps(a, _mm256_fmadd_ps(pl[m], sl, _mm256_load_ps(a)));
        _mm256_store_ps(a + 8, _mm256_fmadd_ps(ph[m], sh, _mm256_load_ps(a + 8)));
      }
    }
    if (MODE != W4_NVFP4) {
      for (int m = 0; m < MR; ++m) {
        const __m256 xs = _mm256_set1_ps(xsum[m * G + gi]);
        for (int i = 0; i < 4; ++i) {
          const __m256 z = MODE == W4_ASYM ? _mm256_loadu_ps(g.zs + so + 8 * i)
                                           : _mm256_mul_ps(_mm256_load_ps(s + 8 * i), _mm256_set1_ps(8.0f));
          _mm256_store_ps(corr[m] + 8 * i, _mm256_fmadd_ps(z, xs, _mm256_load_ps(corr[m] + 8 * i)));
        }
      }
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int c = 0; c < 4; ++c)
      for (int h = 0; h < 2; ++h)
        for (int l = 0; l < 4; ++l) {
          const int col = h * 16 + 4 * c + l;
          const float* a = acc[m] + 16 * c + 8 * h + 2 * l;
          res[m * W4_NP + col] = a[0] + a[1] - corr[m][col];
        }
}

constexpr int kMR = 4;

template <int MODE>
void fused_impl(const W4Gemm& g, const float* x, int64_t M, const float* xsum, int64_t p0, int64_t p1) {
  const int64_t K = g.K, G = g.G;
  std::vector<float> res(M * W4_NP);
  for (int64_t p = p0; p < p1; ++p) {
    const uint8_t* q = g.qpack + p * (K / 2) * W4_NP;
    for (int64_t r0 = 0; r0 < M; r0 += kMR) {
      const int64_t mr = M - r0 < kMR ? M - r0 : kMR;
      const float* x0 = x + r0 * K;
      const float* xs0 = xsum ? xsum + r0 * G : nullptr;
      float* rr = res.data() + r0 * W4_NP;
      with_rows<1, 2, 3, 4>(mr, [&](auto r) { panel_rows<decltype(r)::value, MODE>(g, q, x0, K, xs0, p, rr); });
    }
    for (int64_t m = 0; m < M; ++m) w4a16_store_row(g, m, p * W4_NP, res.data() + m * W4_NP, W4_NP);
  }
}

// ---- 16-bit integer activations (the AVX2 counterpart of w4a16_fused_i16_avx512; see there). One row here (two
// and more: panel_i16_rows). A k-pair row's 16-byte half c zero-extended to 16-bit lanes gives (column 8c + l,
// parity) pairs in each 32-bit lane l: low nibbles columns 8c..8c+7, high nibbles 16+8c..; vpmaddwd + vpaddd
// accumulate the pairs. int4 only (NVFP4: panel_row_i16_nvfp4).
template <int MODE>
void panel_row_i16(const W4Gemm& g, const uint8_t* q, const int16_t* xq, const float* xs, const int32_t* xd,
                   int64_t ag, int64_t p, float* res) {
  const int64_t nab = g.K / ag, bpg = g.gs / ag, pairs = ag / 2;
  static_assert(MODE != W4_NVFP4, "NVFP4: panel_row_i16_nvfp4");
  const __m256i nib16 = _mm256_set1_epi16(15);
  __m256 o[4];  // [half c][low / high nibble]: columns 8c.., 16+8c..
  o[0] = o[1] = o[2] = o[3] = _mm256_setzero_ps();
  const float* sc = nullptr;
  const float* zc = nullptr;
  for (int64_t b = 0, gi = 0, left = 0; b < nab; ++b) {
    if (left == 0) {
      const int64_t so = (p * g.G + gi++) * W4_NP;
      left = bpg;
      sc = static_cast<const float*>(g.scales) + so;
      if (MODE == W4_ASYM) zc = g.zs + so;
    }
    --left;
    __m256i a[4];
    a[0] = a[1] = a[2] = a[3] = _mm256_setzero_si256();
    const uint8_t* qq = q + b * pairs * W4_NP;
    const int16_t* xb = xq + b * ag;
    for (int64_t j = 0; j < pairs; ++j) {
      if ((j & 1) == 0) _mm_prefetch(reinterpret_cast<const char*>(qq + j * W4_NP + kW4PrefetchBytes), _MM_HINT_T0);
      __m256i w[4];
      for (int c = 0; c < 2; ++c) {
        const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qq + j * W4_NP + 16 * c));
        const __m256i v = _mm256_cvtepu8_epi16(bytes);
        w[2 * c] = _mm256_and_si256(v, nib16);
        w[2 * c + 1] = _mm256_srli_epi16(v, 4);
      }
      int32_t xp;
      std::memcpy(&xp, xb + 2 * j, 4);
      const __m256i xv = _mm256_set1_epi32(xp);
      for (int i = 0; i < 4; ++i) a[i] = _mm256_add_epi32(a[i], _mm256_madd_epi16(w[i], xv));
    }
    const __m256 xsv = _mm256_set1_ps(xs[b]);
    const __m256 xsum = _mm256_set1_ps(xs[b] * static_cast<float>(xd[b]));
    for (int t = 0; t < 4; ++t) {  // t = 2c + h: columns 16h + 8c ..
      const int col = 16 * (t & 1) + 8 * (t >> 1);
      __m256i v = a[t];
      if (MODE == W4_SYM) v = _mm256_sub_epi32(v, _mm256_set1_epi32(8 * xd[b]));
      o[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(v), _mm256_mul_ps(_mm256_loadu_ps(sc + col), xsv), o[t]);
      if (MODE == W4_ASYM) o[t] = _mm256_fnmadd_ps(_mm256_loadu_ps(zc + col), xsum, o[t]);
    }
  }
  for (int t = 0; t < 4; ++t) _mm256_storeu_ps(res + 16 * (t & 1) + 8 * (t >> 1), o[t]);
}

// NVFP4 on the int16 path: one 32-byte load per k-pair (both halves), the nibbles of each byte through one
// vpshufb each (2 x e2m1 as int8, both 128-bit lanes at once), then vpunpck{l,h}bw with zero puts each value in
// the high byte of a 16-bit lane: the weight times 256, sign included, with no widening instruction. 9 uops per
// k-pair instead of 14 (vpmovsxbw needs a vextracti128 per upper half). |weight| <= 12 * 256 and |xq| <= 2^15
// keep a 16-k block's int32 sum below 2^31. Activation blocks of ag = 128 (64, 32, 16: the largest dividing K,
// the precision of int4 g128's blocks): each 16-k block adds (int32 dot) x block scale into f, and the activation
// scale multiplies once per activation block (about a third faster than a per-16-k scheme with vpmovsxbw on Zen 3).
// The unpacks take 4 columns from each
// 128-bit lane, so accumulator t holds columns {8h' + 4(t & 1) + 16(t >> 1) + i, i < 4} of both halves h' = 0, 1,
// i.e. a permutation of the columns; the block scales are permuted alike (one vpermd of the 32 scale bytes) and
// the results are put back in column order when stored. The fp8 scales decode through the fp16 bit pattern b << 7
// (the value / 256); weight * 256 * scale / 256 = 2 w s, halved once at the end.
inline const __m256i& nvfp4_lut_i16() {  // 2 x e2m1 as int8, in both 128-bit lanes
  static const __m256i lut = [] {
    alignas(16) int8_t lt[16];
    for (int c = 0; c < 16; ++c) lt[c] = static_cast<int8_t>(2.0f * kE2M1[c]);
    return _mm256_broadcastsi128_si256(_mm_load_si128(reinterpret_cast<const __m128i*>(lt)));
  }();
  return lut;
}

// the 32 fp8 block scales of one 16-k block in accumulator order (4 x 8, see above), value / 256 (vcvtph2ps of the
// fp16 bit pattern; building fp32 bits directly was no faster)
inline void nvfp4_block_scales(const uint8_t* sp, __m256 (&sc)[4]) {
  const __m256i sb = _mm256_permutevar8x32_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sp)),
                                                 _mm256_setr_epi32(0, 2, 1, 3, 4, 6, 5, 7));
  const __m256i lo = _mm256_slli_epi16(_mm256_cvtepu8_epi16(_mm256_castsi256_si128(sb)), 7);
  const __m256i hi = _mm256_slli_epi16(_mm256_cvtepu8_epi16(_mm256_extracti128_si256(sb, 1)), 7);
  sc[0] = _mm256_cvtph_ps(_mm256_castsi256_si128(lo));
  sc[1] = _mm256_cvtph_ps(_mm256_extracti128_si256(lo, 1));
  sc[2] = _mm256_cvtph_ps(_mm256_castsi256_si128(hi));
  sc[3] = _mm256_cvtph_ps(_mm256_extracti128_si256(hi, 1));
}

// one k-pair row of 32 packed NVFP4 bytes -> 4 vectors of 16 int16 weights x 512 (see above)
inline void nvfp4_pair_i16(const uint8_t* qq, const __m256i& lut, __m256i (&w)[4]) {
  const __m256i nib = _mm256_set1_epi8(15), zero = _mm256_setzero_si256();
  const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qq));
  const __m256i vl = _mm256_shuffle_epi8(lut, _mm256_and_si256(bytes, nib));
  const __m256i vh = _mm256_shuffle_epi8(lut, _mm256_and_si256(_mm256_srli_epi16(bytes, 4), nib));
  w[0] = _mm256_unpacklo_epi8(zero, vl);
  w[1] = _mm256_unpackhi_epi8(zero, vl);
  w[2] = _mm256_unpacklo_epi8(zero, vh);
  w[3] = _mm256_unpackhi_epi8(zero, vh);
}

// results in accumulator order f[t] (times 2) -> 32 columns in order
inline void nvfp4_store_cols(const float* f, float* res) {
  for (int t = 0; t < 4; ++t) {  // lanes 0..3: columns c0..c0+3, lanes 4..7: c0+8..c0+11
    const int c0 = 4 * (t & 1) + 16 * (t >> 1);
    const __m256 v = _mm256_mul_ps(_mm256_loadu_ps(f + 8 * t), _mm256_set1_ps(0.5f));
    _mm_storeu_ps(res + c0, _mm256_castps256_ps128(v));
    _mm_storeu_ps(res + c0 + 8, _mm256_extractf128_ps(v, 1));
  }
}

// ---- two rows and more on the int16 path: the weights of up to 64 k-pairs of a panel are decoded once into an
// L1 buffer of int16 vectors (in the order the one-row kernels hold them in registers) and every pair of rows
// reads them from there. The one-row kernels above keep their registers for the decode; with two rows, their 8
// accumulators, 4 weight vectors and the float sums did not fit in 16 registers: GCC kept two accumulators on the
// stack, a store-to-load chain through memory in every k-pair (K=N=4096, 1 thread, hot: M=2 took 2.4x the time
// of M=1). Here a tile of two rows holds 8 accumulators, 4 weights and one broadcast; the integer sums go to
// memory once per chunk (int4) or 16-k block (NVFP4), the float sums once per activation block (Zen 3: M=16 ~1.6x
// faster than one row at a time). The tiles are bound by the vector integer ports: vpmaddwd + vpaddd per 16
// multiply-adds.
constexpr int64_t kI16Rows = 24;        // rows per pass over a panel: the decode is repeated once per pass
constexpr int64_t kI16ChunkPairs = 64;  // k-pairs decoded at a time: 8 KiB of int16 weights

// From 4 rows of a pass the fold pays for itself (~0.3 decodes per chunk; 5-20 % faster on Zen 3 from M = 8).
constexpr int64_t kNvFoldMinRows = 4;

// ---- NVFP4 with the block scales folded into the buffered int16 weights (as the AVX-512 VBMI kernel,
// w4a16_avx512.cpp): an e4m3 scale is mt * 2^(ee - 10) (mantissa mt 8..15, or 0..7 for the denormals with ee = 1), so
// where a column's nonzero blocks in the chunk have ee within kNvFoldD of the largest, every weight is exactly the
// decoded 2w times mt << (ee - eref) (|.| <= 12 * 15 << 4 = 2880) times one column scale 2^(eref - 10) / 2, with
// eref = max ee - kNvFoldD. The int32 sums then run over the whole chunk (the activation quantizer bounds each 128-k
// block's sum of |xq| by kNvFoldL1) and convert once per chunk instead of once per 16 k. The multiply is one vpmulhrsw
// per 16 weights (2w x 256 from the decode, times the multiplier x 128, >> 15 with rounding: exact). A chunk with a
// wider spread keeps the per-16-k conversion.
struct NvFoldAvx2 {
  __m256i mu[kI16ChunkPairs / 8][4];  // [16-k block][accumulator]: multiplier x 128 in both words of each lane
  __m256 cs[4];                       // per accumulator lane (column): 2^(eref - 10), matching the unfolded scales
};

// the nb <= 8 blocks of 32 scale bytes at sp; false: keep the per-16-k conversion. Positive e4m3 bytes order as their
// values (the repack made every scale positive, w4a16_nvfp4_positive_scales), so the largest and the smallest nonzero
// byte per column give the exponent spread: 4 ops per block. (Loading refuses non-finite scales; the op reads e4m3 0x7f
// as 480, folded or not, as the AVX-512 kernel does.) Then per block: the exponent, 2^(ee - eref) by vpshufb, the
// mantissa, and one vpmaddubsw per 16 columns multiplies them into 16-bit words, which unpack (doubled, x 128) into the
// accumulator order; the scale rows are first put in the order columns 0-7, 16-23 | 8-15, 24-31 (one vpermq), in which
// unpack{lo,hi} give that order. ~25 ops per block instead of ~58 with per-lane variable shifts (vpsllvd).
inline __m256i nvfp4_scale_rows(const uint8_t* sp) {  // columns 0-7, 16-23 | 8-15, 24-31
  return _mm256_permute4x64_epi64(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sp)), _MM_SHUFFLE(3, 1, 2, 0));
}

inline __m256i e4m3_exponent(__m256i v) {  // max(exponent field, 1) per byte (the denormals' exponent is 1)
  return _mm256_max_epu8(_mm256_and_si256(_mm256_srli_epi16(v, 3), _mm256_set1_epi8(15)), _mm256_set1_epi8(1));
}

inline bool nvfp4_fold(const uint8_t* sp, int64_t nb, NvFoldAvx2& f) {
  const __m256i zero = _mm256_setzero_si256(), one = _mm256_set1_epi8(1);
  __m256i v[kI16ChunkPairs / 8], hi = zero, lo = _mm256_set1_epi8(-1);
  for (int64_t s = 0; s < nb; ++s) {
    v[s] = nvfp4_scale_rows(sp + 32 * s);
    hi = _mm256_max_epu8(hi, v[s]);
    lo = _mm256_min_epu8(lo, _mm256_sub_epi8(v[s], one));  // smallest nonzero - 1 (a zero wraps to 255)
  }
  const __m256i ehi = e4m3_exponent(hi), elo = e4m3_exponent(_mm256_add_epi8(lo, one));
  const __m256i wide = _mm256_cmpgt_epi8(_mm256_sub_epi8(ehi, elo), _mm256_set1_epi8(kNvFoldD));
  if (!_mm256_testz_si256(wide, wide)) return false;
  const __m256i eref = _mm256_sub_epi8(ehi, _mm256_set1_epi8(kNvFoldD));
  const __m256i pow2 = _mm256_setr_epi8(1, 2, 4, 8, 16, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
                                        1, 2, 4, 8, 16, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0);
  const __m256i c7 = _mm256_set1_epi8(7), c8 = _mm256_set1_epi8(8);
  for (int64_t s = 0; s < nb; ++s) {
    // mantissa 8..15 (0..7 for the denormals) and 2^(ee - eref), 0..4 for nonzero blocks (zero blocks: mantissa 0)
    const __m256i mt = _mm256_or_si256(_mm256_and_si256(v[s], c7), _mm256_and_si256(_mm256_cmpgt_epi8(v[s], c7), c8));
    const __m256i p2 = _mm256_shuffle_epi8(pow2, _mm256_sub_epi8(e4m3_exponent(v[s]), eref));
    for (int h = 0; h < 2; ++h) {  // columns 0-7 | 8-15, then 16-23 | 24-31, as 16-bit multiplier x 128
      const __m256i m = _mm256_slli_epi16(
          h ? _mm256_maddubs_epi16(_mm256_unpackhi_epi8(p2, zero), _mm256_unpackhi_epi8(mt, zero))
            : _mm256_maddubs_epi16(_mm256_unpacklo_epi8(p2, zero), _mm256_unpacklo_epi8(mt, zero)), 7);
      f.mu[s][2 * h] = _mm256_unpacklo_epi16(m, m);
      f.mu[s][2 * h + 1] = _mm256_unpackhi_epi16(m, m);
    }
  }
  const __m256i eb = _mm256_add_epi8(eref, _mm256_set1_epi8(117));  // eref - 10 + 127: 114..128
  for (int h = 0; h < 2; ++h) {
    const __m256i w = h ? _mm256_unpackhi_epi8(eb, zero) : _mm256_unpacklo_epi8(eb, zero);
    f.cs[2 * h] = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_unpacklo_epi16(w, zero), 23));
    f.cs[2 * h + 1] = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_unpackhi_epi16(w, zero), 23));
  }
  return true;
}

template <int MODE>
inline void decode_pairs_i16(const uint8_t* qq, int64_t np, int16_t* wb) {
  const __m256i nib16 = _mm256_set1_epi16(15);
  const __m256i lut = MODE == W4_NVFP4 ? nvfp4_lut_i16() : nib16;
  for (int64_t j = 0; j < np; ++j) {
    if ((j & 1) == 0) _mm_prefetch(reinterpret_cast<const char*>(qq + j * W4_NP + kW4PrefetchBytes), _MM_HINT_T0);
    __m256i w[4];
    if constexpr (MODE == W4_NVFP4) {
      nvfp4_pair_i16(qq + j * W4_NP, lut, w);
    } else {  // as panel_row_i16
      for (int c = 0; c < 2; ++c) {
        const __m256i v = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qq + j * W4_NP + 16 * c)));
        w[2 * c] = _mm256_and_si256(v, nib16);
        w[2 * c + 1] = _mm256_srli_epi16(v, 4);
      }
    }
    for (int i = 0; i < 4; ++i) _mm256_store_si256(reinterpret_cast<__m256i*>(wb + 64 * j) + i, w[i]);
  }
}

// MR rows x np k-pairs of decoded weights: the int32 sums a[m][i] (zeroed here)
template <int MR>
inline void tile_i16(const int16_t* wb, int64_t np, const int16_t* x, int64_t ldx, __m256i (&a)[MR][4]) {
  for (int m = 0; m < MR; ++m) a[m][0] = a[m][1] = a[m][2] = a[m][3] = _mm256_setzero_si256();
  for (int64_t j = 0; j < np; ++j) {
    const __m256i* wp = reinterpret_cast<const __m256i*>(wb + 64 * j);
    const __m256i w[4] = {_mm256_load_si256(wp), _mm256_load_si256(wp + 1), _mm256_load_si256(wp + 2),
                          _mm256_load_si256(wp + 3)};
    for (int m = 0; m < MR; ++m) {
      int32_t xp;
      std::memcpy(&xp, x + m * ldx + 2 * j, 4);
      const __m256i xv = _mm256_set1_epi32(xp);
      for (int i = 0; i < 4; ++i) a[m][i] = _mm256_add_epi32(a[m][i], _mm256_madd_epi16(w[i], xv));
    }
  }
}

// Two rows in inline assembly: GCC 12 compiled the loop above with a register move after each of the 8 vpaddd
// (it put each sum in a new register, then copied it back), 30 instructions per k-pair where 22 do the work.
template <>
inline void tile_i16<2>(const int16_t* wb, int64_t np, const int16_t* x, int64_t ldx, __m256i (&a)[2][4]) {
  __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
  __m256i w0, w1, w2, w3, x0, x1, t;
  const int16_t* xa = x;
  const int16_t* end = wb + 64 * np;
  const int64_t ldb = 2 * ldx;  // bytes
  if (np > 0)
    __asm__(
        "1:\n\t"
        "vmovdqa (%[wp]), %[w0]\n\t"
        "vmovdqa 32(%[wp]), %[w1]\n\t"
        "vmovdqa 64(%[wp]), %[w2]\n\t"
        "vmovdqa 96(%[wp]), %[w3]\n\t"
        "vpbroadcastd (%[xa]), %[x0]\n\t"
        "vpbroadcastd (%[xa], %[ldb]), %[x1]\n\t"
        "vpmaddwd %[w0], %[x0], %[t]\n\tvpaddd %[t], %[a0], %[a0]\n\t"
        "vpmaddwd %[w1], %[x0], %[t]\n\tvpaddd %[t], %[a1], %[a1]\n\t"
        "vpmaddwd %[w2], %[x0], %[t]\n\tvpaddd %[t], %[a2], %[a2]\n\t"
        "vpmaddwd %[w3], %[x0], %[t]\n\tvpaddd %[t], %[a3], %[a3]\n\t"
        "vpmaddwd %[w0], %[x1], %[t]\n\tvpaddd %[t], %[a4], %[a4]\n\t"
        "vpmaddwd %[w1], %[x1], %[t]\n\tvpaddd %[t], %[a5], %[a5]\n\t"
        "vpmaddwd %[w2], %[x1], %[t]\n\tvpaddd %[t], %[a6], %[a6]\n\t"
        "vpmaddwd %[w3], %[x1], %[t]\n\tvpaddd %[t], %[a7], %[a7]\n\t"
        "add $128, %[wp]\n\t"
        "add $4, %[xa]\n\t"
        "cmp %[end], %[wp]\n\t"
        "jne 1b"
        : [a0] "+x"(a0), [a1] "+x"(a1), [a2] "+x"(a2), [a3] "+x"(a3), [a4] "+x"(a4), [a5] "+x"(a5),
          [a6] "+x"(a6), [a7] "+x"(a7), [w0] "=&x"(w0), [w1] "=&x"(w1), [w2] "=&x"(w2), [w3] "=&x"(w3),
          [x0] "=&x"(x0), [x1] "=&x"(x1), [t] "=&x"(t), [wp] "+r"(wb), [xa] "+r"(xa)
        : [end] "r"(end), [ldb] "r"(ldb)
        : "memory", "cc");
  a[0][0] = a0, a[0][1] = a1, a[0][2] = a2, a[0][3] = a3, a[1][0] = a4, a[1][1] = a5, a[1][2] = a6, a[1][3] = a7;
}

// The first two rows of a pass: the k-pairs decoded in registers (as panel_row_i16 / panel_row_i16_nvfp4) and,
// when more rows follow (st != 0), also written to wb for them. Two rows, or the first tile of more: 22 (int4) / 25
// (NVFP4) vector ops per k-pair instead of the separate decode's 6 / 9 plus 4 stores, then 16. In assembly with
// fixed registers (sums ymm0-7, weights 8-11, activations 12-13, product 14, nibble mask / LUT 15): as operands
// the 8 sums alone count 16 of the 30 that GCC allows (Zen 3: M=2 ~1.5x faster than the separate decode).
#define HF_W4_ZERO8                                                                             \
  "vpxor %%xmm0, %%xmm0, %%xmm0\n\tvpxor %%xmm1, %%xmm1, %%xmm1\n\tvpxor %%xmm2, %%xmm2, %%xmm2\n\t"     \
  "vpxor %%xmm3, %%xmm3, %%xmm3\n\tvpxor %%xmm4, %%xmm4, %%xmm4\n\tvpxor %%xmm5, %%xmm5, %%xmm5\n\t"     \
  "vpxor %%xmm6, %%xmm6, %%xmm6\n\tvpxor %%xmm7, %%xmm7, %%xmm7\n\t"
#define HF_W4_DP(W, X, A) "vpmaddwd %%ymm" #W ", %%ymm" #X ", %%ymm14\n\tvpaddd %%ymm14, %%ymm" #A ", %%ymm" #A "\n\t"
// the weights in ymm W0..W3 against the activation pairs of two rows: sums 0-3 (row 0), 4-7 (row 1)
#define HF_W4_DP2(W0, W1, W2, W3)                                                               \
  "vpbroadcastd (%[xa]), %%ymm12\n\tvpbroadcastd (%[xa], %[ldb]), %%ymm13\n\t"                     \
  HF_W4_DP(W0, 12, 0) HF_W4_DP(W1, 12, 1) HF_W4_DP(W2, 12, 2) HF_W4_DP(W3, 12, 3)                 \
  HF_W4_DP(W0, 13, 4) HF_W4_DP(W1, 13, 5) HF_W4_DP(W2, 13, 6) HF_W4_DP(W3, 13, 7)
#define HF_W4_STORE_W(W0, W1, W2, W3)                                                           \
  "test %[st], %[st]\n\tjz 2f\n\t"                                                                \
  "vmovdqa %%ymm" #W0 ", (%[wb])\n\tvmovdqa %%ymm" #W1 ", 32(%[wb])\n\t"                           \
  "vmovdqa %%ymm" #W2 ", 64(%[wb])\n\tvmovdqa %%ymm" #W3 ", 96(%[wb])\n\tadd $128, %[wb]\n\t2:\n\t"
#define HF_W4_CLOBBERS                                                                          \
  "memory", "cc", "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10",   \
      "xmm11", "xmm12", "xmm13", "xmm14", "xmm15"
// the 8 sums (ymm0-7) stored to acc [2][32]
#define HF_W4_PUT8                                                                              \
  "vmovdqu %%ymm0, (%[acc])\n\tvmovdqu %%ymm1, 32(%[acc])\n\tvmovdqu %%ymm2, 64(%[acc])\n\t"           \
  "vmovdqu %%ymm3, 96(%[acc])\n\tvmovdqu %%ymm4, 128(%[acc])\n\tvmovdqu %%ymm5, 160(%[acc])\n\t"       \
  "vmovdqu %%ymm6, 192(%[acc])\n\tvmovdqu %%ymm7, 224(%[acc])\n\t"
static_assert(kW4PrefetchBytes == 8192, "the prefetch distance is written in the assembly below");
// NVFP4: the k-pair at qp (32 bytes) -> weights x 512 in ymm10, 11, 8, 9 (as nvfp4_pair_i16; LUT in ymm15)
#define HF_W4_NVFP4_DECODE                                                                      \
  "vmovdqu (%[qp]), %%ymm8\n\tvpsrlw $4, %%ymm8, %%ymm9\n\t"                                          \
  "vpand %[nib], %%ymm8, %%ymm8\n\tvpand %[nib], %%ymm9, %%ymm9\n\t"                                 \
  "vpshufb %%ymm8, %%ymm15, %%ymm8\n\tvpshufb %%ymm9, %%ymm15, %%ymm9\n\t"                           \
  "vpxor %%xmm14, %%xmm14, %%xmm14\n\t"                                                           \
  "vpunpcklbw %%ymm8, %%ymm14, %%ymm10\n\tvpunpckhbw %%ymm8, %%ymm14, %%ymm11\n\t"                   \
  "vpunpcklbw %%ymm9, %%ymm14, %%ymm8\n\tvpunpckhbw %%ymm9, %%ymm14, %%ymm9\n\t"
alignas(32) const uint8_t kNibbleMask[32] = {15, 15, 15, 15, 15, 15, 15, 15, 15, 15, 15, 15, 15, 15, 15, 15,
                                             15, 15, 15, 15, 15, 15, 15, 15, 15, 15, 15, 15, 15, 15, 15, 15};

// int4: np k-pairs; the two rows' int32 sums added into acc [2][32] (lanes in the order of panel_row_i16's a[t])
inline void tile2_decode_int4(const uint8_t* qq, int64_t np, int16_t* wb, int64_t st, const int16_t* x,
                              int64_t ldx, int32_t* acc) {
  if (np <= 0) return;
  const uint8_t* end = qq + np * W4_NP;
  const int64_t ldb = 2 * ldx;  // bytes
#define HF_W4_ACC(A, OFF) "vpaddd " #OFF "(%[acc]), %%ymm" #A ", %%ymm" #A "\n\tvmovdqu %%ymm" #A ", " #OFF "(%[acc])\n\t"
  __asm__ volatile(
      HF_W4_ZERO8
      "vmovdqa %[nib], %%ymm15\n\t"
      "1:\n\t"
      "prefetcht0 8192(%[qp])\n\t"
      "vpmovzxbw (%[qp]), %%ymm8\n\tvpmovzxbw 16(%[qp]), %%ymm10\n\t"
      "vpsrlw $4, %%ymm8, %%ymm9\n\tvpsrlw $4, %%ymm10, %%ymm11\n\t"
      "vpand %%ymm15, %%ymm8, %%ymm8\n\tvpand %%ymm15, %%ymm10, %%ymm10\n\t"
      HF_W4_DP2(8, 9, 10, 11)
      HF_W4_STORE_W(8, 9, 10, 11)
      "add $32, %[qp]\n\tadd $4, %[xa]\n\tcmp %[end], %[qp]\n\tjne 1b\n\t"
      HF_W4_ACC(0, 0) HF_W4_ACC(1, 32) HF_W4_ACC(2, 64) HF_W4_ACC(3, 96)
      HF_W4_ACC(4, 128) HF_W4_ACC(5, 160) HF_W4_ACC(6, 192) HF_W4_ACC(7, 224)
      : [qp] "+r"(qq), [xa] "+r"(x), [wb] "+r"(wb)
      : [end] "r"(end), [ldb] "r"(ldb), [acc] "r"(acc), [st] "r"(st),
        [nib] "m"(kNibbleMask)
      : HF_W4_CLOBBERS);
#undef HF_W4_ACC
}

// NVFP4: nsub 16-k blocks. mu null: block s's int32 sums stored to acc + 64 s ([2][32], accumulator order of
// panel_row_i16_nvfp4). A folded chunk (nvfp4_fold; mu: [16-k block][4] multiplier vectors): each decoded weight
// times its multiplier before use and store, and one int32 sum per row and column over all blocks, stored to acc.
inline void tile2_decode_nvfp4(const uint8_t* qq, int64_t nsub, const __m256i* mu, int16_t* wb, int64_t st,
                               const int16_t* x, int64_t ldx, int32_t* acc) {
  if (nsub <= 0) return;
  const uint8_t* end = qq + nsub * 8 * W4_NP;
  const int64_t ldb = 2 * ldx;  // bytes
  const __m256i lut = nvfp4_lut_i16();
  if (!mu) {
  __asm__ volatile(
      "vmovdqu %[lut], %%ymm15\n\t"
      "3:\n\t"
      HF_W4_ZERO8
      "lea 256(%[qp]), %%rax\n\t"
      "1:\n\t"
      "prefetcht0 8192(%[qp])\n\t"
      HF_W4_NVFP4_DECODE
      HF_W4_DP2(10, 11, 8, 9)
      HF_W4_STORE_W(10, 11, 8, 9)
      "add $32, %[qp]\n\tadd $4, %[xa]\n\tcmp %%rax, %[qp]\n\tjne 1b\n\t"
      HF_W4_PUT8
      "add $256, %[acc]\n\t"
      "cmp %[end], %[qp]\n\tjne 3b\n\t"
      : [qp] "+r"(qq), [xa] "+r"(x), [wb] "+r"(wb), [acc] "+r"(acc)
      : [end] "r"(end), [ldb] "r"(ldb), [st] "r"(st), [lut] "m"(lut),
        [nib] "m"(kNibbleMask)
      : "rax", HF_W4_CLOBBERS);
  } else {  // folded
  __asm__ volatile(
      "vmovdqu %[lut], %%ymm15\n\t"
      HF_W4_ZERO8
      "3:\n\t"
      "lea 256(%[qp]), %%rax\n\t"
      "1:\n\t"
      "prefetcht0 8192(%[qp])\n\t"
      HF_W4_NVFP4_DECODE
      "vpmulhrsw (%[mu]), %%ymm10, %%ymm10\n\tvpmulhrsw 32(%[mu]), %%ymm11, %%ymm11\n\t"
      "vpmulhrsw 64(%[mu]), %%ymm8, %%ymm8\n\tvpmulhrsw 96(%[mu]), %%ymm9, %%ymm9\n\t"
      HF_W4_DP2(10, 11, 8, 9)
      HF_W4_STORE_W(10, 11, 8, 9)
      "add $32, %[qp]\n\tadd $4, %[xa]\n\tcmp %%rax, %[qp]\n\tjne 1b\n\t"
      "add $128, %[mu]\n\t"
      "cmp %[end], %[qp]\n\tjne 3b\n\t"
      HF_W4_PUT8
      : [qp] "+r"(qq), [xa] "+r"(x), [wb] "+r"(wb), [mu] "+r"(mu)
      : [end] "r"(end), [ldb] "r"(ldb), [st] "r"(st), [lut] "m"(lut), [nib] "m"(kNibbleMask), [acc] "r"(acc)
      : "rax", HF_W4_CLOBBERS);
  }
}

// NVFP4, one row: nsub 16-k blocks; block s's int32 sums stored to acc + 32 s (sums ymm0-3). In assembly: GCC 12
// unrolled the C++ version, re-associated the sums into a tree and kept the products on the stack (1.7x slower).
inline void tile1_decode_nvfp4(const uint8_t* qq, int64_t nsub, const int16_t* x, int32_t* acc) {
  if (nsub <= 0) return;
  const uint8_t* end = qq + nsub * 8 * W4_NP;
  const __m256i lut = nvfp4_lut_i16();
  __asm__ volatile(
      "vmovdqu %[lut], %%ymm15\n\t"
      "3:\n\t"
      "vpxor %%xmm0, %%xmm0, %%xmm0\n\tvpxor %%xmm1, %%xmm1, %%xmm1\n\t"
      "vpxor %%xmm2, %%xmm2, %%xmm2\n\tvpxor %%xmm3, %%xmm3, %%xmm3\n\t"
      "lea 256(%[qp]), %%rax\n\t"
      "1:\n\t"
      "prefetcht0 8192(%[qp])\n\t"
      HF_W4_NVFP4_DECODE
      "vpbroadcastd (%[xa]), %%ymm12\n\t"
      HF_W4_DP(10, 12, 0) HF_W4_DP(11, 12, 1) HF_W4_DP(8, 12, 2) HF_W4_DP(9, 12, 3)
      "add $32, %[qp]\n\tadd $4, %[xa]\n\tcmp %%rax, %[qp]\n\tjne 1b\n\t"
      "vmovdqu %%ymm0, (%[acc])\n\tvmovdqu %%ymm1, 32(%[acc])\n\t"
      "vmovdqu %%ymm2, 64(%[acc])\n\tvmovdqu %%ymm3, 96(%[acc])\n\t"
      "add $128, %[acc]\n\t"
      "cmp %[end], %[qp]\n\tjne 3b\n\t"
      : [qp] "+r"(qq), [xa] "+r"(x), [acc] "+r"(acc)
      : [end] "r"(end), [lut] "m"(lut), [nib] "m"(kNibbleMask)
      : "rax", HF_W4_CLOBBERS);
}
#undef HF_W4_NVFP4_DECODE
#undef HF_W4_PUT8
#undef HF_W4_CLOBBERS
#undef HF_W4_STORE_W
#undef HF_W4_DP2
#undef HF_W4_DP
#undef HF_W4_ZERO8

// int4: MR rows' integer sums over np k-pairs added into acc [MR][32] (lanes in the order of w[i])
template <int MR>
inline void add_i32(const __m256i (&a)[MR][4], int32_t* acc) {
  for (int m = 0; m < MR; ++m)
    for (int i = 0; i < 4; ++i) {
      __m256i* d = reinterpret_cast<__m256i*>(acc + m * W4_NP + 8 * i);
      _mm256_store_si256(d, _mm256_add_epi32(_mm256_load_si256(d), a[m][i]));
    }
}

template <int MR>
inline void tile_i16_int4(const int16_t* wb, int64_t np, const int16_t* x, int64_t ldx, int32_t* acc) {
  __m256i a[MR][4];
  tile_i16<MR>(wb, np, x, ldx, a);
  add_i32<MR>(a, acc);
}

// f [MR][32] += v x xs[m * xs_step] (row m)
template <int MR>
inline void nvfp4_add_rows(const __m256 (&v)[MR][4], const float* xs, int64_t xs_step, float* f) {
  for (int m = 0; m < MR; ++m) {
    const __m256 xsv = _mm256_set1_ps(xs[m * xs_step]);
    for (int t = 0; t < 4; ++t) {
      float* d = f + m * W4_NP + 8 * t;
      _mm256_store_ps(d, _mm256_fmadd_ps(v[m][t], xsv, _mm256_load_ps(d)));
    }
  }
}

// NVFP4: MR rows over nsub 16-k blocks of one activation block; f [MR][32] (permuted columns) += xs[m] x (sum over
// the blocks of int32 dot x block scale): the activation scale once per chunk, not per 16-k block
template <int MR>
inline void tile_i16_nvfp4(const int16_t* wb, int64_t nsub, const __m256 (*sc)[4], const int16_t* x, int64_t ldx,
                           const float* xs, int64_t xs_step, float* f) {
  __m256 v[MR][4];
  for (int m = 0; m < MR; ++m)
    for (int t = 0; t < 4; ++t) v[m][t] = _mm256_setzero_ps();
  for (int64_t s = 0; s < nsub; ++s) {
    __m256i a[MR][4];
    tile_i16<MR>(wb + 8 * 64 * s, 8, x + 16 * s, ldx, a);
    for (int m = 0; m < MR; ++m)
      for (int t = 0; t < 4; ++t) v[m][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a[m][t]), sc[s][t], v[m][t]);
  }
  nvfp4_add_rows<MR>(v, xs, xs_step, f);
}

// NVFP4, a folded chunk (nvfp4_fold): MR rows' int32 sums over the whole chunk, converted once
template <int MR>
inline void nvfp4_add_rows_folded(const __m256i (&a)[MR][4], const __m256 (&cs)[4], const float* xs, int64_t xs_step,
                                  float* f) {
  __m256 v[MR][4];
  for (int m = 0; m < MR; ++m)
    for (int t = 0; t < 4; ++t) v[m][t] = _mm256_mul_ps(_mm256_cvtepi32_ps(a[m][t]), cs[t]);
  nvfp4_add_rows<MR>(v, xs, xs_step, f);
}
template <int MR>
inline void tile_i16_nvfp4_folded(const int16_t* wb, int64_t np, const __m256 (&cs)[4], const int16_t* x, int64_t ldx,
                                  const float* xs, int64_t xs_step, float* f) {
  __m256i a[MR][4];
  tile_i16<MR>(wb, np, x, ldx, a);
  nvfp4_add_rows_folded<MR>(a, cs, xs, xs_step, f);
}

// one row (see above): per activation block, the int32 sums of its 16-k blocks, then f = sum of (sum x block
// scale), o += f x activation scale
void panel_row_i16_nvfp4(const W4Gemm& g, const uint8_t* q, const int16_t* xq, const float* xs, int64_t ag,
                         int64_t p, float* res) {
  const int64_t bpa = ag / 16, nab = g.K / ag;
  alignas(32) int32_t acc[8 * W4_NP];  // bpa <= 8
  __m256 o[4];
  o[0] = o[1] = o[2] = o[3] = _mm256_setzero_ps();
  const uint8_t* sp = static_cast<const uint8_t*>(g.scales) + p * g.G * W4_NP;
  for (int64_t ab = 0; ab < nab; ++ab) {
    tile1_decode_nvfp4(q + ab * bpa * 8 * W4_NP, bpa, xq + ab * ag, acc);
    __m256 f[4];
    f[0] = f[1] = f[2] = f[3] = _mm256_setzero_ps();
    for (int64_t s = 0; s < bpa; ++s) {
      __m256 sc[4];
      nvfp4_block_scales(sp + (ab * bpa + s) * W4_NP, sc);
      for (int t = 0; t < 4; ++t)
        f[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(acc + 32 * s + 8 * t))),
                               sc[t], f[t]);
    }
    const __m256 xsv = _mm256_set1_ps(xs[ab]);
    for (int t = 0; t < 4; ++t) o[t] = _mm256_fmadd_ps(f[t], xsv, o[t]);
  }
  alignas(32) float of[W4_NP];
  for (int t = 0; t < 4; ++t) _mm256_store_ps(of + 8 * t, o[t]);
  nvfp4_store_cols(of, res);
}

template <int MODE>
void panel_i16_rows(const W4Gemm& g, const uint8_t* q, const int16_t* xq, const float* xs, const int32_t* xd,
                    int64_t M, int64_t ag, int64_t p) {
  const int64_t K = g.K, nab = K / ag, pairs = ag / 2;
  alignas(32) int16_t wb[kI16ChunkPairs * 64];
  alignas(32) float facc[kI16Rows * W4_NP];
  alignas(32) int32_t iacc[kI16Rows * W4_NP];
  alignas(32) __m256 scv[kI16ChunkPairs / 8][4];
  NvFoldAvx2 fold;
  alignas(32) float res[W4_NP];
  const uint8_t* sp = static_cast<const uint8_t*>(g.scales) + p * g.G * W4_NP;
  for (int64_t r0 = 0; r0 < M; r0 += kI16Rows) {
    const int64_t rows = std::min(kI16Rows, M - r0);
    std::fill(facc, facc + rows * W4_NP, 0.0f);
    for (int64_t b = 0; b < nab; ++b) {
      if (MODE != W4_NVFP4) std::fill(iacc, iacc + rows * W4_NP, 0);
      for (int64_t c0 = 0; c0 < pairs; c0 += kI16ChunkPairs) {
        const int64_t np = std::min(kI16ChunkPairs, pairs - c0), kp = b * pairs + c0;
        int64_t m0 = 0;
        if constexpr (MODE == W4_NVFP4) {
          if (rows >= kNvFoldMinRows && nvfp4_fold(sp + (kp / 8) * W4_NP, np / 8, fold)) {
            // the first two rows decode (and store for the others), as below
            tile2_decode_nvfp4(q + kp * W4_NP, np / 8, &fold.mu[0][0], wb, rows > 2, xq + r0 * K + 2 * kp, K, iacc);
            __m256i a[2][4];
            for (int m = 0; m < 2; ++m)
              for (int t = 0; t < 4; ++t)
                a[m][t] = _mm256_load_si256(reinterpret_cast<const __m256i*>(iacc + 32 * m + 8 * t));
            nvfp4_add_rows_folded<2>(a, fold.cs, xs + r0 * nab + b, nab, facc);
            for (m0 = 2; m0 < rows; m0 += 2) {
              const int16_t* x = xq + (r0 + m0) * K + 2 * kp;
              const float* xsr = xs + (r0 + m0) * nab + b;
              if (rows - m0 >= 2) tile_i16_nvfp4_folded<2>(wb, np, fold.cs, x, K, xsr, nab, facc + m0 * W4_NP);
              else tile_i16_nvfp4_folded<1>(wb, np, fold.cs, x, K, xsr, nab, facc + m0 * W4_NP);
            }
            continue;
          }
          for (int64_t s = 0; s < np / 8; ++s) nvfp4_block_scales(sp + (kp / 8 + s) * W4_NP, scv[s]);
        }
        if (rows >= 2) {  // the first two rows decode (and store for the others)
          const int16_t* x = xq + r0 * K + 2 * kp;
          if constexpr (MODE == W4_NVFP4) {
            tile2_decode_nvfp4(q + kp * W4_NP, np / 8, nullptr, wb, rows > 2, x, K, iacc);
            __m256 v[2][4];
            for (int m = 0; m < 2; ++m)
              for (int t = 0; t < 4; ++t) v[m][t] = _mm256_setzero_ps();
            for (int64_t s = 0; s < np / 8; ++s)
              for (int m = 0; m < 2; ++m)
                for (int t = 0; t < 4; ++t) {
                  const __m256i a = _mm256_load_si256(reinterpret_cast<const __m256i*>(iacc + 64 * s + 32 * m + 8 * t));
                  v[m][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a), scv[s][t], v[m][t]);
                }
            nvfp4_add_rows<2>(v, xs + r0 * nab + b, nab, facc);
          } else {
            tile2_decode_int4(q + kp * W4_NP, np, wb, rows > 2, x, K, iacc);
          }
          m0 = 2;
        } else {
          decode_pairs_i16<MODE>(q + kp * W4_NP, np, wb);
        }
        for (; m0 < rows; m0 += 2) {
          const int16_t* x = xq + (r0 + m0) * K + 2 * kp;
          if constexpr (MODE == W4_NVFP4) {
            const float* xsr = xs + (r0 + m0) * nab + b;
            if (rows - m0 >= 2) tile_i16_nvfp4<2>(wb, np / 8, scv, x, K, xsr, nab, facc + m0 * W4_NP);
            else tile_i16_nvfp4<1>(wb, np / 8, scv, x, K, xsr, nab, facc + m0 * W4_NP);
          } else {
            if (rows - m0 >= 2) tile_i16_int4<2>(wb, np, x, K, iacc + m0 * W4_NP);
            else tile_i16_int4<1>(wb, np, x, K, iacc + m0 * W4_NP);
          }
        }
      }
      if constexpr (MODE != W4_NVFP4) {  // the block's epilogue, as panel_row_i16
        const int64_t so = (p * g.G + b * ag / g.gs) * W4_NP;
        const float* sc = static_cast<const float*>(g.scales) + so;
        for (int64_t m = 0; m < rows; ++m) {
          const int64_t i = (r0 + m) * nab + b;
          const __m256 xsv = _mm256_set1_ps(xs[i]);
          const __m256 xsum = _mm256_set1_ps(xs[i] * static_cast<float>(xd[i]));
          for (int t = 0; t < 4; ++t) {
            const int col = 16 * (t & 1) + 8 * (t >> 1);
            __m256i v = _mm256_load_si256(reinterpret_cast<const __m256i*>(iacc + m * W4_NP + 8 * t));
            if (MODE == W4_SYM) v = _mm256_sub_epi32(v, _mm256_set1_epi32(8 * xd[i]));
            float* d = facc + m * W4_NP + col;
            __m256 o = _mm256_fmadd_ps(_mm256_cvtepi32_ps(v), _mm256_mul_ps(_mm256_loadu_ps(sc + col), xsv),
                                       _mm256_load_ps(d));
            if (MODE == W4_ASYM) o = _mm256_fnmadd_ps(_mm256_loadu_ps(g.zs + so + col), xsum, o);
            _mm256_store_ps(d, o);
          }
        }
      }
    }
    for (int64_t m = 0; m < rows; ++m) {
      const float* f = facc + m * W4_NP;
      if constexpr (MODE == W4_NVFP4) {
        nvfp4_store_cols(f, res);
        w4a16_store_row(g, r0 + m, p * W4_NP, res, W4_NP);
      } else {
        w4a16_store_row(g, r0 + m, p * W4_NP, f, W4_NP);
      }
    }
  }
}

template <int MODE>
void fused_i16_impl(const W4Gemm& g, const int16_t* xq, const float* xs, const int32_t* xd, int64_t M, int64_t ag,
                    int64_t p0, int64_t p1) {
  alignas(32) float res[W4_NP];
  for (int64_t p = p0; p < p1; ++p) {
    const uint8_t* q = g.qpack + p * (g.K / 2) * W4_NP;
    if (M >= 2) {
      panel_i16_rows<MODE>(g, q, xq, xs, xd, M, ag, p);
      continue;
    }
    if constexpr (MODE == W4_NVFP4) panel_row_i16_nvfp4(g, q, xq, xs, ag, p, res);
    else panel_row_i16<MODE>(g, q, xq, xs, xd, ag, p, res);
    w4a16_store_row(g, 0, p * W4_NP, res, W4_NP);
  }
}

// ---- dequantize to a dense transposed weight Wt [K][ldd] (scales, zero points and the global scale folded in).
// Per k-pair and 16-byte half h (columns 8h..8h+7 and 16+8h..): a vpshufb splits the bytes by k parity, the
// nibbles widen to 32-bit lanes = 8 consecutive columns of one k-row. Partial last panels take the portable code.
inline void store8_bf16x2(uint16_t* d, __m256 a, __m256 b) {  // 16 fp32 -> bf16 (common/convert.h)
  _mm_storeu_si128(reinterpret_cast<__m128i*>(d), f32x8_to_bf16(a));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(d + 8), f32x8_to_bf16(b));
}

template <int MODE>
void dequant_impl(const W4Gemm& g, void* dst, int dst_dtype, int64_t ldd, int64_t p0, int64_t p1) {
  const int64_t K = g.K, G = g.G, kpg = g.gs / 2;
  alignas(32) float lt[16];
  for (int c = 0; c < 16; ++c) lt[c] = kE2M1[c];
  const __m256 lut0 = _mm256_load_ps(lt), lut1 = _mm256_load_ps(lt + 8);
  const __m128i split = _mm_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
  const __m256i m15 = _mm256_set1_epi32(15);
  const __m256 gsv = _mm256_set1_ps(g.gscale);
  const bool bf = dst_dtype == DT_BF16;
  const int64_t pf = std::min(p1, g.N / W4_NP);  // full panels [p0, pf); a partial last one: portable code
  if (pf < p1)
    w4a16_dequant_generic(g, static_cast<char*>(dst) + (pf - p0) * W4_NP * (bf ? 2 : 4), dst_dtype, ldd, pf, p1);
  constexpr int64_t JB = 32;  // k-blocks outermost: few destination rows in flight
  for (int64_t jb = 0; jb < K / 2; jb += JB) {
    const int64_t je = jb + JB < K / 2 ? jb + JB : K / 2;
    for (int64_t p = p0; p < pf; ++p) {
      const uint8_t* q = g.qpack + p * (K / 2) * W4_NP;
      const int64_t col0 = (p - p0) * W4_NP;
      __m256 sv[4], zv[4];
      for (int64_t j = jb, gend = -1; j < je; ++j) {
        if (j >= gend) {
          const int64_t gi = j / kpg;
          gend = (gi + 1) * kpg;
          const int64_t so = (p * G + gi) * W4_NP;
          for (int i = 0; i < 4; ++i) {  // vector i = columns 8i..8i+7
            sv[i] = MODE == W4_NVFP4 ? fp8x8_to_ps(static_cast<const uint8_t*>(g.scales) + so + 8 * i)
                                     : _mm256_loadu_ps(static_cast<const float*>(g.scales) + so + 8 * i);
            sv[i] = _mm256_mul_ps(sv[i], gsv);
            zv[i] = MODE == W4_ASYM ? _mm256_mul_ps(_mm256_loadu_ps(g.zs + so + 8 * i), gsv)
                                    : _mm256_mul_ps(sv[i], _mm256_set1_ps(MODE == W4_SYM ? 8.0f : 0.0f));
          }
        }
        __m256 v[2][4];  // [k parity][columns 8i..]
        for (int h = 0; h < 2; ++h) {
          const __m128i b = _mm_shuffle_epi8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + j * W4_NP + 16 * h)), split);
          for (int par = 0; par < 2; ++par) {
            const __m256i c = _mm256_cvtepu8_epi32(par ? _mm_srli_si128(b, 8) : b);
            const __m256i lo = _mm256_and_si256(c, m15), hi = _mm256_srli_epi32(c, 4);
            // lo: columns 8h.., hi: columns 16 + 8h..
            const __m256 wl = MODE == W4_NVFP4 ? decode<MODE>(lo, lut0, lut1) : _mm256_cvtepi32_ps(lo);
            const __m256 wh = MODE == W4_NVFP4 ? decode<MODE>(hi, lut0, lut1) : _mm256_cvtepi32_ps(hi);
            v[par][h] = _mm256_fmsub_ps(wl, sv[h], zv[h]);
            v[par][2 + h] = _mm256_fmsub_ps(wh, sv[2 + h], zv[2 + h]);
          }
        }
        for (int par = 0; par < 2; ++par) {
          const int64_t off = (2 * j + par) * ldd + col0;
          if (bf) {
            uint16_t* d = static_cast<uint16_t*>(dst) + off;
            store8_bf16x2(d, v[par][0], v[par][1]);
            store8_bf16x2(d + 16, v[par][2], v[par][3]);
          } else {
            float* d = static_cast<float*>(dst) + off;
            for (int i = 0; i < 4; ++i) _mm256_storeu_ps(d + 8 * i, v[par][i]);
          }
        }
      }
    }
  }
}

}  // namespace

// xsum [M][G] is required for int4 (sym and asym) on this path
void w4a16_fused_avx2(const W4Gemm& g, const float* x, int64_t M, const float* xsum, int64_t p0, int64_t p1) {
  with_mode(g.mode, [&](auto m) { fused_impl<decltype(m)::value>(g, x, M, xsum, p0, p1); });
}

// large-M dequantization on AVX2 machines uses the portable code (it is amortised over M rows)
void w4a16_fused_i16_avx2(const W4Gemm& g, const int16_t* xq, const float* xs, const int32_t* xd, int64_t M,
                          int64_t ag, int64_t p0, int64_t p1) {
  with_mode(g.mode, [&](auto m) { fused_i16_impl<decltype(m)::value>(g, xq, xs, xd, M, ag, p0, p1); });
}

// as w4a16_quant_x16_generic (the same numbers: round half to even, saturated, the sums of the saturated values),
// 8 lanes at a time; the block max compares the magnitudes' bits as integers, so a nan is never lost
bool w4a16_quant_x16_avx2(const void* x, int dtype, int64_t M, int64_t K, int64_t ag, int64_t l1max, int16_t* xq,
                          float* xs, int32_t* xd) {
  const int64_t nab = K / ag;
  auto load = [&](int64_t i) -> __m256 {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(x) + i));
    if (dtype == DT_BF16) return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    if (dtype == DT_F16) return _mm256_cvtph_ps(h);
    return _mm256_loadu_ps(static_cast<const float*>(x) + i);
  };
  auto hsum = [](__m128i v) {
    v = _mm_add_epi32(v, _mm_shuffle_epi32(v, _MM_SHUFFLE(1, 0, 3, 2)));
    return _mm_cvtsi128_si32(_mm_add_epi32(v, _mm_shuffle_epi32(v, _MM_SHUFFLE(2, 3, 0, 1))));
  };
  const __m256i mag = _mm256_set1_epi32(0x7fffffff);
  const __m256i lo16 = _mm256_set1_epi32(-32768), hi16 = _mm256_set1_epi32(32767);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t b = 0; b < nab; ++b) {
      const int64_t i0 = m * K + b * ag;
      __m256i mx = _mm256_setzero_si256();
      __m256 sm = _mm256_setzero_ps();
      for (int64_t i = 0; i < ag; i += 8) {
        const __m256i v = _mm256_and_si256(_mm256_castps_si256(load(i0 + i)), mag);
        mx = _mm256_max_epi32(mx, v);
        if (l1max > 0) sm = _mm256_add_ps(sm, _mm256_castsi256_ps(v));
      }
      __m128i m4 = _mm_max_epi32(_mm256_castsi256_si128(mx), _mm256_extracti128_si256(mx, 1));
      m4 = _mm_max_epi32(m4, _mm_shuffle_epi32(m4, _MM_SHUFFLE(1, 0, 3, 2)));
      m4 = _mm_max_epi32(m4, _mm_shuffle_epi32(m4, _MM_SHUFFLE(2, 3, 0, 1)));
      float l1 = 0.0f;
      if (l1max > 0) {
        alignas(32) float t[8];
        _mm256_store_ps(t, sm);
        for (int j = 0; j < 8; ++j) l1 += t[j];
      }
      const int s = quant_x16_exponent(static_cast<uint32_t>(_mm_cvtsi128_si32(m4)), l1, ag, l1max);
      if (s == INT32_MIN) return false;
      const __m256 inv = _mm256_set1_ps(std::ldexp(1.0f, -s));
      xs[m * nab + b] = std::ldexp(1.0f, s);
      __m256i sum = _mm256_setzero_si256();
      for (int64_t i = 0; i < ag; i += 16) {  // ag is a multiple of 16
        __m256i d0 = _mm256_cvtps_epi32(_mm256_mul_ps(load(i0 + i), inv));  // round to nearest even
        __m256i d1 = _mm256_cvtps_epi32(_mm256_mul_ps(load(i0 + i + 8), inv));
        d0 = _mm256_min_epi32(_mm256_max_epi32(d0, lo16), hi16);
        d1 = _mm256_min_epi32(_mm256_max_epi32(d1, lo16), hi16);
        sum = _mm256_add_epi32(sum, _mm256_add_epi32(d0, d1));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(xq + i0 + i),
                            _mm256_permute4x64_epi64(_mm256_packs_epi32(d0, d1), _MM_SHUFFLE(3, 1, 2, 0)));
      }
      xd[m * nab + b] = hsum(_mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1)));
    }
  return true;
}

void w4a16_dequant_avx2(const W4Gemm& g, void* dst, int dst_dtype, int64_t ldd, int64_t p0, int64_t p1) {
  with_mode(g.mode, [&](auto m) { dequant_impl<decltype(m)::value>(g, dst, dst_dtype, ldd, p0, p1); });
}

}  // namespace hf_w4

namespace hf_w4 {
// AWQ codes -> kernel layout. Per panel and k-pair j: the 4 words of k = 2j (columns 8r..8r+7, r = 0..3) in the
// low 128-bit lane, those of k = 2j+1 in the high lane. With A = word r, B = word r+2 (r = 0, 1):
//   T = (A & 0x0F0F0F0F) | (B & 0x0F0F0F0F) << 4   bytes = columns [c0, c4, c1, c5] (AWQ nibble order)
//   U = (A >> 4 & 0x0F0F0F0F) | (B & 0xF0F0F0F0)   bytes = columns [c2, c6, c3, c7]
// (low nibble = column 8r + c, high nibble = column 16 + 8r + c), then one vpermd + vpshufb put the 32 bytes
// in kernel order (byte 16r + 2c + parity).
void w4a16_repack_awq_codes_avx2(const W4Repack& r, int64_t p0, int64_t p1) {
  const int64_t K = r.K, cs0 = r.cs0, cs1 = r.cs1;
  const int32_t* codes = r.codes;
  const __m256i m0f = _mm256_set1_epi32(0x0F0F0F0F), mf0 = _mm256_set1_epi32(static_cast<int>(0xF0F0F0F0u));
  const __m256i perm = _mm256_setr_epi32(0, 1, 4, 5, 2, 3, 6, 7);
  const __m256i shuf = _mm256_setr_epi8(0, 8, 2, 10, 4, 12, 6, 14, 1, 9, 3, 11, 5, 13, 7, 15,
                                        0, 8, 2, 10, 4, 12, 6, 14, 1, 9, 3, 11, 5, 13, 7, 15);
  auto load4 = [&](int64_t rw0, int64_t k) -> __m128i {
    const int32_t* s = codes + rw0 * cs0 + k * cs1;
    if (cs0 == 1) return _mm_loadu_si128(reinterpret_cast<const __m128i*>(s));
    return _mm_setr_epi32(s[0], s[cs0], s[2 * cs0], s[3 * cs0]);
  };
  for (int64_t pg = p0; pg < p1; pg += 4) {  // 4 panels share the 64-byte lines of each k-row (cs0 == 1)
    const int64_t pe = pg + 4 < p1 ? pg + 4 : p1;
    for (int64_t j = 0; j < K / 2; ++j) {
      for (int64_t p = pg; p < pe; ++p) {
        const int64_t rw0 = p * (W4_NP / 8);
        const __m256i y = _mm256_inserti128_si256(_mm256_castsi128_si256(load4(rw0, 2 * j)), load4(rw0, 2 * j + 1), 1);
        const __m256i b = _mm256_shuffle_epi32(y, 0xEE);  // words [2, 3, 2, 3] per lane
        const __m256i t = _mm256_or_si256(_mm256_and_si256(y, m0f), _mm256_slli_epi32(_mm256_and_si256(b, m0f), 4));
        const __m256i u = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(y, 4), m0f), _mm256_and_si256(b, mf0));
        const __m256i tu = _mm256_unpacklo_epi32(t, u);  // [T0 U0 T1 U1] per lane (lane = k parity)
        const __m256i o = _mm256_shuffle_epi8(_mm256_permutevar8x32_epi32(tu, perm), shuf);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(r.qpack + (p * (K / 2) + j) * W4_NP), o);
      }
    }
  }
}
}  // namespace hf_w4

#else  // not x86: stubs, never called (cpu_caps() reports no AVX2)
#include <stdexcept>

#include "w4a16.h"

namespace hf_w4 {
[[noreturn]] static void no_avx2() {
  throw std::runtime_error("hf_w4: the AVX2 W4A16 kernels are not built for this CPU architecture");
}
void w4a16_fused_avx2(const W4Gemm&, const float*, int64_t, const float*, int64_t, int64_t) { no_avx2(); }
void w4a16_fused_i16_avx2(const W4Gemm&, const int16_t*, const float*, const int32_t*, int64_t, int64_t, int64_t,
                          int64_t) { no_avx2(); }
bool w4a16_quant_x16_avx2(const void*, int, int64_t, int64_t, int64_t, int64_t, int16_t*, float*, int32_t*) {
  no_avx2();
}
void w4a16_dequant_avx2(const W4Gemm&, void*, int, int64_t, int64_t, int64_t) { no_avx2(); }
void w4a16_repack_awq_codes_avx2(const W4Repack&, int64_t, int64_t) { no_avx2(); }
}  // namespace hf_w4
#endif
