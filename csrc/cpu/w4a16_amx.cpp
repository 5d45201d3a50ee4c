// hf_w4 W4A16: AMX-BF16 kernel for bf16 activations (Intel Sapphire Rapids and later). Raw pointers only, no
// torch headers; only called when cpu_caps().amx_bf16 (CPUID + XCR0 + Linux's tile-data permission), so nothing
// here runs on other CPUs.
// Per 32-column panel and 16 k-pairs: the packed bytes are decoded to fp32 with the group scale (and zero)
// folded in, rounded to bf16 straight into two VNNI-2 B tiles (16 k-pair rows x 16 columns x 2 k parities;
// the packed layout's (column, parity) lanes are exactly that order, so no shuffles), and multiplied with a
// 16-row bf16 activation tile by tdpbf16ps into two fp32 C tiles (2 x 2 register blocking: two 16-row A tiles,
// two B tiles, four C tiles). Activations are packed into contiguous 1 KiB tiles first (w4a16_amx_pack_a).
// A block of 8 panels x 2048 k (1 MiB) is decoded once into a per-thread buffer and every 32-row block runs
// over it, 256 k at a time across the block's panels (C tiles spilled between the 256-k sub-chunks), so the
// decode is paid once per weight, and the next row block is prefetched into L2. (M <= 32 streams instead, each
// 32-k step decoded into one of two L1 buffers while the tile products of the step before run on the other:
// int4 groups of a multiple of 32 in amx_small_raw - raw codes, scales on the accumulators -, NVFP4 in
// amx_small_nvfp4_fp16 (scales folded in through fp16 products, also the decoder of the blocked kernel for
// NVFP4), the rest in amx_small_folded.) Activations are packed so that every A tile load reads 1 KiB of
// contiguous memory (row-strided loads of x alias in L1). Measurements behind the block and step sizes:
// docs/cpu-kernels.md, "Tuning notes".
#include "common/cpu_features.h"
#if HF_W4_X86
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma,f16c,amx-tile,amx-bf16")
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "common/amx_tiles.h"
#include "common/cpu_features.h"
#include "w4a16.h"
#include "w4a16_common.h"
#include "w4a16_avx512_util.h"

// AVX512-FP16 intrinsics need GCC 12 / clang 14; older compilers build without the fp16 NVFP4 decode
#if (defined(__clang__) && __clang_major__ >= 14) || (!defined(__clang__) && defined(__GNUC__) && __GNUC__ >= 12)
#define HF_W4_FP16_DECODE 1
#else
#define HF_W4_FP16_DECODE 0
#endif

