// Sampling whole rows of logits, per row (torch-free; engine/kernels/csrc/cpu_sampling.cpp checks the tensors
// and spreads the rows over the threads). One body (kernels/sampling_body.inc) compiled for AVX-512,
// AVX2 and no extension (kernels/sampling_isa.cpp); the sums run in fixed lanes, so the AVX2 and
// AVX-512 paths draw the same tokens from the same u.
#pragma once

#include <cstdint>

namespace tokenmill::sampling {

struct Call {
  const void* logits;  // [n, vocab], rows `stride` apart; float32, or bf16 where `bf16`
  int64_t stride, vocab;
  bool bf16;
  const float* inv_t;  // [n], 0: greedy
  const float* u;  // [n] in [0, 1)
  int64_t* tokens;  // [n]
  float* scores;  // [n]
};

namespace avx512 {
void rows(const Call& c, int64_t r0, int64_t r1);
}
namespace avx2 {
void rows(const Call& c, int64_t r0, int64_t r1);
}
namespace portable {
void rows(const Call& c, int64_t r0, int64_t r1);
}

}  // namespace tokenmill::sampling
