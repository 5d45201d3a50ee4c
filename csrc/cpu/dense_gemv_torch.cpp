// hf_w4 dense GEMV: torch glue of cpu_dense_gemv (schema in hf_w4/ops.py). Threads via at::parallel_for only.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <string>

#include "common/torch_checks.h"
#include "dense_gemv.h"

namespace hf_w4 {
namespace {

at::Tensor dense_gemv_op(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias,
                         c10::string_view isa_arg) {
  constexpr const char* op = "hf_w4::cpu_dense_gemv";
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2, op, ": x must be [M, K] and weight [N, K], got ", x.sizes(), " and ",
              weight.sizes());
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  TORCH_CHECK(weight.size(1) == K, op, ": x has K=", K, " columns but weight is ", weight.sizes());
  TORCH_CHECK(M >= 1 && M <= kDenseMaxM, op, ": M=", M, " rows; supported: 1..", kDenseMaxM,
              " (larger M is at::linear's)");
  const auto dt = weight.scalar_type();
  TORCH_CHECK((dt == at::kBFloat16 || dt == at::kHalf) && x.scalar_type() == dt, op,
              ": x and weight must both be bfloat16 or both float16, got ", x.scalar_type(), " and ", dt);
  if (bias.has_value())
    TORCH_CHECK(bias->dim() == 1 && bias->numel() == N, op, ": bias must be [N=", N, "], got ", bias->sizes());
  const std::string isa_s(isa_arg);
  const CpuIsa isa = checked_isa(isa_s.c_str(), op);
  if (isa == CpuIsa::generic) return at::linear(x, weight, bias);  // the portable path

  const at::Tensor w = weight.stride(1) == 1 && weight.stride(0) >= K ? weight : weight.contiguous();
  const at::Tensor xc = x.contiguous();
  at::Tensor b;
  if (bias.has_value()) b = bias->to(dt).contiguous();
  at::Tensor y = at::empty({M, N}, x.options());
  const DenseGemv g{reinterpret_cast<const uint16_t*>(xc.data_ptr()), reinterpret_cast<const uint16_t*>(w.data_ptr()),
                    b.defined() ? reinterpret_cast<const uint16_t*>(b.data_ptr()) : nullptr,
                    reinterpret_cast<uint16_t*>(y.data_ptr()), M, N, K, w.stride(0), dt == at::kBFloat16};
  // threads take whole blocks of 8 rows, each at least ~256 KiB of weights
  constexpr int64_t kRows = 8;
  const int64_t blocks = (N + kRows - 1) / kRows, grain = std::max<int64_t>(1, (int64_t(256) << 10) / (kRows * K * 2));
  at::parallel_for(0, blocks, grain, [&](int64_t b0, int64_t b1) {
    const int64_t n0 = b0 * kRows, n1 = std::min(N, b1 * kRows);
    if (isa == CpuIsa::avx512) dense_gemv_avx512(g, n0, n1);
    else dense_gemv_avx2(g, n0, n1);
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_IMPL(hf_w4, CPU, m) { m.impl("cpu_dense_gemv", &dense_gemv_op); }

}  // namespace hf_w4
