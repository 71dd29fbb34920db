// Which instruction sets this process may use: read once from the CPU (CPUID), the OS (XCR0: the
// register state it saves) and Linux (permission for the AMX tile data), then capped by
// TOKENMILL_CPU_ISA. Every kernel group asks here and runs the best path it has for what is allowed:
// the library is built with the same portable flags on every machine (engine/kernels/cpu_kernels.py), and the
// code for an instruction set lives only in engine/kernels/csrc/kernels/, in functions that carry its target.
//
// TOKENMILL_CPU_ISA=amx|avx512|avx2|base caps the level (an A/B of the paths on one machine, and the
// tests that compare their bits); TOKENMILL_CPU_AMX=0 is the older spelling of avx512. Torch-free.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <strings.h>

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#define TM_X86 1
#endif

namespace tokenmill {

enum class Isa : int { Base = 0, Avx2 = 1, Avx512 = 2, Amx = 3 };

inline const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::Amx: return "AMX";
    case Isa::Avx512: return "AVX-512";
    case Isa::Avx2: return "AVX2";
    default: return "portable";
  }
}

struct CpuFeatures {
  bool avx2 = false;         // AVX2, FMA, F16C, and the OS saves the YMM registers
  bool avx512 = false;       // AVX-512 F, BW, VL, DQ, and the OS saves the ZMM and mask registers
  bool avx512_bf16 = false;  // AVX512_BF16 (vdpbf16ps, vcvtneps2bf16)
  bool avx512_vnni = false;  // AVX512_VNNI (vpdpwssd)
  bool amx = false;          // AMX-TILE and AMX-BF16, and Linux lets this process use the tile data
};

// The cap from the environment: the highest level any kernel may take.
inline Isa isa_cap() {
  const char* v = std::getenv("TOKENMILL_CPU_ISA");
  if (v != nullptr && *v != '\0') {
    if (!strcasecmp(v, "base") || !strcasecmp(v, "portable")) return Isa::Base;
    if (!strcasecmp(v, "avx2")) return Isa::Avx2;
    if (!strcasecmp(v, "avx512") || !strcasecmp(v, "avx-512")) return Isa::Avx512;
    // anything else (the Python side refuses unknown values before loading): no cap
  }
  const char* amx = std::getenv("TOKENMILL_CPU_AMX");
  if (amx != nullptr && std::strcmp(amx, "0") == 0) return Isa::Avx512;
  return Isa::Amx;
}

#ifdef TM_X86
inline uint64_t xcr0() {
  uint32_t lo = 0, hi = 0;
  asm volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  return (static_cast<uint64_t>(hi) << 32) | lo;
}

inline CpuFeatures detect_features(Isa cap) {
  CpuFeatures f;
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid(1, &a, &b, &c, &d)) return f;
  const bool osxsave = c & (1u << 27), avx = c & (1u << 28), fma = c & (1u << 12), f16c = c & (1u << 29);
  if (!osxsave || !avx) return f;
  const uint64_t xcr = xcr0();
  const bool ymm = (xcr & 0x6) == 0x6, zmm = (xcr & 0xE6) == 0xE6, tiles = (xcr & 0x60000) == 0x60000;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return f;
  const bool avx2 = b & (1u << 5);
  const bool avx512 = (b & (1u << 16)) && (b & (1u << 17)) && (b & (1u << 30)) && (b & (1u << 31));  // F DQ BW VL
  const bool vnni = c & (1u << 11), amx_bf16 = d & (1u << 22), amx_tile = d & (1u << 24);
  unsigned a1 = 0, b1 = 0, c1 = 0, d1 = 0;
  const bool bf16 = __get_cpuid_count(7, 1, &a1, &b1, &c1, &d1) && (a1 & (1u << 5));
  f.avx2 = cap >= Isa::Avx2 && ymm && avx2 && fma && f16c;
  f.avx512 = cap >= Isa::Avx512 && f.avx2 && zmm && avx512;
  f.avx512_bf16 = f.avx512 && bf16;
  f.avx512_vnni = f.avx512 && vnni;
  if (cap >= Isa::Amx && f.avx512_bf16 && amx_bf16 && amx_tile && tiles) {
    constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
    f.amx = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
  }
  return f;
}
#else
inline CpuFeatures detect_features(Isa) { return {}; }
#endif

// This process's features after the cap, read once.
inline const CpuFeatures& cpu() {
  static const CpuFeatures f = detect_features(isa_cap());
  return f;
}

// The level the generic (compiler-vectorised) kernels run at: AVX-512 F/BW/VL/DQ, AVX2, or neither.
inline Isa vector_isa() {
  const CpuFeatures& f = cpu();
  return f.avx512 ? Isa::Avx512 : f.avx2 ? Isa::Avx2 : Isa::Base;
}

}  // namespace tokenmill
