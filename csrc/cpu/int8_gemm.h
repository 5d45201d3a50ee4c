// hf_w4 int8 (W8A8 / W4A8) CPU kernel: shared declarations. No torch headers here.
//
// Packed weight layout ("VNNI-4 panels"), built by the repack functions:
//   * N is padded to a multiple of NR = 64 columns; panel p holds columns [64p, 64p+64).
//   * K is reordered (act-order permutation, if any) and each group of `gs` columns is padded with
//     zeros to Gp = roundup(gs, 8); packed K is Kp = G * Gp.
//   * int8 weights: a panel is Kp/4 "quads" of 256 bytes; byte (n*4 + kk) of quad q holds
//     u8 = w[64p+n][4q+kk] + 128 (unsigned, so activations can be the signed operand of vpdpbusd).
//   * int4 weights: a panel is Kp/8 "quad pairs" of 256 bytes; byte i holds code(quad 2q2, i) in the low
//     nibble and code(quad 2q2+1, i) in the high nibble (codes 0..15 unsigned).
//   * scales: float [P][G][64]; zeros (asymmetric int4 only): int32 [P][G][64]; otherwise a constant zero
//     point zconst (128 for int8, 8 for symmetric int4). Dense weight = (u - zero) * scale.
// Packed activations: tiles of MRA = 6 rows; tile t (at t * MRA * Kp) is Kp/4 quads of tile_rows(t, M) rows x 4
// bytes (int8 codes; the last tile holds only the rows left, no padding rows), plus asum [M][G] (sum of the codes
// of each group) and ascale [M] (per token) or [M][G] (per group).
// Result: y[m][n] = sum_g scale[n][g] * ascale * (sum_k a*u - zero*asum[m][g]), exact integer dot per group.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>

#include "common/convert.h"
#include "common/qweight_codes.h"

