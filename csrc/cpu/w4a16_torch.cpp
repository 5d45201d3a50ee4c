// hf_w4 W4A16: torch glue (schemas live in hf_w4/ops.py). Argument checks, the repack, and gemm(), which asks
// w4a16_path.h for the path and runs it. All SIMD code is in w4a16_avx512.cpp / w4a16_avx2.cpp / w4a16_amx.cpp
// behind raw pointers; the ISA comes from common/cpu_features.h. Design and measurements: docs/cpu-kernels.md.
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/linear.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cstdlib>
#include <string>
#include <tuple>
#include <vector>

#include "common/aligned_buf.h"
#include "common/convert.h"
#include "common/cpu_features.h"
#include "common/torch_checks.h"
#include "common/weight_alloc.h"
#include "w4a16.h"
#include "w4a16_common.h"
#include "w4a16_path.h"

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
  auto qpack = empty_weight({P, k / 2, W4_NP}, at::kByte);
  auto oscales = empty_weight({P, G, W4_NP}, nvfp4 ? at::kByte : at::kFloat);
  auto ozs = empty_weight({mode == W4_ASYM ? P : 0, G, W4_NP}, at::kFloat);
  r.qpack = qpack.data_ptr<uint8_t>();
  r.out_scales = oscales.data_ptr();
  r.out_zs = mode == W4_ASYM ? ozs.data_ptr<float>() : nullptr;
  // AWQ codes: AVX2 byte shuffles for the full panels (the portable bit-spreading loop is ~5x slower)
  const CpuIsa isa = checked_isa("", "cpu_w4a16_repack");
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

// Dequantized chunk size: HF_W4_W4A16_CHUNK_MB, else 2 MiB per thread, so that each thread's slice of the chunk is
// still in its L2 when at::linear reads it (docs/cpu-kernels.md, "Tuning notes").
int64_t large_chunk_bytes() {
  static const double mb = [] {
    const char* e = std::getenv("HF_W4_W4A16_CHUNK_MB");
    return e && *e ? std::atof(e) : 0.0;
  }();
  if (mb > 0) return static_cast<int64_t>(mb * (1 << 20));
  return static_cast<int64_t>(2) * (1 << 20) * std::max(1, at::get_num_threads());
}

// HF_W4_LARGE_PATH=int16|bf16|fp32|blocked (read once): the large-M path for bf16 x instead of the fixed rule
// (w4a16_path.h); -1 when unset. A name this CPU cannot run is an error that says what it needs.
int large_path_setting(const CpuCaps& caps) {
  static const int v = [&] {
    const char* e = std::getenv("HF_W4_LARGE_PATH");
    if (!e || !*e) return -1;
    const std::string s(e);
    TORCH_CHECK(s == "int16" || s == "bf16" || s == "fp32" || s == "blocked", "HF_W4_LARGE_PATH must be 'int16', "
                "'bf16', 'fp32' or 'blocked', got '", s, "'");
    TORCH_CHECK(s != "int16" || caps.avx2, "HF_W4_LARGE_PATH=int16 is not available here (needs avx512 or avx2; "
                "this CPU has ", caps.describe(), ")");
    TORCH_CHECK(s != "bf16" || caps.avx512_bf16 || caps.amx_bf16, "HF_W4_LARGE_PATH=bf16 is not available here "
                "(needs AVX512-BF16 or AMX-BF16; this CPU has ", caps.describe(), ")");
    TORCH_CHECK(s != "blocked" || caps.avx512_bf16, "HF_W4_LARGE_PATH=blocked is not available here (needs "
                "AVX512-BF16; this CPU has ", caps.describe(), ")");
    return static_cast<int>(s == "int16" ? W4Path::int16 : s == "bf16" ? W4Path::dequant_bf16
                            : s == "blocked" ? W4Path::blocked : W4Path::dequant_fp32);
  }();
  return v;
}

