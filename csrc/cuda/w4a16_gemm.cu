// CUDA W4A16 kernels (int4 with group scales / zero points, NVFP4) for sm_80+: the plan (which kernel, how split) and
// the dispatch to the GEMM kernel families (w4a16_kernels.h: the mma.sync kernels for small M, the sm_90a wgmma
// kernel, each in a translation unit of its own), and the dequantize-to-dense kernel for the large-M path (dense GEMM
// by cuBLAS). No torch headers: the glue in w4a16_torch.cpp passes raw pointers (w4a16_launch.h). Device building
// blocks: w4a16_device.cuh; arithmetic: w4a16_math.cuh.
#include "w4a16_device.cuh"
#include "w4a16_kernels.h"

namespace hf_w4 {
namespace cuda {
namespace {

// Block: one 64-column tile x kDqSteps k16 steps. Warp w dequantizes step kt0 + w (each lane its 64 weights) into a
// shared [64 n][kDqSteps * 16 k] tile; the block then writes whole 16-byte pieces of rows of the dense [N, K]
// (row-major) output, so a warp stores two contiguous 256-byte row segments instead of scattered 4-byte pairs.
constexpr int kDqSteps = 8;

template <bool BF16, int KIND>
__global__ void __launch_bounds__(32 * kDqSteps) w4a16_dequant_kernel(const GemmArgs a, const int ntiles, uint16_t* w) {
#if defined(HF_W4_DEVICE_CODE)
  using A = DevAct<BF16>;
  constexpr int kRowWords = kDqSteps * 8 + 4;  // k pairs per row, + 4 words: the lanes of a store hit 32 banks
  __shared__ __align__(16) uint32_t tile[64 * kRowWords];
  const int nt = blockIdx.x, kt0 = blockIdx.y * kDqSteps;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int nsteps = a.k / 16 - kt0 < kDqSteps ? a.k / 16 - kt0 : kDqSteps;
  if (warp < nsteps) {
    const int kt = kt0 + warp;
    const WTile t = load_wtile<A, KIND>(a, kt, nt, lane);
#pragma unroll
    for (int sub = 0; sub < 8; ++sub) {
      uint32_t b[2];
      dequant_sub<A, KIND>(t, sub, b[0], b[1]);
      if constexpr (KIND == kNvfp4) {  // global scale in fp32 before the one rounding into x's dtype
        const float gscale = a.global_scale * kNvfp4Unscale;
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const float2 f = A::to_float2(b[r]);
          b[r] = A::from_float2(make_float2(f.x * gscale, f.y * gscale));
        }
      }
      const int row = frag_n(nt, lane, sub >> 1, 2 * (sub & 1)) - nt * 64;
#pragma unroll
      for (int r = 0; r < 2; ++r) tile[row * kRowWords + (frag_k(kt, lane, r) - kt0 * 16) / 2] = b[r];
    }
  }
  __syncthreads();
  const int pieces = 2 * nsteps;  // 16-byte pieces (8 k) per row
  for (int i = threadIdx.x; i < 64 * pieces; i += 32 * kDqSteps) {
    const int row = i / pieces, pc = i - row * pieces, n = nt * 64 + row;
    if (n < a.n)
      *reinterpret_cast<uint4*>(w + (size_t)n * a.k + kt0 * 16 + pc * 8) =
          *reinterpret_cast<const uint4*>(tile + row * kRowWords + pc * 4);
  }
#endif
}

// the tilings of the plans: the mma.sync kernels' (0-3, mma_tiling), plain or wide (+ kTilings), and the wgmma
// kernel's (+ 0 / 1: 64 or 128 rows; its plans have mt = rows / 16)
constexpr int kWgmmaTiling = 2 * kTilings, kAllTilings = kWgmmaTiling + 2;
int tiling(int mt, int mr, bool wide, bool wgmma = false) {
  if (wgmma) return kWgmmaTiling + (mt == 4 ? 0 : 1);
  return mma_tiling(mt, mr) + (wide ? kTilings : 0);
}

// Rows of x per wgmma block for M rows: 64 up to M = 64 (no half-empty blocks), else 128 (64-row blocks were slower
// above M = 64 on every layer the rule takes the kernel for)
int wgmma_rows_for(int m) { return m <= 64 ? 64 : 128; }

template <bool BF16, int KIND>
int blocks_per_sm_any(int t) {
  if (t >= kWgmmaTiling) return wgmma_blocks_per_sm<BF16, KIND>(t == kWgmmaTiling ? 64 : 128);
  return t >= kTilings ? mma_blocks_per_sm<BF16, KIND, true>(t - kTilings) : mma_blocks_per_sm<BF16, KIND, false>(t);
}

template <bool BF16, int KIND>
void launch_gemm_any(const GemmArgs& a, const GemmPlan& p, cudaStream_t stream) {
  if (p.wgmma) launch_wgmma<BF16, KIND>(a, p, stream);
  else if (p.wide) launch_mma<BF16, KIND, true>(a, p, stream);
  else launch_mma<BF16, KIND, false>(a, p, stream);
}

template <bool BF16>
void launch_gemm_kind(const GemmArgs& a, const GemmPlan& p, cudaStream_t stream) {
  if (a.kind == kNvfp4) launch_gemm_any<BF16, kNvfp4>(a, p, stream);
  else if (a.kind == kInt4Asym) launch_gemm_any<BF16, kInt4Asym>(a, p, stream);
  else launch_gemm_any<BF16, kInt4Sym>(a, p, stream);
}

template <bool BF16>
void launch_dequant_kind(const GemmArgs& a, int ntiles, uint16_t* w, cudaStream_t stream) {
  const dim3 grid(ntiles, (a.k / 16 + kDqSteps - 1) / kDqSteps);
  constexpr int threads = 32 * kDqSteps;
  const auto kernel = a.kind == kNvfp4      ? w4a16_dequant_kernel<BF16, kNvfp4>
                      : a.kind == kInt4Asym ? w4a16_dequant_kernel<BF16, kInt4Asym>
                                            : w4a16_dequant_kernel<BF16, kInt4Sym>;
  launch_kernel(kernel, grid, threads, 0, stream, false, a, ntiles, w);
}

// Blocks of the fused kernel for (mt, mr, wide, dtype, kind), or of the wgmma kernel, resident per SM on the current
// device (the occupancy API, once; also sets the kernel's shared memory limit).
int w4a16_gemm_blocks_per_sm(int mt, int mr, bool bf16, int kind, bool wide, bool wgmma = false) {
  static int cache[16][kAllTilings][2][3] = {};  // device, tiling, bf16, kind
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= 16) dev = 0;
  const int t = tiling(mt, mr, wide, wgmma), ki = kind == kNvfp4 ? 2 : (kind == kInt4Asym ? 1 : 0);
  int& c = cache[dev][t][bf16 ? 1 : 0][ki];
  if (!c) {
    if (bf16) c = kind == kNvfp4 ? blocks_per_sm_any<true, kNvfp4>(t)
                                 : (kind == kInt4Asym ? blocks_per_sm_any<true, kInt4Asym>(t)
                                                      : blocks_per_sm_any<true, kInt4Sym>(t));
    else c = kind == kNvfp4 ? blocks_per_sm_any<false, kNvfp4>(t)
                            : (kind == kInt4Asym ? blocks_per_sm_any<false, kInt4Asym>(t)
                                                 : blocks_per_sm_any<false, kInt4Sym>(t));
  }
  return c;
}

// w4a16_wgmma_available's probe: whether this device runs sm_90a code of the library
#if !defined(HF_W4_CUDA_EMULATE)
__global__ void wgmma_probe_kernel(int* built) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  *built = 1;
#else
  *built = 0;
#endif
}
#endif

}  // namespace

