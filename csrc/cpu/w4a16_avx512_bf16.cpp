// hf_w4 W4A16: the blocked large-M kernel for bf16 activations on AVX-512 CPUs with AVX512-BF16 (path `blocked`,
// w4a16_path.h). Raw pointers only, no torch headers. Design: docs/cpu-kernels.md ("The blocked kernel").
//
// At large M a W4A16 GEMM is bound by its multiply instructions, not by the weight stream, so the work per weight
// that is repeated for every row block (decoding codes, applying block scales) has to go. Here each thread decodes
// one 32-column panel at a time ONCE into a buffer of bf16 weights (K x 32 x 2 bytes: 256 KiB at K = 4096, kept in
// L2) and then runs every row block of the activations over it with vdpbf16ps, 32 multiply-adds per instruction,
// the most a 16-bit-product instruction does (vpdpwssd too; the rate of both is measured by csrc/tools/cpu_peak.cpp).
// The decoded words keep the packed layout's VNNI-2 order (word 2c + parity = column c at k = 2j + parity), which is
// exactly vdpbf16ps's pairing, so the micro-kernel needs no shuffles: per k-pair two weight vectors (columns 0..15 and
// 16..31), a 32-bit broadcast of each row's activation pair and two vdpbf16ps per row.
//
// Exactness: int4 codes (code - 8, or the code for asymmetric weights) are exact in bf16 and their group scale is
// applied to the fp32 group sums; NVFP4's e2m1 x e4m3 block scale has at most 6 significant bits, also exact in
// bf16, so the block scales are folded into the decoded weights and the global scale is applied at the end. The
// activations enter as they are (bf16): every product is exact and only the fp32 accumulation rounds (vdpbf16ps
// reads denormal inputs as zero: an activation below 2^-126 counts as 0, far under that rounding). The same
// inputs give the same sums whatever the thread count (each output element is summed by one thread in a fixed
// order).
#include "common/cpu_features.h"
#if HF_W4_X86
#ifndef HF_W4_EMULATE_AVX512  // (the test-only emulated build: common/simd512.h)
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx512bf16,fma,f16c,bmi2")
#endif
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include "common/simd512.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "common/aligned_buf.h"
#include "w4a16.h"
#include "w4a16_common.h"
#include "w4a16_avx512_util.h"

