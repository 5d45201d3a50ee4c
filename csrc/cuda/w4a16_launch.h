// Plain C++ interface between the torch glue (w4a16_torch.cpp) and the device code (w4a16_gemm.cu): raw
// pointers only, so the .cu files include no torch headers. Layouts: see w4a16_math.cuh.
#pragma once
#include <cstddef>
#include <cstdint>

#include <cuda_runtime.h>

#include "w4a16_math.cuh"

namespace hf_w4 {
namespace cuda {

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
  int group_shift;       // log2(group_size / 16) where that is a power of two, else -1 (the fused kernel divides)
  float global_scale;    // nvfp4 multiplier (1 for int4)
  int kind;              // WeightKind
  bool bf16;
};

// The fused kernel's work split for (M, Npad, K) on the current device with `sms` SMs: m16 tiles per block forced
// (mt = 1, 2, 4) or by the rule (mt = 0: plan_mt, two tiles at 9-16 rows where one wave of them holds every column
// tile), the wide kernel forced on or off (wide = 1, 0) or by the rule (-1: at 9-64 rows of layers of at least three
// waves of column tiles, where it then takes the tiling), split-K for the resident blocks per SM the occupancy API
// gives (also stored in *blocks_per_sm if given), or `splits` K splits where that is positive. wgmma: the sm_90a
// wgmma kernel instead (only where w4a16_wgmma_available()), blocks of 4 warpgroups, each on one column tile, x
// wgmma_rows rows of x (64 or 128; 0: 64 up to M = 64, else 128), K split as for the fused kernel.
GemmPlan w4a16_gemm_plan(int m, int npad, int k, bool bf16, int kind, int sms, int mt, int wide, int* blocks_per_sm,
                         int splits = 0, bool wgmma = false, int wgmma_rows = 0);

// Whether the fused path takes the wgmma kernel by default for an M x Npad x K call where the device has the kernel:
// from M = 64 on layers of at least 2^25 weights.
bool w4a16_wgmma_rule(int m, int npad, int k);

// Whether the wgmma kernel runs on the current device (compute capability 9.0 and the library built for sm_90a);
// the first call per device launches a probe and waits for it, or, with may_probe false (e.g. while a CUDA graph
// is captured, where that wait is not allowed), says no while the answer is not known yet.
bool w4a16_wgmma_available(bool may_probe = true);

// y = x @ W^T (+ bias), fused dequantization; returns the launch error, if any.
cudaError_t w4a16_gemm(const GemmArgs& a, const GemmPlan& plan, cudaStream_t stream);

// The dense weight [N, K] (x's dtype; nvfp4 with the global scale applied in fp32 before the rounding), for the
// large-M path (dense GEMM) and for tests. w must be 16-byte aligned (written in 16-byte pieces of rows).
cudaError_t w4a16_dequant(const int32_t* qpack, const void* scales, const uint8_t* zeros, void* w, int n, int npad,
                          int k, int group_size, float global_scale, int kind, bool bf16, cudaStream_t stream);

}  // namespace cuda
}  // namespace hf_w4
