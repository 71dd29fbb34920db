// GGUF (ggml) quantized weights multiplied as they are stored: the block formats, one call's operands,
// and each path's entry points (torch-free). engine/kernels/csrc/cpu_ggml.cpp checks the tensors, picks
// the path for this CPU (isa.h) and spreads a call's output rows over ATen's threads.
//
// Layout: the file's own. A weight [N, K] is N rows of K / 32 blocks, each block as ggml stores it
// (little-endian, no padding; a block never spans two rows):
//   Q4_0 (18 bytes): float16 d, 16 bytes of nibbles; w[j] = d * (lo(q[j]) - 8), w[j + 16] = d * (hi(q[j]) - 8)
//   Q4_1 (20 bytes): float16 d, float16 m, 16 bytes;  w[j] = d * lo(q[j]) + m,   w[j + 16] = d * hi(q[j]) + m
//   Q8_0 (34 bytes): float16 d, 32 int8;              w[j] = d * q[j]
// The values are computed as gguf.quants.dequantize computes them (float32, a product then a sum: no
// fused multiply-add), so a decoded weight is bit for bit the dequantized one.
//
// Activations stay float32 (docs/ENGINE.md, "GGUF quantized weights"): y[r, n] = sum_c x[r, c] w[n, c]
// summed in 8 lanes, lane l taking the columns c = 8i + l in column order by fused multiply-adds, then
// ((s0 + s1) + (s2 + s3)) + ((s4 + s5) + (s6 + s7)), then + bias. Every path sums in this order, so
// the AVX2 path and the portable one give the same bits.
#pragma once

#include <cstdint>
#include <cstring>

namespace tokenmill::ggml {

// ggml's type ids (GGMLQuantizationType).
enum Type : int { Q4_0 = 2, Q4_1 = 3, Q8_0 = 8 };
constexpr int64_t QK = 32;  // values per block

inline int64_t block_bytes(int t) {
  switch (t) {
    case Q4_0: return 18;
    case Q4_1: return 20;
    case Q8_0: return 34;
    default: return 0;  // not a type these kernels take
  }
}

// IEEE half -> float, exact (subnormals, infinities and NaN included): what F16C's vcvtph2ps gives.
inline float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1Fu, man = h & 0x3FFu, bits;
  if (exp == 0x1Fu) {
    bits = sign | 0x7F800000u | (man << 13);
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (man << 13);
  } else if (man == 0) {
    bits = sign;
  } else {  // subnormal: normalise
    exp = 113;
    while (!(man & 0x400u)) {
      man <<= 1;
      --exp;
    }
    bits = sign | (exp << 23) | ((man & 0x3FFu) << 13);
  }
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

inline uint16_t load_u16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// One block's 32 values, as gguf.quants.dequantize computes them (the portable decode; the AVX2 path
// computes the same values 8 at a time).
inline void decode_block(int t, const uint8_t* b, float* w) {
  const float d = half_to_float(load_u16(b));
  if (t == Q8_0) {
    const int8_t* q = reinterpret_cast<const int8_t*>(b + 2);
    for (int j = 0; j < 32; ++j) w[j] = static_cast<float>(q[j]) * d;
  } else if (t == Q4_0) {
    const uint8_t* q = b + 2;
    for (int j = 0; j < 16; ++j) {
      w[j] = d * static_cast<float>((q[j] & 0xF) - 8);
      w[j + 16] = d * static_cast<float>((q[j] >> 4) - 8);
    }
  } else {  // Q4_1
    const float m = half_to_float(load_u16(b + 2));
    const uint8_t* q = b + 4;
    for (int j = 0; j < 16; ++j) {
      w[j] = d * static_cast<float>(q[j] & 0xF) + m;
      w[j + 16] = d * static_cast<float>(q[j] >> 4) + m;
    }
  }
}

// One call: y [m, n] = x [m, k] W^T + bias, float32 throughout.
struct Job {
  int type;
  const uint8_t* w;  // [n, k / 32 blocks]
  int64_t n, k, row_bytes;  // row_bytes = k / 32 * block_bytes(type)
  const float* x;  // [m, k]
  int64_t m;
  const float* bias;  // [n] or null
  float* y;  // [m, n]
};

// The fixed reduction of 8 lane sums (every path's).
inline float reduce8(const float* s) { return ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7])); }

// Output rows [n0, n1) of a call, every row of x.
namespace portable {
void run_rows(const Job& j, int64_t n0, int64_t n1);
}
namespace avx2 {  // AVX2 + FMA + F16C
void run_rows(const Job& j, int64_t n0, int64_t n1);
}

}  // namespace tokenmill::ggml