namespace hf_w4 {
namespace {

// Rows per block of the micro-kernel: 12 rows x 2 vectors of 16 columns = 24 fp32 accumulators, plus 2 weight
// vectors and a broadcast register out of 32. Per k-pair: 2 weight loads and 12 broadcasts for 24 vdpbf16ps.
constexpr int kBR = kBlockedRows;

// The micro-kernel: rows [0, MR) of a packed row block (xb: the block's activation pairs, kBR dwords per k-pair)
// times npairs k-pairs of decoded weights w (64 bf16 per k-pair), one weight group; then o[m][c] += sum * s[c] for
// the rows' fp32 outputs o [MR][32] and the group's column scales s [32] (columns 0..15 of row m: the sums of the
// low-nibble words, 16..31 of the high ones).
// The activations come from the L3 (a chunk of rows is several MiB): the loop prefetches them 3 KiB ahead into L1
// (Zen 5: 2-4 % faster; 384 B to 6 KiB ahead all helped, 3 KiB most).
// In inline asm: GCC 12 compiled the intrinsics loop with register copies of the accumulators, which bounds a loop
// of 2 instructions per cycle by the rename width. The emulated build (no asm there) runs the scalar twin.
#ifndef HF_W4_EMULATE_AVX512
#define HF_BF_ROW(XO, A, B)                          \
  "vpbroadcastd " XO "(%[x]), %%zmm29\n\t"           \
  "vdpbf16ps %%zmm29, %%zmm30, %%zmm" A "\n\t"       \
  "vdpbf16ps %%zmm29, %%zmm31, %%zmm" B "\n\t"
#define HF_BF_ZERO(A, B) "vpxord %%zmm" A ", %%zmm" A ", %%zmm" A "\n\tvpxord %%zmm" B ", %%zmm" B ", %%zmm" B "\n\t"
// o[m] += acc * s (zmm30 / zmm31 hold the scales of columns 0..15 / 16..31 by then)
#define HF_BF_FLUSH(A, B, O)                                                                         \
  "vfmadd213ps " O "(%[o]), %%zmm30, %%zmm" A "\n\tvmovaps %%zmm" A ", " O "(%[o])\n\t"              \
  "vfmadd213ps " O "+64(%[o]), %%zmm31, %%zmm" B "\n\tvmovaps %%zmm" B ", " O "+64(%[o])\n\t"
#define HF_BF_KERNEL(ZERO, ROWS, FLUSH)        \
  ZERO                                         \
  "1:\n\t"                                     \
  "prefetcht0 3072(%[x])\n\t" /* 64 k-pairs */ \
  "vmovdqa64 (%[w]), %%zmm30\n\t"              \
  "vmovdqa64 64(%[w]), %%zmm31\n\t"            \
  ROWS                                         \
  "add $128, %[w]\n\t"                         \
  "add $48, %[x]\n\t" /* kBR * 4 bytes */      \
  "dec %[n]\n\t"                               \
  "jnz 1b\n\t"                                 \
  "vmovups (%[s]), %%zmm30\n\t"                \
  "vmovups 64(%[s]), %%zmm31\n\t"              \
  FLUSH
#define HF_BF_Z4 HF_BF_ZERO("0", "1") HF_BF_ZERO("2", "3") HF_BF_ZERO("4", "5") HF_BF_ZERO("6", "7")
#define HF_BF_Z8 HF_BF_Z4 HF_BF_ZERO("8", "9") HF_BF_ZERO("10", "11") HF_BF_ZERO("12", "13") HF_BF_ZERO("14", "15")
#define HF_BF_Z12 HF_BF_Z8 HF_BF_ZERO("16", "17") HF_BF_ZERO("18", "19") HF_BF_ZERO("20", "21") HF_BF_ZERO("22", "23")
#define HF_BF_R4 HF_BF_ROW("0", "0", "1") HF_BF_ROW("4", "2", "3") HF_BF_ROW("8", "4", "5") HF_BF_ROW("12", "6", "7")
#define HF_BF_R8 HF_BF_R4 HF_BF_ROW("16", "8", "9") HF_BF_ROW("20", "10", "11") HF_BF_ROW("24", "12", "13") \
  HF_BF_ROW("28", "14", "15")
#define HF_BF_R12 HF_BF_R8 HF_BF_ROW("32", "16", "17") HF_BF_ROW("36", "18", "19") HF_BF_ROW("40", "20", "21") \
  HF_BF_ROW("44", "22", "23")
#define HF_BF_F4 HF_BF_FLUSH("0", "1", "0") HF_BF_FLUSH("2", "3", "128") HF_BF_FLUSH("4", "5", "256") \
  HF_BF_FLUSH("6", "7", "384")
#define HF_BF_F8 HF_BF_F4 HF_BF_FLUSH("8", "9", "512") HF_BF_FLUSH("10", "11", "640") \
  HF_BF_FLUSH("12", "13", "768") HF_BF_FLUSH("14", "15", "896")
#define HF_BF_F12 HF_BF_F8 HF_BF_FLUSH("16", "17", "1024") HF_BF_FLUSH("18", "19", "1152") \
  HF_BF_FLUSH("20", "21", "1280") HF_BF_FLUSH("22", "23", "1408")
#define HF_BF_CLOBBERS                                                                                            \
  "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10", "xmm11", "xmm12",      \
      "xmm13", "xmm14", "xmm15", "xmm16", "xmm17", "xmm18", "xmm19", "xmm20", "xmm21", "xmm22", "xmm23", "xmm29", \
      "xmm30", "xmm31", "cc", "memory"
#endif

template <int MR>
__attribute__((always_inline)) inline void group_rows(const uint16_t* w, const uint32_t* xb, int64_t npairs,
                                                      const float* s, float* o) {
  static_assert(kBR == 12 && (MR == 4 || MR == 8 || MR == 12), "the asm spells 12-row blocks, 4 / 8 / 12 rows");
#ifndef HF_W4_EMULATE_AVX512
  if constexpr (MR == 12)
    asm volatile(HF_BF_KERNEL(HF_BF_Z12, HF_BF_R12, HF_BF_F12)
                 : [w] "+r"(w), [x] "+r"(xb), [n] "+r"(npairs) : [s] "r"(s), [o] "r"(o) : HF_BF_CLOBBERS);
  else if constexpr (MR == 8)
    asm volatile(HF_BF_KERNEL(HF_BF_Z8, HF_BF_R8, HF_BF_F8)
                 : [w] "+r"(w), [x] "+r"(xb), [n] "+r"(npairs) : [s] "r"(s), [o] "r"(o) : HF_BF_CLOBBERS);
  else
    asm volatile(HF_BF_KERNEL(HF_BF_Z4, HF_BF_R4, HF_BF_F4)
                 : [w] "+r"(w), [x] "+r"(xb), [n] "+r"(npairs) : [s] "r"(s), [o] "r"(o) : HF_BF_CLOBBERS);
#else
  // vdpbf16ps per lane, after Intel's pseudocode: acc += x1 * w1, then acc += x0 * w0 (products exact in fp32,
  // each add rounded); no denormal flushing here (the tests' inputs have none)
  auto f = [](uint32_t h) {
    const uint32_t b = h << 16;
    float v;
    std::memcpy(&v, &b, 4);
    return v;
  };
  for (int m = 0; m < MR; ++m)
    for (int c = 0; c < 32; ++c) {
      const uint16_t* wc = w + 32 * (c / 16) + 2 * (c % 16);
      float a = 0.0f;
      for (int64_t j = 0; j < npairs; ++j) {
        const uint32_t xv = xb[kBR * j + m];
        a += f(xv >> 16) * f(wc[64 * j + 1]);
        a += f(xv & 0xffff) * f(wc[64 * j]);
      }
      o[32 * m + c] = std::fma(a, s[c], o[32 * m + c]);
    }
#endif
}

// Panel p's codes -> bf16 weights w [K/2][64] in the packed layout's word order (k-pair j: words 0..31 = columns
// 0..15 x parity from the low nibbles, words 32..63 = columns 16..31 from the high nibbles).
// int4: the codes' values (code - 8, or the code) straight from a 16-bit LUT (vpermw reads index bits 4:0 and the
// table repeats, so the low nibble needs no mask).
// NVFP4: through fp32 (the e2m1 LUT with vpermps, times the block scale: exact), then the high halves of the fp32
// lanes, which are the exact bf16 values (vpermt2w).
template <int MODE>
void decode_panel(const W4Gemm& g, int64_t p, uint16_t* w) {
  const uint8_t* q = g.qpack + p * (g.K / 2) * W4_NP;
  if constexpr (MODE != W4_NVFP4) {
    alignas(64) uint16_t t[32];
    for (int c = 0; c < 32; ++c) {
      const float v = w4_code_value(MODE, c & 15);
      uint32_t b;
      std::memcpy(&b, &v, 4);
      t[c] = static_cast<uint16_t>(b >> 16);  // small integers: exact in bf16
    }
    const __m512i lut = _mm512_load_si512(t);
    for (int64_t j = 0; j < g.K / 2; ++j) {
      const __m512i b = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + j * W4_NP)));
      _mm512_store_si512(w + 64 * j, _mm512_permutexvar_epi16(b, lut));
      _mm512_store_si512(w + 64 * j + 32, _mm512_permutexvar_epi16(_mm512_srli_epi16(b, 4), lut));
    }
    return;
  }
  alignas(64) float t[16];
  for (int c = 0; c < 16; ++c) t[c] = w4_code_value(MODE, c);
  const __m512 lut = _mm512_load_ps(t);
  const __m512i dupA = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
  const __m512i dupB = _mm512_add_epi32(dupA, _mm512_set1_epi32(8));
  alignas(64) uint16_t hi[32];  // word i <- the high word of fp32 lane i % 16 of the first (i < 16) / second vector
  for (int i = 0; i < 32; ++i) hi[i] = static_cast<uint16_t>(2 * (i % 16) + 1 + (i >= 16 ? 32 : 0));
  const __m512i odd = _mm512_load_si512(hi);
  __m512 sd[4];
  for (int64_t j = 0; j < g.K / 2; ++j) {
    if (j % 8 == 0) {  // a new 16-k block: its 32 scales
      __m512 s0, s1;
      fp8x32_to_ps(static_cast<const uint8_t*>(g.scales) + (p * g.G + j / 8) * W4_NP, 256.0f, s0, s1);
      sd[0] = _mm512_permutexvar_ps(dupA, s0); sd[1] = _mm512_permutexvar_ps(dupA, s1);
      sd[2] = _mm512_permutexvar_ps(dupB, s0); sd[3] = _mm512_permutexvar_ps(dupB, s1);
    }
    const __m512i b0 = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + j * W4_NP)));
    const __m512i b1 = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + j * W4_NP + 16)));
    // v0: bytes 0..15 low nibbles = columns 0..7, v2: bytes 16..31 low = 8..15, v1 / v3 high = 16..23 / 24..31
    const __m512 v0 = _mm512_mul_ps(_mm512_permutexvar_ps(b0, lut), sd[0]);
    const __m512 v1 = _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(b0, 4), lut), sd[1]);
    const __m512 v2 = _mm512_mul_ps(_mm512_permutexvar_ps(b1, lut), sd[2]);
    const __m512 v3 = _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(b1, 4), lut), sd[3]);
    _mm512_store_si512(w + 64 * j, _mm512_permutex2var_epi16(_mm512_castps_si512(v0), odd, _mm512_castps_si512(v2)));
    _mm512_store_si512(w + 64 * j + 32,
                       _mm512_permutex2var_epi16(_mm512_castps_si512(v1), odd, _mm512_castps_si512(v3)));
  }
}

