// A CPU stand-in for the parts of the CUDA runtime, device intrinsics and PTX that the .cu files of csrc/cuda (and
// the .cuh files they include) use, so that g++ can build the kernels unchanged (the code takes HF_W4_CUDA_EMULATE
// branches only for its inline PTX, its launches and one check of the stores of y) and tests/kernels/
// test_cuda_emulated.py can run them on machines without a GPU. Found before the toolkit's headers through the
// include path, as are cuda_fp16.h / cuda_bf16.h of this folder.
//
// Each block runs as one fiber per thread (ucontext) on the calling thread, blocks one after another. Fibers switch
// only at barriers and warp collectives, so everything in between runs as one thread would. __syncthreads / __syncwarp
// wait for every live thread of the block / warp (exited threads count as arrived, as on sm_70+) and a barrier that can
// never complete fails the launch with a message. Errors the GPU would show as faults or wrong results (this one, a
// copy into shared memory that an issued wgmma may still read, a thread exiting with a wgmma in flight) stop the launch
// and reach the caller as an error (fail()), not a crash. mma.sync m16n8k16 and __shfl_sync are warp collectives: the
// lanes deposit their registers, meet, and each computes its own result from the warp's; wgmma is a warpgroup
// collective that reads B from shared memory when the warpgroup issues it, as early as the GPU may, and writes d at
// the thread's wait for it, as late as the GPU may (B's bytes with a cp.async still in flight when it is issued, or a
// cp.async into them before every thread of the warpgroup has waited for the wgmma, fail the launch). cp.async copies
// land at the issuing thread's cp.async.wait_group, as late as the GPU may deliver them (a read before the wait sees
// stale bytes), or with copies_land_at_issue() when issued, as early as it may, the warps then running one at a time
// (a refill of a slot that a slower warp has yet to read is seen by that read): a kernel without such races gives the
// same bits either way. Half-precision arithmetic rounds once to nearest even from the exact fp32 result, as the device
// does for these operands; the mma sums its 16 products in fp32 in k order (the hardware's order is not specified,
// which the tests' error budgets allow for). Not modelled: timing, memory ordering between blocks (blocks do not run
// concurrently here), hardware-specific handling of special values.
#pragma once
#define HF_W4_CUDA_EMULATE 1

#include <ucontext.h>

#include "common/convert.h"  // csrc/cpu: fp32 <-> fp16 / bf16 bits, rounding to nearest even

#include <cmath>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <initializer_list>
#include <map>
#include <algorithm>
#include <memory>
#include <random>
#include <string>
#include <vector>

#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __align__(n) __attribute__((aligned(n)))
#define __shared__ thread_local

struct dim3 {
  unsigned x, y, z;
  dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};
struct alignas(16) uint4 { unsigned x, y, z, w; };
struct alignas(8) uint2 { unsigned x, y; };
struct alignas(8) float2 { float x, y; };
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return uint4{x, y, z, w}; }
inline uint2 make_uint2(unsigned x, unsigned y) { return uint2{x, y}; }
inline float2 make_float2(float x, float y) { return float2{x, y}; }

// ---- runtime API: what the launch code calls
typedef void* cudaStream_t;
enum cudaError_t { cudaSuccess = 0 };
enum cudaFuncAttribute { cudaFuncAttributeMaxDynamicSharedMemorySize, cudaFuncAttributePreferredSharedMemoryCarveout };
enum { cudaSharedmemCarveoutMaxShared = 100 };
inline cudaError_t cudaGetLastError() { return cudaSuccess; }
inline cudaError_t cudaGetDevice(int* d) { *d = 0; return cudaSuccess; }
template <class F>
cudaError_t cudaFuncSetAttribute(F, cudaFuncAttribute, int) { return cudaSuccess; }
// an H100's shared memory (228 KB per SM, 1 KB reserved per block), at most 8 resident blocks
template <class F>
cudaError_t cudaOccupancyMaxActiveBlocksPerMultiprocessor(int* n, F, int, size_t smem) {
  const size_t per = smem + 1024;
  *n = (int)std::min<size_t>(8, (228u << 10) / per);
  return cudaSuccess;
}

