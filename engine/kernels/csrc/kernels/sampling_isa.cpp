// kernels/sampling_body.inc compiled for each path, each in its own target region (the same source,
// the same flags for every file: the region gives the instructions). Torch-free.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <utility>
#include <vector>

#include "bf16.h"
#include "sampling.h"

using tokenmill::bf16;
using tokenmill::to_float;

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c,bmi,bmi2,prefer-vector-width=512")
#define TM_FMA(a, b, c) __builtin_fmaf(a, b, c)
namespace tokenmill::sampling::avx512 {
#include "sampling_body.inc"
}  // namespace tokenmill::sampling::avx512
#undef TM_FMA
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,bmi,bmi2")
#define TM_FMA(a, b, c) __builtin_fmaf(a, b, c)
namespace tokenmill::sampling::avx2 {
#include "sampling_body.inc"
}  // namespace tokenmill::sampling::avx2
#undef TM_FMA
#pragma GCC pop_options

#define TM_FMA(a, b, c) ((a) * (b) + (c))
namespace tokenmill::sampling::portable {
#include "sampling_body.inc"
}  // namespace tokenmill::sampling::portable
#undef TM_FMA
