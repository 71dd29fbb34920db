// The LoRA delta on the AMX tile unit (bf16 rows and pairs, `in` a multiple of 32; Sapphire Rapids and
// later): 16 rows of one adapter at a time, each pair in the tile layouts of kernels/lora.h. Shrink:
// tmp [16 rows, 16 ranks] = x_rows A^T, the rows gathered as the A operand against A re-laid in column
// pairs; tmp split exactly into three bf16 terms (hi + mid + lo = the float32 sum: the expand's
// products keep float32 precision, as the AVX-512 path's). Expand: per 16 output columns of a span and
// 16 of its ranks, (hi + mid + lo) x the B^T tile into a float32 C tile, added to y's rows in float32,
// rounded once. The parallel region that runs these is engine/kernels/csrc/cpu_lora.cpp's. Torch-free.
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "amx.h"
#include "bf16_avx512.h"
#include "lora.h"
#include "silu_avx512.h"

#define TM_LORA_AMX __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx512vnni,fma")))

namespace tokenmill::lora::amx {

using namespace ::tokenmill::avx512;  // rne16, widen16, load16, tail

// The tiles of a group of n rows (a tile's rows are the group's: a tdpbf16ps, and a tile store, cost
// in proportion to them; ldtilecfg zeroes every tile). The shrink's: 0, 1: x rows (n x 32 columns);
// 2, 3: A (16 column pairs x 16 ranks); 4-7: C (n x 16 ranks), four chains of products.
TM_LORA_AMX void tiles_for_shrink(int n) {
  tokenmill::TileConfig cfg;
  for (int t : {0, 1, 4, 5, 6, 7}) cfg.rows[t] = static_cast<uint8_t>(n), cfg.colsb[t] = 64;
  for (int t : {2, 3}) cfg.rows[t] = 16, cfg.colsb[t] = 64;
  tokenmill::load_tile_config(cfg);
}
// The expand's: 0, 1, 2: hi, mid, lo (n x 16 ranks); 3, 4: B (8 rank pairs x 16 columns); 5, 6: C
// (n x 16 columns float32).
TM_LORA_AMX void tiles_for_expand(int n) {
  tokenmill::TileConfig cfg;
  for (int t : {0, 1, 2}) cfg.rows[t] = static_cast<uint8_t>(n), cfg.colsb[t] = 32;
  for (int t : {3, 4}) cfg.rows[t] = 8, cfg.colsb[t] = 64;
  for (int t : {5, 6}) cfg.rows[t] = static_cast<uint8_t>(n), cfg.colsb[t] = 64;
  tokenmill::load_tile_config(cfg);
}

// One group's shrink: for j < n and r < R, v = sum_c A[r][c] x[rows[j]][c], split exactly into three
// bf16 terms v = hi + mid + lo (each remainder a float32 difference with no rounding), at
// terms[q * 16 * rp + j * rp + r] (q = hi, mid, lo); the rest of terms stays as given (zero). xg: room
// for 16 x in, the group's n rows gathered there; the tiles configured for n rows (tiles_for_shrink).
TM_LORA_AMX void shrink(const bf16* xp, const int64_t* rows, int n, int64_t in, const bf16* pa, int64_t R,
                            int64_t rp, bf16* xg, uint16_t* terms) {
  for (int j = 0; j < n; ++j) std::memcpy(static_cast<void*>(xg + j * in), xp + rows[j] * in, in * sizeof(bf16));
  const int64_t kcs = in / 32;
  alignas(64) float c[4][16][16];
  for (int64_t rt = 0; rt < (R + 15) / 16; ++rt) {
    const bf16* at = pa + rt * kcs * 512;
    _tile_zero(4);
    _tile_zero(5);
    _tile_zero(6);
    _tile_zero(7);
    // four chains of products (32 columns kc, kc + 1, kc + 2, kc + 3): a product's latency is several
    // times its issue interval, so one or two chains leave the tile unit waiting
    for (int64_t kc = 0; kc < kcs; kc += 4) {
      _tile_loadd(0, xg + kc * 32, in * 2);
      _tile_loadd(2, at + kc * 512, 64);
      _tile_dpbf16ps(4, 0, 2);
      if (kc + 1 < kcs) {
        _tile_loadd(1, xg + kc * 32 + 32, in * 2);
        _tile_loadd(3, at + kc * 512 + 512, 64);
        _tile_dpbf16ps(5, 1, 3);
      }
      if (kc + 2 < kcs) {
        _tile_loadd(0, xg + kc * 32 + 64, in * 2);
        _tile_loadd(2, at + kc * 512 + 1024, 64);
        _tile_dpbf16ps(6, 0, 2);
      }
      if (kc + 3 < kcs) {
        _tile_loadd(1, xg + kc * 32 + 96, in * 2);
        _tile_loadd(3, at + kc * 512 + 1536, 64);
        _tile_dpbf16ps(7, 1, 3);
      }
    }
    _tile_stored(4, c[0], 64);
    _tile_stored(5, c[1], 64);
    _tile_stored(6, c[2], 64);
    _tile_stored(7, c[3], 64);
    const __mmask16 m = tail(R - 16 * rt);
    for (int j = 0; j < n; ++j) {  // a row's 16 ranks at once, the chains summed in a fixed order
      const __m512 v = _mm512_add_ps(_mm512_add_ps(_mm512_load_ps(c[0][j]), _mm512_load_ps(c[1][j])),
                                     _mm512_add_ps(_mm512_load_ps(c[2][j]), _mm512_load_ps(c[3][j])));
      const __m512i hi = rne16(v);
      const __m512 rest = _mm512_sub_ps(v, widen16(hi));
      const __m512i mid = rne16(rest);
      const __m512i lo = rne16(_mm512_sub_ps(rest, widen16(mid)));
      uint16_t* t = terms + j * rp + 16 * rt;
      _mm256_mask_storeu_epi16(t, m, _mm512_cvtepi32_epi16(hi));
      _mm256_mask_storeu_epi16(t + 16 * rp, m, _mm512_cvtepi32_epi16(mid));
      _mm256_mask_storeu_epi16(t + 32 * rp, m, _mm512_cvtepi32_epi16(lo));
    }
  }
}

// y[0:cols] += c[0:cols] (c float32, 64-byte aligned), rounded to bf16 once (nearest even, as the base
// product's epilogue rounds: cpu_gemv.cpp): 32 columns a step, one load and one store of y each.
TM_LORA_AMX inline void add_row(bf16* y, const float* c, int64_t cols) {
  int64_t o = 0;
  for (; o + 32 <= cols; o += 32) {
    const __m512i v = _mm512_loadu_si512(y + o);
    const __m512 lo = _mm512_add_ps(widen16(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(v))), _mm512_load_ps(c + o));
    const __m512 hi = _mm512_add_ps(widen16(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(v, 1))), _mm512_load_ps(c + o + 16));
    _mm512_storeu_si512(y + o, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(hi, lo)));
  }
  for (; o < cols; o += 16) {
    const __mmask16 m = tail(cols - o);
    const __m512 v = _mm512_add_ps(load16(y + o, m), _mm512_load_ps(c + o));
    _mm256_mask_storeu_epi16(y + o, m, reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v)));
  }
}

