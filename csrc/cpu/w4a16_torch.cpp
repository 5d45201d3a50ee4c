// hf_w4 W4A16: torch glue (schemas live in hf_w4/ops.py). Minimal torch headers; all SIMD code is in
// w4a16_avx512.cpp / w4a16_avx2.cpp behind raw pointers, chosen at run time (csrc/cpu/isa.h).
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/zeros.h>
#include <ATen/ops/linear.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <string>
#include <tuple>
#include <vector>

#include "aligned_buf.h"
#include "isa.h"
#include "torch_checks.h"
#include "w4a16.h"
#include "w4a16_common.h"

namespace hf_w4 {
namespace {

int mode_of(const std::string& wt, bool has_zs) {
  if (wt == "nvfp4") return W4_NVFP4;
  TORCH_CHECK(wt == "int4", "cpu_w4a16: weight_type must be 'int4' or 'nvfp4', got '", wt, "'");
  return has_zs ? W4_ASYM : W4_SYM;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> repack(
    const at::Tensor& codes, c10::string_view pack_dim, at::IntArrayRef slots, const at::Tensor& scales,
    const std::optional<at::Tensor>& zeros, const std::optional<at::Tensor>& perm, int64_t n, int64_t k,
    int64_t group_size, c10::string_view weight_type) {
  const std::string wt(weight_type), pd(pack_dim);
  const bool nvfp4 = wt == "nvfp4";
  const int mode = mode_of(wt, zeros.has_value());
  const int64_t gs = nvfp4 ? 16 : group_size;
  TORCH_CHECK(codes.device().is_cpu() && codes.scalar_type() == at::kInt, "cpu_w4a16_repack: codes must be int32 on CPU");
  TORCH_CHECK(codes.dim() == 2, "cpu_w4a16_repack: codes must be 2-D");
  TORCH_CHECK(k > 0 && k % 2 == 0 && gs > 0 && gs % 2 == 0 && k % gs == 0,
              "cpu_w4a16_repack: need K > 0 even and an even group size dividing K (channel-wise: group_size = K, "
              "not -1; nvfp4: 16), got K=", k, ", group_size=", gs);
  TORCH_CHECK(slots.size() == 8, "cpu_w4a16_repack: slots must have 8 entries");
  TORCH_CHECK(pd == "k" || pd == "n", "cpu_w4a16_repack: pack_dim must be 'k' or 'n'");
  if (pd == "k") {
    TORCH_CHECK(k % 8 == 0 && codes.size(0) == n && codes.size(1) == k / 8,
                "cpu_w4a16_repack: pack_dim 'k' expects codes [N, K/8] = [", n, ", ", k / 8, "], got ", codes.sizes());
  } else {
    TORCH_CHECK(n % 8 == 0 && codes.size(0) == n / 8 && codes.size(1) == k,
                "cpu_w4a16_repack: pack_dim 'n' expects codes [N/8, K] = [", n / 8, ", ", k, "], got ", codes.sizes());
  }
  const int64_t G = k / gs, P = (n + W4_NP - 1) / W4_NP;
  W4Repack r{};
  r.N = n; r.K = k; r.G = G; r.gs = gs; r.P = P; r.mode = mode;
  r.codes = codes.data_ptr<int32_t>(); r.cs0 = codes.stride(0); r.cs1 = codes.stride(1);
  r.pack_k = pd == "k";
  for (int j = 0; j < 8; ++j) {
    TORCH_CHECK(slots[j] >= 0 && slots[j] < 8, "cpu_w4a16_repack: slots must be in 0..7, got slots[", j, "] = ",
                slots[j]);
    r.slots[j] = static_cast<int>(slots[j]);
  }
  at::Tensor sc, zc, pm;
  if (nvfp4) {
    TORCH_CHECK(scales.scalar_type() == at::kByte && scales.dim() == 2 && scales.size(0) == n && scales.size(1) == G,
                "cpu_w4a16_repack: nvfp4 scales must be uint8 (fp8 e4m3 bits) [N, K/16] = [", n, ", ", G, "], got ",
                scales.scalar_type(), " ", scales.sizes());
    sc = scales.contiguous();
    r.scales8 = sc.data_ptr<uint8_t>();
    // e4m3 has no inf; 0x7f / 0xff are NaN, which the AVX2 / AVX-512 decodes would read as +-480 (a finite scale)
    for (int64_t i = 0; i < n * G; ++i)
      TORCH_CHECK((r.scales8[i] & 0x7f) != 0x7f, "cpu_w4a16_repack: nvfp4 scale [", i / G, ", ", i % G,
                  "] is the fp8 e4m3 NaN byte 0x", (r.scales8[i] == 0xff ? "ff" : "7f"),
                  "; block scales must be finite");
  } else {
    TORCH_CHECK(scales.dim() == 2 && scales.size(0) == n && scales.size(1) == G,
                "cpu_w4a16_repack: scales must be [N, G] = [", n, ", ", G, "], got ", scales.sizes());
    sc = scales.to(at::kFloat).contiguous();
    r.scales = sc.data_ptr<float>();
    if (zeros) {
      TORCH_CHECK(zeros->dim() == 2 && zeros->size(0) == n && zeros->size(1) == G,
                  "cpu_w4a16_repack: zeros must be [N, G] = [", n, ", ", G, "], got ", zeros->sizes());
      zc = zeros->to(at::kFloat).contiguous();
      r.zeros = zc.data_ptr<float>();
    }
  }
  if (perm) {
    pm = checked_perm(*perm, k, "cpu_w4a16_repack");
    r.perm = pm.data_ptr<int64_t>();
  }
  auto qpack = at::empty({P, k / 2, W4_NP}, codes.options().dtype(at::kByte));
  auto oscales = at::empty({P, G, W4_NP}, codes.options().dtype(nvfp4 ? at::kByte : at::kFloat));
  auto ozs = at::empty({mode == W4_ASYM ? P : 0, G, W4_NP}, codes.options().dtype(at::kFloat));
  r.qpack = qpack.data_ptr<uint8_t>();
  r.out_scales = oscales.data_ptr();
  r.out_zs = mode == W4_ASYM ? ozs.data_ptr<float>() : nullptr;
  // AWQ codes: AVX2 byte shuffles for the full panels (the portable bit-spreading loop is ~5x slower)
  const CpuIsa isa = choose_isa("");
  const int64_t full = n / W4_NP;
  const bool awq_simd = !r.pack_k && !r.perm && isa != CpuIsa::generic && w4a16_is_awq_slots(r.slots);
  r.pack_n_from = awq_simd ? full : 0;
  at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
    if (awq_simd && p0 < full) w4a16_repack_awq_codes_avx2(r, p0, std::min(p1, full));
    w4a16_repack_panels(r, p0, p1);
    if (nvfp4) w4a16_nvfp4_positive_scales(r, p0, p1);
  });
  return {qpack, oscales, ozs};
}

int dt_code(at::ScalarType t) {
  return t == at::kFloat ? DT_F32 : t == at::kBFloat16 ? DT_BF16 : DT_F16;
}

// Largest M that takes the fused path (above it: dequantize N-chunks and at::linear).
// Measured on the project machine (the AVX-512 Xeon VM, 1 thread CPU time, K=N=4096, bf16 x, g128; box heavily
// loaded):
//   M      8     16     32     64    256
//   fused  3.9   6.4   12.8   27.3  110.5 ms
//   deq+lin 15.6 10.5  14.4   11.4   31.4 ms   (bf16 dense F.linear: 4.1 4.1 5.1 7.4 29.3 ms)
// -> crossover between M=32 and M=64 on AVX-512. AVX2 (measured with the ISA capped on the same VM, bf16 x, 2
// threads, cold, ms): fused 9.8 / 32.1 vs dequantize (AVX2) + at::linear 9.4 / 10.7 at M = 16 / 64 -> 16. The
// portable value is an estimate.
int64_t fused_max_m(CpuIsa isa, at::ScalarType) {
  if (isa == CpuIsa::avx512) return 32;
  if (isa == CpuIsa::avx2) return 16;
  return 4;
}

// Dequantized chunk size: HF_W4_W4A16_CHUNK_MB, else 2 MiB per thread, so that each thread's slice of the
// chunk is still in its L2 when at::linear reads it. Measured on the 2-vCPU AVX-512/AMX Xeon VM (2 MiB L2 per
// core), K=N=4096, bf16 x, 1 thread: dequant+linear M=64 27.4 ms with 32 MiB chunks vs 11.1 ms with 4 MiB
// (dense bf16 9.6 ms); the dequantize alone: 16.3 ms (32 MiB) vs 2.0 ms (1 MiB).
int64_t large_chunk_bytes() {
  static const double mb = [] {
    const char* e = std::getenv("HF_W4_W4A16_CHUNK_MB");
    return e && *e ? std::atof(e) : 0.0;
  }();
  if (mb > 0) return static_cast<int64_t>(mb * (1 << 20));
  return static_cast<int64_t>(2) * (1 << 20) * std::max(1, at::get_num_threads());
}

bool amx_enabled() {
  static const bool v = !env_switched_off("HF_W4_AMX");
  return v;
}
// Smallest M for which bf16 x takes the AMX path in the automatic choice. Measured on the 2-vCPU AMX Xeon VM
// (K=N=4096, g128, bf16 x, 2 threads, cold weights, min / median of 40 calls, ms):
//   M                      1          2          4          8          16         32
//   int4 fused fp32-FMA    0.70/0.78  0.75/0.86  1.05/1.10  1.94/2.08  3.60/3.72  7.3/7.5
//   int4 AMX raw codes     0.66/0.74  0.70/0.79  0.70/0.78  0.79/0.86  0.79/0.97  1.8/1.9
//   nvfp4 fused fp32-FMA   0.72/0.78  0.79/0.87  1.24/1.30  2.38/2.57  3.63/4.32  7.3/8.5
//   nvfp4 AMX raw codes    1.30/1.33  1.32/1.40  1.34/1.44  1.36/1.49  1.62/1.94  2.6/3.5
//   (torch int4pack        0.73/0.82  1.04/1.10  1.42/1.49  2.77/2.91  4.80/5.38  9.4/10.7)
// NVFP4 for M <= 8 then got a stacked kernel (two 16-k blocks per tile product: rows 0..7 of the A tile the
// first 16 k, rows 8..15 the second); same method, session 3 (min / median, ms):
//   M                      1          2          3          4
//   nvfp4 fused fp32-FMA   0.60/0.71  0.71/0.81  0.87/0.99  1.09/1.27
//   nvfp4 AMX stacked      0.89/1.08  0.87/1.03  0.94/1.11  0.89/1.08   (M=8: 1.15/1.25; raw 8-row tiles 1.36/1.49)
// With AVX512-FP16 as well (every AMX CPU so far), NVFP4 with M <= 32 takes the fp16 decode instead
// (w4a16_amx_nvfp4_fp16), which was faster than the stacked kernel from M = 4 (one process, 2 threads, cold, ms;
// stacked / fp16 decode): 4096x4096 M=5 0.577-0.606 / 0.577-0.598, M=8 0.641-0.677 / 0.573-0.589; 2048x2048 M=5
// 0.156-0.163 / 0.141-0.144, M=8 0.172-0.178 / 0.141-0.146; the stacked kernel was then removed (without FP16 -
// compilers before GCC 12, or HF_W4_AMX_FP16=0 - NVFP4 up to M = 32 takes amx_small_folded, the fp32 decode).
// NVFP4 with M > 8 takes the scale-folding AMX kernels (amx_small_folded up to M = 32, then amx_impl) rather
// than 16-k steps of raw codes with 8-row B tiles: M=16 1.66-1.75 (amx_impl) vs 1.88-1.96 ms, M=32 2.53-2.76 vs
// 3.3 ms; amx_small_folded is faster still (w4a16_amx.cpp).
// With the weight stream prefetched 8 KiB ahead (kW4PrefetchBytes), int4 M=1 is faster on the fused kernel
// (medians of 6 interleaved rounds, ms; fused / AMX raw / torch int4pack / read floor):
//   4096x11008  1.486 / 1.649 / 1.927 / 1.274     11008x4096  1.413 / 1.526 / 1.782 / 1.207
//   4096x4096   0.526 / 0.547 / 0.680 / 0.457     (M=2, 4096x11008: 1.764 / 1.638; M=3: 2.001 / 1.690)
// -> int4 with groups of a multiple of 32: AMX from M = 2; NVFP4: from M = 4; the rest (int4 with other groups:
// scales folded into the decode) from M = 6.
int64_t amx_min_m(const W4Gemm& g) {
  if (g.mode == W4_NVFP4) return 4;
  return w4a16_amx_raw_ok(g, 1) ? 2 : 6;
}

// Activation block of the int16 path (w4a16_fused_i16_avx512): the largest divisor of the group size that is a multiple
// of 4 and at most 4096; 0 if there is none >= 16 (then the path is not used). NVFP4: 16, or with the block scales
// folded in (AVX-512 VBMI, M > 8: w4a16_i16_nvfp4_folded) the largest of 128, 64, 32 that divides K. (Tried: an NVFP4
// int16 kernel with 64-k activation blocks - the activation scale applied once per 64 k, per 16-k block only the block
// scale - was ~3% faster at M = 4 in one process, but 5-10% slower at M = 1, memory bound, with 16- or 64-k blocks
// alike: 2 threads, cold, builds alternated 3 times, ms, this kernel / that one: 4096x4096 0.377-0.402 / 0.411-0.417,
// 11008x4096 0.999-1.055 / 1.094-1.135. Re-tried for M >= 2 only, M = 1 keeping this kernel, with the block scale's
// factor 2^7 moved into the activation scale: 1 thread, hot, 2048x2048 M=4 162.8 / 161.0 vs 161.4 / 161.6 us; cold, 2
// threads, 3 alternations, no difference at M = 2 or 4 on 2048^2, 4096^2, 11008x4096. M = 4 runs 16 vpdpwssd +
// ByteLutDecode's 9 uops per 2 k-pairs in about 16 cycles - the vector ports, not the epilogue, bound it.)
int64_t i16_block(CpuIsa isa, const W4Gemm& g, int64_t M) {
  if (g.mode == W4_NVFP4) {
    if (isa == CpuIsa::avx2) return g.K % 128 == 0 ? 128 : g.K % 64 == 0 ? 64 : g.K % 32 == 0 ? 32 : 16;
    if (isa != CpuIsa::avx512 || !w4a16_i16_nvfp4_folded(M)) return 16;
    return g.K % 128 == 0 ? 128 : g.K % 64 == 0 ? 64 : g.K % 32 == 0 ? 32 : 16;  // 16: nothing to fold
  }
  for (int64_t d = std::min<int64_t>(g.gs, 4096); d >= 16; --d)
    if (g.gs % d == 0 && d % 4 == 0) return d;
  return 0;
}
// Largest M that takes the int16 path in the automatic choice (bf16 activations only: fp32 x keeps the exact fp32
// kernel, fp16 x - 11 significant bits - would lose bits below 2^-4 of a block's max). Measured on the 2-vCPU AMX
// Xeon VM (2 threads, cold weights, g128, medians of 7 interleaved rounds, ms; int16 / fused fp32 / AMX):
//   int4  4096x4096    M=1 0.525 / 0.586 / 0.663   M=2 0.531 / 0.692 / 0.652   M=4 0.616 / 0.968 / 0.711
//                      M=6 1.035 / - / 0.804       M=8 1.195 / - / 0.872       M=16 2.306 / - / 1.003
//   int4  11008x4096   M=1 1.335 / 1.468 / 1.566   M=2 1.323 / 1.673 / 1.630   M=4 1.597 / 2.510 / 1.807
//   nvfp4 4096x4096    M=1 0.648 / 0.743 / 0.988   M=4 0.887 / 1.137 / 0.992   M=8 1.867 / 2.586 / 1.241
//   (read floor 0.51 / 1.35 ms; torch int4pack M=1 0.765 / 1.903 ms)
// -> up to M = 4 where AMX takes over; without AMX it replaces the fused fp32 kernel (~1.4x faster at M = 8-16).
// AVX2 (same machine, isa capped; int16 / fused fp32 / dequantize + at::linear, ms): M=1 0.705 / 1.540 / -,
// M=4 1.786 / 2.285 / -, M=16 8.36 / 9.84 / 9.39, M=64 26.7 / 32.1 / 10.7 -> up to M = 16.
// NVFP4 with the fp16 decode on AMX (w4a16_amx_nvfp4_fp16) measured the same way (one process, ms; int16 / AMX):
// 4096x4096 M=4 0.483 / 0.518, M=5 0.716 / 0.522; 2048x2048 M=4 0.130 / 0.139, M=5 0.189 / 0.140; 11008x4096 M=4
// 1.325 / 1.415, M=5 1.953 / 1.442 -> the same crossover.
// With the AMX small-M kernels double-buffered and prefetching (w4a16_amx.cpp), int4 on the raw-code AMX kernel
// became faster at M = 4 (one process, 2 threads, cold, medians of 4 interleaved rounds, ms; int16 / AMX):
//   4096x4096 0.435 / 0.392   2048x2048 0.113 / 0.104   8192x4096 0.816 / 0.796   11008x4096 1.081 / 1.037
//   4096x11008 1.079 / 1.020  2048x8192 0.408 / 0.384   (M = 3, an earlier run: 11008x4096 0.943 / 1.119,
//   4096x11008 0.935 / 1.045, 4096x4096 0.398 / 0.382) -> int4 groups of a multiple of 32: int16 up to M = 3.
// Re-measured with the two paths interleaved in one process (2 threads, cold, medians of 5-7 rounds, ms; int16 /
// AMX), the crossover moves with the group size - the raw-code AMX kernel flushes its C tiles once per group:
//   g128 sym  M=2: 4096x4096 0.340-0.351 / 0.356-0.359, 11008x4096 0.922-0.938 / 0.966-0.971, 2048x2048 0.095 /
//             0.098, 4096x11008 0.930 / 0.951; M=3: 4096x4096 0.378-0.382 / 0.363, 11008x4096 0.999-1.036 /
//             0.966-0.989, 2048x2048 0.103 / 0.100, 4096x11008 1.009 / 0.951
//   g128 asym M=3: 4096x4096 0.388-0.390 / 0.381-0.383, 11008x4096 1.025 / 0.991; channel-wise (4096x4096) M=2
//             0.340 / 0.363, M=3 0.376 / 0.367
//   g64       M=3: 4096x4096 0.390 / 0.386, 11008x4096 0.981 / 1.009; M=4: 0.410 / 0.392, 1.033 / 1.043
//   g32       M=4: 4096x4096 0.434 / 0.442, 11008x4096 1.162 / 1.213; M=5: 0.550 / 0.474, 1.485 / 1.253
// -> int16 up to M = 2 for groups of 128 and more, 3 for 64, 4 for 32 (from M = 5 it makes two passes).
int64_t i16_max_m(CpuIsa isa, bool amx, const W4Gemm& g) {
  if (isa == CpuIsa::avx2) return 16;
  if (!amx) return 32;
  if (!w4a16_amx_raw_ok(g, 4)) return 4;
  return g.gs >= 128 ? 2 : g.gs >= 64 ? 3 : 4;
}

// fp32 sums of the activations over each group, [M][G] (asymmetric zero points act through them); at(i) reads
// element i of the row-major [M][K] activations as fp32. 16 independent partial sums (vectorized by the compiler):
// one running sum was latency bound, ~0.2 ms per call at M = 32, K = 4096.
template <typename At>
std::vector<float> group_sums(int64_t M, int64_t K, int64_t gs, At at) {
  const int64_t G = K / gs;
  std::vector<float> xsum(static_cast<size_t>(M) * G, 0.0f);
  for (int64_t r = 0; r < M; ++r)
    for (int64_t gi = 0; gi < G; ++gi) {
      float part[16] = {};
      const int64_t k0 = r * K + gi * gs, k1 = k0 + gs;
      int64_t kk = k0;
      for (; kk + 16 <= k1; kk += 16)
        for (int j = 0; j < 16; ++j) part[j] += at(kk + j);
      float s = 0.f;
      for (int j = 0; j < 16; ++j) s += part[j];
      for (; kk < k1; ++kk) s += at(kk);
      xsum[r * G + gi] = s;
    }
  return xsum;
}

// x [M][K] (contiguous, fp32 / bf16 / fp16) -> int16 blocks of ag (see w4a16.h); false on inf / nan. Rows in
// parallel from 16 Ki elements per thread. AVX2 host (Zen 3), 2 threads, K=4096 bf16, us per call, the portable
// quantizer single-threaded / the AVX2 one / that in parallel: M=4 23 / 10 / 10, M=16 78 / 45 / 27, M=64 445 / 140 /
// 80, M=256 1224 / 552 / 318 (the kernel after it: ~3.6 ms at M=16, ~55 ms at M=256 on 4096x4096).
constexpr int64_t kQuantGrain = 16384;
bool quant_x16(const at::Tensor& x, CpuIsa isa, int64_t ag, int64_t l1max, int16_t* xq, float* xs, int32_t* xd) {
  const int64_t M = x.size(0), K = x.size(1), nab = K / ag, es = x.element_size();
  const int dt = dt_code(x.scalar_type());
  const char* xb = static_cast<const char*>(x.data_ptr());
  std::atomic<bool> finite{true};
  at::parallel_for(0, M, std::max<int64_t>(1, kQuantGrain / K), [&](int64_t m0, int64_t m1) {
    const void* xr = xb + m0 * K * es;
    int16_t* q = xq + m0 * K;
    float* s = xs + m0 * nab;
    int32_t* d = xd + m0 * nab;
    const bool ok = isa == CpuIsa::avx512 ? w4a16_quant_x16_avx512(xr, dt, m1 - m0, K, ag, l1max, q, s, d)
                    : isa == CpuIsa::avx2 && ag % 16 == 0 ? w4a16_quant_x16_avx2(xr, dt, m1 - m0, K, ag, l1max, q, s, d)
                    : w4a16_quant_x16_generic(xr, dt, m1 - m0, K, ag, l1max, q, s, d);
    if (!ok) finite = false;
  });
  return finite;
}

// the quantizer alone (tests): (xq int16 [M][K], xs fp32 [M][K/block], xd int32 [M][K/block]); an error on inf / nan
std::tuple<at::Tensor, at::Tensor, at::Tensor> quant_x16_op(const at::Tensor& x_in, int64_t block, int64_t l1max,
                                                             c10::string_view isa_req) {
  TORCH_CHECK(x_in.dim() == 2, "cpu_w4a16_quant_x16: x must be 2-D [M, K]");
  const auto dt = x_in.scalar_type();
  TORCH_CHECK(dt == at::kFloat || dt == at::kBFloat16 || dt == at::kHalf,
              "cpu_w4a16_quant_x16: x must be float32, bfloat16 or float16");
  const int64_t M = x_in.size(0), K = x_in.size(1);
  TORCH_CHECK(K > 0, "cpu_w4a16_quant_x16: x has K=0 columns; K must be positive");
  TORCH_CHECK(block >= 4 && block <= 4096 && block % 4 == 0 && K % block == 0,
              "cpu_w4a16_quant_x16: block must be a multiple of 4 up to 4096 that divides K, got ", block);
  // each element rounds by up to 1/2: a bound <= block / 2 is never met (the scale search would not end), and one
  // just above it can push the scale past the fp32 range; from 2 * block the scale stays below 2^127
  TORCH_CHECK(l1max == 0 || l1max >= 2 * block,
              "cpu_w4a16_quant_x16: l1max must be 0 (no bound) or at least 2 * block = ", 2 * block, ", got ", l1max);
  const at::Tensor x = x_in.contiguous();
  at::Tensor xq = at::empty({M, K}, x.options().dtype(at::kShort));
  at::Tensor xs = at::empty({M, K / block}, x.options().dtype(at::kFloat));
  at::Tensor xd = at::empty({M, K / block}, x.options().dtype(at::kInt));
  const std::string ir(isa_req);
  TORCH_CHECK(quant_x16(x, checked_isa(ir.c_str(), "cpu_w4a16_quant_x16"), block, l1max, xq.data_ptr<int16_t>(), xs.data_ptr<float>(),
                        xd.data_ptr<int32_t>()),
              "cpu_w4a16_quant_x16: x holds inf / nan, a block's sum of |x| overflows, or a nonzero block max is below "
              "2^-100 (the gemm takes the fp32 path there)");
  return {xq, xs, xd};
}

// x[:, perm] for contiguous 2-D x (act-order): a plain gather. index_select took ~27 us for one row of 4096 bf16
// (Zen 3), ~7 % of a 4096x4096 layer's one-row time; this loop ~1 us.
at::Tensor permute_columns(const at::Tensor& x, const at::Tensor& perm) {
  const int64_t M = x.size(0), K = x.size(1);
  at::Tensor out = at::empty(x.sizes(), x.options());
  const int64_t* pp = perm.data_ptr<int64_t>();
  auto gather = [&](auto tag) {
    using T = decltype(tag);
    const T* src = static_cast<const T*>(x.data_ptr());
    T* dst = static_cast<T*>(out.data_ptr());
    at::parallel_for(0, M, std::max<int64_t>(1, 65536 / std::max<int64_t>(K, 1)), [&](int64_t m0, int64_t m1) {
      for (int64_t m = m0; m < m1; ++m)
        for (int64_t k = 0; k < K; ++k) dst[m * K + k] = src[m * K + pp[k]];
    });
  };
  if (x.element_size() == 4) gather(uint32_t{});
  else gather(uint16_t{});
  return out;
}

at::Tensor gemm(const at::Tensor& x_in, const at::Tensor& qpack, const at::Tensor& scales, const at::Tensor& zs,
                const std::optional<at::Tensor>& perm, const std::optional<at::Tensor>& bias, int64_t n,
                int64_t group_size, c10::string_view weight_type, double global_scale, c10::string_view isa_req,
                int64_t path);

// bf16 activations above the small-M kernels' range where AMX does not take them (CPUs without AMX, K % 32 != 0,
// HF_W4_AMX=0): three candidates, and which is fastest depends on the CPU, on torch's GEMM library, on the weight
// type and on M - so it is timed. Path 3 = int16 activations x raw codes (the small-M kernel at any M), 1 =
// dequantize to bf16 + bf16 GEMM (at::linear), 4 = dequantize to fp32 + fp32 GEMM (x widened exactly, y rounded to
// bf16 once). Measured on the AVX-512 Xeon VM, 2 threads, cold, 4096x4096, ms (path 3 / 1 / 4 / dense bf16):
//   oneDNN capped to AVX512_CORE_BF16 (no AMX, as on AMD Zen 4/5):  M=64 4.25 / 13.2 / 11.0 / 10.8,
//     M=256 16.6 / 41.0 / 29.0 / 38.3 (vdpbf16ps runs 1.86 G/s per core there, vfmadd231ps 7.47 G/s; dense bf16
//     is at 92 % of that bf16 peak); NVFP4 (3 / 4) M=64 5.57 / 10.9, M=1024 89.7 / 100.2
//   oneDNN capped to AVX2 (our ISA capped too): M=32 5.0 / 3630 / 8.0 / 26.6, M=64 10.0 / 6878 / 11.4 / 53.1,
//     M=256 40.1 / 28524 / 29.7 / 222 (the bf16 GEMM on a transposed weight view without bf16 hardware: seconds);
//     paths 3 / 4, int4 M=48 7.51 / 9.35, M=96 14.9 / 13.9; NVFP4 M=24 5.81 / 7.13, M=32 7.66 / 7.88, M=48 11.4 /
//     9.10: the int16 kernel's cost grows with M, the dequantize's does not, and NVFP4's int16 kernel (a block
//     scale per 16 k) costs 1.4-1.5x int4's while the dequantize paths cost the same for both.
// On AMD Zen 5 the bf16 GEMM reaches 654-692 GFLOP/s and MKL's fp32 160 (../shared/docs/perf-anchors.md), and with
// AMX the bf16 GEMM wins by far. So at the first such call, per ISA and weight type (int4 g128 / NVFP4), each
// candidate runs a kLargeK x kLargeK problem at M = kLargeM0 and kLargeM1 (deterministic data; per M a warm-up
// run, a timed run, then 3 more interleaved runs and the minimum; a candidate over 50x the fastest is dropped),
// which gives a straight line a + b * M per candidate, and each call takes the candidate whose line is lowest at its
// M. (The single timing at M = 128 this replaces chose fp32 for every M on AVX2, which took up to 1.24x as long
// as int16 below M ~ 80 for int4.) Predicted crossovers (separate processes) against the 4096x4096 measurements
// above, by timing problem size: AVX2 int4 int16 -> fp32 at M = 44 (512^2) / 81-101 (1024^2, 5 runs) / 64-79
// (2048^2, 5 runs), measured ~80; NVFP4 23 / 24-54 / 31-42, measured ~34 (a tie from 24 to 36); AVX-512 without
// AMX, NVFP4: fp32 from M = 537 (512^2) / int16 at every M or up to M = 3435 (2048^2), measured int16 (M=1024 89.7
// vs 100.2 ms). 2048^2 costs 0.15-0.3 s per process (both weight types; 1024^2 ~0.1 s).
// The bf16 GEMM is a candidate only on CPUs with bf16 arithmetic (AVX512-BF16; AMX), path 3 only with AVX-512 or
// AVX2, and not for a group size without an int16 block. HF_W4_LARGE_PATH=int16|bf16|fp32 sets the choice;
// cpu_w4a16_info reports it.
constexpr int64_t kLargeM0 = 64, kLargeM1 = 256, kLargeK = 2048;

struct LargeChoice {
  int fixed = 0;                 // HF_W4_LARGE_PATH (or the only candidate): that path at every M
  bool from_env = false;
  std::vector<int> timed, cand;  // candidates timed (paths 3, 1, 4), and those not dropped
  double t[2][5] = {};           // seconds per path at kLargeM0, kLargeM1 (0 = not timed)
  double a[5] = {}, b[5] = {};   // per path: predicted seconds a + b * M (a, b >= 0)
  // path for a call with M rows (i16: the group size has an int16 block)
  int choose(int64_t M, bool i16) const {
    if (fixed) return fixed == 3 && !i16 ? 4 : fixed;
    int best = 0;
    double bt = 0;
    for (int c : cand) {
      if (c == 3 && !i16) continue;
      const double v = a[c] + b[c] * static_cast<double>(M);
      if (!best || v < bt) { best = c; bt = v; }
    }
    return best ? best : 4;  // (int16 only, no int16 block: the others were dropped) the fp32 GEMM
  }
};

LargeChoice time_large_paths(CpuIsa isa, bool nvfp4) {
  LargeChoice r;
  if (isa != CpuIsa::generic) r.cand.push_back(3);
  if (cpu_best_isa() == CpuIsa::avx512) r.cand.push_back(1);
  r.cand.push_back(4);
  const char* e = std::getenv("HF_W4_LARGE_PATH");
  if (e && *e) {
    const std::string v(e);
    TORCH_CHECK(v == "int16" || v == "bf16" || v == "fp32",
                "HF_W4_LARGE_PATH must be 'int16', 'bf16' or 'fp32', got '", v, "'");
    r.fixed = v == "int16" ? 3 : v == "bf16" ? 1 : 4;
    r.from_env = true;
    TORCH_CHECK(std::find(r.cand.begin(), r.cand.end(), r.fixed) != r.cand.end(), "HF_W4_LARGE_PATH=", v,
                " is not available here (", v == "int16" ? "needs AVX-512 or AVX2" : "needs AVX512-BF16", ")");
    return r;
  }
  if (r.cand.size() == 1) {
    r.fixed = r.cand[0];
    return r;
  }
  const int64_t K = kLargeK, N = kLargeK, gs = nvfp4 ? 16 : 128, P = N / W4_NP, G = K / gs;
  const auto i64 = at::TensorOptions().dtype(at::kLong), f32 = at::TensorOptions().dtype(at::kFloat);
  const at::Tensor q = at::arange(P * (K / 2) * W4_NP, i64).mul(37).remainder(256).to(at::kByte);
  // NVFP4: positive e4m3 block scales 2^-2 .. 2^-1 x 1.875 (bytes 0x28 .. 0x37); int4: fp32 group scales
  const at::Tensor sc = nvfp4 ? at::arange(P * G * W4_NP, i64).remainder(16).add(0x28).to(at::kByte)
                              : at::arange(P * G * W4_NP, f32).remainder(7).add(1).mul(0.002);
  const at::Tensor zs = at::empty({0}, f32);
  const std::string isa_s = isa_name(isa);
  for (int i = 0; i < 2; ++i) {
    const int64_t M = i ? kLargeM1 : kLargeM0;
    const at::Tensor x = at::arange(M * K, f32).remainder(13).sub(6).mul(0.25).reshape({M, K}).to(at::kBFloat16);
    auto run = [&](int path) {
      const auto t0 = std::chrono::steady_clock::now();
      gemm(x, q, sc, zs, std::nullopt, std::nullopt, N, gs, nvfp4 ? "nvfp4" : "int4", 1.0, isa_s, path);
      return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    };
    if (i == 0) r.timed = r.cand;
    for (int c : r.cand) run(c);  // first use of the shape: oneDNN generates its kernels, buffers are allocated
    double best = 1e30;
    for (int c : r.cand) best = std::min(best, r.t[i][c] = run(c));
    // a candidate over 50x the fastest (the bf16 GEMM without bf16 instructions in oneDNN: ~200x) is dropped
    r.cand.erase(std::remove_if(r.cand.begin(), r.cand.end(), [&](int c) { return r.t[i][c] > 50 * best; }),
                 r.cand.end());
    for (int rep = 0; rep < 3; ++rep)
      for (int c : r.cand) r.t[i][c] = std::min(r.t[i][c], run(c));
  }
  // the line through both timings; a slope below 0 (noise) is 0, and an intercept below 0 (a noisy first point)
  // makes it the line through the origin and the second point
  for (int c : r.cand) {
    r.b[c] = std::max(0.0, (r.t[1][c] - r.t[0][c]) / (kLargeM1 - kLargeM0));
    r.a[c] = r.t[0][c] - r.b[c] * kLargeM0;
    if (r.a[c] < 0) { r.a[c] = 0; r.b[c] = r.t[1][c] / kLargeM1; }
  }
  return r;
}

const LargeChoice& large_choice(CpuIsa isa, bool nvfp4) {
  static LargeChoice c[3][2];
  static std::once_flag f[3][2];
  const int i = static_cast<int>(isa), j = nvfp4 ? 1 : 0;
  std::call_once(f[i][j], [&] { c[i][j] = time_large_paths(isa, nvfp4); });
  return c[i][j];
}

// e.g. "isa=avx2 amx=no large_m_bf16 int4=[int16 M<=71, fp32] int4_no_i16=[fp32] nvfp4=[int16 M<=35, fp32] (timed,
// 2048x2048 at M=64 / 256, ms: int4 int16 2.518 / 9.913, fp32 2.630 / 6.995; nvfp4 int16 3.883 / 15.443, fp32
// 2.837 / 7.269)": per weight type the path by M from M = 17 (the smallest M the choice is made for), for int4 also
// for group sizes without an int16 block (NVFP4 always has one), then the timings it comes from
std::string info(c10::string_view isa_req) {
  const std::string ir(isa_req);
  const CpuIsa isa = checked_isa(ir.c_str(), "cpu_w4a16_info");
  auto name = [](int p) { return p == 3 ? "int16" : p == 1 ? "bf16" : "fp32"; };
  char buf[96];
  // "[path M<=m, path M<=m, ..., path]": the switch points of the lower envelope
  auto by_m = [&](const LargeChoice& c, bool i16) {
    std::string r = "[";
    int cur = c.choose(17, i16);
    for (int64_t M = 18; M <= (int64_t(1) << 16); ++M) {
      const int nxt = c.choose(M, i16);
      if (nxt == cur) continue;
      std::snprintf(buf, sizeof buf, "%s M<=%lld, ", name(cur), static_cast<long long>(M - 1));
      r += buf;
      cur = nxt;
    }
    return r + name(cur) + "]";
  };
  std::string s = std::string("isa=") + isa_name(isa) + " amx=" +
                  (amx_enabled() && w4a16_amx_available() ? "yes" : "no") + " large_m_bf16";
  std::string t;
  bool from_env = false;
  for (int j = 0; j < 2; ++j) {
    const LargeChoice& c = large_choice(isa, j == 1);
    s += (j ? " nvfp4=" : " int4=") + by_m(c, true);
    if (j == 0) s += " int4_no_i16=" + by_m(c, false);
    from_env = c.from_env;
    if (c.fixed) continue;
    t += j ? "; nvfp4" : "int4";
    for (size_t k = 0; k < c.timed.size(); ++k) {
      const int p = c.timed[k];
      if (c.t[1][p] > 0) std::snprintf(buf, sizeof buf, "%s %s %.3f / %.3f", k ? "," : "", name(p), c.t[0][p] * 1e3,
                                       c.t[1][p] * 1e3);
      else std::snprintf(buf, sizeof buf, "%s %s %.3f (over 50x, dropped)", k ? "," : "", name(p), c.t[0][p] * 1e3);
      t += buf;
    }
  }
  if (from_env) return s + " (HF_W4_LARGE_PATH)";
  if (t.empty()) return s + " (the only candidate)";
  std::snprintf(buf, sizeof buf, " (timed, %lldx%lld at M=%lld / %lld, ms: ", static_cast<long long>(kLargeK),
                static_cast<long long>(kLargeK), static_cast<long long>(kLargeM0), static_cast<long long>(kLargeM1));
  return s + buf + t + ")";
}

at::Tensor gemm(const at::Tensor& x_in, const at::Tensor& qpack, const at::Tensor& scales, const at::Tensor& zs,
                const std::optional<at::Tensor>& perm, const std::optional<at::Tensor>& bias, int64_t n,
                int64_t group_size, c10::string_view weight_type, double global_scale, c10::string_view isa_req,
                int64_t path) {
  const std::string wt(weight_type), ir(isa_req);
  const int mode = mode_of(wt, zs.numel() > 0);
  TORCH_CHECK(x_in.dim() == 2, "cpu_w4a16_gemm: x must be 2-D [M, K]");
  const auto dt = x_in.scalar_type();
  TORCH_CHECK(dt == at::kFloat || dt == at::kBFloat16 || dt == at::kHalf,
              "cpu_w4a16_gemm: x must be float32, bfloat16 or float16");
  const int64_t M = x_in.size(0), K = x_in.size(1);
  const int64_t gs = mode == W4_NVFP4 ? 16 : group_size;
  TORCH_CHECK(K > 0, "cpu_w4a16_gemm: x has K=0 columns; K must be positive");
  TORCH_CHECK(gs > 0 && gs % 2 == 0 && K % gs == 0,
              "cpu_w4a16_gemm: the group size must be even and divide K (channel-wise: group_size = K, not -1; "
              "nvfp4: 16), got K=", K, ", group_size=", gs);
  const int64_t G = K / gs, P = (n + W4_NP - 1) / W4_NP;
  TORCH_CHECK(qpack.scalar_type() == at::kByte && qpack.numel() == P * (K / 2) * W4_NP && qpack.is_contiguous(),
              "cpu_w4a16_gemm: qpack does not match N=", n, ", K=", K);
  TORCH_CHECK(scales.numel() == P * G * W4_NP && scales.is_contiguous() &&
                  scales.scalar_type() == (mode == W4_NVFP4 ? at::kByte : at::kFloat),
              "cpu_w4a16_gemm: scales do not match the packed layout");
  TORCH_CHECK(mode != W4_ASYM || (zs.numel() == P * G * W4_NP && zs.is_contiguous() && zs.scalar_type() == at::kFloat),
              "cpu_w4a16_gemm: zs does not match the packed layout");
  if (bias) TORCH_CHECK(bias->numel() == n, "cpu_w4a16_gemm: bias must have N entries");
  TORCH_CHECK(path >= -1 && path <= 4, "cpu_w4a16_gemm: path must be -1 (auto) or 0..4, got ", path);
  auto y = at::empty({M, n}, x_in.options());
  if (M == 0 || n == 0) return y;
  at::Tensor x = x_in.contiguous();
  if (perm) x = permute_columns(x, checked_perm(*perm, K, "cpu_w4a16_gemm"));
  const CpuIsa isa = checked_isa(ir.c_str(), "cpu_w4a16_gemm");

  W4Gemm g{};
  g.N = n; g.K = K; g.G = G; g.gs = gs; g.P = P; g.mode = mode;
  g.qpack = qpack.data_ptr<uint8_t>();
  g.scales = scales.data_ptr();
  g.zs = mode == W4_ASYM ? zs.data_ptr<float>() : nullptr;
  g.gscale = static_cast<float>(global_scale);
  g.out = y.data_ptr(); g.ldo = n; g.out_dtype = dt_code(dt);

  // path 3 = 16-bit integer activations on the raw codes (AVX-512 VNNI vpdpwssd; AVX2 vpmaddwd)
  const int64_t ag = isa != CpuIsa::generic ? i16_block(isa, g, M) : 0;
  const bool amx_ok =
      isa == CpuIsa::avx512 && dt == at::kBFloat16 && K % 32 == 0 && amx_enabled() && w4a16_amx_available();
  if (path == 3 && ag == 0) path = -1;  // no int16 block for this group size: the automatic choice
  if (path < 0 && dt == at::kBFloat16 && !(amx_ok && M >= amx_min_m(g)) &&
      M > std::max(i16_max_m(isa, amx_ok, g), fused_max_m(isa, dt))) {
    path = large_choice(isa, mode == W4_NVFP4).choose(M, ag > 0);
  }
  if (ag > 0 && (path == 3 || (path < 0 && dt == at::kBFloat16 && M <= i16_max_m(isa, amx_ok, g)))) {
    const int64_t nab = K / ag;
    at::Tensor xq = at::empty({M, K}, x.options().dtype(at::kShort));
    at::Tensor xs = at::empty({M, nab}, x.options().dtype(at::kFloat));
    at::Tensor xd = at::empty({M, nab}, x.options().dtype(at::kInt));
    int16_t* xqp = xq.data_ptr<int16_t>();
    float* xsp = xs.data_ptr<float>();
    int32_t* xdp = xd.data_ptr<int32_t>();
    const bool avx512 = isa == CpuIsa::avx512;
    const int64_t l1max = mode == W4_NVFP4 && ag > 16 ? kNvFoldL1 : 0;  // the folded NVFP4 kernel
    if (quant_x16(x, isa, ag, l1max, xqp, xsp, xdp)) {
      at::Tensor bf;
      if (bias) { bf = bias->to(at::kFloat).contiguous(); g.bias = bf.data_ptr<float>(); }
      at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
        if (avx512) w4a16_fused_i16_avx512(g, xqp, xsp, xdp, M, ag, p0, p1);
        else w4a16_fused_i16_avx2(g, xqp, xsp, xdp, M, ag, p0, p1);
      });
      return y;
    }
    path = 0;  // inf / nan in x: the fp32 kernel propagates them
  }
  if (path == 3) path = -1;
  // path 2 = AMX-BF16 tiles (bf16 weights with the scales folded in, fp32 accumulation); falls back to the
  // automatic choice when the CPU / OS / shape does not allow it. HF_W4_AMX=0 disables it in the auto choice.
  if (amx_ok && (path == 2 || (path < 0 && M >= amx_min_m(g)))) {
    at::Tensor bf;
    if (bias) { bf = bias->to(at::kFloat).contiguous(); g.bias = bf.data_ptr<float>(); }
    const uint16_t* xs = reinterpret_cast<const uint16_t*>(x.data_ptr());
    const int64_t MB = (M + 15) / 16;
    // packed activations; for the small-M kernels (at most kAmxSmallMaxM x K x 2 bytes) in a buffer kept per
    // calling thread: a fresh allocation per call cost ~1 us there (with glibc's malloc_consolidate on its release;
    // perf, K = 2048, M = 4)
    thread_local AlignedBuf<uint16_t> xa_small;
    at::Tensor xa;
    uint16_t* xap;
    if (M <= kAmxSmallMaxM) {
      xap = xa_small.get(static_cast<size_t>(MB * K * 16));
    } else {
      xa = at::empty({MB * K * 16}, x.options().dtype(at::kBFloat16));
      xap = reinterpret_cast<uint16_t*>(xa.data_ptr());
    }
    // NVFP4 on AMX + AVX512-FP16: the fp16-product decode at every M (M > 32: bit-identical and, one process,
    // 2 threads, cold, ms, fp32 decode / fp16: 4096x4096 M=64 1.77-1.86 / 1.53-1.55, M=256 4.11-4.52 / 3.99-4.09;
    // 4096x11008 M=64 4.49 / 3.96-4.35, M=256 11.1 / 10.3-10.9)
    if (mode == W4_NVFP4 && w4a16_amx_fp16_available()) {
      std::vector<float> rowe(M);
      at::parallel_for(0, MB, 1,
                       [&](int64_t b0, int64_t b1) { w4a16_amx_pack_a_pow2(xs, M, K, xap, rowe.data(), b0, b1); });
      at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) { w4a16_amx_nvfp4_fp16(g, xap, rowe.data(), M, p0, p1); });
      return y;
    }
    at::parallel_for(0, MB, 1, [&](int64_t b0, int64_t b1) { w4a16_amx_pack_a(xs, K, M, K, xap, b0, b1); });
    std::vector<float> xsum;
    if (mode == W4_ASYM && w4a16_amx_raw_ok(g, M))
      xsum = group_sums(M, K, gs, [&](int64_t i) { return bf16_bits_to_f32(xs[i]); });
    const float* xsp = xsum.empty() ? nullptr : xsum.data();
    at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) { w4a16_fused_amx(g, xap, xsp, M, p0, p1); });
    return y;
  }
  if (path == 2) path = -1;
  const bool fused = path == 0 || (path < 0 && M <= fused_max_m(isa, dt));  // path 1 / 4: the large-M path
  if (!fused) {
    // large M: dequantize chunks of N to dense (bf16 for bf16 x, except on path 4; else fp32) and use at::linear
    // (oneDNN / MKL)
    const auto wdt = dt == at::kBFloat16 && path != 4 ? at::kBFloat16 : at::kFloat;
    at::Tensor xc = x.to(wdt);
    std::optional<at::Tensor> bc;
    if (bias) bc = bias->to(wdt).contiguous();
    const int64_t esz = wdt == at::kFloat ? 4 : 2;
    const int64_t chunk_p = std::max<int64_t>(1, large_chunk_bytes() / (K * esz * W4_NP));
    // Chunks of large_chunk_bytes() of dequantized weight: small enough to stay in L2 between the dequantize
    // and the GEMM, large enough to keep the thread barriers and per-call oneDNN overheads few.
    // Reuse one workspace per calling thread: a fresh multi-MiB allocation per call costs page faults.
    thread_local at::Tensor ws;
    const int64_t need = std::min(P, chunk_p) * W4_NP * K * esz;
    if (!ws.defined() || ws.numel() < need) ws = at::empty({need}, x.options().dtype(at::kByte));
    for (int64_t c0 = 0; c0 < P; c0 += chunk_p) {
      const int64_t c1 = std::min(P, c0 + chunk_p);
      const int64_t n0 = c0 * W4_NP, n1 = std::min(n, c1 * W4_NP);
      const int64_t nc = n1 - n0;
      auto wt = at::from_blob(ws.data_ptr(), {K, nc}, x.options().dtype(wdt));  // W^T chunk [K, nc]
      char* base = static_cast<char*>(ws.data_ptr());
      at::parallel_for(c0, c1, 1, [&](int64_t p0, int64_t p1) {
        void* d = base + (p0 - c0) * W4_NP * esz;
        if (isa == CpuIsa::avx512) w4a16_dequant_avx512(g, d, dt_code(wdt), nc, p0, p1);
        else if (isa == CpuIsa::avx2) w4a16_dequant_avx2(g, d, dt_code(wdt), nc, p0, p1);
        else w4a16_dequant_generic(g, d, dt_code(wdt), nc, p0, p1);
      });
      at::Tensor w = wt.t();  // [nc, K] view
      std::optional<at::Tensor> bslice;
      if (bc) bslice = bc->narrow(0, n0, n1 - n0);
      at::Tensor yc = at::linear(xc, w, bslice);
      if (c0 == 0 && c1 == P) return yc.scalar_type() == dt ? yc : yc.to(dt);
      y.narrow(1, n0, n1 - n0).copy_(yc);
    }
    return y;
  }

  at::Tensor bf;
  if (bias) { bf = bias->to(at::kFloat).contiguous(); g.bias = bf.data_ptr<float>(); }
  std::vector<float> xsum;
  at::Tensor xf = x.to(at::kFloat).contiguous();
  const float* xp = xf.data_ptr<float>();
  if (mode == W4_ASYM || (isa == CpuIsa::avx2 && mode == W4_SYM))  // avx2 applies the -8 via sums too
    xsum = group_sums(M, K, gs, [&](int64_t i) { return xp[i]; });
  at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
    if (isa == CpuIsa::avx512) w4a16_fused_avx512(g, xp, M, xsum.empty() ? nullptr : xsum.data(), p0, p1);
    else if (isa == CpuIsa::avx2) w4a16_fused_avx2(g, xp, M, xsum.empty() ? nullptr : xsum.data(), p0, p1);
    else w4a16_fused_generic(g, xp, M, xsum.empty() ? nullptr : xsum.data(), p0, p1);
  });
  return y;
}

}  // namespace
}  // namespace hf_w4

TORCH_LIBRARY_IMPL(hf_w4, CPU, m) {
  m.impl("cpu_w4a16_repack", &hf_w4::repack);
  m.impl("cpu_w4a16_gemm", &hf_w4::gemm);
  m.impl("cpu_w4a16_quant_x16", &hf_w4::quant_x16_op);
}

TORCH_LIBRARY_IMPL(hf_w4, CatchAll, m) {
  m.impl("cpu_w4a16_info", &hf_w4::info);
}
