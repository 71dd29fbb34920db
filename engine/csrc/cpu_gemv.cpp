// Skinny matrix products for the CPU decode step: y = x W^T for a few rows of x, with W held in
// bf16 or in INT8 with float32 scales, streamed once per call. Registered in torch.ops.tokenmill:
// gemv_pack_bf16 / gemv_pack_int8 (re-lay a weight once), gemv (y = x W^T + b), gemv_silu_mul (the
// gated MLP's product with silu(gate) * up fused into the epilogue), gemv_supported (whether this
// CPU runs a kind; "amx": whether bf16 calls of 1..32 rows use the tile unit) and read_sum (a
// memory-read probe for bench floor).
//
// Packed layout: W [N, K] becomes [Nb, K2 / 2, 16, 2] with Nb = ceil(N / 16) rounded up to a
// multiple of NB (4) and K2 = K rounded up to even, zero padded. Block b holds output rows
// 16b..16b+15; for each pair of input columns (2p, 2p + 1) the 16 rows' two elements lie side by
// side: 64 bytes of bf16, the operand of vdpbf16ps, or 32 bytes of int8. A block is one contiguous
// stream, and x contributes a 32-bit broadcast of its pair (x[2p], x[2p + 1]): no horizontal sums.
//
// bf16: float32 sums of vdpbf16ps (AVX512-BF16), rounded to bf16 once at the end, as oneDNN does;
// on CPUs with AMX, calls of 1..32 rows (K a multiple of 32) multiply on the tile unit instead
// (tdpbf16ps on the same packed layout, run_chunks_amx), still streaming the weight once.
// INT8 (weight-only quantization): each row of x is quantized to int16 on entry (symmetric, its own
// scale: 2^-15 of its largest element, finer than bf16's 2^-8 of each element for all but the
// smallest), and int8 weights widened to int16 with one vpmovsxbw multiply-add in pairs into int32
// (vpdpwssd, AVX512-VNNI): one conversion per 32 weights, where int8 -> float -> bf16 takes five.
// (int8 activations with vpdpbusd fail the quality gate on SmolLM2-135M: docs/BENCHMARKS.md.) The
// int32 sums are moved into float32 at least every 256 columns (127 * 32767 * 256 < 2^31: no
// overflow whatever the data) and at the end of each scale group; weight scales are per output
// row and group of input columns (group = K: per channel; 32: Q8_0's blocks).
//
// Gated MLP layout (interleave=true): the gate's and the up projection's blocks alternate (gate
// block j, up block j, ...), each half padded on its own, so a register tile holds both halves of 16
// channels and the epilogue writes silu(gate) * up, rounding where PyTorch's three bf16 ops round.
//
// The AVX-512 code is compiled for its own target whatever -march says, and the engine runs it only
// where gemv_supported() says this CPU has the instructions.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include "amx.h"
#include "silu.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>

#define TM_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx512vnni,fma")))
#define TM_AMX __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx512vnni,fma")))

namespace {

constexpr int64_t NB = 4;  // blocks of 16 output rows per register tile
constexpr int64_t MR = 4;  // most rows of x per register tile
constexpr int64_t FLUSH_PAIRS = 128;  // int32 sums move to float32 at least this often (256 columns)

bool has(const char* kind) {
  __builtin_cpu_init();
  const bool base = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                    __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
                    __builtin_cpu_supports("avx512bf16");  // the epilogue rounds with vcvtneps2bf16
  return base && (std::string(kind) == "bf16" || __builtin_cpu_supports("avx512vnni"));
}

// Whether bf16 calls of 1..32 rows may take the tile unit (amx.h: CPUID, Linux's permission, and
// TOKENMILL_CPU_AMX=0 to keep the AVX-512 tiles for every row count).
bool amx() { return tokenmill::amx_usable(); }

bool supported(const std::string& kind) {
  static const bool bf16 = has("bf16"), int8 = has("int8");
  TORCH_CHECK(kind == "bf16" || kind == "int8" || kind == "amx", "gemv_supported: kind must be 'bf16', 'int8' or 'amx'");
  if (kind == "amx") return bf16 && amx();  // bf16 calls of 1..32 rows take the tile path (run_chunks_amx*)
  return kind == "bf16" ? bf16 : int8;
}

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
};

TM_AVX512 inline int32_t pair_at(const uint16_t* row, int64_t p) {
  int32_t v;
  std::memcpy(&v, row + 2 * p, sizeof(v));
  return v;
}

// ---- bf16 --------------------------------------------------------------------------------------

template <int R>
TM_AVX512 inline void tile_bf16(const Job& j, int64_t m0, int64_t b0, __m512 (&acc)[R][NB]) {
  const int64_t kp = j.g.k2 / 2;
  const uint16_t* w = static_cast<const uint16_t*>(j.w) + b0 * kp * 32;
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < NB; ++b) acc[r][b] = _mm512_setzero_ps();
  for (int64_t p = 0; p < kp; ++p) {
    __m512i wv[NB];
    for (int b = 0; b < NB; ++b) wv[b] = _mm512_loadu_si512(w + (b * kp + p) * 32);
    for (int r = 0; r < R; ++r) {
      const __m512bh xb = reinterpret_cast<__m512bh>(_mm512_set1_epi32(pair_at(j.x + (m0 + r) * j.g.k2, p)));
      for (int b = 0; b < NB; ++b) acc[r][b] = _mm512_dpbf16_ps(acc[r][b], reinterpret_cast<__m512bh>(wv[b]), xb);
    }
  }
}

