// GGUF (ggml) quantized weights multiplied as they are stored: the block formats, one call's operands,
// and each path's entry points (torch-free). engine/kernels/csrc/cpu_ggml.cpp checks the tensors, picks
// the path for this CPU (isa.h) and spreads a call's output rows over ATen's threads.
//
// Layout: the file's own. A weight [N, K] is N rows of K / block_values blocks, each block as ggml stores
// it (little-endian, no padding; a block never spans two rows). Every type is read in units of 32
// values (a 32-value block, or one of the 8 sub-blocks of a K-quant's 256-value super-block), each unit
// as 32 small integers q[j] and float scales: w[j] = s[j / 16] * q[j] (+ c), s[0] == s[1] except Q6_K.
//   Q4_0 (18 bytes): f16 d, 16 bytes of nibbles                q = nibble - 8          s = d
//   Q4_1 (20 bytes): f16 d, f16 m, 16 bytes of nibbles         q = nibble             s = d, c = m
//   Q5_0 (22 bytes): f16 d, u32 high bits, 16 bytes nibbles    q = (nibble | hi << 4) - 16, s = d
//   Q5_1 (24 bytes): f16 d, f16 m, u32 high bits, 16 bytes     q = nibble | hi << 4   s = d, c = m
//   Q8_0 (34 bytes): f16 d, 32 int8                            q = int8               s = d
//   (value j < 16 is the low nibble of byte j, value j >= 16 the high nibble of byte j - 16; hi = bit j)
//   Q4_K (144 bytes / 256 values): f16 d, f16 dmin, 12 bytes of 6-bit (scale, min) pairs, 128 bytes:
//     sub-block u: q = nibble (low nibbles of bytes 32 (u/2).. for even u, high for odd u),
//     s = d * sc[u], c = -(dmin * mn[u])
//   Q5_K (176 bytes): Q4_K's header, 32 bytes of high bits (bit u of byte i: sub-block u's value i),
//     128 bytes of nibbles as Q4_K: q = nibble | hi << 4, s and c as Q4_K
//   Q6_K (210 bytes): 128 bytes of low nibbles, 64 bytes of 2-bit highs, 16 int8 scales, f16 d:
//     value v = 32u + i: low = nibble (v % 128) / 64 of ql[64 (v / 128) + v % 64],
//     high = 2 bits at 2 ((v % 128) / 32) of qh[32 (v / 128) + i], q = (low | high << 4) - 32,
//     s = d * scale[v / 16]
// The values are computed as gguf.quants.dequantize computes them (float32, products then a sum, in
// its order: s is d * sc rounded once, then s * q, then + c; no fused multiply-add), so a decoded
// weight is bit for bit the dequantized one.
//
// Two products, the same operand layout:
// - float activations (run_rows): y[r, n] = sum_c x[r, c] w[n, c] summed in 8 lanes, lane l taking the
//   columns c = 8i + l in column order by fused multiply-adds, then
//   ((s0 + s1) + (s2 + s3)) + ((s4 + s5) + (s6 + s7)), then + bias. Bit-exact to the float32 reference
//   in that order; every path sums in this order, so the AVX2 path and the portable one give the same bits.
// - int8 activations (run_rows_q8, llama.cpp's vec_dot): each row of x quantized per unit of 32
//   (quantize_x: dx = max |x| / 127, qx = round-to-nearest-even(x * (1 / dx)), xs = dx * sum qx), then per
//   unit exact integer sums isum[l] = sum_{p = 4l..4l+3} q[p] qx[p] (l = 0..7), and in float
//   acc[l] = fma(s[l / 4] * dx, isum[l], acc[l]), accm += c * xs; y = (reduce8(acc) + accm) + bias.
//   Not the float32 product: each x is off by at most dx / 2 (docs/ENGINE.md states the bound); the same
//   bits on every path.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

