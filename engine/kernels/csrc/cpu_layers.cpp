// Fused elementwise kernels for the decoder layers on the CPU: RMSNorm (with the residual add
// folded in) and rotary embedding in place. Each replaces a chain of 4-8 small PyTorch ops (an
// allocation and a pass over memory each) with one pass. They round where transformers' modules
// round, so only summation order can differ (the RMS mean): in float32 that leaves greedy output
// unchanged in the parity suite. Registered in torch.ops.tokenmill; the arithmetic is
// kernels/layers_body.inc, for each path (isa.h).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "isa.h"
#include "kernels/layers.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

using tokenmill::Isa;

// The path of this process's layer kernels: AVX-512, AVX2, or portable (isa.h).
Isa path() { return tokenmill::vector_isa(); }

void norm_rows(const tokenmill::layers::Norm& c, int64_t r0, int64_t r1) {
  const Isa p = path();
  if (p == Isa::Avx512) return tokenmill::layers::avx512::norm_rows(c, r0, r1);
  if (p == Isa::Avx2) return tokenmill::layers::avx2::norm_rows(c, r0, r1);
  tokenmill::layers::portable::norm_rows(c, r0, r1);
}

void rotary_tokens(const tokenmill::layers::Rotary& c, int64_t t0, int64_t t1) {
  const Isa p = path();
  if (p == Isa::Avx512) return tokenmill::layers::avx512::rotary_tokens(c, t0, t1);
  if (p == Isa::Avx2) return tokenmill::layers::avx2::rotary_tokens(c, t0, t1);
  tokenmill::layers::portable::rotary_tokens(c, t0, t1);
}

void norm_impl(const at::Tensor& x, at::Tensor* residual, const at::Tensor& w, at::Tensor& out, double eps) {
  const int64_t n = x.size(-1), rows = x.numel() / n;
  const tokenmill::layers::Norm c{x.data_ptr(), residual ? residual->data_ptr() : nullptr, w.data_ptr(), out.data_ptr(),
                                  n, static_cast<float>(eps), x.scalar_type() == at::kBFloat16};
  at::parallel_for(0, rows, 4, [&](int64_t r0, int64_t r1) { norm_rows(c, r0, r1); });
}

void check_norm(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(x.device().is_cpu() && x.is_contiguous(), "rms_norm: x must be a contiguous CPU tensor");
  TORCH_CHECK(w.dim() == 1 && w.is_contiguous() && w.size(0) == x.size(-1), "rms_norm: weight must be [hidden]");
  TORCH_CHECK(w.scalar_type() == x.scalar_type(), "rms_norm: weight and x must share a dtype");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "rms_norm: float32 or bfloat16");
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_norm(x, weight);
  auto out = at::empty_like(x);
  norm_impl(x, nullptr, weight, out, eps);
  return out;
}

at::Tensor add_rms_norm(const at::Tensor& x, at::Tensor& residual, const at::Tensor& weight, double eps) {
  // residual += x in place; returns rms_norm(residual) * weight.
  check_norm(x, weight);
  TORCH_CHECK(residual.is_contiguous() && residual.sizes() == x.sizes() && residual.scalar_type() == x.scalar_type(),
              "add_rms_norm: residual must be contiguous and shaped and typed like x");
  auto out = at::empty_like(x);
  norm_impl(x, &residual, weight, out, eps);
  return out;
}

void rotary_inplace(at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  // x: [T, heads, D], head_dim contiguous; cos, sin: [T, D] (any leading shape of T * D elements).
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 3 && x.stride(2) == 1 && x.size(2) % 2 == 0,
              "rotary: x must be [T, heads, D] with contiguous, even D");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.numel() == x.size(0) * x.size(2) &&
                  sin.numel() == cos.numel(),
              "rotary: cos and sin must be contiguous [T, D]");
  TORCH_CHECK(cos.scalar_type() == x.scalar_type() && sin.scalar_type() == x.scalar_type(),
              "rotary: cos, sin and x must share a dtype");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "rotary: float32 or bfloat16 only");
  const tokenmill::layers::Rotary c{x.data_ptr(), cos.data_ptr(), sin.data_ptr(), x.size(1), x.size(2), x.stride(0),
                                    x.stride(1), x.scalar_type() == at::kBFloat16};
  at::parallel_for(0, x.size(0), 8, [&](int64_t t0, int64_t t1) { rotary_tokens(c, t0, t1); });
}

std::string layers_path() { return tokenmill::isa_name(path()); }

}  // namespace

TORCH_LIBRARY_FRAGMENT(tokenmill, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor(a!) residual, Tensor weight, float eps) -> Tensor");
  m.def("rotary_inplace(Tensor(a!) x, Tensor cos, Tensor sin) -> ()");
  m.def("layers_path() -> str", &layers_path);
  m.impl("rms_norm", c10::DispatchKey::CPU, TORCH_FN(rms_norm));
  m.impl("add_rms_norm", c10::DispatchKey::CPU, TORCH_FN(add_rms_norm));
  m.impl("rotary_inplace", c10::DispatchKey::CPU, TORCH_FN(rotary_inplace));
}