// One row block (MR of its rows computed) x the decoded panel p: int4 per weight group (the group sums times the
// group's column scales, minus zero * scale * the rows' group sums of x for asymmetric weights), NVFP4 over all of
// K at once (scales 1: its block scales are in the weights); then the rows' outputs.
template <int MR, int MODE>
void row_block(const W4Gemm& g, const uint16_t* w, const uint32_t* xb, const float* xsum, int64_t rows,
               int64_t row0, int64_t p) {
  alignas(64) float o[MR * 32] = {};
  alignas(64) static const float ones[32] = {1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1,
                                             1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1};
  if (MODE == W4_NVFP4) {
    group_rows<MR>(w, xb, g.K / 2, ones, o);
  } else {
    const int64_t kp = g.gs / 2;  // k-pairs per group
    const float* sc = static_cast<const float*>(g.scales) + p * g.G * W4_NP;
    for (int64_t gi = 0; gi < g.G; ++gi) {
      group_rows<MR>(w + gi * kp * 64, xb + gi * kp * kBR, kp, sc + gi * W4_NP, o);
      if (MODE == W4_ASYM) {  // - zero * scale * the group's sum of x
        const __m512 z0 = _mm512_loadu_ps(g.zs + (p * g.G + gi) * W4_NP);
        const __m512 z1 = _mm512_loadu_ps(g.zs + (p * g.G + gi) * W4_NP + 16);
        for (int64_t m = 0; m < rows; ++m) {
          const __m512 xs = _mm512_set1_ps(xsum[m * g.G + gi]);
          _mm512_store_ps(o + 32 * m, _mm512_fnmadd_ps(z0, xs, _mm512_load_ps(o + 32 * m)));
          _mm512_store_ps(o + 32 * m + 16, _mm512_fnmadd_ps(z1, xs, _mm512_load_ps(o + 32 * m + 16)));
        }
      }
    }
  }
  for (int64_t m = 0; m < rows; ++m) store_row_avx512(g, row0 + m, p * W4_NP, o + 32 * m, W4_NP);
}