// The same product summed in the order oneDNN's AMX GEMM (tdpbf16ps) sums it, as measured on a Xeon
// (docs/ENGINE.md, "batch-invariant mode"): per 32 input columns (16 pairs, one AMX tile row), the even
// columns' products in one float32 chain and the odd columns' in another, each from zero, then
// acc += (even + odd). vdpbf16ps adds a pair's odd product, then its even one, into one register: with
// the other half of x's pair zeroed, one instruction adds just the even (or just the odd) product, so
// each chain costs one vdpbf16ps per pair: twice the one-chain kernel's arithmetic, the same weight
// reads. Rows of x in tiles of at most 2 (three accumulator sets of 2 x NB registers, plus weights).
template <int R>
TM_AVX512 inline void tile_bf16_blocked(const Job& j, int64_t m0, int64_t b0, __m512 (&acc)[R][NB]) {
  static_assert(R <= 2, "three accumulator sets: at most 2 rows a tile");
  const int64_t kp = j.g.k2 / 2;
  const uint16_t* w = static_cast<const uint16_t*>(j.w) + b0 * kp * 32;
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < NB; ++b) acc[r][b] = _mm512_setzero_ps();
  for (int64_t p0 = 0; p0 < kp; p0 += 16) {
    __m512 even[R][NB], odd[R][NB];
    for (int r = 0; r < R; ++r)
      for (int b = 0; b < NB; ++b) even[r][b] = odd[r][b] = _mm512_setzero_ps();
    const int64_t p1 = std::min(kp, p0 + 16);
    for (int64_t p = p0; p < p1; ++p) {
      __m512i wv[NB];
      for (int b = 0; b < NB; ++b) wv[b] = _mm512_loadu_si512(w + (b * kp + p) * 32);
      for (int r = 0; r < R; ++r) {
        const int32_t pair = pair_at(j.x + (m0 + r) * j.g.k2, p);  // little-endian: column 2p in the low half
        const __m512bh xe = reinterpret_cast<__m512bh>(_mm512_set1_epi32(pair & 0xFFFF));
        const __m512bh xo = reinterpret_cast<__m512bh>(_mm512_set1_epi32(static_cast<int32_t>(pair & 0xFFFF0000u)));
        for (int b = 0; b < NB; ++b) {
          even[r][b] = _mm512_dpbf16_ps(even[r][b], reinterpret_cast<__m512bh>(wv[b]), xe);
          odd[r][b] = _mm512_dpbf16_ps(odd[r][b], reinterpret_cast<__m512bh>(wv[b]), xo);
        }
      }
    }
    for (int r = 0; r < R; ++r)
      for (int b = 0; b < NB; ++b) acc[r][b] = _mm512_add_ps(acc[r][b], _mm512_add_ps(even[r][b], odd[r][b]));
  }
}

// ---- INT8 ----------------------------------------------------------------------------------------

// sums[r][b] = int32 sums of x[row m0 + r] . W[block b] over pairs [p0, p1) (at most FLUSH_PAIRS).
// Named accumulators, not an array: with `__m512i part[R][NB]` GCC 12 copies each accumulator
// twice per vpdpwssd in tiles of 2+ rows (an array of dpbf16 accumulators it keeps in place).
#define TM_DOT_ROW(r)                                                   \
  if constexpr (R > r) {                                                \
    const __m512i xb = _mm512_set1_epi32(pair_at(x##r, p));             \
    a##r##0 = _mm512_dpwssd_epi32(a##r##0, w0, xb);                     \
    a##r##1 = _mm512_dpwssd_epi32(a##r##1, w1, xb);                     \
    a##r##2 = _mm512_dpwssd_epi32(a##r##2, w2, xb);                     \
    a##r##3 = _mm512_dpwssd_epi32(a##r##3, w3, xb);                     \
  }
#define TM_SAVE_ROW(r) \
  if constexpr (R > r) { sums[r][0] = a##r##0; sums[r][1] = a##r##1; sums[r][2] = a##r##2; sums[r][3] = a##r##3; }

template <int R>
TM_AVX512 __attribute__((noinline)) void dot_int8(const Job& j, const int8_t* w, int64_t m0, int64_t p0, int64_t p1,
                                                  __m512i (&sums)[R][NB]) {
  static_assert(NB == 4 && R >= 1 && R <= 4, "dot_int8 is written out for 4 blocks and up to 4 rows");
  const int64_t kp = j.g.k2 / 2, k2 = j.g.k2;
  const uint16_t* x0 = j.x + m0 * k2;
  const uint16_t *x1 = x0 + k2, *x2 = x0 + 2 * k2, *x3 = x0 + 3 * k2;  // rows past R are never read
  const __m512i z = _mm512_setzero_si512();
  __m512i a00 = z, a01 = z, a02 = z, a03 = z, a10 = z, a11 = z, a12 = z, a13 = z;
  __m512i a20 = z, a21 = z, a22 = z, a23 = z, a30 = z, a31 = z, a32 = z, a33 = z;
  for (int64_t p = p0; p < p1; ++p) {
    const int8_t* wp = w + p * 32;
    const __m512i w0 = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wp)));
    const __m512i w1 = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wp + kp * 32)));
    const __m512i w2 = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wp + 2 * kp * 32)));
    const __m512i w3 = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wp + 3 * kp * 32)));
    TM_DOT_ROW(0)
    TM_DOT_ROW(1)
    TM_DOT_ROW(2)
    TM_DOT_ROW(3)
  }
  TM_SAVE_ROW(0)
  TM_SAVE_ROW(1)
  TM_SAVE_ROW(2)
  TM_SAVE_ROW(3)
}
#undef TM_DOT_ROW
#undef TM_SAVE_ROW

