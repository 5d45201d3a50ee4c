// The GEMM kernel families' launchers and occupancy queries, for the plan and dispatch in w4a16_gemm.cu. Each family
// is its own translation unit, so that a build compiles them side by side (the wide and the wgmma kernels take most
// of the compile time): the fused mma.sync kernel (w4a16_mma.cu), its wide variant (w4a16_wide.cu), both from
// w4a16_mma.cuh, and the sm_90a wgmma kernel (w4a16_wgmma.cu, from w4a16_wgmma.cuh).
#pragma once
#include "w4a16_launch.h"

namespace hf_w4 {
namespace cuda {

// The mma.sync kernels' tilings (MT, MR): 0 = (1, 8), 1 = (1, 16), 2 = (2, 16), 3 = (4, 16)
constexpr int kTilings = 4;
inline int mma_tiling(int mt, int mr) { return mt == 4 ? 3 : (mt == 2 ? 2 : (mr == 8 ? 0 : 1)); }

// The wgmma kernel's blocks: 4 warpgroups, each on one 64-column tile, by 64 or 128 rows (its plans: mt = rows / 16)
constexpr int kWgmmaWarpgroups = 4;
// k16 steps per chunk: one per warp of a warpgroup, each of whose threads copies one 16-byte piece of weights per
// chunk; twice the fused kernels' chunk, so the block-wide barrier, the proxy fence and the copies' bookkeeping come
// once per four wgmma of a warpgroup
constexpr int kWgSteps = 4;

// The fused kernel (WIDE false) or its wide variant (true) in the plan's tiling; blocks of it resident per SM
template <bool BF16, int KIND, bool WIDE>
void launch_mma(const GemmArgs& a, const GemmPlan& p, cudaStream_t stream);
template <bool BF16, int KIND, bool WIDE>
int mma_blocks_per_sm(int tiling);

// The wgmma kernel by the plan's rows; blocks of it with `rows` rows resident per SM
template <bool BF16, int KIND>
void launch_wgmma(const GemmArgs& a, const GemmPlan& p, cudaStream_t stream);
template <bool BF16, int KIND>
int wgmma_blocks_per_sm(int rows);

// X(BF16, KIND) for every activation type and weight kind: the instantiations of a family's translation unit
#define HF_W4_EACH_TYPE_AND_KIND(X) \
  X(false, kInt4Sym) X(false, kInt4Asym) X(false, kNvfp4) X(true, kInt4Sym) X(true, kInt4Asym) X(true, kNvfp4)

}  // namespace cuda
}  // namespace hf_w4
