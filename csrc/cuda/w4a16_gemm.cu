// CUDA W4A16 kernels (int4 with group scales / zero points, NVFP4) for sm_80+: a fused dequantize + mma.sync
// kernel for small M and a dequantize-to-dense kernel for the large-M path (dense GEMM by cuBLAS). No torch
// headers: the glue in w4a16_torch.cpp passes raw pointers (w4a16_launch.h). Arithmetic: w4a16_math.cuh.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "w4a16_launch.h"
#include "w4a16_math.cuh"

namespace hf_w4 {
namespace cuda {
namespace {

__device__ __forceinline__ __half2 as_h2(uint32_t v) { return *reinterpret_cast<const __half2*>(&v); }
__device__ __forceinline__ __nv_bfloat162 as_b2(uint32_t v) { return *reinterpret_cast<const __nv_bfloat162*>(&v); }
__device__ __forceinline__ uint32_t bits(__half2 v) { return *reinterpret_cast<const uint32_t*>(&v); }
__device__ __forceinline__ uint32_t bits(__nv_bfloat162 v) { return *reinterpret_cast<const uint32_t*>(&v); }

// fp16x2 / bf16x2 arithmetic on bit patterns for the recipes of w4a16_math.cuh (one RNE rounding per operation)
struct DevF16 {
  static constexpr bool kBF16 = false;
  __device__ static __forceinline__ uint32_t sub2(uint32_t a, uint32_t b) { return bits(__hsub2(as_h2(a), as_h2(b))); }
  __device__ static __forceinline__ uint32_t mul2(uint32_t a, uint32_t b) { return bits(__hmul2(as_h2(a), as_h2(b))); }
  __device__ static __forceinline__ uint32_t from_f16x2(uint32_t v) { return v; }
  __device__ static __forceinline__ uint32_t from_float2(float2 v) { return bits(__float22half2_rn(v)); }
  __device__ static __forceinline__ float to_float(uint16_t v) { return __half2float(__ushort_as_half(v)); }
  __device__ static __forceinline__ uint16_t from_float(float v) { return __half_as_ushort(__float2half_rn(v)); }
};
struct DevBF16 {
  static constexpr bool kBF16 = true;
  __device__ static __forceinline__ uint32_t sub2(uint32_t a, uint32_t b) { return bits(__hsub2(as_b2(a), as_b2(b))); }
  __device__ static __forceinline__ uint32_t mul2(uint32_t a, uint32_t b) { return bits(__hmul2(as_b2(a), as_b2(b))); }
  __device__ static __forceinline__ uint32_t from_f16x2(uint32_t v) { return from_float2(__half22float2(as_h2(v))); }
  __device__ static __forceinline__ uint32_t from_float2(float2 v) { return bits(__float22bfloat162_rn(v)); }
  __device__ static __forceinline__ float to_float(uint16_t v) { return __bfloat162float(__ushort_as_bfloat16(v)); }
  __device__ static __forceinline__ uint16_t from_float(float v) { return __bfloat16_as_ushort(__float2bfloat16_rn(v)); }
};
template <bool BF16> struct DevAct;
template <> struct DevAct<false> : DevF16 {};
template <> struct DevAct<true> : DevBF16 {};

// 16 bytes read once by one lane: through L2 only, no L1 allocation
__device__ __forceinline__ uint4 ld_stream(const int32_t* p) {
  uint4 r;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
  return r;
}

// Asynchronous 16-byte copy global -> shared through L2 only (cp.async.cg), its commit group and the wait for all
// but the N most recent groups (the copies become visible to the issuing thread)
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(gmem) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

template <bool BF16>
__device__ __forceinline__ void mma16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  if constexpr (BF16) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
                 "{%8, %9}, {%0, %1, %2, %3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
                 "{%8, %9}, {%0, %1, %2, %3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

// One lane's weights, scales and zero points for one (k16 step, 64-column tile)
struct WTile {
  uint4 w;  // 4 words: 8 sub-tiles x 2 fragment registers x 2 k
  uint4 s;  // int4: 8 scales (x's dtype) of sub-tiles 0..7 at column g; nvfp4: 8 E4M3 bytes in s.x, s.y
  uint2 z;  // asymmetric int4: 8 zero-point bytes
};

__device__ __forceinline__ const int32_t* wtile_ptr(const GemmArgs& a, int kt, int nt, int ntiles, int lane) {
  return a.qpack + (((size_t)kt * ntiles + nt) * 32 + lane) * 4;
}

// scales and zero points of a tile (r.w untouched)
template <int KIND>
__device__ __forceinline__ void load_scales(WTile& r, const GemmArgs& a, int kt, int nt, int ntiles, int lane) {
  const int g = lane >> 2;
  r.z = make_uint2(0u, 0u);
  if constexpr (KIND == kNvfp4) {
    const uint2 s8 = __ldg(reinterpret_cast<const uint2*>(static_cast<const uint8_t*>(a.scales) +
                                                          ((size_t)kt * ntiles + nt) * 64 + g * 8));
    r.s = make_uint4(s8.x, s8.y, 0u, 0u);
  } else {
    const size_t off = ((size_t)(kt * 16 / a.group_size) * ntiles + nt) * 64 + g * 8;
    r.s = __ldg(reinterpret_cast<const uint4*>(static_cast<const uint16_t*>(a.scales) + off));
    if constexpr (KIND == kInt4Asym) r.z = __ldg(reinterpret_cast<const uint2*>(a.zeros + off));
  }
}

template <int KIND>
__device__ __forceinline__ WTile load_wtile(const GemmArgs& a, int kt, int nt, int ntiles, int lane) {
  WTile r;
  r.w = ld_stream(wtile_ptr(a, kt, nt, ntiles, lane));
  load_scales<KIND>(r, a, kt, nt, ntiles, lane);
  return r;
}

// The two B fragment registers of sub-tile ``sub`` (0..7), dequantized into Out's type (for NVFP4 without the
// global scale)
template <class Out, int KIND>
__device__ __forceinline__ void dequant_sub(const WTile& t, int sub, uint32_t& b0, uint32_t& b1) {
  const uint32_t wv[4] = {t.w.x, t.w.y, t.w.z, t.w.w};
  const uint32_t word = wv[sub >> 1];
  const int p = sub & 1;
  if constexpr (KIND == kNvfp4) {
    const uint32_t byte = ((sub < 4 ? t.s.x : t.s.y) >> (8 * (sub & 3))) & 0xffu;
    const uint32_t s2 = nvfp4_scale2<DevF16>(byte);
    b0 = nvfp4_dequant<DevF16, Out>(word, 2 * p, s2);
    b1 = nvfp4_dequant<DevF16, Out>(word, 2 * p + 1, s2);
  } else {
    const uint32_t sv[4] = {t.s.x, t.s.y, t.s.z, t.s.w};
    const uint32_t s2 = broadcast16(sv[sub >> 1], sub & 1);
    uint32_t z2 = int4_zero_bits(8u, Out::kBF16);
    if constexpr (KIND == kInt4Asym) z2 = int4_zero_pair(sub < 4 ? t.z.x : t.z.y, sub & 3, Out::kBF16);
    b0 = int4_dequant<Out>(word, 2 * p, z2, s2);
    b1 = int4_dequant<Out>(word, 2 * p + 1, z2, s2);
  }
}

template <int MT>
struct Stage {
  WTile wt;           // scales / zero points (the weights come from the shared-memory ring)
  uint32_t a[MT][4];  // A fragments of the MT m16 tiles
};

// A fragment (row-major m16k16): a0 = (g, 2t..2t+1), a1 = (g+8, 2t..), a2 = (g, 2t+8..), a3 = (g+8, 2t+8..);
// rows past M read as zero
template <int MT, int KIND>
__device__ __forceinline__ void load_stage(Stage<MT>& st, const GemmArgs& a, int kt, int nt, int ntiles, int m0,
                                           int lane) {
  load_scales<KIND>(st.wt, a, kt, nt, ntiles, lane);
  const uint16_t* x = static_cast<const uint16_t*>(a.x);
  const int col = kt * 16 + 2 * (lane & 3);
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
    const int r0 = m0 + mt * 16 + (lane >> 2), r1 = r0 + 8;
    const uint32_t* p0 = reinterpret_cast<const uint32_t*>(x + (size_t)r0 * a.k + col);
    const uint32_t* p1 = reinterpret_cast<const uint32_t*>(x + (size_t)r1 * a.k + col);
    st.a[mt][0] = r0 < a.m ? __ldg(p0) : 0u;
    st.a[mt][1] = r1 < a.m ? __ldg(p1) : 0u;
    st.a[mt][2] = r0 < a.m ? __ldg(p0 + 4) : 0u;
    st.a[mt][3] = r1 < a.m ? __ldg(p1 + 4) : 0u;
  }
}

// Block: 4 warps, BM = 16 * MT rows x 64 columns; warp w takes the k16 steps kb + w, kb + w + 4, ... of its split.
// The weights stream through a per-lane ring of WS stages in shared memory (cp.async: many bytes in flight without
// registers; a lane reads back only the 16 bytes it copied itself, so no barrier is needed), scales and activations
// (L1 / L2 hits) through PF stages in registers. The warps' partial sums are added
// in warp order in shared memory; with split-K every split stores its partial tile and the last block to arrive
// (a per-tile counter) adds them in split order: the result does not depend on scheduling.
template <int MT, bool BF16, int KIND>
__global__ void __launch_bounds__(128) w4a16_gemm_kernel(const GemmArgs a, const int ntiles, const int splits,
                                                         const int steps_per_split) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  using A = DevAct<BF16>;
  constexpr int BM = 16 * MT;
  constexpr int PF = MT == 1 ? 4 : (MT == 2 ? 3 : 2);
  constexpr int WS = 16;  // weight stages per lane (power of 2): 32 KB of shared memory, with red at most 48 KB
  __shared__ uint4 wring[4][WS][32];
  __shared__ float red[BM * 64];
  const int nt = blockIdx.x, split = blockIdx.y, mb = blockIdx.z;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int m0 = mb * BM;
  int first;
  const int nsteps = warp_steps(a.k / 16, steps_per_split, split, warp, &first);

