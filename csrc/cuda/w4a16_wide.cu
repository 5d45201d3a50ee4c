// The wide mma.sync kernel (w4a16_gemm_wide_kernel, w4a16_mma.cuh) in every tiling, activation type and weight
// kind: a translation unit of its own, compiled beside the other kernel families (w4a16_kernels.h).
#include "w4a16_mma.cuh"

namespace hf_w4 {
namespace cuda {

#define HF_W4_INSTANTIATE(BF16, KIND)                                                          \
  template void launch_mma<BF16, KIND, true>(const GemmArgs&, const GemmPlan&, cudaStream_t); \
  template int mma_blocks_per_sm<BF16, KIND, true>(int);
HF_W4_EACH_TYPE_AND_KIND(HF_W4_INSTANTIATE)
#undef HF_W4_INSTANTIATE

}  // namespace cuda
}  // namespace hf_w4