// Whether oneDNN, at::linear's bf16 GEMM, may use the CPU's bf16 instructions. ONEDNN_MAX_CPU_ISA (or the older
// DNNL_MAX_CPU_ISA; case-insensitive, as oneDNN reads them) can cap it below them, and then its bf16 GEMM emulates
// them: on Zen 5 capped to AVX2 a 256 x 4096 x 1024 GEMM takes 36 ms with the weight as F.linear holds it and 3 s
// with the dequantize path's transposed chunks (2.6 ms uncapped): the path rule then counts no bf16 arithmetic.
bool onednn_bf16_allowed() {
  static const bool v = [] {
    const char* e = std::getenv("ONEDNN_MAX_CPU_ISA");
    if (!e || !*e) e = std::getenv("DNNL_MAX_CPU_ISA");
    if (!e || !*e) return true;
    std::string s(e);
    for (char& ch : s) ch = static_cast<char>(std::toupper(static_cast<unsigned char>(ch)));
    if (s == "DEFAULT" || s == "ALL") return true;
    for (const char* at_least : {"AVX512_CORE_BF16", "AVX512_CORE_FP16", "AVX512_CORE_AMX", "AVX10"})
      if (s.rfind(at_least, 0) == 0) return true;
    return false;
  }();
  return v;
}

// The machine facts the path choice reads, for a call on `isa`.
PathCaps path_caps(CpuIsa isa) {
  const CpuCaps& caps = cpu_caps();
  PathCaps c;
  c.isa = isa;
  c.amx = amx_allowed() && caps.amx_bf16;
  c.vbmi = w4a16_vbmi_enabled();
  c.bf16_gemm = (caps.avx512_bf16 || caps.amx_bf16) && onednn_bf16_allowed();
  c.avx512_bf16 = caps.avx512_bf16;
  c.amd = caps.amd;
  c.large = large_path_setting(caps);
  TORCH_CHECK(c.large != static_cast<int>(W4Path::int16) || isa != CpuIsa::generic, "HF_W4_LARGE_PATH=int16 is not "
              "available with isa generic (needs avx512 or avx2)");
  return c;
}

// x [M][K] (contiguous, fp32 / bf16 / fp16) -> int16 blocks of ag (see w4a16.h); false on inf / nan. Rows in
// parallel from 16 Ki elements per thread (below that the thread start costs more than it saves).
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
    if (!w4a16_quant_x16(isa, xr, dt, m1 - m0, K, ag, l1max, q, s, d)) finite = false;
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

// x[:, perm] for contiguous 2-D x (act-order): a plain gather, several times faster than index_select for one row.
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

// ---- the paths (w4a16_path.h says which one a call takes)

// int16 activations x raw codes; false when x holds inf / nan (the caller then runs the fp32 kernel, which
// propagates them)
bool run_int16(const W4Gemm& g, const at::Tensor& x, CpuIsa isa, int64_t ag, const std::optional<at::Tensor>& bias) {
  const int64_t M = x.size(0), K = x.size(1), nab = K / ag;
  at::Tensor xq = at::empty({M, K}, x.options().dtype(at::kShort));
  at::Tensor xs = at::empty({M, nab}, x.options().dtype(at::kFloat));
  at::Tensor xd = at::empty({M, nab}, x.options().dtype(at::kInt));
  int16_t* xqp = xq.data_ptr<int16_t>();
  float* xsp = xs.data_ptr<float>();
  int32_t* xdp = xd.data_ptr<int32_t>();
  if (!quant_x16(x, isa, ag, i16_l1max(isa, g.mode, ag, M), xqp, xsp, xdp)) return false;
  W4Gemm gb = g;
  at::Tensor bf;
  if (bias) { bf = bias->to(at::kFloat).contiguous(); gb.bias = bf.data_ptr<float>(); }
  at::parallel_for(0, g.P, 1, [&](int64_t p0, int64_t p1) {
    if (isa == CpuIsa::avx512) w4a16_fused_i16_avx512(gb, xqp, xsp, xdp, M, ag, p0, p1);
    else w4a16_fused_i16_avx2(gb, xqp, xsp, xdp, M, ag, p0, p1);
  });
  return true;
}

