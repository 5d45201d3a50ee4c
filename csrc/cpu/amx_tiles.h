// AMX tile configuration shared by the AMX kernels (w4a16_amx.cpp, int8_avx512.cpp).
#pragma once
#include <cstdint>
#include <cstring>

namespace hf_w4 {

struct alignas(64) TileCfg {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// Palette 1, every tile unconfigured (0 rows) until set.
inline TileCfg tile_config() {
  TileCfg cfg;
  std::memset(&cfg, 0, sizeof(cfg));
  cfg.palette = 1;
  return cfg;
}

// ldtilecfg with the whole 64-byte configuration as its memory operand. GCC 12's _tile_loadconfig declares a read
// of 8 bytes only ("m" (*(const void **) config)), so where the configuration did not escape otherwise the
// compiler dropped the stores of its rows / colsb as dead: all tiles had 0 rows and the first tilezero raised
// SIGILL (seen once small_tile_config stopped being inlined).
inline void load_tile_config(const TileCfg& cfg) { __asm__ volatile("ldtilecfg %0" : : "m"(cfg)); }

}  // namespace hf_w4
