// The arithmetic of the CUDA W4A16 kernels, shared by host and device (no torch, no CUDA headers needed):
// the packed weight layout and its inverse, the nibble -> fp16/bf16 bit tricks and the dequantization recipes.
// tests/kernels/cuda_host/w4a16_host.cpp compiles this header with g++ and checks it against hf_w4.layouts.dequantize.
//
// Packed weight: int32 [Npad/64][K/16][32 lanes][4 words]: each 64-column strip is contiguous along K, so a block
// streaming one strip (or one k-range of it under split-K) reads long runs of DRAM pages. For k16 step kt and
// 64-column tile nt, lane l (g = l/4, t = l%4) holds the mma.sync m16n8k16 B fragments of all eight n8 sub-tiles
// in one 16-byte load: word j covers sub-tiles 2j and 2j+1 (column nt*64 + 8*sub + g); nibble slot s = 4h + 2p + b
// of word j holds k = kt*16 + 2t + 8b + h of sub-tile 2j + p. So (word >> 4i) & 0x000f000f, i = 2p + b, puts the
// pair (k, k+1) of fragment register b into the two 16-bit halves, ready for the magic-number conversion.
// Scales / zero points: [Npad/64][G][8 g][8 sub-tiles] (NVFP4: G = K/16), one 16-byte (8-byte) read per lane and
// group.
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
// first int32 of lane 0's 16 bytes for (k16 step kt, tile nt); K/16 = ksteps
HF_W4_HD int64_t tile_word(int kt, int nt, int ksteps) { return ((int64_t)nt * ksteps + kt) * 128; }
HF_W4_HD FragPos frag_pos(int n, int k, int ksteps) {
  const int nt = n >> 6, sub = (n & 63) >> 3, g = n & 7;
  const int kt = k >> 4, r = k & 15, b = r >> 3, t = (r & 7) >> 1, h = r & 1;
  const int lane = 4 * g + t;
  return FragPos{tile_word(kt, nt, ksteps) + lane * 4 + (sub >> 1), 4 * h + 2 * (sub & 1) + b};
}
// first element of the 64 values of (group, tile nt) in the scale / zero-point layout (groups = G)
HF_W4_HD int64_t group_row(int grp, int nt, int groups) { return ((int64_t)nt * groups + grp) * 64; }
// position of (group, column n) in the scale / zero-point layout
HF_W4_HD int64_t group_pos(int grp, int n, int groups) {
  return group_row(grp, n >> 6, groups) + (n & 7) * 8 + ((n & 63) >> 3);
}

// ---- bit tricks (two 16-bit lanes per uint32; the low half is the lower k)
constexpr uint32_t kF16Magic = 0x64006400u;   // half2(1024, 1024): 1024 + v for v in 0..1023 is exact
constexpr uint32_t kBF16Magic = 0x43004300u;  // bf16x2(128, 128): 128 + v for v in 0..127 is exact

// (x & mask) | bits in one LOP3 (the device form keeps both constants in registers: a LOP3 takes one immediate)
HF_W4_HD uint32_t and_or(uint32_t x, uint32_t mask, uint32_t bits) {
#if defined(__CUDA_ARCH__)
  uint32_t r;
  asm("lop3.b32 %0, %1, %2, %3, 0xea;" : "=r"(r) : "r"(x), "r"(mask), "r"(bits));
  return r;
#else
  return (x & mask) | bits;
#endif
}
// int4 codes of pair i (slots i, i+4) as (1024 + v) fp16 / (128 + v) bf16
HF_W4_HD uint32_t int4_pair_bits(uint32_t word, int i, bool bf16) {
  return and_or(word >> (4 * i), 0x000f000fu, bf16 ? kBF16Magic : kF16Magic);
}
// fp16 only: the codes of pair i + 1 (i even) in place, without a shift: (1024 + 16 v), exact
HF_W4_HD uint32_t int4_hi_pair_bits_f16(uint32_t word, int i) { return and_or(word >> (4 * i), 0x00f000f0u, kF16Magic); }
constexpr uint32_t kF16Sixteenth = 0x2c002c00u;  // half2(1/16, 1/16)
constexpr uint32_t kF16Minus72 = 0xd480d480u;    // half2(-72, -72) = -(1024 / 16 + 8)
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
// E2M1 codes of pair i with exponent and mantissa moved into the fp16 / bf16 fields: value * 2^-14 (fp16) or
// * 2^-126 (bf16); code 1 (0.5) lands on a subnormal, still exact
template <bool BF16>
HF_W4_HD uint32_t e2m1_pair_bits(uint32_t word, int i) {
  const uint32_t x = word >> (4 * i);
  return ((x & 0x00070007u) << (BF16 ? 6 : 9)) | ((x & 0x00080008u) << 12);
}
// E4M3 bytes idx, idx + 1 of word in the low / high half, moved the same way: value * 2^-8 (fp16) or * 2^-120
// (bf16); E4M3 subnormals become subnormals
template <bool BF16>
HF_W4_HD uint32_t e4m3_pair_bits(uint32_t word, int idx) {
  const uint32_t b = prmt(word, 0u, 0x4040u | ((uint32_t)(idx + 1) << 8) | (uint32_t)idx);  // 0x00 b1 0x00 b0
  return ((b & 0x007f007fu) << (BF16 ? 4 : 7)) | ((b & 0x00800080u) << 8);
}

