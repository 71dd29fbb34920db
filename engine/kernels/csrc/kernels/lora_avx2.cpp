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

// The tiles keep their 8 accumulators in named variables and are functions of their own (noinline):
// GCC 12 spills an accumulator array that lives across a loop (kernels/gemv_avx2.cpp met the same).

// tmp[rows[i], r] = A[r] . x[rows[i]] for the n <= GROUP rows of one adapter of rank R: two ranks x
// four rows at a time (s<rank><row>); a short group repeats its last row and an odd rank its last
// rank, whose sums are not stored.
template <typename T, typename W>
TM_LORA_AVX2 __attribute__((noinline)) void shrink_group(const T* xp, const int64_t* rows, int n, int64_t in,
                                                        const W* a, int64_t R, int64_t max_rank, float* tmp) {
  static_assert(GROUP == 4, "written out for groups of 4 rows");
  const T* x0 = xp + rows[0] * in;
  const T* x1 = xp + rows[std::min(1, n - 1)] * in;
  const T* x2 = xp + rows[std::min(2, n - 1)] * in;
  const T* x3 = xp + rows[std::min(3, n - 1)] * in;
  for (int64_t r0 = 0; r0 < R; r0 += 2) {
    const bool two = r0 + 1 < R;
    const W* a0 = a + r0 * in;
    const W* a1 = two ? a0 + in : a0;
    const __m256 z = _mm256_setzero_ps();
    __m256 s00 = z, s01 = z, s02 = z, s03 = z, s10 = z, s11 = z, s12 = z, s13 = z;
    for (int64_t c = 0; c < in; c += 8) {
      const int64_t m = in - c;
      const __m256 v0 = load8(x0 + c, m), v1 = load8(x1 + c, m), v2 = load8(x2 + c, m), v3 = load8(x3 + c, m);
      const __m256 b0 = load8(a0 + c, m);
      s00 = _mm256_fmadd_ps(b0, v0, s00), s01 = _mm256_fmadd_ps(b0, v1, s01);
      s02 = _mm256_fmadd_ps(b0, v2, s02), s03 = _mm256_fmadd_ps(b0, v3, s03);
      const __m256 b1 = load8(a1 + c, m);
      s10 = _mm256_fmadd_ps(b1, v0, s10), s11 = _mm256_fmadd_ps(b1, v1, s11);
      s12 = _mm256_fmadd_ps(b1, v2, s12), s13 = _mm256_fmadd_ps(b1, v3, s13);
    }
    const float first[GROUP] = {hsum(s00), hsum(s01), hsum(s02), hsum(s03)};
    const float second[GROUP] = {hsum(s10), hsum(s11), hsum(s12), hsum(s13)};
    for (int i = 0; i < n; ++i) {
      tmp[rows[i] * max_rank + r0] = first[i];
      if (two) tmp[rows[i] * max_rank + r0 + 1] = second[i];
    }
  }
}

// y[rows[i], o0:o0+w] += tmp[rows[i], r_lo:r_hi] B^T[r_lo:r_hi, o0:o0+w] for n <= GROUP rows of one
// adapter, 16 columns (two registers: y<row><half>) at a time: each output is y, then + tmp[r] *
// B^T[r] for r in order (fused), one store. A short group repeats its last row, never stored.
template <typename T, typename W>
TM_LORA_AVX2 __attribute__((noinline)) void expand_group(T* yp, const int64_t* rows, int n, int64_t out, const W* bt,
                                                        int64_t r_lo, int64_t r_hi, int64_t max_rank, const float* tmp,
                                                        int64_t o0, int64_t w) {
  static_assert(GROUP == 4, "written out for groups of 4 rows");
  const int64_t row[GROUP] = {rows[0], rows[std::min(1, n - 1)], rows[std::min(2, n - 1)], rows[std::min(3, n - 1)]};
  const float* t0 = tmp + row[0] * max_rank;
  const float* t1 = tmp + row[1] * max_rank;
  const float* t2 = tmp + row[2] * max_rank;
  const float* t3 = tmp + row[3] * max_rank;
  for (int64_t o = o0; o < o0 + w; o += 16) {
    const int64_t m0 = o0 + w - o, m1 = std::max<int64_t>(0, m0 - 8);  // valid columns of each half
    T* const yr[GROUP] = {yp + row[0] * out + o, yp + row[1] * out + o, yp + row[2] * out + o, yp + row[3] * out + o};
    __m256 y00 = load8(yr[0], m0), y10 = load8(yr[1], m0), y20 = load8(yr[2], m0), y30 = load8(yr[3], m0);
    const __m256 z = _mm256_setzero_ps();
    __m256 y01 = m1 ? load8(yr[0] + 8, m1) : z, y11 = m1 ? load8(yr[1] + 8, m1) : z;
    __m256 y21 = m1 ? load8(yr[2] + 8, m1) : z, y31 = m1 ? load8(yr[3] + 8, m1) : z;
    for (int64_t r = r_lo; r < r_hi; ++r) {
      const W* br = bt + r * out + o;
      const __m256 b0 = load8(br, m0), b1 = m1 ? load8(br + 8, m1) : z;
      __m256 t = _mm256_set1_ps(t0[r]);
      y00 = _mm256_fmadd_ps(t, b0, y00), y01 = _mm256_fmadd_ps(t, b1, y01);
      t = _mm256_set1_ps(t1[r]);
      y10 = _mm256_fmadd_ps(t, b0, y10), y11 = _mm256_fmadd_ps(t, b1, y11);
      t = _mm256_set1_ps(t2[r]);
      y20 = _mm256_fmadd_ps(t, b0, y20), y21 = _mm256_fmadd_ps(t, b1, y21);
      t = _mm256_set1_ps(t3[r]);
      y30 = _mm256_fmadd_ps(t, b0, y30), y31 = _mm256_fmadd_ps(t, b1, y31);
    }
    const __m256 out0[GROUP] = {y00, y10, y20, y30}, out1[GROUP] = {y01, y11, y21, y31};
    for (int i = 0; i < n; ++i) {
      store8(yr[i], out0[i], m0);
      if (m1) store8(yr[i] + 8, out1[i], m1);
    }
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