namespace hf_w4_emu {

constexpr size_t kSharedBytes = 228u << 10;
constexpr size_t kStackBytes = 64u << 10;

struct Copy {  // one cp.async: 16 bytes from src, or zeros where src is null; landed: already (at its issue)
  void* dst;
  const void* src;
  bool landed;
};

struct WarpgroupSlots {  // what the 128 threads of a warpgroup deposit for wgmma
  uint32_t a[128][4];
  uint64_t desc[128];
};

// An issued wgmma of a warpgroup: its A fragments as issued and its B in shared memory (the descriptor decoded:
// start, K-direction core-matrix offset, 8-row-group offset, bytes; b: shared memory [start, end) when issued), until
// all 128 threads have run their share
struct IssuedWgmma {
  WarpgroupSlots a;
  bool bf16;
  uint32_t start, lbo, sbo, end;  // end: past B's last byte
  std::vector<char> b;
  int left = 128;
  bool overlaps(const void* smem16) const;  // whether 16 bytes of shared memory there lie partly in B
};
// One thread's share of an issued wgmma: d is computed (from B as it was when issued) when the thread waits for it
struct PendingWgmma {
  float* d;
  size_t values;
  std::shared_ptr<IssuedWgmma> op;
  const uint32_t* a;  // the thread's A registers (a variable of the kernel), which must hold `issued` until the wait
  uint32_t issued[4];
};

// A thread's asynchronous operations of one kind (cp.async, wgmma): those since its last commit and the committed
// groups not yet waited for, oldest first
template <class Op>
struct CommitGroups {
  std::vector<Op> open;
  std::vector<std::vector<Op>> groups;
  void commit() {
    groups.push_back(std::move(open));
    open.clear();
  }
  // all but the newest n groups complete: run(op) for each of their operations, oldest first
  template <class Run>
  void wait(size_t n, Run&& run) {
    while (groups.size() > n) {
      for (const Op& op : groups.front()) run(op);
      groups.erase(groups.begin());
    }
  }
  bool empty() const { return open.empty() && groups.empty(); }
};

struct Fiber {
  ucontext_t ctx;
  bool done = false;
  bool awaited = false;  // passed griddepcontrol.wait
  CommitGroups<Copy> copies;
  CommitGroups<PendingWgmma> wgmmas;
};

struct WarpSlots {  // what the lanes of a warp deposit for a collective
  uint32_t a[32][4], b[32][2];
  uint32_t v[32];
};

// The barriers of a block's groups of `size` threads (warps, warpgroups); group i: threads size i ..
struct GroupBarriers {
  int size;
  int arrived[32] = {}, exited[32] = {};
  uint64_t gen[32] = {};
};

struct BlockState {
  std::vector<Fiber> fibers;
  ucontext_t scheduler;
  int current = 0, threads = 0, exited = 0;
  uint64_t events = 0;  // arrivals, passes, exits: progress for the deadlock check
  // block barrier
  int block_arrived = 0;
  uint64_t block_gen = 0;
  int block_or = 0;
  std::map<uint64_t, int> block_or_result;
  GroupBarriers warps{32}, warpgroups{128};
  WarpSlots warp[32];
  WarpgroupSlots warpgroup[8];
  std::shared_ptr<IssuedWgmma> wg_issued[8];          // the warpgroup's newest wgmma, for its threads to take
  std::vector<std::shared_ptr<IssuedWgmma>> wg_reads;  // wgmma not yet run by every thread: no copies into their B
  std::function<void()> body;
  bool failed = false;  // a thread called fail(): the grid stops
};

inline BlockState*& block() {
  static BlockState* b = nullptr;
  return b;
}
inline dim3& thread_idx() { static dim3 v; return v; }
inline dim3& block_idx() { static dim3 v; return v; }

inline int tid() { return (int)thread_idx().x; }
inline void yield() {
  BlockState* b = block();
  swapcontext(&b->fibers[b->current].ctx, &b->scheduler);
}

// Open the block's / warp w's barrier where every thread has arrived or exited (an exit can complete one too)
inline void release_block(BlockState* b) {
  if (b->block_arrived > 0 && b->block_arrived + b->exited == b->threads) {
    b->block_or_result[b->block_gen] = b->block_or;
    b->block_or = 0;
    b->block_arrived = 0;
    ++b->block_gen;
  }
}
inline void release_group(const BlockState* b, GroupBarriers& gb, int w) {
  if (gb.arrived[w] > 0 && gb.arrived[w] + gb.exited[w] == std::min(gb.size, b->threads - gb.size * w)) {
    gb.arrived[w] = 0;
    ++gb.gen[w];
  }
}

// The first error of the current launch, for the caller (hf_w4_emu_error); empty: none
inline std::string& launch_error() {
  static std::string e;
  return e;
}

// An error the GPU would show as a fault or as wrong results: recorded as the launch's error (the first one counts),
// and the calling thread's block stops there; run_grid then runs no further block. Outside a block (the launch's own
// checks) it returns, and the launch does not run.
__attribute__((format(printf, 1, 2))) inline void fail(const char* format, ...) {
  char text[512];
  va_list args;
  va_start(args, format);
  std::vsnprintf(text, sizeof text, format, args);
  va_end(args);
  if (launch_error().empty()) launch_error() = std::string("hf_w4 CUDA emulation: ") + text;
  if (BlockState* b = block()) {
    b->failed = true;
    swapcontext(&b->fibers[b->current].ctx, &b->scheduler);  // never resumed
  }
}

// Whether the running launch may overlap the kernel before it (programmatic dependent launch): its threads must then
// read x and write anything only after griddepcontrol.wait, which the copies, loads, stores and atomics below check
inline bool& overlapped_launch() {
  static bool v = false;
  return v;
}
inline void require_awaited(const char* what) {
  BlockState* b = block();
  if (overlapped_launch() && b && !b->fibers[b->current].awaited)
    fail("%s by thread %d of block (%u, %u, %u) before griddepcontrol.wait, in a kernel launched to overlap the one "
         "before it (which may still write that memory)", what, tid(), block_idx().x, block_idx().y, block_idx().z);
}

// When a cp.async lands: false (the default), when the issuing thread waits for its group (shared memory holds the
// old bytes until then, so a read before the wait, or by another thread before the barrier after it, sees stale
// data, as it may on the GPU); true, when issued, and run_grid runs the warps of a block one at a time, each as far
// as it goes before the next block barrier, so that a refill issued by a warp ahead lands while a warp behind may still
// have reads of the old bytes to do, which then see the new ones, as they may on the GPU
inline bool& copies_land_at_issue() {
  static bool v = false;
  return v;
}

inline void fiber_main() {
  BlockState* b = block();
  b->body();
  if (!b->fibers[b->current].wgmmas.empty())
    fail("thread %d of block (%u, %u, %u) exited with wgmma in flight (no wgmma.wait_group 0)", tid(), block_idx().x,
         block_idx().y, block_idx().z);
  b->fibers[b->current].done = true;
  ++b->exited;
  for (GroupBarriers* gb : {&b->warps, &b->warpgroups}) ++gb->exited[tid() / gb->size];
  ++b->events;
  release_block(b);
  for (GroupBarriers* gb : {&b->warps, &b->warpgroups}) release_group(b, *gb, tid() / gb->size);
  swapcontext(&b->fibers[b->current].ctx, &b->scheduler);  // never resumed
}

// Every live thread of the block arrives; returns the generation passed
inline uint64_t block_barrier() {
  BlockState* b = block();
  const uint64_t gen = b->block_gen;
  ++b->block_arrived;
  ++b->events;
  release_block(b);
  while (b->block_gen == gen) yield();
  ++b->events;
  return gen;
}
// Every live thread of the calling thread's group (warp, warpgroup) arrives
inline void group_barrier(GroupBarriers BlockState::*groups) {
  BlockState* b = block();
  GroupBarriers& gb = b->*groups;
  const int w = tid() / gb.size;
  const uint64_t gen = gb.gen[w];
  ++gb.arrived[w];
  ++b->events;
  release_group(b, gb, w);
  while (gb.gen[w] == gen) yield();
  ++b->events;
}
inline void warp_barrier() { group_barrier(&BlockState::warps); }
inline void warpgroup_barrier() { group_barrier(&BlockState::warpgroups); }

// Runs body() as every thread of every block of the grid. Blocks run in a shuffled order and each round resumes the
// waiting threads in a shuffled order (fixed seed): no kernel may depend on either, and a fixed order would hide a
// dependence (e.g. on which split-K block arrives last). With copies_land_at_issue(), each round runs the warps one at
// a time in a shuffled order, each until all its threads wait for another warp or have exited.
inline void run_grid(dim3 grid, dim3 blk, const std::function<void()>& body) {
  const int threads = (int)(blk.x * blk.y * blk.z);
  if (threads > 1024 || blk.y != 1 || blk.z != 1) return fail("block (%u, %u, %u) not supported", blk.x, blk.y, blk.z);
  std::unique_ptr<char[]> stacks(new char[threads * kStackBytes]);  // the fibers' stacks, reused block after block
  std::vector<dim3> blocks;
  for (unsigned z = 0; z < grid.z; ++z)
    for (unsigned y = 0; y < grid.y; ++y)
      for (unsigned x = 0; x < grid.x; ++x) blocks.emplace_back(x, y, z);
  static std::mt19937 rng(1);
  std::shuffle(blocks.begin(), blocks.end(), rng);
  std::vector<int> order(threads);
  for (const dim3& bi : blocks) {
    BlockState b;
    b.threads = threads;
    b.body = body;
    b.fibers.resize(threads);
    block() = &b;
    block_idx() = bi;
    for (int t = 0; t < threads; ++t) {
      Fiber& f = b.fibers[t];
      getcontext(&f.ctx);
      f.ctx.uc_stack.ss_sp = stacks.get() + t * kStackBytes;
      f.ctx.uc_stack.ss_size = kStackBytes;
      f.ctx.uc_link = nullptr;
      makecontext(&f.ctx, fiber_main, 0);
      order[t] = t;
    }
    while (b.exited < threads) {
      const uint64_t before = b.events;
      std::shuffle(order.begin(), order.end(), rng);
      auto resume = [&](int t) {
        if (b.fibers[t].done || b.failed) return;
        b.current = t;
        thread_idx() = dim3(t);
        swapcontext(&b.scheduler, &b.fibers[t].ctx);
      };
      if (!copies_land_at_issue()) {
        for (int t : order) resume(t);
      } else {  // the warps one at a time (shuffled), each as far as it goes without the others
        std::vector<int> warps((threads + 31) / 32);
        for (size_t w = 0; w < warps.size(); ++w) warps[w] = (int)w;
        std::shuffle(warps.begin(), warps.end(), rng);
        for (int w : warps)
          for (uint64_t seen = ~0ull; seen != b.events && !b.failed;) {
            seen = b.events;
            for (int t : order)
              if (t / 32 == w) resume(t);
          }
      }
      if (!b.failed && b.events == before) {
        block() = nullptr;
        return fail("block (%u, %u, %u) deadlocked at a barrier", bi.x, bi.y, bi.z);
      }
      if (b.failed) break;  // the other threads' fibers are dropped with their stacks
    }
    block() = nullptr;
    if (b.failed) return;
  }
}

// kernel<<<grid, block, smem, stream>>>(args...), launched to overlap the kernel before it where `overlap`
template <class K>
auto launch(K kernel, dim3 grid, dim3 blk, size_t smem, bool overlap = false) {
  return [=](auto... args) {
    if (smem > kSharedBytes) return fail("%zu bytes of dynamic shared memory", smem);
    overlapped_launch() = overlap;
    run_grid(grid, blk, [&] { kernel(args...); });
    overlapped_launch() = false;
  };
}

// ---- the PTX of the kernels
inline uint4 ld_stream(const int32_t* p) {
  require_awaited("a load");
  uint4 r;
  std::memcpy(&r, p, 16);
  return r;
}
inline void land(const Copy& c) {
  if (c.landed) return;
  if (c.src) std::memcpy(c.dst, c.src, 16);
  else std::memset(c.dst, 0, 16);
}
inline uint32_t smem_offset(const void* p);
inline bool IssuedWgmma::overlaps(const void* smem16) const {
  const uint32_t at = smem_offset(smem16);
  return at < end && at + 16 > start;
}
inline void cp_async16(void* smem, const void* gmem, bool full = true) {
  require_awaited("cp.async");
  for (const auto& r : block()->wg_reads)
    if (r->overlaps(smem))
      return fail("cp.async into shared memory bytes %u.. that an issued wgmma may still read (%u..%u): wait for it "
                  "first", smem_offset(smem), r->start, r->end);
  Copy c{smem, full ? gmem : nullptr, false};
  if (copies_land_at_issue()) {
    land(c);
    c.landed = true;
  }
  block()->fibers[block()->current].copies.open.push_back(c);
}
// griddepcontrol.launch_dependents + griddepcontrol.wait: nothing runs beside a launch here, so only the order of
// the calling thread's accesses is checked (require_awaited)
inline void grid_dependency_wait() { block()->fibers[block()->current].awaited = true; }
// cp.async.bulk.prefetch.L2: reads nothing for the kernel, but its range must be valid, 16-byte aligned and sized
inline void prefetch_l2(const void* p, uint32_t bytes) {
  if (reinterpret_cast<uintptr_t>(p) % 16 || bytes == 0 || bytes % 16)
    return fail("cp.async.bulk.prefetch.L2 of %u bytes at %p: needs a positive multiple of 16 bytes at a 16-byte "
                "aligned address", bytes, p);
  const volatile char* c = static_cast<const char*>(p);
  (void)c[0];
  (void)c[bytes - 1];  // past a buffer's end: the guard page faults
}
inline void cp_async_commit() { block()->fibers[block()->current].copies.commit(); }
// all but the newest n committed groups complete
inline void cp_async_wait(size_t n) {
  block()->fibers[block()->current].copies.wait(n, land);
}

// cvt.rn.f16x2.e4m3x2: the E4M3 byte in bits 0..7 to the low fp16 half, bits 8..15 to the high one (exact; 0x7f /
// 0xff are NaN)
inline uint32_t cvt_f16x2_e4m3x2(uint16_t v) {
  uint32_t out = 0;
  for (int h = 0; h < 2; ++h) {
    const uint32_t b = (v >> (8 * h)) & 0xffu, e = (b >> 3) & 15u, m = b & 7u;
    float f = (b & 0x7fu) == 0x7fu ? NAN : (e ? std::ldexp(8.0f + m, (int)e - 10) : std::ldexp((float)m, -9));
    if (b & 0x80u) f = -f;
    out |= (uint32_t)hf_w4::f32_to_f16_bits(f) << (16 * h);
  }
  return out;
}

// D = A (16 x 16, row) x B (16 x 8, col) + C over the warp's fragments (PTX ISA, mma.m16n8k16 with .f16 / .bf16)
template <bool BF16>
void mma16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  BlockState* bs = block();
  const int lane = tid() & 31;
  WarpSlots& w = bs->warp[tid() / 32];
  for (int i = 0; i < 4; ++i) w.a[lane][i] = a[i];
  w.b[lane][0] = b0;
  w.b[lane][1] = b1;
  warp_barrier();
  auto half = [](uint32_t v, int h) {
    const uint16_t bits = static_cast<uint16_t>(v >> (16 * h));
    return BF16 ? hf_w4::bf16_bits_to_f32(bits) : hf_w4::f16_bits_to_f32(bits);
  };
  auto A = [&](int row, int k) {  // a0 (g, 2t..), a1 (g + 8, 2t..), a2 (g, 2t + 8..), a3 (g + 8, 2t + 8..)
    return half(w.a[4 * (row % 8) + (k % 8) / 2][(row >= 8) + 2 * (k >= 8)], k % 2);
  };
  auto B = [&](int k, int col) {  // b0 (k 2t, 2t + 1; col g), b1 (k 2t + 8, 2t + 9; col g)
    return half(w.b[4 * col + (k % 8) / 2][k >= 8], k % 2);
  };
  float d[4];
  const int g = lane >> 2, t = lane & 3;
  for (int r = 0; r < 4; ++r) {
    const int row = g + 8 * (r >> 1), col = 2 * t + (r & 1);
    float s = c[r];
    for (int k = 0; k < 16; ++k) s = std::fmaf(A(row, k), B(k, col), s);
    d[r] = s;
  }
  warp_barrier();  // every lane has read the deposits
  for (int r = 0; r < 4; ++r) c[r] = d[r];
}

}  // namespace hf_w4_emu

