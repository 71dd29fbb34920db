// The GGUF block kernels with int8 activations on AVX2 + FMA + F16C (kernels/ggml.h, llama.cpp's
// vec_dot): x quantized per unit of 32 (quantize_rows), each weight unit decoded to 32 int8 in one
// register (ggml_avx2.h) and multiplied by x's unit with vpmaddubsw (|q| unsigned times x carrying q's
// sign, pairs summed in int16: at most 2 * 128 * 127, no saturation) and vpmaddwd by ones (lane l = the
// exact sum of values 4l..4l+3), converted to float and added by one FMA with the unit's scale times x's
// (s[l / 4] * dx), the minimum's term c * xs apart: the portable path's operations in its order, so the
// same bits. About half the instructions a unit of the float-activation tiles (ggml_avx2.cpp).
//
// Register tiles as there: NR output rows x MR rows of x, a row of x's units shared by NR rows of
// weights, a weight unit decoded once for MR rows of x. Torch-free.
#include "ggml_avx2.h"

namespace tokenmill::ggml::avx2 {

namespace {

template <int T, int NR, int MR>
TM_AVX2 __attribute__((noinline)) void tile(const Job& j, int64_t n, int64_t r) {
  const int64_t units = j.k / QK;
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[NR][MR];
  float accm[NR][MR];
#pragma GCC unroll 8
  for (int i = 0; i < NR; ++i)
#pragma GCC unroll 4
    for (int q = 0; q < MR; ++q) {
      acc[i][q] = _mm256_setzero_ps();
      accm[i][q] = 0.f;
    }
  const uint8_t* w0 = j.w + n * j.row_bytes;
  // blocks, then their units (unrolled: a K-quant's sub-block index is a constant in each copy)
  for (int64_t b = 0; b < units / kUnits<T>; ++b)
#pragma GCC unroll 8
   for (int sub = 0; sub < kUnits<T>; ++sub) {
    const int64_t u = b * kUnits<T> + sub;
    __m256i xq[MR];
    __m256 dx[MR];
#pragma GCC unroll 4
    for (int q = 0; q < MR; ++q) {
      xq[q] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(j.qx + (r + q) * j.k + u * QK));
      dx[q] = _mm256_set1_ps(j.dx[(r + q) * units + u]);
    }
    const int64_t at = b * kBytes<T>;
    // The tile's rows 1 KiB ahead: a tile reads NR rows at once (NR streams), which the hardware
    // prefetcher follows too late (measured: the Q8_0 head 49152x576 about 2x faster, others in the noise).
    if (sub == 0) {
#pragma GCC unroll 8
      for (int i = 0; i < NR; ++i) _mm_prefetch(reinterpret_cast<const char*>(w0 + i * j.row_bytes + at + 1024), _MM_HINT_T0);
    }
#pragma GCC unroll 8
    for (int i = 0; i < NR; ++i) {
      Scales sc;
      const __m256i w = decode<T>(w0 + i * j.row_bytes + at, sub, sc);
      const __m256i aw = kSigned<T> ? _mm256_sign_epi8(w, w) : w;
      const __m256 sv = T == Q6_K ? _mm256_set_m128(_mm_set1_ps(sc.s[1]), _mm_set1_ps(sc.s[0]))
                                  : _mm256_set1_ps(sc.s[0]);
#pragma GCC unroll 4
      for (int q = 0; q < MR; ++q) {
        const __m256i xv = kSigned<T> ? _mm256_sign_epi8(xq[q], w) : xq[q];
        const __m256i isum = _mm256_madd_epi16(_mm256_maddubs_epi16(aw, xv), ones);
        acc[i][q] = _mm256_fmadd_ps(_mm256_mul_ps(sv, dx[q]), _mm256_cvtepi32_ps(isum), acc[i][q]);
        if constexpr (has_min(T)) accm[i][q] = accm[i][q] + sc.c * j.xs[(r + q) * units + u];
      }
    }
  }
  for (int i = 0; i < NR; ++i)
    for (int q = 0; q < MR; ++q) {
      alignas(32) float s[8];
      _mm256_store_ps(s, acc[i][q]);
      j.y[(r + q) * j.n + n + i] = (reduce8(s) + accm[i][q]) + (j.bias ? j.bias[n + i] : 0.f);
    }
}

template <int T, int NR>
TM_AVX2 void rows_of_x(const Job& j, int64_t n) {
  int64_t r = 0;
  if constexpr (NR <= 2) {
    for (; r + 4 <= j.m; r += 4) tile<T, NR, 4>(j, n, r);
  }
  for (; r + 2 <= j.m; r += 2) tile<T, NR == 4 ? 4 : NR, 2>(j, n, r);
  for (; r < j.m; ++r) tile<T, NR, 1>(j, n, r);
}

template <int T>
TM_AVX2 void run(const Job& j, int64_t n0, int64_t n1) {
  int64_t n = n0;
  if (j.m >= 4) {
    for (; n + 2 <= n1; n += 2) rows_of_x<T, 2>(j, n);
  } else {
    for (; n + 4 <= n1; n += 4) rows_of_x<T, 4>(j, n);
  }
  for (; n < n1; ++n) rows_of_x<T, 1>(j, n);
}

TM_AVX2 inline float hmax(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}

TM_AVX2 inline int hsum(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
  return _mm_cvtsi128_si32(s);
}

}  // namespace

void run_rows_q8(const Job& j, int64_t n0, int64_t n1) {
  switch (j.type) {
    case Q4_0: run<Q4_0>(j, n0, n1); break;
    case Q4_1: run<Q4_1>(j, n0, n1); break;
    case Q5_0: run<Q5_0>(j, n0, n1); break;
    case Q5_1: run<Q5_1>(j, n0, n1); break;
    case Q4_K: run<Q4_K>(j, n0, n1); break;
    case Q5_K: run<Q5_K>(j, n0, n1); break;
    case Q6_K: run<Q6_K>(j, n0, n1); break;
    default: run<Q8_0>(j, n0, n1); break;
  }
}

// quantize_unit's values 32 at a time: max |x| is exact in any order, the rest is elementwise.
TM_AVX2 void quantize_rows(const float* x, int64_t k, int64_t r0, int64_t r1, int8_t* qx, float* dx, float* xs) {
  const int64_t units = k / QK;
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int64_t r = r0; r < r1; ++r)
    for (int64_t u = 0; u < units; ++u) {
      const float* p = x + r * k + u * QK;
      __m256 v[4];
      __m256 amax = _mm256_setzero_ps();
      for (int i = 0; i < 4; ++i) {
        v[i] = _mm256_loadu_ps(p + 8 * i);
        amax = _mm256_max_ps(amax, _mm256_and_ps(v[i], abs_mask));
      }
      const float d = hmax(amax) / 127.f;
      const __m256 id = _mm256_set1_ps(d != 0.f ? 1.f / d : 0.f);
      __m256i q[4];
      for (int i = 0; i < 4; ++i)
        q[i] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v[i], id), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
      const int sum = hsum(_mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3])));
      const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(qx + r * k + u * QK), _mm256_permutevar8x32_epi32(packed, order));
      dx[r * units + u] = d;
      xs[r * units + u] = d * static_cast<float>(sum);
    }
}

}  // namespace tokenmill::ggml::avx2
