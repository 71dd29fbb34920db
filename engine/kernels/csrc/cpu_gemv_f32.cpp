// Skinny float32 matrix products for CPUs with AVX2 and FMA (a Zen 3, say, where the engine serves
// in float32): y = x W^T + b for a few rows of x, W streamed from memory once per call.
//
// Why: MKL's sgemm re-reads (packs) the weight for each call, and with a handful of rows that costs
// more than the product. Measured on a 2-vCPU AMD EPYC (Zen 3), SmolLM2-135M's linears with cold
// weights: one decode step's products take 77 ms at 1 row and 140-170 ms at 2-5 rows, so a
// speculative verification step of 1 + k rows, or a second decoding request, doubles the step. This
// kernel reads each weight once whatever the row count, so 1-8 rows cost about what one row does.
//
// Packed layout: W [N, K] becomes [Nb, K, 8] with Nb = ceil(N / 8) rounded up to a multiple of GB (4),
// zero padded: block b holds output rows 8b..8b+7, and for each input column c its 8 weights lie side
// by side (one ymm register). A group of GB blocks (32 outputs) is one contiguous stream; a tile of up
// to 6 rows of x takes each weight vector once while x's columns are broadcast (more rows: tiles of 6
// re-read the group from L2). Each output is a float32 chain
// over the input columns in order (one accumulator lane per output, fused multiply-adds).
//
// Registered in torch.ops.tokenmill: gemv_f32_supported(), gemv_pack_f32(w) and gemv_f32(x, packed, n,
// k, bias). The AVX2 code is kernels/gemv_f32_avx2.cpp, run only where isa.h says this CPU has it.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "isa.h"
#include "kernels/gemv_f32.h"

namespace {

using tokenmill::gemv_f32::blocks;
using tokenmill::gemv_f32::GB;
using tokenmill::gemv_f32::LANES;

bool supported() { return tokenmill::cpu().avx2; }

void run(const float* x, int64_t m, int64_t k, const float* packed, int64_t n, const float* bias, float* out) {
  at::parallel_for(0, blocks(n) / GB, 1, [&](int64_t g0, int64_t g1) {
    tokenmill::gemv_f32::avx2::run_groups(x, m, k, packed, n, bias, out, g0, g1);
  });
}

bool gemv_f32_supported() { return supported(); }

at::Tensor gemv_pack_f32(const at::Tensor& w) {
  TORCH_CHECK(w.scalar_type() == at::kFloat && w.dim() == 2 && w.device().is_cpu(),
              "gemv_pack_f32: weight must be a float32 CPU matrix [N, K]");
  const at::Tensor wc = w.contiguous();
  const int64_t n = wc.size(0), k = wc.size(1), nb = blocks(n);
  auto out = at::zeros({nb, k, LANES}, wc.options());
  const float* src = wc.data_ptr<float>();
  float* dst = out.data_ptr<float>();
  at::parallel_for(0, n, LANES, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t c = 0; c < k; ++c) dst[((r / LANES) * k + c) * LANES + r % LANES] = src[r * k + c];
  });
  return out;
}

at::Tensor gemv_f32(const at::Tensor& x, const at::Tensor& packed, int64_t n, int64_t k,
                    const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(supported(), "gemv_f32: this CPU lacks AVX2/FMA");
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() >= 1 && x.size(-1) == k,
              "gemv_f32: x must be a float32 CPU tensor [..., K]");
  TORCH_CHECK(packed.scalar_type() == at::kFloat && packed.is_contiguous() && packed.dim() == 3 &&
                  packed.size(0) == blocks(n) && packed.size(1) == k && packed.size(2) == LANES,
              "gemv_f32: the packed weight does not match N, K");
  at::Tensor bias_c;
  if (bias.has_value()) {
    TORCH_CHECK(bias->numel() == n, "gemv_f32: bias must have N elements");
    bias_c = bias->to(at::kFloat).contiguous();
  }
  const at::Tensor x2d = x.reshape({-1, k}).contiguous();
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = n;
  auto out = at::empty(shape, x.options());
  if (x2d.size(0) == 0) return out;
  run(x2d.data_ptr<float>(), x2d.size(0), k, packed.data_ptr<float>(), n,
      bias.has_value() ? bias_c.data_ptr<float>() : nullptr, out.data_ptr<float>());
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tokenmill, m) {
  m.def("gemv_f32_supported() -> bool");
  m.def("gemv_pack_f32(Tensor w) -> Tensor");
  m.def("gemv_f32(Tensor x, Tensor packed, int n, int k, Tensor? bias) -> Tensor");
  m.impl("gemv_f32_supported", c10::DispatchKey::CatchAll, TORCH_FN(gemv_f32_supported));
  m.impl("gemv_pack_f32", c10::DispatchKey::CPU, TORCH_FN(gemv_pack_f32));
  m.impl("gemv_f32", c10::DispatchKey::CPU, TORCH_FN(gemv_f32));
}
