// The sm_90a wgmma kernel (w4a16_wgmma_kernel, w4a16_wgmma.cuh): its launch by the plan's rows per block and its
// occupancy, in every activation type and weight kind; a translation unit of its own, compiled beside the other kernel
// families (w4a16_kernels.h).
#include "w4a16_wgmma.cuh"

namespace hf_w4 {
namespace cuda {
namespace {

template <bool BF16, int KIND, int ROWS>
void launch_rows(const GemmArgs& a, const GemmPlan& p, cudaStream_t stream) {
  constexpr int NWG = kWgmmaWarpgroups;
  const dim3 grid(p.mblocks, (p.ntiles + NWG - 1) / NWG, p.splits);
  launch_kernel(w4a16_wgmma_kernel<BF16, KIND, NWG, ROWS>, grid, 128 * NWG, wg_ring_bytes<KIND, NWG, ROWS>(), stream,
                p.overlap, a, p.ntiles, p.splits, p.steps_per_split);
}

template <bool BF16, int KIND, int ROWS>
int rows_blocks_per_sm() {
  constexpr int NWG = kWgmmaWarpgroups;
  return resident_blocks(w4a16_wgmma_kernel<BF16, KIND, NWG, ROWS>, wg_ring_bytes<KIND, NWG, ROWS>(), 128 * NWG);
}

}  // namespace

template <bool BF16, int KIND>
void launch_wgmma(const GemmArgs& a, const GemmPlan& p, cudaStream_t stream) {
  if (p.mt == 4) launch_rows<BF16, KIND, 64>(a, p, stream);
  else launch_rows<BF16, KIND, 128>(a, p, stream);
}

template <bool BF16, int KIND>
int wgmma_blocks_per_sm(int rows) {
  return rows == 64 ? rows_blocks_per_sm<BF16, KIND, 64>() : rows_blocks_per_sm<BF16, KIND, 128>();
}

#define HF_W4_INSTANTIATE(BF16, KIND)                                                      \
  template void launch_wgmma<BF16, KIND>(const GemmArgs&, const GemmPlan&, cudaStream_t); \
  template int wgmma_blocks_per_sm<BF16, KIND>(int);
HF_W4_EACH_TYPE_AND_KIND(HF_W4_INSTANTIATE)
#undef HF_W4_INSTANTIATE

}  // namespace cuda
}  // namespace hf_w4