// acc[r][b] = (sum over groups of float(int32 sums) * w_scale[group]) * x_scale[row], and for
// per-channel scales * w_scale at the end.
template <int R>
TM_AVX512 inline void tile_int8(const Job& j, int64_t m0, int64_t b0, __m512 (&acc)[R][NB]) {
  const int64_t kp = j.g.k2 / 2;
  const int8_t* w = static_cast<const int8_t*>(j.w) + b0 * kp * 32;
  const bool grouped = j.g.groups > 1;
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < NB; ++b) acc[r][b] = _mm512_setzero_ps();
  __m512i sums[R][NB];
  for (int64_t gi = 0; gi < j.g.groups; ++gi) {
    const int64_t g_end = std::min(kp, (gi + 1) * j.g.group_pairs);
    for (int64_t p0 = gi * j.g.group_pairs; p0 < g_end; p0 += FLUSH_PAIRS) {
      dot_int8<R>(j, w, m0, p0, std::min(g_end, p0 + FLUSH_PAIRS), sums);
      for (int b = 0; b < NB; ++b) {
        const __m512 sc = grouped ? _mm512_loadu_ps(j.w_scale + ((b0 + b) * j.g.groups + gi) * 16) : _mm512_set1_ps(1.f);
        for (int r = 0; r < R; ++r) acc[r][b] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums[r][b]), sc, acc[r][b]);
      }
    }
  }
  for (int r = 0; r < R; ++r) {  // the row's activation scale, and a per-channel weight scale
    const __m512 xs = _mm512_set1_ps(j.x_scale[m0 + r]);
    for (int b = 0; b < NB; ++b)
      acc[r][b] = _mm512_mul_ps(acc[r][b], grouped ? xs : _mm512_mul_ps(xs, _mm512_loadu_ps(j.w_scale + (b0 + b) * 16)));
  }
}

// ---- epilogue ------------------------------------------------------------------------------------

using tokenmill::exp512;
using tokenmill::round_bf16;
using tokenmill::silu_mul;
using tokenmill::silu_mul_row;
using tokenmill::widen_bf16;

template <int R>
TM_AVX512 inline void store_tile(const Job& j, int64_t m0, int64_t b0, __m512 (&acc)[R][NB]) {
  for (int b = 0; b < NB; b += j.silu ? 2 : 1) {
    int64_t col = (j.silu ? (b0 + b) / 2 : b0 + b) * 16;  // first output column of the block
    int64_t valid = std::min<int64_t>(16, j.out_cols - col);
    if (j.split) {  // gate block (b0 + b) / 2 (even) or up block (odd): to its plain column
      const int64_t half = j.out_cols / 2, at = (b0 + b) / 2 * 16;
      valid = std::min<int64_t>(16, half - at);
      col = at + ((b0 + b) % 2 ? half : 0);
    }
    if (valid <= 0) continue;  // padding blocks
    const __mmask16 mask = static_cast<__mmask16>((1u << valid) - 1);
    const __m512 bias = j.bias ? _mm512_maskz_loadu_ps(mask, j.bias + col) : _mm512_setzero_ps();
    const __m512 up_bias = j.bias && j.silu ? _mm512_maskz_loadu_ps(mask, j.bias + j.out_cols + col) : _mm512_setzero_ps();
    for (int r = 0; r < R; ++r) {
      __m512 v = _mm512_add_ps(acc[r][b], bias);
      if (j.silu) v = silu_mul(v, _mm512_add_ps(acc[r][b + 1], up_bias), j.out_bf16);
      const int64_t at = (m0 + r) * j.out_cols + col;
      if (j.out_bf16) {
        _mm256_mask_storeu_epi16(static_cast<uint16_t*>(j.out) + at, mask, reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v)));
      } else {
        _mm512_mask_storeu_ps(static_cast<float*>(j.out) + at, mask, v);
      }
    }
  }
}

// ---- driver --------------------------------------------------------------------------------------

template <int R>
TM_AVX512 void tile(const Job& j, int64_t m0, int64_t b0) {
  __m512 acc[R][NB];
  if (j.w_scale) {
    tile_int8<R>(j, m0, b0, acc);
  } else if constexpr (R <= 2) {
    if (j.blocked) {
      tile_bf16_blocked<R>(j, m0, b0, acc);
    } else {
      tile_bf16<R>(j, m0, b0, acc);
    }
  } else {
    tile_bf16<R>(j, m0, b0, acc);
  }
  store_tile<R>(j, m0, b0, acc);
}

// ---- AMX (bf16, 1..32 rows) ------------------------------------------------------------------------
// One tdpbf16ps multiplies a tile of up to 16 rows of x by 32 input columns (A: rows x 64 bytes) and a
// packed block's 16 column pairs (B: 16 rows of 16 outputs x 2 bf16, the packed layout as it lies)
// into 16 rows x 16 float32 outputs (C). A chunk's NB blocks take four C tiles; per 32 input columns
// x is loaded once and each block's 1 KiB of weights once, so the call streams the weight once for
// every row of x like the AVX-512 tiles, but the arithmetic is the tile unit's (the AVX-512 tiles
// are bound by vdpbf16ps past ~4 rows: SmolLM2-135M's linears took 16 ms at 9 rows against 9 ms at
// one). The C tiles go to a buffer and through the AVX-512 epilogue (store_tile) a row at a time.
// The tile unit sums as oneDNN's AMX GEMM does (per 32 columns; docs/ENGINE.md "batch-invariant
// mode"), so these are oneDNN's bits at every row count up to 32 (tests/engine/test_cpu_gemv.py),
// where the AVX-512 tiles' one chain per output differs from them near cancellations.
constexpr int64_t AMX_ROWS = 16;  // rows of x per A tile; the tile path takes calls of 1..2 x AMX_ROWS rows

