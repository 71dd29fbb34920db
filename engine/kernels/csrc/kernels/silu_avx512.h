// The gated MLP's activation in bf16 on AVX-512, shared by the fused product's epilogue
// (kernels/gemv_avx512.h) and the LoRA delta of a gate/up product (kernels/lora_amx.cpp): one
// arithmetic, so an adapter step's activation is bit for bit what the fused product gives the same
// rows. kernels/silu_avx2.h is the same arithmetic on AVX2 (the same bits). Needs AVX-512 BF16.
#pragma once

#include <immintrin.h>

#include <cstdint>

#define TM_SILU __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx512vnni,fma")))

namespace tokenmill::avx512 {

TM_SILU inline __m512 widen_bf16(__m256i h) {  // 16 bf16 to float32
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

TM_SILU inline __m512 round_bf16(__m512 v) {  // to bf16 (nearest even) and back
  return widen_bf16(reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v)));
}

TM_SILU inline __m512 exp512(__m512 x) {
  // exp(x) = 2^n e^r, |r| <= ln2 / 2, degree-6 polynomial (float32 relative error ~2e-7).
  x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.3762626647949f)), _mm512_set1_ps(-87.3365447504f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return _mm512_scalef_ps(p, n);
}

// silu(gate) * up; for a bf16 output gate, up and silu(gate) are each rounded to bf16 first, as
// PyTorch's three bf16 ops round them.
TM_SILU inline __m512 silu_mul(__m512 gate, __m512 up, bool bf16) {
  const __m512 g = bf16 ? round_bf16(gate) : gate;
  const __m512 e = exp512(_mm512_sub_ps(_mm512_setzero_ps(), g));
  const __m512 s = _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.f), e));
  return bf16 ? _mm512_mul_ps(round_bf16(s), round_bf16(up)) : _mm512_mul_ps(s, up);
}

// One row of silu_mul_rows (below): out[c] = silu(gu[c]) * gu[half + c], rounded to bf16.
TM_SILU inline void silu_mul_row(const uint16_t* gu, uint16_t* out, int64_t half) {
  for (int64_t c = 0; c < half; c += 16) {
    const __mmask16 m = half - c >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (half - c)) - 1);
    const __m512 v =
        silu_mul(widen_bf16(_mm256_maskz_loadu_epi16(m, gu + c)), widen_bf16(_mm256_maskz_loadu_epi16(m, gu + half + c)), true);
    _mm256_mask_storeu_epi16(out + c, m, reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v)));
  }
}

}  // namespace tokenmill::avx512
