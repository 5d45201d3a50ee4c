// Host build of csrc/cuda/w4a16_math.cuh for tests/kernels/test_cuda_w4a16.py (g++ -shared, loaded with ctypes): runs the
// kernels' layout maps and dequantization recipes on the CPU, with fp16 / bf16 arithmetic emulated exactly as the
// GPU rounds it (each operation computed in fp32, where it is exact for these operands, then rounded to nearest
// even once). Also exports a float -> fp16 rounding for its own test against torch.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "w4a16_math.cuh"

using namespace hf_w4::cuda;

namespace {

// IEEE binary16 by hand (no _Float16: older compilers lack it)
float f16_to_float(uint32_t b) {
  const uint32_t e = (b >> 10) & 31u, m = b & 1023u;
  const float mag = e == 0 ? std::ldexp((float)m, -24) : (e == 31 ? (m ? NAN : INFINITY)
                                                                     : std::ldexp((float)(1024u + m), (int)e - 25));
  return (b & 0x8000u) ? -mag : mag;
}
uint32_t float_to_f16(float f) {  // nearest even
  uint32_t x;
  std::memcpy(&x, &f, 4);
  const uint32_t sign = (x >> 16) & 0x8000u, ax = x & 0x7fffffffu;
  if (ax > 0x7f800000u) return sign | 0x7e00u;  // NaN
  if (ax >= 0x47800000u) return sign | 0x7c00u;  // >= 65536: inf
  if (ax < 0x38800000u) {                        // below 2^-14: a multiple of 2^-24, rounded
    float a;
    std::memcpy(&a, &ax, 4);
    return sign | (uint32_t)std::nearbyint(a * 16777216.0f);
  }
  const uint32_t m = ax & 0x7fffffu, rem = m & 0x1fffu;
  uint32_t h = ((((ax >> 23) - 127u + 15u)) << 10) | (m >> 13);
  if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) ++h;  // a carry moves into the exponent (up to inf)
  return sign | h;
}
float bf16_to_float(uint32_t b) {
  const uint32_t u = (b & 0xffffu) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
uint32_t float_to_bf16(float f) {  // nearest even; finite inputs
  uint32_t u;
  std::memcpy(&u, &f, 4);
  u += 0x7fffu + ((u >> 16) & 1u);
  return u >> 16;
}

struct HostF16 {
  static constexpr bool kBF16 = false;
  static float get(uint32_t v, int h) { return f16_to_float(v >> (16 * h)); }
  static uint32_t make(float lo, float hi) { return float_to_f16(lo) | (float_to_f16(hi) << 16); }
  static uint32_t sub2(uint32_t a, uint32_t b) { return make(get(a, 0) - get(b, 0), get(a, 1) - get(b, 1)); }
  static uint32_t mul2(uint32_t a, uint32_t b) { return make(get(a, 0) * get(b, 0), get(a, 1) * get(b, 1)); }
  // a * b + c rounded once (the product and sum of the recipe's operands are exact in fp32)
  static uint32_t fma2(uint32_t a, uint32_t b, uint32_t c) {
    return make(get(a, 0) * get(b, 0) + get(c, 0), get(a, 1) * get(b, 1) + get(c, 1));
  }
};
struct HostBF16 {
  static constexpr bool kBF16 = true;
  static float get(uint32_t v, int h) { return bf16_to_float(v >> (16 * h)); }
  static uint32_t make(float lo, float hi) { return float_to_bf16(lo) | (float_to_bf16(hi) << 16); }
  static uint32_t sub2(uint32_t a, uint32_t b) { return make(get(a, 0) - get(b, 0), get(a, 1) - get(b, 1)); }
  static uint32_t mul2(uint32_t a, uint32_t b) { return make(get(a, 0) * get(b, 0), get(a, 1) * get(b, 1)); }
};

// The pair (b = fragment register) of sub-tile ``sub`` as the kernels compute it from one lane's 16 bytes
// (NVFP4: times 2^-8)
template <class A>
uint32_t pair(const uint32_t* w4, const void* scales, const uint8_t* zeros, int kind, int64_t goff, int sub, int b) {
  const uint32_t word = w4[sub >> 1];
  const int i = 2 * (sub & 1) + b;
  // the lane's 8 scales / 8 zero bytes as the device holds them in registers, picked as it picks them
  uint32_t sv[4], zv[2] = {0u, 0u};
  if (kind == kNvfp4) {
    uint32_t s8[2];
    std::memcpy(s8, static_cast<const uint8_t*>(scales) + goff, 8);
    for (int j = 0; j < 4; ++j) sv[j] = nvfp4_scale_pair<A>(s8[j >> 1], 2 * (j & 1));
  } else {
    std::memcpy(sv, static_cast<const uint16_t*>(scales) + goff, 16);
  }
  const uint32_t s2 = broadcast16(sv[sub >> 1], sub & 1);
  if (kind == kNvfp4) return nvfp4_dequant<A>(word, i, s2);
  if (kind == kInt4Asym) std::memcpy(zv, zeros + goff, 8);
  if (kind != kInt4Asym) return int4_sym_dequant<A>(word, i, s2);
  return int4_dequant<A>(word, i, int4_zero_pair(zv[sub >> 2], sub & 3, A::kBF16), s2);
}

template <class A>
void dequant(const uint32_t* q, const void* scales, const uint8_t* zeros, int n, int npad, int k, int gs, int kind,
             int apply_global, float gscale, uint16_t* out) {
  const int ntiles = npad / 64, ksteps = k / 16, groups = kind == kNvfp4 ? ksteps : k / gs;
  const float unscale = gscale * kNvfp4Unscale;
  for (int kt = 0; kt < ksteps; ++kt)
    for (int nt = 0; nt < ntiles; ++nt)
      for (int lane = 0; lane < 32; ++lane) {
        const uint32_t* w4 = q + tile_word(kt, nt, ksteps) + lane * 4;
        const int grp = kind == kNvfp4 ? kt : kt * 16 / gs;
        const int64_t goff = group_row(grp, nt, groups) + (lane >> 2) * 8;  // as the device reads it
        for (int sub = 0; sub < 8; ++sub)
          for (int b = 0; b < 2; ++b) {
            const int slot = 2 * (sub & 1) + b;  // the low half of the pair (h = 0)
            const int nn = frag_n(nt, lane, sub >> 1, slot), kk = frag_k(kt, lane, slot);
            if (nn >= n) continue;
            uint32_t v = pair<A>(w4, scales, zeros, kind, goff, sub, b);
            if (kind == kNvfp4 && apply_global)  // the dequantize kernel: * global * 2^8 in fp32, one rounding
              v = A::make(A::get(v, 0) * unscale, A::get(v, 1) * unscale);
            out[(int64_t)nn * k + kk] = (uint16_t)v;
            out[(int64_t)nn * k + kk + 1] = (uint16_t)(v >> 16);
          }
      }
}

}  // namespace