  float acc[MT][8][4];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int s = 0; s < 8; ++s)
#pragma unroll
      for (int r = 0; r < 4; ++r) acc[mt][s][r] = 0.f;

  // weight ring: commit group i holds step i (empty past nsteps); step s is in slot s % WS
  uint4(&wr)[WS][32] = wring[warp];
#pragma unroll
  for (int p = 0; p < WS - 1; ++p) {
    if (p < nsteps) cp_async16(&wr[p][lane], wtile_ptr(a, first + 4 * p, nt, ntiles, lane));
    cp_async_commit();
  }
  Stage<MT> ring[PF];
#pragma unroll
  for (int p = 0; p < PF; ++p)
    if (p < nsteps) load_stage<MT, KIND>(ring[p], a, first + 4 * p, nt, ntiles, m0, lane);
  for (int base = 0; base < nsteps; base += PF) {
#pragma unroll
    for (int p = 0; p < PF; ++p) {
      const int s = base + p;
      if (s < nsteps) {
        // WS - 1 + s groups committed; all but the newest WS - 2 done means groups 0..s are
        cp_async_wait<WS - 2>();
        Stage<MT> cur = ring[p];
        cur.wt.w = wr[s & (WS - 1)][lane];
        // refill the slot read at step s - 1 (already consumed by this lane) with step s + WS - 1
        const int nx = s + WS - 1;
        if (nx < nsteps) cp_async16(&wr[nx & (WS - 1)][lane], wtile_ptr(a, first + 4 * nx, nt, ntiles, lane));
        cp_async_commit();
        if (s + PF < nsteps) load_stage<MT, KIND>(ring[p], a, first + 4 * (s + PF), nt, ntiles, m0, lane);
#pragma unroll
        for (int sub = 0; sub < 8; ++sub) {
          uint32_t b0, b1;
          dequant_sub<A, KIND>(cur.wt, sub, b0, b1);
#pragma unroll
          for (int mt = 0; mt < MT; ++mt) mma16816<BF16>(acc[mt][sub], cur.a[mt], b0, b1);
        }
      }
    }
  }

