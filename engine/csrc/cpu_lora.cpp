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
// step, mostly dispatch. Here one call per linear does every adapter: rows go to the threads, each row
// computes its R_s shrink sums (dot products over `in`, contiguous) into a small buffer, then adds
// R_s scaled rows of B^T into y (contiguous over `out`). Rows of one adapter share its matrices in
// cache; a base-model row costs nothing.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstdint>
#include <vector>

namespace {

template <typename T>
void delta_rows(T* yp, const T* xp, int64_t rows, int64_t in, int64_t out, const int64_t* slot,
                const std::vector<const float*>& ap, const std::vector<const float*>& bp,
                const std::vector<int64_t>& rank, int64_t max_rank) {
  at::parallel_for(0, rows, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> tmp(static_cast<size_t>(max_rank)), xf(static_cast<size_t>(in)), yf(static_cast<size_t>(out));
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t s = slot[t];
      if (s < 0 || rank[s] == 0) continue;
      const T* __restrict xr = xp + t * in;
      float* __restrict xw = xf.data();
      for (int64_t c = 0; c < in; ++c) xw[c] = static_cast<float>(xr[c]);
      for (int64_t r = 0; r < rank[s]; ++r) {  // shrink: tmp = A_s x[t]
        const float* __restrict ar = ap[s] + r * in;
        float acc = 0.f;
#pragma omp simd reduction(+ : acc)  // vectorised: the sum's order is the compiler's lanes, then theirs
        for (int64_t c = 0; c < in; ++c) acc += ar[c] * xw[c];
        tmp[r] = acc;
      }
      T* __restrict yr = yp + t * out;
      float* __restrict yw = yf.data();
      for (int64_t o = 0; o < out; ++o) yw[o] = static_cast<float>(yr[o]);
      for (int64_t r = 0; r < rank[s]; ++r) {  // expand: y[t] += tmp B_s^T, one row of B^T at a time
        const float v = tmp[r];
        const float* __restrict br = bp[s] + r * out;
        for (int64_t o = 0; o < out; ++o) yw[o] += v * br[o];
      }
      for (int64_t o = 0; o < out; ++o) yr[o] = static_cast<T>(yw[o]);
    }
  });
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
