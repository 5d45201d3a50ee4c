// hf_w4 CPU W4A16 kernels: packed layout and raw-pointer entry points (no torch headers here).
//
// Kernel layout (produced by w4a16_repack_panels, one layer at a time):
//   N is split into P = ceil(N/32) panels of 32 output columns (the last one zero padded).
//   qpack  uint8 [P][K/2][32]: for k-pair j (k = 2j, 2j+1) byte i holds
//            low nibble  = code(n = 32p + i/2,      k = 2j + i%2)
//            high nibble = code(n = 32p + 16 + i/2, k = 2j + i%2)
//          i.e. after a zero-extension of 16 bytes to 32-bit lanes, (b & 15) and (b >> 4) index a 16-entry
//          LUT (vpermps) and give fp32 weights whose lanes are (column, k parity) pairs, multiplied with the
//          broadcast activation pair (x[k], x[k+1]); zero-extended to 16-bit lanes the same bytes are bf16
//          VNNI-2 operands (for a future vdpbf16ps / AMX path).
//          When an act-order permutation is given, k counts the permuted order (y = x[:, perm] W'^T).
//   scales float [P][G][32] (int4) or uint8 fp8-e4m3 bytes [P][G][32] (nvfp4, G = K/16) with the sign bit clear:
//          a negative block scale's sign is moved into its 16 codes (e2m1 is sign-magnitude: code bit 3), so that
//          the AVX-512 and AVX2 kernels turn a scale byte into fp16 bits with one shift (b << 7 = scale / 2^8).
//   zs     float [P][G][32] = zero * scale (asymmetric int4 only; else absent).
// Math: y[m, n] = gscale * sum_g ( s[n,g] * sum_{k in g} x[m,k] * lut(code) - zs[n,g] * sum_{k in g} x[m,k] )
//   lut: sym int4 -> code - 8, asym int4 -> code, nvfp4 -> e2m1(code).
#pragma once
#include <algorithm>
#include <cstdint>

#include "common/dispatch.h"

namespace hf_w4 {

constexpr int W4_NP = 32;  // panel width (output columns)

enum W4Mode : int { W4_SYM = 0, W4_ASYM = 1, W4_NVFP4 = 2 };

// f(IntC<MODE>{}) for a run-time weight mode: one kernel template per mode.
template <class F>
__attribute__((always_inline)) inline void with_mode(int mode, F&& f) {
  if (mode == W4_NVFP4) f(IntC<W4_NVFP4>{});
  else if (mode == W4_ASYM) f(IntC<W4_ASYM>{});
  else f(IntC<W4_SYM>{});
}

// The value a 4-bit code stands for before its scale (the kernels' lookup tables are built from this):
// symmetric int4 code - 8, asymmetric int4 the code (its zero acts through zero * scale), NVFP4 e2m1 (bit 3 = sign).
inline constexpr float kE2M1[16] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f,
                                    -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};
constexpr float w4_code_value(int mode, int code) {
  return mode == W4_NVFP4 ? kE2M1[code & 15] : mode == W4_SYM ? static_cast<float>((code & 15) - 8)
                                                                : static_cast<float>(code & 15);
}
enum W4DType : int { DT_F32 = 0, DT_BF16 = 1, DT_F16 = 2 };

struct W4Gemm {
  int64_t N, K, G, gs, P;
  int mode;
  const uint8_t* qpack;
  const void* scales;
  const float* zs;       // asym only
  float gscale;          // multiplies the result (nvfp4 global scale; 1 otherwise)
  const float* bias;     // fp32 [N] or null
  void* out;             // [M][ldo] in out_dtype
  int64_t ldo;
  int out_dtype;
};

// ---- repack (portable C++)
struct W4Repack {
  int64_t N, K, G, gs, P;
  int mode;
  const int32_t* codes; int64_t cs0, cs1;  // int32 view [N, K/8] (pack_k) or [N/8, K] (pack_n), element strides
  bool pack_k;
  int slots[8];
  const int64_t* perm;                     // [K] or null: new k' takes old column perm[k']
  const float* scales;                     // int4: fp32 [N][G] contiguous
  const uint8_t* scales8;                  // nvfp4: uint8 [N][G] contiguous
  const float* zeros;                      // asym: fp32 [N][G] contiguous, else null
  uint8_t* qpack; void* out_scales; float* out_zs;
  int64_t pack_n_from;                     // pack_n codes: panels below this are written elsewhere (SIMD path)
};
void w4a16_repack_panels(const W4Repack& r, int64_t p0, int64_t p1);
// nvfp4, after w4a16_repack_panels (and any SIMD code path) wrote panels [p0, p1): clears the sign bit of every
// block scale, flipping the sign bit of its 16 codes where it was set (-0 included, which then reads +0)
void w4a16_nvfp4_positive_scales(const W4Repack& r, int64_t p0, int64_t p1);
// AVX2 fast path for AWQ codes (pack_n, slots {0,4,1,5,2,6,3,7}, no perm): codes of the full panels [p0, p1)
// only (the caller guarantees 32 * p1 <= N); scales / zeros and partial panels stay with w4a16_repack_panels.
bool w4a16_is_awq_slots(const int slots[8]);
void w4a16_repack_awq_codes_avx2(const W4Repack& r, int64_t p0, int64_t p1);

