// bf16 as the kernels hold it (the top half of a float32's bits) and its conversions, torch-free:
// widening by a shift, narrowing by round-to-nearest-even as c10::BFloat16 rounds (NaN -> 0x7FC0),
// so a kernel's bf16 results are PyTorch's.
#pragma once

#include <cstdint>
#include <cstring>

namespace tokenmill {

struct bf16 {
  uint16_t x;
};
static_assert(sizeof(bf16) == 2, "bf16 is two bytes, as at::BFloat16");

inline float to_float(float v) { return v; }

inline float to_float(bf16 v) {  // spelled out so loops vectorise
  const uint32_t bits = static_cast<uint32_t>(v.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

inline uint16_t bf16_bits(float f) {  // c10::BFloat16's round_to_nearest_even
  if (f != f) return 0x7FC0;
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return static_cast<uint16_t>((u + ((u >> 16) & 1) + 0x7FFFu) >> 16);
}

// A float32 as T: itself, or rounded to bf16.
template <typename T>
inline T from_float(float f);
template <>
inline float from_float<float>(float f) { return f; }
template <>
inline bf16 from_float<bf16>(float f) { return bf16{bf16_bits(f)}; }

// Round a float to T and back (PyTorch's rounding of an op's result in T).
template <typename T>
inline float round_to(float f) {
  return to_float(from_float<T>(f));
}

}  // namespace tokenmill