namespace hf_w4 {

bool w4a16_amx_fp16_available() {
#if HF_W4_FP16_DECODE
  static const bool ok = !env_switched_off("HF_W4_AMX_FP16") && cpu_caps().amx_bf16 && cpu_caps().avx512_fp16;
  return ok;
#else
  return false;
#endif
}

namespace {

// One 32-k step of the 2 x 2 register blocking: B tiles 1, 2 (columns 0..15, 16..31) from b, b + 512; A tile 0
// (rows 0..15) from a0 and, when two, A tile 7 (rows 16..31) from a1; C tiles 3, 4 (and 5, 6) accumulate.
inline void tile_step(const uint16_t* b, const uint16_t* a0, const uint16_t* a1, bool two) {
  HF_TILE_LOAD(1, b, 64);
  HF_TILE_LOAD(2, b + 512, 64);
  HF_TILE_LOAD(0, a0, 64);
  _tile_dpbf16ps(3, 0, 1);
  _tile_dpbf16ps(4, 0, 2);
  if (two) {
    HF_TILE_LOAD(7, a1, 64);
    _tile_dpbf16ps(5, 7, 1);
    _tile_dpbf16ps(6, 7, 2);
  }
}

// The same step on the second tile set alone (A tile 7, C tiles 5, 6), for amx_small_raw's odd groups when M <= 16.
inline void tile_step_set1(const uint16_t* b, const uint16_t* a) {
  HF_TILE_LOAD(1, b, 64);
  HF_TILE_LOAD(2, b + 512, 64);
  HF_TILE_LOAD(7, a, 64);
  _tile_dpbf16ps(5, 7, 1);
  _tile_dpbf16ps(6, 7, 2);
}

// Decodes 16 k-pairs x 32 columns of packed codes to bf16 B tiles with the group scales (and zero points) folded
// in: dst[0..511] columns 0..15, dst[512..1023] columns 16..31 (VNNI-2 rows; the packed layout's (column, parity)
// lanes are exactly that order, so no shuffles). fp32 LUT (vpermps), scale, round to bf16.
template <int MODE>
struct FoldedDecoder {
  const W4Gemm& g;
  __m512 lut;
  __m512i dupA, dupB;
  explicit FoldedDecoder(const W4Gemm& gg) : g(gg) {
    alignas(64) float lt[16];
    for (int c = 0; c < 16; ++c) lt[c] = w4_code_value(MODE, c);
    lut = _mm512_load_ps(lt);
    dupA = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
    dupB = _mm512_add_epi32(dupA, _mm512_set1_epi32(8));
  }
  // k-pairs kb .. kb + 15 of panel p
  inline void operator()(int64_t p, int64_t kb, uint16_t* dst) const {
    const int64_t kpg = g.gs / 2;
    const uint8_t* q = g.qpack + p * (g.K / 2) * W4_NP;
    int64_t gend = -1;
    __m512 sd[4], zd[4];
    for (int jj = 0; jj < 16; ++jj) {
      const int64_t j = kb + jj;
      if (j >= gend) {
        const int64_t gi = j / kpg;
        gend = (gi + 1) * kpg;
        const int64_t so = (p * g.G + gi) * W4_NP;
        __m512 s0, s1;
        load_scales<MODE>(g, so, s0, s1);
        sd[0] = _mm512_permutexvar_ps(dupA, s0); sd[1] = _mm512_permutexvar_ps(dupA, s1);
        sd[2] = _mm512_permutexvar_ps(dupB, s0); sd[3] = _mm512_permutexvar_ps(dupB, s1);
        if (MODE == W4_ASYM) {
          const __m512 z0 = _mm512_loadu_ps(g.zs + so), z1 = _mm512_loadu_ps(g.zs + so + 16);
          zd[0] = _mm512_permutexvar_ps(dupA, z0); zd[1] = _mm512_permutexvar_ps(dupA, z1);
          zd[2] = _mm512_permutexvar_ps(dupB, z0); zd[3] = _mm512_permutexvar_ps(dupB, z1);
        }
      }
      const __m512i b0 = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + j * W4_NP)));
      const __m512i b1 = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + j * W4_NP + 16)));
      __m512 v[4] = {_mm512_permutexvar_ps(b0, lut), _mm512_permutexvar_ps(_mm512_srli_epi32(b0, 4), lut),
                     _mm512_permutexvar_ps(b1, lut), _mm512_permutexvar_ps(_mm512_srli_epi32(b1, 4), lut)};
      for (int i = 0; i < 4; ++i)
        v[i] = MODE == W4_ASYM ? _mm512_fmsub_ps(v[i], sd[i], zd[i]) : _mm512_mul_ps(v[i], sd[i]);
      // VNNI-2 rows: columns 0..15 = [v0 | v2], columns 16..31 = [v1 | v3]
      _mm512_storeu_si512(dst + jj * 32, (__m512i)_mm512_cvtne2ps_pbh(v[2], v[0]));
      _mm512_storeu_si512(dst + 512 + jj * 32, (__m512i)_mm512_cvtne2ps_pbh(v[3], v[1]));
    }
  }
};

// One output row of a C tile pair (c: 32 fp32, 64-byte aligned): multiplied by 2^rowe[m] first where rowe is given
// (the fp16 decode's B tiles hold w * 2^-108 and its activation rows are scaled; see Fp16NvDecoder), then stored.
inline void store_c_row(const W4Gemm& g, int64_t m, int64_t n0, float* c, const float* rowe) {
  if (rowe) {
    const __m512 e = _mm512_set1_ps(rowe[m]);
    _mm512_store_ps(c, _mm512_scalef_ps(_mm512_load_ps(c), e));
    _mm512_store_ps(c + 16, _mm512_scalef_ps(_mm512_load_ps(c + 16), e));
  }
  store_row_avx512(g, m, n0, c, W4_NP);
}

