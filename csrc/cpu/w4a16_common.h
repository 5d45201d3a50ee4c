// small inline helpers shared by the W4A16 sources (no torch headers, no ISA-specific code)
#pragma once
#include <algorithm>
#include <cstdint>
#include <climits>
#include <cmath>
#include <cstring>
#include <vector>

#include "common/aligned_buf.h"
#include "common/convert.h"
#include "common/cpu_features.h"
#include "w4a16.h"

namespace hf_w4 {

// How far ahead (bytes of the packed panel stream) the small-M kernels prefetch the weights into L1, and the int16
// kernels also into L2: a stream needs many lines in flight to reach DRAM speed (docs/cpu-kernels.md, "Tuning notes").
// The AVX2 kernels, and the AVX-512 ones of 1-6 rows on AMD, prefetch only the near distance: the far one made them
// slower.
constexpr int64_t kW4PrefetchBytes = 8192;
constexpr int64_t kW4PrefetchFarBytes = 32768;

// Exponent s of the int16 activation scale 2^s of a block of ag k (w4a16_quant_x16_*), from max_bits, the largest
// |x| of the block as fp32 bits (compared as integers by the callers, so that a nan is never lost): e - 14 for its
// exponent e, so |xq| < 2^15 and every element within 2^7 (bf16) / 2^4 (fp16) of the max converts exactly; raised
// until the block's sum of |x| (l1, summed in fp32) rounds to a sum of |xq| of at most l1max (rounding adds at most
// 1/2 per element; 2^-10 of margin for the fp32 sum). INT32_MIN if the max is inf / nan or l1 is not finite, or if a
// nonzero max is below 2^-100 (incl. denormals: its scale, and the products with it, would leave fp32's normal range
// and round the block towards zero): the caller takes the float path. An all-zero block gets -114.
inline int quant_x16_exponent(uint32_t max_bits, float l1, int64_t ag, int64_t l1max) {
  if ((max_bits >> 23) >= 255) return INT32_MIN;
  const int e = static_cast<int>(max_bits >> 23) - 127;
  if (max_bits != 0 && e < -100) return INT32_MIN;
  int s = std::max(e, -100) - 14;
  if (l1max <= 0) return s;
  if (!std::isfinite(l1)) return INT32_MIN;
  const float t = static_cast<float>(l1max - ag / 2) * (1.0f - 0x1p-10f);
  while (std::ldexp(l1, -s) > t) ++s;
  return s;
}

// fp32 sums of the activations over each group, [M][G] (asymmetric zero points act through them); at(i) reads
// element i of the row-major [M][K] activations as fp32. 16 independent partial sums (vectorized by the compiler):
// one running sum was latency bound.
template <typename At>
inline std::vector<float> group_sums(int64_t M, int64_t K, int64_t gs, At at) {
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

// element i of an fp32 / bf16 / fp16 array of dtype dt (DT_*), as fp32 (exact)
inline float w4_elem_f32(const void* p, int dt, int64_t i) {
  if (dt == DT_BF16) return bf16_bits_to_f32(static_cast<const uint16_t*>(p)[i]);
  if (dt == DT_F16) return f16_bits_to_f32(static_cast<const uint16_t*>(p)[i]);
  return static_cast<const float*>(p)[i];
}

// x [M][K] (dtype dt) to int16 blocks of ag with the quantizer of `isa` (w4a16.h; the AVX2 one takes blocks of a
// multiple of 16, others the portable one); false on inf / nan
inline bool w4a16_quant_x16(CpuIsa isa, const void* x, int dt, int64_t M, int64_t K, int64_t ag, int64_t l1max,
                            int16_t* xq, float* xs, int32_t* xd) {
  if (isa == CpuIsa::avx512) return w4a16_quant_x16_avx512(x, dt, M, K, ag, l1max, xq, xs, xd);
  if (isa == CpuIsa::avx2 && ag % 16 == 0) return w4a16_quant_x16_avx2(x, dt, M, K, ag, l1max, xq, xs, xd);
  return w4a16_quant_x16_generic(x, dt, M, K, ag, l1max, xq, xs, xd);
}

// store fp32 results v[0..cnt) of output row m, columns n0.. (gscale, bias, dtype conversion)
void w4a16_store_row(const W4Gemm& g, int64_t m, int64_t n0, const float* v, int64_t cnt);

}  // namespace hf_w4