// One adapter's delta for every group of its rows over output columns [q0, q1) (whole blocks of its
// spans from c0), span by span, group by group across the columns (y swept row-major), two blocks of
// 16 columns at a time (two C tiles: two chains of products at once): per step of 16 ranks,
// C += hi x B + mid x B + lo x B, then y[row] += C[row] in float32, rounded once.
// cfg: the rows the tiles are configured for (tiles_for_expand), kept across calls.
TM_LORA_AMX void expand(bf16* yp, const std::vector<int64_t>& seg, int64_t g_lo, int64_t g_hi,
                            int64_t out, const bf16* pb, const Spans& spans, int64_t rp, const uint16_t* terms, int64_t q0,
                            int64_t q1, int& cfg) {
  constexpr int64_t CHUNK = 8;  // blocks of 16 columns per pass over y
  alignas(64) float cb[16 * CHUNK * 16];
  for (const Span& sp : spans) {
    if (sp.c0 >= sp.c1 || sp.r0 >= sp.r1) continue;
    const int64_t rw = sp.r0 & ~int64_t{15}, steps = span_steps(sp), blocks = span_blocks(sp);
    const bf16* span_pb = pb;
    pb += steps * blocks * 256;
    // this share's blocks: those whose first column lies in [q0, q1)
    const int64_t b_lo = std::max<int64_t>(0, (q0 - sp.c0 + 15) / 16), b_hi = std::min(blocks, (q1 - sp.c0 + 15) / 16);
    if (q1 <= sp.c0 || b_lo >= b_hi) continue;
    for (int64_t g = g_lo; g < g_hi; ++g) {
      const uint16_t* tg = terms + g * 48 * rp + rw;
      const int n = static_cast<int>(std::min<int64_t>(AMX_ROWS, static_cast<int64_t>(seg.size()) - g * AMX_ROWS));
      if (n != cfg) tiles_for_expand(cfg = n);
      if (steps == 1) {  // the A tiles stay loaded across the columns
        _tile_loadd(0, tg, rp * 2);
        _tile_loadd(1, tg + 16 * rp, rp * 2);
        _tile_loadd(2, tg + 32 * rp, rp * 2);
      }
      // CHUNK blocks at a time: their C tiles stored side by side (cb: n rows x CHUNK * 16 columns),
      // then added to y's rows in runs of CHUNK * 16 columns
      for (int64_t bc = b_lo; bc < b_hi; bc += CHUNK) {
        const int64_t be = std::min(b_hi, bc + CHUNK);
        for (int64_t b = bc; b < be; b += 2) {
          const bool two = b + 1 < be;
          _tile_zero(5);
          _tile_zero(6);
          for (int64_t st = 0; st < steps; ++st) {
            if (steps > 1) {
              _tile_loadd(0, tg + 16 * st, rp * 2);
              _tile_loadd(1, tg + 16 * rp + 16 * st, rp * 2);
              _tile_loadd(2, tg + 32 * rp + 16 * st, rp * 2);
            }
            const bf16* bb = span_pb + (st * blocks + b) * 256;
            _tile_loadd(3, bb, 64);
            _tile_dpbf16ps(5, 0, 3);
            if (two) {
              _tile_loadd(4, bb + 256, 64);
              _tile_dpbf16ps(6, 0, 4);
              _tile_dpbf16ps(5, 1, 3);
              _tile_dpbf16ps(6, 1, 4);
              _tile_dpbf16ps(5, 2, 3);
              _tile_dpbf16ps(6, 2, 4);
            } else {
              _tile_dpbf16ps(5, 1, 3);
              _tile_dpbf16ps(5, 2, 3);
            }
          }
          _tile_stored(5, cb + (b - bc) * 16, CHUNK * 64);
          if (two) _tile_stored(6, cb + (b - bc + 1) * 16, CHUNK * 64);
        }
        const int64_t o0 = sp.c0 + 16 * bc, cols = std::min(sp.c1, sp.c0 + 16 * be) - o0;
        for (int j = 0; j < n; ++j) add_row(yp + seg[g * AMX_ROWS + j] * out + o0, cb + j * CHUNK * 16, cols);
      }
    }
  }
}


TM_LORA_AMX void release() { _tile_release(); }

TM_LORA_AMX void activate(const bf16* y, bf16* act, int64_t half) {
  ::tokenmill::avx512::silu_mul_row(reinterpret_cast<const uint16_t*>(y), reinterpret_cast<uint16_t*>(act), half);
}

}  // namespace tokenmill::lora::amx