// decode: a decoder as FoldedDecoder (or Fp16NvDecoder, then rowe holds each row's exponent to restore, else null).
// Always inlined into amx_impl and amx_impl_nvfp4_fp16 (compiled for AVX512-FP16, so its decoder inlines too).
template <class Decoder>
__attribute__((always_inline)) inline void amx_blocked(const W4Gemm& g, const Decoder& decode, const uint16_t* xa,
                                                       const float* rowe, int64_t M, int64_t p0, int64_t p1) {
  // tiles: 0 / 7 = A of the two 16-row blocks, 1-2 = B (columns 0..15, 16..31), 3-4 / 5-6 = C
  const int64_t KB = g.K / 32, MB = (M + 15) / 16;
  TileCfg cfg = tile_config();
  for (int t = 0; t < 8; ++t) { cfg.rows[t] = 16; cfg.colsb[t] = 64; }
  load_tile_config(cfg);
  alignas(64) float cbuf[2][16][32];
  auto epilogue = [&](int64_t p, int64_t mb, bool two) {
    HF_TILE_STORE(3, &cbuf[0][0][0], 128); HF_TILE_STORE(4, &cbuf[0][0][16], 128);
    if (two) { HF_TILE_STORE(5, &cbuf[1][0][0], 128); HF_TILE_STORE(6, &cbuf[1][0][16], 128); }
    for (int64_t m = 16 * mb; m < M && m < 16 * mb + 32; ++m)
      store_c_row(g, m, p * W4_NP, cbuf[(m - 16 * mb) >> 4][m & 15], rowe);
  };
  // Decode a block of NB panels x one K chunk of at most 2048 k (NB * KC * 64 bytes, 1 MiB, stays in L2) once,
  // then run every 32-row block of the (tile-packed) activations over it. With K > 2048 the C tiles are
  // spilled to a per-thread buffer between chunks (4 KiB per 32 rows x 32 columns per chunk - cheap); without
  // the chunks, a large K allowed only one panel per block and every panel re-read all of the activations. The
  // tile loads are what the AMX unit waits on here, so a chunk's activations (64 KiB per 32 rows at 2048 k) should
  // stay close: 2048-k chunks measured best.
  const int64_t KCB = std::min<int64_t>(KB, 64);  // 32-k steps per chunk
  // Within a chunk a 32-row block walks 8 steps (256 k) over all NB panels before the next 8: its two A tiles
  // per step (16 KiB) are then read from L1 by every panel instead of from L2 by each in turn, for one C-tile
  // spill and reload per panel per 8 steps. The 2 x 2 tile loop is bound by its tile loads; 8 steps measured
  // 3-8 % faster than 64, and faster than 4 or 16 (16: the A tiles of the two row blocks share L1 sets).
  constexpr int64_t kAmxSubSteps = 8;
  const int64_t NB = std::max<int64_t>(1, std::min<int64_t>(8, (int64_t(1) << 20) / (KCB * 2048)));
  // C tiles are spilled between sub-chunks; only across K chunks must every 32-row block keep its own (one
  // reused slot is a few % faster)
  const bool spill = kAmxSubSteps < KB, chunked = KCB < KB;
  // 64-byte aligned (AlignedBuf): tile loads of rows that straddle cache lines ran ~1.6x slower
  thread_local AlignedBuf<uint16_t> pbuf_s;
  thread_local AlignedBuf<float> cacc_s;
  uint16_t* const pbuf = pbuf_s.get(static_cast<size_t>(NB * KCB * 1024));
  float* const cacc = spill ? cacc_s.get(static_cast<size_t>((chunked ? (MB + 1) / 2 : 1) * NB * 1024)) : nullptr;
  for (int64_t pb = p0; pb < p1; pb += NB) {
    const int64_t pe = std::min(p1, pb + NB);
    for (int64_t k0 = 0; k0 < KB; k0 += KCB) {
      const int64_t k1 = std::min(KB, k0 + KCB), kn = k1 - k0;
      for (int64_t p = pb; p < pe; ++p)
        for (int64_t kb = k0; kb < k1; ++kb) decode(p, 16 * kb, pbuf + ((p - pb) * KCB + kb - k0) * 1024);
      for (int64_t mb = 0; mb < MB; mb += 2) {
        const bool two = mb + 1 < MB;
        const uint16_t* a0 = xa + mb * KB * 512;
        const uint16_t* a1 = a0 + KB * 512;
        // the next 32-row block's activations of this chunk (2 x kn KiB) are prefetched into L2 while this
        // one runs, spread evenly over the pe - pb panels x kn steps (without it the time per call varied 3x)
        const int64_t nmb = mb + 2 < MB ? mb + 2 : 0;
        const char* an0 = reinterpret_cast<const char*>(xa + (nmb * KB + k0) * 512);
        const char* an1 = an0 + KB * 1024;
        const int64_t an_lines = std::min<int64_t>(2, MB - nmb) * kn * 16;
        const int64_t per = (an_lines + (pe - pb) * kn - 1) / ((pe - pb) * kn);
        int64_t l = 0;
        for (int64_t ks = k0; ks < k1; ks += kAmxSubSteps) {
          const int64_t ke = std::min(k1, ks + kAmxSubSteps);
          for (int64_t p = pb; p < pe; ++p) {
            const uint16_t* b = pbuf + (p - pb) * KCB * 1024;
            float* cs = spill ? cacc + ((chunked ? mb / 2 : 0) * NB + (p - pb)) * 1024 : nullptr;
            if (ks == 0) {
              _tile_zero(3); _tile_zero(4);
              if (two) { _tile_zero(5); _tile_zero(6); }
            } else {
              HF_TILE_LOAD(3, cs, 64); HF_TILE_LOAD(4, cs + 256, 64);
              if (two) { HF_TILE_LOAD(5, cs + 512, 64); HF_TILE_LOAD(6, cs + 768, 64); }
            }
            for (int64_t kb = ks; kb < ke; ++kb) {
              for (const int64_t le = std::min(an_lines, l + per); l < le; ++l)
                _mm_prefetch((l < kn * 16 ? an0 : an1 - kn * 1024) + 64 * l, _MM_HINT_T1);
              tile_step(b + (kb - k0) * 1024, a0 + kb * 512, a1 + kb * 512, two);
            }
            if (ke == KB) {
              epilogue(p, mb, two);
            } else {
              HF_TILE_STORE(3, cs, 64); HF_TILE_STORE(4, cs + 256, 64);
              if (two) { HF_TILE_STORE(5, cs + 512, 64); HF_TILE_STORE(6, cs + 768, 64); }
            }
          }
        }
      }
    }
  }
  _tile_release();
}

