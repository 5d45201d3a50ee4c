// Device building blocks of the CUDA W4A16 kernels, shared by the mma.sync kernels (w4a16_mma.cuh), the wgmma
// kernel (w4a16_wgmma.cuh) and the dequantize kernel (w4a16_gemm.cu): fp16 / bf16 bit arithmetic, the PTX wrappers
// (cp.async, mma.sync, L2 prefetch, overlapped launches), a lane's tile of weights and scales, the shared-memory
// chunk ring the kernels stream their weights through, the store of y; on the host, the launch and the occupancy
// query. Internal to the translation units of csrc/cuda (an anonymous namespace in each). Arithmetic: w4a16_math.cuh.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "w4a16_launch.h"
#include "w4a16_math.cuh"

// HF_W4_CUDA_EMULATE: built by g++ against tests/kernels/cuda_emu (a CPU stand-in for the runtime, the intrinsics and
// the PTX below), which runs the kernels on machines without a GPU for tests/kernels/test_cuda_emulated.py
#if defined(HF_W4_CUDA_EMULATE)
#define HF_W4_DEVICE_CODE 1
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
#define HF_W4_DEVICE_CODE 1
#endif

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
  __device__ static __forceinline__ uint32_t fma2(uint32_t a, uint32_t b, uint32_t c) {
    return bits(__hfma2(as_h2(a), as_h2(b), as_h2(c)));
  }
  __device__ static __forceinline__ float2 to_float2(uint32_t v) { return __half22float2(as_h2(v)); }
  __device__ static __forceinline__ uint32_t from_float2(float2 v) { return bits(__float22half2_rn(v)); }
  __device__ static __forceinline__ float to_float(uint16_t v) { return __half2float(__ushort_as_half(v)); }
  __device__ static __forceinline__ uint16_t from_float(float v) { return __half_as_ushort(__float2half_rn(v)); }
};
struct DevBF16 {
  static constexpr bool kBF16 = true;
  __device__ static __forceinline__ uint32_t sub2(uint32_t a, uint32_t b) { return bits(__hsub2(as_b2(a), as_b2(b))); }
  __device__ static __forceinline__ uint32_t mul2(uint32_t a, uint32_t b) { return bits(__hmul2(as_b2(a), as_b2(b))); }
  __device__ static __forceinline__ float2 to_float2(uint32_t v) { return __bfloat1622float2(as_b2(v)); }
  __device__ static __forceinline__ uint32_t from_float2(float2 v) { return bits(__float22bfloat162_rn(v)); }
  __device__ static __forceinline__ float to_float(uint16_t v) { return __bfloat162float(__ushort_as_bfloat16(v)); }
  __device__ static __forceinline__ uint16_t from_float(float v) { return __bfloat16_as_ushort(__float2bfloat16_rn(v)); }
};
template <bool BF16> struct DevAct;
template <> struct DevAct<false> : DevF16 {};
template <> struct DevAct<true> : DevBF16 {};

// 16 bytes read once by one lane: through L2 only, no L1 allocation
__device__ __forceinline__ uint4 ld_stream(const int32_t* p) {
#if defined(HF_W4_CUDA_EMULATE)
  return hf_w4_emu::ld_stream(p);
#else
  uint4 r;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
  return r;
#endif
}

// Asynchronous 16-byte copy global -> shared through L2 only (cp.async.cg), or 16 zero bytes (nothing read) where
// !full, or nothing where !issue: one predicated instruction, not a branch, so a chunk's copies stay in one basic
// block (ptxas pads each block's group of cp.async with three no-op loads, and the branches cost too). Then the
// commit group and the wait for all but the N most recent groups (the copies become visible to the issuing thread).
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, bool full, bool issue) {
#if defined(HF_W4_CUDA_EMULATE)
  if (issue) hf_w4_emu::cp_async16(smem, gmem, full);
#else
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile(
      "{\n .reg .pred p;\n setp.ne.b32 p, %3, 0;\n @p cp.async.cg.shared.global [%0], [%1], 16, %2;\n}\n" ::"r"(dst),
      "l"(gmem), "r"(full ? 16 : 0), "r"(issue ? 1 : 0)
      : "memory");
#endif
}
#if defined(HF_W4_CUDA_EMULATE)
__device__ __forceinline__ void cp_async_commit() { hf_w4_emu::cp_async_commit(); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { hf_w4_emu::cp_async_wait(N); }
#else
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}
#endif

