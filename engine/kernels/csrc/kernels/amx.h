// The AMX tile unit's configuration, shared by the tile paths (kernels/gemv_amx.cpp, lora_amx.cpp).
// Whether the unit may be used at all is isa.h's (CPUID, XCR0, Linux's permission, the cap).
#pragma once

#include <immintrin.h>

#include <cstdint>

namespace tokenmill {

// The 64-byte operand of ldtilecfg (palette 1).
struct TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// ldtilecfg of cfg. The empty asm tells the compiler cfg's bytes are read here: GCC otherwise treats
// the stores that fill a local TileConfig as dead (seen: only the palette byte stored, and ldtilecfg
// then faulting on the garbage rows and columns).
__attribute__((target("amx-tile"))) inline void load_tile_config(const TileConfig& cfg) {
  asm volatile("" : : "r"(&cfg) : "memory");
  _tile_loadconfig(&cfg);
}

}  // namespace tokenmill