// Bytes [i * step, (i + 1) * step) of n at p (step: n / parts, whole cache lines) prefetched into L2.
inline void prefetch_part(const void* p, int64_t n, int64_t i, int64_t parts) {
  const int64_t step = ((n + parts - 1) / parts + 63) & ~int64_t(63);
  for (int64_t b = i * step; b < std::min(n, (i + 1) * step); b += 64)
    __builtin_prefetch(static_cast<const char*>(p) + b, 0, 2);
}

// Every row block of xp (the packed rows of one chunk, w4a16_blocked_chunk: the torch glue calls once per chunk)
// over each panel of [p0, p1), the panel decoded once.
template <int MODE>
void blocked_impl(const W4Gemm& g, const uint32_t* xp, const float* xsum, int64_t M, int64_t p0, int64_t p1) {
  const int64_t K = g.K, nrb = (M + kBR - 1) / kBR;
  thread_local AlignedBuf<uint16_t> wbuf;
  uint16_t* w = wbuf.get(static_cast<size_t>(K / 2) * 64);
  const int64_t qbytes = (K / 2) * W4_NP, sbytes = g.G * W4_NP * (MODE == W4_NVFP4 ? 1 : 4);
  for (int64_t p = p0; p < p1; ++p) {
    decode_panel<MODE>(g, p, w);
    for (int64_t rb = 0; rb < nrb; ++rb) {
      // the next panel's codes and scales into L2, a part before each row block: its decode then does not wait
      // for them (they come from memory or a busy L3; Zen 5, 1 thread: 1.5-3 % faster at M = 256-1024)
      if (p + 1 < p1) {
        prefetch_part(g.qpack + (p + 1) * qbytes, qbytes, rb, nrb);
        prefetch_part(static_cast<const char*>(g.scales) + (p + 1) * sbytes, sbytes, rb, nrb);
      }
      const int64_t row0 = rb * kBR, rows = std::min<int64_t>(kBR, M - row0);
      const uint32_t* xb = xp + rb * (K / 2) * kBR;
      const float* xs = xsum ? xsum + row0 * g.G : nullptr;
      // the last block: the fewest multiple of 4 rows that covers it (packed rows beyond M are zero)
      if (rows > 8) row_block<12, MODE>(g, w, xb, xs, rows, row0, p);
      else if (rows > 4) row_block<8, MODE>(g, w, xb, xs, rows, row0, p);
      else row_block<4, MODE>(g, w, xb, xs, rows, row0, p);
    }
  }
}

}  // namespace