  // Only the block's rows below M are reduced, stored and read back (M = 1 touches 64 of the BM x 64 values).
  // accumulator c0, c1: (row g, cols 2t, 2t+1), c2, c3: (row g+8, same cols)
  const int rows = a.m - m0 < BM ? a.m - m0 : BM, nvals = rows * 64;
  const int g = lane >> 2, t = lane & 3;
  for (int w = 0; w < 4; ++w) {
    if (warp == w) {
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int sub = 0; sub < 8; ++sub)
#pragma unroll
          for (int r = 0; r < 4; ++r) {
            const int row = mt * 16 + g + 8 * (r >> 1), i = row * 64 + sub * 8 + 2 * t + (r & 1);
            if (row < rows) red[i] = w == 0 ? acc[mt][sub][r] : red[i] + acc[mt][sub][r];
          }
    }
    __syncthreads();
  }

  if (splits > 1) {
    float* part = a.workspace + (size_t)(mb * ntiles + nt) * splits * (BM * 64);
    for (int i = tid; i < nvals; i += 128) part[(size_t)split * (BM * 64) + i] = red[i];
    __threadfence();
    __syncthreads();
    if (!__syncthreads_or(tid == 0 && atomicAdd(a.counters + mb * ntiles + nt, 1) == splits - 1)) return;
    __threadfence();
    for (int i = tid; i < nvals; i += 128) {  // each thread re-reads only its own red[i] below
      // the loads of 8 splits are issued together (independent L2 reads); the sum stays in split order
      float v = 0.f;
      for (int s0 = 0; s0 < splits; s0 += 8) {
        float p[8];
#pragma unroll
        for (int s = 0; s < 8; ++s) p[s] = s0 + s < splits ? __ldcg(part + (size_t)(s0 + s) * (BM * 64) + i) : 0.f;
#pragma unroll
        for (int s = 0; s < 8; ++s)
          if (s0 + s < splits) v += p[s];
      }
      red[i] = v;
    }
    if (tid == 0) a.counters[mb * ntiles + nt] = 0;
  }

  const uint16_t* bias = static_cast<const uint16_t*>(a.bias);
  uint16_t* y = static_cast<uint16_t*>(a.y);
  for (int i = tid; i < nvals; i += 128) {
    const int row = m0 + i / 64, col = nt * 64 + (i & 63);
    if (col < a.n) {
      float v = red[i] * a.global_scale;
      if (bias) v += A::to_float(bias[col]);
      y[(size_t)row * a.n + col] = A::from_float(v);
    }
  }