template <int MODE>
void amx_impl(const W4Gemm& g, const uint16_t* xa, int64_t M, int64_t p0, int64_t p1) {
  amx_blocked(g, FoldedDecoder<MODE>(g), xa, nullptr, M, p0, p1);
}

// Prefetches the packed codes of the 32-k step kW4PrefetchBytes after qk into L1, all 8 of its cache lines, and
// those kW4PrefetchFarBytes after it into L2 (fewer lines left the stream to the hardware prefetcher, ~10 % slower).
// (always_inline: GCC 12 dropped these prefetches where a plain inline prefetch_step was inlined into the
// always_inline loops below - no prefetch instruction left in the binary)
__attribute__((always_inline)) inline void prefetch_step(const uint8_t* qk) {
  const char* p = reinterpret_cast<const char*>(qk) + kW4PrefetchBytes;
  for (int i = 0; i < 8; ++i) _mm_prefetch(p + 64 * i, _MM_HINT_T0);
  const char* f = reinterpret_cast<const char*>(qk) + kW4PrefetchFarBytes;
  for (int i = 0; i < 8; ++i) _mm_prefetch(f + 64 * i, _MM_HINT_T1);
}

// 16 k-pairs x 32 columns of raw codes (qk) -> two B tiles in bbuf (columns 0..15, then 16..31): bf16 code values
// from a 32-entry vpermw LUT (entries c and c + 16 equal, so the low nibble needs no mask); the weight stream is
// prefetched kW4PrefetchBytes ahead.
inline void decode_raw16(const uint8_t* qk, const __m512i lut, uint16_t* bbuf) {
  prefetch_step(qk);
  for (int jj = 0; jj < 16; ++jj) {
    const __m512i b = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(qk + jj * W4_NP)));
    _mm512_store_si512(bbuf + jj * 32, _mm512_permutexvar_epi16(b, lut));
    _mm512_store_si512(bbuf + 512 + jj * 32, _mm512_permutexvar_epi16(_mm512_srli_epi16(b, 4), lut));
  }
}

// Tile configuration of the small-M kernels (M <= 32, tile_step's numbering): A and C tiles with M rows (<= 16) per
// 16-row block; returns whether there are two blocks. With one, tiles 7 and 5, 6 take M rows too (a second tile set
// for the same rows: tile_step_set1).
inline bool small_tile_config(int64_t M) {
  const bool two = M > 16;
  const int r0 = two ? 16 : static_cast<int>(M), r1 = two ? static_cast<int>(M - 16) : r0;
  TileCfg cfg = tile_config();
  cfg.rows[0] = r0; cfg.colsb[0] = 64;             // A, rows 0..15
  cfg.rows[7] = r1; cfg.colsb[7] = 64;             // A, rows 16..
  cfg.rows[1] = cfg.rows[2] = 16; cfg.colsb[1] = cfg.colsb[2] = 64;
  cfg.rows[3] = cfg.rows[4] = r0; cfg.colsb[3] = cfg.colsb[4] = 64;
  cfg.rows[5] = cfg.rows[6] = r1; cfg.colsb[5] = cfg.colsb[6] = 64;
  load_tile_config(cfg);
  return two;
}

