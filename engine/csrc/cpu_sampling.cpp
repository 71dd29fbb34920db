// Sampling whole rows of logits on the CPU: the argmax for greedy rows, an inverse-CDF draw from
// softmax(logits / T) for the others. Registered as torch.ops.tokenmill.sample_rows.
//
// Why: in PyTorch a sampled step is a float32 upcast, a division, a softmax, a cumsum and a search over
// [rows, vocab], five full passes and four [rows, vocab] temporaries: about 10 ms a step at 32 rows of
// a 49k vocabulary on one core, a sixth of the step. Here a row is two passes: one exponentiates and
// sums into a row-sized scratch buffer (hot in L2), one walks that buffer in 64-entry chunks to the
// chunk holding u x total and scans it. Rows are independent work items, so a row's draw does not
// depend on the other rows of the batch (what the seeded-request guarantee needs).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "widen.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <tuple>
#include <vector>

namespace {

using tokenmill::exp_nonpositive;
using tokenmill::to_float;

constexpr int64_t CHUNK = 64;  // entries summed at once by the search pass

// Greedy: the first index of the row's maximum (as torch.argmax) and that maximum; a NaN anywhere
// makes the score NaN (the caller fails the row).
template <typename T>
std::pair<int64_t, float> argmax_row(const T* row, int64_t V) {
  float best = -std::numeric_limits<float>::infinity();
  int nan = 0;
#pragma omp simd reduction(max : best) reduction(| : nan)
  for (int64_t i = 0; i < V; ++i) {  // two vectorised passes beat one scalar pass tracking the index
    const float x = to_float(row[i]);
    nan |= x != x;
    best = x > best ? x : best;
  }
  int64_t at = 0;
  while (at < V - 1 && !(to_float(row[at]) == best)) ++at;
  return {at, nan ? std::numeric_limits<float>::quiet_NaN() : best};
}

// Sampled: e[i] = exp((row[i] - max) / T) into buf; the first index whose running sum of e exceeds
// u x sum(e), and its probability e / sum. Zero-probability entries are never drawn: the running sum
// only passes the target at an entry that adds to it. Non-finite rows give probability NaN.
template <typename T>
std::pair<int64_t, float> draw_row(const T* row, int64_t V, float inv_t, float u, float* buf) {
  float mx = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : mx)
  for (int64_t i = 0; i < V; ++i) {
    const float x = to_float(row[i]);
    mx = x > mx ? x : mx;  // NaN entries are skipped here and caught by the sum below
  }
  double lanes = 0;  // float64: a float32 sum over 49k entries is off by ~1e-5 of the mass
#pragma omp simd reduction(+ : lanes)
  for (int64_t i = 0; i < V; ++i) {
    buf[i] = exp_nonpositive((to_float(row[i]) - mx) * inv_t);  // NaN or inf logits: NaN here
    lanes += buf[i];
  }
  const double total = lanes;
  if (!std::isfinite(total) || !(total > 0)) return {0, std::numeric_limits<float>::quiet_NaN()};
  const double target = static_cast<double>(u) * total;
  double run = 0;
  int64_t last = -1;  // the last entry with mass seen so far: the answer if rounding overshoots
  for (int64_t c = 0; c < V; c += CHUNK) {
    const int64_t end = std::min(V, c + CHUNK);
    float s = 0.f;
#pragma omp simd reduction(+ : s)
    for (int64_t i = c; i < end; ++i) s += buf[i];
    if (run + s <= target) {
      run += s;
      if (s > 0)
        for (int64_t i = end - 1; i >= c; --i)
          if (buf[i] > 0) { last = i; break; }
      continue;
    }
    for (int64_t i = c; i < end; ++i) {
      run += buf[i];
      if (buf[i] > 0) last = i;
      if (run > target) return {i, static_cast<float>(buf[i] / total)};
    }
  }
  return {last, static_cast<float>(buf[last] / total)};  // u x total rounded past the running sum
}

template <typename T>
void sample_impl(const at::Tensor& logits, const float* inv_t, const float* u, int64_t* tok, float* score) {
  const int64_t V = logits.size(1);
  const T* lp = logits.data_ptr<T>();
  const int64_t stride = logits.stride(0);
  at::parallel_for(0, logits.size(0), 1, [&](int64_t begin, int64_t end) {
    std::vector<float> buf(V);
    for (int64_t r = begin; r < end; ++r) {
      const auto [i, s] = inv_t[r] == 0.f ? argmax_row(lp + r * stride, V) : draw_row(lp + r * stride, V, inv_t[r], u[r], buf.data());
      tok[r] = i;
      score[r] = s;
    }
  });
}

// logits: [n, vocab] float32 or bfloat16, vocab contiguous. inv_temperature: float32 [n], 0 for a
// greedy row. u: float32 [n] in [0, 1), ignored for greedy rows. Returns int64 tokens [n] and float32
// scores [n]: a greedy row's maximum logit, a sampled row's probability of its token (NaN where the
// row is not finite).
std::tuple<at::Tensor, at::Tensor> sample_rows(const at::Tensor& logits, const at::Tensor& inv_temperature,
                                               const at::Tensor& u) {
  TORCH_CHECK(logits.device().is_cpu() && logits.dim() == 2 && logits.stride(1) == 1 && logits.size(1) > 0,
              "sample_rows: logits must be a CPU [n, vocab] tensor with contiguous rows");
  TORCH_CHECK(logits.scalar_type() == at::kFloat || logits.scalar_type() == at::kBFloat16,
              "sample_rows: float32 or bfloat16 logits");
  const int64_t n = logits.size(0);
  for (const at::Tensor* t : {&inv_temperature, &u})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->dim() == 1 && t->size(0) == n && t->is_contiguous(),
                "sample_rows: inv_temperature and u must be contiguous float32 [n]");
  auto tokens = at::empty({n}, logits.options().dtype(at::kLong));
  auto scores = at::empty({n}, logits.options().dtype(at::kFloat));
  const float* it = inv_temperature.data_ptr<float>();
  const float* up = u.data_ptr<float>();
  if (logits.scalar_type() == at::kFloat)
    sample_impl<float>(logits, it, up, tokens.data_ptr<int64_t>(), scores.data_ptr<float>());
  else
    sample_impl<c10::BFloat16>(logits, it, up, tokens.data_ptr<int64_t>(), scores.data_ptr<float>());
  return {tokens, scores};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tokenmill, m) {
  m.def("sample_rows(Tensor logits, Tensor inv_temperature, Tensor u) -> (Tensor, Tensor)");
  m.impl("sample_rows", c10::DispatchKey::CPU, TORCH_FN(sample_rows));
}
