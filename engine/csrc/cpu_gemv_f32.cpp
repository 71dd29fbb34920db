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
// k, bias). The AVX2 code is compiled for its own target whatever -march says, and runs only where
// gemv_f32_supported() says this CPU has the instructions.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#define TM_AVX2 __attribute__((target("avx2,fma")))

namespace {

constexpr int64_t LANES = 8;  // outputs per block (one ymm register)
constexpr int64_t GB = 4;  // blocks per group: the unit of work of a thread
constexpr int64_t MR = 6;  // most rows of x per tile

bool supported() {
  static const bool ok = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  }();
  return ok;
}

int64_t blocks(int64_t n) { return (n + LANES * GB - 1) / (LANES * GB) * GB; }

// acc[r][b] = x[r] . W[block b] for R rows and NB blocks starting at w (NB * k * 8 floats).
template <int R, int NB>
TM_AVX2 inline void tile(const float* x, int64_t ldx, const float* w, int64_t k, float* out, int64_t ldo,
                         int64_t col0, int64_t n, const float* bias) {
  __m256 acc[R][NB];
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < NB; ++b) acc[r][b] = _mm256_setzero_ps();
  for (int64_t c = 0; c < k; ++c) {
    __m256 wv[NB];
    for (int b = 0; b < NB; ++b) wv[b] = _mm256_loadu_ps(w + (b * k + c) * LANES);
    for (int r = 0; r < R; ++r) {
      const __m256 xb = _mm256_broadcast_ss(x + r * ldx + c);
      for (int b = 0; b < NB; ++b) acc[r][b] = _mm256_fmadd_ps(wv[b], xb, acc[r][b]);
    }
  }
  for (int b = 0; b < NB; ++b) {
    const int64_t c0 = col0 + b * LANES;
    if (c0 >= n) break;
    const int64_t valid = std::min<int64_t>(LANES, n - c0);
    alignas(32) float bv[LANES] = {};
    if (bias != nullptr)
      for (int64_t l = 0; l < valid; ++l) bv[l] = bias[c0 + l];
    const __m256 bias_v = _mm256_load_ps(bv);
    for (int r = 0; r < R; ++r) {
      const __m256 y = _mm256_add_ps(acc[r][b], bias_v);
      float* dst = out + r * ldo + c0;
      if (valid == LANES) {
        _mm256_storeu_ps(dst, y);
      } else {
        alignas(32) float tmp[LANES];
        _mm256_store_ps(tmp, y);
        std::copy(tmp, tmp + valid, dst);
      }
    }
  }
}

// Rows [m0, m0 + R) of one group's outputs, every row of the tile against each weight loaded: 1-2
// rows take the group's four blocks at once, 3-6 rows two blocks at a time: at least 8 independent
// accumulator chains (2 FMA units x 4 cycles of latency) and at most 12 (AVX2 has 16 registers).
template <int R>
TM_AVX2 void rows_of_group(const float* x, int64_t k, const float* w, float* out, int64_t n, int64_t col0,
                           const float* bias) {
  constexpr int NB = R <= 2 ? 4 : 2;
  for (int b = 0; b < GB; b += NB) tile<R, NB>(x, k, w + b * k * LANES, k, out, n, col0 + b * LANES, n, bias);
}

void run(const float* x, int64_t m, int64_t k, const float* packed, int64_t n, const float* bias, float* out) {
  const int64_t groups = blocks(n) / GB;
  at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      const float* w = packed + g * GB * k * LANES;
      const int64_t col0 = g * GB * LANES;
      // Up to 6 rows: one pass over the group's weights from memory; more rows: tiles of 6 (and
      // the rest), re-reading the group from L1/L2.
      for (int64_t m0 = 0; m0 < m; m0 += MR) {
        const float* xr = x + m0 * k;
        float* o = out + m0 * n;
        switch (std::min<int64_t>(MR, m - m0)) {
          case 6: rows_of_group<6>(xr, k, w, o, n, col0, bias); break;
          case 5: rows_of_group<5>(xr, k, w, o, n, col0, bias); break;
          case 4: rows_of_group<4>(xr, k, w, o, n, col0, bias); break;
          case 3: rows_of_group<3>(xr, k, w, o, n, col0, bias); break;
          case 2: rows_of_group<2>(xr, k, w, o, n, col0, bias); break;
          default: rows_of_group<1>(xr, k, w, o, n, col0, bias); break;
        }
      }
    }
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
