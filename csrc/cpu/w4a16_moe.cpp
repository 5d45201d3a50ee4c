// hf_w4 W4A16 MoE experts in one call (schema in hf_w4/ops.py: cpu_w4a16_moe). A decode step of a MoE layer runs
// every routed expert's gate and up projections, the activation, the down projection and the weighted sum here,
// instead of three gemm calls (and the glue between them) per routed expert: at decode the per-call costs, not the
// weight stream, were what made small experts slow.
//
// Each (expert, projection) runs the kernel that cpu_w4a16_gemm would pick for its rows (w4a16_path.h), restricted
// to the small-M kernels (int16 activations x raw codes, or the fused fp32 decode), with the same activation
// quantization and the same output rounding; silu and the product run through ATen on the same row blocks as the
// per-expert forward, and the weighted outputs are summed per token as transformers' eager experts sum them on the
// CPU (output x routing weight in their promoted dtype, cast to x's; index_add_ adds those in fp32, in ascending
// expert order, and rounds once). So the result is bit for bit the per-expert forward's wherever its projection
// calls take the small-M kernels (always at M = 1).
//
// Work split (at::parallel_for, OpenMP): gate and up as (expert, projection, panel) items, each thread a contiguous
// run of them (both threads busy even with few experts); then the down projection by output panels, each thread
// running every routed expert over its panels and summing them there (no cross-thread reduction). Each expert's
// weights are read once per step.
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mul.h>
#include <ATen/ops/silu.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "common/convert.h"
#include "common/cpu_features.h"
#include "common/torch_checks.h"
#include "w4a16.h"
#include "w4a16_common.h"
#include "w4a16_path.h"

namespace hf_w4 {
namespace {

constexpr const char* kOp = "cpu_w4a16_moe";

int dtype_code(at::ScalarType t) {
  return t == at::kFloat ? DT_F32 : t == at::kBFloat16 ? DT_BF16 : DT_F16;
}

// v rounded to the dtype dt (round to nearest even), back as fp32
float round_to(float v, int dt) {
  if (dt == DT_BF16) return bf16_bits_to_f32(f32_to_bf16_bits(v));
  if (dt == DT_F16) return f16_bits_to_f32(f32_to_f16_bits(v));
  return v;
}

void store(void* p, int dt, int64_t i, float v) {
  if (dt == DT_BF16) static_cast<uint16_t*>(p)[i] = f32_to_bf16_bits(v);
  else if (dt == DT_F16) static_cast<uint16_t*>(p)[i] = f32_to_f16_bits(v);
  else static_cast<float*>(p)[i] = v;
}

// One stacked projection kind (gate_up: [E, 2, P, K/2, 32] codes; down: [E, P, K/2, 32]) checked against the shapes
// it must have; `per` = projections per expert.
struct Stack {
  int64_t N, K, gs, G, P, per;
  int mode;
  const uint8_t* qpack;
  const char* scales;
  const float* zs;
  int64_t scale_bytes;