#define threadIdx (hf_w4_emu::thread_idx())
#define blockIdx (hf_w4_emu::block_idx())

inline void __syncthreads() { hf_w4_emu::block_barrier(); }
inline int __syncthreads_or(int pred) {
  hf_w4_emu::BlockState* b = hf_w4_emu::block();
  b->block_or |= pred != 0;
  const uint64_t gen = hf_w4_emu::block_barrier();
  return b->block_or_result[gen];
}
inline void __syncwarp(unsigned = 0xffffffffu) { hf_w4_emu::warp_barrier(); }
inline void __threadfence() {}
inline int atomicAdd(int* p, int v) {
  hf_w4_emu::require_awaited("an atomic");
  const int old = *p;
  *p = old + v;
  return old;
}
template <class T>
T __shfl_sync(unsigned, T v, int src) {
  static_assert(sizeof(T) == 4, "32-bit values");
  hf_w4_emu::BlockState* b = hf_w4_emu::block();
  hf_w4_emu::WarpSlots& w = b->warp[hf_w4_emu::tid() / 32];
  std::memcpy(&w.v[hf_w4_emu::tid() & 31], &v, 4);
  hf_w4_emu::warp_barrier();
  T r;
  std::memcpy(&r, &w.v[src & 31], 4);
  hf_w4_emu::warp_barrier();
  return r;
}
template <class T>
T __ldg(const T* p) { return *p; }
template <class T>
T __ldcg(const T* p) {
  hf_w4_emu::require_awaited("a load");
  return *p;
}
template <class T>
void __stcg(T* p, T v) {
  hf_w4_emu::require_awaited("a store");
  *p = v;
}

