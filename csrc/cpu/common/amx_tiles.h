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

// Tile loads and stores (t: a tile number literal) with a "memory" clobber. GCC 12's _tile_loadd / _tile_stored are
// asm statements with register operands only, which tells the compiler they touch no memory: it may then sink the
// vector stores that fill a B tile buffer below the tile load that reads it, or hoist the loads of a C tile buffer
// above the tile store that writes it (the hazard _tile_loadconfig's short operand turned into a SIGILL).
#define HF_TILE_LOAD(t, base, stride)                                                                     \
  __asm__ volatile("{tileloadd\t(%0,%1,1), %%tmm" #t "|tileloadd\t%%tmm" #t ", [%0+%1*1]}"             \
                   : : "r"(static_cast<const void*>(base)), "r"(static_cast<long>(stride)) : "memory")
#define HF_TILE_STORE(t, base, stride)                                                                    \
  __asm__ volatile("{tilestored\t%%tmm" #t ", (%0,%1,1)|tilestored\t[%0+%1*1], %%tmm" #t "}"           \
                   : : "r"(static_cast<void*>(base)), "r"(static_cast<long>(stride)) : "memory")

}  // namespace hf_w4
