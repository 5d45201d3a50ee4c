// hf_w4 W4A16: portable C++ parts (repack, reference-speed fused kernel, dequantize, epilogue).
// Compiled with the baseline flags only; no torch headers.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "common/qweight_codes.h"
#include "w4a16.h"
#include "w4a16_common.h"

namespace hf_w4 {

float fp8e4m3_to_f32(uint8_t b) {
  const int e = (b >> 3) & 15, m = b & 7;
  float v;
  if (e == 15 && m == 7) v = NAN;
  else if (e == 0) v = std::ldexp(static_cast<float>(m), -9);   // subnormal: m/8 * 2^-6
  else v = std::ldexp(1.0f + m / 8.0f, e - 7);
  return (b & 0x80) ? -v : v;
}

namespace {
struct Fp8Table {
  float t[256];
  Fp8Table() { for (int i = 0; i < 256; ++i) t[i] = fp8e4m3_to_f32(static_cast<uint8_t>(i)); }
};
const Fp8Table& fp8_table() { static const Fp8Table t; return t; }

void lut_for(int mode, float lut[16]) {
  for (int c = 0; c < 16; ++c) lut[c] = w4_code_value(mode, c);
}
}  // namespace

// ------------------------------------------------------------------------------------------------
// epilogue shared by every path: v[0..cnt) are fp32 results for row m, columns n0..n0+cnt
void w4a16_store_row(const W4Gemm& g, int64_t m, int64_t n0, const float* v, int64_t cnt) {
  if (n0 + cnt > g.N) cnt = g.N - n0;
  if (cnt <= 0) return;
  const float gs = g.gscale;
  float tmp[W4_NP];
  for (int64_t i = 0; i < cnt; ++i) tmp[i] = v[i] * gs + (g.bias ? g.bias[n0 + i] : 0.0f);
  const int64_t off = m * g.ldo + n0;
  if (g.out_dtype == DT_F32) {
    std::memcpy(static_cast<float*>(g.out) + off, tmp, cnt * sizeof(float));
  } else if (g.out_dtype == DT_BF16) {
    uint16_t* o = static_cast<uint16_t*>(g.out) + off;
    for (int64_t i = 0; i < cnt; ++i) o[i] = f32_to_bf16_bits(tmp[i]);
  } else {
    _Float16* o = static_cast<_Float16*>(g.out) + off;
    for (int64_t i = 0; i < cnt; ++i) o[i] = static_cast<_Float16>(tmp[i]);
  }
}

bool w4a16_quant_x16_generic(const void* x, int dtype, int64_t M, int64_t K, int64_t ag, int64_t l1max, int16_t* xq,
                             float* xs, int32_t* xd) {
  const int64_t nab = K / ag;
  auto at = [&](int64_t i) { return w4_elem_f32(x, dtype, i); };
  for (int64_t m = 0; m < M; ++m)
    for (int64_t b = 0; b < nab; ++b) {
      const int64_t i0 = m * K + b * ag;
      uint32_t mx = 0;  // magnitudes compare as integers
      float l1 = 0.0f;
      for (int64_t i = 0; i < ag; ++i) {
        const float v = at(i0 + i);
        uint32_t u;
        std::memcpy(&u, &v, 4);
        mx = std::max(mx, u & 0x7fffffffu);
        if (l1max > 0) l1 += std::fabs(v);
      }
      const int s = quant_x16_exponent(mx, l1, ag, l1max);
      if (s == INT32_MIN) return false;
      const float inv = std::ldexp(1.0f, -s);
      xs[m * nab + b] = std::ldexp(1.0f, s);
      int32_t sum = 0;
      for (int64_t i = 0; i < ag; ++i) {
        // round half to even through the 1.5 * 2^23 magic number (|v| < 2^15), saturated like vpmovsdw
        const float r = (at(i0 + i) * inv + 0x1.8p23f) - 0x1.8p23f;
        const int32_t d = std::min(32767, std::max(-32768, static_cast<int32_t>(r)));
        xq[i0 + i] = static_cast<int16_t>(d);
        sum += d;
      }
      xd[m * nab + b] = sum;
    }
  return true;
}

bool w4a16_is_awq_slots(const int slots[8]) {
  static const int kAwq[8] = {0, 4, 1, 5, 2, 6, 3, 7};
  for (int j = 0; j < 8; ++j)
    if (slots[j] != kAwq[j]) return false;
  return true;
}

// ------------------------------------------------------------------------------------------------
// repack: canonical QWeight pieces -> kernel layout, panels [p0, p1)
void w4a16_repack_panels(const W4Repack& r, int64_t p0, int64_t p1) {
  const int64_t K = r.K, N = r.N, G = r.G;
  const int64_t KS = K + 64;  // row stride of the unpacked codes; the pad avoids 4 KiB set aliasing
  const QCodes qc(r.codes, r.cs0, r.cs1, r.pack_k, r.slots);
  const bool fast = r.pack_k && !r.perm;
  std::vector<uint8_t> tmp(r.pack_k && r.perm ? static_cast<size_t>(W4_NP) * KS : 0);   // unpacked codes [32][KS]
  std::vector<uint8_t> row(r.perm ? K : 0);
  const uint8_t pad = r.mode == W4_SYM ? 8 : 0;  // padding columns: weight 0 (their scale is 0 too)
  for (int64_t p = p0; p < p1; ++p) {
    const int64_t nb = p * W4_NP;
    uint8_t* q = r.qpack + p * (K / 2) * W4_NP;
    if (fast) {
      // words of 8 consecutive k; gather a block of 16 words x 32 columns, then write 4 k-pairs per word
      uint32_t buf[W4_NP][16];
      for (int64_t w0 = 0; w0 < K / 8; w0 += 16) {
        const int nw = K / 8 - w0 < 16 ? static_cast<int>(K / 8 - w0) : 16;
        const int ncol = N - nb < W4_NP ? static_cast<int>(N - nb) : W4_NP;
        if (ncol < W4_NP)
          for (int c = ncol; c < W4_NP; ++c)
            for (int w = 0; w < nw; ++w) buf[c][w] = pad * 0x11111111u;
        if (r.cs0 <= r.cs1) {  // columns adjacent in memory (GPTQ [K/8, N] transposed view)
          for (int w = 0; w < nw; ++w) {
            const int32_t* src = r.codes + nb * r.cs0 + (w0 + w) * r.cs1;
            for (int c = 0; c < ncol; ++c) buf[c][w] = static_cast<uint32_t>(src[c * r.cs0]);
          }
        } else {
          for (int c = 0; c < ncol; ++c) {
            const int32_t* src = r.codes + (nb + c) * r.cs0 + w0 * r.cs1;
            for (int w = 0; w < nw; ++w) buf[c][w] = static_cast<uint32_t>(src[w * r.cs1]);
          }
        }
        if (!qc.in_order)
          for (int c = 0; c < ncol; ++c)
            for (int w = 0; w < nw; ++w) buf[c][w] = qc.canonical(buf[c][w]);
        for (int w = 0; w < nw; ++w) {
          // column c (low nibble) and c+16 (high nibble) of k-pair b: bytes lo[c].b (k even), hi[c].b (k odd)
          uint32_t lo[16], hi[16];
          for (int c = 0; c < 16; ++c) {
            const uint32_t v0 = buf[c][w], v1 = buf[c + 16][w];
            lo[c] = (v0 & 0x0F0F0F0Fu) | ((v1 & 0x0F0F0F0Fu) << 4);
            hi[c] = ((v0 >> 4) & 0x0F0F0F0Fu) | (v1 & 0xF0F0F0F0u);
          }
          uint16_t* o = reinterpret_cast<uint16_t*>(q + (w0 + w) * 4 * W4_NP);
          for (int b = 0; b < 4; ++b)
            for (int c = 0; c < 16; ++c)
              o[b * 16 + c] = static_cast<uint16_t>(((lo[c] >> (8 * b)) & 0xffu) | (((hi[c] >> (8 * b)) & 0xffu) << 8));
        }
      }
    } else if (!r.pack_k) {
      // packed along N: codes handled below, four panels (one 64-byte line of each k-row) per pass
    } else {
      // packed along K with an act-order permutation: unpack each column, gather, interleave
      std::memset(tmp.data(), pad, tmp.size());
      for (int c = 0; c < W4_NP && nb + c < N; ++c) {
        for (int64_t w = 0; w < K / 8; ++w) {
          const uint32_t v = qc.canonical(qc.word(nb + c, 8 * w));
          for (int j = 0; j < 8; ++j) row[8 * w + j] = (v >> (4 * j)) & 15;
        }
        uint8_t* t = tmp.data() + c * KS;
        for (int64_t k = 0; k < K; ++k) t[k] = row[r.perm[k]];
      }
      for (int64_t j = 0; j < K / 2; ++j) {
        uint8_t* o = q + j * W4_NP;
        for (int i = 0; i < W4_NP; ++i) {
          const int64_t k = 2 * j + (i & 1);
          o[i] = static_cast<uint8_t>(tmp[(i >> 1) * KS + k] | (tmp[(16 + (i >> 1)) * KS + k] << 4));
        }
      }
    }
    // scales / zero*scale: [G][32]
    for (int64_t gi = 0; gi < G; ++gi) {
      for (int c = 0; c < W4_NP; ++c) {
        const int64_t n = nb + c;
        const int64_t o = (p * G + gi) * W4_NP + c;
        if (r.mode == W4_NVFP4) {
          static_cast<uint8_t*>(r.out_scales)[o] = n < N ? r.scales8[n * G + gi] : 0;
        } else {
          const float s = n < N ? r.scales[n * G + gi] : 0.0f;
          static_cast<float*>(r.out_scales)[o] = s;
          if (r.out_zs) r.out_zs[o] = n < N ? r.zeros[n * G + gi] * s : 0.0f;
        }
      }
    }
  }
  if (!r.pack_k) {
      // [N/8, K] words; word (rw, k) holds columns 8rw..8rw+7 (AWQ: transposed view)
      // AWQ nibble order: slots hold columns [0,2,4,6,1,3,5,7] -> even columns in bits 0..15, odd in 16..31
      static const int kAwq[8] = {0, 4, 1, 5, 2, 6, 3, 7};
      bool awq = true;
      for (int j = 0; j < 8; ++j) awq = awq && r.slots[j] == kAwq[j];
      auto spread4 = [](uint32_t v) -> uint32_t {  // nibble i of a 16-bit value -> nibble 2i
        v = (v | (v << 8)) & 0x00FF00FFu;
        return (v | (v << 4)) & 0x0F0F0F0Fu;
      };
      auto word = [&](int64_t rw0, int64_t nrw, int64_t rr, int64_t k) -> uint32_t {
        if (rr >= nrw) return pad * 0x11111111u;
        const uint32_t v = qc.word(8 * (rw0 + rr), r.perm ? r.perm[k] : k);
        if (awq) return spread4(v & 0xFFFFu) | (spread4(v >> 16) << 4);
        return qc.canonical(v);
      };
      auto spread8 = [](uint32_t z) -> uint64_t {  // byte i -> byte 2i
        uint64_t v = z;
        v = (v | (v << 16)) & 0x0000FFFF0000FFFFull;
        return (v | (v << 8)) & 0x00FF00FF00FF00FFull;
      };
      auto nib2bytes = [](uint32_t x, uint32_t y) -> uint64_t {  // byte i = nib_i(x) | nib_i(y) << 4
        auto sp = [](uint32_t w) -> uint64_t {
          uint64_t v = w;
          v = (v | (v << 16)) & 0x0000FFFF0000FFFFull;
          v = (v | (v << 8)) & 0x00FF00FF00FF00FFull;
          return (v | (v << 4)) & 0x0F0F0F0F0F0F0F0Full;
        };
        return sp(x) | (sp(y) << 4);
      };
      for (int64_t pg = p0 > r.pack_n_from ? p0 : r.pack_n_from; pg < p1; pg += 4) {
        const int64_t pe = pg + 4 < p1 ? pg + 4 : p1;
        for (int64_t j = 0; j < K / 2; ++j) {
          for (int64_t p = pg; p < pe; ++p) {
            const int64_t nb = p * W4_NP, rw0 = nb / 8, nrw = (N - nb) / 8 < 4 ? (N - nb) / 8 : 4;
            uint8_t* o = r.qpack + p * (K / 2) * W4_NP + j * W4_NP;
            for (int rr = 0; rr < 2; ++rr) {
              const uint64_t a = nib2bytes(word(rw0, nrw, rr, 2 * j), word(rw0, nrw, rr + 2, 2 * j));          // k even
              const uint64_t b = nib2bytes(word(rw0, nrw, rr, 2 * j + 1), word(rw0, nrw, rr + 2, 2 * j + 1));  // k odd
              const uint64_t lo = spread8(static_cast<uint32_t>(a)) | (spread8(static_cast<uint32_t>(b)) << 8);
              const uint64_t hi = spread8(static_cast<uint32_t>(a >> 32)) | (spread8(static_cast<uint32_t>(b >> 32)) << 8);
              std::memcpy(o + 16 * rr, &lo, 8);   // little-endian byte order
              std::memcpy(o + 16 * rr + 8, &hi, 8);
            }
          }
        }
      }
  }
}

void w4a16_nvfp4_positive_scales(const W4Repack& r, int64_t p0, int64_t p1) {
  const int64_t K = r.K, G = r.G;
  for (int64_t p = p0; p < p1; ++p) {
    uint8_t* sc = static_cast<uint8_t*>(r.out_scales) + p * G * W4_NP;
    uint8_t* q = r.qpack + p * (K / 2) * W4_NP;
    for (int64_t gi = 0; gi < G; ++gi)
      for (int c = 0; c < W4_NP; ++c) {
        uint8_t& s = sc[gi * W4_NP + c];
        if (!(s & 0x80)) continue;
        s &= 0x7f;
        // column c: byte 2(c % 16) + parity of each k-pair row, low nibble for c < 16, else high
        const uint8_t flip = c < 16 ? 0x08 : 0x80;
        const int i = 2 * (c % 16);
        for (int64_t j = gi * 8; j < gi * 8 + 8; ++j) {
          q[j * W4_NP + i] ^= flip;
          q[j * W4_NP + i + 1] ^= flip;
        }
      }
  }
}

// ------------------------------------------------------------------------------------------------
// portable fused kernel (fp32 activations)
void w4a16_fused_generic(const W4Gemm& g, const float* x, int64_t M, const float* xsum, int64_t p0, int64_t p1) {
  const int64_t K = g.K, G = g.G, gs = g.gs;
  float lut[16];
  lut_for(g.mode, lut);
  const float* f8 = fp8_table().t;
  std::vector<float> acc(M * W4_NP), part(M * W4_NP);
  for (int64_t p = p0; p < p1; ++p) {
    const uint8_t* q = g.qpack + p * (K / 2) * W4_NP;
    std::fill(acc.begin(), acc.end(), 0.0f);
    for (int64_t gi = 0; gi < G; ++gi) {
      std::fill(part.begin(), part.end(), 0.0f);
      for (int64_t j = gi * gs / 2; j < (gi + 1) * gs / 2; ++j) {
        float w0[W4_NP], w1[W4_NP];  // w0: k = 2j, w1: k = 2j+1, by column
        const uint8_t* b = q + j * W4_NP;
        for (int c = 0; c < 16; ++c) {
          w0[c] = lut[b[2 * c] & 15];      w1[c] = lut[b[2 * c + 1] & 15];
          w0[16 + c] = lut[b[2 * c] >> 4]; w1[16 + c] = lut[b[2 * c + 1] >> 4];
        }
        for (int64_t m = 0; m < M; ++m) {
          const float x0 = x[m * K + 2 * j], x1 = x[m * K + 2 * j + 1];
          float* pp = &part[m * W4_NP];
          for (int c = 0; c < W4_NP; ++c) pp[c] += x0 * w0[c] + x1 * w1[c];
        }
      }
      const int64_t so = (p * G + gi) * W4_NP;
      float s[W4_NP];
      for (int c = 0; c < W4_NP; ++c)
        s[c] = g.mode == W4_NVFP4 ? f8[static_cast<const uint8_t*>(g.scales)[so + c]]
                                  : static_cast<const float*>(g.scales)[so + c];
      for (int64_t m = 0; m < M; ++m) {
        float* a = &acc[m * W4_NP];
        const float* pp = &part[m * W4_NP];
        for (int c = 0; c < W4_NP; ++c) a[c] += s[c] * pp[c];
        if (g.mode == W4_ASYM) {
          const float xs = xsum[m * G + gi];
          for (int c = 0; c < W4_NP; ++c) a[c] -= g.zs[so + c] * xs;
        }
      }
    }
    for (int64_t m = 0; m < M; ++m) w4a16_store_row(g, m, p * W4_NP, &acc[m * W4_NP], W4_NP);
  }
}

// ------------------------------------------------------------------------------------------------
void w4a16_dequant_generic(const W4Gemm& g, void* dst, int dst_dtype, int64_t ldd, int64_t p0, int64_t p1) {
  const int64_t K = g.K, G = g.G, gs = g.gs;
  float lut[16];
  lut_for(g.mode, lut);
  const float* f8 = fp8_table().t;
  // one k-row of a panel's (up to) 32 columns at a time: the transposed destination is written contiguously
  // (writing it column by column touched a new cache line per element: ~15x slower)
  for (int64_t p = p0; p < p1; ++p) {
    const uint8_t* q = g.qpack + p * (K / 2) * W4_NP;
    const int64_t ncol = std::min<int64_t>(W4_NP, g.N - p * W4_NP);
    const int64_t dcol = (p - p0) * W4_NP;
    for (int64_t gi = 0; gi < G; ++gi) {
      float s[W4_NP], z[W4_NP];
      for (int c = 0; c < W4_NP; ++c) {
        const int64_t so = (p * G + gi) * W4_NP + c;
        s[c] = (g.mode == W4_NVFP4 ? f8[static_cast<const uint8_t*>(g.scales)[so]]
                                   : static_cast<const float*>(g.scales)[so]) * g.gscale;
        z[c] = g.mode == W4_ASYM ? g.zs[so] * g.gscale : 0.0f;
      }
      for (int64_t k = gi * gs; k < (gi + 1) * gs; ++k) {
        const uint8_t* row = q + (k >> 1) * W4_NP + (k & 1);
        float v[W4_NP];
        for (int c = 0; c < W4_NP; ++c) {
          const uint8_t b = row[2 * (c & 15)];
          v[c] = lut[c < 16 ? (b & 15) : (b >> 4)] * s[c] - z[c];
        }
        if (dst_dtype == DT_F32) {
          std::memcpy(static_cast<float*>(dst) + k * ldd + dcol, v, ncol * sizeof(float));
        } else {
          uint16_t* o = static_cast<uint16_t*>(dst) + k * ldd + dcol;
          for (int64_t c = 0; c < ncol; ++c) o[c] = f32_to_bf16_bits(v[c]);
        }
      }
    }
  }
}

}  // namespace hf_w4