// ---- cuda_fp16.h / cuda_bf16.h: the types and intrinsics the kernels use; each operation rounds its exact fp32
// result once (exact in fp32 for the kernels' operands)
struct __half { uint16_t x; };
struct __half2 { uint16_t x, y; };
struct __nv_bfloat16 { uint16_t x; };
struct __nv_bfloat162 { uint16_t x, y; };

inline float __half2float(__half h) { return hf_w4::f16_bits_to_f32(h.x); }
inline __half __float2half_rn(float f) { return __half{hf_w4::f32_to_f16_bits(f)}; }
inline __half __ushort_as_half(unsigned short v) { return __half{v}; }
inline unsigned short __half_as_ushort(__half h) { return h.x; }
inline float2 __half22float2(__half2 h) { return float2{hf_w4::f16_bits_to_f32(h.x), hf_w4::f16_bits_to_f32(h.y)}; }
inline __half2 __float22half2_rn(float2 f) { return __half2{hf_w4::f32_to_f16_bits(f.x), hf_w4::f32_to_f16_bits(f.y)}; }

inline float __bfloat162float(__nv_bfloat16 h) { return hf_w4::bf16_bits_to_f32(h.x); }
inline __nv_bfloat16 __float2bfloat16_rn(float f) { return __nv_bfloat16{hf_w4::f32_to_bf16_bits(f)}; }
inline __nv_bfloat16 __ushort_as_bfloat16(unsigned short v) { return __nv_bfloat16{v}; }
inline unsigned short __bfloat16_as_ushort(__nv_bfloat16 h) { return h.x; }
inline float2 __bfloat1622float2(__nv_bfloat162 h) {
  return float2{hf_w4::bf16_bits_to_f32(h.x), hf_w4::bf16_bits_to_f32(h.y)};
}
inline __nv_bfloat162 __float22bfloat162_rn(float2 f) {
  return __nv_bfloat162{hf_w4::f32_to_bf16_bits(f.x), hf_w4::f32_to_bf16_bits(f.y)};
}

