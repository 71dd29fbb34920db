// The GGUF block kernels with float32 activations on AVX2 + FMA + F16C (kernels/ggml.h): each unit of a
// weight row is loaded once per tile, decoded to 4 x 8 float32 in registers (the dequantized values bit
// for bit: the unit's integers (ggml_avx2.h), an exact int -> float conversion, a product by its scale,
// the minimum's sum where the type has one) and multiplied into the tile's accumulators by FMAs, lane l
// of an accumulator taking the columns 8i + l in column order: the portable path's sums exactly.
//
// A register tile is NR output rows x MR rows of x (NR * MR accumulators): the chains of FMAs into one
// accumulator are latency-bound, so a one-row call still runs NR = 4 independent chains; rows of x
// share each decoded unit (4-row tiles decode a unit once for 4 rows). Torch-free.
#include "ggml_avx2.h"

namespace tokenmill::ggml::avx2 {

namespace {

// Output rows n..n+NR-1 for rows r..r+MR-1 of x.
template <int T, int NR, int MR>
TM_AVX2 __attribute__((noinline)) void tile(const Job& j, int64_t n, int64_t r) {
  const int64_t units = j.k / QK;
  __m256 acc[NR][MR];
#pragma GCC unroll 8
  for (int i = 0; i < NR; ++i)
#pragma GCC unroll 4
    for (int q = 0; q < MR; ++q) acc[i][q] = _mm256_setzero_ps();
  const uint8_t* w0 = j.w + n * j.row_bytes;
  const float* x0 = j.x + r * j.k;
  // blocks, then their units (unrolled: a K-quant's sub-block index is a constant in each copy)
  for (int64_t b = 0; b < units / kUnits<T>; ++b)
#pragma GCC unroll 8
   for (int sub = 0; sub < kUnits<T>; ++sub) {
    const int64_t u = b * kUnits<T> + sub;
#pragma GCC unroll 8
    for (int i = 0; i < NR; ++i) {
      __m256 w[4];
      values<T>(w0 + i * j.row_bytes + b * kBytes<T>, sub, w);
#pragma GCC unroll 4
      for (int q = 0; q < MR; ++q) {
        const float* x = x0 + q * j.k + u * QK;
#pragma GCC unroll 4
        for (int v = 0; v < 4; ++v) acc[i][q] = _mm256_fmadd_ps(w[v], _mm256_loadu_ps(x + 8 * v), acc[i][q]);
      }
    }
  }
  for (int i = 0; i < NR; ++i)
    for (int q = 0; q < MR; ++q) {
      alignas(32) float s[8];
      _mm256_store_ps(s, acc[i][q]);
      j.y[(r + q) * j.n + n + i] = reduce8(s) + (j.bias ? j.bias[n + i] : 0.f);
    }
}

// Rows of x in tiles of 4, 2, 1 (fewer output rows per tile where x has more rows: 8 accumulators).
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
  if (j.m >= 4) {  // 2 output rows x 4 rows of x
    for (; n + 2 <= n1; n += 2) rows_of_x<T, 2>(j, n);
  } else {
    for (; n + 4 <= n1; n += 4) rows_of_x<T, 4>(j, n);
  }
  for (; n < n1; ++n) rows_of_x<T, 1>(j, n);
}

}  // namespace

void run_rows(const Job& j, int64_t n0, int64_t n1) {
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

}  // namespace tokenmill::ggml::avx2