// Each block's 12 rows in 3 groups of 4: per 16 k-pairs, 4 rows' 64-byte loads transposed as 4 x 4 dword blocks in
// each 128-bit lane (unpack 32 / 64), so that lane l of result t holds the 4 rows' pair 4l + t: one 16-byte store per
// k-pair and group (a scalar copy per pair was ~2.5 % of the call at M = 1024).
void w4a16_blocked_pack_x(const uint16_t* x, int64_t M, int64_t K, uint32_t* xp, int64_t rb0, int64_t rb1) {
  const int64_t kp = K / 2, kv = kp & ~int64_t(15);
  for (int64_t rb = rb0; rb < rb1; ++rb) {
    uint32_t* o = xp + rb * kp * kBR;
    for (int r0 = 0; r0 < kBR; r0 += 4) {
      const uint16_t* xr[4];
      for (int r = 0; r < 4; ++r) {
        const int64_t m = rb * kBR + r0 + r;
        xr[r] = m < M ? x + m * K : nullptr;
      }
      auto row = [&](int r, int64_t j) {  // pairs j .. j + 15 of row r (zero past M)
        return xr[r] ? _mm512_loadu_si512(xr[r] + 2 * j) : _mm512_setzero_si512();
      };
      for (int64_t j = 0; j < kv; j += 16) {
        const __m512i a = row(0, j), b = row(1, j), c = row(2, j), d = row(3, j);
        const __m512i ab0 = _mm512_unpacklo_epi32(a, b), ab1 = _mm512_unpackhi_epi32(a, b);
        const __m512i cd0 = _mm512_unpacklo_epi32(c, d), cd1 = _mm512_unpackhi_epi32(c, d);
        const __m512i t[4] = {_mm512_unpacklo_epi64(ab0, cd0), _mm512_unpackhi_epi64(ab0, cd0),
                              _mm512_unpacklo_epi64(ab1, cd1), _mm512_unpackhi_epi64(ab1, cd1)};
        uint32_t* oj = o + j * kBR + r0;
        for (int tt = 0; tt < 4; ++tt) {
          _mm_storeu_si128(reinterpret_cast<__m128i*>(oj + tt * kBR), _mm512_castsi512_si128(t[tt]));
          _mm_storeu_si128(reinterpret_cast<__m128i*>(oj + (4 + tt) * kBR), _mm512_extracti32x4_epi32(t[tt], 1));
          _mm_storeu_si128(reinterpret_cast<__m128i*>(oj + (8 + tt) * kBR), _mm512_extracti32x4_epi32(t[tt], 2));
          _mm_storeu_si128(reinterpret_cast<__m128i*>(oj + (12 + tt) * kBR), _mm512_extracti32x4_epi32(t[tt], 3));
        }
      }
      for (int64_t j = kv; j < kp; ++j)
        for (int r = 0; r < 4; ++r) {
          uint32_t v = 0;
          if (xr[r]) std::memcpy(&v, xr[r] + 2 * j, 4);  // (x may be 2-byte aligned)
          o[j * kBR + r0 + r] = v;
        }
    }
  }
}

void w4a16_blocked_avx512(const W4Gemm& g, const uint32_t* xp, const float* xsum, int64_t M, int64_t p0,
                          int64_t p1) {
  with_mode(g.mode, [&](auto m) { blocked_impl<decltype(m)::value>(g, xp, xsum, M, p0, p1); });
}

}  // namespace hf_w4

#else  // not x86: stubs, never called (cpu_caps() reports no AVX-512)
#include <stdexcept>

#include "w4a16.h"

namespace hf_w4 {
void w4a16_blocked_pack_x(const uint16_t*, int64_t, int64_t, uint32_t*, int64_t, int64_t) {
  throw std::runtime_error("hf_w4: the AVX-512 W4A16 kernels are not built for this CPU architecture");
}
void w4a16_blocked_avx512(const W4Gemm&, const uint32_t*, const float*, int64_t, int64_t, int64_t) {
  throw std::runtime_error("hf_w4: the AVX-512 W4A16 kernels are not built for this CPU architecture");
}
}  // namespace hf_w4
#endif