namespace hf_w4_emu {
inline float2 unpack(__half2 v) { return __half22float2(v); }
inline float2 unpack(__nv_bfloat162 v) { return __bfloat1622float2(v); }
inline void pack(float2 f, __half2& r) { r = __float22half2_rn(f); }
inline void pack(float2 f, __nv_bfloat162& r) { r = __float22bfloat162_rn(f); }
// op on both lanes, computed in fp32 and rounded once
template <class T, class Op>
T lanewise(T a, T b, T c, Op op) {
  const float2 x = unpack(a), y = unpack(b), z = unpack(c);
  T r;
  pack(float2{op(x.x, y.x, z.x), op(x.y, y.y, z.y)}, r);
  return r;
}
}  // namespace hf_w4_emu

template <class T>
T __hsub2(T a, T b) { return hf_w4_emu::lanewise(a, b, b, [](float x, float y, float) { return x - y; }); }
template <class T>
T __hmul2(T a, T b) { return hf_w4_emu::lanewise(a, b, b, [](float x, float y, float) { return x * y; }); }
template <class T>
T __hfma2(T a, T b, T c) {
  return hf_w4_emu::lanewise(a, b, c, [](float x, float y, float z) { return std::fmaf(x, y, z); });
}

// the kernels' dynamic shared memory (extern __shared__ uint4 smem[] in the kernels' namespace)
namespace hf_w4 {
namespace cuda {
namespace {
thread_local uint4 smem[hf_w4_emu::kSharedBytes / 16];
}  // namespace
}  // namespace cuda
}  // namespace hf_w4