namespace tokenmill::ggml {

// ggml's type ids (GGMLQuantizationType).
enum Type : int { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14 };
constexpr int64_t QK = 32;  // values per unit

inline int64_t block_bytes(int t) {
  switch (t) {
    case Q4_0: return 18;
    case Q4_1: return 20;
    case Q5_0: return 22;
    case Q5_1: return 24;
    case Q8_0: return 34;
    case Q4_K: return 144;
    case Q5_K: return 176;
    case Q6_K: return 210;
    default: return 0;  // not a type these kernels take
  }
}

// Values per block: 256 for the K-quants, else 32.
inline int64_t block_values(int t) { return t == Q4_K || t == Q5_K || t == Q6_K ? 256 : 32; }

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

inline uint32_t load_u32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// A K-quant sub-block's 6-bit (scale, min) pair u (0..7) from the 12 packed bytes (gguf's get_scale_min).
inline void scale_min_k4(const uint8_t* s, int u, int& sc, int& mn) {
  if (u < 4) {
    sc = s[u] & 63;
    mn = s[u + 4] & 63;
  } else {
    sc = (s[u + 4] & 0xF) | ((s[u - 4] >> 6) << 4);
    mn = (s[u + 4] >> 4) | ((s[u] >> 6) << 4);
  }
}

// Unit u's scales of a block: s[0] for values 0..15, s[1] for 16..31; c added where has_min.
struct Scales {
  float s[2];
  float c;
};

// Whether a type's values carry an added constant (c).
constexpr bool has_min(int t) { return t == Q4_1 || t == Q5_1 || t == Q4_K || t == Q5_K; }

// Unit u (0 .. block_values / 32 - 1) of block b: its 32 integers and scales (the portable decode; the
// AVX2 path computes the same 32 at once).
inline void decode_unit(int t, const uint8_t* b, int u, int8_t* q, Scales& sc) {
  sc.c = 0.f;
  switch (t) {
    case Q4_0:
    case Q4_1: {
      const uint8_t* qs = b + (t == Q4_1 ? 4 : 2);
      const int off = t == Q4_0 ? 8 : 0;
      for (int j = 0; j < 16; ++j) {
        q[j] = static_cast<int8_t>((qs[j] & 0xF) - off);
        q[j + 16] = static_cast<int8_t>((qs[j] >> 4) - off);
      }
      sc.s[0] = sc.s[1] = half_to_float(load_u16(b));
      if (t == Q4_1) sc.c = half_to_float(load_u16(b + 2));
      return;
    }
    case Q5_0:
    case Q5_1: {
      const uint8_t* hp = b + (t == Q5_1 ? 4 : 2);
      const uint32_t hi = load_u32(hp);
      const uint8_t* qs = hp + 4;
      const int off = t == Q5_0 ? 16 : 0;
      for (int j = 0; j < 16; ++j) {
        q[j] = static_cast<int8_t>(((qs[j] & 0xF) | (((hi >> j) & 1) << 4)) - off);
        q[j + 16] = static_cast<int8_t>(((qs[j] >> 4) | (((hi >> (j + 16)) & 1) << 4)) - off);
      }
      sc.s[0] = sc.s[1] = half_to_float(load_u16(b));
      if (t == Q5_1) sc.c = half_to_float(load_u16(b + 2));
      return;
    }
    case Q8_0: {
      std::memcpy(q, b + 2, 32);
      sc.s[0] = sc.s[1] = half_to_float(load_u16(b));
      return;
    }
    case Q4_K:
    case Q5_K: {
      const uint8_t* hbits = b + 16;  // Q5_K
      const uint8_t* qs = b + (t == Q5_K ? 48 : 16) + 32 * (u / 2);
      const int shift = (u & 1) * 4;
      for (int i = 0; i < 32; ++i) {
        int v = (qs[i] >> shift) & 0xF;
        if (t == Q5_K) v |= ((hbits[i] >> u) & 1) << 4;
        q[i] = static_cast<int8_t>(v);
      }
      int s6, m6;
      scale_min_k4(b + 4, u, s6, m6);
      const float d = half_to_float(load_u16(b)), dmin = half_to_float(load_u16(b + 2));
      sc.s[0] = sc.s[1] = d * static_cast<float>(s6);
      sc.c = -(dmin * static_cast<float>(m6));
      return;
    }
    default: {  // Q6_K
      const int h = u / 4, jj = u % 4;
      const uint8_t* ql = b + 64 * h + 32 * (jj % 2);
      const uint8_t* qh = b + 128 + 32 * h;
      const int lshift = (jj / 2) * 4, hshift = 2 * jj;
      for (int i = 0; i < 32; ++i)
        q[i] = static_cast<int8_t>((((ql[i] >> lshift) & 0xF) | (((qh[i] >> hshift) & 3) << 4)) - 32);
      const int8_t* scales = reinterpret_cast<const int8_t*>(b + 192);
      const float d = half_to_float(load_u16(b + 208));
      sc.s[0] = d * static_cast<float>(scales[2 * u]);
      sc.s[1] = d * static_cast<float>(scales[2 * u + 1]);
      return;
    }
  }
}

// Unit u of the row `row` (blocks of type t), as float32 values: gguf.quants.dequantize's bit for bit.
inline void decode_values(int t, const uint8_t* row, int64_t u, float* w) {
  const int64_t upb = block_values(t) / QK;
  int8_t q[QK];
  Scales sc;
  decode_unit(t, row + (u / upb) * block_bytes(t), static_cast<int>(u % upb), q, sc);
  for (int j = 0; j < QK; ++j) {
    const float p = sc.s[j / 16] * static_cast<float>(q[j]);
    w[j] = has_min(t) ? p + sc.c : p;
  }
}

// The activation quantization of one unit of 32 values (every path's, the AVX2 one 8 at a time):
// dx = max |x| / 127, qx = nearbyint(x * (1 / dx)) (round to nearest even; 0 where dx is 0).
inline void quantize_unit(const float* x, int8_t* qx, float& dx, float& xs) {
  float amax = 0.f;
  for (int j = 0; j < QK; ++j) amax = std::fmax(amax, std::fabs(x[j]));
  dx = amax / 127.f;
  const float id = dx != 0.f ? 1.f / dx : 0.f;
  int sum = 0;
  for (int j = 0; j < QK; ++j) {
    const int v = static_cast<int>(std::nearbyint(x[j] * id));
    qx[j] = static_cast<int8_t>(v);
    sum += v;
  }
  xs = dx * static_cast<float>(sum);
}

// One call: y [m, n] = x [m, k] W^T + bias. Float activations read x; int8 ones read qx / dx / xs
// (x quantized by quantize_rows first).
struct Job {
  int type;
  const uint8_t* w;  // [n, row_bytes]
  int64_t n, k, row_bytes;  // row_bytes = k / block_values(type) * block_bytes(type)
  const float* x;  // [m, k]
  int64_t m;
  const float* bias;  // [n] or null
  float* y;  // [m, n]
  const int8_t* qx = nullptr;  // [m, k]: x quantized per unit of 32
  const float* dx = nullptr;  // [m, k / 32]: the units' scales
  const float* xs = nullptr;  // [m, k / 32]: dx * sum of the unit's qx
};

// The fixed reduction of 8 lane sums (every path's).
inline float reduce8(const float* s) { return ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7])); }

