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

}  // namespace tokenmill
