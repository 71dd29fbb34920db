// The LoRA delta on AVX-512 (kernels/lora.h): rows of one adapter in groups of up to GROUP (4),
// register tiles: 16 accumulators (4 ranks or 64 columns x 4 rows), each of A's and B^T's vectors
// loaded once per group (the portable loops re-read them for every row: ~15 GMAC/s on a 2-vCPU Xeon at
// 32 rows). A row's sums never depend on its neighbours: each row has its own accumulators, and a short
// group repeats a row it does not store. Torch-free.
#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "bf16_avx512.h"
#include "lora.h"

#define TM_LORA_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl")))

namespace tokenmill::lora::avx512 {

namespace {

using namespace ::tokenmill::avx512;  // rne16, widen16, load16, store16, tail

// tmp[rows[i], r] = A[r] . x[rows[i]] for the n <= GROUP rows of one adapter of rank R.
template <typename T, typename W>
TM_LORA_AVX512 void shrink_group(const T* xp, const int64_t* rows, int n, int64_t in, const W* a, int64_t R,
                                 int64_t max_rank, float* tmp) {
  const T* xr[GROUP];
  for (int i = 0; i < GROUP; ++i) xr[i] = xp + rows[std::min(i, n - 1)] * in;  // short groups repeat a row
  for (int64_t r0 = 0; r0 < R; r0 += 4) {
    const int nr = static_cast<int>(std::min<int64_t>(4, R - r0));
    __m512 acc[4][GROUP];
    for (int q = 0; q < 4; ++q)
      for (int i = 0; i < GROUP; ++i) acc[q][i] = _mm512_setzero_ps();
    for (int64_t c = 0; c < in; c += 16) {
      const __mmask16 m = tail(in - c);
      __m512 xv[GROUP];
      for (int i = 0; i < GROUP; ++i) xv[i] = load16(xr[i] + c, m);
      for (int q = 0; q < 4; ++q) {
        if (q >= nr) break;
        const __m512 av = load16(a + (r0 + q) * in + c, m);
        for (int i = 0; i < GROUP; ++i) acc[q][i] = _mm512_fmadd_ps(av, xv[i], acc[q][i]);
      }
    }
    for (int q = 0; q < nr; ++q)
      for (int i = 0; i < n; ++i) tmp[rows[i] * max_rank + r0 + q] = _mm512_reduce_add_ps(acc[q][i]);
  }
}

// y[rows[i], o0:o0+w] += tmp[rows[i], r_lo:r_hi] B^T[r_lo:r_hi, o0:o0+w] for n <= GROUP rows of one
// adapter, 64 columns (4 registers) at a time: each output is y, then + tmp[r] * B^T[r] for r in
// order (fused), one store.
template <typename T, typename W>
TM_LORA_AVX512 void expand_group(T* yp, const int64_t* rows, int n, int64_t out, const W* bt, int64_t r_lo,
                                 int64_t r_hi, int64_t max_rank, const float* tmp, int64_t o0, int64_t w) {
  for (int64_t o = o0; o < o0 + w; o += 64) {
    __mmask16 m[4];
    for (int v = 0; v < 4; ++v) m[v] = tail(std::max<int64_t>(0, o0 + w - (o + 16 * v)));
    __m512 acc[GROUP][4];
    for (int i = 0; i < n; ++i)
      for (int v = 0; v < 4; ++v) acc[i][v] = load16(yp + rows[i] * out + o + 16 * v, m[v]);
    for (int64_t r = r_lo; r < r_hi; ++r) {
      __m512 bv[4];
      for (int v = 0; v < 4; ++v) bv[v] = load16(bt + r * out + o + 16 * v, m[v]);
      for (int i = 0; i < GROUP; ++i) {
        if (i >= n) break;
        const __m512 t = _mm512_set1_ps(tmp[rows[i] * max_rank + r]);
        for (int v = 0; v < 4; ++v) acc[i][v] = _mm512_fmadd_ps(t, bv[v], acc[i][v]);
      }
    }
    for (int i = 0; i < n; ++i)
      for (int v = 0; v < 4; ++v) store16(yp + rows[i] * out + o + 16 * v, acc[i][v], m[v]);
  }
}

template <typename T, typename W>
TM_LORA_AVX512 void shrink_typed(const Delta& d, int64_t g0, int64_t g1) {
  const LoraLinear& lin = *d.lin;
  const W* const* ap = reinterpret_cast<const W* const*>(lin.ap.data());
  for (int64_t g = g0; g < g1; ++g) {
    const Group& gr = (*d.groups)[g];
    shrink_group(static_cast<const T*>(d.x), (*d.segments)[gr.s].data() + gr.first, gr.n, lin.in, ap[gr.s],
                 lin.rank[gr.s], lin.max_rank, d.tmp);
  }
}

template <typename T, typename W>
TM_LORA_AVX512 void expand_typed(const Delta& d, int64_t b0, int64_t b1) {
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

// x and y float32 with float32 pairs, or bf16 with bf16 or float32 pairs.
TM_LORA_AVX512 void shrink_groups(const Delta& d, int64_t g0, int64_t g1) {
  if (!d.xy_bf16) return shrink_typed<float, float>(d, g0, g1);
  if (d.lin->bf16) return shrink_typed<bf16, bf16>(d, g0, g1);
  shrink_typed<bf16, float>(d, g0, g1);
}

TM_LORA_AVX512 void expand_blocks(const Delta& d, int64_t b0, int64_t b1) {
  if (!d.xy_bf16) return expand_typed<float, float>(d, b0, b1);
  if (d.lin->bf16) return expand_typed<bf16, bf16>(d, b0, b1);
  expand_typed<bf16, float>(d, b0, b1);
}

}  // namespace tokenmill::lora::avx512