// group (scale row) of k16 step kt: a shift where the group is a power-of-two number of steps
__device__ __forceinline__ int step_group(int kt, int gsteps, int gshift) { return gshift >= 0 ? kt >> gshift : kt / gsteps; }

// ---- Overlap with the kernel before in the stream (programmatic dependent launch, sm_90+). The GEMM kernels are
// launched so that their blocks may start while that kernel still runs (launch_kernel's `overlap`): a block first
// asks L2 for the start of its weights and scales (a hint; no data reaches the kernel before the wait, so nothing
// stale can), lets the kernel after it start the same way, then waits until the kernel before it has completed with
// its writes visible. x, the partials, the counters and y (whose memory that kernel may still use) are touched only
// after the wait. Back-to-back calls then start the next one's launch and first weight reads during the end of the
// one before.

// k16 steps of a tile that a block prefetches (16 KB of weights): the ring's start; resident blocks x this stays
// well below the L2 while the kernel before still streams through it
constexpr int kPrefetchSteps = 32;

// cp.async.bulk.prefetch.L2 of `bytes` (a multiple of 16) from p (16-byte aligned), if `issue`: predicated, not
// branched around, like cp_async16 (a branch here moved the register allocation of the main loops)
__device__ __forceinline__ void prefetch_l2(const void* p, uint32_t bytes, bool issue) {
#if defined(HF_W4_CUDA_EMULATE)
  if (issue) hf_w4_emu::prefetch_l2(p, bytes);
#elif __CUDA_ARCH__ >= 900
  asm volatile(
      "{\n .reg .pred p;\n setp.ne.b32 p, %2, 0;\n @p cp.async.bulk.prefetch.L2.global [%0], %1;\n}\n" ::"l"(p),
      "r"(bytes), "r"(issue ? 1 : 0)
      : "memory");
#else
  (void)p;
  (void)bytes;
  (void)issue;
#endif
}

// If `issue`: the first steps (at most kPrefetchSteps) of column tile nt's k16 steps [kt, end), its packed weights,
// scales and zero points, all three contiguous along K within a tile (w4a16_math.cuh)
template <int KIND>
__device__ __forceinline__ void prefetch_tile(const GemmArgs& a, int nt, int kt, int end, bool issue) {
  const int ksteps = a.k / 16, steps = end - kt < kPrefetchSteps ? end - kt : kPrefetchSteps;
  issue = issue && steps > 0;
  prefetch_l2(a.qpack + tile_word(kt, nt, ksteps), steps * 512, issue);
  if constexpr (KIND == kNvfp4) {
    prefetch_l2(static_cast<const uint8_t*>(a.scales) + group_row(kt, nt, ksteps), steps * 64, issue);
  } else {  // groups by shifts where the group size is a power of two steps (the integer divisions are long)
    const int gsteps = a.group_size >> 4, groups = step_group(ksteps, gsteps, a.group_shift);
    const int g0 = step_group(kt, gsteps, a.group_shift);
    const int ng = step_group(kt + steps - 1, gsteps, a.group_shift) - g0 + 1;
    prefetch_l2(static_cast<const uint16_t*>(a.scales) + group_row(g0, nt, groups), ng * 128, issue);
    if constexpr (KIND == kInt4Asym) prefetch_l2(a.zeros + group_row(g0, nt, groups), ng * 64, issue);
  }
}

// Every thread of the block: let the next kernel's blocks start, then wait for the previous kernel (both no-ops where
// the launch did not ask for the overlap)
__device__ __forceinline__ void await_prior_kernel() {
#if defined(HF_W4_CUDA_EMULATE)
  hf_w4_emu::grid_dependency_wait();
#elif __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

template <bool BF16>
__device__ __forceinline__ void mma16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
#if defined(HF_W4_CUDA_EMULATE)
  hf_w4_emu::mma16816<BF16>(c, a, b0, b1);
#else
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
#endif
}

// One lane's weights, scales and zero points for one (k16 step, 64-column tile)
struct WTile {
  uint4 w;  // 4 words: 8 sub-tiles x 2 fragment registers x 2 k
  uint4 s;  // 8 scales of sub-tiles 0..7 at column g in x's dtype (nvfp4: as nvfp4_scales prepares them)
  uint2 z;  // asymmetric int4: 8 zero-point bytes
};