// The blocked kernel (bf16 x, AVX512-BF16), one chunk of rows at a time (w4a16_blocked_chunk): the chunk's
// activations packed into row blocks, then its panels decoded once each and every row block run over them. Packing a
// chunk just before its use finds it in the L3, and a packed copy never exceeds one chunk. Threads split the panels
// of a call with one chunk; from two chunks they split the chunks (as many per thread), each packing its own, so that
// a call has one barrier instead of two per chunk (each costs a scheduler tick when the host is busy) and the
// decodes are as many as with one thread.
void run_blocked(const W4Gemm& g, const at::Tensor& x, const std::optional<at::Tensor>& bias) {
  const int64_t M = x.size(0), K = x.size(1), nrb = (M + kBlockedRows - 1) / kBlockedRows;
  const int64_t nt = at::get_num_threads();
  int64_t chunk = w4a16_blocked_chunk(M, K), nch = (nrb + chunk - 1) / chunk;
  const bool by_chunk = nt > 1 && nch > 1;
  if (by_chunk) {  // a multiple of the thread count of equal chunks
    nch = (nch + nt - 1) / nt * nt;
    chunk = (nrb + nch - 1) / nch;
    nch = (nrb + chunk - 1) / chunk;
  }
  W4Gemm gb = g;
  at::Tensor bf;
  if (bias) { bf = bias->to(at::kFloat).contiguous(); gb.bias = bf.data_ptr<float>(); }
  const uint16_t* xs = reinterpret_cast<const uint16_t*>(x.data_ptr());
  std::vector<float> xsum;
  if (g.mode == W4_ASYM) xsum = group_sums(M, K, g.gs, [&](int64_t i) { return bf16_bits_to_f32(xs[i]); });
  const int64_t crows = chunk * kBlockedRows;
  auto packed = [&] { return at::empty({std::min(nrb, chunk) * kBlockedRows, K / 2}, x.options().dtype(at::kInt)); };
  // chunk c (rows r0 .. r0 + rows): its row blocks [b0, b1) packed, its panels [p0, p1) run
  auto pack = [&](int64_t c, uint32_t* xp, int64_t b0, int64_t b1) {
    const int64_t r0 = c * crows;
    w4a16_blocked_pack_x(xs + r0 * K, std::min(crows, M - r0), K, xp, b0, b1);
  };
  auto run = [&](int64_t c, const uint32_t* xp, int64_t p0, int64_t p1) {
    const int64_t r0 = c * crows;
    W4Gemm gc = gb;
    gc.out = static_cast<uint16_t*>(g.out) + r0 * g.ldo;  // bf16 y (the path takes bf16 x only)
    w4a16_blocked_avx512(gc, xp, xsum.empty() ? nullptr : xsum.data() + r0 * g.G, std::min(crows, M - r0), p0, p1);
  };
  if (by_chunk) {
    at::parallel_for(0, nch, 1, [&](int64_t c0, int64_t c1) {
      at::Tensor xp = packed();
      uint32_t* xpp = reinterpret_cast<uint32_t*>(xp.data_ptr<int32_t>());
      for (int64_t c = c0; c < c1; ++c) {
        pack(c, xpp, 0, std::min(chunk, nrb - c * chunk));
        run(c, xpp, 0, g.P);
      }
    });
    return;
  }
  at::Tensor xp = packed();
  uint32_t* xpp = reinterpret_cast<uint32_t*>(xp.data_ptr<int32_t>());
  for (int64_t c = 0; c < nch; ++c) {
    at::parallel_for(0, std::min(chunk, nrb - c * chunk), 1, [&](int64_t b0, int64_t b1) { pack(c, xpp, b0, b1); });
    at::parallel_for(0, g.P, 1, [&](int64_t p0, int64_t p1) { run(c, xpp, p0, p1); });
  }
}

// AMX-BF16 tiles (bf16 x, K % 32 == 0)
void run_amx(const W4Gemm& g, const at::Tensor& x, const std::optional<at::Tensor>& bias) {
  const int64_t M = x.size(0), K = x.size(1), MB = (M + 15) / 16;
  W4Gemm gb = g;
  at::Tensor bf;
  if (bias) { bf = bias->to(at::kFloat).contiguous(); gb.bias = bf.data_ptr<float>(); }
  const uint16_t* xs = reinterpret_cast<const uint16_t*>(x.data_ptr());
  // packed activations; for the small-M kernels in a buffer kept per calling thread (a fresh allocation per call
  // cost ~1 us there)
  thread_local AlignedBuf<uint16_t> xa_small;
  at::Tensor xa;
  uint16_t* xap;
  if (M <= kAmxSmallMaxM) {
    xap = xa_small.get(static_cast<size_t>(MB * K * 16));
  } else {
    xa = at::empty({MB * K * 16}, x.options().dtype(at::kBFloat16));
    xap = reinterpret_cast<uint16_t*>(xa.data_ptr());
  }
  // NVFP4 with AVX512-FP16: the fp16-product decode at every M (bit-identical to the fp32 decode, faster)
  if (g.mode == W4_NVFP4 && w4a16_amx_fp16_available()) {
    std::vector<float> rowe(M);
    at::parallel_for(0, MB, 1,
                     [&](int64_t b0, int64_t b1) { w4a16_amx_pack_a_pow2(xs, M, K, xap, rowe.data(), b0, b1); });
    at::parallel_for(0, g.P, 1, [&](int64_t p0, int64_t p1) { w4a16_amx_nvfp4_fp16(gb, xap, rowe.data(), M, p0, p1); });
    return;
  }
  at::parallel_for(0, MB, 1, [&](int64_t b0, int64_t b1) { w4a16_amx_pack_a(xs, K, M, K, xap, b0, b1); });
  std::vector<float> xsum;
  if (g.mode == W4_ASYM && amx_raw_codes(g.mode, g.gs, M))
    xsum = group_sums(M, K, g.gs, [&](int64_t i) { return bf16_bits_to_f32(xs[i]); });
  const float* xsp = xsum.empty() ? nullptr : xsum.data();
  at::parallel_for(0, g.P, 1, [&](int64_t p0, int64_t p1) { w4a16_fused_amx(gb, xap, xsp, M, p0, p1); });
}