// ---- recipes. F16 does fp16x2 arithmetic on bit patterns, A the activation type's (fp16 or bf16); each
// operation rounds once to nearest even (device: __hsub2 / __hmul2; host: emulated).
// int4: (1024 + v) - (1024 + z) is exact, then one rounding in the multiply by the scale (already in A's type).
template <class A>
HF_W4_HD uint32_t int4_dequant(uint32_t word, int i, uint32_t zero2, uint32_t scale2) {
  return A::mul2(A::sub2(int4_pair_bits(word, i, A::kBF16), zero2), scale2);
}
// symmetric int4 (zero 8): the same values. In fp16 the odd pairs skip the shift: (1024 + 16 v) / 16 - 72 = v - 8 in
// one fused multiply-add, exact (every intermediate is a small multiple of 1/16), so the bits do not change.
template <class A>
HF_W4_HD uint32_t int4_sym_dequant(uint32_t word, int i, uint32_t scale2) {
  if constexpr (!A::kBF16) {
    if (i & 1) return A::mul2(A::fma2(int4_hi_pair_bits_f16(word, i - 1), kF16Sixteenth, kF16Minus72), scale2);
  }
  return int4_dequant<A>(word, i, int4_zero_bits(8u, A::kBF16), scale2);
}
// NVFP4: the mma operands are the weights times 2^-8 (kNvfp4Unscale, with the global scale, undoes it in fp32 on
// the accumulated sums: exact, a power of two). Then one multiply per pair makes them, in A's own type: the E2M1
// bits times the block scale brought to 2^6 (fp16) / 2^118 (bf16). Exact: the product has at most 6 significant
// bits (2 of E2M1, 4 of E4M3) and lies in [2^-18, 10.5], normal in bf16 and at least 2^-24 apart in fp16.
constexpr float kNvfp4Unscale = 256.f;
// the block scales of sub-tiles idx, idx + 1 (E4M3 bytes idx, idx + 1 of word) in the low / high half, prepared
template <class A>
HF_W4_HD uint32_t nvfp4_scale_pair(uint32_t word, int idx) {
  if constexpr (A::kBF16) {  // * 2^-120 -> * 2^118 in two exact steps (2^238 is past bf16's range)
    constexpr uint32_t k2p119 = 0x7b007b00u;
    return A::mul2(A::mul2(e4m3_pair_bits<true>(word, idx), k2p119), k2p119);
  } else {
    return A::mul2(e4m3_pair_bits<false>(word, idx), 0x74007400u);  // * 2^-8 -> * 2^6
  }
}
// NVFP4 pair i of word times 2^-8, with a broadcast scale from nvfp4_scale_pair
template <class A>
HF_W4_HD uint32_t nvfp4_dequant(uint32_t word, int i, uint32_t scale2) {
  return A::mul2(e2m1_pair_bits<A::kBF16>(word, i), scale2);
}