extern "C" {

// Forward map (frag_n / frag_k), inverse (frag_pos) and the scale positions (group_pos vs the device's per-lane
// load) agree and cover every element once; returns the number of violations.
int hf_w4_host_check_maps(int npad, int k) {
  const int ntiles = npad / 64, ksteps = k / 16;
  std::vector<int> seen((size_t)npad * k, 0);
  int bad = 0;
  for (int kt = 0; kt < k / 16; ++kt)
    for (int nt = 0; nt < ntiles; ++nt)
      for (int lane = 0; lane < 32; ++lane)
        for (int j = 0; j < 4; ++j)
          for (int slot = 0; slot < 8; ++slot) {
            const int n = frag_n(nt, lane, j, slot), kk = frag_k(kt, lane, slot);
            if (n < 0 || n >= npad || kk < 0 || kk >= k) { ++bad; continue; }
            seen[(size_t)n * k + kk]++;
            const FragPos p = frag_pos(n, kk, ksteps);
            // strips contiguous along K: tile (kt, nt) is the (nt * K/16 + kt)-th 512-byte block
            if (p.word != (((int64_t)nt * ksteps + kt) * 32 + lane) * 4 + j || p.slot != slot) ++bad;
            const int sub = 2 * j + ((slot & 3) >> 1);
            if (group_pos(kt, n, ksteps) != ((int64_t)nt * ksteps + kt) * 64 + (lane >> 2) * 8 + sub) ++bad;
          }
  for (int c : seen) bad += c != 1;
  return bad;
}

// The dense weight [N, K] as fp16 / bf16 bit patterns, computed the way the kernels compute it: the fused kernel's
// mma operands (apply_global = 0; NVFP4 without its global scale, times 2^-8) or the dequantize kernel's output.
void hf_w4_host_dequant(const uint32_t* q, const void* scales, const uint8_t* zeros, int n, int npad, int k, int gs,
                        int kind, int bf16, int apply_global, float gscale, uint16_t* out) {
  if (bf16) dequant<HostBF16>(q, scales, zeros, n, npad, k, gs, kind, apply_global, gscale, out);
  else dequant<HostF16>(q, scales, zeros, n, npad, k, gs, kind, apply_global, gscale, out);
}

// Single bit tricks, for the exhaustive tests: E2M1 code -> fp16 / bf16 bits (value * 2^-14 / 2^-126); E4M3 byte
// -> the fp16 / bf16 scale the kernels multiply by (value * 2^6 / 2^118); int4 code v with zero z -> (v - z) in
// fp16 / bf16 bits.
uint32_t hf_w4_host_e2m1(uint32_t code, int bf16) {
  return (bf16 ? e2m1_pair_bits<true>(code, 0) : e2m1_pair_bits<false>(code, 0)) & 0xffffu;
}
uint32_t hf_w4_host_e4m3(uint32_t byte, int bf16) {  // the byte as sub-tile 2 of 0..3, read back from the high half
  const uint32_t word = (byte << 24) | 0x003c96e1u;  // other bytes: noise
  return (bf16 ? nvfp4_scale_pair<HostBF16>(word, 2) : nvfp4_scale_pair<HostF16>(word, 2)) >> 16;
}
uint32_t hf_w4_host_int4(uint32_t v, uint32_t z, int bf16) {
  return (bf16 ? HostBF16::sub2(int4_pair_bits(v, 0, true), int4_zero_bits(z, true))
               : HostF16::sub2(int4_pair_bits(v, 0, false), int4_zero_bits(z, false))) & 0xffffu;
}
}

