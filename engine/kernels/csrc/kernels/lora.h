// The LoRA delta kernels' shared definitions (torch-free): one linear's adapters as the kernels read
// them, a call's rows sorted by adapter, the tile layouts of the AMX path, and each path's range
// functions. engine/kernels/csrc/cpu_lora.cpp checks the tensors, sorts the rows, picks the path (isa.h) and
// spreads the ranges over the threads; the arithmetic is in kernels/lora_amx.cpp, lora_avx512.cpp and
// lora_avx2.cpp, each under its own target (the portable loops, for CPUs with none of them, are
// cpu_lora.cpp's).
#pragma once

#include <cstdint>
#include <vector>

#include "bf16.h"

namespace tokenmill {

struct LoraSpan {  // B^T is non-zero only at output columns [c0, c1) from ranks [r0, r1)
  int64_t c0, c1, r0, r1;
};

// One linear's adapters (one per segment of a step: the rows' slots index them), checked: each
// adapter's rank (0: it does not target the linear), its spans, and pointers to A [R, in], B^T
// [R, out] (bf16 where `bf16`, else float32) and to their tile layouts (lora_pack_bf16; null where
// not given). The tensors pointed to are the holder's to keep alive.
struct LoraLinear {
  int64_t in = 0, out = 0, n = 0, max_rank = 0;
  bool any = false;  // some adapter targets the linear
  bool bf16 = false;  // A and B^T in bf16 (else float32)
  std::vector<int64_t> rank;
  std::vector<std::vector<LoraSpan>> spans;
  std::vector<const void*> ap, bp;
  std::vector<const tokenmill::bf16*> pa, pb;
};

}  // namespace tokenmill

namespace tokenmill::lora {

using Span = LoraSpan;
using Spans = std::vector<Span>;

struct Group {  // rows [first, first + n) of adapter s's rows
  int64_t s, first;
  int n;
};

// One call of the register-tile paths (AVX-512, AVX2): y[t] += (A_s x[t]) B_s^T for the rows of each
// adapter s in `segments[s]`, in `groups` of up to GROUP rows of one adapter.
struct Delta {
  void* y;  // [rows, out]: float32, or bf16 where xy_bf16
  const void* x;  // [rows, in], x's dtype
  bool xy_bf16;
  const LoraLinear* lin;
  const std::vector<std::vector<int64_t>>* segments;  // each adapter's rows, in order
  const std::vector<Group>* groups;
  float* tmp;  // [rows, max_rank]: the shrink's sums, read by the expand
};

constexpr int64_t GROUP = 4;  // rows of one adapter per register tile
constexpr int64_t COLS = 128;  // output columns per expand task: a rank-16 B^T tile of 8 KiB stays in L1

// The register-tile paths: the shrink of groups [g0, g1) (tmp[row, :R] = A x[row]), then the expand of
// column blocks [b0, b1) of COLS columns (y[row, cols] += tmp[row, :R] B^T[:, cols], every group).
namespace avx512 {
void shrink_groups(const Delta& d, int64_t g0, int64_t g1);
void expand_blocks(const Delta& d, int64_t b0, int64_t b1);
}  // namespace avx512
namespace avx2 {
void shrink_groups(const Delta& d, int64_t g0, int64_t g1);
void expand_blocks(const Delta& d, int64_t b0, int64_t b1);
}  // namespace avx2

// ---- AMX (bf16 rows and pairs): 16 rows of one adapter per tile ------------------------------------

constexpr int AMX_ROWS = 16;  // rows of one adapter per group (a tile's rows)

// The tile layouts of one adapter's pair (lora_pack_bf16, once per adapter placed; or per call):
//   A: per 16 ranks (rt) and 32 input columns (kc), 512 elements [16 column pairs][16 ranks][2]:
//      pa[(rt * KC + kc) * 512 + p * 32 + r * 2 + e] = A[16 rt + r][32 kc + 2p + e] (0 past R)
//   B^T: span by span, per 16 ranks from the span's first multiple of 16 (step) and 16 output columns
//      from c0 (block), 256 elements [8 rank pairs][16 columns][2], zero outside the span's ranks and
//      columns: the B tile of the expand. A span's steps x blocks x 256 follow the previous span's.
inline int64_t packed_a_size(int64_t R, int64_t in) { return (R + 15) / 16 * (in / 32) * 512; }
inline int64_t span_steps(const Span& sp) { return (sp.r1 - (sp.r0 & ~int64_t{15}) + 15) / 16; }
inline int64_t span_blocks(const Span& sp) { return (sp.c1 - sp.c0 + 15) / 16; }
inline int64_t packed_b_size(const Spans& spans) {
  int64_t n = 0;
  for (const Span& sp : spans)
    if (sp.c0 < sp.c1 && sp.r0 < sp.r1) n += span_steps(sp) * span_blocks(sp) * 256;
  return n;
}

namespace amx {
// The tiles configured for a group of n rows: the shrink's, the expand's; and given back.
void tiles_for_shrink(int n);
void tiles_for_expand(int n);
void release();
// One group's shrink: for j < n and r < R, v = sum_c A[r][c] x[rows[j]][c], split exactly into three
// bf16 terms v = hi + mid + lo (each remainder a float32 difference with no rounding), at
// terms[q * 16 * rp + j * rp + r] (q = hi, mid, lo); the rest of terms stays as given (zero). xg: room
// for 16 x in, the group's n rows gathered there; the tiles configured for n rows (tiles_for_shrink).
void shrink(const bf16* xp, const int64_t* rows, int n, int64_t in, const bf16* pa, int64_t R, int64_t rp, bf16* xg,
            uint16_t* terms);
// One adapter's delta for its groups [g_lo, g_hi) over output columns [q0, q1) (whole blocks of its
// spans from c0); cfg: the rows the tiles are configured for (tiles_for_expand), kept across calls.
void expand(bf16* yp, const std::vector<int64_t>& seg, int64_t g_lo, int64_t g_hi, int64_t out, const bf16* pb,
            const Spans& spans, int64_t rp, const uint16_t* terms, int64_t q0, int64_t q1, int& cfg);
// act[c] = silu(y[c]) * y[half + c] for one row of a gated MLP's [gate | up] (kernels/silu_avx512.h).
void activate(const bf16* y, bf16* act, int64_t half);
}  // namespace amx

}  // namespace tokenmill::lora