// int4, M <= 32, groups of a multiple of 32: the codes go to the B tiles as they are (decode_raw16: 1 widening
// load, 2 vpermw and 1 shift per k-pair x 32 columns, no fp32 detour), and the group scales (and zero points,
// through the per-group activation sums) are applied to the C tiles once per group. The decode is what costs at
// small M, so this is ~3x cheaper per weight than decoding with the scales folded in. A / C tiles have M (<= 16)
// rows per block. With M <= 16 the groups alternate between two tile sets (A 0 / C 3, 4 and A 7 / C 5, 6) and a
// group's C tiles are stored and scaled only once the next group's first tile products are issued: a tile store
// right behind the products it reads waits for them, once per group (2-10 % faster, bit-identical).
template <int MODE>
void amx_small_raw(const W4Gemm& g, const uint16_t* xa, const float* xsum, int64_t M, int64_t p0, int64_t p1) {
  const int64_t K = g.K, G = g.G, KB = K / 32, steps = g.gs / 32;
  const bool two = small_tile_config(M);
  alignas(64) uint16_t lt[32];
  for (int c = 0; c < 32; ++c)
    lt[c] = f32_to_bf16_bits(MODE == W4_SYM ? static_cast<float>((c & 15) - 8) : static_cast<float>(c & 15));
  const __m512i lut = _mm512_load_si512(lt);
  alignas(64) uint16_t bbuf[2][2 * 16 * 32];
  alignas(64) float cb[32][32];
  alignas(64) float acc[32][32];
  for (int64_t p = p0; p < p1; ++p) {
    const uint8_t* q = g.qpack + p * (K / 2) * W4_NP;
    std::memset(acc, 0, sizeof(float) * 32 * M);
    // acc += scale * C (- zero * scale * xsum) of group gi, C stored in cb
    auto flush = [&](int64_t gi) {
      const int64_t so = (p * G + gi) * W4_NP;
      __m512 s0, s1;
      load_scales<MODE>(g, so, s0, s1);
      for (int64_t m = 0; m < M; ++m) {
        __m512 v0 = _mm512_fmadd_ps(_mm512_load_ps(cb[m]), s0, _mm512_load_ps(acc[m]));
        __m512 v1 = _mm512_fmadd_ps(_mm512_load_ps(cb[m] + 16), s1, _mm512_load_ps(acc[m] + 16));
        if (MODE == W4_ASYM) {
          const __m512 xs = _mm512_set1_ps(xsum[m * G + gi]);
          v0 = _mm512_fnmadd_ps(_mm512_loadu_ps(g.zs + so), xs, v0);
          v1 = _mm512_fnmadd_ps(_mm512_loadu_ps(g.zs + so + 16), xs, v1);
        }
        _mm512_store_ps(acc[m], v0);
        _mm512_store_ps(acc[m] + 16, v1);
      }
    };
    // C tiles 3, 4 (rows 0..15, or M <= 16 and an even group) or 5, 6 (M <= 16 and an odd group) to cb rows 0..
    auto store_set = [&](bool odd) {
      if (odd) { HF_TILE_STORE(5, &cb[0][0], 128); HF_TILE_STORE(6, &cb[0][16], 128); }
      else { HF_TILE_STORE(3, &cb[0][0], 128); HF_TILE_STORE(4, &cb[0][16], 128); }
    };
    decode_raw16(q, lut, bbuf[0]);
    for (int64_t gi = 0; gi < G; ++gi) {
      const bool odd = !two && (gi & 1);
      if (odd) { _tile_zero(5); _tile_zero(6); }
      else { _tile_zero(3); _tile_zero(4); }
      if (two) { _tile_zero(5); _tile_zero(6); }
      for (int64_t kb = gi * steps; kb < (gi + 1) * steps; ++kb) {
        if (kb + 1 < KB) decode_raw16(q + (kb + 1) * 16 * W4_NP, lut, bbuf[(kb + 1) & 1]);
        if (odd) tile_step_set1(bbuf[kb & 1], xa + kb * 512);
        else tile_step(bbuf[kb & 1], xa + kb * 512, two ? xa + (KB + kb) * 512 : nullptr, two);
        if (!two && gi > 0 && kb == gi * steps) {  // the previous group, behind this group's first products
          store_set(!odd);
          flush(gi - 1);
        }
      }
      if (two) {
        store_set(false);
        HF_TILE_STORE(5, &cb[16][0], 128); HF_TILE_STORE(6, &cb[16][16], 128);
        flush(gi);
      }
    }
    if (!two) {
      store_set((G - 1) & 1);
      flush(G - 1);
    }
    for (int64_t m = 0; m < M; ++m) store_row_avx512(g, m, p * W4_NP, acc[m], W4_NP);
  }
  _tile_release();
}