// ---- work split (host)
// Work split of the fused kernel: a block computes BM = 16 * mt rows x 64 columns over steps_per_split k16 steps;
// grid (mblocks, Npad/64, splits). Where the tiles alone do not fill the GPU (``slots`` = SMs x resident blocks per
// SM), split-K multiplies the blocks up to at most one full wave (a partial second wave would cost a whole wave).
// The warps take chunks of kChunk consecutive k16 steps; splits start on chunk boundaries.
constexpr int kChunk = 2;
// m16 tiles per block: blocks of one tile (the m-blocks of a column tile share its weights in L2, registers stay
// low) up to 32 rows, and above that too where K < 8192; tiles of two from 33 rows at K >= 8192 (measured on an H100:
// docs/cuda-kernels.md)
HF_W4_HD int plan_mt(int m, int k) { return m <= 32 || k < 8192 ? 1 : 2; }
// GemmArgs::group_shift: log2(group_size / 16) where that is a power of two, else -1 (the fused kernel divides)
HF_W4_HD int group_shift_of(int group_size) {
  for (int b = 0; b < 31; ++b)
    if (group_size / 16 == 1 << b) return b;
  return -1;
}
// rows of each m16 tile staged in shared memory: 8 where the one tile has at most 8 rows (smaller rings, more blocks)
HF_W4_HD int plan_rows(int m, int mt) { return mt == 1 && m <= 8 ? 8 : 16; }

struct GemmPlan {
  int mt, mr, bm, mblocks, ntiles, splits, steps_per_split;
  bool wide;  // the wide kernel: blocks of 4 column tiles
  int wgmma;  // the sm_90a wgmma kernel's warpgroups per block (0: a fused mma.sync kernel)
  int64_t ws_floats;
  int counters;
  bool overlap;  // launched to overlap the kernel before it in the stream (sm_90+; set by the caller, not the plan)
};

// mt: 0 = by M and K (plan_mt), else 1, 2 or 4 (4: only when forced, HF_W4_CUDA_MT; the wgmma kernel: rows / 16);
// splits: 0 = one wave of ``slots`` blocks at most, else that many (HF_W4_CUDA_SPLITS), within the same bounds of
// 1 .. K / 128; tiles: the column tiles of a block (the wide kernel's 4; the wgmma kernel's warpgroups); chunk: the
// k16 steps of the kernel's chunks, which a split's length is rounded up to
inline GemmPlan plan_gemm(int m, int npad, int k, int slots, int mt = 0, bool wide = false, int splits = 0,
                          int tiles = 1, int chunk = kChunk) {
  GemmPlan p;
  p.mt = mt ? mt : plan_mt(m, k);
  p.mr = plan_rows(m, p.mt);
  p.wide = wide;
  p.wgmma = 0;
  p.overlap = false;
  p.bm = 16 * p.mt;
  p.mblocks = (m + p.bm - 1) / p.bm;
  p.ntiles = npad / 64;
  const int ksteps = k / 16;
  if (wide) tiles = 4;
  const int blocks = (p.ntiles + tiles - 1) / tiles * p.mblocks;
  int s = splits > 0 ? splits : slots / blocks;
  const int max_s = ksteps / 8 > 1 ? ksteps / 8 : 1;  // at least 8 k16 steps (one chunk per warp) per split
  s = s < 1 ? 1 : (s > max_s ? max_s : s);
  p.steps_per_split = ((ksteps + s - 1) / s + chunk - 1) / chunk * chunk;
  p.splits = (ksteps + p.steps_per_split - 1) / p.steps_per_split;
  p.ws_floats = p.splits > 1 ? (int64_t)p.mblocks * p.ntiles * p.splits * p.bm * 64 : 0;
  p.counters = p.splits > 1 ? p.mblocks * p.ntiles : 0;
  return p;
}

// The chunks warp ``warp`` of split ``split`` runs, as the kernel does: chunk i starts at k16 step first + 4 i kChunk
// and holds the steps below *end (only the very last chunk of K can be short).
HF_W4_HD int warp_chunks(int ksteps, int steps_per_split, int split, int warp, int* first, int* end) {
  const int kb = split * steps_per_split;
  const int ke = ksteps < kb + steps_per_split ? ksteps : kb + steps_per_split;
  *first = kb + warp * kChunk;
  *end = ke;
  return *first < ke ? (ke - *first + 4 * kChunk - 1) / (4 * kChunk) : 0;
}

}  // namespace cuda
}  // namespace hf_w4
