// The GGUF block decode on AVX2 + F16C (kernels/ggml.h's units): a unit's 32 integers in one register,
// in value order, and its scales, as decode_unit computes them. Shared by the float-activation tiles
// (ggml_avx2.cpp), the int8-activation ones (ggml_q8_avx2.cpp) and the row decoder
// (ggml_dequant_avx2.cpp). Torch-free.
#pragma once

#include <immintrin.h>

#include "ggml.h"

#define TM_AVX2 __attribute__((target("avx2,fma,f16c")))

namespace tokenmill::ggml::avx2 {

template <int T>
constexpr int64_t kBytes = T == Q4_0 ? 18 : T == Q4_1 ? 20 : T == Q5_0 ? 22 : T == Q5_1 ? 24 : T == Q8_0 ? 34
                         : T == Q4_K ? 144 : T == Q5_K ? 176 : 210;
template <int T>
constexpr int64_t kUnits = T == Q4_K || T == Q5_K || T == Q6_K ? 8 : 1;  // units per block
template <int T>
constexpr bool kSigned = T == Q4_0 || T == Q5_0 || T == Q8_0 || T == Q6_K;  // q may be negative

TM_AVX2 inline float half_at(const uint8_t* p) { return _cvtsh_ss(load_u16(p)); }

// 16 bytes of nibbles -> 32 bytes: the low nibbles (values 0..15), then the high ones (16..31).
TM_AVX2 inline __m256i nibbles(const uint8_t* p) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m128i mask = _mm_set1_epi8(0x0F);
  return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), mask), _mm_and_si128(v, mask));
}

// 32 bits -> 32 bytes, byte j 0x10 where bit j is set, else 0 (the fifth bit of Q5_0 / Q5_1 values).
TM_AVX2 inline __m256i fifth_bits(const uint8_t* p) {
  const __m256i shuf = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0);
  __m256i bytes = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(load_u32(p))), shuf);
  bytes = _mm256_or_si256(bytes, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe));  // all ones where the bit is set
  return _mm256_and_si256(_mm256_cmpeq_epi8(bytes, _mm256_set1_epi64x(-1)), _mm256_set1_epi8(0x10));
}

// Unit u of block b: q (32 int8 in value order) and its scales (kernels/ggml.h, decode_unit's values).
template <int T>
TM_AVX2 inline __m256i decode(const uint8_t* b, int u, Scales& sc) {
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  if constexpr (T == Q4_0 || T == Q4_1) {
    sc.s[0] = sc.s[1] = half_at(b);
    if constexpr (T == Q4_1) sc.c = half_at(b + 2);
    const __m256i q = nibbles(b + (T == Q4_1 ? 4 : 2));
    return T == Q4_0 ? _mm256_sub_epi8(q, _mm256_set1_epi8(8)) : q;
  } else if constexpr (T == Q5_0 || T == Q5_1) {
    sc.s[0] = sc.s[1] = half_at(b);
    if constexpr (T == Q5_1) sc.c = half_at(b + 2);
    const uint8_t* hp = b + (T == Q5_1 ? 4 : 2);
    const __m256i q = _mm256_or_si256(nibbles(hp + 4), fifth_bits(hp));
    return T == Q5_0 ? _mm256_sub_epi8(q, _mm256_set1_epi8(16)) : q;
  } else if constexpr (T == Q8_0) {
    sc.s[0] = sc.s[1] = half_at(b);
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 2));
  } else if constexpr (T == Q4_K || T == Q5_K) {
    int s6, m6;
    scale_min_k4(b + 4, u, s6, m6);
    sc.s[0] = sc.s[1] = half_at(b) * static_cast<float>(s6);
    sc.c = -(half_at(b + 2) * static_cast<float>(m6));
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + (T == Q5_K ? 48 : 16) + 32 * (u / 2)));
    __m256i q = _mm256_and_si256(_mm256_srl_epi16(v, _mm_cvtsi32_si128((u & 1) * 4)), low4);
    if constexpr (T == Q5_K) {
      const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16));
      const __m256i bit = _mm256_and_si256(_mm256_srl_epi16(h, _mm_cvtsi32_si128(u)), _mm256_set1_epi8(1));
      q = _mm256_or_si256(q, _mm256_slli_epi16(bit, 4));
    }
    return q;
  } else {  // Q6_K
    const int h = u / 4, jj = u % 4;
    const int8_t* scales = reinterpret_cast<const int8_t*>(b + 192);
    const float d = half_at(b + 208);
    sc.s[0] = d * static_cast<float>(scales[2 * u]);
    sc.s[1] = d * static_cast<float>(scales[2 * u + 1]);
    const __m256i lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 64 * h + 32 * (jj % 2)));
    const __m256i hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 128 + 32 * h));
    const __m256i l4 = _mm256_and_si256(_mm256_srl_epi16(lo, _mm_cvtsi32_si128((jj / 2) * 4)), low4);
    const __m256i h2 = _mm256_and_si256(_mm256_srl_epi16(hi, _mm_cvtsi32_si128(2 * jj)), _mm256_set1_epi8(3));
    return _mm256_sub_epi8(_mm256_or_si256(l4, _mm256_slli_epi16(h2, 4)), _mm256_set1_epi8(32));
  }
}

// Unit `sub` of block b into w[0..3] (columns 0-7, 8-15, 16-23, 24-31).
template <int T>
TM_AVX2 inline void values(const uint8_t* b, int sub, __m256* w) {
  Scales sc;
  const __m256i q = decode<T>(b, sub, sc);
  const __m128i lo = _mm256_castsi256_si128(q), hi = _mm256_extracti128_si256(q, 1);
  const __m128i part[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
  for (int v = 0; v < 4; ++v) {
    const __m256 p = _mm256_mul_ps(_mm256_set1_ps(sc.s[v / 2]), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(part[v])));
    w[v] = has_min(T) ? _mm256_add_ps(p, _mm256_set1_ps(sc.c)) : p;
  }
}

}  // namespace tokenmill::ggml::avx2