using tokenmill::TileConfig;

using AmxSums = float[NB][2 * AMX_ROWS][16];  // a chunk's C tiles as stored: [block][row][output]

// Rows 0..m-1 of a chunk's stored sums through the AVX-512 epilogue (bias, silu, split, rounding).
TM_AVX512 inline void store_sums(const Job& j, int64_t b0, const AmxSums& c) {
  for (int64_t r = 0; r < j.m; ++r) {
    __m512 acc[1][NB];
    for (int b = 0; b < NB; ++b) acc[0][b] = _mm512_load_ps(c[b][r]);
    store_tile<1>(j, r, b0, acc);
  }
}

// gemv_blocked's calls too: the tile unit sums in the order tile_bf16_blocked emulates (oneDNN's), so
// the batch-invariant mode's kernel runs at the tile unit's speed up to 32 rows with the same bits
// (its start-up check, kernel_agrees, compares them with oneDNN's at 1 and 32 rows).
bool amx_applies(const Job& j) {
  return j.w_scale == nullptr && j.m >= 1 && j.m <= 2 * AMX_ROWS && j.g.k2 % 32 == 0 && amx();
}

TM_AMX void run_chunks_amx(const Job& j, int64_t c0, int64_t c1) {
  TileConfig cfg;
  const int m = static_cast<int>(j.m);
  cfg.rows[0] = m, cfg.colsb[0] = 64;  // A: m rows of 32 bf16
  cfg.rows[1] = 16, cfg.colsb[1] = 64;  // B: 16 pairs of 16 outputs
  cfg.rows[2] = 16, cfg.colsb[2] = 64;
  for (int t = 4; t < 8; ++t) cfg.rows[t] = m, cfg.colsb[t] = 64;  // C: m rows of 16 float32
  tokenmill::load_tile_config(cfg);
  const int64_t kp = j.g.k2 / 2;
  const uint16_t* w = static_cast<const uint16_t*>(j.w);
  alignas(64) AmxSums c;
  for (int64_t ch = c0; ch < c1; ++ch) {
    const int64_t b0 = ch * NB;
    const uint16_t* wb = w + b0 * kp * 32;  // block b0 + b at wb + b * kp * 32, pair p at + p * 32
    _tile_zero(4);
    _tile_zero(5);
    _tile_zero(6);
    _tile_zero(7);
    for (int64_t p = 0; p < kp; p += 16) {
      _tile_loadd(0, j.x + 2 * p, j.g.k2 * 2);
      _tile_loadd(1, wb + (0 * kp + p) * 32, 64);
      _tile_loadd(2, wb + (1 * kp + p) * 32, 64);
      _tile_dpbf16ps(4, 0, 1);
      _tile_dpbf16ps(5, 0, 2);
      _tile_loadd(1, wb + (2 * kp + p) * 32, 64);
      _tile_loadd(2, wb + (3 * kp + p) * 32, 64);
      _tile_dpbf16ps(6, 0, 1);
      _tile_dpbf16ps(7, 0, 2);
    }
    _tile_stored(4, c[0], 64);
    _tile_stored(5, c[1], 64);
    _tile_stored(6, c[2], 64);
    _tile_stored(7, c[3], 64);
    store_sums(j, b0, c);
  }
  _tile_release();
}

// 17..32 rows: two A tiles (rows 0-15 and 16..m-1) share each B tile, and a chunk's NB blocks go in
// two halves of two blocks (A 2 + B 2 + C 4: the eight tile registers); each block is still loaded
// once per call.
TM_AMX void run_chunks_amx2(const Job& j, int64_t c0, int64_t c1) {
  static_assert(NB == 4, "two halves of two blocks");
  TileConfig cfg;
  const int m = static_cast<int>(j.m), m1 = m - static_cast<int>(AMX_ROWS);
  for (int t = 0; t < 8; ++t) cfg.colsb[t] = 64;
  cfg.rows[0] = 16, cfg.rows[1] = m1;  // A: rows 0-15, rows 16..m-1
  cfg.rows[2] = cfg.rows[3] = 16;  // B: two blocks
  cfg.rows[4] = cfg.rows[5] = 16;  // C: A0 with each block
  cfg.rows[6] = cfg.rows[7] = m1;  // C: A1 with each block
  tokenmill::load_tile_config(cfg);
  const int64_t kp = j.g.k2 / 2;
  const uint16_t* w = static_cast<const uint16_t*>(j.w);
  const uint16_t* x1 = j.x + AMX_ROWS * j.g.k2;
  alignas(64) AmxSums c;
  for (int64_t ch = c0; ch < c1; ++ch) {
    const int64_t b0 = ch * NB;
    for (int half = 0; half < 2; ++half) {
      const uint16_t* w0 = w + (b0 + 2 * half) * kp * 32;
      const uint16_t* w1 = w0 + kp * 32;
      _tile_zero(4);
      _tile_zero(5);
      _tile_zero(6);
      _tile_zero(7);
      for (int64_t p = 0; p < kp; p += 16) {
        _tile_loadd(0, j.x + 2 * p, j.g.k2 * 2);
        _tile_loadd(1, x1 + 2 * p, j.g.k2 * 2);
        _tile_loadd(2, w0 + p * 32, 64);
        _tile_loadd(3, w1 + p * 32, 64);
        _tile_dpbf16ps(4, 0, 2);
        _tile_dpbf16ps(5, 0, 3);
        _tile_dpbf16ps(6, 1, 2);
        _tile_dpbf16ps(7, 1, 3);
      }
      _tile_stored(4, c[2 * half][0], 64);
      _tile_stored(5, c[2 * half + 1][0], 64);
      _tile_stored(6, c[2 * half][AMX_ROWS], 64);
      _tile_stored(7, c[2 * half + 1][AMX_ROWS], 64);
    }
    store_sums(j, b0, c);
  }
  _tile_release();
}