  // the W4Gemm of projection j of expert e, writing fp32-rounded results to out [M][ldo] in out_dtype
  W4Gemm gemm(int64_t e, int64_t j, float gscale, void* out, int64_t ldo, int out_dtype) const {
    const int64_t i = e * per + j;
    W4Gemm g{};
    g.N = N; g.K = K; g.G = G; g.gs = gs; g.P = P; g.mode = mode;
    g.qpack = qpack + i * P * (K / 2) * W4_NP;
    g.scales = scales + i * P * G * W4_NP * scale_bytes;
    g.zs = zs ? zs + i * P * G * W4_NP : nullptr;
    g.gscale = gscale;
    g.out = out; g.ldo = ldo; g.out_dtype = out_dtype;
    return g;
  }
};

Stack checked_stack(const char* what, const at::Tensor& q, const at::Tensor& s, const at::Tensor& z, int64_t E,
                    int64_t per, int64_t N, int64_t K, int64_t group_size, bool nvfp4) {
  const int64_t gs = nvfp4 ? 16 : group_size;
  TORCH_CHECK(K > 0 && K % 2 == 0 && gs > 0 && gs % 2 == 0 && K % gs == 0, kOp, ": ", what, ": the group size must "
              "be even and divide K (channel-wise: group_size = K; nvfp4: 16), got K=", K, ", group_size=", gs);
  const int64_t P = (N + W4_NP - 1) / W4_NP, G = K / gs;
  std::vector<int64_t> lead = {E};
  if (per > 1) lead.push_back(per);
  auto shape = [&](int64_t inner) {
    std::vector<int64_t> v = lead;
    v.insert(v.end(), {P, inner, W4_NP});
    return v;
  };
  TORCH_CHECK(q.scalar_type() == at::kByte && q.sizes() == at::IntArrayRef(shape(K / 2)) && q.is_contiguous(), kOp,
              ": ", what, "_qpack must be contiguous uint8 ", at::IntArrayRef(shape(K / 2)), ", got ", q.scalar_type(),
              " ", q.sizes());
  const auto sdt = nvfp4 ? at::kByte : at::kFloat;
  TORCH_CHECK(s.scalar_type() == sdt && s.sizes() == at::IntArrayRef(shape(G)) && s.is_contiguous(), kOp, ": ", what,
              "_scales must be contiguous ", sdt, " ", at::IntArrayRef(shape(G)), ", got ", s.scalar_type(), " ",
              s.sizes());
  const bool asym = z.numel() > 0;
  TORCH_CHECK(!asym || (!nvfp4 && z.scalar_type() == at::kFloat && z.sizes() == s.sizes() && z.is_contiguous()), kOp,
              ": ", what, "_zs must be empty (symmetric int4, nvfp4) or contiguous float32 like the scales ",
              s.sizes(), ", got ", z.scalar_type(), " ", z.sizes());
  Stack st{};
  st.N = N; st.K = K; st.gs = gs; st.G = G; st.P = P; st.per = per;
  st.mode = nvfp4 ? W4_NVFP4 : asym ? W4_ASYM : W4_SYM;
  st.qpack = q.data_ptr<uint8_t>();
  st.scales = static_cast<const char*>(s.data_ptr());
  st.zs = asym ? z.data_ptr<float>() : nullptr;
  st.scale_bytes = nvfp4 ? 1 : 4;
  return st;
}

// The activations of one (expert, projection kind) in the form its kernel takes: int16 blocks, or fp32 rows (+ group
// sums). Built from M contiguous rows of the kind's input, exactly as cpu_w4a16_gemm builds them for those rows.
struct ExpertInput {
  bool i16 = false;
  int64_t M = 0, ag = 0;
  std::vector<int16_t> xq;
  std::vector<float> xs, xf, xsum;
  std::vector<int32_t> xd;

  void build(const void* x, int dt, int64_t M_, int64_t K, const Stack& st, const PathCaps& caps) {
    M = M_;
    const W4Call call{M, K, st.mode, st.gs, dt};
    W4Path p = choose_path(caps, call);
    // above small M the gemm would dequantize or use AMX tiles: here the small-M kernel of the same dtype instead
    if (p != W4Path::int16 && p != W4Path::fused)
      p = dt == DT_BF16 && i16_block(caps, call) > 0 ? W4Path::int16 : W4Path::fused;
    i16 = false;
    if (p == W4Path::int16) {
      ag = i16_block(caps, call);
      xq.resize(static_cast<size_t>(M * K));
      xs.resize(static_cast<size_t>(M * (K / ag)));
      xd.resize(xs.size());
      // inf / nan in x: the fused fp32 kernel, which propagates them (as the gemm does)
      i16 = w4a16_quant_x16(caps.isa, x, dt, M, K, ag, i16_l1max(caps.isa, st.mode, ag, M), xq.data(), xs.data(),
                            xd.data());
    }
    if (i16) return;
    xf.resize(static_cast<size_t>(M * K));
    for (int64_t i = 0; i < M * K; ++i) xf[i] = w4_elem_f32(x, dt, i);
    xsum.clear();
    if (fused_needs_xsum(caps.isa, st.mode)) xsum = group_sums(M, K, st.gs, [&](int64_t i) { return xf[i]; });
  }