namespace hf_w4_emu {
inline uint32_t smem_offset(const void* p) {
  return (uint32_t)(static_cast<const char*>(p) - reinterpret_cast<const char*>(hf_w4::cuda::smem));
}

// wgmma.mma_async.m64nNk16 (.f32 accumulators, .f16 / .bf16 operands) with A from registers and B from shared memory,
// as a collective of the calling thread's warpgroup (blocks of whole warpgroups): A's fragments per warp as
// mma.m16n8k16's (warp w of the warpgroup: rows 16 w ..), B K-major without swizzle through the descriptor (start
// address, K-direction core-matrix offset, 8-row-group offset, each >> 4; anything else fails), D as 16 x N per warp:
// value i at row 16 w + g + 8 ((i >> 1) & 1), column 8 (i >> 2) + 2 t + (i & 1). Asynchronous as on the GPU, and as
// late as it may be for its result: B is read from shared memory when issued (as early as the GPU may; a copy into B
// that some thread has not yet waited for fails the launch), and each thread's share of d is written at the
// wgmma.wait_group that completes it (a kernel that reads d too early gets wrong results here); a cp.async into B's
// bytes before every thread of the warpgroup has waited for the wgmma fails the launch.
template <bool BF16, size_t V>
void wgmma_m64k16_async(float (&d)[V], const uint32_t (&a)[4], uint64_t desc, int n) {
  BlockState* bs = block();
  const int me = tid() % 128;
  if (bs->threads % 128 || (size_t)n != 2 * V || n % 8 || n > 256)
    return fail("wgmma needs a block of whole warpgroups and N = 2 x its values");
  WarpgroupSlots& wg = bs->warpgroup[tid() / 128];
  for (int i = 0; i < 4; ++i) wg.a[me][i] = a[i];
  wg.desc[me] = desc;
  warpgroup_barrier();
  const uint32_t start = (uint32_t)(desc & 0x3fff) << 4, lbo = (uint32_t)((desc >> 16) & 0x3fff) << 4,
                 sbo = (uint32_t)((desc >> 32) & 0x3fff) << 4;
  bool same = true;
  for (int t = 0; t < 128; ++t) same = same && wg.desc[t] == desc;
  if (!same || (desc >> 49) != 0 || (desc & 0xc000ull) || (desc & 0xc0000000ull) || ((desc >> 46) & 7) ||
      start + (size_t)(n / 8 - 1) * sbo + lbo + 128 > kSharedBytes)
    return fail("wgmma descriptor %llx not supported (one for all threads, no swizzle, base offset 0, inside shared "
                "memory)", (unsigned long long)desc);
  if (me == 0) {
    auto op = std::make_shared<IssuedWgmma>();
    op->a = wg;
    op->bf16 = BF16;
    op->start = start;
    op->lbo = lbo;
    op->sbo = sbo;
    op->end = start + (uint32_t)(n / 8 - 1) * sbo + lbo + 128;
    // B's bytes must have arrived: no thread may still have a copy into them that it has not waited for
    const auto into_b = [&](const Copy& c) { return op->overlaps(c.dst); };
    for (int t = 0; t < bs->threads; ++t) {
      const auto& q = bs->fibers[t].copies;
      bool pending = std::any_of(q.open.begin(), q.open.end(), into_b);
      for (const auto& g : q.groups) pending = pending || std::any_of(g.begin(), g.end(), into_b);
      if (pending)
        return fail("wgmma issued on shared memory bytes %u..%u with a cp.async into them by thread %d not yet waited "
                    "for", op->start, op->end, t);
    }
    const char* base = reinterpret_cast<const char*>(hf_w4::cuda::smem);
    op->b.assign(base + op->start, base + op->end);
    bs->wg_issued[tid() / 128] = op;
    bs->wg_reads.push_back(op);
  }
  warpgroup_barrier();  // the record exists; every thread has taken the deposits
  bs->fibers[bs->current].wgmmas.open.push_back(
      PendingWgmma{d, V, bs->wg_issued[tid() / 128], a, {a[0], a[1], a[2], a[3]}});
}

inline void run_wgmma(const PendingWgmma& share) {
  // the GPU may read A's registers up to the wait that completes the wgmma: writing them earlier is a race
  if (!std::equal(share.issued, share.issued + 4, share.a))
    return fail("the A registers of a wgmma in flight were overwritten before the wait that completes it");
  const IssuedWgmma& op = *share.op;
  auto half = [&](uint32_t v, int h) {
    const uint16_t bits = static_cast<uint16_t>(v >> (16 * h));
    return op.bf16 ? hf_w4::bf16_bits_to_f32(bits) : hf_w4::f16_bits_to_f32(bits);
  };
  const char* base = op.b.data();  // B as it was when issued
  auto A = [&](int row, int k) {
    const int r = row % 16;
    return half(op.a.a[32 * (row / 16) + 4 * (r % 8) + (k % 8) / 2][(r >= 8) + 2 * (k >= 8)], k % 2);
  };
  auto B = [&](int k, int col) {
    uint16_t v;
    std::memcpy(&v, base + (size_t)(col / 8) * op.sbo + (size_t)(k / 8) * op.lbo + (col % 8) * 16 + (k % 8) * 2, 2);
    return half(v, 0);
  };
  const int me = tid() % 128, w = me / 32, g = (me & 31) >> 2, t = me & 3;
  for (size_t i = 0; i < share.values; ++i) {
    const int row = 16 * w + g + 8 * (int)((i >> 1) & 1), col = 8 * (int)(i >> 2) + 2 * t + (int)(i & 1);
    float s = share.d[i];
    for (int k = 0; k < 16; ++k) s = std::fmaf(A(row, k), B(k, col), s);
    share.d[i] = s;
  }
  if (--share.op->left == 0) {
    auto& reads = block()->wg_reads;
    reads.erase(std::find(reads.begin(), reads.end(), share.op));
  }
}

// wgmma.commit_group and wgmma.wait_group n: this thread's shares of all but the newest n groups run now
inline void wgmma_commit() { block()->fibers[block()->current].wgmmas.commit(); }
inline void wgmma_wait(size_t n) { block()->fibers[block()->current].wgmmas.wait(n, run_wgmma); }
}  // namespace hf_w4_emu