TM_AVX512 void run_chunks(const Job& j, int64_t c0, int64_t c1) {
  // Every row of x against one chunk of NB blocks at a time: the chunk stays in L1/L2 across the
  // row tiles, so the weights are read from memory once per call whatever the row count.
  for (int64_t c = c0; c < c1; ++c) {
    const int64_t b0 = c * NB;
    int64_t m0 = 0;
    if (j.blocked) {  // tiles of at most 2 rows (tile_bf16_blocked)
      for (; m0 + 2 <= j.m; m0 += 2) tile<2>(j, m0, b0);
      if (m0 < j.m) tile<1>(j, m0, b0);
      continue;
    }
    for (; m0 + MR <= j.m; m0 += MR) tile<MR>(j, m0, b0);
    switch (j.m - m0) {
      case 3: tile<3>(j, m0, b0); break;
      case 2: tile<2>(j, m0, b0); break;
      case 1: tile<1>(j, m0, b0); break;
      default: break;
    }
  }
}

void run(const Job& j) {
  // At least ~64 KiB of weights per task: below that starting a thread costs more than it saves.
  const int64_t chunk_bytes = NB * 16 * j.g.k2 * (j.w_scale ? 1 : 2);
  const int64_t grain = std::max<int64_t>(1, (64 << 10) / chunk_bytes);
  if (amx_applies(j)) {
    at::parallel_for(0, j.g.nb / NB, grain, [&](int64_t c0, int64_t c1) {
      if (j.m <= AMX_ROWS) {
        run_chunks_amx(j, c0, c1);
      } else {
        run_chunks_amx2(j, c0, c1);
      }
    });
    return;
  }
  at::parallel_for(0, j.g.nb / NB, grain, [&](int64_t c0, int64_t c1) { run_chunks(j, c0, c1); });
}

// ---- packing -------------------------------------------------------------------------------------

// Logical weight row -> (packed block, lane). Interleaved: rows [0, half) are the gate, [half, n) up.
struct RowMap {
  int64_t half;  // rows per half when interleaved, else 0
  int64_t block(int64_t r) const { return half ? 2 * (r % half / 16) + r / half : r / 16; }
  int64_t lane(int64_t r) const { return (half ? r % half : r) % 16; }
};

Geometry geometry(int64_t n, int64_t k, bool interleave, int64_t groups) {
  const int64_t blocks = interleave ? 2 * ((n / 2 + 15) / 16) : (n + 15) / 16;
  const int64_t k2 = k + (k & 1);
  return {n, k, k2, (blocks + NB - 1) / NB * NB, groups, groups == 1 ? k2 / 2 : k / groups / 2};
}

template <typename T>
void pack_rows(const T* w, const Geometry& g, const RowMap& map, T* out) {
  const int64_t kp = g.k2 / 2;
  at::parallel_for(0, g.n, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      T* dst = out + map.block(r) * kp * 32 + map.lane(r) * 2;
      for (int64_t c = 0; c < g.k; ++c) dst[(c / 2) * 32 + (c & 1)] = w[r * g.k + c];
    }
  });
}

void check_weight(const at::Tensor& w, bool interleave) {
  TORCH_CHECK(w.device().is_cpu() && w.dim() == 2 && w.is_contiguous(), "gemv_pack: weight must be contiguous [N, K]");
  TORCH_CHECK(!interleave || w.size(0) % 2 == 0, "gemv_pack: an interleaved gate/up weight needs an even N");
}

at::Tensor gemv_pack_bf16(const at::Tensor& w, bool interleave) {
  TORCH_CHECK(w.scalar_type() == at::kBFloat16, "gemv_pack_bf16: weight must be bfloat16");
  check_weight(w, interleave);
  const Geometry g = geometry(w.size(0), w.size(1), interleave, 1);
  auto out = at::zeros({g.nb, g.k2 / 2, 16, 2}, w.options());
  pack_rows(reinterpret_cast<const uint16_t*>(w.data_ptr()), g, RowMap{interleave ? g.n / 2 : 0},
            reinterpret_cast<uint16_t*>(out.data_ptr()));
  return out;
}

std::tuple<at::Tensor, at::Tensor> gemv_pack_int8(const at::Tensor& q, const at::Tensor& scales, bool interleave) {
  // q: int8 [N, K]; scales: float32 [N, G]: G = 1 per channel, else groups of K / G (even) columns.
  TORCH_CHECK(q.scalar_type() == at::kChar, "gemv_pack_int8: weight must be int8");
  check_weight(q, interleave);
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.dim() == 2 && scales.size(0) == q.size(0) &&
                  scales.is_contiguous() && scales.size(1) >= 1 && q.size(1) % scales.size(1) == 0 &&
                  (scales.size(1) == 1 || (q.size(1) / scales.size(1)) % 2 == 0),
              "gemv_pack_int8: scales must be contiguous float32 [N, G], G dividing K into even groups");
  const Geometry g = geometry(q.size(0), q.size(1), interleave, scales.size(1));
  auto out = at::zeros({g.nb, g.k2 / 2, 16, 2}, q.options());
  auto packed_scales = at::zeros({g.nb, g.groups, 16}, scales.options());
  const RowMap map{interleave ? g.n / 2 : 0};
  pack_rows(q.data_ptr<int8_t>(), g, map, out.data_ptr<int8_t>());
  const float* s = scales.data_ptr<float>();
  float* ps = packed_scales.data_ptr<float>();
  for (int64_t r = 0; r < g.n; ++r)
    for (int64_t gi = 0; gi < g.groups; ++gi) ps[(map.block(r) * g.groups + gi) * 16 + map.lane(r)] = s[r * g.groups + gi];
  return {out, packed_scales};
}