// NVFP4 block scales of sub-tiles idx, idx + 1 (E4M3 bytes idx, idx + 1 of word, idx even) as nvfp4_scale_pair
// prepares them; for fp16 on sm_89+ by the hardware conversion (exact), then the same * 2^6 (the emulated build
// takes this path too: the bit moves of the other are checked by tests/kernels/test_cuda_w4a16.py)
template <class A>
__device__ __forceinline__ uint32_t scale_pair(uint32_t word, int idx) {
#if defined(HF_W4_CUDA_EMULATE) || __CUDA_ARCH__ >= 890
  if constexpr (!A::kBF16) {
    const uint16_t h = static_cast<uint16_t>(word >> (8 * idx));  // byte idx low, idx + 1 high: halves in order
    uint32_t s2;
#if defined(HF_W4_CUDA_EMULATE)
    s2 = hf_w4_emu::cvt_f16x2_e4m3x2(h);
#else
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(s2) : "h"(h));
#endif
    return A::mul2(s2, 0x54005400u);
  }
#endif
  return nvfp4_scale_pair<A>(word, idx);
}
// a lane's 8 E4M3 bytes (sub-tiles 0..7) -> WTile::s, two scales per word as int4's
template <class A>
__device__ __forceinline__ uint4 nvfp4_scales(uint2 s8) {
  return make_uint4(scale_pair<A>(s8.x, 0), scale_pair<A>(s8.x, 2), scale_pair<A>(s8.y, 0), scale_pair<A>(s8.y, 2));
}

// the dequantize kernel's direct loads of a tile
template <class A, int KIND>
__device__ __forceinline__ WTile load_wtile(const GemmArgs& a, int kt, int nt, int lane) {
  const int ksteps = a.k / 16, g = lane >> 2;
  WTile r;
  r.w = ld_stream(a.qpack + tile_word(kt, nt, ksteps) + lane * 4);
  r.z = make_uint2(0u, 0u);
  if constexpr (KIND == kNvfp4) {
    const uint2 s8 = __ldg(reinterpret_cast<const uint2*>(static_cast<const uint8_t*>(a.scales) +
                                                          group_row(kt, nt, ksteps) + g * 8));
    r.s = nvfp4_scales<A>(s8);
  } else {
    const int groups = a.k / a.group_size;
    const int64_t off = group_row(kt * 16 / a.group_size, nt, groups) + g * 8;
    r.s = __ldg(reinterpret_cast<const uint4*>(static_cast<const uint16_t*>(a.scales) + off));
    if constexpr (KIND == kInt4Asym) r.z = __ldg(reinterpret_cast<const uint2*>(a.zeros + off));
  }
  return r;
}

// The two B fragment registers of sub-tile ``sub`` (0..7), dequantized into Out's type (NVFP4: times 2^-8, without
// the global scale)
template <class Out, int KIND>
__device__ __forceinline__ void dequant_sub(const WTile& t, int sub, uint32_t& b0, uint32_t& b1) {
  const uint32_t wv[4] = {t.w.x, t.w.y, t.w.z, t.w.w};
  const uint32_t sv[4] = {t.s.x, t.s.y, t.s.z, t.s.w};
  const uint32_t word = wv[sub >> 1], s2 = broadcast16(sv[sub >> 1], sub & 1);
  const int p = sub & 1;
  if constexpr (KIND == kNvfp4) {
    b0 = nvfp4_dequant<Out>(word, 2 * p, s2);
    b1 = nvfp4_dequant<Out>(word, 2 * p + 1, s2);
  } else if constexpr (KIND == kInt4Asym) {
    const uint32_t z2 = int4_zero_pair(sub < 4 ? t.z.x : t.z.y, sub & 3, Out::kBF16);
    b0 = int4_dequant<Out>(word, 2 * p, z2, s2);
    b1 = int4_dequant<Out>(word, 2 * p + 1, z2, s2);
  } else {
    b0 = int4_sym_dequant<Out>(word, 2 * p, s2);
    b1 = int4_sym_dequant<Out>(word, 2 * p + 1, s2);
  }
}

// Everything one warp needs for one chunk of kChunk k16 steps, in shared memory, as 16-byte pieces (one cp.async
// each): its weights (16 bytes per lane and step), the activations of the block's rows (row r of m16 tile mt: 32 k
// in x[mt][r][0..3]; the fifth piece pads rows to 80 bytes, so the fragment reads of a warp hit 32 distinct banks)
// and the tile's scale rows (int4: 64 scales per step, then 64 zero-point bytes per step if asymmetric; nvfp4: 64
// E4M3 bytes per step).
template <int KIND, int STEPS = kChunk>
constexpr int scale_pieces() { return KIND == kNvfp4 ? 4 * STEPS : (KIND == kInt4Asym ? 12 * STEPS : 8 * STEPS); }