#endif
}

// Block: one 64-column tile x kDqSteps k16 steps. Warp w dequantizes step kt0 + w (each lane its 64 weights) into a
// shared [64 n][kDqSteps * 16 k] tile; the block then writes whole 16-byte pieces of rows of the dense [N, K]
// (row-major) output, so a warp stores two contiguous 256-byte row segments instead of scattered 4-byte pairs.
constexpr int kDqSteps = 8;

template <bool BF16, int KIND>
__global__ void __launch_bounds__(32 * kDqSteps) w4a16_dequant_kernel(const GemmArgs a, const int ntiles, uint16_t* w) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  using A = DevAct<BF16>;
  constexpr int kRowWords = kDqSteps * 8 + 4;  // k pairs per row, + 4 words: the lanes of a store hit 32 banks
  __shared__ __align__(16) uint32_t tile[64 * kRowWords];
  const int nt = blockIdx.x, kt0 = blockIdx.y * kDqSteps;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int nsteps = a.k / 16 - kt0 < kDqSteps ? a.k / 16 - kt0 : kDqSteps;
  if (warp < nsteps) {
    const int kt = kt0 + warp;
    const WTile t = load_wtile<KIND>(a, kt, nt, ntiles, lane);
#pragma unroll
    for (int sub = 0; sub < 8; ++sub) {
      uint32_t b[2];
      if constexpr (KIND == kNvfp4) {  // global scale in fp32 before the one rounding into x's dtype
        dequant_sub<DevF16, KIND>(t, sub, b[0], b[1]);
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const float2 f = __half22float2(as_h2(b[r]));
          b[r] = A::from_float2(make_float2(f.x * a.global_scale, f.y * a.global_scale));
        }
      } else {
        dequant_sub<A, KIND>(t, sub, b[0], b[1]);
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

template <int MT, bool BF16, int KIND>
void launch_gemm(const GemmArgs& a, const GemmPlan& p, cudaStream_t stream) {
  const dim3 grid(p.ntiles, p.splits, p.mblocks);
  w4a16_gemm_kernel<MT, BF16, KIND><<<grid, 128, 0, stream>>>(a, p.ntiles, p.splits, p.steps_per_split);
}

template <int MT, bool BF16, int KIND>
int blocks_per_sm() {
  // Prefer shared memory over L1 (the weight ring), so that the occupancy the split-K plan assumes is the one the
  // launches get; only a hint, so a failure is not an error.
  if (cudaFuncSetAttribute(w4a16_gemm_kernel<MT, BF16, KIND>, cudaFuncAttributePreferredSharedMemoryCarveout,
                           cudaSharedmemCarveoutMaxShared) != cudaSuccess)
    (void)cudaGetLastError();
  int n = 0;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, w4a16_gemm_kernel<MT, BF16, KIND>, 128, 0) != cudaSuccess) {
    (void)cudaGetLastError();  // not sticky; plan with one block per SM
    n = 1;
  }
  return n > 0 ? n : 1;
}