// M <= 32 where the raw-code kernel does not apply (NVFP4 from M = 9, int4 groups that are not a multiple of 32):
// the streaming loop of amx_small_raw, each 32-k step decoded with the scales folded in (FoldedDecoder) into an
// L1 buffer right before its tile products, and the C tiles accumulating over all of K (no per-group flush).
// amx_impl's blocking (decode a 512 KiB block once and re-read it from L2 for every 32-row block) only pays
// with several row blocks; with one, its B tile loads come from L2 instead of L1 (streaming: ~1.5x faster up to
// M = 32). (NVFP4 takes amx_small_nvfp4_fp16 where the CPU has AVX512-FP16.)
// The streaming loop shared by amx_small_folded and amx_small_nvfp4_fp16: decode(p, kb, dst) writes the two B tiles
// of 32-k step kb / 16 of panel p; rowe (or null) holds per row the exponent the epilogue multiplies back in.
// Always inlined, so that the fp16 kernel (compiled for AVX512-FP16) inlines its decoder too (a call costs ~5 %).
template <class Decoder>
__attribute__((always_inline)) inline void amx_small_stream(const W4Gemm& g, const Decoder& decode, const uint16_t* xa,
                                                            const float* rowe, int64_t M, int64_t p0, int64_t p1) {
  const int64_t KB = g.K / 32;
  const bool two = small_tile_config(M);
  alignas(64) uint16_t bbuf[2][2 * 16 * 32];
  alignas(64) float cb[32][32];
  for (int64_t p = p0; p < p1; ++p) {
    const uint8_t* q = g.qpack + p * (g.K / 2) * W4_NP;
    _tile_zero(3); _tile_zero(4);
    if (two) { _tile_zero(5); _tile_zero(6); }
    prefetch_step(q);
    decode(p, 0, bbuf[0]);
    for (int64_t kb = 0; kb < KB; ++kb) {
      if (kb + 1 < KB) {
        prefetch_step(q + (kb + 1) * 512);
        decode(p, 16 * (kb + 1), bbuf[(kb + 1) & 1]);
      }
      tile_step(bbuf[kb & 1], xa + kb * 512, two ? xa + (KB + kb) * 512 : nullptr, two);
    }
    HF_TILE_STORE(3, &cb[0][0], 128); HF_TILE_STORE(4, &cb[0][16], 128);
    if (two) { HF_TILE_STORE(5, &cb[16][0], 128); HF_TILE_STORE(6, &cb[16][16], 128); }
    for (int64_t m = 0; m < M; ++m) store_c_row(g, m, p * W4_NP, cb[m], rowe);
  }
  _tile_release();
}

template <int MODE>
void amx_small_folded(const W4Gemm& g, const uint16_t* xa, int64_t M, int64_t p0, int64_t p1) {
  amx_small_stream(g, FoldedDecoder<MODE>(g), xa, nullptr, M, p0, p1);
}

