// The LoRA delta of one linear for every row of a step in one call (CPU):
//     y[t] += (A_s x[t]) B_s^T      for each row t on adapter s = slots[t] (-1: the base model)
// with A_s [R_s, in] and B_s^T [R_s, out] float32 (the adapter's scale folded into B); an adapter
// that does not target the linear passes two empty tensors. x and y are float32 or both bf16: a bf16
// row is widened on the fly, the delta summed in float32 and added to y's row in float32, rounded to
// bf16 once (PyTorch's bf16 products would round after each of the three ops). Registered as
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

#include <cstdint>
#include <vector>

namespace {

constexpr int64_t COLS = 128;  // output columns per expand task: a rank-16 B^T tile of 8 KiB stays in L1
constexpr int64_t SHRINK_GRAIN = 8;  // rows per shrink task: fewer run inline (no parallel region)

// Phase 1, shrink: tmp[t, :R_s] = A_s x[t] for each adapted row, parallel over rows.
template <typename T>
void shrink(const T* xp, int64_t rows, int64_t in, const int64_t* slot, const std::vector<const float*>& ap,
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
        const float* __restrict ar = ap[s] + r * in;
        float acc = 0.f;
#pragma omp simd reduction(+ : acc)  // vectorised: the sum's order is the compiler's lanes, then theirs
        for (int64_t c = 0; c < in; ++c) acc += ar[c] * xw[c];
        tmp[t * max_rank + r] = acc;
      }
    }
  });
}

// Phase 2, expand: y[t, cols] += tmp[t, :R_s] B_s^T[:, cols], parallel over blocks of COLS output
// columns (so one row's expand uses every thread too); within a block the rows in order, so a run of
// one adapter's rows reuses its B^T tile from L1. Each output element: y, then + tmp[r] * B^T[r] for
// r = 0..R_s-1 in float32, one store (bf16: one rounding).
template <typename T>
void expand(T* yp, int64_t rows, int64_t out, const int64_t* slot, const std::vector<const float*>& bp,
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
          const float* __restrict br = bp[s] + r * out + o0;
          for (int64_t o = 0; o < w; ++o) acc[o] += v * br[o];
        }
        for (int64_t o = 0; o < w; ++o) yr[o] = static_cast<T>(acc[o]);
      }
    }
  });
}

template <typename T>
void delta_rows(T* yp, const T* xp, int64_t rows, int64_t in, int64_t out, const int64_t* slot,
                const std::vector<const float*>& ap, const std::vector<const float*>& bp,
                const std::vector<int64_t>& rank, int64_t max_rank) {
  std::vector<float> tmp(static_cast<size_t>(rows * max_rank));
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
  for (int64_t s = 0; s < n; ++s) {
    if (a[s].numel() == 0 && bt[s].numel() == 0) continue;  // an adapter that does not target this linear
    TORCH_CHECK(a[s].scalar_type() == at::kFloat && a[s].dim() == 2 && a[s].is_contiguous() && a[s].size(1) == in,
                "lora_add_: A must be contiguous float32 [R, in]");
    TORCH_CHECK(bt[s].scalar_type() == at::kFloat && bt[s].dim() == 2 && bt[s].is_contiguous() &&
                    bt[s].size(1) == out && bt[s].size(0) == a[s].size(0),
                "lora_add_: B^T must be contiguous float32 [R, out] with A's rank");
    rank[s] = a[s].size(0);
    max_rank = std::max(max_rank, rank[s]);
  }
  const int64_t* slot = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < rows; ++t)
    TORCH_CHECK(slot[t] >= -1 && slot[t] < n, "lora_add_: slot ", slot[t], " of row ", t, " is out of range");
  std::vector<const float*> ap(n), bp(n);
  for (int64_t s = 0; s < n; ++s) {
    if (rank[s] == 0) continue;
    ap[s] = a[s].data_ptr<float>();
    bp[s] = bt[s].data_ptr<float>();
  }
  if (bf16) {
    delta_rows(y.data_ptr<at::BFloat16>(), x.data_ptr<at::BFloat16>(), rows, in, out, slot, ap, bp, rank, max_rank);
  } else {
    delta_rows(y.data_ptr<float>(), x.data_ptr<float>(), rows, in, out, slot, ap, bp, rank, max_rank);
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tokenmill, m) {
  m.def("lora_add_(Tensor(a!) y, Tensor x, Tensor[] a, Tensor[] bt, Tensor slots) -> ()");
  m.impl("lora_add_", c10::DispatchKey::CPU, TORCH_FN(lora_add_));
}
