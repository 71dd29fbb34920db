// Fused elementwise kernels for the decoder layers on the CPU: RMSNorm (with the residual add
// folded in) and rotary embedding in place. Each replaces a chain of 4-8 small PyTorch ops (an
// allocation and a pass over memory each) with one pass. They round where transformers' modules
// round, so only summation order can differ (the RMS mean): in float32 that leaves greedy output
// unchanged in the parity suite. Registered in torch.ops.tokenmill.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "widen.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

using tokenmill::to_float;
// Round a float to T (round to nearest even for bf16, as PyTorch does) and back.
template <typename T>
inline float round_to(float x) {
  return to_float(static_cast<T>(x));
}

// One row: out = w * T(x * rsqrt(mean(x^2) + eps)), as transformers' LlamaRMSNorm.
template <typename T>
inline void norm_row(const float* xf, const T* w, T* out, int64_t n, float eps) {
  float ss = 0.f;
#pragma omp simd reduction(+ : ss)
  for (int64_t i = 0; i < n; ++i) ss += xf[i] * xf[i];
  const float r = 1.f / std::sqrt(ss / static_cast<float>(n) + eps);
  for (int64_t i = 0; i < n; ++i) out[i] = static_cast<T>(to_float(w[i]) * round_to<T>(xf[i] * r));
}

template <typename T>
void norm_impl(const at::Tensor& x, at::Tensor* residual, const at::Tensor& w, at::Tensor& out, double eps) {
  const int64_t n = x.size(-1), rows = x.numel() / n;
  const T* xp = x.data_ptr<T>();
  T* rp = residual ? residual->data_ptr<T>() : nullptr;
  const T* wp = w.data_ptr<T>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, rows, 4, [&](int64_t begin, int64_t end) {
    std::vector<float> xf(n);
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = xp + r * n;
      if (rp) {  // residual += x (rounded to T, as a T addition), then normalise the sum
        T* rr = rp + r * n;
        for (int64_t i = 0; i < n; ++i) {
          const float s = round_to<T>(to_float(rr[i]) + to_float(xr[i]));
          rr[i] = static_cast<T>(s);
          xf[i] = s;
        }
      } else {
        for (int64_t i = 0; i < n; ++i) xf[i] = to_float(xr[i]);
      }
      norm_row<T>(xf.data(), wp, op + r * n, n, static_cast<float>(eps));
    }
  });
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
  if (x.scalar_type() == at::kFloat) {
    norm_impl<float>(x, nullptr, weight, out, eps);
  } else {
    norm_impl<c10::BFloat16>(x, nullptr, weight, out, eps);
  }
  return out;
}

at::Tensor add_rms_norm(const at::Tensor& x, at::Tensor& residual, const at::Tensor& weight, double eps) {
  // residual += x in place; returns rms_norm(residual) * weight.
  check_norm(x, weight);
  TORCH_CHECK(residual.is_contiguous() && residual.sizes() == x.sizes() && residual.scalar_type() == x.scalar_type(),
              "add_rms_norm: residual must be contiguous and shaped and typed like x");
  auto out = at::empty_like(x);
  if (x.scalar_type() == at::kFloat) {
    norm_impl<float>(x, &residual, weight, out, eps);
  } else {
    norm_impl<c10::BFloat16>(x, &residual, weight, out, eps);
  }
  return out;
}

// x[t, h] = x * cos + rotate_half(x) * sin, in place, each product and the sum rounded to T as
// transformers' apply_rotary_pos_emb rounds them. x: [T, heads, D] (rows may be strided).
template <typename T>
void rotary_impl(at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  const int64_t tokens = x.size(0), heads = x.size(1), D = x.size(2), half = D / 2;
  const int64_t s0 = x.stride(0), s1 = x.stride(1);
  T* xp = x.data_ptr<T>();
  const T* cp = cos.data_ptr<T>();
  const T* sp = sin.data_ptr<T>();
  at::parallel_for(0, tokens, 8, [&](int64_t begin, int64_t end) {
    std::vector<float> row(D);
    for (int64_t t = begin; t < end; ++t) {
      const T* c = cp + t * D;
      const T* s = sp + t * D;
      for (int64_t h = 0; h < heads; ++h) {
        T* xr = xp + t * s0 + h * s1;
        for (int64_t i = 0; i < D; ++i) row[i] = to_float(xr[i]);
        for (int64_t i = 0; i < D; ++i) {
          const float rot = i < half ? -row[i + half] : row[i - half];
          const float a = round_to<T>(row[i] * to_float(c[i]));
          const float b = round_to<T>(rot * to_float(s[i]));
          xr[i] = static_cast<T>(a + b);
        }
      }
    }
  });
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
  if (x.scalar_type() == at::kFloat) {
    rotary_impl<float>(x, cos, sin);
  } else if (x.scalar_type() == at::kBFloat16) {
    rotary_impl<c10::BFloat16>(x, cos, sin);
  } else {
    TORCH_CHECK(false, "rotary: float32 or bfloat16 only");
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tokenmill, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor(a!) residual, Tensor weight, float eps) -> Tensor");
  m.def("rotary_inplace(Tensor(a!) x, Tensor cos, Tensor sin) -> ()");
  m.impl("rms_norm", c10::DispatchKey::CPU, TORCH_FN(rms_norm));
  m.impl("add_rms_norm", c10::DispatchKey::CPU, TORCH_FN(add_rms_norm));
  m.impl("rotary_inplace", c10::DispatchKey::CPU, TORCH_FN(rotary_inplace));
}
