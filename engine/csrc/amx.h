// Whether this process may use the AMX tile unit, shared by the CPU kernels (cpu_gemv.cpp, cpu_lora.cpp).
#pragma once

#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdlib>
#include <string>

namespace tokenmill {

// AMX (Sapphire Rapids and later): CPUID.(7, 0):EDX bits 22 (AMX-BF16) and 24 (AMX-TILE), and Linux's
// permission for this process to use the tile data state (arch_prctl ARCH_REQ_XCOMP_PERM, once).
// TOKENMILL_CPU_AMX=0 keeps every kernel off the tile unit (an A/B of the tile paths).
inline bool amx_usable() {
  static const bool ok = [] {
    const char* env = std::getenv("TOKENMILL_CPU_AMX");
    if (env != nullptr && std::string(env) == "0") return false;
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(d & (1u << 22)) || !(d & (1u << 24))) return false;
    constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
  }();
  return ok;
}

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
