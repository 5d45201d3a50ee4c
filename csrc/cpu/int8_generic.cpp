// hf_w4 int8 kernel: repacking and the portable C++ path (always compiled and tested).
// No torch headers.
#include <cfloat>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <memory>

#include "common/aligned_buf.h"
#include "int8_gemm.h"

namespace hf_w4_int8 {

// ------------------------------------------------------------------------------------------------
// ISA (detection and HF_W4_ISA: common/cpu_features.h)

const char* isa_name(int isa) {
  switch (isa) {
    case ISA_GENERIC: return "generic";
    case ISA_AVX2: return "avx2";
    case ISA_AVXVNNI: return "avxvnni";
    case ISA_AVX512: return "avx512";
  }
  return "?";
}

// ------------------------------------------------------------------------------------------------
// scratch

namespace {
thread_local hf_w4::AlignedBuf<unsigned char> tls_scratch[4];
}  // namespace

void* thread_scratch(int slot, size_t bytes) { return tls_scratch[slot].get(bytes); }

// ------------------------------------------------------------------------------------------------
// geometry + repack

Geometry make_geometry(int64_t n, int64_t k, int64_t group_size, int wtype) {
  Geometry g;
  g.N = n; g.K = k; g.wtype = wtype;
  g.gs = group_size <= 0 ? k : group_size;
  g.G = k / g.gs;
  g.Gp = (g.gs + 7) / 8 * 8;
  g.Kp = g.G * g.Gp;
  g.P = (n + NR - 1) / NR;
  g.Np = g.P * NR;
  return g;
}

static inline int64_t logical_col(const Geometry& g, int64_t kp) {  // packed k -> position in permuted K, or -1 (pad)
  const int64_t grp = kp / g.Gp, j = kp % g.Gp;
  return j < g.gs ? grp * g.gs + j : -1;
}

void repack_int8_panels(const Geometry& g, const int8_t* w, int64_t s0, int64_t s1, const int64_t* perm,
                        uint8_t* out, int64_t p0, int64_t p1) {
  const int64_t nq = g.Kp / 4;
  // column map of packed k (original column index, or -1)
  std::unique_ptr<int64_t[]> col(new int64_t[g.Kp]);
  for (int64_t kp = 0; kp < g.Kp; ++kp) {
    int64_t j = logical_col(g, kp);
    col[kp] = j < 0 ? -1 : (perm ? perm[j] : j);
  }
  for (int64_t p = p0; p < p1; ++p) {
    uint8_t* o = out + p * nq * 256;
    for (int64_t nl = 0; nl < NR; ++nl) {
      const int64_t n = p * NR + nl;
      const int8_t* wr = n < g.N ? w + n * s0 : nullptr;
      for (int64_t q = 0; q < nq; ++q) {
        uint8_t* ob = o + q * 256 + nl * 4;
        for (int kk = 0; kk < 4; ++kk) {
          const int64_t c = col[q * 4 + kk];
          const int v = (wr && c >= 0) ? wr[c * s1] : 0;
          ob[kk] = (uint8_t)(v + 128);
        }
      }
    }
  }
}

void repack_int4_panels(const Geometry& g, const hf_w4::QCodes& qc, const int64_t* perm, uint8_t* out, int64_t p0,
                        int64_t p1) {
  const int64_t nq2 = g.Kp / 8;
  std::unique_ptr<int64_t[]> col(new int64_t[g.Kp]);
  bool identity = true;
  for (int64_t kp = 0; kp < g.Kp; ++kp) {
    int64_t j = logical_col(g, kp);
    col[kp] = j < 0 ? -1 : (perm ? perm[j] : j);
    if (col[kp] != kp) identity = false;
  }
  for (int64_t p = p0; p < p1; ++p) {
    uint8_t* o = out + p * nq2 * 256;
    for (int64_t nl = 0; nl < NR; ++nl) {
      const int64_t n = p * NR + nl;
      if (n >= g.N) {
        for (int64_t q2 = 0; q2 < nq2; ++q2) std::memset(o + q2 * 256 + nl * 4, 0, 4);
        continue;
      }
      if (qc.pack_k && identity) {
        // fast path: word q2 of row n holds k = 8q2..8q2+7 = exactly quad pair q2
        for (int64_t q2 = 0; q2 < nq2; ++q2) {
          const uint32_t wd = qc.canonical(qc.word(n, 8 * q2));
          uint8_t* ob = o + q2 * 256 + nl * 4;
          for (int kk = 0; kk < 4; ++kk) ob[kk] = (uint8_t)(((wd >> (4 * kk)) & 15u) | (((wd >> (16 + 4 * kk)) & 15u) << 4));
        }
        continue;
      }
      for (int64_t q2 = 0; q2 < nq2; ++q2) {
        uint8_t* ob = o + q2 * 256 + nl * 4;
        for (int kk = 0; kk < 4; ++kk) {
          const int64_t c0 = col[q2 * 8 + kk], c1 = col[q2 * 8 + 4 + kk];
          const uint32_t v0 = c0 < 0 ? 0 : qc.at(n, c0), v1 = c1 < 0 ? 0 : qc.at(n, c1);
          ob[kk] = (uint8_t)(v0 | (v1 << 4));
        }
      }
    }
  }
}

void repack_int4_from_int8(const Geometry& g, const int8_t* w, int64_t s0, int64_t s1, const int64_t* perm,
                           uint8_t* out, int64_t p0, int64_t p1) {
  const int64_t nq2 = g.Kp / 8;
  std::unique_ptr<int64_t[]> col(new int64_t[g.Kp]);
  for (int64_t kp = 0; kp < g.Kp; ++kp) {
    int64_t j = logical_col(g, kp);
    col[kp] = j < 0 ? -1 : (perm ? perm[j] : j);
  }
  for (int64_t p = p0; p < p1; ++p) {
    uint8_t* o = out + p * nq2 * 256;
    for (int64_t nl = 0; nl < NR; ++nl) {
      const int64_t n = p * NR + nl;
      const int8_t* wr = n < g.N ? w + n * s0 : nullptr;
      for (int64_t q2 = 0; q2 < nq2; ++q2) {
        uint8_t* ob = o + q2 * 256 + nl * 4;
        for (int kk = 0; kk < 4; ++kk) {
          const int64_t c0 = col[q2 * 8 + kk], c1 = col[q2 * 8 + 4 + kk];
          const int v0 = (wr && c0 >= 0) ? wr[c0 * s1] + 8 : 8, v1 = (wr && c1 >= 0) ? wr[c1 * s1] + 8 : 8;
          ob[kk] = (uint8_t)((v0 & 15) | ((v1 & 15) << 4));
        }
      }
    }
  }
}

void repack_scales(const Geometry& g, const float* s, int64_t lds, const float* z, int64_t ldz, float* s_out,
                   int32_t* z_out, int64_t p0, int64_t p1) {
  for (int64_t p = p0; p < p1; ++p)
    for (int64_t gi = 0; gi < g.G; ++gi)
      for (int64_t nl = 0; nl < NR; ++nl) {
        const int64_t n = p * NR + nl;
        const int64_t o = (p * g.G + gi) * NR + nl;
        s_out[o] = n < g.N ? s[n * lds + gi] : 0.f;
        if (z_out) z_out[o] = n < g.N ? (int32_t)std::lrint(z[n * ldz + gi]) : 0;
      }
}

// ------------------------------------------------------------------------------------------------
// activation quantization (portable)

static inline float load_x(const void* x, int t, int64_t i) {
  if (t == OUT_F32) return ((const float*)x)[i];
  if (t == OUT_BF16) return bf16_bits_to_f32(((const uint16_t*)x)[i]);
  return f16_bits_to_f32(((const uint16_t*)x)[i]);
}

void quant_tiles_generic(const QuantArgs& q, int64_t t0, int64_t t1) {
  const Geometry& g = q.g;
  float* buf = (float*)thread_scratch(3, (size_t)g.K * 4);
  for (int64_t t = t0; t < t1; ++t) {
    int8_t* At = q.A + t * MRA * g.Kp;
    for (int r = 0; r < MRA; ++r) {
      const int64_t m = t * MRA + r;
      if (m >= q.M) break;
      const int64_t QS = 4 * tile_rows(t, q.M);
      const char* xr = (const char*)q.x + m * q.ldx * (q.in_type == OUT_F32 ? 4 : 2);
      for (int64_t j = 0; j < g.K; ++j) buf[j] = load_x(xr, q.in_type, q.perm ? q.perm[j] : j);
      float s_tok = 0.f;
      if (!q.act_group) {
        uint32_t mx = 0;
        for (int64_t j = 0; j < g.K; ++j) mx = std::max(mx, abs_bits(buf[j]));
        s_tok = act_scale(mx);
        q.ascale[m] = s_tok;
      }
      for (int64_t gi = 0; gi < g.G; ++gi) {
        const float* xg = buf + gi * g.gs;
        float s = s_tok;
        if (q.act_group) {
          uint32_t mx = 0;
          for (int64_t j = 0; j < g.gs; ++j) mx = std::max(mx, abs_bits(xg[j]));
          s = act_scale(mx);
          q.ascale[m * g.G + gi] = s;
        }
        int32_t sum = 0;
        for (int64_t j = 0; j < g.Gp; ++j) {
          const int64_t kp = gi * g.Gp + j;
          const int8_t v = j < g.gs ? q8(xg[j], s) : 0;
          sum += v;
          At[(kp / 4) * QS + r * 4 + kp % 4] = v;
        }
        q.asum[m * g.G + gi] = sum;
      }
    }
  }
}

// ------------------------------------------------------------------------------------------------
// portable gemm path

namespace {
struct GenericT {
  static constexpr int MR = MRA;
  static constexpr bool kFusedDecode = false;
  static constexpr int64_t kKcInt8 = KC;
  static void tile(const TileArgs& a) {
    int32_t acc[MRA][NR];
    const int64_t Gp = a.Gp;
    for (int64_t g = a.s0 / Gp; g * Gp < a.s1; ++g) {
      const int64_t gs0 = g * Gp > a.s0 ? g * Gp : a.s0;
      const int64_t gs1 = (g + 1) * Gp < a.s1 ? (g + 1) * Gp : a.s1;
      const bool load_ci = gs0 % Gp != 0, store_ci = gs1 % Gp != 0;
      for (int r = 0; r < a.mr; ++r)
        for (int n = 0; n < NR; ++n) acc[r][n] = load_ci ? a.ci[r * NR + n] : 0;
      for (int64_t kp = gs0; kp < gs1; kp += 4) {
        const int64_t qd = kp / 4;
        const int8_t* aq = a.a + qd * a.qs;
        for (int n = 0; n < NR; ++n) {
          uint8_t u[4];
          if (a.otf) {
            const int64_t rel = kp - a.kb0;  // multiple of 4
            const uint8_t* bb = a.b + (rel / 8) * 256 + n * 4;
            const int hi = (rel / 4) & 1;
            for (int kk = 0; kk < 4; ++kk) u[kk] = hi ? (bb[kk] >> 4) : (bb[kk] & 15);
          } else {
            const uint8_t* bb = a.b + ((kp - a.kb0) / 4) * 256 + n * 4;
            for (int kk = 0; kk < 4; ++kk) u[kk] = bb[kk];
          }
          for (int r = 0; r < a.mr; ++r) {
            const int8_t* ar = aq + r * 4;
            acc[r][n] += (int32_t)u[0] * ar[0] + (int32_t)u[1] * ar[1] + (int32_t)u[2] * ar[2] +
                         (int32_t)u[3] * ar[3];
          }
        }
      }
      if (store_ci) {
        for (int r = 0; r < a.mr; ++r)
          for (int n = 0; n < NR; ++n) a.ci[r * NR + n] = acc[r][n];
        continue;
      }
      const float* sc = a.scales + g * NR;
      const int32_t* zp = a.zeros ? a.zeros + g * NR : nullptr;
      for (int r = 0; r < a.mr; ++r) {
        const int32_t as = a.asum[r * a.G + g];
        const float sx = a.ascale ? a.ascale[r * a.G + g] : 1.f;
        float* c = a.cf + r * NR;
        for (int n = 0; n < NR; ++n) {
          const int32_t z = zp ? zp[n] : a.zconst;
          const float v = (float)(acc[r][n] - z * as);
          const float sv = a.ascale ? sc[n] * sx : sc[n];
          c[n] = (g == 0) ? v * sv : std::fma(v, sv, c[n]);
        }
      }
    }
  }
  static void decode(const uint8_t* src, uint8_t* dst, int64_t nq2) {
    for (int64_t q2 = 0; q2 < nq2; ++q2)
      for (int i = 0; i < 256; ++i) {
        dst[q2 * 512 + i] = src[q2 * 256 + i] & 15;
        dst[q2 * 512 + 256 + i] = src[q2 * 256 + i] >> 4;
      }
  }
  static void store_rows(const float* cf, int64_t rows, char* out, int64_t ldo, int ot, int64_t ncols,
                         const float* afinal, const float* bias) {
    for (int64_t r = 0; r < rows; ++r) {
      const float sx = afinal ? afinal[r] : 1.f;
      for (int64_t n = 0; n < ncols; ++n) {
        float v = cf[r * NR + n] * sx;
        if (bias) v += bias[n];
        if (ot == OUT_F32) ((float*)out)[r * ldo + n] = v;
        else if (ot == OUT_BF16) ((uint16_t*)out)[r * ldo + n] = f32_to_bf16_bits(v);
        else ((uint16_t*)out)[r * ldo + n] = f32_to_f16_bits(v);
      }
    }
  }
};
}  // namespace

void gemm_items_generic(const Plan& p, int64_t i0, int64_t i1) { run_items<GenericT>(p, i0, i1); }

void quant_tiles(int isa, const QuantArgs& q, int64_t t0, int64_t t1) {
  switch (isa) {
    case ISA_AVX512: quant_tiles_avx512(q, t0, t1); return;
    case ISA_AVX2:
    case ISA_AVXVNNI: quant_tiles_avx2(q, t0, t1); return;
    default: quant_tiles_generic(q, t0, t1);
  }
}

void gemm_items(int isa, const Plan& p, int64_t i0, int64_t i1) {
  switch (isa) {
    case ISA_AVX512: gemm_items_avx512(p, i0, i1); return;
    case ISA_AVXVNNI: gemm_items_avx2(p, i0, i1, true); return;
    case ISA_AVX2: gemm_items_avx2(p, i0, i1, false); return;
    default: gemm_items_generic(p, i0, i1);
  }
}

}  // namespace hf_w4_int8