extern "C" {
// The fused kernel's work split for (M, Npad, K) with ``slots`` resident blocks: every k16 step is run by exactly one
// (split, warp, chunk) and the split count matches the grid (and the wgmma kernel's splits cover K in whole chunks);
// returns the violations, and the plan's splits in *splits.
int hf_w4_host_check_plan(int m, int npad, int k, int slots, int* splits) {
  const GemmPlan p = plan_gemm(m, npad, k, slots);
  *splits = p.splits;
  const int ksteps = k / 16;
  std::vector<int> seen(ksteps, 0);
  int bad = 0;
  for (int s = 0; s < p.splits; ++s)
    for (int w = 0; w < 4; ++w) {
      int first, end;
      const int cnt = warp_chunks(ksteps, p.steps_per_split, s, w, &first, &end);
      for (int i = 0; i < cnt; ++i)
        for (int j = 0; j < kChunk; ++j) {
          const int kt = first + 4 * kChunk * i + j;
          if (kt >= end) continue;
          if (kt < 0 || kt >= ksteps || kt >= (s + 1) * p.steps_per_split) ++bad;
          else seen[kt]++;
        }
    }
  for (int c : seen) bad += c != 1;
  bad += p.mblocks * p.bm < m || (p.mblocks - 1) * p.bm >= m;
  bad += p.splits > 1 && p.ws_floats != (int64_t)p.mblocks * p.ntiles * p.splits * p.bm * 64;
  bad += p.splits > 1 && (int64_t)p.splits * p.ntiles * p.mblocks > slots;  // never more than one wave from split-K
  // the wgmma kernel's: 4 column tiles per block, 128 rows, splits of whole 4-step chunks covering K
  const GemmPlan w = plan_gemm(m, npad, k, slots, 8, false, 0, 4, 4);
  bad += w.steps_per_split % 4 != 0 || (w.splits - 1) * w.steps_per_split >= ksteps ||
         w.splits * w.steps_per_split < ksteps;
  bad += w.splits > 1 && (int64_t)w.splits * ((w.ntiles + 3) / 4) * w.mblocks > slots;
  return bad;
}
}

extern "C" uint32_t hf_w4_host_f16_round(float f) { return float_to_f16(f); }

// int4_zero_pair (PRMT) against int4_zero_bits for every zero point 0..127 in each byte position; returns violations
extern "C" int hf_w4_host_check_zero_pair() {
  int bad = 0;
  for (int bf16 = 0; bf16 < 2; ++bf16)
    for (uint32_t z = 0; z < 128; ++z)
      for (int idx = 0; idx < 4; ++idx) {
        const uint32_t word = (0xa5c3e1f0u & ~(0xffu << (8 * idx))) | (z << (8 * idx));  // other bytes: noise
        bad += int4_zero_pair(word, idx, bf16) != int4_zero_bits(z, bf16);
      }
  return bad;
}
