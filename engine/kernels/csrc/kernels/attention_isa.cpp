// kernels/attention_body.inc compiled for each path, each in its own target region (the same source,
// the same flags for every file: the region gives the instructions). Torch-free.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "attention.h"
#include "bf16.h"

using tokenmill::bf16;
using tokenmill::from_float;
using tokenmill::to_float;

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c,bmi,bmi2,prefer-vector-width=512")
#define TM_FMA(a, b, c) __builtin_fmaf(a, b, c)
#define TM_VEC_FLOATS 448  // 28 of the 32 zmm registers
namespace tokenmill::attention::avx512 {
#include "attention_body.inc"
}  // namespace tokenmill::attention::avx512
#undef TM_FMA
#undef TM_VEC_FLOATS
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,bmi,bmi2")
#define TM_FMA(a, b, c) __builtin_fmaf(a, b, c)
#define TM_VEC_FLOATS 112  // 14 of the 16 ymm registers
namespace tokenmill::attention::avx2 {
#include "attention_body.inc"
}  // namespace tokenmill::attention::avx2
#undef TM_FMA
#undef TM_VEC_FLOATS
#pragma GCC pop_options

#define TM_FMA(a, b, c) ((a) * (b) + (c))
#define TM_VEC_FLOATS 56  // 14 of the 16 xmm registers
namespace tokenmill::attention::portable {
#include "attention_body.inc"
}  // namespace tokenmill::attention::portable
#undef TM_FMA
#undef TM_VEC_FLOATS
