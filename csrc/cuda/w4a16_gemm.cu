// CUDA W4A16 kernels (int4 with group scales / zero points, NVFP4) for sm_80+: a fused dequantize + mma.sync
// kernel for small M and a dequantize-to-dense kernel for the large-M path (dense GEMM by cuBLAS). No torch
// headers: the glue in w4a16_torch.cpp passes raw pointers (w4a16_launch.h). Arithmetic: w4a16_math.cuh.
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

template <int MT>
__device__ __forceinline__ void zero_acc(float (&acc)[MT][8][4]) {
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int s = 0; s < 8; ++s)
#pragma unroll
      for (int r = 0; r < 4; ++r) acc[mt][s][r] = 0.f;
}

// A lane's tile of step i of a chunk in shared memory: its weights (w[i][lane]) and the scales / zero points of its
// column g, from the scale pieces laid out as ChunkSlot::s (NVFP4: prepared by nvfp4_scales)
template <class A, int KIND>
__device__ __forceinline__ WTile chunk_tile(const uint4 (&w)[kChunk][32], const uint4* s, int i, int lane) {
  const int g = lane >> 2;
  WTile wt;
  wt.w = w[i][lane];
  if constexpr (KIND == kNvfp4) {
    wt.s = nvfp4_scales<A>(reinterpret_cast<const uint2*>(s + 4 * i)[g]);
    wt.z = make_uint2(0u, 0u);
  } else {
    wt.s = s[8 * i + g];
    wt.z = KIND == kInt4Asym ? reinterpret_cast<const uint2*>(s + 8 * kChunk + 4 * i)[g] : make_uint2(0u, 0u);
  }
  return wt;
}

// One warp's work on a chunk in shared memory: per k16 step its weights (w[step][lane]), scale / zero-point pieces
// (s, laid out as ChunkSlot::s) and the staged rows x (zero past M; rows 8..15 of the tile read as zero where only 8
// are staged), dequantized and multiplied into acc.
// WT (one m16 tile of at most 8 rows): the weights are mma's A operand and the activations its B (y^T = W x^T), so
// an mma covers 16 columns and the rows it would pad with zeros are the 8 columns of B: 4 mma per k16 step instead of
// 8, and acc[0][j] holds columns 16 j + g (+ 8) of rows 2t, 2t + 1 (acc_pos). The packed B fragments of sub-tiles 2j
// and 2j + 1 are exactly the A fragment of the 16 columns they cover, and a row's A fragment registers a0 / a2 are
// its B fragment.
template <int MT, int MR, bool BF16, int KIND, bool WT>
__device__ __forceinline__ void compute_chunk(const uint4 (&w)[kChunk][32], const uint4* s, const uint4 (&x)[MT][MR][5],
                                              int lane, float (&acc)[MT][8][4]) {
  static_assert(!WT || (MT == 1 && MR == 8), "weights as A: one tile of 8 staged rows");
  using A = DevAct<BF16>;
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int i = 0; i < kChunk; ++i) {
    const WTile wt = chunk_tile<A, KIND>(w, s, i, lane);
    if constexpr (WT) {
      const uint32_t* xr = reinterpret_cast<const uint32_t*>(x[0][g]) + 8 * i + t;  // row g: B fragment column g
      const uint32_t x0 = xr[0], x1 = xr[4];
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        uint32_t wa[4];  // a0 (column 16 j + g, k 2t..), a1 (16 j + 8 + g), a2 / a3 the same at k 2t + 8..
        dequant_sub<A, KIND>(wt, 2 * j, wa[0], wa[2]);
        dequant_sub<A, KIND>(wt, 2 * j + 1, wa[1], wa[3]);
        mma16816<BF16>(acc[0][j], wa, x0, x1);
      }
    } else {
      // A fragment (row-major m16k16): a0 = (g, 2t..2t+1), a1 = (g+8, 2t..), a2 = (g, 2t+8..), a3 = (g+8, 2t+8..)
      uint32_t af[MT][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        const uint32_t* lo = reinterpret_cast<const uint32_t*>(x[mt][g]) + 8 * i + t;
        const uint32_t* hi = reinterpret_cast<const uint32_t*>(x[mt][MR == 16 ? g + 8 : g]) + 8 * i + t;
        af[mt][0] = lo[0];
        af[mt][1] = MR == 16 ? hi[0] : 0u;
        af[mt][2] = lo[4];
        af[mt][3] = MR == 16 ? hi[4] : 0u;
      }
#pragma unroll
      for (int sub = 0; sub < 8; ++sub) {
        uint32_t b0, b1;
        dequant_sub<A, KIND>(wt, sub, b0, b1);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) mma16816<BF16>(acc[mt][sub], af[mt], b0, b1);
      }
    }
  }
}

