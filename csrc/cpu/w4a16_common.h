// small inline helpers shared by the W4A16 sources (no torch headers, no ISA-specific code)
#pragma once
#include <algorithm>
#include <cstdint>
#include <climits>
#include <cmath>
#include <cstring>

#include "aligned_buf.h"
#include "w4a16.h"

namespace hf_w4 {

// How far ahead (bytes of the packed panel stream) the small-M kernels prefetch the weights. Measured on the
// 2-vCPU AMX Xeon VM (K=N=4096, 2 threads, cold weights, medians of 6 interleaved rounds, ms):
//   distance            1024   2048   4096   8192   none
//   M=1 fused AVX-512   0.684   -     0.547  0.549  0.78
//   M=4 AMX raw codes    -     0.656   -     0.611  0.69
// (torch int4pack in the same run: 0.729 / 1.237.) A stream needs many lines in flight to reach DRAM speed.
constexpr int64_t kW4PrefetchBytes = 8192;
// The int16 kernel also prefetches into L2 this far ahead (one line per 64 bytes of codes), which the hardware
// streamer alone did not keep up with. 2 threads, cold, bf16 x, one process, the same weight copies, medians of
// 3 interleaved rounds, ms (without / 16 KiB / 32 KiB):
//   4096x4096   M=1 0.409 / 0.363 / 0.361   M=4 0.460 / 0.440 / 0.441   (NVFP4 M=1 0.414 / 0.392 / 0.391)
//   11008x4096  M=1 1.089 / 0.944 / 0.946   M=4 1.241 / 1.194 / 1.182   (NVFP4 M=4 1.351 / 1.332 / 1.330)
// (The AVX2 kernels do not: on the AVX2-only EPYC (Zen 3) the same far prefetch in every decode loop made int4 M=1
// slower, 4096x4096 0.36-0.42 -> 0.48-0.50 ms, 11008x4096 1.02-1.10 -> 1.16-1.21, builds alternated 3 times.)
constexpr int64_t kW4PrefetchFarBytes = 32768;

inline uint16_t f32_to_bf16_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

inline float bf16_bits_to_f32(uint16_t h) {
  const uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

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