// ---- fused small-M kernels; compute panels [p0, p1) for all rows
// generic / avx2: fp32 activations x [M][K] (already permuted), xsum fp32 [M][G] (asym only)
void w4a16_fused_generic(const W4Gemm& g, const float* x, int64_t M, const float* xsum, int64_t p0, int64_t p1);
void w4a16_fused_avx2(const W4Gemm& g, const float* x, int64_t M, const float* xsum, int64_t p0, int64_t p1);
// avx512: fp32 activations as above, xsum only for asym (fp32 FMA: faster here than a vdpbf16ps formulation)
void w4a16_fused_avx512(const W4Gemm& g, const float* x, int64_t M, const float* xsum, int64_t p0, int64_t p1);

// avx512 + VNNI, 16-bit activations: x quantized per (row, block of ag k) to int16 with a power-of-two scale
// (w4a16_quant_x16_avx512: xq int16 [M][K], xs fp32 [M][K/ag] = scale, xd int32 [M][K/ag] = sum of the block's
// int16 values; returns false if x holds inf / nan). ag divides the group size (NVFP4: 16) and is at most 4096, so
// the int32 sums cannot overflow. Exact for every element within 2^7 (bf16) / 2^4 (fp16) of its block's max;
// smaller ones are off by at most 2^-16 of that max.
// With l1max > 0 the scale is also large enough that each block's sum of |xq| stays at most l1max (the NVFP4
// kernel, whose folded weights reach 12 * 15 * 2^kNvFoldD, passes kNvFoldL1).
bool w4a16_quant_x16_avx512(const void* x, int dtype, int64_t M, int64_t K, int64_t ag, int64_t l1max, int16_t* xq,
                            float* xs, int32_t* xd);
constexpr int kNvFoldD = 4;
constexpr int64_t kNvFoldL1 = 2147483647 / (12 * 15 << kNvFoldD);
// NVFP4 decodes its codes with vpermb where w4a16_vbmi_enabled() (AVX512-VBMI, and HF_W4_VBMI=0 not set; else
// vpermw, bit-identical). With activation blocks ag > 16 (w4a16_path.h, i16_block, says when) NVFP4 runs from
// kNvFoldMinM rows with its block scales folded into the int16 weights (x quantized with l1max = kNvFoldL1), below
// it with one fp32 FMA per 16-k block and row (x quantized without the bound).
constexpr int64_t kNvFoldMinM = 8;
bool w4a16_vbmi_enabled();
void w4a16_fused_i16_avx512(const W4Gemm& g, const int16_t* xq, const float* xs, const int32_t* xd, int64_t M,
                            int64_t ag, int64_t p0, int64_t p1);
// the same in portable C++ (any ISA) and AVX2 (ag a multiple of 16; the kernel: vpmaddwd + vpaddd)
bool w4a16_quant_x16_generic(const void* x, int dtype, int64_t M, int64_t K, int64_t ag, int64_t l1max, int16_t* xq,
                             float* xs, int32_t* xd);
bool w4a16_quant_x16_avx2(const void* x, int dtype, int64_t M, int64_t K, int64_t ag, int64_t l1max, int16_t* xq,
                          float* xs, int32_t* xd);
void w4a16_fused_i16_avx2(const W4Gemm& g, const int16_t* xq, const float* xs, const int32_t* xd, int64_t M,
                          int64_t ag, int64_t p0, int64_t p1);

