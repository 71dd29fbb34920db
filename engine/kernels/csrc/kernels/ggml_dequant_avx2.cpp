// The GGUF block decode to whole rows on AVX2 + FMA + F16C (kernels/ggml.h's dequantize_rows): each unit
// decoded in registers as the float-activation tiles decode it (ggml_avx2.h's values: the dequantized
// values bit for bit), stored as float32, or rounded to bfloat16 to nearest even as c10::BFloat16 rounds
// (a NaN becomes 0x7FC0). The large-batch path multiplies what this writes; about 1 ns a unit of 32
// values against ~4 for the portable loop, so a 576 x 1536 matrix decodes in ~0.1 ms. Torch-free.
#include "ggml_avx2.h"

namespace tokenmill::ggml::avx2 {

namespace {

// 8 floats -> 8 bfloat16, round to nearest even, NaN -> 0x7FC0 (c10's round_to_nearest_even).
TM_AVX2 inline __m128i to_bf16(__m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), nan);
  // 8 x u32 (each < 2^16) -> 8 x u16: pack within lanes, then put the two lanes' halves together
  const __m256i packed = _mm256_packus_epi32(r, r);
  return _mm256_castsi256_si128(_mm256_permute4x64_epi64(packed, 0x08));
}

template <int T>
TM_AVX2 void rows(const uint8_t* w, int64_t row_bytes, int64_t k, int64_t r0, int64_t r1, float* f32, uint16_t* bf16) {
  const int64_t blocks = k / (QK * kUnits<T>);
  for (int64_t r = r0; r < r1; ++r) {
    const uint8_t* row = w + r * row_bytes;
    for (int64_t b = 0; b < blocks; ++b)
#pragma GCC unroll 8
      for (int sub = 0; sub < kUnits<T>; ++sub) {
        __m256 v[4];
        values<T>(row + b * kBytes<T>, sub, v);
        const int64_t at = r * k + (b * kUnits<T> + sub) * QK;
        for (int i = 0; i < 4; ++i) {
          if (f32 != nullptr) {
            _mm256_storeu_ps(f32 + at + 8 * i, v[i]);
          } else {
            _mm_storeu_si128(reinterpret_cast<__m128i*>(bf16 + at + 8 * i), to_bf16(v[i]));
          }
        }
      }
  }
}

}  // namespace

void dequantize_rows(int type, const uint8_t* w, int64_t row_bytes, int64_t k, int64_t r0, int64_t r1, float* f32,
                     uint16_t* bf16) {
  switch (type) {
    case Q4_0: rows<Q4_0>(w, row_bytes, k, r0, r1, f32, bf16); break;
    case Q4_1: rows<Q4_1>(w, row_bytes, k, r0, r1, f32, bf16); break;
    case Q5_0: rows<Q5_0>(w, row_bytes, k, r0, r1, f32, bf16); break;
    case Q5_1: rows<Q5_1>(w, row_bytes, k, r0, r1, f32, bf16); break;
    case Q4_K: rows<Q4_K>(w, row_bytes, k, r0, r1, f32, bf16); break;
    case Q5_K: rows<Q5_K>(w, row_bytes, k, r0, r1, f32, bf16); break;
    case Q6_K: rows<Q6_K>(w, row_bytes, k, r0, r1, f32, bf16); break;
    default: rows<Q8_0>(w, row_bytes, k, r0, r1, f32, bf16); break;
  }
}

}  // namespace tokenmill::ggml::avx2