// Position (row * 64 + column) in the block's [BM][64] tile of accumulator r of acc[mt][sub] (lane g, t), and whether
// that slot is used: mma's D layout (row mt * 16 + g (+ 8), columns 8 sub + 2t (+ 1)), or with WT the transposed
// one of compute_chunk (row 2t (+ 1), column 16 sub + g (+ 8), sub < 4)
template <bool WT>
__device__ __forceinline__ int acc_pos(int mt, int sub, int r, int g, int t, int* row) {
  if constexpr (WT) {
    *row = 2 * t + (r & 1);
    return *row * 64 + 16 * sub + g + 8 * (r >> 1);
  } else {
    *row = mt * 16 + g + 8 * (r >> 1);
    return *row * 64 + sub * 8 + 2 * t + (r & 1);
  }
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

// Block: 4 warps, BM = 16 * MT rows x 64 columns; warp w takes the chunks kb + kChunk w, kb + kChunk (w + 4), ... of
// its split. Each warp streams its chunks through its own ring of shared-memory slots filled by cp.async (weights,
// activations and scales alike, so nothing in the main loop waits on memory except the ring's head); a warp barrier
// after each wait makes one lane's copies visible to the others and orders the reads of the slot computed one chunk
// earlier before its refill. The warps' partial sums are added in warp order in shared memory (reusing the ring);
// with split-K every split stores its partial tile and the last block to arrive (a per-tile counter) adds them in
// split order: the result does not depend on scheduling. Dynamic shared memory: ring_bytes<MT, MR, KIND>().
// __launch_bounds__'s minimum of resident blocks: at most 8 rows (MR = 8) the ring lets 9 blocks reside per SM, so
// registers are held to the 56 that 9 leave (no spills; left free, ptxas takes 64 where the copies are predicated);
// asymmetric int4 would spill within 56 and stays at 8 blocks. 0: no minimum (ptxas's own choice; an explicit 1
// makes it take more registers than needed, e.g. 107 instead of 72 for MR = 16, where 5 blocks should fit).
template <int MR, int KIND>
constexpr int min_blocks() { return MR == 8 && KIND != kInt4Asym ? 9 : 0; }

template <int MT, int MR, bool BF16, int KIND>
__global__ void __launch_bounds__(128, min_blocks<MR, KIND>())
    w4a16_gemm_kernel(const GemmArgs a, const int ntiles, const int splits, const int steps_per_split) {
#if defined(HF_W4_DEVICE_CODE)
  using A = DevAct<BF16>;
  using Slot = ChunkSlot<MT, MR, KIND>;
  constexpr int BM = 16 * MT;
  constexpr int WS = ring_slots<MT, MR>();
  constexpr bool kWT = MR == 8;  // at most 8 rows: the weights as mma's A operand (compute_chunk)
  static_assert(sizeof(Slot) * WS * 4 >= 4 * BM * 64 * sizeof(float), "the reduction reuses the ring");
  extern __shared__ uint4 smem[];
  // the m-blocks of a tile are neighbours in the launch order, so they run together and share its weights in L2
  const int mb = blockIdx.x, nt = blockIdx.y, split = blockIdx.z;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int g = lane >> 2, t = lane & 3;
  const int m0 = mb * BM;
  const int gsteps = a.group_size >> 4;
  int first, end;
  const int nchunks = warp_chunks(a.k / 16, steps_per_split, split, warp, &first, &end);
  prefetch_tile<KIND>(a, nt, split * steps_per_split, end, tid == 0);
  await_prior_kernel();

  float acc[MT][8][4];
  zero_acc(acc);

  // this warp's own ring
  Slot* wr = reinterpret_cast<Slot*>(smem) + warp * WS;
  ChunkSource<MT, KIND> src = chunk_source<MT, KIND>(a, first, nt, m0, lane);
  stream_ring<WS>(
      nchunks,
      [&](int slot, int c) {
        copy_chunk(wr[slot], src, a, first + 4 * kChunk * c, end, lane, gsteps, c < nchunks);
        advance(src, 4 * kChunk);
      },
      [] { __syncwarp(); },
      [&](int slot) {
        compute_chunk<MT, MR, BF16, KIND, kWT>(wr[slot].w, wr[slot].s, wr[slot].x, lane, acc);
      });
  __syncthreads();  // every warp is done with the ring: it becomes the reduction buffer

  // Only the block's rows below M are reduced, stored and read back (M = 1 touches 64 of the BM x 64 values).
  // Each warp stores its sums in a region of its own, then every value is added up in warp order by one thread,
  // which keeps the sum in region 0 (red) and alone reads it back below.
  float* red = reinterpret_cast<float*>(smem);
  const int rows = a.m - m0 < BM ? a.m - m0 : BM, nvals = rows * 64;
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int sub = 0; sub < (kWT ? 4 : 8); ++sub)
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        int row;
        const int i = acc_pos<kWT>(mt, sub, r, g, t, &row);
        if (row < rows) red[warp * (BM * 64) + i] = acc[mt][sub][r];
      }
  __syncthreads();
  for (int i = tid; i < nvals; i += 128)
    red[i] = ((red[i] + red[BM * 64 + i]) + red[2 * BM * 64 + i]) + red[3 * BM * 64 + i];

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

  for (int i = tid; i < nvals; i += 128) {
    const int row = m0 + i / 64, col = nt * 64 + (i & 63);
    if (col < a.n) store_y<A, KIND>(a, row, col, red[i]);
  }
