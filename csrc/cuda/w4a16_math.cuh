// The arithmetic of the CUDA W4A16 kernels, shared by host and device (no torch, no CUDA headers needed):
// the packed weight layout and its inverse, the nibble -> fp16/bf16 bit tricks and the dequantization recipes.
// tests/kernels/cuda_host/w4a16_host.cpp compiles this header with g++ and checks it against hf_w4.layouts.dequantize.
//
// Packed weight: int32 [K/16][Npad/64][32 lanes][4 words]. For k16 step kt and 64-column tile nt, lane l
// (g = l/4, t = l%4) holds the mma.sync m16n8k16 B fragments of all eight n8 sub-tiles in one 16-byte load:
// word j covers sub-tiles 2j and 2j+1 (column nt*64 + 8*sub + g); nibble slot s = 4h + 2p + b of word j holds
// k = kt*16 + 2t + 8b + h of sub-tile 2j + p. So (word >> 4i) & 0x000f000f, i = 2p + b, puts the pair
// (k, k+1) of fragment register b into the two 16-bit halves, ready for the magic-number conversion.
// Scales / zero points: [G][Npad/64][8 g][8 sub-tiles], one 16-byte (8-byte) load per lane and group.
#pragma once
#include <cstdint>

#if defined(__CUDACC__)
#define HF_W4_HD __host__ __device__ __forceinline__
#else
#define HF_W4_HD inline
#endif

