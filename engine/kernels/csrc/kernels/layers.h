// The decoder layers' elementwise kernels' per-row arithmetic (torch-free; engine/kernels/csrc/cpu_layers.cpp
// checks the tensors and spreads the rows over the threads): RMSNorm with the residual add folded in,
// and rotary embedding in place. One body (kernels/layers_body.inc) compiled for AVX-512, AVX2 and no
// extension (kernels/layers_isa.cpp): no fused multiply-adds (each product rounds where PyTorch's
// does) and the norm's sum in fixed lanes, so every path gives the same bits.
#pragma once

#include <cstdint>

namespace tokenmill::layers {

// Rows [r0, r1) of x [rows, n]: out = w * T(x * rsqrt(mean(x^2) + eps)); with a residual, first
// residual += x (rounded to T) and the sum normalised. float32, or bf16 where `bf16`.
struct Norm {
  const void* x;
  void* residual;  // or null
  const void* w;
  void* out;
  int64_t n;
  float eps;
  bool bf16;
};

// Tokens [t0, t1) of x [T, heads, D] (strides s0, s1) in place: x * cos + rotate_half(x) * sin, cos and
// sin [T, D].
struct Rotary {
  void* x;
  const void* cos;
  const void* sin;
  int64_t heads, dim, s0, s1;
  bool bf16;
};

#define TM_LAYERS_PATH(ns)                                     \
  namespace ns {                                               \
  void norm_rows(const Norm& c, int64_t r0, int64_t r1);       \
  void rotary_tokens(const Rotary& c, int64_t t0, int64_t t1); \
  }
TM_LAYERS_PATH(avx512)
TM_LAYERS_PATH(avx2)
TM_LAYERS_PATH(portable)
#undef TM_LAYERS_PATH

}  // namespace tokenmill::layers
