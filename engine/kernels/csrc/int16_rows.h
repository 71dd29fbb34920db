// The INT8 linears' activation rows as int16 with one scale a row (ATen's threads; portable code), shared
// by the linear group (cpu_gemv.cpp) and the grouped experts (cpu_moe.cpp), so both quantize x alike.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace tokenmill {

// Row r of x: q[r] = round(x[r] / scale[r]) with scale[r] = max |x[r]| / 32767 (1 for a zero row).
template <typename T>
inline void quantize_int16_rows(const T* x, int64_t m, int64_t k, int64_t k2, int16_t* q, float* scale) {
  at::parallel_for(0, m, 8, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* xr = x + r * k;
      float amax = 0.f;
      for (int64_t c = 0; c < k; ++c) amax = std::max(amax, std::fabs(static_cast<float>(xr[c])));
      const float s = amax > 0.f ? amax / 32767.f : 1.f, inv = 1.f / s;
      for (int64_t c = 0; c < k; ++c) q[r * k2 + c] = static_cast<int16_t>(std::clamp(std::nearbyint(static_cast<float>(xr[c]) * inv), -32767.f, 32767.f));
      scale[r] = s;
    }
  });
}

}  // namespace tokenmill
