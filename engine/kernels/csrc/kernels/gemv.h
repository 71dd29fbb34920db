// The small-batch linear kernels' shared definitions (torch-free): the packed layout's geometry, one
// call's operands, and each path's entry points. engine/kernels/csrc/cpu_gemv.cpp checks the tensors, picks
// the path for this CPU (isa.h) and spreads a call's chunks over ATen's threads; the paths are in
// kernels/gemv_amx.cpp, gemv_avx512.cpp and gemv_avx2.cpp, each under its own target.
//
// Packed layout: W [N, K] becomes [Nb, K2 / 2, 16, 2] with Nb = ceil(N / 16) rounded up to a
// multiple of NB (4) and K2 = K rounded up to even, zero padded. Block b holds output rows
// 16b..16b+15; for each pair of input columns (2p, 2p + 1) the 16 rows' two elements lie side by
// side: 64 bytes of bf16, the operand of vdpbf16ps, or 32 bytes of int8. A block is one contiguous
// stream, and x contributes a 32-bit broadcast of its pair (x[2p], x[2p + 1]): no horizontal sums.
// A chunk is NB blocks (64 outputs): the unit the threads share.
#pragma once

#include <cstdint>

namespace tokenmill::gemv {

constexpr int64_t NB = 4;  // blocks of 16 output rows per chunk
constexpr int64_t FLUSH_PAIRS = 128;  // int32 sums move to float32 at least this often (256 columns)
constexpr int64_t AMX_ROWS = 16;  // rows of x per AMX A tile; the tile path takes calls of 1..2 x AMX_ROWS rows

struct Geometry {
  int64_t n;  // logical output rows (gate + up together when interleaved)
  int64_t k, k2;  // input columns, rounded up to even
  int64_t nb;  // packed blocks of 16 rows (a multiple of NB)
  int64_t groups, group_pairs;  // scale groups per row and column pairs per group (int8)
};

// One call's operands. x rows are 16-bit (bf16, or int16 for INT8), read in pairs as int32.
struct Job {
  const uint16_t* x;  // [m, k2]
  int64_t m;
  const float* x_scale;  // [m] int16 row scales (INT8), else null
  const void* w;  // packed weight: bf16 bits or int8
  const float* w_scale;  // [nb, groups, 16] (INT8), else null
  const float* bias;  // [n] float32 or null (interleaved: gate's then up's)
  Geometry g;
  bool silu;  // interleaved gate/up blocks; output [m, n / 2]
  void* out;  // [m, out_cols], bf16 or float32
  bool out_bf16;
  int64_t out_cols;
  bool blocked = false;  // bf16 sums in oneDNN's AMX order (tile_bf16_blocked), not one chain per output
  bool split = false;  // interleaved gate/up blocks, stored plain: [m, n] = [gate | up] (no silu)
  const float* xf = nullptr;  // bf16 x widened to float32 [m, k2]: the AVX2 path's (its broadcasts)
};

// Logical weight row -> (packed block, lane). Interleaved: rows [0, half) are the gate, [half, n) up.
struct RowMap {
  int64_t half;  // rows per half when interleaved, else 0
  int64_t block(int64_t r) const { return half ? 2 * (r % half / 16) + r / half : r / 16; }
  int64_t lane(int64_t r) const { return (half ? r % half : r) % 16; }
};

// The AMX path: chunks [c0, c1) of a call, every row of x. The others: one chunk and a range of rows
// (rows split across threads too where a call has few chunks: each tile's sums do not depend on which
// rows share its thread). Each path's silu(gate) * up of rows [r0, r1) of a bf16
// [rows, 2 half] product (row stride ld) into out [rows, half]; int8 blocks [b0, b1) dequantized to
// bf16 rows of out [n, k] (k even).
namespace amx {
bool applies(const Job& j);  // bf16, 1..32 rows, k2 a multiple of 32
void run_chunks(const Job& j, int64_t c0, int64_t c1);
}  // namespace amx
namespace avx512 {  // needs AVX512-BF16 for bf16, and VNNI for int8
void run_rows(const Job& j, int64_t c, int64_t r0, int64_t r1);  // chunk c, rows [r0, r1) of x
void silu_rows(const uint16_t* gu, int64_t ld, uint16_t* out, int64_t half, int64_t r0, int64_t r1);
void unpack_int8(const int8_t* packed, const float* scales, const Geometry& g, const RowMap& map, uint16_t* out,
                 int64_t b0, int64_t b1);
uint64_t sum_words(const uint64_t* p, int64_t b, int64_t e);  // words [b, e) summed: a memory-read probe
}  // namespace avx512
namespace avx2 {  // AVX2 + FMA: the same sums as the AVX-512 path (bf16 products are exact in float32)
void run_rows(const Job& j, int64_t c, int64_t r0, int64_t r1);
void silu_rows(const uint16_t* gu, int64_t ld, uint16_t* out, int64_t half, int64_t r0, int64_t r1);
void unpack_int8(const int8_t* packed, const float* scales, const Geometry& g, const RowMap& map, uint16_t* out,
                 int64_t b0, int64_t b1);
uint64_t sum_words(const uint64_t* p, int64_t b, int64_t e);
}  // namespace avx2

}  // namespace tokenmill::gemv
