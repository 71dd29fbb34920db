// The LoRA delta of one linear for every row of a step in one call (CPU):
//     y[t] += (A_s x[t]) B_s^T      for each row t on adapter s = slots[t] (-1: the base model)
// with A_s [R_s, in] and B_s^T [R_s, out] (the adapter's scale folded into B); an adapter that does
// not target the linear passes two empty tensors. x and y are float32 or both bf16, the pairs float32
// or (with bf16 rows) bf16, half the bytes a step reads: everything is widened on the fly, the delta
// summed in float32 and added to y's row in float32, rounded to bf16 once (PyTorch's bf16 products
// would round after each of the three ops). Registered as
// torch.ops.tokenmill.lora_add_ (engine/lora/batch.py; called from the C++ decode loop too,
// cpu_decode.cpp).
//
// Why: the PyTorch form costs four dispatched ops per adapter and linear (gather the adapter's rows,
// two thin products, scatter-add): with 4 adapters on SmolLM2-135M's 30 layers, ~2,000 ops a decode
// step, mostly dispatch. Here one call per linear does every adapter in two phases: each row's R_s
// shrink sums (dot products over `in`, contiguous) into a small buffer, then per block of output
// columns each row's R_s scaled rows of B^T added into y (blocks go to the threads, so a one-row
// decode uses them all, and a block of B^T stays in L1 across one adapter's rows). A base-model row
// costs nothing.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#define TM_LORA_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl")))

namespace {

// ---- AVX-512 (most x86 servers): rows of one adapter in groups of up to 4, register tiles ------------
// The portable loops below re-read an adapter's A and B^T for every row, ~15 GMAC/s on a 2-vCPU Xeon
// at 32 rows; here 4 rows of one adapter share each load: 16 accumulators (4 ranks or 64 columns x 4
// rows), each weight vector loaded once per group.

constexpr int64_t GROUP = 4;  // rows of one adapter per register tile

bool avx512() {
  static const bool ok = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl");
  }();
  return ok;
}

TM_LORA_AVX512 inline __m512 load16(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
TM_LORA_AVX512 inline __m512 load16(const at::BFloat16* p, __mmask16 m) {
  const __m256i h = _mm256_maskz_loadu_epi16(m, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
TM_LORA_AVX512 inline void store16(float* p, __m512 v, __mmask16 m) { _mm512_mask_storeu_ps(p, m, v); }
TM_LORA_AVX512 inline void store16(at::BFloat16* p, __m512 v, __mmask16 m) {  // round to nearest even (finite)
  __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  u = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), lsb));
  _mm256_mask_storeu_epi16(p, m, _mm512_cvtepi32_epi16(_mm512_srli_epi32(u, 16)));
}
inline __mmask16 tail(int64_t n) { return n >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << n) - 1); }

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