// MR: the rows of each m16 tile that are staged (8 where M <= 8: rows 8..15 of the only tile read as zero anyway,
// and the smaller slots let more blocks reside)
template <int MT, int MR, int KIND>
struct ChunkSlot {
  static_assert(scale_pieces<KIND>() <= 32, "one scale piece per lane");
  uint4 w[kChunk][32];
  uint4 x[MT][MR][5];
  uint4 s[scale_pieces<KIND>()];
};

// Chunk slots per ring: where at most 8 rows are staged (MR = 8), 3 (2 chunks in flight while one is computed):
// shared memory limits the resident blocks, and 9 instead of 7 per SM measured faster at M = 1-8 on an H200; with 16
// rows, 4 (3 in flight): there the smaller ring's extra blocks (7 instead of 5 per SM) measured slower, up to 20 %
// at M = 16-64. Four m16 tiles: 3 (a chunk computes four times as long; 77 KB of ring per block instead of 102 fits
// the 99 KB a block may have on sm_86 / sm_89)
template <int MT, int MR>
constexpr int ring_slots() { return MR == 8 || MT == 4 ? 3 : 4; }
template <int MT, int MR, int KIND>
constexpr int ring_bytes() { return 4 * ring_slots<MT, MR>() * (int)sizeof(ChunkSlot<MT, MR, KIND>); }

// Per-lane sources of a chunk's copies, advanced by one chunk of the warp (4 kChunk k16 steps) per slot. The scale
// pieces are those of chunks of STEPS k16 steps (the wgmma kernel's are longer), one per ``lane`` below
// scale_pieces<KIND, STEPS>() (there: the thread of the warpgroup, which also makes w its step lane / 32 piece).
template <int MT, int KIND>
struct ChunkSource {
  const int32_t* w;   // lane's 16 bytes of step kt
  const uint16_t* x;  // row (lane >> 1) of each m16 tile, k16 step kt + (lane & 1)
  int xrows;          // tiles whose row (lane >> 1) exists
  const uint8_t* s;   // scale / zero-point piece of this lane at group 0 (int4) or at step kt (nvfp4)
  int sstep;          // the chunk step (0 .. kChunk - 1) whose scale piece this lane copies
  bool scopy;         // whether this lane copies a scale piece
};

template <int MT, int KIND, int STEPS = kChunk>
__device__ __forceinline__ ChunkSource<MT, KIND> chunk_source(const GemmArgs& a, int kt, int nt, int m0, int lane) {
  const int ksteps = a.k / 16;
  ChunkSource<MT, KIND> c;
  c.w = a.qpack + tile_word(kt, nt, ksteps) + lane * 4;
  c.x = static_cast<const uint16_t*>(a.x) + (size_t)(m0 + (lane >> 1)) * a.k + (kt + (lane & 1)) * 16;
  c.xrows = 0;
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) c.xrows += m0 + mt * 16 + (lane >> 1) < a.m;
  c.sstep = 0;
  c.s = static_cast<const uint8_t*>(a.scales);  // lanes without a piece: any address, never read
  c.scopy = lane < scale_pieces<KIND, STEPS>();
  if (c.scopy) {
    if constexpr (KIND == kNvfp4) {  // lanes 4 i .. 4 i + 3: step i's 64 bytes
      c.sstep = lane >> 2;
      c.s = static_cast<const uint8_t*>(a.scales) + group_row(kt + c.sstep, nt, ksteps) + (lane & 3) * 16;
    } else if (lane < 8 * STEPS) {  // lanes 8 i .. 8 i + 7: step i's 64 scales (128 bytes)
      c.sstep = lane >> 3;
      c.s = reinterpret_cast<const uint8_t*>(static_cast<const uint16_t*>(a.scales) +
                                             group_row(0, nt, a.k / a.group_size)) + (lane & 7) * 16;
    } else {  // asymmetric: lanes 8 STEPS + 4 i ..: step i's 64 zero-point bytes
      c.sstep = (lane - 8 * STEPS) >> 2;
      c.s = a.zeros + group_row(0, nt, a.k / a.group_size) + (lane & 3) * 16;
    }
  }
  return c;
}

