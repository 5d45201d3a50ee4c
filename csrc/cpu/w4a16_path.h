// Which W4A16 kernel path a call takes: a pure function of the call (M, K, weight type, group size, activation
// dtype) and of what the CPU offers, so the same inputs take the same path - and give the same outputs - in every
// process on one machine. The thresholds were measured offline per CPU family; docs/cpu-kernels.md ("W4A16 paths" and
// "M crossovers") has the table, where each number comes from and how to re-measure it. No torch headers.
#pragma once
#include <algorithm>
#include <cstdint>

#include "common/cpu_features.h"
#include "w4a16.h"

namespace hf_w4 {

// The numbers are the cpu_w4a16_gemm op's `path` argument (-1 = the automatic choice).
enum class W4Path : int {
  fused = 0,         // decode in registers + fp32 FMA (small M; every ISA)
  dequant_bf16 = 1,  // dequantize N-chunks to bf16 + at::linear (bf16 x; other x dtypes dequantize to fp32)
  amx = 2,           // AMX-BF16 tiles (bf16 x, K % 32 == 0)
  int16 = 3,         // activations as int16 blocks x raw codes (AVX-512 vpdpwssd / AVX2 vpmaddwd)
  dequant_fp32 = 4,  // dequantize to fp32 + at::linear (x widened exactly, y rounded once)
  blocked = 5,       // each panel decoded once to bf16, vdpbf16ps on the bf16 x (AVX512-BF16, bf16 x, large M)
};

inline const char* path_name(W4Path p) {
  switch (p) {
    case W4Path::fused: return "fused";
    case W4Path::dequant_bf16: return "bf16";
    case W4Path::amx: return "amx";
    case W4Path::int16: return "int16";
    case W4Path::dequant_fp32: return "fp32";
    case W4Path::blocked: return "blocked";
  }
  return "?";
}

// What the path choice needs to know about the machine (w4a16_torch.cpp fills it from cpu_caps() and HF_W4_*).
struct PathCaps {
  CpuIsa isa = CpuIsa::generic;
  bool amx = false;        // AMX-BF16 usable (CPU + OS) and not switched off (HF_W4_AMX=0)
  bool vbmi = false;       // AVX512-VBMI and not switched off (HF_W4_VBMI=0)
  bool bf16_gemm = false;  // the CPU has bf16 arithmetic (AVX512-BF16 or AMX-BF16) and oneDNN may use it, so
                          // at::linear's bf16 GEMM is fast
  bool avx512_bf16 = false;     // AVX512-BF16 (the blocked kernel can run)
  bool amd = false;             // AMD: AVX2's vpmaddwd runs at twice the fp32 FMA rate of multiply-adds
  int large = -1;          // HF_W4_LARGE_PATH as a W4Path number, -1 = the fixed rule
  // AVX512-BF16 at the fp32 FMA rate (AMD; Intel's runs vdpbf16ps at a quarter of it)
  bool bf16_full_rate() const { return avx512_bf16 && amd; }
};

struct W4Call {
  int64_t M, K;
  int mode;     // W4_SYM / W4_ASYM / W4_NVFP4
  int64_t gs;   // group size (NVFP4: 16)
  int dtype;    // DT_F32 / DT_BF16 / DT_F16 of x
};

// Activation block of the int16 path: the largest divisor of the group size that is a multiple of 4 and at most
// 4096; 0 if none is >= 16 (no int16 path for that group size). NVFP4: the largest of 128, 64, 32 (or 16) that
// divides K, except on AVX-512 at M = 1 and, without VBMI, from kNvFoldMinM = 8 rows (w4a16.h): 16. AVX2 folds the
// block scales into the weights; AVX-512 does with VBMI from 8 rows and below them applies the scales with one FMA
// per 16-k block and row, the activation scale once per activation block. On Zen 5 (1 thread, cold, against blocks
// of 16) that is 5-15 % faster at M = 2-4, even at 6, slower at M = 1 (bound by the weight stream, not the
// multiplies); folded is ~15 % faster at M = 8 (docs/cpu-kernels.md, "M crossovers").
inline int64_t i16_block(const PathCaps& c, const W4Call& q) {
  if (c.isa == CpuIsa::generic) return 0;
  if (q.mode == W4_NVFP4) {
    if (c.isa == CpuIsa::avx512 && (q.M == 1 || (q.M >= kNvFoldMinM && !c.vbmi))) return 16;
    return q.K % 128 == 0 ? 128 : q.K % 64 == 0 ? 64 : q.K % 32 == 0 ? 32 : 16;
  }
  for (int64_t d = std::min<int64_t>(q.gs, 4096); d >= 16; --d)
    if (q.gs % d == 0 && d % 4 == 0) return d;
  return 0;
}

// The blocked kernel can run this call (it takes any K and group size: K and the groups are whole k-pairs).
inline bool blocked_ok(const PathCaps& c, const W4Call& q) {
  return c.avx512_bf16 && c.isa == CpuIsa::avx512 && q.dtype == DT_BF16;
}

// The AMX path can run this call.
inline bool amx_ok(const PathCaps& c, const W4Call& q) {
  return c.amx && c.isa == CpuIsa::avx512 && q.dtype == DT_BF16 && q.K % 32 == 0;
}

// ---- the M crossovers (docs/cpu-kernels.md, "M crossovers")
// Largest M of the fused fp32 kernel in the automatic choice.
inline int64_t fused_max_m(CpuIsa isa) { return isa == CpuIsa::avx512 ? 32 : isa == CpuIsa::avx2 ? 16 : 4; }
// Largest M of the int16 kernel at small M (bf16 x only: fp16 x would lose bits, fp32 x keeps the exact kernel).
inline int64_t i16_max_m(const PathCaps& c, const W4Call& q) {
  if (c.isa == CpuIsa::avx2) return 16;
  if (!amx_ok(c, q)) return 32;
  if (!amx_raw_codes(q.mode, q.gs, 4)) return 4;
  return q.gs >= 128 ? 2 : q.gs >= 64 ? 3 : 4;
}
// Smallest M of the AMX path: int4 on raw codes from 2, NVFP4 from 4, int4 with other groups from 6.
inline int64_t amx_min_m(const W4Call& q) {
  if (q.mode == W4_NVFP4) return 4;
  return amx_raw_codes(q.mode, q.gs, 1) ? 2 : 6;
}
// Largest M of the AVX2 int16 kernel above small M, before dequantize + GEMM takes over, where the CPU has no bf16
// arithmetic: on AMD none (vpmaddwd + vpaddd do twice the multiply-adds of fp32 FMAs per cycle: the int16 kernel
// runs at ~2x the dequantize + fp32 GEMM path at every M), elsewhere (Intel, where the two are even from M ~ 96)
// 80 for int4 and 32 for NVFP4, whose decode costs more.
inline int64_t avx2_i16_large_max_m(const PathCaps& c, int mode) {
  if (c.amd && !c.bf16_gemm) return INT64_MAX;
  return mode == W4_NVFP4 ? 32 : 80;
}
// Smallest M of the blocked kernel for int4 with an int16 block, on CPUs whose AVX512-BF16 runs at full rate (AMD):
// below it the int16 kernel, which decodes the codes in registers for every 8 rows, is faster (Zen 5, 1 thread: by
// 1-2 % at M = 96, where the blocked kernel's panel decode is not yet spread over enough rows); the two are even at
// M = 112-128 and the blocked kernel is ahead from M = 160 (by 2-5 % at 192-256, ~20 % at 4096, where the int16
// kernel's activations no longer fit the L3). NVFP4 (whose int16 decode costs ~1.4x int4's) and int4 group sizes
// without an int16 block take the blocked kernel at every large M there (docs/cpu-kernels.md, "M crossovers").
constexpr int64_t kBlockedInt4MinM = 128;

// bf16 x above the small-M kernels where AMX does not take it.
inline W4Path large_m_path(const PathCaps& c, const W4Call& q) {
  const bool i16 = i16_block(c, q) > 0;
  const W4Path gemm = c.bf16_gemm ? W4Path::dequant_bf16 : W4Path::dequant_fp32;
  if (c.large >= 0) {
    const W4Path forced = static_cast<W4Path>(c.large);
    if (forced == W4Path::int16 && !i16) return W4Path::dequant_fp32;
    if (forced == W4Path::blocked && !blocked_ok(c, q)) return gemm;
    return forced;
  }
  // AMX CPU, shape AMX cannot take (K % 32): at::linear runs on AMX (unless oneDNN is capped)
  if (c.amx) return gemm;
  // AVX512-BF16 at full rate: the blocked kernel (vdpbf16ps, 32 multiply-adds per instruction like vpdpwssd, the
  // weights decoded once per panel instead of once per 8 rows)
  if (blocked_ok(c, q) && c.bf16_full_rate() && (q.mode == W4_NVFP4 || !i16 || q.M >= kBlockedInt4MinM))
    return W4Path::blocked;
  if (c.isa == CpuIsa::avx512 && i16) return W4Path::int16;
  if (c.isa == CpuIsa::avx2 && i16 && q.M <= avx2_i16_large_max_m(c, q.mode)) return W4Path::int16;
  return gemm;
}

// The int16 activations' l1 bound (w4a16_quant_x16_*): the folded NVFP4 kernel's (AVX2: every M; AVX-512: from
// kNvFoldMinM rows), else none.
inline int64_t i16_l1max(CpuIsa isa, int mode, int64_t ag, int64_t M) {
  return mode == W4_NVFP4 && ag > 16 && (isa != CpuIsa::avx512 || M >= kNvFoldMinM) ? kNvFoldL1 : 0;
}

// The fused fp32 kernels take the activations' group sums for asymmetric int4 (zero points) and, on AVX2, for
// symmetric int4 too (the -8 goes through them).
inline bool fused_needs_xsum(CpuIsa isa, int mode) {
  return mode == W4_ASYM || (isa == CpuIsa::avx2 && mode == W4_SYM);
}

// The automatic choice.
inline W4Path choose_path(const PathCaps& c, const W4Call& q) {
  const bool bf16 = q.dtype == DT_BF16;
  const int64_t i16max = i16_max_m(c, q);
  if (bf16 && i16_block(c, q) > 0 && q.M <= i16max) return W4Path::int16;
  if (amx_ok(c, q) && q.M >= amx_min_m(q)) return W4Path::amx;
  if (bf16 && q.M > std::max(i16max, fused_max_m(c.isa))) return large_m_path(c, q);
  if (q.M <= fused_max_m(c.isa)) return W4Path::fused;
  return bf16 ? W4Path::dequant_bf16 : W4Path::dequant_fp32;
}

// A requested path (-1 = automatic); a path the call cannot take (int16 without an int16 block or on the generic
// ISA, AMX where amx_ok is false, blocked where blocked_ok is false) falls back to the automatic choice.
inline W4Path resolve_path(const PathCaps& c, const W4Call& q, int requested) {
  if (requested < 0) return choose_path(c, q);
  const W4Path p = static_cast<W4Path>(requested);
  if (p == W4Path::int16 && i16_block(c, q) == 0) return choose_path(c, q);
  if (p == W4Path::amx && !amx_ok(c, q)) return choose_path(c, q);
  if (p == W4Path::blocked && !blocked_ok(c, q)) return choose_path(c, q);
  return p;
}

// The machine facts of a call on `isa` (w4a16_torch.cpp: cpu_caps() and the HF_W4_* settings).
PathCaps w4a16_path_caps(CpuIsa isa);

}  // namespace hf_w4
