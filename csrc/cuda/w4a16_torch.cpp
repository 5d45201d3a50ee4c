// torch glue of the CUDA W4A16 kernels: checks, allocations from torch's caching allocator, the launch on the
// current stream. Schemas are defined in hf_w4/ops.py; this file only registers the CUDA implementations.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdlib>
#include <map>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "w4a16_launch.h"

namespace hf_w4 {
namespace cuda {
namespace {

int weight_kind(c10::string_view weight_type_sv, const std::optional<at::Tensor>& zeros) {
  const std::string weight_type(weight_type_sv);
  if (weight_type == "nvfp4") return kNvfp4;
  TORCH_CHECK(weight_type == "int4", "hf_w4 cuda_w4a16: weight_type '", weight_type,
              "' is not supported; supported: int4, nvfp4");
  return zeros.has_value() && zeros->numel() ? kInt4Asym : kInt4Sym;
}

// A device attribute, read once per device (cudaDeviceGetAttribute is cheap, but the plan asks on every call)
template <cudaDeviceAttr ATTR>
int device_attribute(int device) {
  static int cached[64] = {0};
  if (device < 64 && cached[device]) return cached[device];
  int v = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&v, ATTR, device));
  if (device < 64) cached[device] = v;
  return v;
}

// The split-K tile counters of a call: zero on entry, and every launch leaves them zero (the last block of a tile
// resets its counter). Outside graph capture one buffer per device and stream serves every call. A captured call
// takes a slice of its own from a per-device arena zeroed outside capture, never handed out twice: the graph then
// needs no zeroing node (an extra kernel in every replay), and graphs replayed side by side never share counters.
// Where the arena has no room (it is refilled only by calls outside capture), the graph zeroes a buffer of its own.
struct CounterArena {
  at::Tensor free;                  // zeroed, not yet handed out
  std::vector<at::Tensor> retired;  // earlier arenas: captured graphs still use their slices
};
constexpr int64_t kArenaInts = 1 << 18;  // 1 MiB; a call needs at most one counter per block of one wave

at::Tensor split_counters(int64_t n, const at::Tensor& like) {
  const auto options = like.options().dtype(at::kInt);
  const bool capturing = c10::cuda::currentStreamCaptureStatusMayInitCtx() != c10::cuda::CaptureStatus::None;
  static std::mutex mu;
  // never destroyed: freeing CUDA memory during static destruction can run after the CUDA runtime has shut down
  static auto* cache = new std::map<std::pair<int, c10::StreamId>, at::Tensor>();
  static auto* arenas = new std::map<int, CounterArena>();
  const int device = static_cast<int>(like.get_device());
  const std::lock_guard<std::mutex> lock(mu);
  CounterArena& arena = (*arenas)[device];
  if (capturing) {
    if (!arena.free.defined() || arena.free.numel() < n) return at::zeros({n}, options);
    at::Tensor slice = arena.free.narrow(0, 0, n);
    arena.free = arena.free.narrow(0, n, arena.free.numel() - n);
    return slice;
  }
  if (!arena.free.defined() || arena.free.numel() < kArenaInts / 2) {
    if (arena.free.defined()) arena.retired.push_back(arena.free);
    arena.free = at::zeros({kArenaInts}, options);
    // zeroed before any graph captured from now on can replay, whatever stream replays it
    C10_CUDA_CHECK(cudaStreamSynchronize(c10::cuda::getCurrentCUDAStream()));
  }
  at::Tensor& t = (*cache)[{device, c10::cuda::getCurrentCUDAStream().id()}];
  if (!t.defined() || t.numel() < n) t = at::zeros({std::max<int64_t>(n, 4096)}, options);
  return t;
}

// A small integer setting of the fused kernel's plan, read per call (a getenv, next to a kernel launch) so that a
// benchmark can compare the choices in one process: `unset` when the variable is unset or empty, else its value
// (plain decimal digits, no leading zero), which `ok` must accept.
template <class Ok>
int plan_setting(const char* name, int unset, Ok ok, const char* expected) {
  const char* e = std::getenv(name);
  if (!e || !*e) return unset;
  const std::string v(e);
  const bool decimal = v.size() <= 4 && (v == "0" || v[0] != '0') &&
                       std::all_of(v.begin(), v.end(), [](char c) { return c >= '0' && c <= '9'; });
  TORCH_CHECK(decimal && ok(std::stoi(v)), name, "='", v, "': expected ", expected);
  return std::stoi(v);
}

// HF_W4_CUDA_MT: the fused kernel's m16 tiles per block (1, 2, 4) instead of the rule by M and K; 0 when unset
int mt_override() {
  return plan_setting("HF_W4_CUDA_MT", 0, [](int v) { return v == 1 || v == 2 || v == 4; },
                      "1, 2 or 4 (m16 tiles per block)");
}

// HF_W4_CUDA_WIDE=1 / 0: the wide kernel (blocks of 4 column tiles sharing the activations) or not, instead of the
// rule (-1 when unset)
int wide_kernel() {
  return plan_setting("HF_W4_CUDA_WIDE", -1, [](int v) { return v == 0 || v == 1; },
                      "1 (the wide kernel) or 0 (not)");
}

// HF_W4_CUDA_SPLITS=n: the fused kernel splits K n ways (within 1 .. K / 128) instead of filling one wave of
// resident blocks; 0 when unset (the benchmark's split-K table)
int splits_override() {
  return plan_setting("HF_W4_CUDA_SPLITS", 0, [](int v) { return v > 0; }, "a positive number of K splits");
}

// HF_W4_CUDA_WGMMA=1: the sm_90a wgmma kernel for every call of the fused path, an error where this GPU or build has
// none; 0: never; unset (-1): w4a16_wgmma_rule where the device has the kernel and no mma.sync tiling is forced
int wgmma_setting() {
  const int n = plan_setting("HF_W4_CUDA_WGMMA", -1, [](int v) { return v == 0 || v == 1; },
                             "1 (the sm_90a wgmma kernel) or 0 (not)");
  TORCH_CHECK(n <= 0 || w4a16_wgmma_available(), "HF_W4_CUDA_WGMMA=1: the wgmma kernel needs a GPU of compute "
              "capability 9.0 (H100 / H200) and the library built for sm_90a; this device or build has none");
  return n;
}

// HF_W4_CUDA_WGMMA_ROWS=64 / 128: the wgmma kernel's rows of x per block instead of the rule (0 when unset)
int wgmma_rows_override() {
  return plan_setting("HF_W4_CUDA_WGMMA_ROWS", 0, [](int v) { return v == 64 || v == 128; },
                      "64 or 128 (rows of x per wgmma block)");
}

// HF_W4_CUDA_PDL=0: launch the GEMM kernels without overlapping the kernel before them in the stream (programmatic
// dependent launch); 1 (the default): overlap on GPUs of compute capability 9.x and 10.x (Hopper, data-center
// Blackwell; on sm_120 CUDA graph capture of such launches has been reported to fail)
bool overlap_setting(int device) {
  if (!plan_setting("HF_W4_CUDA_PDL", 1, [](int v) { return v == 0 || v == 1; }, "1 (overlap) or 0 (not)"))
    return false;
  const int major = device_attribute<cudaDevAttrComputeCapabilityMajor>(device);
  return major == 9 || major == 10;
}

// the fused kernel's work split for this call on ``device``
GemmPlan make_plan(int64_t m, int64_t npad, int64_t k, bool bf16, int kind, int device, int* blocks_per_sm) {
  const int mt = mt_override(), wide = wide_kernel();
  const int setting = wgmma_setting();
  bool wgmma = setting > 0;
  if (setting < 0 && !mt && wide < 0 && w4a16_wgmma_rule((int)m, (int)npad, (int)k)) {
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    C10_CUDA_CHECK(cudaStreamIsCapturing(c10::cuda::getCurrentCUDAStream(), &capture));
    wgmma = w4a16_wgmma_available(capture == cudaStreamCaptureStatusNone);
  }
  const int sms = device_attribute<cudaDevAttrMultiProcessorCount>(device);
  GemmPlan p = w4a16_gemm_plan((int)m, (int)npad, (int)k, bf16, kind, sms, mt, wide, blocks_per_sm, splits_override(),
                               wgmma, wgmma ? wgmma_rows_override() : 0);
  p.overlap = overlap_setting(device);
  return p;
}

void check_layout(const at::Tensor& qpack, const at::Tensor& scales, const std::optional<at::Tensor>& zeros,
                  int64_t n, int64_t k, int64_t group_size, int kind, at::ScalarType act) {
  TORCH_CHECK(n > 0 && k > 0 && k % 16 == 0, "hf_w4 cuda_w4a16: K=", k, " must be a positive multiple of 16");
  const int64_t npad = (n + 63) / 64 * 64;
  TORCH_CHECK(qpack.is_cuda() && qpack.scalar_type() == at::kInt && qpack.is_contiguous() &&
                  qpack.numel() == k * npad / 8,
              "hf_w4 cuda_w4a16: qpack must be a contiguous int32 CUDA tensor of ", k * npad / 8, " elements (Npad/64 x K/16 "
              "x 32 x 4), got ", qpack.scalar_type(), " ", qpack.sizes());
  TORCH_CHECK(act == at::kHalf || act == at::kBFloat16, "hf_w4 cuda_w4a16: activations must be float16 or bfloat16, got ",
              act);
  if (kind == kNvfp4) {
    TORCH_CHECK(scales.scalar_type() == at::kByte && scales.is_contiguous() && scales.numel() == k / 16 * npad,
                "hf_w4 cuda_w4a16: nvfp4 scales must be contiguous uint8 of ", k / 16 * npad, " elements, got ",
                scales.scalar_type(), " ", scales.sizes());
  } else {
    TORCH_CHECK(group_size > 0 && group_size % 16 == 0 && k % group_size == 0, "hf_w4 cuda_w4a16: group_size=",
                group_size, " must be a multiple of 16 dividing K=", k);
    const int64_t g = k / group_size;
    TORCH_CHECK(scales.scalar_type() == act && scales.is_contiguous() && scales.numel() == g * npad,
                "hf_w4 cuda_w4a16: int4 scales must be contiguous ", act, " of ", g * npad, " elements, got ",
                scales.scalar_type(), " ", scales.sizes());
    if (kind == kInt4Asym)
      TORCH_CHECK(zeros->scalar_type() == at::kByte && zeros->is_contiguous() && zeros->numel() == g * npad,
                  "hf_w4 cuda_w4a16: zeros must be contiguous uint8 of ", g * npad, " elements, got ",
                  zeros->scalar_type(), " ", zeros->sizes());
  }
  TORCH_CHECK(scales.device() == qpack.device() && (!zeros.has_value() || zeros->device() == qpack.device()),
              "hf_w4 cuda_w4a16: qpack, scales and zeros must be on one device");
  // the kernels copy 16-byte pieces of each
  const auto aligned = [](const at::Tensor& t) { return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0; };
  TORCH_CHECK(aligned(qpack) && aligned(scales) && (kind != kInt4Asym || aligned(*zeros)),
              "hf_w4 cuda_w4a16: qpack, scales and zeros must start on 16-byte boundaries");
}

at::Tensor gemm(const at::Tensor& x_in, const at::Tensor& qpack, const at::Tensor& scales,
                const std::optional<at::Tensor>& zeros, const std::optional<at::Tensor>& bias, int64_t n,
                int64_t group_size, c10::string_view weight_type, double global_scale) {
  const int kind = weight_kind(weight_type, zeros);
  TORCH_CHECK(x_in.dim() == 2, "hf_w4 cuda_w4a16_gemm: x must be 2-D [M, K], got ", x_in.sizes());
  const int64_t m = x_in.size(0), k = x_in.size(1);
  check_layout(qpack, scales, zeros, n, k, group_size, kind, x_in.scalar_type());
  TORCH_CHECK(x_in.device() == qpack.device(), "hf_w4 cuda_w4a16_gemm: x is on ", x_in.device(),
              ", the weights on ", qpack.device());
  const c10::cuda::CUDAGuard guard(x_in.device());
  at::Tensor x = x_in.contiguous();
  if (reinterpret_cast<uintptr_t>(x.data_ptr()) % 16) x = x.clone();  // the kernel copies 16-byte pieces of rows
  std::optional<at::Tensor> b;
  if (bias.has_value()) {
    TORCH_CHECK(bias->numel() == n, "hf_w4 cuda_w4a16_gemm: bias has ", bias->numel(), " elements, expected N=", n);
    b = bias->to(x.scalar_type()).contiguous();
  }
  at::Tensor y = at::empty({m, n}, x.options());
  if (m == 0) return y;
  const int64_t npad = (n + 63) / 64 * 64;
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  const GemmPlan plan = make_plan(m, npad, k, bf16, kind, x.get_device(), nullptr);
  at::Tensor ws, counters;
  if (plan.splits > 1) {
    ws = at::empty({(int64_t)plan.ws_floats}, x.options().dtype(at::kFloat));
    counters = split_counters(plan.counters, x);
  }
  GemmArgs a{};
  a.x = x.data_ptr();
  a.qpack = qpack.data_ptr<int32_t>();
  a.scales = scales.data_ptr();
  a.zeros = kind == kInt4Asym ? zeros->data_ptr<uint8_t>() : nullptr;
  a.bias = b.has_value() ? b->data_ptr() : nullptr;
  a.y = y.data_ptr();
  a.workspace = plan.splits > 1 ? ws.data_ptr<float>() : nullptr;
  a.counters = plan.splits > 1 ? counters.data_ptr<int>() : nullptr;
  a.m = (int)m;
  a.n = (int)n;
  a.npad = (int)npad;
  a.k = (int)k;
  a.group_size = kind == kNvfp4 ? 16 : (int)group_size;
  a.group_shift = group_shift_of(a.group_size);
  a.global_scale = (float)global_scale;
  a.kind = kind;
  a.bf16 = bf16;
  C10_CUDA_CHECK(w4a16_gemm(a, plan, c10::cuda::getCurrentCUDAStream()));
  return y;
}

at::Tensor dequant(const at::Tensor& qpack, const at::Tensor& scales, const std::optional<at::Tensor>& zeros,
                   int64_t n, int64_t k, int64_t group_size, c10::string_view weight_type, double global_scale,
                   at::ScalarType dtype) {
  const int kind = weight_kind(weight_type, zeros);
  check_layout(qpack, scales, zeros, n, k, group_size, kind, kind == kNvfp4 ? dtype : scales.scalar_type());
  TORCH_CHECK(dtype == at::kHalf || dtype == at::kBFloat16, "hf_w4 cuda_w4a16_dequant: dtype must be float16 or "
              "bfloat16, got ", dtype);
  TORCH_CHECK(kind == kNvfp4 || scales.scalar_type() == dtype, "hf_w4 cuda_w4a16_dequant: int4 scales are ",
              scales.scalar_type(), ", the requested dtype is ", dtype);
  const c10::cuda::CUDAGuard guard(qpack.device());
  at::Tensor w = at::empty({n, k}, qpack.options().dtype(dtype));
  C10_CUDA_CHECK(w4a16_dequant(qpack.data_ptr<int32_t>(), scales.data_ptr(),
                               kind == kInt4Asym ? zeros->data_ptr<uint8_t>() : nullptr, w.data_ptr(), (int)n,
                               (int)((n + 63) / 64 * 64), (int)k, kind == kNvfp4 ? 16 : (int)group_size,
                               (float)global_scale, kind, dtype == at::kBFloat16,
                               c10::cuda::getCurrentCUDAStream()));
  return w;
}

std::vector<int64_t> plan(int64_t m, int64_t n, int64_t k, c10::string_view weight_type_sv, bool asym, bool bf16) {
  const std::string weight_type(weight_type_sv);
  TORCH_CHECK(weight_type == "int4" || weight_type == "nvfp4", "hf_w4 cuda_w4a16_plan: weight_type '", weight_type,
              "' is not supported; supported: int4, nvfp4");
  TORCH_CHECK(m > 0 && n > 0 && k > 0 && k % 16 == 0, "hf_w4 cuda_w4a16_plan: M=", m, ", N=", n, ", K=", k,
              ": expected positive sizes and K a multiple of 16");
  const int kind = weight_type == "nvfp4" ? kNvfp4 : (asym ? kInt4Asym : kInt4Sym);
  int bps = 0;
  const GemmPlan p = make_plan(m, (n + 63) / 64 * 64, k, bf16, kind, c10::cuda::current_device(), &bps);
  return {p.mt, p.mblocks, p.ntiles, p.splits, p.steps_per_split, bps, p.wide ? 1 : 0, p.wgmma, p.overlap ? 1 : 0};
}

}  // namespace
}  // namespace cuda
}  // namespace hf_w4

TORCH_LIBRARY_IMPL(hf_w4, CUDA, m) {
  m.impl("cuda_w4a16_gemm", &hf_w4::cuda::gemm);
  m.impl("cuda_w4a16_dequant", &hf_w4::cuda::dequant);
}

TORCH_LIBRARY_IMPL(hf_w4, CatchAll, m) {
  m.impl("cuda_w4a16_plan", &hf_w4::cuda::plan);
}