// The source of a lane's scale / zero-point piece in the chunk at k16 step kt (chunks of STEPS steps; ``in``: the
// piece's step lies before the split's end, else it is zero-filled and any address in bounds does): int4 the row of
// the step's group (128 bytes of scales, 64 of zero points), NVFP4 the source's own step.
template <int STEPS, int MT, int KIND>
__device__ __forceinline__ const void* scale_piece_src(const ChunkSource<MT, KIND>& c, const GemmArgs& a, int kt,
                                                       bool in, int lane, int gsteps) {
  if constexpr (KIND != kNvfp4) {
    const int grp = step_group(in ? kt + c.sstep : kt, gsteps, a.group_shift);
    return c.s + (size_t)grp * (lane < 8 * STEPS ? 128 : 64);
  } else {
    return in ? static_cast<const void*>(c.s) : a.scales;
  }
}

// A warp's weight and scale pieces of the chunk at k16 step kt (both fused kernels), if ``issue`` (none past the
// warp's last chunk). The pieces of the chunk's second step are zero-filled where it lies past ``end`` (only at the
// end of an odd K): it adds 0 x (finite weights), so the main loop needs no branch. Lanes without a piece skip it by
// predicate, not by branch.
template <int MT, int KIND>
__device__ __forceinline__ void copy_weight_pieces(uint4 (&w)[kChunk][32], uint4* s, const ChunkSource<MT, KIND>& c,
                                                   const GemmArgs& a, int kt, int end, int lane, int gsteps,
                                                   bool issue) {
  static_assert(kChunk == 2, "two k16 steps per chunk");
  const bool two = kt + 1 < end;
  cp_async16(&w[0][lane], c.w, true, issue);
  cp_async16(&w[1][lane], two ? c.w + 128 : c.w, two, issue);
  const bool in = kt + c.sstep < end;
  cp_async16(&s[c.scopy ? lane : 0], scale_piece_src<kChunk>(c, a, kt, in, lane, gsteps), in, issue && c.scopy);
}

// Issue the copies of the chunk at k16 step kt for one warp: its weights and scales, and the block's rows. Staged rows
// past M are zero-filled (nothing is read), so the main loop needs no row mask either.
template <int MT, int MR, int KIND>
__device__ __forceinline__ void copy_chunk(ChunkSlot<MT, MR, KIND>& slot, const ChunkSource<MT, KIND>& c,
                                           const GemmArgs& a, int kt, int end, int lane, int gsteps, bool issue) {
  const bool two = kt + 1 < end;
  const int row = (lane >> 1) & (MR - 1);  // lanes 2 MR and up stage no row (MR = 8)
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
    const bool full = mt < c.xrows && ((lane & 1) == 0 || two);  // odd lanes copy step 1's activations
    const uint16_t* src = full ? c.x + (size_t)mt * 16 * a.k : static_cast<const uint16_t*>(a.x);
    const bool xcopy = issue && (lane >> 1) < MR;
    cp_async16(&slot.x[mt][row][2 * (lane & 1)], src, full, xcopy);
    cp_async16(&slot.x[mt][row][2 * (lane & 1) + 1], full ? src + 8 : src, full, xcopy);
  }
  copy_weight_pieces(slot.w, slot.s, c, a, kt, end, lane, gsteps, issue);
}

// the sources ``steps`` k16 steps on (the warp-interleaved kernel: a chunk for each of the 4 warps; the others: one)
template <int MT, int KIND>
__device__ __forceinline__ void advance(ChunkSource<MT, KIND>& c, int steps) {
  c.w += steps * 128;
  c.x += steps * 16;
  if constexpr (KIND == kNvfp4) c.s += steps * 64;
}