// The blocked large-M kernel (AVX512-BF16, bf16 activations; w4a16_avx512_bf16.cpp): each panel decoded once into
// bf16 weights, every row block run over it with vdpbf16ps. The activations are first packed by
// w4a16_blocked_pack_x into row blocks of kBlockedRows: xp uint32 [ceil(M / kBlockedRows)][K/2][kBlockedRows], the
// bf16 pair (x[m][2j], x[m][2j+1]) of each row, rows >= M zero (blocks [rb0, rb1)), so that the micro-kernel reads
// one contiguous stream instead of 12 rows K apart (which alias in L1). xsum fp32 [M][G] (asymmetric int4 only,
// else null): the rows' group sums of x.
constexpr int kBlockedRows = 12;
// Row blocks per chunk: the rows run in chunks of equal size whose packed activations take at most
// kBlockedChunkBytes, so that every panel's pass over a chunk reads it from the L3; a panel is decoded again for each
// chunk, so the chunks are as large as that allows (Zen 5, 1 thread: 4 MiB chunks 5-8 % slower at K = 11008,
// M = 256-1024, 2 MiB ~3 % at M = 4096; 8, 12 and 16 MiB even at M = 1024-4096). The torch glue packs and runs one
// chunk at a time (w4a16_blocked_avx512 takes the rows of one chunk), so the packed activations never take more.
constexpr int64_t kBlockedChunkBytes = int64_t(8) << 20;
inline int64_t w4a16_blocked_chunk(int64_t M, int64_t K) {
  const int64_t nrb = (M + kBlockedRows - 1) / kBlockedRows;
  const int64_t most = std::max<int64_t>(1, kBlockedChunkBytes / (kBlockedRows * 2 * K));
  const int64_t nch = (nrb + most - 1) / most;
  return (nrb + nch - 1) / nch;
}
void w4a16_blocked_pack_x(const uint16_t* x, int64_t M, int64_t K, uint32_t* xp, int64_t rb0, int64_t rb1);
void w4a16_blocked_avx512(const W4Gemm& g, const uint32_t* xp, const float* xsum, int64_t M, int64_t p0, int64_t p1);

// AMX-BF16 (bf16 activations, K % 32 == 0). Activations are first packed into tiles by w4a16_amx_pack_a:
// xa bf16 [ceil(M/16)][K/32][16 rows][32] (16-row blocks [mb0, mb1)), so that every A tile load reads 1 KiB of
// contiguous memory (row-strided loads of a K=4096 row-major x alias in L1 every 4 KiB). Rows >= M are zeroed
// only for M > kAmxSmallMaxM: the small-M kernels configure their A and C tiles with the real row count and never
// read them. Call only when cpu_caps().amx_bf16 (common/cpu_features.h: the CPU has it and Linux granted the tile
// data state).
// Up to this M the AMX path streams the weights through L1 one 32-k step at a time (amx_small_*: at most two
// 16-row blocks, tiles of the real row count); above it, blocks of panels are decoded once for all 16-row blocks.
constexpr int64_t kAmxSmallMaxM = 32;
void w4a16_amx_pack_a(const uint16_t* x, int64_t ldx, int64_t M, int64_t K, uint16_t* xa, int64_t mb0, int64_t mb1);
// int4 with M <= kAmxSmallMaxM and groups of a multiple of 32 take the raw-code kernel (amx_raw_codes), which needs
// xsum fp32 [M][G] of the (bf16) activations for asymmetric weights; otherwise xsum is unused.
inline bool amx_raw_codes(int mode, int64_t gs, int64_t M) {
  return M <= kAmxSmallMaxM && mode != W4_NVFP4 && gs % 32 == 0;
}
void w4a16_fused_amx(const W4Gemm& g, const uint16_t* xa, const float* xsum, int64_t M, int64_t p0, int64_t p1);
// NVFP4 when the CPU also has AVX512-FP16 (w4a16_amx_fp16_available; HF_W4_AMX_FP16=0 in the environment says
// no): a cheaper decode with the block scales folded in (fp16 products moved into bf16 position, w * 2^-108), for
// every M that takes AMX. The activations are packed by w4a16_amx_pack_a_pow2 (as w4a16_amx_pack_a, 16-row blocks
// [mb0, mb1), each row multiplied by 2^a_m; rowe fp32 [M] = 108 - a_m, the exponent the epilogue restores).
bool w4a16_amx_fp16_available();
void w4a16_amx_pack_a_pow2(const uint16_t* x, int64_t M, int64_t K, uint16_t* xa, float* rowe, int64_t mb0,
                           int64_t mb1);
void w4a16_amx_nvfp4_fp16(const W4Gemm& g, const uint16_t* xa, const float* rowe, int64_t M, int64_t p0, int64_t p1);

// ---- dequantize panels [p0, p1) to the dense *transposed* weight (all scales and the global scale folded
// in): dst[k * ldd + (n - 32*p0)] for n in 32*p0 .. min(N, 32*p1) - 1, dtype DT_F32 or DT_BF16
void w4a16_dequant_generic(const W4Gemm& g, void* dst, int dst_dtype, int64_t ldd, int64_t p0, int64_t p1);
void w4a16_dequant_avx512(const W4Gemm& g, void* dst, int dst_dtype, int64_t ldd, int64_t p0, int64_t p1);
void w4a16_dequant_avx2(const W4Gemm& g, void* dst, int dst_dtype, int64_t ldd, int64_t p0, int64_t p1);

// helpers
float fp8e4m3_to_f32(uint8_t b);

}  // namespace hf_w4
