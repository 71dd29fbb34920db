// Loading and storing 16 float32 or bf16 lanes on AVX-512 (masked at a tail), shared by the LoRA
// paths (kernels/lora_avx512.cpp, lora_amx.cpp). Torch-free.
#pragma once

#include <immintrin.h>

#include <cstdint>

#include "bf16.h"

#define TM_BF16_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl")))

namespace tokenmill::avx512 {

// bf16 bits (round to nearest even, finite values) of each float32 lane, in the lane's low 16 bits, and
// back to float32.
TM_BF16_AVX512 inline __m512i rne16(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  return _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), lsb)), 16);
}
TM_BF16_AVX512 inline __m512 widen16(__m512i h) { return _mm512_castsi512_ps(_mm512_slli_epi32(h, 16)); }

TM_BF16_AVX512 inline __m512 load16(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
TM_BF16_AVX512 inline __m512 load16(const bf16* p, __mmask16 m) {
  return widen16(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)));
}
TM_BF16_AVX512 inline void store16(float* p, __m512 v, __mmask16 m) { _mm512_mask_storeu_ps(p, m, v); }
TM_BF16_AVX512 inline void store16(bf16* p, __m512 v, __mmask16 m) {
  _mm256_mask_storeu_epi16(p, m, _mm512_cvtepi32_epi16(rne16(v)));
}
inline __mmask16 tail(int64_t n) { return n >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << n) - 1); }

}  // namespace tokenmill::avx512