// Output rows [n0, n1) of a call, every row of x: float activations (run_rows) or int8 (run_rows_q8);
// quantize_rows fills qx / dx / xs for rows [r0, r1) of x; dequantize_rows writes rows [r0, r1) of a
// weight [n, k] (row_bytes a row) as float32 (f32 [n, k]) or, where f32 is null, bfloat16 bits (bf16
// [n, k], rounded to nearest even), the values decode_values gives.
namespace portable {
void run_rows(const Job& j, int64_t n0, int64_t n1);
void run_rows_q8(const Job& j, int64_t n0, int64_t n1);
void quantize_rows(const float* x, int64_t k, int64_t r0, int64_t r1, int8_t* qx, float* dx, float* xs);
void dequantize_rows(int type, const uint8_t* w, int64_t row_bytes, int64_t k, int64_t r0, int64_t r1, float* f32,
                     uint16_t* bf16);
}  // namespace portable
namespace avx2 {  // AVX2 + FMA + F16C
void run_rows(const Job& j, int64_t n0, int64_t n1);
void run_rows_q8(const Job& j, int64_t n0, int64_t n1);
void quantize_rows(const float* x, int64_t k, int64_t r0, int64_t r1, int8_t* qx, float* dx, float* xs);
void dequantize_rows(int type, const uint8_t* w, int64_t row_bytes, int64_t k, int64_t r0, int64_t r1, float* f32,
                     uint16_t* bf16);
}  // namespace avx2

}  // namespace tokenmill::ggml
