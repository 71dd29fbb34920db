// kernels/silu_avx512.h's arithmetic on AVX2 + FMA, 8 lanes at a time: the same operations in the same
// order, so the same bits (scalef is two exact power-of-two products; vcvtneps2bf16 is emulated
// with its zero, denormal and NaN cases). Torch-free.
#pragma once

#include <immintrin.h>

#include <cstdint>

#define TM_AVX2_SILU __attribute__((target("avx2,fma,f16c")))

namespace tokenmill::avx2 {

TM_AVX2_SILU inline __m256 widen_bf16(__m128i h) {  // 8 bf16 to float32
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// vcvtneps2bf16, lane by lane, into each 32-bit lane's low half: NaN quieted, zero and denormal inputs
// to a signed zero, else round to nearest even.
TM_AVX2_SILU inline __m256i bf16_lanes(__m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i top = _mm256_srli_epi32(u, 16);
  const __m256i lsb = _mm256_and_si256(top, _mm256_set1_epi32(1));
  const __m256i rne = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7FFF), lsb)), 16);
  const __m256i exp = _mm256_and_si256(u, _mm256_set1_epi32(0x7F800000));
  const __m256i zero = _mm256_setzero_si256(), inf_exp = _mm256_set1_epi32(0x7F800000);
  const __m256i is_small = _mm256_cmpeq_epi32(exp, zero), is_top = _mm256_cmpeq_epi32(exp, inf_exp);
  const __m256i special = _mm256_or_si256(is_small, is_top);
  if (_mm256_testz_si256(special, special)) return rne;  // every lane normal (the common case)
  const __m256i mant = _mm256_and_si256(u, _mm256_set1_epi32(0x007FFFFF));
  const __m256i is_nan = _mm256_andnot_si256(_mm256_cmpeq_epi32(mant, zero), is_top);
  const __m256i flushed = _mm256_and_si256(top, _mm256_set1_epi32(0x8000));
  __m256i r = _mm256_blendv_epi8(rne, _mm256_or_si256(top, _mm256_set1_epi32(0x40)), is_nan);
  return _mm256_blendv_epi8(r, flushed, is_small);
}

TM_AVX2_SILU inline __m128i narrow_bf16(__m256 v) {  // 8 float32 to 8 bf16 (vcvtneps2bf16)
  const __m256i r = bf16_lanes(v);
  return _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08));
}

TM_AVX2_SILU inline __m256 round_bf16(__m256 v) {  // to bf16 and back
  return _mm256_castsi256_ps(_mm256_slli_epi32(bf16_lanes(v), 16));
}

// 2^n for integral n in [-126, 127], by its exponent bits.
TM_AVX2_SILU inline __m256 pow2(__m256i n) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n, _mm256_set1_epi32(127)), 23));
}

TM_AVX2_SILU inline __m256 exp256(__m256 x) {  // exp512's
  x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(88.3762626647949f)), _mm256_set1_ps(-87.3365447504f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(_mm256_mul_ps(p, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  // scalef(p, n) = p 2^n, n in [-126, 128]: p 2^a exactly (a = floor(n / 2): normal), then one
  // rounding by 2^(n - a), as scalef's one rounding
  const __m256i ni = _mm256_cvtps_epi32(n);
  const __m256i a = _mm256_srai_epi32(ni, 1);
  return _mm256_mul_ps(_mm256_mul_ps(p, pow2(a)), pow2(_mm256_sub_epi32(ni, a)));
}

// silu(gate) * up; for a bf16 output gate, up and silu(gate) are each rounded to bf16 first, as
// PyTorch's three bf16 ops round them.
TM_AVX2_SILU inline __m256 silu_mul(__m256 gate, __m256 up, bool bf16) {
  const __m256 g = bf16 ? round_bf16(gate) : gate;
  const __m256 e = exp256(_mm256_sub_ps(_mm256_setzero_ps(), g));
  const __m256 s = _mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.f), e));
  return bf16 ? _mm256_mul_ps(round_bf16(s), round_bf16(up)) : _mm256_mul_ps(s, up);
}

// n <= 8 bf16 from p (zeros past n), and stored to p.
TM_AVX2_SILU inline __m128i load_bf16(const uint16_t* p, int64_t n) {
  if (n >= 8) return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  alignas(16) uint16_t tmp[8] = {};
  for (int64_t i = 0; i < n; ++i) tmp[i] = p[i];
  return _mm_load_si128(reinterpret_cast<const __m128i*>(tmp));
}
TM_AVX2_SILU inline void store_bf16(uint16_t* p, __m128i v, int64_t n) {
  if (n >= 8) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), v);
    return;
  }
  alignas(16) uint16_t tmp[8];
  _mm_store_si128(reinterpret_cast<__m128i*>(tmp), v);
  for (int64_t i = 0; i < n; ++i) p[i] = tmp[i];
}

// One row: out[c] = silu(gu[c]) * gu[half + c], rounded to bf16.
TM_AVX2_SILU inline void silu_mul_row(const uint16_t* gu, uint16_t* out, int64_t half) {
  for (int64_t c = 0; c < half; c += 8) {
    const int64_t n = half - c;
    const __m256 v = silu_mul(widen_bf16(load_bf16(gu + c, n)), widen_bf16(load_bf16(gu + half + c, n)), true);
    store_bf16(out + c, narrow_bf16(v), n);
  }
}

}  // namespace tokenmill::avx2