template <bool BF16, int KIND>
int blocks_per_sm_mt(int mt) {
  return mt == 1 ? blocks_per_sm<1, BF16, KIND>() : (mt == 2 ? blocks_per_sm<2, BF16, KIND>() : blocks_per_sm<4, BF16, KIND>());
}

template <bool BF16, int KIND>
void launch_gemm_mt(const GemmArgs& a, const GemmPlan& p, cudaStream_t stream) {
  if (p.mt == 1) launch_gemm<1, BF16, KIND>(a, p, stream);
  else if (p.mt == 2) launch_gemm<2, BF16, KIND>(a, p, stream);
  else launch_gemm<4, BF16, KIND>(a, p, stream);
}

template <bool BF16>
void launch_gemm_kind(const GemmArgs& a, const GemmPlan& p, cudaStream_t stream) {
  if (a.kind == kNvfp4) launch_gemm_mt<BF16, kNvfp4>(a, p, stream);
  else if (a.kind == kInt4Asym) launch_gemm_mt<BF16, kInt4Asym>(a, p, stream);
  else launch_gemm_mt<BF16, kInt4Sym>(a, p, stream);
}

template <bool BF16>
void launch_dequant_kind(const GemmArgs& a, int ntiles, uint16_t* w, cudaStream_t stream) {
  const dim3 grid(ntiles, (a.k / 16 + kDqSteps - 1) / kDqSteps);
  constexpr int threads = 32 * kDqSteps;
  if (a.kind == kNvfp4) w4a16_dequant_kernel<BF16, kNvfp4><<<grid, threads, 0, stream>>>(a, ntiles, w);
  else if (a.kind == kInt4Asym) w4a16_dequant_kernel<BF16, kInt4Asym><<<grid, threads, 0, stream>>>(a, ntiles, w);
  else w4a16_dequant_kernel<BF16, kInt4Sym><<<grid, threads, 0, stream>>>(a, ntiles, w);
}

}  // namespace

int w4a16_gemm_blocks_per_sm(int mt, bool bf16, int kind) {
  static int cache[16][3][2][3] = {};  // device, mt 1/2/4, bf16, kind
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= 16) dev = 0;
  const int mi = mt == 1 ? 0 : (mt == 2 ? 1 : 2), ki = kind == kNvfp4 ? 2 : (kind == kInt4Asym ? 1 : 0);
  int& c = cache[dev][mi][bf16 ? 1 : 0][ki];
  if (!c) {
    if (bf16) c = kind == kNvfp4 ? blocks_per_sm_mt<true, kNvfp4>(mt)
                                 : (kind == kInt4Asym ? blocks_per_sm_mt<true, kInt4Asym>(mt) : blocks_per_sm_mt<true, kInt4Sym>(mt));
    else c = kind == kNvfp4 ? blocks_per_sm_mt<false, kNvfp4>(mt)
                            : (kind == kInt4Asym ? blocks_per_sm_mt<false, kInt4Asym>(mt) : blocks_per_sm_mt<false, kInt4Sym>(mt));
  }
  return c;
}

cudaError_t w4a16_gemm(const GemmArgs& a, const GemmPlan& plan, cudaStream_t stream) {
  if (a.m <= 0 || a.n <= 0) return cudaSuccess;
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