// y[rows[i], o0:o0+w] += tmp[rows[i], :R] B^T[:, o0:o0+w] for n <= GROUP rows of one adapter, 64 columns
// (4 registers) at a time: each output is y, then + tmp[r] * B^T[r] for r = 0..R-1 (fused), one store.
template <typename T, typename W>
TM_LORA_AVX512 void expand_group(T* yp, const int64_t* rows, int n, int64_t out, const W* bt, int64_t R,
                                 int64_t max_rank, const float* tmp, int64_t o0, int64_t w) {
  for (int64_t o = o0; o < o0 + w; o += 64) {
    __mmask16 m[4];
    for (int v = 0; v < 4; ++v) m[v] = tail(std::max<int64_t>(0, o0 + w - (o + 16 * v)));
    __m512 acc[GROUP][4];
    for (int i = 0; i < n; ++i)
      for (int v = 0; v < 4; ++v) acc[i][v] = load16(yp + rows[i] * out + o + 16 * v, m[v]);
    for (int64_t r = 0; r < R; ++r) {
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

// Every adapter's rows (segments[s]: row indices in order) in groups of GROUP: the shrink over groups,
// the expand over blocks of COLS_512 output columns, both spread over the threads.
template <typename T, typename W>
void delta_avx512(T* yp, const T* xp, int64_t in, int64_t out, const std::vector<std::vector<int64_t>>& segments,
                  const std::vector<const W*>& ap, const std::vector<const W*>& bp,
                  const std::vector<int64_t>& rank, int64_t max_rank, float* tmp) {
  struct Group { int64_t s, first; int n; };
  std::vector<Group> groups;
  int64_t adapted = 0;
  for (int64_t s = 0; s < static_cast<int64_t>(segments.size()); ++s) {
    if (rank[s] == 0) continue;
    const int64_t k = static_cast<int64_t>(segments[s].size());
    adapted += k;
    for (int64_t i = 0; i < k; i += GROUP) groups.push_back({s, i, static_cast<int>(std::min<int64_t>(GROUP, k - i))});
  }
  if (groups.empty()) return;
  const int64_t work = adapted * max_rank;  // multiply-adds per input or output column
  at::parallel_for(0, static_cast<int64_t>(groups.size()), std::max<int64_t>(1, (1 << 16) / std::max<int64_t>(1, work * in / static_cast<int64_t>(groups.size()))),
                   [&](int64_t g0, int64_t g1) {
                     for (int64_t g = g0; g < g1; ++g) {
                       const Group& gr = groups[g];
                       shrink_group(xp, segments[gr.s].data() + gr.first, gr.n, in, ap[gr.s], rank[gr.s], max_rank, tmp);
                     }
                   });
  constexpr int64_t COLS_512 = 128;
  const int64_t blocks = (out + COLS_512 - 1) / COLS_512;
  at::parallel_for(0, blocks, std::max<int64_t>(1, (1 << 15) / std::max<int64_t>(1, work * COLS_512)),
                   [&](int64_t b0, int64_t b1) {
                     for (int64_t b = b0; b < b1; ++b) {
                       const int64_t o0 = b * COLS_512, w = std::min(COLS_512, out - o0);
                       for (const Group& gr : groups)
                         expand_group(yp, segments[gr.s].data() + gr.first, gr.n, out, bp[gr.s], rank[gr.s], max_rank,
                                      tmp, o0, w);
                     }
                   });
}

// ---- portable loops (CPUs without AVX-512) ----------------------------------------------------------

constexpr int64_t COLS = 128;  // output columns per expand task: a rank-16 B^T tile of 8 KiB stays in L1
constexpr int64_t SHRINK_GRAIN = 8;  // rows per shrink task: fewer run inline (no parallel region)

// Phase 1, shrink: tmp[t, :R_s] = A_s x[t] for each adapted row, parallel over rows.
template <typename T, typename W>
void shrink(const T* xp, int64_t rows, int64_t in, const int64_t* slot, const std::vector<const W*>& ap,
            const std::vector<int64_t>& rank, int64_t max_rank, float* tmp) {
  at::parallel_for(0, rows, SHRINK_GRAIN, [&](int64_t t0, int64_t t1) {
    std::vector<float> xf(static_cast<size_t>(in));
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t s = slot[t];
      if (s < 0 || rank[s] == 0) continue;
      const T* __restrict xr = xp + t * in;
      float* __restrict xw = xf.data();
      for (int64_t c = 0; c < in; ++c) xw[c] = static_cast<float>(xr[c]);
      for (int64_t r = 0; r < rank[s]; ++r) {
        const W* __restrict ar = ap[s] + r * in;
        float acc = 0.f;
#pragma omp simd reduction(+ : acc)  // vectorised: the sum's order is the compiler's lanes, then theirs
        for (int64_t c = 0; c < in; ++c) acc += static_cast<float>(ar[c]) * xw[c];
        tmp[t * max_rank + r] = acc;
      }
    }
  });
}

// Phase 2, expand: y[t, cols] += tmp[t, :R_s] B_s^T[:, cols], parallel over blocks of COLS output
// columns (so one row's expand uses every thread too); within a block the rows in order, so a run of
// one adapter's rows reuses its B^T tile from L1. Each output element: y, then + tmp[r] * B^T[r] for
// r = 0..R_s-1 in float32, one store (bf16: one rounding).
template <typename T, typename W>
void expand(T* yp, int64_t rows, int64_t out, const int64_t* slot, const std::vector<const W*>& bp,
            const std::vector<int64_t>& rank, int64_t max_rank, const float* tmp) {
  const int64_t blocks = (out + COLS - 1) / COLS;
  // at least ~32k multiply-adds a task: below that the parallel region costs more than the work
  const int64_t grain = std::max<int64_t>(1, (1 << 15) / std::max<int64_t>(1, rows * max_rank * COLS));
  at::parallel_for(0, blocks, grain, [&](int64_t b0, int64_t b1) {
    alignas(64) float acc[COLS];
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t o0 = b * COLS, w = std::min(COLS, out - o0);
      for (int64_t t = 0; t < rows; ++t) {
        const int64_t s = slot[t];
        if (s < 0 || rank[s] == 0) continue;
        T* __restrict yr = yp + t * out + o0;
        for (int64_t o = 0; o < w; ++o) acc[o] = static_cast<float>(yr[o]);
        for (int64_t r = 0; r < rank[s]; ++r) {
          const float v = tmp[t * max_rank + r];
          const W* __restrict br = bp[s] + r * out + o0;
          for (int64_t o = 0; o < w; ++o) acc[o] += v * static_cast<float>(br[o]);
        }
        for (int64_t o = 0; o < w; ++o) yr[o] = static_cast<T>(acc[o]);
      }
    }
  });
}

template <typename T, typename W>
void delta_rows(T* yp, const T* xp, int64_t rows, int64_t in, int64_t out, const int64_t* slot,
                const std::vector<const W*>& ap, const std::vector<const W*>& bp,
                const std::vector<int64_t>& rank, int64_t max_rank) {
  std::vector<float> tmp(static_cast<size_t>(rows * max_rank));
  if (avx512()) {
    std::vector<std::vector<int64_t>> segments(ap.size());
    for (int64_t t = 0; t < rows; ++t)
      if (slot[t] >= 0) segments[slot[t]].push_back(t);
    delta_avx512(yp, xp, in, out, segments, ap, bp, rank, max_rank, tmp.data());
    return;
  }
  shrink(xp, rows, in, slot, ap, rank, max_rank, tmp.data());
  expand(yp, rows, out, slot, bp, rank, max_rank, tmp.data());
}

void lora_add_(at::Tensor& y, const at::Tensor& x, const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& bt,
               const at::Tensor& slots) {
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  TORCH_CHECK(x.device().is_cpu() && (bf16 || x.scalar_type() == at::kFloat) && x.dim() == 2 && x.is_contiguous(),
              "lora_add_: x must be a contiguous float32 or bf16 CPU matrix [T, in]");
  TORCH_CHECK(y.device().is_cpu() && y.scalar_type() == x.scalar_type() && y.dim() == 2 && y.is_contiguous() &&
                  y.size(0) == x.size(0),
              "lora_add_: y must be a contiguous CPU matrix [T, out] of x's dtype with x's rows");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.dim() == 1 && slots.numel() == x.size(0) && slots.is_contiguous(),
              "lora_add_: slots must be int64 [T]");
  TORCH_CHECK(a.size() == bt.size(), "lora_add_: one A and one B^T per adapter");
  const int64_t rows = x.size(0), in = x.size(1), out = y.size(1), n = static_cast<int64_t>(a.size());
  int64_t max_rank = 0;
  std::vector<int64_t> rank(n);
  c10::optional<at::ScalarType> wtype;  // the pairs' dtype: float32, or bf16 with bf16 rows
  for (int64_t s = 0; s < n; ++s) {
    if (a[s].numel() == 0 && bt[s].numel() == 0) continue;  // an adapter that does not target this linear
    const at::ScalarType st = a[s].scalar_type();
    TORCH_CHECK((st == at::kFloat || (bf16 && st == at::kBFloat16)) && (!wtype || *wtype == st) &&
                    bt[s].scalar_type() == st,
                "lora_add_: A and B^T must be float32 (or bf16 with bf16 rows), one dtype for every adapter");
    wtype = st;
    TORCH_CHECK(a[s].dim() == 2 && a[s].is_contiguous() && a[s].size(1) == in,
                "lora_add_: A must be contiguous [R, in]");
    TORCH_CHECK(bt[s].dim() == 2 && bt[s].is_contiguous() && bt[s].size(1) == out && bt[s].size(0) == a[s].size(0),
                "lora_add_: B^T must be contiguous [R, out] with A's rank");
    rank[s] = a[s].size(0);
    max_rank = std::max(max_rank, rank[s]);
  }
  const int64_t* slot = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < rows; ++t)
    TORCH_CHECK(slot[t] >= -1 && slot[t] < n, "lora_add_: slot ", slot[t], " of row ", t, " is out of range");
  if (!wtype) return;  // no adapter targets this linear
  auto run = [&](auto w_tag) {
    using W = decltype(w_tag);
    std::vector<const W*> ap(n), bp(n);
    for (int64_t s = 0; s < n; ++s) {
      if (rank[s] == 0) continue;
      ap[s] = a[s].data_ptr<W>();
      bp[s] = bt[s].data_ptr<W>();
    }
    if (bf16) {
      delta_rows(y.data_ptr<at::BFloat16>(), x.data_ptr<at::BFloat16>(), rows, in, out, slot, ap, bp, rank, max_rank);
    } else {
      delta_rows(y.data_ptr<float>(), x.data_ptr<float>(), rows, in, out, slot, ap, bp, rank, max_rank);
    }
  };
  if (*wtype == at::kBFloat16) {
    run(at::BFloat16());
  } else {
    run(float());
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tokenmill, m) {
  m.def("lora_add_(Tensor(a!) y, Tensor x, Tensor[] a, Tensor[] bt, Tensor slots) -> ()");
  m.impl("lora_add_", c10::DispatchKey::CPU, TORCH_FN(lora_add_));
}