// The ring the kernels stream their chunks through: WS slots, chunk c in slot c % WS, WS - LAG chunks in flight ahead
// of the one computed, one cp.async commit group per chunk (empty past nchunks). fill(slot, c) issues chunk c's
// copies (none past nchunks) and advances the sources; sync() makes chunk c visible to every thread that reads it and
// orders the reads of chunk c - LAG's slot before that slot is refilled; compute(slot) consumes chunk c. LAG = 2
// where the reads of a chunk may still be in flight when the next chunk's sync() is reached (the wgmma kernel).
// UNROLL: the loop runs WS chunks per iteration, so that every slot index is a constant (the addresses of a slot's
// copies, reads and wgmma descriptors fold into immediates), with one uniform exit test per chunk.
template <int WS, int LAG = 1, bool UNROLL = false, class Fill, class Sync, class Compute>
__device__ __forceinline__ void stream_ring(int nchunks, Fill&& fill, Sync&& sync, Compute&& compute) {
  static_assert(LAG >= 1 && WS - LAG >= 2, "a chunk in flight ahead of the one computed");
#pragma unroll
  for (int p = 0; p < WS - LAG; ++p) {
    fill(p, p);
    cp_async_commit();
  }
  // WS - LAG + c groups committed before chunk c; all but the newest WS - LAG - 1 done means groups 0..c are
  if constexpr (UNROLL) {
    for (int c0 = 0; c0 < nchunks; c0 += WS) {
#pragma unroll
      for (int u = 0; u < WS; ++u) {
        if (c0 + u >= nchunks) break;
        cp_async_wait<WS - LAG - 1>();
        sync();
        fill((u + WS - LAG) % WS, c0 + u + WS - LAG);
        cp_async_commit();
        compute(u);
      }
    }
  } else {
    int slot = 0, refill = WS - LAG;  // chunk c's slot, and chunk c - LAG's (chunk c + WS - LAG's)
    for (int c = 0; c < nchunks; ++c) {
      cp_async_wait<WS - LAG - 1>();
      sync();
      fill(refill, c + WS - LAG);
      cp_async_commit();
      compute(slot);
      refill = LAG == 1 ? slot : (refill + 1 == WS ? 0 : refill + 1);
      slot = slot + 1 == WS ? 0 : slot + 1;
    }
  }
  cp_async_wait<0>();
}

// y[row][col] = sum * the output scale (the global scale; for NVFP4 also undoing the operands' 2^-8) + bias,
// rounded once into the activation type: the fused kernels' one output step
template <class A, int KIND>
__device__ __forceinline__ void store_y(const GemmArgs& a, int row, int col, float sum) {
#if defined(HF_W4_CUDA_EMULATE)
  hf_w4_emu::require_awaited("a store of y");  // the bias too may be the kernel before's output
#endif
  float v = sum * (KIND == kNvfp4 ? a.global_scale * kNvfp4Unscale : a.global_scale);
  if (a.bias) v += A::to_float(static_cast<const uint16_t*>(a.bias)[col]);
  static_cast<uint16_t*>(a.y)[(size_t)row * a.n + col] = A::from_float(v);
}

// ---- host side

// kernel<<<grid, threads, bytes, stream>>>(args...); `overlap`: its blocks may start while the kernel before it in
// the stream still runs (programmatic stream serialization; the kernel waits for that one in await_prior_kernel). A
// launch error stays for cudaGetLastError.
template <class... Params, class... Args>
void launch_kernel(void (*kernel)(Params...), dim3 grid, int threads, int bytes, cudaStream_t stream, bool overlap,
                   Args... args) {
#if defined(HF_W4_CUDA_EMULATE)
  (void)stream;
  hf_w4_emu::launch(kernel, grid, dim3(threads), bytes, overlap)(args...);
#else
  cudaLaunchAttribute attr;
  attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr.val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = dim3(threads);
  config.dynamicSmemBytes = bytes;
  config.stream = stream;
  config.attrs = &attr;
  config.numAttrs = overlap ? 1 : 0;
  (void)cudaLaunchKernelEx(&config, kernel, args...);
#endif
}

// Blocks of ``threads`` threads of ``kernel`` with ``bytes`` of dynamic shared memory resident per SM (the occupancy
// API)
template <class Kernel>
int resident_blocks(Kernel kernel, int bytes, int threads = 128) {
  // The ring is dynamic shared memory (above 48 KB at MT = 2: needs the opt-in; a failure shows at the launch).
  // Prefer shared memory over L1, so that the occupancy the split-K plan assumes is the one the launches get; only a
  // hint, so a failure is not an error.
  if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes) != cudaSuccess)
    (void)cudaGetLastError();
  if (cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout, cudaSharedmemCarveoutMaxShared) !=
      cudaSuccess)
    (void)cudaGetLastError();
  int n = 0;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, threads, bytes) != cudaSuccess) {
    (void)cudaGetLastError();  // not sticky; plan with one block per SM
    n = 1;
  }
  return n > 0 ? n : 1;
}

}  // namespace
}  // namespace cuda
}  // namespace hf_w4
