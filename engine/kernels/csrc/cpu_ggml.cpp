// GGUF quantized weights (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K) multiplied from their blocks
// as the file stores them (kernels/ggml.h), registered in torch.ops.tokenmill:
//   ggml_gemv(x, w, type, n, k, bias): y = x W^T + b, x [..., K] bf16 or float32 (taken as float32),
//     y in x's dtype; each weight block read once per tile of rows and decoded in registers;
//   ggml_gemv_q8(x, w, type, n, k, bias): the same product with x quantized to int8 per 32 values and
//     integer dot products (llama.cpp's vec_dot; within kernels/ggml.h's bound of the float product);
//   ggml_dequantize(w, type, n, k, dtype): W [N, K] in bfloat16 or float32 (the values
//     gguf.quants.dequantize gives, rounded once to bf16): the large-batch path's weight and the
//     embedding's rows;
//   ggml_supported(type): whether these kernels take a ggml type id; ggml_path(): "AVX2" or "portable".
// The path is the CPU's (isa.h: AVX2 + FMA + F16C, else the portable loops, the same sums).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <string>

#include "isa.h"
#include "kernels/ggml.h"

namespace {

namespace gg = tokenmill::ggml;

bool avx2() { return tokenmill::cpu().avx2; }

bool ggml_supported(int64_t type) { return gg::block_bytes(static_cast<int>(type)) > 0; }

std::string ggml_path() { return avx2() ? "AVX2" : "portable"; }

void check_weight(const at::Tensor& w, int64_t type, int64_t n, int64_t k) {
  TORCH_CHECK(ggml_supported(type), "ggml: unsupported ggml type ", type,
              " (Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14)");
  const int64_t bv = gg::block_values(static_cast<int>(type));
  TORCH_CHECK(k > 0 && k % bv == 0, "ggml: K must be a positive multiple of ", bv, ", got ", k);
  TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == at::kByte && w.dim() == 2 && w.is_contiguous() &&
                  w.size(0) == n && w.size(1) == k / bv * gg::block_bytes(static_cast<int>(type)),
              "ggml: the weight must be contiguous uint8 [N, K / block values * block bytes] blocks");
}

at::Tensor gemv(const at::Tensor& x, const at::Tensor& w, int64_t type, int64_t n, int64_t k,
                const c10::optional<at::Tensor>& bias, bool q8) {
  check_weight(w, type, n, k);
  TORCH_CHECK(x.device().is_cpu() && x.dim() >= 1 && x.size(-1) == k, "ggml_gemv: x must be a CPU tensor [..., K]");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat, "ggml_gemv: x must be bf16 or float32");
  at::Tensor bias_f;
  if (bias.has_value()) {
    TORCH_CHECK(bias->numel() == n, "ggml_gemv: bias must have N elements");
    bias_f = bias->to(at::kFloat).contiguous();
  }
  const at::Tensor xf = x.reshape({-1, k}).to(at::kFloat).contiguous();  // [M, K]
  const int64_t m = xf.size(0);
  at::Tensor y = at::empty({m, n}, xf.options());
  const bool wide = avx2();
  if (m > 0) {
    gg::Job j{static_cast<int>(type), w.data_ptr<uint8_t>(), n, k, w.size(1), xf.data_ptr<float>(), m,
              bias.has_value() ? bias_f.data_ptr<float>() : nullptr, y.data_ptr<float>()};
    at::Tensor qx, dx, xs;
    if (q8) {  // x quantized once per call, before the rows are spread over threads
      qx = at::empty({m, k}, xf.options().dtype(at::kChar));
      dx = at::empty({m, k / gg::QK}, xf.options());
      xs = at::empty({m, k / gg::QK}, xf.options());
      (wide ? gg::avx2::quantize_rows : gg::portable::quantize_rows)(xf.data_ptr<float>(), k, 0, m,
                                                                     qx.data_ptr<int8_t>(), dx.data_ptr<float>(),
                                                                     xs.data_ptr<float>());
      j.qx = qx.data_ptr<int8_t>();
      j.dx = dx.data_ptr<float>();
      j.xs = xs.data_ptr<float>();
    }
    // At least ~64 KiB of weight per task (a task that reads less costs more to start than it saves),
    // in whole tiles of 4 output rows.
    const int64_t grain = std::max<int64_t>(4, (64 << 10) / std::max<int64_t>(1, w.size(1)) / 4 * 4);
    const auto rows = q8 ? (wide ? gg::avx2::run_rows_q8 : gg::portable::run_rows_q8)
                         : (wide ? gg::avx2::run_rows : gg::portable::run_rows);
    at::parallel_for(0, (n + 3) / 4, std::max<int64_t>(1, grain / 4), [&](int64_t t0, int64_t t1) {
      rows(j, t0 * 4, std::min(n, t1 * 4));
    });
  }
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = n;
  return y.to(x.scalar_type()).view(shape);
}

at::Tensor ggml_gemv(const at::Tensor& x, const at::Tensor& w, int64_t type, int64_t n, int64_t k,
                     const c10::optional<at::Tensor>& bias) {
  return gemv(x, w, type, n, k, bias, false);
}

at::Tensor ggml_gemv_q8(const at::Tensor& x, const at::Tensor& w, int64_t type, int64_t n, int64_t k,
                        const c10::optional<at::Tensor>& bias) {
  return gemv(x, w, type, n, k, bias, true);
}

at::Tensor ggml_dequantize(const at::Tensor& w, int64_t type, int64_t n, int64_t k, at::ScalarType dtype) {
  check_weight(w, type, n, k);
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "ggml_dequantize: dtype must be float32 or bfloat16");
  at::Tensor out = at::empty({n, k}, w.options().dtype(dtype));
  const auto rows = avx2() ? gg::avx2::dequantize_rows : gg::portable::dequantize_rows;
  float* f32 = dtype == at::kFloat ? out.data_ptr<float>() : nullptr;
  uint16_t* bf16 = dtype == at::kFloat ? nullptr : reinterpret_cast<uint16_t*>(out.data_ptr<c10::BFloat16>());
  // ~64 KiB of output per task
  at::parallel_for(0, n, std::max<int64_t>(1, (64 << 10) / (k * out.element_size())), [&](int64_t r0, int64_t r1) {
    rows(static_cast<int>(type), w.data_ptr<uint8_t>(), w.size(1), k, r0, r1, f32, bf16);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tokenmill, m) {
  m.def("ggml_supported(int type) -> bool");
  m.def("ggml_path() -> str");
  m.def("ggml_gemv(Tensor x, Tensor w, int type, int n, int k, Tensor? bias) -> Tensor");
  m.def("ggml_gemv_q8(Tensor x, Tensor w, int type, int n, int k, Tensor? bias) -> Tensor");
  m.def("ggml_dequantize(Tensor w, int type, int n, int k, ScalarType dtype) -> Tensor");
  m.impl("ggml_supported", c10::DispatchKey::CatchAll, TORCH_FN(ggml_supported));
  m.impl("ggml_path", c10::DispatchKey::CatchAll, TORCH_FN(ggml_path));
  m.impl("ggml_gemv", c10::DispatchKey::CPU, TORCH_FN(ggml_gemv));
  m.impl("ggml_gemv_q8", c10::DispatchKey::CPU, TORCH_FN(ggml_gemv_q8));
  m.impl("ggml_dequantize", c10::DispatchKey::CPU, TORCH_FN(ggml_dequantize));
}