#if HF_W4_FP16_DECODE
#define HF_W4_FP16_TARGET \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx512fp16,amx-tile,amx-bf16")))
// NVFP4 decode with the block scale folded in at 5 vector operations per 32 weights (the fp32 decode of
// FoldedDecoder takes about 8): e2m1 from a vpermw LUT as fp16, times the fp16 block scale (vmulph; exact: e2m1 x
// e4m3 has at most 6 significant bits), and the fp16 bits moved into bf16 position by an arithmetic shift by 3
// and a mask (sign kept, the fp16 exponent lands in the bf16 exponent field, the mantissa's low 3 bits are
// zero). That bf16 is the product times 2^-112 (the exponent biases differ by 112), zero stays zero, so no
// exponent has to be added (which would need a zero test); the scales carry 2^4 so that every product is a
// normal fp16 (2^-6 .. 43008), making the B tiles hold w * 2^-108 exactly. The activations are packed multiplied
// by 2^a_m per row (w4a16_amx_pack_a_pow2: max |x| -> ~2^100), so that no product of the tile multiply falls
// below fp32's normal range, and the epilogue multiplies row m by 2^(108 - a_m) (vscalefps): bit for bit the
// result of the unscaled product (power-of-two factors commute with every rounding while nothing under- or
// overflows). Needs AVX512-FP16 (every AMX CPU so far has it; checked at run time).
struct Fp16NvDecoder {
  const W4Gemm& g;
  __m512i lut, dlo, dhi;
  HF_W4_FP16_TARGET explicit Fp16NvDecoder(const W4Gemm& gg) : g(gg) {
    alignas(64) uint16_t lt[32], il[32], ih[32];
    for (int c = 0; c < 32; ++c) {
      lt[c] = static_cast<uint16_t>(_cvtss_sh(kE2M1[c & 15], 0));
      il[c] = static_cast<uint16_t>(c / 2);
      ih[c] = static_cast<uint16_t>(16 + c / 2);
    }
    lut = _mm512_load_si512(lt);
    dlo = _mm512_load_si512(il);
    dhi = _mm512_load_si512(ih);
  }
  // k-pairs kb .. kb + 15 of panel p -> two VNNI-2 B tiles (columns 0..15, 16..31)
  HF_W4_FP16_TARGET inline void operator()(int64_t p, int64_t kb, uint16_t* dst) const {
    const uint8_t* q = g.qpack + p * (g.K / 2) * W4_NP;
    const uint8_t* sc = static_cast<const uint8_t*>(g.scales) + p * g.G * W4_NP;
    const __m512i keep = _mm512_set1_epi16(static_cast<short>(0x8fff));
    for (int half = 0; half < 2; ++half) {  // one 16-k block (8 k-pairs) each
      const int64_t j0 = kb + 8 * half;
      // the 32 columns' scales as fp16 x 2^4 (exact; fp16 arithmetic handles denormals whatever MXCSR says)
      const __m512i sh = _mm512_castph_si512(
          _mm512_mul_ph(_mm512_castsi512_ph(fp8x32_to_ph_bits(sc + (j0 / 8) * W4_NP)), _mm512_set1_ph(4096.0f)));
      const __m512h slo = _mm512_castsi512_ph(_mm512_permutexvar_epi16(dlo, sh));
      const __m512h shi = _mm512_castsi512_ph(_mm512_permutexvar_epi16(dhi, sh));
      for (int jj = 8 * half; jj < 8 * half + 8; ++jj) {
        const __m512i b =
            _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + (kb + jj) * W4_NP)));
        const __m512h vl = _mm512_castsi512_ph(_mm512_permutexvar_epi16(b, lut));
        const __m512h vh = _mm512_castsi512_ph(_mm512_permutexvar_epi16(_mm512_srli_epi16(b, 4), lut));
        const __m512i pl = _mm512_castph_si512(_mm512_mul_ph(vl, slo));
        const __m512i ph = _mm512_castph_si512(_mm512_mul_ph(vh, shi));
        _mm512_store_si512(dst + jj * 32, _mm512_and_si512(_mm512_srai_epi16(pl, 3), keep));
        _mm512_store_si512(dst + 512 + jj * 32, _mm512_and_si512(_mm512_srai_epi16(ph, 3), keep));
      }
    }
  }
};

// amx_small_folded for NVFP4 with the fp16 decode; xa packed by w4a16_amx_pack_a_pow2, rowe[m] = 108 - a_m
HF_W4_FP16_TARGET void amx_small_nvfp4_fp16(const W4Gemm& g, const uint16_t* xa, const float* rowe, int64_t M,
                                            int64_t p0, int64_t p1) {
  amx_small_stream(g, Fp16NvDecoder(g), xa, rowe, M, p0, p1);
}

// amx_impl for NVFP4 with the fp16 decode (M > 32)
HF_W4_FP16_TARGET void amx_impl_nvfp4_fp16(const W4Gemm& g, const uint16_t* xa, const float* rowe, int64_t M,
                                           int64_t p0, int64_t p1) {
  amx_blocked(g, Fp16NvDecoder(g), xa, rowe, M, p0, p1);
}
#endif

// Row r >= M of a packed 16-row block (d: the row's first 32 k; the next 32 k are 512 elements on): zeroed only for
// M > kAmxSmallMaxM, where amx_blocked's full 16-row tiles read it; the small-M kernels' tiles have the real row count.
inline void pad_row(uint16_t* d, int64_t KB, int64_t M) {
  if (M > kAmxSmallMaxM)
    for (int64_t kb = 0; kb < KB; ++kb) _mm512_store_si512(d + kb * 512, _mm512_setzero_si512());
}

}  // namespace

