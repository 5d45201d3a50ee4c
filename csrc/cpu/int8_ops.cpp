// hf_w4 int8 kernel: torch glue (schemas live in hf_w4/ops.py). Threads via at::parallel_for only.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/aminmax.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "int8_gemm.h"
#include "common/cpu_features.h"
#include "common/torch_checks.h"
#include "common/weight_alloc.h"

namespace {
using namespace hf_w4_int8;

int wtype_of(const std::string& s) {
  if (s == "int8") return W_INT8;
  if (s == "int4") return W_INT4;
  TORCH_CHECK(false, "hf_w4 int8 kernel: weight_type must be 'int8' or 'int4', got '", s, "'");
}

int dtype_code(c10::ScalarType t) {
  if (t == at::kFloat) return OUT_F32;
  if (t == at::kBFloat16) return OUT_BF16;
  if (t == at::kHalf) return OUT_F16;
  TORCH_CHECK(false, "hf_w4 int8 kernel: activations must be float32, bfloat16 or float16, got ", t);
}

// The kernel variant for an isa argument: the shared level names ("" / auto reads HF_W4_ISA; common/cpu_features.h),
// or one of this family's variants by name: "avxvnni" (AVX2 + AVX-VNNI), "avx2novnni" (AVX2 with vpdpbusd
// emulated); a variant this CPU lacks is an error.
int check_isa(c10::string_view isa_sv) {
  const std::string isa(isa_sv);
  const hf_w4::CpuCaps& caps = hf_w4::cpu_caps();
  if (isa == "avxvnni" || isa == "avx2novnni") {
    const bool vnni = isa == "avxvnni";
    TORCH_CHECK(caps.avx2 && (!vnni || caps.avx_vnni), "hf_w4 int8 kernel: isa='", isa, "' is not available: this "
                "CPU has ", caps.describe());
    return vnni ? ISA_AVXVNNI : ISA_AVX2;
  }
  TORCH_CHECK(hf_w4::parse_isa(isa.c_str()) >= 0, "hf_w4 int8 kernel: isa='", isa, "' is not an ISA name; use auto, "
              "avx512, avx2, generic, or one of this kernel's variants avxvnni, avx2novnni, amx");
  switch (hf_w4::checked_isa(isa.c_str(), "hf_w4 int8 kernel")) {
    case hf_w4::CpuIsa::avx512: return ISA_AVX512;
    case hf_w4::CpuIsa::avx2: return caps.avx_vnni ? ISA_AVXVNNI : ISA_AVX2;
    case hf_w4::CpuIsa::generic: break;
  }
  return ISA_GENERIC;
}

const int64_t* perm_ptr(const std::optional<at::Tensor>& perm, int64_t k, at::Tensor& keep) {
  if (!perm.has_value() || !perm->defined()) return nullptr;
  keep = hf_w4::checked_perm(*perm, k, "hf_w4 int8 kernel");
  return keep.data_ptr<int64_t>();
}

std::string isa_op(c10::string_view isa) { return isa_name(check_isa(isa)); }

// K > 0, and group_size -1 (channel-wise) or a positive divisor of K
void check_group(int64_t group_size, int64_t k, const char* op) {
  TORCH_CHECK(k > 0, op, ": K must be positive, got K=", k);
  TORCH_CHECK(group_size == -1 || (group_size > 0 && k % group_size == 0), op,
              ": group_size must be -1 (channel-wise) or a positive divisor of K=", k, ", got ", group_size);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> repack(const at::Tensor& codes, c10::string_view weight_type,
                                                      int64_t pack_dim, c10::IntArrayRef slots,
                                                      const at::Tensor& scales, const std::optional<at::Tensor>& zeros,
                                                      const std::optional<at::Tensor>& perm, int64_t n, int64_t k,
                                                      int64_t group_size) {
  const int wt = wtype_of(std::string(weight_type));
  check_group(group_size, k, "hf_w4 int8 repack");
  const Geometry g = make_geometry(n, k, group_size, wt);
  TORCH_CHECK(codes.dim() == 2, "hf_w4 int8 repack: codes must be 2-D");
  TORCH_CHECK(scales.dim() == 2 && scales.size(0) == n && scales.size(1) == g.G,
              "hf_w4 int8 repack: scales must be [N, G] = [", n, ", ", g.G, "], got ", scales.sizes());
  at::Tensor pk;
  const int64_t* pp = perm_ptr(perm, k, pk);
  const at::Tensor s = scales.to(at::kFloat).contiguous();
  at::Tensor z;
  if (zeros.has_value() && zeros->defined()) {
    TORCH_CHECK(wt == W_INT4, "hf_w4 int8 repack: zero points are only supported for int4 weights");
    TORCH_CHECK(zeros->sizes() == scales.sizes(), "hf_w4 int8 repack: zeros must be [N, G] like scales");
    z = zeros->to(at::kFloat).contiguous();
    // stored as int32 (the integer dot products subtract zero * sum(x))
    const float* zp = z.data_ptr<float>();
    for (int64_t i = 0; i < z.numel(); ++i)
      TORCH_CHECK(std::nearbyint(zp[i]) == zp[i] && std::fabs(zp[i]) < 2147483648.f,
                  "hf_w4 int8 repack: zero points must be integers (code units) in the int32 range, got zeros[",
                  i / g.G, ", ", i % g.G, "] = ", zp[i]);
  }
  const int64_t panel_bytes = wt == W_INT8 ? g.Kp * NR : g.Kp * NR / 2;
  at::Tensor out = hf_w4::empty_weight({g.P, panel_bytes}, at::kByte);
  at::Tensor so = hf_w4::empty_weight({g.P, g.G, NR}, at::kFloat);
  at::Tensor zo = z.defined() ? hf_w4::empty_weight({g.P, g.G, NR}, at::kInt)
                              : at::empty({0}, codes.options().dtype(at::kInt));
  if (wt == W_INT8) {
    TORCH_CHECK(codes.scalar_type() == at::kChar && codes.size(0) == n && codes.size(1) == k,
                "hf_w4 int8 repack: int8 weights must be int8 [N, K] = [", n, ", ", k, "]");
    const int8_t* w = codes.data_ptr<int8_t>();
    const int64_t s0 = codes.stride(0), s1 = codes.stride(1);
    at::parallel_for(0, g.P, 1, [&](int64_t b, int64_t e) { repack_int8_panels(g, w, s0, s1, pp, out.data_ptr<uint8_t>(), b, e); });
  } else if (codes.scalar_type() == at::kChar) {
    // int4 values -8..7 one per int8 (compressed-tensors int-quantized W4A8): nibble codes v + 8
    TORCH_CHECK(codes.size(0) == n && codes.size(1) == k, "hf_w4 int8 repack: int8-held int4 weights must be [N, K]");
    TORCH_CHECK(!z.defined(), "hf_w4 int8 repack: int8-held int4 weights are symmetric");
    if (codes.numel()) {
      const auto mm = at::aminmax(codes);
      const int lo = std::get<0>(mm).item<int8_t>(), hi = std::get<1>(mm).item<int8_t>();
      TORCH_CHECK(lo >= -8 && hi <= 7, "hf_w4 int8 repack: int8-held int4 weights must be in -8..7, found values from ",
                  lo, " to ", hi);
    }
    const int8_t* w = codes.data_ptr<int8_t>();
    const int64_t s0 = codes.stride(0), s1 = codes.stride(1);
    at::parallel_for(0, g.P, 1, [&](int64_t b, int64_t e) { repack_int4_from_int8(g, w, s0, s1, pp, out.data_ptr<uint8_t>(), b, e); });
  } else {
    TORCH_CHECK(codes.scalar_type() == at::kInt, "hf_w4 int8 repack: int4 codes must be int32 words");
    TORCH_CHECK(slots.size() == 8, "hf_w4 int8 repack: slots must have 8 entries");
    if (pack_dim == 0) {
      TORCH_CHECK(k % 8 == 0 && codes.size(0) == n && codes.size(1) == k / 8,
                  "hf_w4 int8 repack: codes packed along K must be [N, K/8]");
    } else {
      TORCH_CHECK(pack_dim == 1 && n % 8 == 0 && codes.size(0) == n / 8 && codes.size(1) == k,
                  "hf_w4 int8 repack: codes packed along N must be [N/8, K]");
    }
    int sl[8];
    for (int i = 0; i < 8; ++i) {
      TORCH_CHECK(slots[i] >= 0 && slots[i] < 8, "hf_w4 int8 repack: slots must be in 0..7, got slots[", i, "] = ",
                  slots[i]);
      sl[i] = (int)slots[i];
    }
    const hf_w4::QCodes qc(codes.data_ptr<int32_t>(), codes.stride(0), codes.stride(1), pack_dim == 0, sl);
    at::parallel_for(0, g.P, 1, [&](int64_t b, int64_t e) {
      repack_int4_panels(g, qc, pp, out.data_ptr<uint8_t>(), b, e);
    });
  }
  repack_scales(g, s.data_ptr<float>(), g.G, z.defined() ? z.data_ptr<float>() : nullptr, g.G,
                so.data_ptr<float>(), z.defined() ? zo.data_ptr<int32_t>() : nullptr, 0, g.P);
  return {out, so, zo};
}

struct ActQ {
  Geometry g;
  at::Tensor A, asum, ascale;
};

ActQ quantize(const at::Tensor& x2, const int64_t* pp, const Geometry& g, bool act_group, int isa,
              bool rowmajor = false) {
  const int64_t M = x2.size(0);
  const int64_t Mt = (M + MRA - 1) / MRA;
  ActQ r;
  r.g = g;
  // AMX layout (rowmajor) reads whole 16-row blocks: pad the allocation (rows >= M are never written; their
  // results are never stored)
  r.A = at::empty({rowmajor ? (M + 15) / 16 * 16 * g.Kp : Mt * MRA * g.Kp}, x2.options().dtype(at::kChar));
  r.asum = at::empty({M, g.G}, x2.options().dtype(at::kInt));
  r.ascale = at::empty({M, act_group ? g.G : 1}, x2.options().dtype(at::kFloat));
  QuantArgs q;
  q.x = x2.data_ptr(); q.in_type = dtype_code(x2.scalar_type()); q.ldx = x2.stride(0);
  q.M = M; q.perm = pp; q.act_group = act_group; q.g = g;
  q.A = r.A.data_ptr<int8_t>(); q.asum = r.asum.data_ptr<int32_t>(); q.ascale = r.ascale.data_ptr<float>();
  q.rowmajor = rowmajor;
  if (Mt == 1) quant_tiles(isa, q, 0, 1);
  else at::parallel_for(0, Mt, 1, [&](int64_t b, int64_t e) { quant_tiles(isa, q, b, e); });
  return r;
}

at::Tensor flat2d(const at::Tensor& x, int64_t k, const char* op) {
  TORCH_CHECK(x.dim() >= 1, op, ": x must be [..., K] with K=", k, ", got a 0-d tensor");
  TORCH_CHECK(x.size(-1) == k, op, ": x has ", x.size(-1), " features, expected K=", k);
  at::Tensor x2 = x.reshape({-1, k});
  if (x2.stride(1) != 1 || (x2.size(0) > 1 && x2.stride(0) < k)) x2 = x2.contiguous();
  return x2;
}

std::tuple<at::Tensor, at::Tensor> quant_act_op(const at::Tensor& x, int64_t group_size, c10::string_view isa_req) {
  const int isa = check_isa(isa_req);
  TORCH_CHECK(x.dim() >= 1, "hf_w4 int8 quant_act: x must be [..., K], got a 0-d tensor");
  const int64_t k = x.size(-1);
  check_group(group_size, k, "hf_w4 int8 quant_act");
  const bool act_group = group_size > 0 && group_size != k;
  at::Tensor x2 = flat2d(x, k, "hf_w4 int8 quant_act");
  dtype_code(x2.scalar_type());
  const Geometry g = make_geometry(1, k, act_group ? group_size : k, W_INT8);
  ActQ a = quantize(x2, nullptr, g, act_group, isa);
  const int64_t M = x2.size(0);
  at::Tensor q = at::empty({M, k}, x2.options().dtype(at::kChar));
  const int8_t* A = a.A.data_ptr<int8_t>();
  int8_t* qo = q.data_ptr<int8_t>();
  for (int64_t m = 0; m < M; ++m)
    for (int64_t j = 0; j < k; ++j) {
      const int64_t kp = (j / g.gs) * g.Gp + j % g.gs;
      qo[m * k + j] = A[(m / MRA) * MRA * g.Kp + (kp / 4) * 4 * tile_rows(m / MRA, M) + (m % MRA) * 4 + kp % 4];
    }
  std::vector<int64_t> qs(x.sizes().begin(), x.sizes().end());
  std::vector<int64_t> ss(qs);
  ss.back() = act_group ? g.G : 1;
  return {q.reshape(qs), a.ascale.reshape(ss)};
}

at::Tensor gemm_op(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                   const std::optional<at::Tensor>& zeros, const std::optional<at::Tensor>& perm,
                   const std::optional<at::Tensor>& bias, c10::string_view weight_type, int64_t n, int64_t k,
                   int64_t group_size, bool act_group, c10::string_view isa_req) {
  // "amx": AMX-INT8 wherever the layer allows it (groups of a multiple of 64 columns); "" (auto): AMX from the
  // measured M threshold below when the CPU and OS allow it (HF_W4_AMX=0 turns it off)
  const bool want_amx = std::string(isa_req) == "amx";
  TORCH_CHECK(!want_amx || hf_w4::cpu_caps().amx_int8, "hf_w4 int8 kernel: isa='amx' is not available: this CPU "
              "(or OS) has ", hf_w4::cpu_caps().describe());
  const int isa = check_isa(want_amx ? c10::string_view("avx512") : isa_req);
  const int wt = wtype_of(std::string(weight_type));
  check_group(group_size, k, "hf_w4 int8 gemm");
  const Geometry g = make_geometry(n, k, group_size, wt);
  const int64_t panel_bytes = wt == W_INT8 ? g.Kp * NR : g.Kp * NR / 2;
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous() && packed.numel() == g.P * panel_bytes,
              "hf_w4 int8 gemm: packed weight does not match N=", n, ", K=", k, ", group_size=", group_size);
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.numel() == g.P * g.G * NR,
              "hf_w4 int8 gemm: packed scales do not match the geometry");
  const bool has_z = zeros.has_value() && zeros->defined() && zeros->numel() > 0;
  if (has_z) {
    TORCH_CHECK(wt == W_INT4, "hf_w4 int8 gemm: zero points are only supported for int4 weights (int8 weights have "
                "the implicit zero 128), got zeros ", zeros->sizes(), " with weight_type 'int8'");
    TORCH_CHECK(zeros->scalar_type() == at::kInt && zeros->is_contiguous() && zeros->numel() == g.P * g.G * NR,
                "hf_w4 int8 gemm: packed zeros do not match the geometry");
  }
  at::Tensor x2 = flat2d(x, k, "hf_w4 int8 gemm");
  const int ot = dtype_code(x2.scalar_type());
  at::Tensor pk;
  const int64_t* pp = perm_ptr(perm, k, pk);
  TORCH_CHECK(!(act_group && pp), "hf_w4 int8 gemm: per-group activation quantization with an act-order "
              "permutation is not supported");
  at::Tensor b;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == n, "hf_w4 int8 gemm: bias must have N=", n, " entries");
    b = bias->to(at::kFloat).contiguous();
  }
  const int64_t M = x2.size(0);
  std::vector<int64_t> os(x.sizes().begin(), x.sizes().end());
  os.back() = n;
  at::Tensor out = at::empty({M, n}, x2.options());
  if (M == 0 || n == 0) return out.reshape(os);
  const bool auto_isa = isa_req.empty() || std::string(isa_req) == "auto";
  // AMX-INT8 from M = 8 for both weight types (docs/cpu-kernels.md, "M crossovers"); HF_W4_AMX=0 turns it off
  constexpr int64_t amx_min_m = 8;
  const bool amx_ok = isa == ISA_AVX512 && (want_amx || (auto_isa && M >= amx_min_m && hf_w4::amx_allowed())) &&
                      g.Gp % 64 == 0 && hf_w4::cpu_caps().amx_int8;
  ActQ a = quantize(x2, pp, g, act_group, isa, amx_ok);

  Plan p;
  p.g = g;
  p.B = packed.data_ptr<uint8_t>(); p.panel_bytes = panel_bytes;
  p.scales = scales.data_ptr<float>(); p.zeros = has_z ? zeros->data_ptr<int32_t>() : nullptr;
  p.zconst = wt == W_INT8 ? 128 : 8;
  p.M = M; p.A = a.A.data_ptr<int8_t>(); p.asum = a.asum.data_ptr<int32_t>(); p.ascale = a.ascale.data_ptr<float>();
  p.act_group = act_group && g.G > 1;  // one group = per token
  p.out = out.data_ptr(); p.out_type = ot; p.ldo = n;
  p.bias = b.defined() ? b.data_ptr<float>() : nullptr;
  // schedule: work item = (row chunk, 64-column panel); row chunks only for large M or few panels
  const int64_t nt = std::max<int64_t>(1, at::get_num_threads());
  const int64_t Mr = (M + MRA - 1) / MRA * MRA;
  int64_t nmc = (Mr + 479) / 480;
  if (M > 4 * MRA && g.P < 2 * nt) nmc = std::max<int64_t>(nmc, std::min<int64_t>((2 * nt + g.P - 1) / g.P, Mr / (2 * MRA)));
  int64_t mchunk = ((Mr + nmc - 1) / nmc + MRA - 1) / MRA * MRA;
  if (amx_ok) {
    // AMX: chunks of a multiple of 16 rows (its activation blocks) and at most 256 rows, so the chunk's
    // activations (256 x K bytes) stay in L2 while the item loops over the panels
    const int64_t M16 = (M + 15) / 16 * 16;
    nmc = (M16 + 255) / 256;
    if (g.P < 2 * nt) nmc = std::max<int64_t>(nmc, std::min<int64_t>((2 * nt + g.P - 1) / g.P, M16 / 16));
    mchunk = ((M16 + nmc - 1) / nmc + 15) / 16 * 16;
  }
  nmc = (M + mchunk - 1) / mchunk;
  p.mchunk = mchunk; p.nmchunks = nmc;
  const int64_t items = nmc * g.P;
  if (amx_ok) {
    at::parallel_for(0, items, 1, [&](int64_t b0, int64_t e0) { gemm_items_amx(p, b0, e0); });
  } else if (items == 1) {
    gemm_items(isa, p, 0, 1);
  } else {
    at::parallel_for(0, items, 1, [&](int64_t b0, int64_t e0) { gemm_items(isa, p, b0, e0); });
  }
  return out.reshape(os);
}

}  // namespace

TORCH_LIBRARY_IMPL(hf_w4, CPU, m) {
  m.impl("int8_repack", &repack);
  m.impl("int8_quant_act", &quant_act_op);
  m.impl("int8_gemm", &gemm_op);
}

TORCH_LIBRARY_IMPL(hf_w4, CatchAll, m) {
  m.impl("int8_isa", &isa_op);
}