#endif
}

// ---- the wide variant: a block of 4 warps covers 4 column tiles (warp w: tile 4 blockIdx.y + w) over the same
// K range, all warps on the same chunk at a time: the activations of a chunk are copied once per block (not once per
// warp), and no partial sums cross warps (each warp owns its columns; split-K fix-up per warp).

// One chunk for the whole block: every warp's weights and scale rows, the shared activations
template <int MT, int MR, int KIND>
struct WideSlot {
  uint4 w[4][kChunk][32];
  uint4 s[4][scale_pieces<KIND>()];
  uint4 x[MT][MR][5];
};
template <int MT, int MR, int KIND>
constexpr int wide_ring_bytes() { return ring_slots<MT, MR>() * (int)sizeof(WideSlot<MT, MR, KIND>); }

// The chunk at k16 step kt (steps below ``end``), if ``issue``: this warp's weights and scales from ``c`` (where it
// has a tile), and the block's activation pieces, spread over the 128 threads (piece p: row p / 4 of the staged rows,
// k16 step (p / 2) & 1, half p & 1; rows past M zero-filled, as in copy_chunk)
template <int MT, int MR, int KIND>
__device__ __forceinline__ void copy_wide_chunk(WideSlot<MT, MR, KIND>& slot, const ChunkSource<MT, KIND>& c,
                                                const GemmArgs& a, int kt, int end, int m0, int warp, int lane,
                                                int gsteps, bool has_tile, bool issue) {
  copy_weight_pieces(slot.w[warp], slot.s[warp], c, a, kt, end, lane, gsteps, issue && has_tile);
  const bool two = kt + 1 < end;
  const uint16_t* x = static_cast<const uint16_t*>(a.x);
  constexpr int kPieces = MT * MR * 4;
#pragma unroll
  for (int p0 = 0; p0 < kPieces; p0 += 128) {
    const bool piece = p0 + warp * 32 + lane < kPieces;  // threads past the pieces copy nothing
    const int p = piece ? p0 + warp * 32 + lane : 0;
    const int r = p >> 2, step = (p >> 1) & 1, half = p & 1;
    const int mt = r / MR, rr = r % MR, row = m0 + mt * 16 + rr;
    const bool full = row < a.m && (step == 0 || two);
    cp_async16(&slot.x[mt][rr][2 * step + half], full ? x + (size_t)row * a.k + (kt + step) * 16 + half * 8 : x,
               full, issue && piece);
  }
}

// One m16 tile: 7 blocks per SM (72 registers), as measured; the ring would allow 8
template <int MT>
constexpr int wide_min_blocks() { return MT == 1 ? 7 : 0; }

