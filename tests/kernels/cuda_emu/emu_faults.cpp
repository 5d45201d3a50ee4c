// Kernels that break the rules the CUDA stand-in (cuda_runtime.h) checks, one per case, as a ctypes library for
// tests/kernels/test_cuda_emulated.py: each launch must come back with the stand-in's error, not a crash and not
// silence, so a kernel of csrc/cuda that broke the same rule would fail its tests the same way.
#include "cuda_runtime.h"

#include <cstdint>

namespace {

using hf_w4::cuda::smem;

// A warpgroup's wgmma on B at the start of shared memory (K-major, no swizzle: 8-row groups 256 bytes apart, the
// two k halves 128 bytes apart; fault 4: with a swizzle mode, which the stand-in does not model), then what `fault`
// asks for
void wgmma_kernel(int fault) {
  float d[32] = {};
  uint32_t a[4] = {0x3c003c00u, 0x3c003c00u, 0x3c003c00u, 0x3c003c00u};
  const uint64_t swizzle = fault == 4 ? 1ull << 62 : 0;  // 128-byte swizzle
  const uint64_t desc = (uint64_t)(128 >> 4) << 16 | (uint64_t)(256 >> 4) << 32 | swizzle;  // start 0
  hf_w4_emu::wgmma_m64k16_async<false>(d, a, desc, 64);
  hf_w4_emu::wgmma_commit();
  if (fault == 6) {  // the next step's A written into the registers the wgmma in flight still reads
    a[0] = 0x40004000u;
    hf_w4_emu::wgmma_wait(0);
  }
  if (fault == 0) {  // waited for by every thread of the warpgroup: B's bytes are free again
    hf_w4_emu::wgmma_wait(0);
    __syncthreads();
  }
  if (fault == 10) {  // the next wgmma on B while this thread's copy into B is still in flight
    static const uint4 src{};
    hf_w4_emu::wgmma_wait(0);
    __syncthreads();
    hf_w4_emu::cp_async16(&smem[threadIdx.x % 64], &src);
    hf_w4_emu::cp_async_commit();
    hf_w4_emu::wgmma_m64k16_async<false>(d, a, desc, 64);
    hf_w4_emu::wgmma_commit();
    hf_w4_emu::cp_async_wait(0);
    hf_w4_emu::wgmma_wait(0);
  }
  if (fault <= 1) {  // a copy into B: fine after the wait, a hazard before it
    static const uint4 src{};
    hf_w4_emu::cp_async16(&smem[threadIdx.x % 64], &src);
    hf_w4_emu::cp_async_commit();
    hf_w4_emu::cp_async_wait(0);
  }
  if (fault == 1) hf_w4_emu::wgmma_wait(0);
  // fault 2: the thread exits with the wgmma in flight
}

// Half the warp waits at the warp's barrier, the other half at the block's: neither can complete
void deadlock_kernel() {
  if (threadIdx.x < 16) __syncwarp();
  else __syncthreads();
}

// A launch that overlaps the kernel before it: an L2 prefetch (fault 8: of 8 bytes, not a multiple of 16), then a copy
// from global memory, after griddepcontrol.wait (fault 7: before it)
void overlap_kernel(int fault) {
  static const uint4 src{};
  hf_w4_emu::prefetch_l2(&src, fault == 8 ? 8 : 16);
  if (fault != 7) hf_w4_emu::grid_dependency_wait();
  hf_w4_emu::cp_async16(&smem[threadIdx.x], &src);
  hf_w4_emu::cp_async_commit();
  hf_w4_emu::cp_async_wait(0);
}

// Each thread refills its 16 bytes of shared memory and, before any barrier, reads its neighbour's: a race, since
// nothing orders the neighbour's refill after the read. seen[t]: the word thread t read (0: the old bytes)
void refill_race_kernel(uint32_t* seen) {
  static const uint4 ones{1u, 1u, 1u, 1u};
  smem[threadIdx.x] = uint4{0u, 0u, 0u, 0u};
  __syncthreads();
  hf_w4_emu::cp_async16(&smem[threadIdx.x], &ones);
  hf_w4_emu::cp_async_commit();
  seen[threadIdx.x] = smem[(threadIdx.x + 1) % 32].x;
  __syncthreads();
  hf_w4_emu::cp_async_wait(0);
}

}  // namespace

extern "C" {

// Launches fault case `which` (0: no fault; 1: cp.async into an in-flight wgmma's B; 2: a thread exits with a wgmma in
// flight; 3: a barrier that cannot complete; 4: a swizzled wgmma descriptor; 5: more dynamic shared memory than an
// SM has; 6: A's registers written while a wgmma reads them; 7: a copy before griddepcontrol.wait in a launch that
// overlaps the kernel before it; 8: a prefetch of a size that is not a multiple of 16; 9: that launch without a
// fault; 10: a wgmma issued on shared memory with a copy into it not yet waited for); 0 if the launch came back
// without an error, else -3 (the error: hf_w4_emu_fault_error)
int hf_w4_emu_fault(int which) {
  hf_w4_emu::launch_error().clear();
  if (which == 7 || which == 8 || which == 9) hf_w4_emu::launch(overlap_kernel, dim3(2), dim3(32), 0, true)(which);
  else if (which == 3) hf_w4_emu::launch(deadlock_kernel, dim3(1), dim3(32), 0)();
  else hf_w4_emu::launch(wgmma_kernel, dim3(2), dim3(128), which == 5 ? hf_w4_emu::kSharedBytes + 16 : 0)(which);
  return hf_w4_emu::launch_error().empty() ? 0 : -3;
}

// The race above in one block of 32 threads, the copies landing when issued (at_issue = 1) or at the wait: how many
// threads read their neighbour's new bytes
int hf_w4_emu_refill_race(int at_issue) {
  hf_w4_emu::launch_error().clear();
  uint32_t seen[32] = {};
  hf_w4_emu::copies_land_at_issue() = at_issue != 0;
  hf_w4_emu::launch(refill_race_kernel, dim3(1), dim3(32), 0)(seen);
  hf_w4_emu::copies_land_at_issue() = false;
  int fresh = 0;
  for (uint32_t v : seen) fresh += v != 0;
  return hf_w4_emu::launch_error().empty() ? fresh : -3;
}

const char* hf_w4_emu_fault_error() { return hf_w4_emu::launch_error().c_str(); }
}
