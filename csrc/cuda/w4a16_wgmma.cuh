// The Hopper kernel (sm_90a only): wgmma.mma_async with the dequantized weights as the A operand from registers, for
// M from 64 on large layers; launched by w4a16_wgmma.cu.
#pragma once
#include "w4a16_device.cuh"
#include "w4a16_kernels.h"

namespace hf_w4 {
namespace cuda {
namespace {

// ---- Hopper (sm_90a): wgmma.mma_async with the weights as the A operand, from registers. A warpgroup (4 warps)
// multiplies one 64-column tile by ROWS rows of x per k16 step: warp w dequantizes word w of each lane's packed 16
// bytes, which is the mma.m16n8k16 A fragment of columns 16 w .. 16 w + 15 (as the MR = 8 path's transposed product)
// and also wgmma's A layout for rows 16 w .. 16 w + 15 of the 64; B (ROWS x 16) is the rows of x in shared memory,
// K-major in 8 x 16-byte core matrices (no swizzle). D holds y^T: 64 columns x ROWS rows. A block holds NWG
// warpgroups on NWG adjacent column tiles that share the staged rows of x: the rows are read from L2 once per NWG
// tiles, and the 4-bit weights are an eighth of the bytes of the rows they multiply (ROWS = 128: 4 KB of x and 512 B
// of weights per warpgroup and k16 step), so the L2 traffic per mma falls almost NWG-fold. Built with NWG = 4 and
// ROWS = 64 or 128: on an H100 blocks of 1 or 2 warpgroups (and 256 rows, which only they can hold) were slower at
// every shape and M measured. The body exists only in sm_90a code.
// Chunks in the block's ring: WS - 2 in flight while one is computed and the previous one's last wgmmas may still
// read its slot. One block runs per SM (registers), and its weights stream from DRAM at (bytes in flight) / latency:
// at ~1.5 us an SM's share of the H100's bandwidth (25 GB/s) needs ~38 KB of weights in flight, 19 k16 steps of 4
// tiles. 64 rows per block (a step is 32 tensor-core cycles per warpgroup) keep 6 chunks = 24 steps = 48 KB in
// flight (ring: up to 152 KB); 128 rows (64 cycles per step: half that rate) 4 chunks = 32 KB (up to 162 KB).
template <int ROWS>
constexpr int wg_slots() { return ROWS == 64 ? 8 : 6; }
// wgmma left in flight by each warpgroup's wait after an issue: step i + 1 is dequantized (into the A registers of
// step i + 1 - kWgSteps, complete) while steps i - 1 and i run, so the tensor cores keep a queue from every warpgroup
constexpr int kWgInFlight = 2;
static_assert(kWgInFlight < kWgSteps, "the A registers written next belong to a completed wgmma");

template <int KIND, int NWG, int ROWS>
struct WgSlot {
  static_assert(ROWS == 64 || ROWS == 128, "wgmma n = 64 or 128 rows of x");
  uint4 w[NWG][kWgSteps][32];
  uint4 s[NWG][scale_pieces<KIND, kWgSteps>()];
  uint4 x[kWgSteps][ROWS / 8][2][8];  // per step: core matrix (8-row group, k half), its 8 rows of 16 bytes
};
template <int KIND, int NWG, int ROWS>
constexpr int wg_ring_bytes() { return wg_slots<ROWS>() * (int)sizeof(WgSlot<KIND, NWG, ROWS>); }

// The wgmma kernel's device helpers, compiled where its body is (sm_90a, and the emulation)
#if defined(HF_W4_CUDA_EMULATE) || defined(__CUDA_ARCH_FEAT_SM90_ALL)
// 32-bit shared-memory address of p (the emulation: its offset in the block's shared memory)
__device__ __forceinline__ uint32_t smem_addr(const void* p) {
#if defined(HF_W4_CUDA_EMULATE)
  return hf_w4_emu::smem_offset(p);
#else
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
#endif
}
// wgmma shared-memory descriptor of a K-major B operand without swizzle: start address, the offset between the two
// core matrices of a k16 step (K direction, 128 bytes) and between 8-row groups (256 bytes), all in 16-byte units.
// Adding n to it moves the start n x 16 bytes: the 14-bit start field spans all 228 KB of shared memory (no carry).
__device__ __forceinline__ uint64_t wg_desc(const void* b) {
  return (uint64_t)((smem_addr(b) >> 4) & 0x3fff) | (uint64_t)(128 >> 4) << 16 | (uint64_t)(256 >> 4) << 32;
}

// Orders this thread's generic-proxy writes to shared memory (the cp.async copies) before wgmma's reads of them
__device__ __forceinline__ void fence_proxy_async() {
#if !defined(HF_W4_CUDA_EMULATE)
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
#endif
}

// the accumulator operands of one wgmma: "+f" of d[i] for 8 consecutive i
#define HF_W4_D8(i)                                                                                               \
  "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), "+f"(d[i + 6]), \
      "+f"(d[i + 7])

// Issues d (64 x N, fp32, this thread's N / 2 values) += A (64 x 16, registers) x B (16 x N, shared memory at desc)
// as a commit group of its own, N = 64 or 128. Until wgmma_wait has completed it, d must not be touched and A's
// registers and B's shared memory must keep their contents (wgmmas on the same d may be issued meanwhile: they run in
// order).
template <bool BF16, int N>
__device__ __forceinline__ void wgmma_issue(float (&d)[N / 2], const uint32_t (&a)[4], uint64_t desc) {
#if defined(HF_W4_CUDA_EMULATE)
  hf_w4_emu::wgmma_m64k16_async<BF16>(d, a, desc, N);
  hf_w4_emu::wgmma_commit();
#else
  asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#define HF_W4_WGMMA_N64(TYPE)                                                                                          \
  asm volatile(                                                                                                        \
      "{\n .reg .pred p;\n setp.ne.b32 p, %37, 0;\n"                                                                   \
      "wgmma.mma_async.sync.aligned.m64n64k16.f32." TYPE "." TYPE " {"                                                 \
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "                                         \
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"                                 \
      "}, {%32, %33, %34, %35}, %36, p, 1, 1, 0;\n}\n"                                                                 \
      : HF_W4_D8(0), HF_W4_D8(8), HF_W4_D8(16), HF_W4_D8(24)                                                           \
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(1))
#define HF_W4_WGMMA_N128(TYPE)                                                                                         \
  asm volatile(                                                                                                        \
      "{\n .reg .pred p;\n setp.ne.b32 p, %69, 0;\n"                                                                   \
      "wgmma.mma_async.sync.aligned.m64n128k16.f32." TYPE "." TYPE " {"                                                \
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "                                         \
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "                               \
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "                               \
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"                                 \
      "}, {%64, %65, %66, %67}, %68, p, 1, 1, 0;\n}\n"                                                                 \
      : HF_W4_D8(0), HF_W4_D8(8), HF_W4_D8(16), HF_W4_D8(24), HF_W4_D8(32), HF_W4_D8(40), HF_W4_D8(48),                \
        HF_W4_D8(56)                                                                                                   \
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(1))
  if constexpr (N == 64) {
    if constexpr (BF16) HF_W4_WGMMA_N64("bf16");
    else HF_W4_WGMMA_N64("f16");
  } else {
    if constexpr (BF16) HF_W4_WGMMA_N128("bf16");
    else HF_W4_WGMMA_N128("f16");
  }
#undef HF_W4_WGMMA_N64
#undef HF_W4_WGMMA_N128
  asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
#endif
}

// Waits until at most PENDING of this thread's wgmma groups are in flight; d may be read after PENDING = 0
template <int PENDING, int N>
__device__ __forceinline__ void wgmma_wait(float (&d)[N / 2]) {
#if defined(HF_W4_CUDA_EMULATE)
  hf_w4_emu::wgmma_wait(PENDING);
#else
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(PENDING) : "memory");
  // keep the compiler from moving reads of d before the wait
#pragma unroll
  for (int i = 0; i < N / 2; ++i) asm volatile("" : "+f"(d[i])::"memory");
#endif
}

// The A registers of a wgmma stay allocated (not reused) up to here: after the wait that completed it
__device__ __forceinline__ void keep_until_here(const uint32_t (&a)[4]) {
#if !defined(HF_W4_CUDA_EMULATE)
#pragma unroll
  for (int i = 0; i < 4; ++i) asm volatile("" ::"r"(a[i]) : "memory");
#else
  (void)a;
#endif
}
#undef HF_W4_D8

// Word j of a lane's tile of step i of a chunk (chunk_tile's weights, scales, zero points of sub-tiles 2 j, 2 j + 1)
// as sub-tiles 0 and 1, read alone from shared memory: a warp-dependent j indexes addresses, not registers (selects
// from whole 16-byte loads, or local memory), and NVFP4 decodes one scale pair, not four
template <class A, int KIND, int STEPS>
__device__ __forceinline__ WTile chunk_word(const uint4 (&w)[STEPS][32], const uint4* s, int i, int lane, int j) {
  const int g = lane >> 2;
  WTile r;
  r.w = make_uint4(reinterpret_cast<const uint32_t*>(&w[i][lane])[j], 0u, 0u, 0u);
  r.z = make_uint2(0u, 0u);
  if constexpr (KIND == kNvfp4) {  // E4M3 bytes 2 j, 2 j + 1 of the column's 8
    r.s = make_uint4(scale_pair<A>(reinterpret_cast<const uint16_t*>(s + 4 * i)[4 * g + j], 0), 0u, 0u, 0u);
  } else {
    r.s = make_uint4(reinterpret_cast<const uint32_t*>(s + 8 * i + g)[j], 0u, 0u, 0u);
    if constexpr (KIND == kInt4Asym) r.z.x = reinterpret_cast<const uint16_t*>(s + 8 * STEPS + 4 * i)[4 * g + j];
  }
  return r;
}
#endif

// Block: NWG warpgroups; warpgroup wg takes column tile NWG blockIdx.y + wg (none past the last) x ROWS rows (block
// blockIdx.x) over its split of K, chunks of kWgSteps steps through a block-wide ring of wg_slots slots: thread q of a
// warpgroup copies piece q of its tile's weights (step q / 32) and scale / zero-point piece q if there is one, all
// threads the shared rows of x, rows past M zero-filled. Each step's wgmma runs while the next steps are dequantized
// (wait_group kWgInFlight), so a chunk's last wgmmas may still read its slot at the next chunk's barrier: the ring
// refills the slot of the chunk before (stream_ring's LAG = 2). Split-K (blockIdx.z: steps_per_split k16 steps each) as
// the fused kernels: every split stores its partial tile, and the last block to arrive at a tile's counter adds them in
// split order.
template <bool BF16, int KIND, int NWG, int ROWS>
__global__ void __launch_bounds__(128 * NWG) w4a16_wgmma_kernel(const GemmArgs a, const int ntiles, const int splits,
                                                                 const int steps_per_split) {
#if defined(HF_W4_CUDA_EMULATE) || defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using A = DevAct<BF16>;
  using Slot = WgSlot<KIND, NWG, ROWS>;
  constexpr int S = kWgSteps;
  extern __shared__ uint4 smem[];
  const int tid = threadIdx.x, wg = tid >> 7, q = tid & 127, warp = q >> 5, lane = tid & 31;
  const int mb = blockIdx.x, nt = NWG * blockIdx.y + wg, m0 = mb * ROWS, split = blockIdx.z;
  // A warpgroup past the last tile multiplies the last one again and stores nothing: no branch around the wgmma
  // (ptxas serializes the wgmma pipeline where it sits in a path it cannot prove uniform)
  const bool has_tile = nt < ntiles;
  const int g = lane >> 2, t = lane & 3;
  const int gsteps = a.group_size >> 4, ksteps = a.k / 16, kb = split * steps_per_split;
  const int end = ksteps < kb + steps_per_split ? ksteps : kb + steps_per_split;
  const int nchunks = (end - kb + S - 1) / S;
  prefetch_tile<KIND>(a, nt, kb, end, has_tile && q == 0);
  await_prior_kernel();
  Slot* ring = reinterpret_cast<Slot*>(smem);
  // This thread's weight piece (step `warp`, 16 bytes `lane`: the packed strip is contiguous along K, so piece q of
  // a chunk lies 16 q bytes past its start) and scale piece (q below scale_pieces, step cs.sstep)
  ChunkSource<1, KIND> cs = chunk_source<1, KIND, S>(a, kb, has_tile ? nt : ntiles - 1, 0, q);
  const uint16_t* x = static_cast<const uint16_t*>(a.x);
  // This thread's 16-byte pieces of x per chunk: row (tid / 2) % ROWS, k half tid % 2, steps xstep + j kStride
  constexpr int kStride = 128 * NWG / (2 * ROWS), kPer = S / kStride;
  static_assert(kStride * 2 * ROWS == 128 * NWG && kPer * kStride == S, "the threads cover a chunk's rows evenly");
  const int row = (tid >> 1) % ROWS, half = tid & 1, xstep = tid / (2 * ROWS);
  const int xoff = ((xstep * (ROWS / 8) + (row >> 3)) * 2 + half) * 8 + (row & 7);  // uint4 index in a slot's x
  const bool xrow = m0 + row < a.m;
  const uint16_t* xsrc = xrow ? x + (size_t)(m0 + row) * a.k + (kb + xstep) * 16 + half * 8 : x;
  // slot 0's destinations and B descriptor: the other slots' are constant offsets from them
  uint4* const wdst = &ring[0].w[wg][warp][lane];
  uint4* const sdst = &ring[0].s[wg][cs.scopy ? q : 0];
  uint4* const xdst = &ring[0].x[0][0][0][0] + xoff;
  const uint64_t desc0 = wg_desc(&ring[0].x[0][0][0][0]);
  constexpr int kSlotUnits = sizeof(Slot) / 16, kStepUnits = 2 * ROWS;  // uint4 per slot, per step of x
  float acc[ROWS / 2];
#pragma unroll
  for (int i = 0; i < ROWS / 2; ++i) acc[i] = 0.f;
  uint32_t af[S][4] = {};  // A of each step of a chunk (a wgmma reads its registers until its wait)
  stream_ring<wg_slots<ROWS>(), 2, true>(
      nchunks,
      [&](int slot, int c) {
        const int kt = kb + S * c;
        const bool issue = c < nchunks;
        // zero-filled past the split's end (the last steps of a short last chunk): they add 0 x (finite weights)
        const bool win = kt + warp < end, sin = kt + cs.sstep < end;
        cp_async16(wdst + slot * kSlotUnits, win ? cs.w : a.qpack, win, issue);
        cp_async16(sdst + slot * kSlotUnits, scale_piece_src<S>(cs, a, kt, sin, q, gsteps), sin, issue && cs.scopy);
        advance(cs, S);
#pragma unroll
        for (int j = 0; j < kPer; ++j) {
          const bool full = xrow && kt + xstep + j * kStride < end;
          cp_async16(xdst + slot * kSlotUnits + j * kStride * kStepUnits, full ? xsrc + j * kStride * 16 : x, full,
                     issue);
        }
        xsrc += S * 16;
      },
      [] {
        fence_proxy_async();
        __syncthreads();
      },
      [&](int slot) {
        const Slot& r = ring[slot];
        // every step's word first: the waits below are memory barriers to the compiler, and a load behind one would
        // add its latency to the wgmma pipeline's
        WTile ww[S];
#pragma unroll
        for (int i = 0; i < S; ++i) ww[i] = chunk_word<A, KIND, S>(r.w[wg], r.s[wg], i, lane, warp);
#pragma unroll
        for (int i = 0; i < S; ++i) {
          // rows 16 w + g (+ 8) = columns of sub-tiles 2 w, 2 w + 1; k 2t.. and 2t + 8..
          dequant_sub<A, KIND>(ww[i], 0, af[i][0], af[i][2]);
          dequant_sub<A, KIND>(ww[i], 1, af[i][1], af[i][3]);
          wgmma_issue<BF16, ROWS>(acc, af[i], desc0 + (slot * kSlotUnits + i * kStepUnits));
          // step i - kWgInFlight's wgmma (maybe the previous chunk's) is done: its A registers and slot are free
          wgmma_wait<kWgInFlight, ROWS>(acc);
          keep_until_here(af[(i + S - kWgInFlight) % S]);
        }
      });
  wgmma_wait<0, ROWS>(acc);
  // acc[4 j + r]: column nt 64 + 16 warp + g + 8 (r >> 1), row m0 + 8 j + 2 t + (r & 1)
  if (splits > 1) {
    // a split's partial tile: [64 columns][ROWS rows] fp32, so that a thread's two rows of a column are one float2
    __shared__ int last[NWG];
    float* part = a.workspace + (size_t)(mb * ntiles + (has_tile ? nt : 0)) * splits * (ROWS * 64);
    const auto at = [&](int j, int h) { return (16 * warp + g + 8 * h) * ROWS + 8 * j + 2 * t; };
    if (has_tile)
#pragma unroll
      for (int j = 0; j < ROWS / 8; ++j)
#pragma unroll
        for (int h = 0; h < 2; ++h)
          if (m0 + 8 * j + 2 * t < a.m)
            __stcg(reinterpret_cast<float2*>(part + (size_t)split * (ROWS * 64) + at(j, h)),
                   make_float2(acc[4 * j + 2 * h], acc[4 * j + 2 * h + 1]));
    __threadfence();
    __syncthreads();
    if ((tid & 127) == 0) last[wg] = has_tile && atomicAdd(a.counters + mb * ntiles + nt, 1) == splits - 1;
    __syncthreads();
    if (!last[wg]) return;
    __threadfence();
    // the last split of this tile adds all splits in split order (the same order in every run)
#pragma unroll
    for (int j = 0; j < ROWS / 8; ++j)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float2 v = make_float2(0.f, 0.f);
        if (m0 + 8 * j + 2 * t < a.m)
          for (int sp = 0; sp < splits; ++sp) {
            const float2 p = __ldcg(reinterpret_cast<const float2*>(part + (size_t)sp * (ROWS * 64) + at(j, h)));
            v.x += p.x;
            v.y += p.y;
          }
        acc[4 * j + 2 * h] = v.x;
        acc[4 * j + 2 * h + 1] = v.y;
      }
    if ((tid & 127) == 0) a.counters[mb * ntiles + nt] = 0;
  }
  if (!has_tile) return;
#pragma unroll
  for (int j = 0; j < ROWS / 8; ++j)
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const int row = m0 + 8 * j + 2 * t + (r & 1), col = nt * 64 + 16 * warp + g + 8 * (r >> 1);
      if (row < a.m && col < a.n) store_y<A, KIND>(a, row, col, acc[4 * j + r]);
    }
#endif
}

}  // namespace
}  // namespace cuda
}  // namespace hf_w4