template <int MT, int MR, bool BF16, int KIND>
__global__ void __launch_bounds__(128, wide_min_blocks<MT>())
    w4a16_gemm_wide_kernel(const GemmArgs a, const int ntiles, const int splits, const int steps_per_split) {
#if defined(HF_W4_DEVICE_CODE)
  using A = DevAct<BF16>;
  using Slot = WideSlot<MT, MR, KIND>;
  constexpr int BM = 16 * MT;
  constexpr int WS = ring_slots<MT, MR>();
  extern __shared__ uint4 smem[];
  const int mb = blockIdx.x, split = blockIdx.z;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int nt = 4 * blockIdx.y + warp;
  const bool has_tile = nt < ntiles;
  const int g = lane >> 2, t = lane & 3;
  const int m0 = mb * BM;
  const int gsteps = a.group_size >> 4;
  const int ksteps = a.k / 16;
  const int kb = split * steps_per_split;
  const int end = ksteps < kb + steps_per_split ? ksteps : kb + steps_per_split;
  const int nchunks = (end - kb + kChunk - 1) / kChunk;
  prefetch_tile<KIND>(a, nt, kb, end, has_tile && lane == 0);
  await_prior_kernel();

  float acc[MT][8][4];
  zero_acc(acc);

  Slot* ring = reinterpret_cast<Slot*>(smem);
  ChunkSource<MT, KIND> src = chunk_source<MT, KIND>(a, kb, has_tile ? nt : 0, m0, lane);
  stream_ring<WS>(
      nchunks,
      [&](int slot, int c) {
        copy_wide_chunk(ring[slot], src, a, kb + kChunk * c, end, m0, warp, lane, gsteps, has_tile, c < nchunks);
        advance(src, kChunk);  // all warps on the same chunk
      },
      // every thread's copies of chunk c are visible; every warp is done with chunk c - 1's slot
      [] { __syncthreads(); },
      [&](int slot) {
        if (has_tile)
          compute_chunk<MT, MR, BF16, KIND, false>(ring[slot].w[warp], ring[slot].s[warp], ring[slot].x, lane, acc);
      });
  if (!has_tile) return;

  // accumulator c0, c1: (row g, cols 2t, 2t+1), c2, c3: (row g+8, same cols); index in a [BM][64] tile
  if (splits > 1) {
    float* part = a.workspace + (size_t)(mb * ntiles + nt) * splits * (BM * 64);
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int sub = 0; sub < 8; ++sub)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int row = mt * 16 + g + 8 * h, i = row * 64 + sub * 8 + 2 * t;
          if (m0 + row < a.m)
            __stcg(reinterpret_cast<float2*>(part + (size_t)split * (BM * 64) + i),
                   make_float2(acc[mt][sub][2 * h], acc[mt][sub][2 * h + 1]));
        }
    __threadfence();
    __syncwarp();
    int last = 0;
    if (lane == 0) last = atomicAdd(a.counters + mb * ntiles + nt, 1) == splits - 1;
    if (!__shfl_sync(0xffffffffu, last, 0)) return;
    __threadfence();
    // the last split of this tile adds all splits in split order (the same order in every run)
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int sub = 0; sub < 8; ++sub)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int row = mt * 16 + g + 8 * h, i = row * 64 + sub * 8 + 2 * t;
          float2 v = make_float2(0.f, 0.f);
          if (m0 + row < a.m)
            for (int s = 0; s < splits; ++s) {
              const float2 p = __ldcg(reinterpret_cast<const float2*>(part + (size_t)s * (BM * 64) + i));
              v.x += p.x;
              v.y += p.y;
            }
          acc[mt][sub][2 * h] = v.x;
          acc[mt][sub][2 * h + 1] = v.y;
        }
    if (lane == 0) a.counters[mb * ntiles + nt] = 0;
  }
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int sub = 0; sub < 8; ++sub)
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        const int row = m0 + mt * 16 + g + 8 * (r >> 1), col = nt * 64 + sub * 8 + 2 * t + (r & 1);
        if (row < a.m && col < a.n) store_y<A, KIND>(a, row, col, acc[mt][sub][r]);
      }
#endif
}

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
// k16 steps per chunk: one per warp of a warpgroup, each of whose threads copies one 16-byte piece of weights per
// chunk; twice the fused kernels' chunk, so the block-wide barrier, the proxy fence and the copies' bookkeeping come
// once per four wgmma of a warpgroup
constexpr int kWgSteps = 4;
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

