// hf_w4 dense GEMV: y = x W^T for a model's unquantized bf16 / fp16 Linear layers (the LM head above all) at
// decode (M <= kDenseMaxM rows). There every weight byte is read once per token, so the layer is bound by its weight
// stream; at::linear's small-M bf16 GEMM streams at about half the rate the 4-bit kernels reach on the same CPU.
// Raw pointers only, no torch headers; the glue is dense_gemv_torch.cpp. Design: docs/cpu-kernels.md ("Dense
// layers at decode").
#pragma once
#include <cstdint>

namespace hf_w4 {

constexpr int64_t kDenseMaxM = 4;

struct DenseGemv {
  const uint16_t* x;  // [M, K] activations, row-major (widened to fp32 as they are read: half the bytes of an
                      // fp32 copy, so 4 rows of K = 4096 stay in L1)
  const uint16_t* w;  // N rows of K weights, row n at w + n * ldw
  const uint16_t* bias;  // [N] (x's dtype) or nullptr
  uint16_t* y;        // [M, N]: the fp32 sum + bias, rounded once (to nearest even) into x's dtype
  int64_t M, N, K, ldw;
  bool bf16;          // x and w bf16, else fp16
};

// Rows [n0, n1) of y. Each sum runs in a fixed order (k in vector-width steps, one fp32 accumulator per row and
// output, a fixed reduction tree, then the K tail), so the result does not depend on n0 / n1 or the thread count.
void dense_gemv_avx512(const DenseGemv& g, int64_t n0, int64_t n1);
void dense_gemv_avx2(const DenseGemv& g, int64_t n0, int64_t n1);

}  // namespace hf_w4