// The logical weight back from a packed one, dequantized (INT8) and in `dtype`: [N, K]. Walks each
// block in its stored order, writing its 16 rows two columns at a time.
template <typename T, typename O>
void unpack_rows(const T* packed, const float* scales, const Geometry& g, const RowMap& map, O* out) {
  const int64_t kp = g.k2 / 2, group = g.groups == 1 ? g.k2 : 2 * g.group_pairs;
  at::parallel_for(0, g.n, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t blk = map.block(r), lane = map.lane(r);
      const T* src = packed + blk * kp * 32 + lane * 2;
      for (int64_t c = 0; c < g.k; ++c) {
        const float v = static_cast<float>(src[(c / 2) * 32 + (c & 1)]);
        out[r * g.k + c] = static_cast<O>(scales ? v * scales[(blk * g.groups + c / group) * 16 + lane] : v);
      }
    }
  });
}

// INT8 -> bf16 for even K, vectorised (the large-batch path dequantizes every call): per block and
// column pair, 32 weights widened, scaled per row and group, rounded to bf16, and scattered as 16
// 32-bit pairs into their rows.
// One block of 16 rows (a lambda would not carry the target attribute: on a CPU without AVX-512 the
// file then fails to compile, and the whole library loses these kernels).
TM_AVX512 void unpack_int8_block(const int8_t* packed, const float* scales, const Geometry& g, const RowMap& map,
                                 uint16_t* out, int64_t blk) {
  const int64_t kp = g.k2 / 2, group = g.groups == 1 ? g.k2 : 2 * g.group_pairs;
  const __m512i lo_lanes = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
  const __m512i hi_lanes = _mm512_add_epi32(lo_lanes, _mm512_set1_epi32(8));
  alignas(64) int32_t row_unit[16];  // first 32-bit unit of each lane's output row
  __mmask16 valid = 0;
  for (int l = 0; l < 16; ++l) {
    const int64_t r = map.half ? (blk % 2) * map.half + (blk / 2) * 16 + l : blk * 16 + l;
    const bool ok = map.half ? (blk / 2) * 16 + l < map.half : r < g.n;
    row_unit[l] = ok ? static_cast<int32_t>(r * kp) : 0;
    valid |= ok ? static_cast<__mmask16>(1u << l) : 0;
  }
  if (!valid) return;
  const __m512i rows = _mm512_load_si512(row_unit);
  uint32_t* units = reinterpret_cast<uint32_t*>(out);
  for (int64_t p = 0; p < kp; ++p) {
    const int8_t* src = packed + (blk * kp + p) * 32;
    const __m512 sc = _mm512_loadu_ps(scales + (blk * g.groups + 2 * p / group) * 16);
    const __m512 lo = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src)))),
                                    _mm512_permutexvar_ps(lo_lanes, sc));
    const __m512 hi = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 16)))),
                                    _mm512_permutexvar_ps(hi_lanes, sc));
    const __m512i pairs = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(hi, lo));
    _mm512_mask_i32scatter_epi32(units, valid, _mm512_add_epi32(rows, _mm512_set1_epi32(static_cast<int32_t>(p))),
                                 pairs, 4);
  }
}

void unpack_int8_bf16(const int8_t* packed, const float* scales, const Geometry& g, const RowMap& map,
                      uint16_t* out) {
  at::parallel_for(0, g.nb, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t blk = b0; blk < b1; ++blk) unpack_int8_block(packed, scales, g, map, out, blk);
  });
}

at::Tensor gemv_unpack(const at::Tensor& packed, const c10::optional<at::Tensor>& scales, int64_t n, int64_t k,
                       bool interleave, at::ScalarType dtype) {
  const bool int8 = packed.scalar_type() == at::kChar;
  TORCH_CHECK(int8 == scales.has_value(), "gemv_unpack: scales go with int8 weights, and only with them");
  TORCH_CHECK(int8 || packed.scalar_type() == at::kBFloat16, "gemv_unpack: a bf16 or int8 packed weight");
  const Geometry g = geometry(n, k, interleave, int8 ? scales->size(1) : 1);
  TORCH_CHECK(packed.is_contiguous() && packed.dim() == 4 && packed.size(0) == g.nb && packed.size(1) == g.k2 / 2,
              "gemv_unpack: the packed weight does not match N, K");
  TORCH_CHECK(dtype == at::kBFloat16 || dtype == at::kFloat, "gemv_unpack: dtype must be bfloat16 or float32");
  auto out = at::empty({n, k}, packed.options().dtype(dtype));
  const RowMap map{interleave ? n / 2 : 0};
  const float* sp = int8 ? scales->data_ptr<float>() : nullptr;
  if (int8 && dtype == at::kFloat) {
    unpack_rows(packed.data_ptr<int8_t>(), sp, g, map, out.data_ptr<float>());
  } else if (int8 && k % 2 == 0 && supported("int8") && n * (k / 2) < (int64_t{1} << 31)) {
    unpack_int8_bf16(packed.data_ptr<int8_t>(), sp, g, map, reinterpret_cast<uint16_t*>(out.data_ptr()));
  } else if (int8) {
    unpack_rows(packed.data_ptr<int8_t>(), sp, g, map, out.data_ptr<c10::BFloat16>());
  } else if (dtype == at::kFloat) {
    unpack_rows(packed.data_ptr<c10::BFloat16>(), sp, g, map, out.data_ptr<float>());
  } else {
    unpack_rows(packed.data_ptr<c10::BFloat16>(), sp, g, map, out.data_ptr<c10::BFloat16>());
  }
  return out;
}

