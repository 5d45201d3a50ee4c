// Argument checks shared by the W4A16 and int8 op wrappers (ATen side only).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <string>
#include <vector>

#include "cpu_features.h"

namespace hf_w4 {

// A K permutation (act-order) as int64, checked: the kernels use its values as raw column indices, so a wrong
// length or an out-of-range / repeated entry would read past the activations or silently drop columns.
inline at::Tensor checked_perm(const at::Tensor& perm, int64_t k, const char* op) {
  TORCH_CHECK(perm.dim() == 1 && perm.numel() == k && !at::isFloatingType(perm.scalar_type()), op,
              ": perm must be a 1-D integer permutation of the K=", k, " columns, got ", perm.scalar_type(), " ",
              perm.sizes());
  at::Tensor p = perm.to(at::kLong).contiguous();
  const int64_t* v = p.data_ptr<int64_t>();
  std::vector<char> seen(static_cast<size_t>(k), 0);
  for (int64_t i = 0; i < k; ++i) {
    TORCH_CHECK(v[i] >= 0 && v[i] < k && !seen[v[i]], op, ": perm is not a permutation of 0..", k - 1, " (entry ", i,
                " is ", v[i], v[i] >= 0 && v[i] < k ? ", repeated)" : ", out of range)");
    seen[v[i]] = 1;
  }
  return p;
}

// The ISA level for an op's isa argument ("" / auto, else a level name; "" reads HF_W4_ISA), checked: an unknown
// name or a level this CPU lacks is an error naming what was asked, what the CPU has and what is supported.
inline CpuIsa checked_isa(const char* requested, const char* op) {
  CpuIsa isa;
  std::string err;
  TORCH_CHECK(resolve_isa(requested, isa, err), op, ": ", err);
  return isa;
}

}  // namespace hf_w4