namespace hf_w4_int8 {

constexpr int NR = 64;
constexpr int MRA = 6;
// packed-K block of the weights that several row tiles share: int4 blocks are decoded into an L1 buffer; int8
// blocks are read in place, by default also from L1 (T::kKcInt8 sets a kernel's own size)
constexpr int64_t KC = 512;

enum Isa : int { ISA_GENERIC = 0, ISA_AVX2 = 1, ISA_AVXVNNI = 2, ISA_AVX512 = 3 };
enum OutType : int { OUT_F32 = 0, OUT_BF16 = 1, OUT_F16 = 2 };
enum WType : int { W_INT8 = 0, W_INT4 = 1 };

// The kernel variants; the ISA level (common/cpu_features.h) picks one: avx512 -> ISA_AVX512, avx2 -> ISA_AVXVNNI
// where the CPU has AVX-VNNI, else ISA_AVX2 (vpdpbusd emulated), generic -> ISA_GENERIC.
const char* isa_name(int isa);

// rows held by activation tile t of an M-row call (its quad stride is 4 * that). A short last tile packs only its
// own rows: a decode call (M = 1) then reads K bytes of activations per panel rather than 6 K, which at K = 11008
// (66 KiB) did not stay in L1 next to the weight stream.
inline int64_t tile_rows(int64_t t, int64_t M) { return M - t * MRA < MRA ? M - t * MRA : MRA; }

// per-thread scratch (64-byte aligned, grows; slot 0..3)
void* thread_scratch(int slot, size_t bytes);

struct Geometry {
  int64_t N, K, Np, P, G, gs, Gp, Kp;
  int wtype;
};
Geometry make_geometry(int64_t n, int64_t k, int64_t group_size, int wtype);

// ---- repack (portable, per panel range; called in parallel)
// int8: w int8 [N][K] (element (n, k) at w[n*s0 + k*s1]); perm: int64 [K] or null (packed logical column j = perm[j])
void repack_int8_panels(const Geometry& g, const int8_t* w, int64_t s0, int64_t s1, const int64_t* perm,
                        uint8_t* out, int64_t p0, int64_t p1);
// int4: the checkpoint's int32 words (common/qweight_codes.h)
void repack_int4_panels(const Geometry& g, const hf_w4::QCodes& qc, const int64_t* perm, uint8_t* out, int64_t p0,
                        int64_t p1);
// int4 values -8..7 stored one per int8 (compressed-tensors W4A8) -> int4 panels with codes v + 8 (zero 8)
void repack_int4_from_int8(const Geometry& g, const int8_t* w, int64_t s0, int64_t s1, const int64_t* perm,
                           uint8_t* out, int64_t p0, int64_t p1);
// scales float [N][G] (row stride lds) -> [P][G][64]; zeros float [N][G] (or null) -> int32 [P][G][64]
void repack_scales(const Geometry& g, const float* s, int64_t lds, const float* z, int64_t ldz, float* s_out,
                   int32_t* z_out, int64_t p0, int64_t p1);

// ---- activation quantization
struct QuantArgs {
  const void* x; int in_type; int64_t ldx;   // [M][K] (in_type: OutType codes)
  int64_t M;
  const int64_t* perm;
  bool act_group;
  Geometry g;
  int8_t* A; int32_t* asum; float* ascale;
  bool rowmajor = false;  // AMX path: A in 16-row blocks of 16x64-byte tiles (AVX-512 quantizer only)
};
void quant_tiles(int isa, const QuantArgs& q, int64_t t0, int64_t t1);

// ---- gemm
struct Plan {
  Geometry g;
  const uint8_t* B; int64_t panel_bytes;
  const float* scales; const int32_t* zeros; int32_t zconst;
  int64_t M;
  const int8_t* A; const int32_t* asum; const float* ascale; bool act_group;
  void* out; int out_type; int64_t ldo;
  const float* bias;
  int64_t mchunk, nmchunks;
};
void gemm_items(int isa, const Plan& p, int64_t i0, int64_t i1);

// per-ISA entry points
void quant_tiles_generic(const QuantArgs& q, int64_t t0, int64_t t1);
void quant_tiles_avx512(const QuantArgs& q, int64_t t0, int64_t t1);
void quant_tiles_avx2(const QuantArgs& q, int64_t t0, int64_t t1);
void gemm_items_generic(const Plan& p, int64_t i0, int64_t i1);
void gemm_items_avx512(const Plan& p, int64_t i0, int64_t i1);
void gemm_items_avx2(const Plan& p, int64_t i0, int64_t i1, bool vnni);
// AMX-INT8 (Intel; only when cpu_caps().amx_int8): any weight type, groups of a multiple of 64 (Gp % 64 == 0), activations quantized with
// QuantArgs::rowmajor (16-row blocks of 16x64-byte tiles), row chunks (Plan::mchunk) a multiple of 16
void gemm_items_amx(const Plan& p, int64_t i0, int64_t i1);

// ---- per row tile arguments of a micro-kernel call
struct TileArgs {
  const int8_t* a;       // activation tile at row r0, packed k = 0
  int64_t qs;            // the tile's quad stride (bytes): 4 * its rows
  const uint8_t* b;      // weight block base (packed k = kb0)
  int64_t kb0;
  bool otf;              // b holds nibble pairs (int4, decoded on the fly) rather than u8 quads
  bool w4;               // the weights are 4-bit codes (0..15), whether packed in pairs or decoded
  int64_t s0, s1;        // packed-k range to process
  int64_t Gp, G;
  const float* scales;   // panel [G][64]
  const int32_t* zeros;  // panel [G][64] or null
  int32_t zconst;
  const int32_t* asum;   // row r0: asum[r*G + g]
  const float* ascale;   // row r0: ascale[r*G + g] when per group, else null
  float* cf;             // fp32 accumulators, rows r0.., stride 64
  int32_t* ci;           // int32 partial sums of a group split across blocks, rows r0.., stride 64
  int mr;
  bool stream;           // a single row tile: the weights stream from memory once (software prefetch)
  uint8_t* dec;          // otf: also store the decoded u8 quads here (the block's buffer for the other row tiles)
  const char* pf;        // this tile's share of the next weight block, prefetched into L2 while it computes
  int64_t pfn;           // (64-byte lines)
};

// scalar helpers shared by all paths
// compressed-tensors' rounding of one activation: round half to even (default FP environment), clamp to int8.
// The scalar tail of every ISA's activation quantizer uses this, so all paths round alike.
inline int8_t q8(float v, float s) {
  float r = std::nearbyint(v / s);
  r = r >= -128.f ? (r > 127.f ? 127.f : r) : -128.f;  // nan (a nan scale) -> -128, as vmaxps(nan, -128) gives
  return (int8_t)(int)r;
}

// |v| as the bits of a float: a maximum over these orders nan above inf above every finite value (vmaxps and fmax
// drop a nan)
inline uint32_t abs_bits(float v) {
  uint32_t u;
  __builtin_memcpy(&u, &v, 4);
  return u & 0x7fffffffu;
}

// the activation scale of a row (per token) or group from the abs_bits maximum of its values: max / 127.5 (1 for
// an all-zero one); nan where x holds inf / nan, so that the row's outputs are nan, as compressed-tensors' forward
// makes them (its scale is inf / nan there)
inline float act_scale(uint32_t amax_bits) {
  if (amax_bits >= 0x7f800000u) return NAN;
  float m;
  __builtin_memcpy(&m, &amax_bits, 4);
  const float s = m / 127.5f;
  return s == 0.f ? 1.f : s;
}

using hf_w4::bf16_bits_to_f32;
using hf_w4::f16_bits_to_f32;
using hf_w4::f32_to_bf16_bits;
using hf_w4::f32_to_f16_bits;

// The driver shared by all ISAs: T provides MR, tile(const TileArgs&), decode(src, dst, nq2),
// store_rows(...). Instantiated in each ISA's .cpp (the driver itself needs no special ISA).
template <class T>
void run_items(const Plan& p, int64_t i0, int64_t i1) {
  const Geometry& g = p.g;
  const int64_t Kp = g.Kp, Gp = g.Gp, G = g.G;
  for (int64_t item = i0; item < i1; ++item) {
    const int64_t mc = item / g.P, pn = item % g.P;
    const int64_t m0 = mc * p.mchunk, m1 = (m0 + p.mchunk < p.M) ? m0 + p.mchunk : p.M;
    const int64_t rows = m1 - m0, ntiles = (rows + MRA - 1) / MRA;
    const uint8_t* Bp = p.B + pn * p.panel_bytes;
    const float* Sp = p.scales + pn * G * NR;
    const int32_t* Zp = p.zeros ? p.zeros + pn * G * NR : nullptr;
    const bool single = ntiles == 1;
    const int64_t kc = single ? Kp : g.wtype == W_INT8 ? T::kKcInt8 : KC;
    float* Cf = (float*)thread_scratch(0, (size_t)ntiles * MRA * NR * 4);
    // int32 partials of a group split across K blocks (a group longer than a block, or one straddling a block
    // boundary when Gp does not divide KC, e.g. group 192)
    int32_t* Ci = (Kp > kc && kc % Gp != 0) ? (int32_t*)thread_scratch(1, (size_t)ntiles * MRA * NR * 4) : nullptr;
    const bool decode = g.wtype == W_INT4 && !single;
    uint8_t* dec = decode ? (uint8_t*)thread_scratch(2, (size_t)kc * NR) : nullptr;
    // Up to 8 row tiles (T::kFusedDecode) the first tile decodes the block on the fly and stores it for the others,
    // rather than a decode pass before the tiles: the decode's loads and stores then overlap that tile's dot
    // products (5-8 % faster up to 8 tiles, slower beyond).
    const bool fuse = decode && T::kFusedDecode && ntiles <= 8;
    const int64_t bpk = g.wtype == W_INT8 ? NR : NR / 2;  // weight bytes per packed k
    for (int64_t k0 = 0; k0 < Kp; k0 += kc) {
      const int64_t k1 = (k0 + kc < Kp) ? k0 + kc : Kp;
      // the weight block this thread reads next: the rest of the panel, or the next item's panel
      const char* nxt = nullptr;
      int64_t nlines = 0;
      if (k1 < Kp) {
        nxt = (const char*)Bp + k1 * bpk;
        nlines = ((k1 + kc < Kp ? kc : Kp - k1) * bpk) / 64;
      } else if (item + 1 < i1) {
        nxt = (const char*)p.B + ((item + 1) % g.P) * p.panel_bytes;
        nlines = ((kc < Kp ? kc : Kp) * bpk) / 64;
      }
      const uint8_t* Bb;
      bool otf = false;
      if (g.wtype == W_INT8) {
        Bb = Bp + k0 * NR;
      } else if (decode) {
        if (!fuse) T::decode(Bp + k0 * (NR / 2), dec, (k1 - k0) / 8);
        Bb = dec;
      } else {
        Bb = Bp + k0 * (NR / 2);
        otf = true;
      }
      for (int64_t t = 0; t < ntiles; ++t) {
        const int64_t tr = (rows - t * MRA < MRA) ? rows - t * MRA : MRA;
        const int8_t* At = p.A + (m0 / MRA + t) * MRA * Kp;
        for (int64_t r0 = 0; r0 < tr; r0 += T::MR) {
          TileArgs a;
          const int64_t m = m0 + t * MRA + r0;
          a.a = At + r0 * 4;
          a.qs = 4 * tr;
          a.b = Bb; a.kb0 = k0; a.otf = otf; a.w4 = g.wtype == W_INT4; a.s0 = k0; a.s1 = k1; a.Gp = Gp; a.G = G;
          a.dec = nullptr;
          if (fuse && t == 0 && r0 == 0) {  // the first tile decodes the block on the fly into the buffer
            a.b = Bp + k0 * (NR / 2);
            a.otf = true;
            a.dec = dec;
          }
          a.scales = Sp; a.zeros = Zp; a.zconst = p.zconst;
          a.asum = p.asum + m * G;
          a.ascale = p.act_group ? p.ascale + m * G : nullptr;
          a.cf = Cf + (t * MRA + r0) * NR;
          a.ci = Ci ? Ci + (t * MRA + r0) * NR : nullptr;
          a.mr = (int)((tr - r0 < T::MR) ? tr - r0 : T::MR);
          a.stream = single || (t == 0 && g.wtype == W_INT8);  // the first tile pulls the block from memory
          // with several row tiles each prefetches its share of the next block into L2, so the memory stream keeps
          // going while the tiles compute on this one (otherwise it waits for the next decode / first tile).
          // (W4A8: 5-10 % faster at M = 8-48; W8A8 level, its first tile streams the block)
          a.pfn = single ? 0 : (nlines * (t + 1)) / ntiles - (nlines * t) / ntiles;
          a.pf = a.pfn ? nxt + 64 * ((nlines * t) / ntiles) : nullptr;
          if (k1 == Kp && !single) {
            // the tile's output rows, written by store_rows after the last block: requested now, the lines
            // arrive while the tile computes rather than one cache miss per row at the store (M = 1024: ~1 %)
            const int64_t es = p.out_type == OUT_F32 ? 4 : 2;
            const int64_t nb = ((g.N - pn * NR < NR) ? g.N - pn * NR : NR) * es;
            for (int r = 0; r < a.mr; ++r) {
              const char* o = (const char*)p.out + ((m + r) * p.ldo + pn * NR) * es;
              for (int64_t b = 0; b < nb; b += 64) __builtin_prefetch(o + b, 1, 3);
            }
          }
          T::tile(a);
        }
      }
    }
    const int64_t ncols = (g.N - pn * NR < NR) ? g.N - pn * NR : NR;
    const int64_t es = p.out_type == OUT_F32 ? 4 : 2;
    T::store_rows(Cf, rows, (char*)p.out + (m0 * p.ldo + pn * NR) * es, p.ldo, p.out_type, ncols,
                  p.act_group ? nullptr : p.ascale + m0, p.bias ? p.bias + pn * NR : nullptr);
  }
}

}  // namespace hf_w4_int8
