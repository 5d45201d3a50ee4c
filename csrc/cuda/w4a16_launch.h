// Plain C++ interface between the torch glue (w4a16_torch.cpp) and the device code (w4a16_gemm.cu): raw
// pointers only, so the .cu files include no torch headers. Layouts: see w4a16_math.cuh.
#pragma once
#include <cstddef>
#include <cstdint>

#include <cuda_runtime.h>

namespace hf_w4 {
namespace cuda {

enum WeightKind : int { kInt4Sym = 0, kInt4Asym = 1, kNvfp4 = 2 };

struct GemmArgs {
  const void* x;         // [M, K] fp16 / bf16, row-major, 4-byte aligned
  const int32_t* qpack;  // [K/16][Npad/64][32][4]
  const void* scales;    // int4: [G][Npad/64][64] in x's dtype; nvfp4: uint8 E4M3 [K/16][Npad/64][64]
  const uint8_t* zeros;  // int4 asymmetric: [G][Npad/64][64] integer zero points; else null
  const void* bias;      // [N] in x's dtype or null
  void* y;               // [M, N] in x's dtype
  float* workspace;      // split-K partials (plan.ws_floats)
  int* counters;         // plan.counters ints, zero on entry; the kernel leaves them zero
  int m, n, npad, k, group_size;
  float global_scale;    // nvfp4 multiplier (1 for int4)
  int kind;              // WeightKind
  bool bf16;
};

// Work split of the fused kernel: a block computes BM = 16 * mt rows x 64 columns over steps_per_split k16 steps;
// grid (Npad/64, splits, mblocks). Split-K brings the block count up to ~4 per SM where N is small.
struct GemmPlan {
  int mt, bm, mblocks, ntiles, splits, steps_per_split;
  size_t ws_floats;
  int counters;
};

inline GemmPlan plan_gemm(int m, int npad, int k, int sms) {
  GemmPlan p;
  p.mt = m <= 16 ? 1 : (m <= 32 ? 2 : 4);
  p.bm = 16 * p.mt;
  p.mblocks = (m + p.bm - 1) / p.bm;
  p.ntiles = npad / 64;
  const int ksteps = k / 16;
  const int blocks = p.ntiles * p.mblocks;
  int s = (4 * sms + blocks - 1) / blocks;
  const int max_s = ksteps / 8 > 1 ? ksteps / 8 : 1;  // at least 8 k16 steps (2 per warp) per split
  s = s < 1 ? 1 : (s > max_s ? max_s : s);
  p.steps_per_split = (ksteps + s - 1) / s;
  p.splits = p.steps_per_split ? (ksteps + p.steps_per_split - 1) / p.steps_per_split : 1;
  if (p.splits < 1) p.splits = 1;
  p.ws_floats = p.splits > 1 ? (size_t)p.mblocks * p.ntiles * p.splits * p.bm * 64 : 0;
  p.counters = p.splits > 1 ? p.mblocks * p.ntiles : 0;
  return p;
}

// y = x @ W^T (+ bias), fused dequantization; returns the launch error, if any.
cudaError_t w4a16_gemm(const GemmArgs& a, const GemmPlan& plan, cudaStream_t stream);

// The dense weight [N, K] (x's dtype; nvfp4 with the global scale applied in fp32 before the rounding), for the
// large-M path (dense GEMM) and for tests.
cudaError_t w4a16_dequant(const int32_t* qpack, const void* scales, const uint8_t* zeros, void* w, int n, int npad,
                          int k, int group_size, float global_scale, int kind, bool bf16, cudaStream_t stream);

}  // namespace cuda
}  // namespace hf_w4
