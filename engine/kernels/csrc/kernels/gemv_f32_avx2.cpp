// The float32 small-batch linear kernel's register tiles on AVX2 + FMA (the layout and why:
// engine/kernels/csrc/cpu_gemv_f32.cpp). Torch-free.
#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "gemv_f32.h"

#define TM_AVX2 __attribute__((target("avx2,fma")))

namespace tokenmill::gemv_f32::avx2 {

namespace {

// acc[r][b] = x[r] . W[block b] for R rows and NB blocks starting at w (NB * k * 8 floats).
template <int R, int NB>
TM_AVX2 inline void tile(const float* x, int64_t ldx, const float* w, int64_t k, float* out, int64_t ldo,
                         int64_t col0, int64_t n, const float* bias) {
  __m256 acc[R][NB];
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < NB; ++b) acc[r][b] = _mm256_setzero_ps();
  for (int64_t c = 0; c < k; ++c) {
    __m256 wv[NB];
    for (int b = 0; b < NB; ++b) wv[b] = _mm256_loadu_ps(w + (b * k + c) * LANES);
    for (int r = 0; r < R; ++r) {
      const __m256 xb = _mm256_broadcast_ss(x + r * ldx + c);
      for (int b = 0; b < NB; ++b) acc[r][b] = _mm256_fmadd_ps(wv[b], xb, acc[r][b]);
    }
  }
  for (int b = 0; b < NB; ++b) {
    const int64_t c0 = col0 + b * LANES;
    if (c0 >= n) break;
    const int64_t valid = std::min<int64_t>(LANES, n - c0);
    alignas(32) float bv[LANES] = {};
    if (bias != nullptr)
      for (int64_t l = 0; l < valid; ++l) bv[l] = bias[c0 + l];
    const __m256 bias_v = _mm256_load_ps(bv);
    for (int r = 0; r < R; ++r) {
      const __m256 y = _mm256_add_ps(acc[r][b], bias_v);
      float* dst = out + r * ldo + c0;
      if (valid == LANES) {
        _mm256_storeu_ps(dst, y);
      } else {
        alignas(32) float tmp[LANES];
        _mm256_store_ps(tmp, y);
        std::copy(tmp, tmp + valid, dst);
      }
    }
  }
}

// Rows [m0, m0 + R) of one group's outputs, every row of the tile against each weight loaded: 1-2
// rows take the group's four blocks at once, 3-6 rows two blocks at a time: at least 8 independent
// accumulator chains (2 FMA units x 4 cycles of latency) and at most 12 (AVX2 has 16 registers).
template <int R>
TM_AVX2 void rows_of_group(const float* x, int64_t k, const float* w, float* out, int64_t n, int64_t col0,
                           const float* bias) {
  constexpr int NB = R <= 2 ? 4 : 2;
  for (int b = 0; b < GB; b += NB) tile<R, NB>(x, k, w + b * k * LANES, k, out, n, col0 + b * LANES, n, bias);
}

}  // namespace

// Groups [g0, g1) of GB blocks, every row of x. Up to 6 rows: one pass over a group's weights from
// memory; more rows: tiles of 6 (and the rest), re-reading the group from L1/L2.
TM_AVX2 void run_groups(const float* x, int64_t m, int64_t k, const float* packed, int64_t n, const float* bias,
                        float* out, int64_t g0, int64_t g1) {
  for (int64_t g = g0; g < g1; ++g) {
    const float* w = packed + g * GB * k * LANES;
    const int64_t col0 = g * GB * LANES;
    for (int64_t m0 = 0; m0 < m; m0 += MR) {
      const float* xr = x + m0 * k;
      float* o = out + m0 * n;
      switch (std::min<int64_t>(MR, m - m0)) {
        case 6: rows_of_group<6>(xr, k, w, o, n, col0, bias); break;
        case 5: rows_of_group<5>(xr, k, w, o, n, col0, bias); break;
        case 4: rows_of_group<4>(xr, k, w, o, n, col0, bias); break;
        case 3: rows_of_group<3>(xr, k, w, o, n, col0, bias); break;
        case 2: rows_of_group<2>(xr, k, w, o, n, col0, bias); break;
        default: rows_of_group<1>(xr, k, w, o, n, col0, bias); break;
      }
    }
  }
}

}  // namespace tokenmill::gemv_f32::avx2
