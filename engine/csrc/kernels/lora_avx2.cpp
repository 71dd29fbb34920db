// The LoRA delta on AVX2 + FMA (kernels/lora.h): kernels/lora_avx512.cpp's register tiles at 8 lanes,
// sized for AVX2's 16 registers: the shrink 2 ranks x 4 rows, the expand 16 columns x 4 rows, each
// of A's and B^T's vectors loaded once per group of a adapter's rows. A row's sums never depend on its
// neighbours (its own accumulators; a short group repeats a row it does not store). Torch-free.
#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "lora.h"
#include "silu_avx2.h"

#define TM_LORA_AVX2 __attribute__((target("avx2,fma,f16c")))

namespace tokenmill::lora::avx2 {

namespace {

// n <= 8 lanes of float32 (zeros past n), from float32 or bf16; and stored back (bf16: rounded to
// nearest even as vcvtneps2bf16).
TM_LORA_AVX2 inline __m256 load8(const float* p, int64_t n) {
  if (n >= 8) return _mm256_loadu_ps(p);
  alignas(32) float tmp[8] = {};
  for (int64_t i = 0; i < n; ++i) tmp[i] = p[i];
  return _mm256_load_ps(tmp);
}
TM_LORA_AVX2 inline __m256 load8(const bf16* p, int64_t n) {
  return ::tokenmill::avx2::widen_bf16(::tokenmill::avx2::load_bf16(reinterpret_cast<const uint16_t*>(p), n));
}
TM_LORA_AVX2 inline void store8(float* p, __m256 v, int64_t n) {
  if (n >= 8) return _mm256_storeu_ps(p, v);
  alignas(32) float tmp[8];
  _mm256_store_ps(tmp, v);
  std::copy(tmp, tmp + n, p);
}
TM_LORA_AVX2 inline void store8(bf16* p, __m256 v, int64_t n) {
  ::tokenmill::avx2::store_bf16(reinterpret_cast<uint16_t*>(p), ::tokenmill::avx2::narrow_bf16(v), n);
}

TM_LORA_AVX2 inline float hsum(__m256 v) {  // (lanes 0-3 + 4-7), then pairs, then the two halves
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// tmp[rows[i], r] = A[r] . x[rows[i]] for the n <= GROUP rows of one adapter of rank R.
template <typename T, typename W>
TM_LORA_AVX2 void shrink_group(const T* xp, const int64_t* rows, int n, int64_t in, const W* a, int64_t R,
                               int64_t max_rank, float* tmp) {
  const T* xr[GROUP];
  for (int i = 0; i < GROUP; ++i) xr[i] = xp + rows[std::min(i, n - 1)] * in;  // short groups repeat a row
  for (int64_t r0 = 0; r0 < R; r0 += 2) {
    const int nr = static_cast<int>(std::min<int64_t>(2, R - r0));
    __m256 acc[2][GROUP];
    for (int q = 0; q < 2; ++q)
      for (int i = 0; i < GROUP; ++i) acc[q][i] = _mm256_setzero_ps();
    for (int64_t c = 0; c < in; c += 8) {
      const int64_t m = in - c;
      __m256 xv[GROUP];
      for (int i = 0; i < GROUP; ++i) xv[i] = load8(xr[i] + c, m);
      for (int q = 0; q < 2; ++q) {
        if (q >= nr) break;
        const __m256 av = load8(a + (r0 + q) * in + c, m);
        for (int i = 0; i < GROUP; ++i) acc[q][i] = _mm256_fmadd_ps(av, xv[i], acc[q][i]);
      }
    }
    for (int q = 0; q < nr; ++q)
      for (int i = 0; i < n; ++i) tmp[rows[i] * max_rank + r0 + q] = hsum(acc[q][i]);
  }
}

// y[rows[i], o0:o0+w] += tmp[rows[i], r_lo:r_hi] B^T[r_lo:r_hi, o0:o0+w] for n <= GROUP rows of one
// adapter, 16 columns (2 registers) at a time: each output is y, then + tmp[r] * B^T[r] for r in
// order (fused), one store.
template <typename T, typename W>
TM_LORA_AVX2 void expand_group(T* yp, const int64_t* rows, int n, int64_t out, const W* bt, int64_t r_lo,
                               int64_t r_hi, int64_t max_rank, const float* tmp, int64_t o0, int64_t w) {
  for (int64_t o = o0; o < o0 + w; o += 16) {
    const int64_t m[2] = {std::max<int64_t>(0, o0 + w - o), std::max<int64_t>(0, o0 + w - (o + 8))};
    __m256 acc[GROUP][2];
    for (int i = 0; i < n; ++i)
      for (int v = 0; v < 2; ++v) acc[i][v] = m[v] > 0 ? load8(yp + rows[i] * out + o + 8 * v, m[v]) : _mm256_setzero_ps();
    for (int64_t r = r_lo; r < r_hi; ++r) {
      __m256 bv[2];
      for (int v = 0; v < 2; ++v) bv[v] = m[v] > 0 ? load8(bt + r * out + o + 8 * v, m[v]) : _mm256_setzero_ps();
      for (int i = 0; i < GROUP; ++i) {
        if (i >= n) break;
        const __m256 t = _mm256_set1_ps(tmp[rows[i] * max_rank + r]);
        for (int v = 0; v < 2; ++v) acc[i][v] = _mm256_fmadd_ps(t, bv[v], acc[i][v]);
      }
    }
    for (int i = 0; i < n; ++i)
      for (int v = 0; v < 2; ++v)
        if (m[v] > 0) store8(yp + rows[i] * out + o + 8 * v, acc[i][v], m[v]);
  }
}

template <typename T, typename W>
TM_LORA_AVX2 void shrink_typed(const Delta& d, int64_t g0, int64_t g1) {
  const LoraLinear& lin = *d.lin;
  const W* const* ap = reinterpret_cast<const W* const*>(lin.ap.data());
  for (int64_t g = g0; g < g1; ++g) {
    const Group& gr = (*d.groups)[g];
    shrink_group(static_cast<const T*>(d.x), (*d.segments)[gr.s].data() + gr.first, gr.n, lin.in, ap[gr.s],
                 lin.rank[gr.s], lin.max_rank, d.tmp);
  }
}

template <typename T, typename W>
TM_LORA_AVX2 void expand_typed(const Delta& d, int64_t b0, int64_t b1) {
  const LoraLinear& lin = *d.lin;
  const W* const* bp = reinterpret_cast<const W* const*>(lin.bp.data());
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t o0 = b * COLS, w = std::min(COLS, lin.out - o0);
    for (const Group& gr : *d.groups)
      for (const Span& sp : lin.spans[gr.s]) {  // the span's part of the block, its ranks only
        const int64_t c0 = std::max(o0, sp.c0), c1 = std::min(o0 + w, sp.c1);
        if (c0 < c1 && sp.r0 < sp.r1)
          expand_group(static_cast<T*>(d.y), (*d.segments)[gr.s].data() + gr.first, gr.n, lin.out, bp[gr.s], sp.r0,
                       sp.r1, lin.max_rank, d.tmp, c0, c1 - c0);
      }
  }
}

}  // namespace

TM_LORA_AVX2 void shrink_groups(const Delta& d, int64_t g0, int64_t g1) {
  if (!d.xy_bf16) return shrink_typed<float, float>(d, g0, g1);
  if (d.lin->bf16) return shrink_typed<bf16, bf16>(d, g0, g1);
  shrink_typed<bf16, float>(d, g0, g1);
}

TM_LORA_AVX2 void expand_blocks(const Delta& d, int64_t b0, int64_t b1) {
  if (!d.xy_bf16) return expand_typed<float, float>(d, b0, b1);
  if (d.lin->bf16) return expand_typed<bf16, bf16>(d, b0, b1);
  expand_typed<bf16, float>(d, b0, b1);
}

}  // namespace tokenmill::lora::avx2
