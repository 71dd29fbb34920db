// The portable path of the GGUF block kernels (kernels/ggml.h): any CPU, the same sums as the AVX2
// path lane for lane (std::fma rounds once, as vfmadd does; the build's -ffp-contract=off keeps every
// other product and sum as written). Slow where the CPU has no FMA (a library call per term): it is
// the path of CPUs without AVX2 and the reference the AVX2 path is tested against. Torch-free.
#include <cmath>

#include "ggml.h"

namespace tokenmill::ggml::portable {

void run_rows(const Job& j, int64_t n0, int64_t n1) {
  const int64_t units = j.k / QK;
  float w[QK];
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = j.w + n * j.row_bytes;
    for (int64_t r = 0; r < j.m; ++r) {
      const float* x = j.x + r * j.k;
      float acc[8] = {};
      for (int64_t u = 0; u < units; ++u) {
        decode_values(j.type, row, u, w);  // (decoded again per row of x: the reference)
        for (int v = 0; v < 4; ++v)
          for (int l = 0; l < 8; ++l) acc[l] = std::fma(w[v * 8 + l], x[u * QK + v * 8 + l], acc[l]);
      }
      j.y[r * j.n + n] = reduce8(acc) + (j.bias ? j.bias[n] : 0.f);
    }
  }
}

void run_rows_q8(const Job& j, int64_t n0, int64_t n1) {
  const int64_t units = j.k / QK, upb = block_values(j.type) / QK, bb = block_bytes(j.type);
  const bool min = has_min(j.type);
  int8_t q[QK];
  Scales sc;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = j.w + n * j.row_bytes;
    for (int64_t r = 0; r < j.m; ++r) {
      const int8_t* qx = j.qx + r * j.k;
      float acc[8] = {}, accm = 0.f;
      for (int64_t u = 0; u < units; ++u) {
        decode_unit(j.type, row + (u / upb) * bb, static_cast<int>(u % upb), q, sc);
        const float dx = j.dx[r * units + u];
        for (int l = 0; l < 8; ++l) {
          int isum = 0;
          for (int p = 4 * l; p < 4 * l + 4; ++p) isum += q[p] * qx[u * QK + p];
          acc[l] = std::fma(sc.s[l / 4] * dx, static_cast<float>(isum), acc[l]);
        }
        if (min) accm = accm + sc.c * j.xs[r * units + u];
      }
      j.y[r * j.n + n] = (reduce8(acc) + accm) + (j.bias ? j.bias[n] : 0.f);
    }
  }
}

void quantize_rows(const float* x, int64_t k, int64_t r0, int64_t r1, int8_t* qx, float* dx, float* xs) {
  const int64_t units = k / QK;
  for (int64_t r = r0; r < r1; ++r)
    for (int64_t u = 0; u < units; ++u)
      quantize_unit(x + r * k + u * QK, qx + r * k + u * QK, dx[r * units + u], xs[r * units + u]);
}

// bfloat16 bits of f, rounded to nearest even (c10::BFloat16's rounding; NaN -> 0x7FC0).
static uint16_t to_bf16(float f) {
  if (std::isnan(f)) return 0x7FC0;
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  return static_cast<uint16_t>((bits + ((bits >> 16) & 1u) + 0x7FFFu) >> 16);
}

void dequantize_rows(int type, const uint8_t* w, int64_t row_bytes, int64_t k, int64_t r0, int64_t r1, float* f32,
                     uint16_t* bf16) {
  float vals[QK];
  for (int64_t r = r0; r < r1; ++r)
    for (int64_t u = 0; u < k / QK; ++u) {
      decode_values(type, w + r * row_bytes, u, vals);
      for (int64_t c = 0; c < QK; ++c) {
        if (f32 != nullptr) {
          f32[r * k + u * QK + c] = vals[c];
        } else {
          bf16[r * k + u * QK + c] = to_bf16(vals[c]);
        }
      }
    }
}

}  // namespace tokenmill::ggml::portable
