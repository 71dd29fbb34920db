// The small-batch bf16 linear kernel on the AMX tile unit (Sapphire Rapids and later), 1..32 rows.
// Torch-free; engine/kernels/csrc/cpu_gemv.cpp runs it where isa.h allows the tile unit.
//
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
#include "amx.h"
#include "gemv_avx512.h"

#define TM_AMX __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx512vnni,fma")))

namespace tokenmill::gemv::amx {

using ::tokenmill::TileConfig;
using avx512::store_tile;

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
bool applies(const Job& j) { return j.w_scale == nullptr && j.m >= 1 && j.m <= 2 * AMX_ROWS && j.g.k2 % 32 == 0; }

namespace {

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

}  // namespace

TM_AMX void run_chunks(const Job& j, int64_t c0, int64_t c1) {
  if (j.m <= AMX_ROWS) {
    run_chunks_amx(j, c0, c1);
  } else {
    run_chunks_amx2(j, c0, c1);
  }
}

}  // namespace tokenmill::gemv::amx
