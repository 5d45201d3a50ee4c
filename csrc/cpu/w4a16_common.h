// small inline helpers shared by the W4A16 sources (no torch headers, no ISA-specific code)
#pragma once
#include <algorithm>
#include <cstdint>
#include <climits>
#include <cmath>
#include <cstring>

#include "common/aligned_buf.h"
#include "common/convert.h"
#include "w4a16.h"

namespace hf_w4 {

// How far ahead (bytes of the packed panel stream) the small-M kernels prefetch the weights into L1, and the int16
// kernels also into L2: a stream needs many lines in flight to reach DRAM speed (docs/cpu-kernels.md, "Tuning notes").
// The AVX2 kernels prefetch only the near distance: the far one made them slower.
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

// store fp32 results v[0..cnt) of output row m, columns n0.. (gscale, bias, dtype conversion)
void w4a16_store_row(const W4Gemm& g, int64_t m, int64_t n0, const float* v, int64_t cnt);

}  // namespace hf_w4
