// The portable path of the GGUF block kernels (kernels/ggml.h): any CPU, the same sums as the AVX2
// path lane for lane (std::fma rounds once, as vfmadd does; the build's -ffp-contract=off keeps every
// other product and sum as written). Slow where the CPU has no FMA (a library call per term): it is
// the path of CPUs without AVX2 and the reference the AVX2 path is tested against. Torch-free.
#include <cmath>

#include "ggml.h"

namespace tokenmill::ggml::portable {

void run_rows(const Job& j, int64_t n0, int64_t n1) {
  const int64_t blocks = j.k / QK;
  float w[QK];
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = j.w + n * j.row_bytes;
    for (int64_t r = 0; r < j.m; ++r) {
      const float* x = j.x + r * j.k;
      float acc[8] = {};
      for (int64_t b = 0; b < blocks; ++b) {
        decode_block(j.type, row + b * block_bytes(j.type), w);  // (decoded again per row of x: the reference)
        for (int v = 0; v < 4; ++v)
          for (int l = 0; l < 8; ++l) acc[l] = std::fma(w[v * 8 + l], x[b * QK + v * 8 + l], acc[l]);
      }
      j.y[r * j.n + n] = reduce8(acc) + (j.bias ? j.bias[n] : 0.f);
    }
  }
}

}  // namespace tokenmill::ggml::portable
