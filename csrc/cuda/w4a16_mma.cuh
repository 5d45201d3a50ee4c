// The mma.sync kernels (sm_80+): the fused dequantize + mma.m16n8k16 kernel for small M (w4a16_gemm_kernel: 4 warps,
// each streaming its own chunks of one 64-column tile) and its wide variant (w4a16_gemm_wide_kernel: 4 warps on 4
// tiles, sharing the staged rows of x), and their launch (launch_mma, mma_blocks_per_sm), instantiated by
// w4a16_mma.cu and w4a16_wide.cu.
#pragma once
#include "w4a16_device.cuh"
#include "w4a16_kernels.h"

namespace hf_w4 {
namespace cuda {
namespace {

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

// ---- host side
template <int MT, int MR, bool BF16, int KIND, bool WIDE>
void launch_tiling(const GemmArgs& a, const GemmPlan& p, cudaStream_t stream) {
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

template <int MT, int MR, bool BF16, int KIND, bool WIDE>
int tiling_blocks_per_sm() {
  if constexpr (WIDE)
    return resident_blocks(w4a16_gemm_wide_kernel<MT, MR, BF16, KIND>, wide_ring_bytes<MT, MR, KIND>());
  else
    return resident_blocks(w4a16_gemm_kernel<MT, MR, BF16, KIND>, ring_bytes<MT, MR, KIND>());
}

}  // namespace

template <bool BF16, int KIND, bool WIDE>
void launch_mma(const GemmArgs& a, const GemmPlan& p, cudaStream_t stream) {
  switch (mma_tiling(p.mt, p.mr)) {
    case 0: launch_tiling<1, 8, BF16, KIND, WIDE>(a, p, stream); break;
    case 1: launch_tiling<1, 16, BF16, KIND, WIDE>(a, p, stream); break;
    case 2: launch_tiling<2, 16, BF16, KIND, WIDE>(a, p, stream); break;
    default: launch_tiling<4, 16, BF16, KIND, WIDE>(a, p, stream); break;
  }
}

template <bool BF16, int KIND, bool WIDE>
int mma_blocks_per_sm(int tiling) {
  switch (tiling) {
    case 0: return tiling_blocks_per_sm<1, 8, BF16, KIND, WIDE>();
    case 1: return tiling_blocks_per_sm<1, 16, BF16, KIND, WIDE>();
    case 2: return tiling_blocks_per_sm<2, 16, BF16, KIND, WIDE>();
    default: return tiling_blocks_per_sm<4, 16, BF16, KIND, WIDE>();
  }
}

}  // namespace cuda
}  // namespace hf_w4