// ---- calls ---------------------------------------------------------------------------------------

// Row r of x: q[r] = round(x[r] / scale[r]) with scale[r] = max |x[r]| / 32767 (1 for a zero row).
template <typename T>
void quantize_rows(const T* x, int64_t m, int64_t k, int64_t k2, int16_t* q, float* scale) {
  at::parallel_for(0, m, 8, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* xr = x + r * k;
      float amax = 0.f;
      for (int64_t c = 0; c < k; ++c) amax = std::max(amax, std::fabs(static_cast<float>(xr[c])));
      const float s = amax > 0.f ? amax / 32767.f : 1.f, inv = 1.f / s;
      for (int64_t c = 0; c < k; ++c) q[r * k2 + c] = static_cast<int16_t>(std::clamp(std::nearbyint(static_cast<float>(xr[c]) * inv), -32767.f, 32767.f));
      scale[r] = s;
    }
  });
}

// x [M, K] as 16-bit rows of k2 columns: bf16 as it is (padded when K is odd), or for INT8 int16
// quantized per row (x = q * scale, |q| <= 32767), the scales into `scale`.
at::Tensor x_rows(const at::Tensor& x2d, int64_t k2, bool int8, at::Tensor* scale) {
  if (!int8) {
    TORCH_CHECK(x2d.scalar_type() == at::kBFloat16, "gemv: bf16 weights need bf16 x");
    if (x2d.size(1) == k2 && x2d.is_contiguous()) return x2d;
    auto padded = at::zeros({x2d.size(0), k2}, x2d.options());
    padded.narrow(1, 0, x2d.size(1)).copy_(x2d);
    return padded;
  }
  *scale = at::empty({x2d.size(0)}, x2d.options().dtype(at::kFloat));
  auto q = at::zeros({x2d.size(0), k2}, x2d.options().dtype(at::kShort));
  const at::Tensor xc = x2d.contiguous();
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, xc.scalar_type(), "gemv_quantize_rows", [&] {
    quantize_rows(xc.data_ptr<scalar_t>(), x2d.size(0), x2d.size(1), k2, q.data_ptr<int16_t>(), scale->data_ptr<float>());
  });
  return q;
}

at::Tensor call(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& scales, int64_t n,
                int64_t k, const c10::optional<at::Tensor>& bias, bool silu, bool blocked = false, bool split = false) {
  const bool int8 = packed.scalar_type() == at::kChar;
  TORCH_CHECK(supported(int8 ? "int8" : "bf16"), "gemv: this CPU lacks the AVX-512 instructions these kernels use");
  TORCH_CHECK(x.device().is_cpu() && x.dim() >= 1 && x.size(-1) == k, "gemv: x must be a CPU tensor [..., K]");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat, "gemv: x must be bf16 or float32");
  TORCH_CHECK(int8 == scales.has_value(), "gemv: scales go with int8 weights, and only with them");
  TORCH_CHECK(!(silu || split) || n % 2 == 0, "gemv_silu_mul / gemv_split: N (gate + up) must be even");
  const int64_t groups = int8 ? scales->size(1) : 1;
  const Geometry g = geometry(n, k, silu || split, groups);
  TORCH_CHECK(packed.is_contiguous() && packed.dim() == 4 && packed.size(0) == g.nb && packed.size(1) == g.k2 / 2,
              "gemv: the packed weight does not match N, K");
  TORCH_CHECK(!int8 || (scales->dim() == 3 && scales->size(0) == g.nb && scales->is_contiguous() &&
                        scales->scalar_type() == at::kFloat && (groups == 1 || k % groups == 0)),
              "gemv: the packed scales do not match the weight");
  at::Tensor bias_f;
  if (bias.has_value()) {
    TORCH_CHECK(bias->numel() == n, "gemv: bias must have N elements");
    bias_f = bias->to(at::kFloat).contiguous();
  }
  const at::Tensor x2d = x.reshape({-1, k});
  at::Tensor x_scale;
  const at::Tensor rows = x_rows(x2d, g.k2, int8, &x_scale);
  const int64_t out_cols = silu ? n / 2 : n;
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = out_cols;
  auto out = at::empty(shape, x.options());
  if (x2d.size(0) == 0) return out;
  const Job j{reinterpret_cast<const uint16_t*>(rows.data_ptr()), x2d.size(0),
              int8 ? x_scale.data_ptr<float>() : nullptr, packed.data_ptr(),
              int8 ? scales->data_ptr<float>() : nullptr, bias.has_value() ? bias_f.data_ptr<float>() : nullptr,
              g, silu, out.data_ptr(), x.scalar_type() == at::kBFloat16, out_cols, blocked, split};
  run(j);
  return out;
}

at::Tensor gemv(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& scales, int64_t n,
                int64_t k, const c10::optional<at::Tensor>& bias) {
  return call(x, packed, scales, n, k, bias, false);
}

at::Tensor gemv_silu_mul(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& scales,
                         int64_t n, int64_t k, const c10::optional<at::Tensor>& bias) {
  return call(x, packed, scales, n, k, bias, true);
}

// y = x W^T + b = [gate | up] for a weight packed interleaved (a gated MLP's gate/up, for silu_mul): the
// product itself, for a caller that adds to it before the activation (LoRA deltas).
at::Tensor gemv_split(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& scales,
                      int64_t n, int64_t k, const c10::optional<at::Tensor>& bias) {
  return call(x, packed, scales, n, k, bias, false, false, true);
}

