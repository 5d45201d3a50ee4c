// The .cu files of csrc/cuda built for the CPU against this folder's stand-in for CUDA (cuda_runtime.h), as a ctypes
// library for tests/kernels/test_cuda_emulated.py: the fused kernel and the dequantize kernel on host buffers. Every
// buffer the kernels get is a copy that ends where an inaccessible page begins, so a read or write past its end
// faults instead of touching a neighbour's bytes.
#include "cuda_runtime.h"

#include <sys/mman.h>
#include <unistd.h>

#include <vector>

// the kernel families first: w4a16_gemm.cu calls their launchers
#include "w4a16_mma.cu"
#include "w4a16_wide.cu"
#include "w4a16_wgmma.cu"
#include "w4a16_gemm.cu"

using namespace hf_w4::cuda;

namespace {

struct Guarded {
  char* base = nullptr;
  size_t len = 0;
  void* data = nullptr;
  Guarded(const void* src, size_t bytes) {
    if (!src && !bytes) return;
    const size_t page = (size_t)sysconf(_SC_PAGESIZE), body = (bytes + page - 1) / page * page;
    len = body + page;
    void* m = mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (m == MAP_FAILED || mprotect(static_cast<char*>(m) + body, page, PROT_NONE) != 0) std::abort();
    base = static_cast<char*>(m);
    data = base + body - bytes;
    if (src) std::memcpy(data, src, bytes);
  }
  Guarded(const Guarded&) = delete;
  ~Guarded() {
    if (base) munmap(base, len);
  }
};

// bytes of the kernel layout's buffers (w4a16_math.cuh)
size_t qpack_bytes(int npad, int k) { return (size_t)npad / 64 * (k / 16) * 512; }
size_t scale_bytes(int npad, int k, int gs, int kind) {
  return kind == kNvfp4 ? (size_t)npad / 64 * (k / 16) * 64 : (size_t)npad / 64 * (k / gs) * 64 * 2;
}
size_t zero_bytes(int npad, int k, int gs, int kind) {
  return kind == kInt4Asym ? (size_t)npad / 64 * (k / gs) * 64 : 0;
}

}  // namespace

extern "C" {

// y [m, n] = x [m, k] @ W^T (+ bias) through the fused kernel, planned for `sms` SMs x the kernel's resident blocks
// per SM (132: an H100) with mt (1, 2, 4; 0: the rule), wide (1: the wide kernel, 0: not, -1: the rule) and
// force_splits (0: the rule) as w4a16_gemm_plan takes them, or the wgmma kernel (wgmma = 1; wgmma_rows: its rows
// per block, 0: the rule); the plan's splits in *splits, its rows per block in *rows
int hf_w4_emu_gemm(const void* x, const int32_t* qpack, const void* scales, const uint8_t* zeros, const void* bias,
                   void* y, int m, int n, int k, int group_size, int kind, int bf16, float global_scale, int sms,
                   int mt, int wide, int force_splits, int wgmma, int wgmma_rows, int* splits, int* rows) {
  hf_w4_emu::launch_error().clear();
  const int npad = (n + 63) / 64 * 64;
  GemmPlan plan =
      w4a16_gemm_plan(m, npad, k, bf16 != 0, kind, sms, mt, wide, nullptr, force_splits, wgmma != 0, wgmma_rows);
  plan.overlap = true;  // as on sm_90+: every access but the prefetches must follow griddepcontrol.wait
  *splits = plan.splits;
  *rows = plan.bm;
  const int gs = kind == kNvfp4 ? 16 : group_size;
  Guarded gx(x, (size_t)m * k * 2), gq(qpack, qpack_bytes(npad, k)), gsc(scales, scale_bytes(npad, k, gs, kind)),
      gz(kind == kInt4Asym ? zeros : nullptr, zero_bytes(npad, k, gs, kind)), gb(bias, bias ? (size_t)n * 2 : 0),
      gy(y, (size_t)m * n * 2), gw(nullptr, (size_t)plan.ws_floats * 4), gc(nullptr, (size_t)plan.counters * 4);
  GemmArgs a{};
  a.x = gx.data;
  a.qpack = static_cast<const int32_t*>(gq.data);
  a.scales = gsc.data;
  a.zeros = static_cast<const uint8_t*>(gz.data);
  a.bias = gb.data;
  a.y = gy.data;
  a.workspace = static_cast<float*>(gw.data);
  a.counters = static_cast<int*>(gc.data);
  a.m = m;
  a.n = n;
  a.npad = npad;
  a.k = k;
  a.group_size = gs;
  a.group_shift = group_shift_of(gs);
  a.global_scale = global_scale;
  a.kind = kind;
  a.bf16 = bf16 != 0;
  if (w4a16_gemm(a, plan, nullptr) != cudaSuccess) return -1;
  if (!hf_w4_emu::launch_error().empty()) return -3;
  std::memcpy(y, gy.data, (size_t)m * n * 2);
  for (int i = 0; i < plan.counters; ++i)  // the kernel leaves every split-K counter zero
    if (static_cast<int*>(gc.data)[i]) return -2;
  return 0;
}

// The plan itself (for the tests of its rules, with this stand-in's occupancy): mt, mr, m-blocks, tiles, splits, wide
// (wgmma = 1: the wgmma kernel's plan, whose mt is its rows / 16)
void hf_w4_emu_plan(int m, int n, int k, int bf16, int kind, int sms, int mt, int wide, int force_splits, int wgmma,
                    int* out) {
  const GemmPlan p =
      w4a16_gemm_plan(m, (n + 63) / 64 * 64, k, bf16 != 0, kind, sms, mt, wide, nullptr, force_splits, wgmma != 0);
  const int v[6] = {p.mt, p.mr, p.mblocks, p.ntiles, p.splits, p.wide ? 1 : 0};
  std::memcpy(out, v, sizeof(v));
}

// Whether the fused path takes the wgmma kernel by default on a device that has it
int hf_w4_emu_wgmma_rule(int m, int n, int k) { return w4a16_wgmma_rule(m, (n + 63) / 64 * 64, k); }

// Where the next launches' cp.async copies land: 0 at the issuing thread's wait (the default), 1 when issued
// (cuda_runtime.h, copies_land_at_issue)
void hf_w4_emu_copies_at_issue(int on) { hf_w4_emu::copies_land_at_issue() = on != 0; }

// The error that stopped the last launch (a return value of -3), e.g. a barrier that cannot complete
const char* hf_w4_emu_error() { return hf_w4_emu::launch_error().c_str(); }

int hf_w4_emu_dequant(const int32_t* qpack, const void* scales, const uint8_t* zeros, void* w, int n, int k,
                      int group_size, float global_scale, int kind, int bf16) {
  hf_w4_emu::launch_error().clear();
  const int npad = (n + 63) / 64 * 64, gs = kind == kNvfp4 ? 16 : group_size;
  Guarded gq(qpack, qpack_bytes(npad, k)), gsc(scales, scale_bytes(npad, k, gs, kind)),
      gz(kind == kInt4Asym ? zeros : nullptr, zero_bytes(npad, k, gs, kind)), gw(nullptr, (size_t)n * k * 2);
  if (w4a16_dequant(static_cast<const int32_t*>(gq.data), gsc.data, static_cast<const uint8_t*>(gz.data), gw.data, n,
                    npad, k, gs, global_scale, kind, bf16 != 0, nullptr) != cudaSuccess)
    return -1;
  if (!hf_w4_emu::launch_error().empty()) return -3;
  std::memcpy(w, gw.data, (size_t)n * k * 2);
  return 0;
}
}