// Whether the wgmma kernel runs on the current device: compute capability 9.0 and the library's code for it built
// for sm_90a (a one-thread probe, once per device; the emulation always has it)
bool w4a16_wgmma_available(bool may_probe) {
#if defined(HF_W4_CUDA_EMULATE)
  (void)may_probe;
  return true;
#else
  static int cache[16] = {};  // 0 unknown, 1 yes, 2 no
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= 16) return false;
  if (!cache[dev] && may_probe) {
    int major = 0, minor = 0, built = 0;
    int* flag = nullptr;
    bool ok = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) == cudaSuccess &&
              cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev) == cudaSuccess &&
              major == 9 && minor == 0 && cudaMalloc(&flag, sizeof(int)) == cudaSuccess;
    if (ok) {
      wgmma_probe_kernel<<<1, 1>>>(flag);
      ok = cudaMemcpy(&built, flag, sizeof(int), cudaMemcpyDeviceToHost) == cudaSuccess && built == 1;
    }
    if (flag) (void)cudaFree(flag);
    (void)cudaGetLastError();
    cache[dev] = ok ? 1 : 2;
  }
  return cache[dev] == 1;
#endif
}

// Measured on an H100 (docs/cuda-kernels.md): from M = 64 the kernel beat the mma.sync kernels (M = 64) and
// dequantize + cuBLAS (M = 256) by 1.03-1.43x on layers of 58M and 235M weights, and lost on those of 4M and 17M (too
// few column tiles to fill 132 SMs without deep split-K)
bool w4a16_wgmma_rule(int m, int npad, int k) {
  return m >= 64 && (int64_t)npad * k >= (int64_t{1} << 25);
}