// Dequantize chunks of N to a dense W^T (bf16 or fp32) and run at::linear (oneDNN / MKL) on each. Chunks of
// large_chunk_bytes(): small enough to stay in L2 between the dequantize and the GEMM, large enough to keep the
// thread barriers and per-call GEMM overheads few.
at::Tensor run_dequant(const W4Gemm& g, const at::Tensor& x, at::ScalarType wdt, CpuIsa isa,
                       const std::optional<at::Tensor>& bias, at::Tensor y) {
  const int64_t K = g.K, n = g.N, P = g.P;
  const auto dt = x.scalar_type();
  at::Tensor xc = x.to(wdt);
  std::optional<at::Tensor> bc;
  if (bias) bc = bias->to(wdt).contiguous();
  const int64_t esz = wdt == at::kFloat ? 4 : 2;
  const int64_t chunk_p = std::max<int64_t>(1, large_chunk_bytes() / (K * esz * W4_NP));
  // one workspace per calling thread: a fresh multi-MiB allocation per call costs page faults
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
    std::optional<at::Tensor> bslice;
    if (bc) bslice = bc->narrow(0, n0, nc);
    at::Tensor yc = at::linear(xc, wt.t(), bslice);
    if (c0 == 0 && c1 == P) return yc.scalar_type() == dt ? yc : yc.to(dt);
    y.narrow(1, n0, nc).copy_(yc);
  }
  return y;
}

// Decode in registers + fp32 FMA (fp32 activations)
void run_fused(const W4Gemm& g, const at::Tensor& x, CpuIsa isa, const std::optional<at::Tensor>& bias) {
  const int64_t M = x.size(0), K = x.size(1);
  W4Gemm gb = g;
  at::Tensor bf;
  if (bias) { bf = bias->to(at::kFloat).contiguous(); gb.bias = bf.data_ptr<float>(); }
  at::Tensor xf = x.to(at::kFloat).contiguous();
  const float* xp = xf.data_ptr<float>();
  std::vector<float> xsum;
  if (fused_needs_xsum(isa, g.mode))
    xsum = group_sums(M, K, g.gs, [&](int64_t i) { return xp[i]; });
  const float* xsp = xsum.empty() ? nullptr : xsum.data();
  at::parallel_for(0, g.P, 1, [&](int64_t p0, int64_t p1) {
    if (isa == CpuIsa::avx512) w4a16_fused_avx512(gb, xp, M, xsp, p0, p1);
    else if (isa == CpuIsa::avx2) w4a16_fused_avx2(gb, xp, M, xsp, p0, p1);
    else w4a16_fused_generic(gb, xp, M, xsp, p0, p1);
  });
}

W4Call make_call(int64_t M, int64_t K, int mode, int64_t gs, at::ScalarType dt) {
  return W4Call{M, K, mode, gs, dt_code(dt)};
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
  TORCH_CHECK(path >= -1 && path <= 5, "cpu_w4a16_gemm: path must be -1 (auto) or 0..5 (fused, bf16, amx, int16, "
              "fp32, blocked), got ", path);
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

  const PathCaps caps = path_caps(isa);
  const W4Call call = make_call(M, K, mode, gs, dt);
  switch (resolve_path(caps, call, static_cast<int>(path))) {
    case W4Path::int16:
      if (run_int16(g, x, isa, i16_block(caps, call), bias)) return y;
      break;  // inf / nan in x: the fp32 kernel propagates them
    case W4Path::amx:
      run_amx(g, x, bias);
      return y;
    case W4Path::blocked:
      run_blocked(g, x, bias);
      return y;
    case W4Path::dequant_bf16:
      return run_dequant(g, x, dt == at::kBFloat16 ? at::kBFloat16 : at::kFloat, isa, bias, y);
    case W4Path::dequant_fp32:
      return run_dequant(g, x, at::kFloat, isa, bias, y);
    case W4Path::fused:
      break;
  }
  run_fused(g, x, isa, bias);
  return y;
}

