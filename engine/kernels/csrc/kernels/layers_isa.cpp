// kernels/layers_body.inc compiled for each path, each in its own target region (the same source, the
// same flags for every file: the region gives the instructions). No fused multiply-adds in any region
// (the build's -ffp-contract=off; the body writes none), so the paths agree bit for bit. Torch-free.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "bf16.h"
#include "layers.h"

using tokenmill::bf16;
using tokenmill::from_float;
using tokenmill::round_to;
using tokenmill::to_float;

#define TM_FMA(a, b, c) ((a) * (b) + (c))  // (math.inc's exp is not used here)

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c,bmi,bmi2,prefer-vector-width=512")
namespace tokenmill::layers::avx512 {
#include "layers_body.inc"
}  // namespace tokenmill::layers::avx512
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,bmi,bmi2")
namespace tokenmill::layers::avx2 {
#include "layers_body.inc"
}  // namespace tokenmill::layers::avx2
#pragma GCC pop_options

namespace tokenmill::layers::portable {
#include "layers_body.inc"
}  // namespace tokenmill::layers::portable