GemmPlan w4a16_gemm_plan(int m, int npad, int k, bool bf16, int kind, int sms, int mt, int wide, int* blocks_per_sm,
                         int splits, bool wgmma, int wgmma_rows) {
  if (wgmma) {  // 4 warpgroups x 64 columns by wgmma_rows_for rows; split-K as the fused kernels
    const int rows = wgmma_rows == 64 || wgmma_rows == 128 ? wgmma_rows : wgmma_rows_for(m);
    const int bps = w4a16_gemm_blocks_per_sm(rows / 16, 16, bf16, kind, false, true);
    if (blocks_per_sm) *blocks_per_sm = bps;
    GemmPlan p = plan_gemm(m, npad, k, sms * bps, rows / 16, false, splits, kWgmmaWarpgroups, kWgSteps);
    p.wgmma = kWgmmaWarpgroups;
    p.mr = 16;
    return p;
  }
  int t = mt ? mt : plan_mt(m, k);
  bool w = wide > 0;
  if (!mt && wide < 0 && m > 8 && m <= 64 && npad / 64 >= 3 * sms) {
    // 9-64 rows of a layer of at least three column tiles per SM (70B-class gate / up projections): the wide
    // kernel, one m16 tile per block up to 16 rows, two above; on 28672 x 8192 6-30 % faster at M = 16, 32 and 64
    // than the plain kernel's tiling, in the tiling tables of an H100 and two H200 runs (slower on narrower layers)
    w = true;
    t = m <= 16 ? 1 : 2;
  } else if (!mt && !w && m > 8 && m <= 16 && npad / 64 <= sms * w4a16_gemm_blocks_per_sm(2, 16, bf16, kind, false)) {
    // 9-16 rows: blocks of two m16 tiles (the second one empty) where one wave of them holds every column tile. Fewer
    // blocks reside and K is split fewer times; measured 3-17 % faster than one tile at M = 16 on three of the
    // benchmark's shapes on an H100 and an H200 (the fourth, 28672 x 8192, would need two waves of them)
    t = 2;
  }
  const int bps = w4a16_gemm_blocks_per_sm(t, plan_rows(m, t), bf16, kind, w);
  if (blocks_per_sm) *blocks_per_sm = bps;
  return plan_gemm(m, npad, k, sms * bps, t, w, splits);
}

cudaError_t w4a16_gemm(const GemmArgs& a, const GemmPlan& plan, cudaStream_t stream) {
  if (a.m <= 0 || a.n <= 0) return cudaSuccess;
  // once per device and kernel: shared memory opt-in
  (void)w4a16_gemm_blocks_per_sm(plan.mt, plan.mr, a.bf16, a.kind, plan.wide, plan.wgmma);
  if (a.bf16) launch_gemm_kind<true>(a, plan, stream);
  else launch_gemm_kind<false>(a, plan, stream);
  return cudaGetLastError();
}

cudaError_t w4a16_dequant(const int32_t* qpack, const void* scales, const uint8_t* zeros, void* w, int n, int npad,
                          int k, int group_size, float global_scale, int kind, bool bf16, cudaStream_t stream) {
  if (n <= 0 || k <= 0) return cudaSuccess;
  GemmArgs a{};
  a.qpack = qpack;
  a.scales = scales;
  a.zeros = zeros;
  a.n = n;
  a.npad = npad;
  a.k = k;
  a.group_size = group_size;
  a.global_scale = global_scale;
  a.kind = kind;
  a.bf16 = bf16;
  if (bf16) launch_dequant_kind<true>(a, npad / 64, static_cast<uint16_t*>(w), stream);
  else launch_dequant_kind<false>(a, npad / 64, static_cast<uint16_t*>(w), stream);
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace hf_w4