// The path the automatic choice takes for a call (tests, and anyone who wants to know): the same function gemm()
// runs, with this machine's capabilities.
std::string path_op(int64_t m, int64_t k, c10::string_view weight_type, int64_t group_size, bool asym,
                    at::ScalarType dtype, c10::string_view isa_req) {
  const std::string wt(weight_type), ir(isa_req);
  const int mode = mode_of(wt, asym);
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf,
              "cpu_w4a16_path: dtype must be float32, bfloat16 or float16, got ", dtype);
  const int64_t gs = mode == W4_NVFP4 ? 16 : group_size;
  TORCH_CHECK(m >= 0 && k > 0 && gs > 0 && k % gs == 0, "cpu_w4a16_path: need M >= 0, K > 0 and a group size "
              "dividing K, got M=", m, ", K=", k, ", group_size=", gs);
  const CpuIsa isa = checked_isa(ir.c_str(), "cpu_w4a16_path");
  return path_name(choose_path(path_caps(isa), make_call(m, k, mode, gs, dtype)));
}

// e.g. "isa=avx512 amx=no large_m_bf16 int4=[int16] int4_no_i16=[bf16] nvfp4=[int16] (fixed rules for avx512
// without AMX; cpu: avx512 (avx512_bf16 avx512_vbmi avx_vnni))": per weight type the bf16 path by M from M = 17
// (the smallest M the large-M rule is asked for; K = 4096, group 128), for int4 also for group sizes without an
// int16 block (NVFP4 always has one)
std::string info(c10::string_view isa_req) {
  const std::string ir(isa_req);
  const CpuIsa isa = checked_isa(ir.c_str(), "cpu_w4a16_info");
  const PathCaps caps = path_caps(isa);
  constexpr int64_t K = 4096;
  auto by_m = [&](int mode, int64_t gs) {
    // "[path M<=m, path M<=m, ..., path]": where the path changes
    std::string r = "[";
    auto at_m = [&](int64_t M) { return large_m_path(caps, W4Call{M, K, mode, gs, DT_BF16}); };
    W4Path cur = at_m(17);
    for (int64_t M = 18; M <= (int64_t(1) << 16); ++M) {
      const W4Path nxt = at_m(M);
      if (nxt == cur) continue;
      r += std::string(path_name(cur)) + " M<=" + std::to_string(M - 1) + ", ";
      cur = nxt;
    }
    return r + path_name(cur) + "]";
  };
  std::string s = std::string("isa=") + isa_name(isa) + " amx=" + (caps.amx ? "yes" : "no") +
                  " bf16_gemm=" + (caps.bf16_gemm ? "yes" : "no") + " large_m_bf16" +
                  " int4=" + by_m(W4_SYM, 128) + " int4_no_i16=" + by_m(W4_SYM, 2) + " nvfp4=" + by_m(W4_NVFP4, 16);
  const std::string cpu = "; cpu: " + cpu_caps().describe();
  if (caps.large >= 0) return s + " (HF_W4_LARGE_PATH" + cpu + ")";
  return s + " (fixed rules for " + isa_name(isa) + (caps.amx ? " with AMX" : " without AMX") + cpu + ")";
}

}  // namespace

PathCaps w4a16_path_caps(CpuIsa isa) { return path_caps(isa); }

}  // namespace hf_w4

TORCH_LIBRARY_IMPL(hf_w4, CPU, m) {
  m.impl("cpu_w4a16_repack", &hf_w4::repack);
  m.impl("cpu_w4a16_gemm", &hf_w4::gemm);
  m.impl("cpu_w4a16_quant_x16", &hf_w4::quant_x16_op);
}

TORCH_LIBRARY_IMPL(hf_w4, CatchAll, m) {
  m.impl("cpu_empty_weight",
         [](at::IntArrayRef size, at::ScalarType dtype) { return hf_w4::empty_weight(size, dtype); });
  m.impl("cpu_w4a16_info", &hf_w4::info);
  m.impl("cpu_w4a16_path", &hf_w4::path_op);
}