  // panels [p0, p1) of g for these rows
  void run(const W4Gemm& g, CpuIsa isa, int64_t p0, int64_t p1) const {
    if (i16) {
      if (isa == CpuIsa::avx512) w4a16_fused_i16_avx512(g, xq.data(), xs.data(), xd.data(), M, ag, p0, p1);
      else w4a16_fused_i16_avx2(g, xq.data(), xs.data(), xd.data(), M, ag, p0, p1);
      return;
    }
    const float* sums = xsum.empty() ? nullptr : xsum.data();
    if (isa == CpuIsa::avx512) w4a16_fused_avx512(g, xf.data(), M, sums, p0, p1);
    else if (isa == CpuIsa::avx2) w4a16_fused_avx2(g, xf.data(), M, sums, p0, p1);
    else w4a16_fused_generic(g, xf.data(), M, sums, p0, p1);
  }
};

at::Tensor moe(const at::Tensor& x_in, const at::Tensor& expert_ids, const at::Tensor& expert_weights,
               const at::Tensor& gate_up_qpack, const at::Tensor& gate_up_scales, const at::Tensor& gate_up_zs,
               const at::Tensor& down_qpack, const at::Tensor& down_scales, const at::Tensor& down_zs,
               const at::Tensor& global_scales, int64_t intermediate, int64_t gate_up_group_size,
               int64_t down_group_size, c10::string_view weight_type, c10::string_view act, c10::string_view isa_req) {
  const std::string wt(weight_type), actname(act), ir(isa_req);
  TORCH_CHECK(wt == "int4" || wt == "nvfp4", kOp, ": weight_type must be 'int4' or 'nvfp4', got '", wt, "'");
  TORCH_CHECK(actname == "silu", kOp, ": act must be 'silu' (act(gate) * up), got '", actname, "'");
  TORCH_CHECK(x_in.dim() == 2, kOp, ": x must be 2-D [tokens, hidden], got ", x_in.sizes());
  const auto xdt = x_in.scalar_type();
  TORCH_CHECK(xdt == at::kFloat || xdt == at::kBFloat16 || xdt == at::kHalf, kOp,
              ": x must be float32, bfloat16 or float16, got ", xdt);
  const int64_t T = x_in.size(0), H = x_in.size(1), I = intermediate;
  TORCH_CHECK(expert_ids.dim() == 2 && expert_ids.size(0) == T &&
                  at::isIntegralType(expert_ids.scalar_type(), /*includeBool=*/false),
              kOp, ": expert_ids must be an integer tensor [tokens, k] with tokens = ", T, ", got ",
              expert_ids.scalar_type(), " ", expert_ids.sizes());
  const auto wdt = expert_weights.scalar_type();
  TORCH_CHECK(expert_weights.sizes() == expert_ids.sizes() &&
                  (wdt == at::kFloat || wdt == at::kBFloat16 || wdt == at::kHalf),
              kOp, ": expert_weights must be float32 / bfloat16 / float16 shaped like expert_ids ", expert_ids.sizes(),
              ", got ", wdt, " ", expert_weights.sizes());
  TORCH_CHECK(gate_up_qpack.dim() == 5, kOp, ": gate_up_qpack must be [experts, 2, panels, hidden/2, 32], got ",
              gate_up_qpack.sizes());
  TORCH_CHECK(I > 0, kOp, ": intermediate must be positive, got ", I);
  const int64_t E = gate_up_qpack.size(0);
  const bool nvfp4 = wt == "nvfp4";
  const Stack gu = checked_stack("gate_up", gate_up_qpack, gate_up_scales, gate_up_zs, E, 2, I, H, gate_up_group_size,
                                 nvfp4);
  const Stack dn = checked_stack("down", down_qpack, down_scales, down_zs, E, 1, H, I, down_group_size, nvfp4);
  TORCH_CHECK(global_scales.scalar_type() == at::kFloat && global_scales.dim() == 2 && global_scales.size(0) == E &&
                  global_scales.size(1) == 3 && global_scales.is_contiguous(),
              kOp, ": global_scales must be contiguous float32 [experts, 3] (gate, up, down; 1 for int4), got ",
              global_scales.scalar_type(), " ", global_scales.sizes());
  const CpuIsa isa = checked_isa(ir.c_str(), kOp);
  const float* gsc = global_scales.data_ptr<float>();

  at::Tensor out = at::zeros({T, H}, x_in.options());
  const int k = static_cast<int>(expert_ids.size(1));
  if (T == 0 || k == 0) return out;
  const at::Tensor x = x_in.contiguous();
  const at::Tensor ids = expert_ids.to(at::kLong).contiguous();
  const at::Tensor wts = expert_weights.contiguous();
  const int dt = dtype_code(xdt), wd = dtype_code(wdt);
  const int64_t* idp = ids.data_ptr<int64_t>();

  // rows: the routed (token, slot) pairs sorted by expert, stably (tokens ascending within an expert); ids >=
  // experts are masked slots (expert parallelism marks them so) and skipped
  std::vector<int64_t> start(E + 1, 0);
  for (int64_t i = 0; i < T * k; ++i) {
    TORCH_CHECK(idp[i] >= 0, kOp, ": expert_ids[", i / k, ", ", i % k, "] = ", idp[i], " is negative");
    if (idp[i] < E) ++start[idp[i] + 1];
  }
  for (int64_t e = 0; e < E; ++e) start[e + 1] += start[e];
  const int64_t R = start[E];
  std::vector<int64_t> row_pair(R), fill(start.begin(), start.end() - 1);
  for (int64_t i = 0; i < T * k; ++i)
    if (idp[i] < E) row_pair[fill[idp[i]]++] = i;
  std::vector<int64_t> used;
  for (int64_t e = 0; e < E; ++e)
    if (start[e + 1] > start[e]) used.push_back(e);
  if (used.empty()) return out;
  const int64_t U = static_cast<int64_t>(used.size());
  const auto opts = x.options();
  const int64_t es = x.element_size();
  const char* xb = static_cast<const char*>(x.data_ptr());

  // gate and up: (expert, projection, panel) items. Each thread builds the inputs of the experts its items touch
  // (their rows of x, gathered; at decode every expert has the one token and they are built once)
  const PathCaps caps = w4a16_path_caps(isa);
  const bool shared = T == 1 && R == U;
  at::Tensor gate = at::empty({R, I}, opts), up = at::empty({R, I}, opts);
  char* gp = static_cast<char*>(gate.data_ptr());
  char* upp = static_cast<char*>(up.data_ptr());
  at::parallel_for(0, U * 2 * gu.P, 1, [&](int64_t i0, int64_t i1) {
    ExpertInput in;
    std::vector<char> rows;
    int64_t built = -1;
    for (int64_t i = i0; i < i1;) {
      const int64_t u = i / (2 * gu.P), j = (i / gu.P) % 2, p0 = i % gu.P;
      const int64_t p1 = std::min(gu.P, p0 + (i1 - i));
      const int64_t e = used[u];
      if (built < 0 || (!shared && built != u)) {
        const int64_t r0 = start[e], M = start[e + 1] - r0;
        rows.resize(static_cast<size_t>(M * H * es));
        for (int64_t r = 0; r < M; ++r)
          std::memcpy(rows.data() + r * H * es, xb + (row_pair[r0 + r] / k) * H * es, H * es);
        in.build(rows.data(), dt, M, H, gu, caps);
        built = u;
      }
      void* o = (j == 0 ? gp : upp) + start[e] * I * es;
      in.run(gu.gemm(e, j, gsc[e * 3 + j], o, I, dt), isa, p0, p1);
      i += p1 - p0;
    }
  });

  // act(gate) * up through ATen, per expert's rows as the per-expert forward does (bit for bit the same values);
  // one call for all rows where that is the same computation: one elementwise chunk (at most ATen's grain of 32768
  // elements, so no thread split) and rows of whole vectors (I a multiple of 64)
  at::Tensor h;
  if (R * I <= 32768 && I % 64 == 0) {
    h = at::silu_(gate).mul_(up);
  } else {
    h = at::empty({R, I}, opts);
    for (int64_t e : used) {
      const int64_t r0 = start[e], r1 = start[e + 1];
      h.narrow(0, r0, r1 - r0).copy_(at::mul(at::silu(gate.narrow(0, r0, r1 - r0)), up.narrow(0, r0, r1 - r0)));
    }
  }
  const char* hb = static_cast<const char*>(h.data_ptr());

  // per token its rows, in ascending expert order (the order index_add_ adds them in)
  std::vector<int64_t> tok_start(T + 1, 0), tok_rows(R);
  for (int64_t r = 0; r < R; ++r) ++tok_start[row_pair[r] / k + 1];
  for (int64_t t = 0; t < T; ++t) tok_start[t + 1] += tok_start[t];
  {
    std::vector<int64_t> f(tok_start.begin(), tok_start.end() - 1);
    for (int64_t r = 0; r < R; ++r) tok_rows[f[row_pair[r] / k]++] = r;
  }
  // output x routing weight in their promoted dtype: 16-bit only where both are that dtype
  const int prod_dt = wd == dt ? dt : DT_F32;
  const void* wp = wts.data_ptr();

  // down: output panels, each thread every routed expert over its panels, then their weighted sum there. Each
  // thread builds the experts' inputs (their rows of h, contiguous) itself: a few microseconds at decode, where a
  // parallel region of its own would add a barrier
  at::Tensor y = at::empty({R, H}, opts);
  char* yb = static_cast<char*>(y.data_ptr());
  void* ob = out.data_ptr();
  at::parallel_for(0, dn.P, 1, [&](int64_t p0, int64_t p1) {
    ExpertInput din;
    for (int64_t u = 0; u < U; ++u) {
      const int64_t e = used[u];
      din.build(hb + start[e] * I * es, dt, start[e + 1] - start[e], I, dn, caps);
      din.run(dn.gemm(e, 0, gsc[e * 3 + 2], yb + start[e] * H * es, H, dt), isa, p0, p1);
    }
    const int64_t c0 = p0 * W4_NP, c1 = std::min(H, p1 * W4_NP);
    for (int64_t t = 0; t < T; ++t)
      for (int64_t c = c0; c < c1; ++c) {
        float acc = 0.0f;
        for (int64_t q = tok_start[t]; q < tok_start[t + 1]; ++q) {
          const int64_t r = tok_rows[q];
          const float y = w4_elem_f32(yb, dt, r * H + c), w = w4_elem_f32(wp, wd, row_pair[r]);
          const float v = round_to(round_to(y * w, prod_dt), dt);
          acc += v;
        }
        store(ob, dt, t * H + c, acc);
      }
  });
  return out;
}

}  // namespace
}  // namespace hf_w4

TORCH_LIBRARY_IMPL(hf_w4, CPU, m) {
  m.impl("cpu_w4a16_moe", &hf_w4::moe);
}