void w4a16_amx_pack_a(const uint16_t* x, int64_t ldx, int64_t M, int64_t K, uint16_t* xa, int64_t mb0, int64_t mb1) {
  const int64_t KB = K / 32;
  for (int64_t mb = mb0; mb < mb1; ++mb)
    for (int64_t r = 0; r < 16; ++r) {
      const int64_t m = 16 * mb + r;
      uint16_t* d = xa + mb * KB * 512 + 32 * r;
      if (m < M) {
        const uint16_t* xr = x + m * ldx;
        for (int64_t kb = 0; kb < KB; ++kb) _mm512_store_si512(d + kb * 512, _mm512_loadu_si512(xr + 32 * kb));
      } else {
        pad_row(d, KB, M);
      }
    }
}

void w4a16_amx_pack_a_pow2(const uint16_t* x, int64_t M, int64_t K, uint16_t* xa, float* rowe, int64_t mb0,
                           int64_t mb1) {
  const int64_t KB = K / 32;
  for (int64_t mb = mb0; mb < mb1; ++mb)
    for (int64_t r = 0; r < 16; ++r) {
      const int64_t m = 16 * mb + r;
      if (m >= M) {
        pad_row(xa + mb * KB * 512 + 32 * r, KB, M);
        continue;
      }
      const uint16_t* xr = x + m * K;
      int emax = 0;  // largest biased exponent of the row (255: inf / nan)
      for (int64_t k = 0; k < K; ++k) emax = std::max(emax, (xr[k] >> 7) & 0xff);
      // a = 227 - emax puts max |x| at 2^100..2^101; capped at 127 (2^a must be an fp32) and 0 for inf / nan
      const int a = emax == 255 ? 0 : std::min(127, 227 - emax);
      rowe[m] = static_cast<float>(108 - a);
      const __m512 f = _mm512_castsi512_ps(_mm512_set1_epi32((127 + a) << 23));
      for (int64_t kb = 0; kb < KB; ++kb) {
        const __m512i h = _mm512_loadu_si512(xr + 32 * kb);
        const __m512 lo = _mm512_mul_ps(_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(
                                            _mm512_castsi512_si256(h)), 16)), f);
        const __m512 hi = _mm512_mul_ps(_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(
                                            _mm512_extracti64x4_epi64(h, 1)), 16)), f);
        _mm512_store_si512(xa + (mb * KB + kb) * 512 + 32 * r, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
      }
    }
}

void w4a16_amx_nvfp4_fp16(const W4Gemm& g, const uint16_t* xa, const float* rowe, int64_t M, int64_t p0, int64_t p1) {
#if HF_W4_FP16_DECODE
  if (M <= kAmxSmallMaxM) amx_small_nvfp4_fp16(g, xa, rowe, M, p0, p1);
  else amx_impl_nvfp4_fp16(g, xa, rowe, M, p0, p1);
#else
  (void)g; (void)xa; (void)rowe; (void)M; (void)p0; (void)p1;
#endif
}

// xa: bf16 activations packed by w4a16_amx_pack_a, K % 32 == 0; xsum fp32 [M][G] for asym int4 on the raw-code
// kernel (amx_raw_codes)
void w4a16_fused_amx(const W4Gemm& g, const uint16_t* xa, const float* xsum, int64_t M, int64_t p0, int64_t p1) {
  with_mode(g.mode, [&](auto m) {
    constexpr int MODE = decltype(m)::value;
    if constexpr (MODE != W4_NVFP4) {
      if (amx_raw_codes(MODE, g.gs, M)) return amx_small_raw<MODE>(g, xa, xsum, M, p0, p1);
    }
    if (M <= kAmxSmallMaxM) amx_small_folded<MODE>(g, xa, M, p0, p1);
    else amx_impl<MODE>(g, xa, M, p0, p1);
  });
}

}  // namespace hf_w4

#else  // not x86: stubs, never called (cpu_caps() reports no AMX)
#include <stdexcept>

#include "w4a16.h"

namespace hf_w4 {
[[noreturn]] static void no_amx() {
  throw std::runtime_error("hf_w4: the AMX W4A16 kernels are not built for this CPU architecture");
}
bool w4a16_amx_fp16_available() { return false; }
void w4a16_amx_pack_a(const uint16_t*, int64_t, int64_t, int64_t, uint16_t*, int64_t, int64_t) { no_amx(); }
void w4a16_amx_pack_a_pow2(const uint16_t*, int64_t, int64_t, uint16_t*, float*, int64_t, int64_t) { no_amx(); }
void w4a16_amx_nvfp4_fp16(const W4Gemm&, const uint16_t*, const float*, int64_t, int64_t, int64_t) { no_amx(); }
void w4a16_fused_amx(const W4Gemm&, const uint16_t*, const float*, int64_t, int64_t, int64_t) { no_amx(); }
}  // namespace hf_w4
#endif