namespace hf_w4 {
namespace cuda {

enum WeightKind : int { kInt4Sym = 0, kInt4Asym = 1, kNvfp4 = 2 };

constexpr int kTileN = 64;  // columns per packed tile (8 mma n8 sub-tiles)
constexpr int kTileK = 16;  // k per packed step (one mma k16)

// ---- layout: forward map (slot -> element) and its inverse
HF_W4_HD int frag_n(int nt, int lane, int j, int slot) { return nt * 64 + 8 * (2 * j + ((slot & 3) >> 1)) + (lane >> 2); }
HF_W4_HD int frag_k(int kt, int lane, int slot) { return kt * 16 + 2 * (lane & 3) + 8 * (slot & 1) + (slot >> 2); }

struct FragPos {
  int64_t word;  // index into the int32 array
  int slot;      // nibble slot in that word
};
HF_W4_HD FragPos frag_pos(int n, int k, int ntiles) {
  const int nt = n >> 6, sub = (n & 63) >> 3, g = n & 7;
  const int kt = k >> 4, r = k & 15, b = r >> 3, t = (r & 7) >> 1, h = r & 1;
  const int lane = 4 * g + t;
  return FragPos{((int64_t)(kt * ntiles + nt) * 32 + lane) * 4 + (sub >> 1), 4 * h + 2 * (sub & 1) + b};
}
// position of (group, column n) in the scale / zero-point layout
HF_W4_HD int64_t group_pos(int grp, int n, int ntiles) {
  return ((int64_t)grp * ntiles + (n >> 6)) * 64 + (n & 7) * 8 + ((n & 63) >> 3);
}

// ---- bit tricks (two 16-bit lanes per uint32; the low half is the lower k)
constexpr uint32_t kF16Magic = 0x64006400u;   // half2(1024, 1024): 1024 + v for v in 0..1023 is exact
constexpr uint32_t kBF16Magic = 0x43004300u;  // bf16x2(128, 128): 128 + v for v in 0..127 is exact
constexpr uint32_t kE2M1Rescale = 0x74007400u;  // half2(2^14, 2^14)
constexpr uint32_t kE4M3Rescale = 0x5c00u;      // half(256)

// int4 codes of pair i (slots i, i+4) as (1024 + v) fp16 / (128 + v) bf16
HF_W4_HD uint32_t int4_pair_bits(uint32_t word, int i, bool bf16) {
  return ((word >> (4 * i)) & 0x000f000fu) | (bf16 ? kBF16Magic : kF16Magic);
}
// zero point z (integer 0..127) as the matching (1024 + z) / (128 + z), broadcast to both halves
HF_W4_HD uint32_t int4_zero_bits(uint32_t z, bool bf16) {
  const uint32_t b = (bf16 ? 0x4300u : 0x6400u) | z;
  return b | (b << 16);
}
// PRMT (__byte_perm): byte i of the result is byte sel[4i..4i+2] of the 8-byte pool (b:a); the host emulates it
HF_W4_HD uint32_t prmt(uint32_t a, uint32_t b, uint32_t sel) {
#if defined(__CUDA_ARCH__)
  return __byte_perm(a, b, sel);
#else
  const uint64_t pool = ((uint64_t)b << 32) | a;
  uint32_t r = 0;
  for (int i = 0; i < 4; ++i) r |= (uint32_t)((pool >> (8 * ((sel >> (4 * i)) & 7u))) & 0xffu) << (8 * i);
  return r;
#endif
}
// 16-bit value ``half`` (0 = low, 1 = high) of word, in both halves (one PRMT): a scale broadcast to a pair
HF_W4_HD uint32_t broadcast16(uint32_t word, int half) { return prmt(word, 0u, half ? 0x3232u : 0x1010u); }
// zero-point byte ``idx`` (0..3) of word as int4_zero_bits gives it (one PRMT: bytes z, 0x64 / 0x43, z, 0x64 / 0x43)
HF_W4_HD uint32_t int4_zero_pair(uint32_t word, int idx, bool bf16) {
  return prmt(word, bf16 ? 0x43u : 0x64u, 0x4040u | ((uint32_t)idx << 8) | (uint32_t)idx);
}
// E2M1 codes of pair i as fp16 with value * 2^-14 (exponent and mantissa moved into the fp16 fields; code 1 = 0.5
// lands on an fp16 subnormal, still exact)
HF_W4_HD uint32_t e2m1_pair_bits(uint32_t word, int i) {
  const uint32_t x = word >> (4 * i);
  return ((x & 0x00070007u) << 9) | ((x & 0x00080008u) << 12);
}
// E4M3 byte as fp16 with value * 2^-8 (same move; E4M3 subnormals become fp16 subnormals)
HF_W4_HD uint32_t e4m3_half_bits(uint32_t b) { return ((b & 0x7fu) << 7) | ((b & 0x80u) << 8); }

// ---- recipes. F16 does fp16x2 arithmetic on bit patterns, A the activation type's (fp16 or bf16); each
// operation rounds once to nearest even (device: __hsub2 / __hmul2; host: emulated).
// int4: (1024 + v) - (1024 + z) is exact, then one rounding in the multiply by the scale (already in A's type).
template <class A>
HF_W4_HD uint32_t int4_dequant(uint32_t word, int i, uint32_t zero2, uint32_t scale2) {
  return A::mul2(A::sub2(int4_pair_bits(word, i, A::kBF16), zero2), scale2);
}
// NVFP4 block scale byte -> fp16 pair (exact: E4M3 values are all fp16 numbers)
template <class F16>
HF_W4_HD uint32_t nvfp4_scale2(uint32_t b) {
  const uint32_t h = e4m3_half_bits(b);
  return F16::mul2(h | (h << 16), kE4M3Rescale | (kE4M3Rescale << 16));
}
// NVFP4 e2m1 * e4m3 in fp16 (exact: at most 6 significant bits, magnitudes 2^-10 .. 2688), then to A's type
// (exact for bf16 too). The global scale is applied later in fp32.
template <class F16, class A>
HF_W4_HD uint32_t nvfp4_dequant(uint32_t word, int i, uint32_t scale2_f16) {
  return A::from_f16x2(F16::mul2(F16::mul2(e2m1_pair_bits(word, i), kE2M1Rescale), scale2_f16));
}

// ---- work split (host)
// Work split of the fused kernel: a block computes BM = 16 * mt rows x 64 columns over steps_per_split k16 steps;
// grid (Npad/64, splits, mblocks). Where the tiles alone do not fill the GPU (``slots`` = SMs x resident blocks per
// SM), split-K multiplies the blocks up to at most one full wave (a partial second wave would cost a whole wave).
HF_W4_HD int plan_mt(int m) { return m <= 16 ? 1 : (m <= 32 ? 2 : 4); }

struct GemmPlan {
  int mt, bm, mblocks, ntiles, splits, steps_per_split;
  int64_t ws_floats;
  int counters;
};

inline GemmPlan plan_gemm(int m, int npad, int k, int slots) {
  GemmPlan p;
  p.mt = plan_mt(m);
  p.bm = 16 * p.mt;
  p.mblocks = (m + p.bm - 1) / p.bm;
  p.ntiles = npad / 64;
  const int ksteps = k / 16;
  const int blocks = p.ntiles * p.mblocks;
  int s = slots / blocks;
  const int max_s = ksteps / 8 > 1 ? ksteps / 8 : 1;  // at least 8 k16 steps (2 per warp) per split
  s = s < 1 ? 1 : (s > max_s ? max_s : s);
  p.steps_per_split = (ksteps + s - 1) / s;
  p.splits = p.steps_per_split ? (ksteps + p.steps_per_split - 1) / p.steps_per_split : 1;
  if (p.splits < 1) p.splits = 1;
  p.ws_floats = p.splits > 1 ? (int64_t)p.mblocks * p.ntiles * p.splits * p.bm * 64 : 0;
  p.counters = p.splits > 1 ? p.mblocks * p.ntiles : 0;
  return p;
}

// The k16 steps warp ``warp`` of split ``split`` runs: first, first + 4, ... (count of them), as the kernel does.
HF_W4_HD int warp_steps(int ksteps, int steps_per_split, int split, int warp, int* first) {
  const int kb = split * steps_per_split;
  const int ke = ksteps < kb + steps_per_split ? ksteps : kb + steps_per_split;
  *first = kb + warp;
  return *first < ke ? (ke - *first + 3) / 4 : 0;
}

}  // namespace cuda
}  // namespace hf_w4