// y = x W^T + b for a bf16 weight, summed in oneDNN's AMX order (tile_bf16_blocked): the batch-invariant
// mode's small-batch product, bit-identical to oneDNN's where the start-up check finds it so.
at::Tensor gemv_blocked(const at::Tensor& x, const at::Tensor& packed, int64_t n, int64_t k,
                        const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(packed.scalar_type() == at::kBFloat16 && x.scalar_type() == at::kBFloat16,
              "gemv_blocked: bf16 x and a bf16 packed weight");
  return call(x, packed, c10::nullopt, n, k, bias, false, true);
}

bool gemv_supported(c10::string_view kind) { return supported(std::string(kind)); }

// silu(gate) * up of a bf16 [T, 2I] = [gate | up] product, with the fused product's arithmetic and
// roundings (silu_mul above): a LoRA step's gate/up takes the adapters' delta between the product and
// the activation, so the fused product cannot run there; this keeps its activation what the fused
// product gives the same rows (and costs one pass, where PyTorch's silu and mul take two and an
// intermediate). Off AVX512-BF16 CPUs: PyTorch's silu and mul.
at::Tensor silu_mul_rows(const at::Tensor& gu) {
  TORCH_CHECK(gu.device().is_cpu() && gu.scalar_type() == at::kBFloat16 && gu.dim() == 2 && gu.size(1) % 2 == 0 &&
                  gu.stride(1) == 1,
              "silu_mul: gu must be a bf16 CPU matrix [T, 2I] with contiguous rows");
  const int64_t rows = gu.size(0), half = gu.size(1) / 2;
  if (!has("bf16")) {
    auto parts = gu.chunk(2, -1);
    return at::silu(parts[0]) * parts[1];
  }
  at::Tensor out = at::empty({rows, half}, gu.options());
  const uint16_t* src = reinterpret_cast<const uint16_t*>(gu.data_ptr<at::BFloat16>());
  uint16_t* dst = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  const int64_t ld = gu.stride(0);
  at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / std::max<int64_t>(1, half)), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) silu_mul_row(src + r * ld, dst + r * half, half);
  });
  return out;
}

// Sums 64-bit words [b, e) in eight independent lanes (one AVX-512 register once vectorised).
uint64_t sum_words(const uint64_t* p, int64_t b, int64_t e) {
  uint64_t lane[8] = {};
  int64_t i = b;
  for (; i + 8 <= e; i += 8)
    for (int l = 0; l < 8; ++l) lane[l] += p[i + l];
  uint64_t s = 0;
  for (; i < e; ++i) s += p[i];
  for (int l = 0; l < 8; ++l) s += lane[l];
  return s;
}

int64_t read_sum(const at::Tensor& buf) {
  // Reads every byte of a buffer over the intra-op threads (a memory-read probe for bench floor).
  TORCH_CHECK(buf.is_contiguous() && buf.nbytes() % 8 == 0, "read_sum: contiguous, whole 64-bit words");
  const uint64_t* p = static_cast<const uint64_t*>(buf.data_ptr());
  const int64_t words = static_cast<int64_t>(buf.nbytes() / 8);
  std::atomic<uint64_t> total{0};
  at::parallel_for(0, words, 1 << 16, [&](int64_t b, int64_t e) { total += sum_words(p, b, e); });
  return static_cast<int64_t>(total.load());
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tokenmill, m) {
  m.def("gemv_supported(str kind) -> bool");
  m.def("gemv_pack_bf16(Tensor w, bool interleave) -> Tensor");
  m.def("gemv_pack_int8(Tensor q, Tensor scales, bool interleave) -> (Tensor, Tensor)");
  m.def("gemv(Tensor x, Tensor packed, Tensor? scales, int n, int k, Tensor? bias) -> Tensor");
  m.def("gemv_silu_mul(Tensor x, Tensor packed, Tensor? scales, int n, int k, Tensor? bias) -> Tensor");
  m.def("gemv_blocked(Tensor x, Tensor packed, int n, int k, Tensor? bias) -> Tensor");
  m.def("gemv_split(Tensor x, Tensor packed, Tensor? scales, int n, int k, Tensor? bias) -> Tensor");
  m.def("gemv_unpack(Tensor packed, Tensor? scales, int n, int k, bool interleave, ScalarType dtype) -> Tensor");
  m.def("read_sum(Tensor buf) -> int");
  m.def("silu_mul(Tensor gu) -> Tensor");
  m.impl("silu_mul", c10::DispatchKey::CPU, TORCH_FN(silu_mul_rows));
  m.impl("gemv_supported", c10::DispatchKey::CatchAll, TORCH_FN(gemv_supported));
  m.impl("gemv_pack_bf16", c10::DispatchKey::CPU, TORCH_FN(gemv_pack_bf16));
  m.impl("gemv_pack_int8", c10::DispatchKey::CPU, TORCH_FN(gemv_pack_int8));
  m.impl("gemv", c10::DispatchKey::CPU, TORCH_FN(gemv));
  m.impl("gemv_silu_mul", c10::DispatchKey::CPU, TORCH_FN(gemv_silu_mul));
  m.impl("gemv_blocked", c10::DispatchKey::CPU, TORCH_FN(gemv_blocked));
  m.impl("gemv_split", c10::DispatchKey::CPU, TORCH_FN(gemv_split));
  m.impl("gemv_unpack", c10::DispatchKey::CPU, TORCH_FN(gemv_unpack));
  m.impl("read_sum", c10::DispatchKey::CPU, TORCH_FN(read_sum));
}
