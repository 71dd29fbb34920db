// Sampling whole rows of logits on the CPU: the argmax for greedy rows, an inverse-CDF draw from
// softmax(logits / T) for the others. Registered as torch.ops.tokenmill.sample_rows.
//
// Why: in PyTorch a sampled step is a float32 upcast, a division, a softmax, a cumsum and a search over
// [rows, vocab], five full passes and four [rows, vocab] temporaries: about 10 ms a step at 32 rows of
// a 49k vocabulary on one core, a sixth of the step. Here a row is two passes: one exponentiates and
// sums into a row-sized scratch buffer (hot in L2), one walks that buffer in 64-entry chunks to the
// chunk holding u x total and scans it. Rows are independent work items, so a row's draw does not
// depend on the other rows of the batch (what the seeded-request guarantee needs). The arithmetic is
// kernels/sampling_body.inc, for each path (isa.h).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "isa.h"
#include "kernels/sampling.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <tuple>
#include <vector>

namespace {

using tokenmill::Isa;

// The path of this process's sampling: AVX-512, AVX2, or portable (isa.h).
Isa path() { return tokenmill::vector_isa(); }

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
  const tokenmill::sampling::Call c{logits.data_ptr(), logits.stride(0), logits.size(1),
                                    logits.scalar_type() == at::kBFloat16, it, up, tokens.data_ptr<int64_t>(),
                                    scores.data_ptr<float>()};
  const Isa p = path();
  at::parallel_for(0, n, 1, [&](int64_t r0, int64_t r1) {
    if (p == Isa::Avx512) {
      tokenmill::sampling::avx512::rows(c, r0, r1);
    } else if (p == Isa::Avx2) {
      tokenmill::sampling::avx2::rows(c, r0, r1);
    } else {
      tokenmill::sampling::portable::rows(c, r0, r1);
    }
  });
  return {tokens, scores};
}

std::string sampling_path() { return tokenmill::isa_name(path()); }

}  // namespace

TORCH_LIBRARY_FRAGMENT(tokenmill, m) {
  m.def("sample_rows(Tensor logits, Tensor inv_temperature, Tensor u) -> (Tensor, Tensor)");
  m.impl("sample_rows", c10::DispatchKey::CPU, TORCH_FN(sample_rows));
  m.def("sampling_path() -> str", &sampling_path);
}
