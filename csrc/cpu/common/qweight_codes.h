// Reading 4-bit codes out of a checkpoint's int32 words (the canonical QWeight: GPTQ / AWQ / compressed-tensors
// packing, hf_w4/layouts.py), shared by the W4A16 and int8 repackers. No torch headers.
#pragma once
#include <cstdint>

namespace hf_w4 {

// codes: int32 words, word (a, b) at codes[a * s0 + b * s1]; pack_k: words along K ([N][K/8]: word (n, k/8) holds
// k = 8w .. 8w+7), else along N ([N/8][K]: word (n/8, k) holds n = 8w .. 8w+7); element j of a run of 8 sits in
// nibble slots[j] (AWQ: slots {0, 4, 1, 5, 2, 6, 3, 7}).
struct QCodes {
  const int32_t* codes;
  int64_t s0, s1;
  bool pack_k;
  int shift[8];          // 4 * slots[j]
  bool in_order = true;  // slots[j] == j: a word is already in canonical nibble order

  QCodes(const int32_t* c, int64_t stride0, int64_t stride1, bool along_k, const int slots[8])
      : codes(c), s0(stride0), s1(stride1), pack_k(along_k) {
    for (int j = 0; j < 8; ++j) {
      shift[j] = 4 * slots[j];
      in_order = in_order && slots[j] == j;
    }
  }
  // the word holding (n, k)
  uint32_t word(int64_t n, int64_t k) const {
    return static_cast<uint32_t>(pack_k ? codes[n * s0 + (k / 8) * s1] : codes[(n / 8) * s0 + k * s1]);
  }
  // the code (0..15) of output column n, input column k
  uint32_t at(int64_t n, int64_t k) const { return (word(n, k) >> shift[pack_k ? k % 8 : n % 8]) & 15u; }
  // a word with its 8 elements moved to nibbles 0..7 in order
  uint32_t canonical(uint32_t v) const {
    if (in_order) return v;
    uint32_t o = 0;
    for (int j = 0; j < 8; ++j) o |= ((v >> shift[j]) & 15u) << (4 * j);
    return o;
  }
};

}  // namespace hf_w4
