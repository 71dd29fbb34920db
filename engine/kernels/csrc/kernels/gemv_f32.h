// The float32 small-batch linear kernel's layout and entry point (torch-free): W [N, K] packed as
// [Nb, K, 8], Nb = ceil(N / 8) rounded up to a multiple of GB (engine/kernels/csrc/cpu_gemv_f32.cpp).
#pragma once

#include <cstdint>

namespace tokenmill::gemv_f32 {

constexpr int64_t LANES = 8;  // outputs per block (one ymm register)
constexpr int64_t GB = 4;  // blocks per group: the unit of work of a thread
constexpr int64_t MR = 6;  // most rows of x per tile

inline int64_t blocks(int64_t n) { return (n + LANES * GB - 1) / (LANES * GB) * GB; }

namespace avx2 {
// out [m, n] = x [m, k] W^T + bias for the groups [g0, g1) of the packed weight.
void run_groups(const float* x, int64_t m, int64_t k, const float* packed, int64_t n, const float* bias, float* out,
                int64_t g0, int64_t g1);
}  // namespace avx2

}  // namespace tokenmill::gemv_f32
