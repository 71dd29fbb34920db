// Widening a cache/activation element to float32, shared by the CPU kernels.
#pragma once

#include <c10/util/BFloat16.h>

#include <cstdint>
#include <cstring>

namespace tokenmill {

inline float to_float(float x) { return x; }

// bf16 is the top half of a float32: widen by shifting (spelled out so loops vectorise).
inline float to_float(c10::BFloat16 x) {
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// exp(x) for x <= 0 in plain arithmetic the compiler vectorises (glibc's expf does not vectorise
// without -ffast-math): 2^(x log2 e) = 2^n 2^f with n = round, |f| <= 0.5, 2^f by a degree-6
// polynomial (relative error ~2e-7), 2^n by the exponent bits. Below -87 the result is 0 (as expf
// underflows there); NaN stays NaN.
inline float exp_nonpositive(float x) {
  const float y = (x < -87.f ? -87.f : x) * 1.44269504088896341f;
  const float n = (y + 12582912.f) - 12582912.f;  // round to nearest: 1.5 x 2^23 pushes out the fraction
  const float f = y - n;
  float p = 1.5403530393381606e-4f;
  p = p * f + 1.3333558146428443e-3f;
  p = p * f + 9.6181291076284772e-3f;
  p = p * f + 5.5504108664821580e-2f;
  p = p * f + 2.4022650695910071e-1f;
  p = p * f + 6.9314718055994531e-1f;
  p = p * f + 1.0f;
  int32_t bits;
  std::memcpy(&bits, &p, sizeof(bits));
  bits += static_cast<int32_t>(n) << 23;
  float r;
  std::memcpy(&r, &bits, sizeof(r));
  r = x < -87.f ? 0.f : r;
  return x != x ? x : r;
}

}  // namespace tokenmill