template <int MT, int MR, bool BF16, int KIND, bool WIDE>
void launch_gemm(const GemmArgs& a, const GemmPlan& p, cudaStream_t stream) {
  if constexpr (WIDE) {
    const dim3 grid(p.mblocks, (p.ntiles + 3) / 4, p.splits);
    launch_kernel(w4a16_gemm_wide_kernel<MT, MR, BF16, KIND>, grid, 128, wide_ring_bytes<MT, MR, KIND>(), stream,
                  p.overlap, a, p.ntiles, p.splits, p.steps_per_split);
  } else {
    const dim3 grid(p.mblocks, p.ntiles, p.splits);
    launch_kernel(w4a16_gemm_kernel<MT, MR, BF16, KIND>, grid, 128, ring_bytes<MT, MR, KIND>(), stream, p.overlap, a,
                  p.ntiles, p.splits, p.steps_per_split);
  }
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

template <int MT, int MR, bool BF16, int KIND, bool WIDE>
int blocks_per_sm() {
  if constexpr (WIDE)
    return resident_blocks(w4a16_gemm_wide_kernel<MT, MR, BF16, KIND>, wide_ring_bytes<MT, MR, KIND>());
  else
    return resident_blocks(w4a16_gemm_kernel<MT, MR, BF16, KIND>, ring_bytes<MT, MR, KIND>());
}

// the instantiated tilings: (MT, MR) = (1, 8), (1, 16), (2, 16), (4, 16), each plain (0-3) or wide (4-7), and the
// wgmma kernel's (8, 9: 4 warpgroups x 64 or 128 rows; its plans have mt = rows / 16)
constexpr int kTilings = 4, kWgmmaTiling = 2 * kTilings, kAllTilings = kWgmmaTiling + 2;
constexpr int kWgmmaWarpgroups = 4;
int tiling(int mt, int mr, bool wide, bool wgmma = false) {
  if (wgmma) return kWgmmaTiling + (mt == 4 ? 0 : 1);
  return (mt == 4 ? 3 : (mt == 2 ? 2 : (mr == 8 ? 0 : 1))) + (wide ? kTilings : 0);
}

template <bool BF16, int KIND, bool WIDE>
int blocks_per_sm_tiling(int t) {
  switch (t) {
    case 0: return blocks_per_sm<1, 8, BF16, KIND, WIDE>();
    case 1: return blocks_per_sm<1, 16, BF16, KIND, WIDE>();
    case 2: return blocks_per_sm<2, 16, BF16, KIND, WIDE>();
    default: return blocks_per_sm<4, 16, BF16, KIND, WIDE>();
  }
}
// Rows of x per wgmma block for M rows: 64 up to M = 64 (no half-empty blocks), else 128 (64-row blocks were slower
// above M = 64 on every layer the rule takes the kernel for)
int wgmma_rows_for(int m) { return m <= 64 ? 64 : 128; }

// f(Int<ROWS>{}) for wgmma tiling t
template <int V>
struct Int {
  static constexpr int value = V;
};
template <class F>
auto with_wgmma_tiling(int t, F&& f) {
  return t == kWgmmaTiling ? f(Int<64>{}) : f(Int<128>{});
}

template <bool BF16, int KIND>
int blocks_per_sm_any(int t) {
  if (t >= kWgmmaTiling)
    return with_wgmma_tiling(t, [](auto rows) {
      constexpr int NWG = kWgmmaWarpgroups, ROWS = decltype(rows)::value;
      return resident_blocks(w4a16_wgmma_kernel<BF16, KIND, NWG, ROWS>, wg_ring_bytes<KIND, NWG, ROWS>(), 128 * NWG);
    });
  return t >= kTilings ? blocks_per_sm_tiling<BF16, KIND, true>(t - kTilings)
                       : blocks_per_sm_tiling<BF16, KIND, false>(t);
}

template <bool BF16, int KIND, bool WIDE>
void launch_gemm_tiling(const GemmArgs& a, const GemmPlan& p, cudaStream_t stream) {
  switch (tiling(p.mt, p.mr, false)) {
    case 0: launch_gemm<1, 8, BF16, KIND, WIDE>(a, p, stream); break;
    case 1: launch_gemm<1, 16, BF16, KIND, WIDE>(a, p, stream); break;
    case 2: launch_gemm<2, 16, BF16, KIND, WIDE>(a, p, stream); break;
    default: launch_gemm<4, 16, BF16, KIND, WIDE>(a, p, stream); break;
  }
}
template <bool BF16, int KIND>
void launch_wgmma(const GemmArgs& a, const GemmPlan& p, cudaStream_t stream) {
  with_wgmma_tiling(tiling(p.mt, p.mr, false, true), [&](auto rows) {
    constexpr int NWG = kWgmmaWarpgroups, ROWS = decltype(rows)::value;
    const dim3 grid(p.mblocks, (p.ntiles + NWG - 1) / NWG, p.splits);
    launch_kernel(w4a16_wgmma_kernel<BF16, KIND, NWG, ROWS>, grid, 128 * NWG, wg_ring_bytes<KIND, NWG, ROWS>(),
                  stream, p.overlap, a, p.ntiles, p.splits, p.steps_per_split);
  });
}

template <bool BF16, int KIND>
void launch_gemm_any(const GemmArgs& a, const GemmPlan& p, cudaStream_t stream) {
  if (p.wgmma) launch_wgmma<BF16, KIND>(a, p, stream);
  else if (p.wide) launch_gemm_tiling<BF16, KIND, true>(a, p, stream);
  else launch_gemm_tiling<BF16, KIND, false>(a, p, stream);
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
