// The LoRA delta of one linear for every row of a step in one call (CPU):
//     y[t] += (A_s x[t]) B_s^T      for each row t on adapter s = slots[t] (-1: the base model)
// with A_s [R_s, in] and B_s^T [R_s, out] (the adapter's scale folded into B); an adapter that does
// not target the linear passes two empty tensors. x and y are float32 or both bf16, the pairs float32
// or (with bf16 rows) bf16, half the bytes a step reads: everything is widened on the fly, the delta
// summed in float32 and added to y's row in float32, rounded to bf16 once (PyTorch's bf16 products
// would round after each of the three ops). Registered as
// torch.ops.tokenmill.lora_add_ (engine/lora/batch.py) and called by the C++ decode loop directly
// (lora.h, cpu_decode.cpp).
//
// Why: the PyTorch form costs four dispatched ops per adapter and linear (gather the adapter's rows,
// two thin products, scatter-add): with 4 adapters on SmolLM2-135M's 30 layers, ~2,000 ops a decode
// step, mostly dispatch. Here one call per linear does every adapter in two phases: each row's R_s
// shrink sums (dot products over `in`, contiguous) into a small buffer, then per block of output
// columns each row's R_s scaled rows of B^T added into y (blocks go to the threads, so a one-row
// decode uses them all, and a block of B^T stays in L1 across one adapter's rows). A base-model row
// costs nothing.
//
// Spans: a fused linear's B^T is block-diagonal (engine/lora/adapter.py: q/k/v or gate/up side by side,
// each shard's ranks feeding only its own columns). Each segment may say where its B^T is non-zero,
// as rows (c0, c1, r0, r1): output columns [c0, c1) take ranks [r0, r1); the kernel reads and
// multiplies nothing else (columns outside every span get no delta), a third of qkv's and half of
// gate/up's expand at equal ranks. An empty spans tensor: the whole B^T.
//
// AMX (Sapphire Rapids and later; bf16 rows and pairs, `in` a multiple of 32): 16 rows of one adapter at a time on the tile unit, each pair in tile layouts
// (pack_pair: given per adapter as `packed`, made once when the adapter is placed by lora_pack_bf16,
// else made here per call). Shrink: tmp [16 rows, 16 ranks] = x_rows A^T, the rows gathered as the A
// operand against A re-laid in column pairs; tmp split exactly into three bf16 terms (hi + mid + lo =
// the float32 sum: the expand's products keep float32 precision, as the AVX-512 path's). Expand: per
// 16 output columns of a span and 16 of its ranks, (hi + mid + lo) x the B^T tile into a float32 C
// tile, added to y's rows in float32, rounded once. TOKENMILL_CPU_AMX=0 keeps AVX-512.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

#include "amx.h"
#include "lora.h"

#define TM_LORA_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl")))
#if defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 11
#define TM_LORA_HAS_AMX 1
#define TM_LORA_AMX __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512bf16")))
#include "silu.h"
#endif

namespace {

using Span = tokenmill::LoraSpan;
using Spans = std::vector<Span>;
using tokenmill::LoraLinear;

struct Group {  // rows [first, first + n) of adapter s's rows
  int64_t s, first;
  int n;
};

// Every per-call list of lora_add_, kept per thread across calls (their capacity reused): a decode step
// makes 120 calls, whose ~50 small allocations each cost ~1 ms a step of the master thread's time, the
// other threads waiting.
struct Scratch {
  LoraLinear lin;  // the op's call: its adapters (the decode loop's are prepared once: lora.h)
  std::vector<const at::BFloat16*> pa, pb;  // pairs in the tile layouts, where some are packed per call
  std::vector<std::vector<int64_t>> segments;  // each adapter's rows, in order
  std::vector<Group> groups;
  std::vector<int64_t> first_group;
  std::vector<uint16_t> terms;
  std::vector<int64_t> plain;  // rows without a delta (delta_amx's activation)
  std::vector<float> tmp;
};

Scratch& scratch() {
  thread_local Scratch s;
  return s;
}

// lin's A and B^T data as W (null where an adapter does not target the linear)
template <typename W>
const W* const* a_data(const LoraLinear& lin) { return reinterpret_cast<const W* const*>(lin.ap.data()); }
template <typename W>
const W* const* bt_data(const LoraLinear& lin) { return reinterpret_cast<const W* const*>(lin.bp.data()); }

// v's first n lists, each emptied (their capacity kept)
template <typename V>
void reset_lists(std::vector<V>& v, size_t n) {
  if (v.size() < n) v.resize(n);
  for (size_t i = 0; i < n; ++i) v[i].clear();
}

// ---- AVX-512 (most x86 servers): rows of one adapter in groups of up to 4, register tiles ------------
// The portable loops below re-read an adapter's A and B^T for every row, ~15 GMAC/s on a 2-vCPU Xeon
// at 32 rows; here 4 rows of one adapter share each load: 16 accumulators (4 ranks or 64 columns x 4
// rows), each weight vector loaded once per group.

constexpr int64_t GROUP = 4;  // rows of one adapter per register tile

bool avx512() {
  static const bool ok = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl");
  }();
  return ok;
}

// bf16 bits (round to nearest even, finite values) of each float32 lane, in the lane's low 16 bits, and
// back to float32.
TM_LORA_AVX512 inline __m512i rne16(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  return _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), lsb)), 16);
}
TM_LORA_AVX512 inline __m512 widen16(__m512i h) { return _mm512_castsi512_ps(_mm512_slli_epi32(h, 16)); }

TM_LORA_AVX512 inline __m512 load16(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
TM_LORA_AVX512 inline __m512 load16(const at::BFloat16* p, __mmask16 m) {
  return widen16(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)));
}
TM_LORA_AVX512 inline void store16(float* p, __m512 v, __mmask16 m) { _mm512_mask_storeu_ps(p, m, v); }
TM_LORA_AVX512 inline void store16(at::BFloat16* p, __m512 v, __mmask16 m) {
  _mm256_mask_storeu_epi16(p, m, _mm512_cvtepi32_epi16(rne16(v)));
}
inline __mmask16 tail(int64_t n) { return n >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << n) - 1); }

// tmp[rows[i], r] = A[r] . x[rows[i]] for the n <= GROUP rows of one adapter of rank R.
template <typename T, typename W>
TM_LORA_AVX512 void shrink_group(const T* xp, const int64_t* rows, int n, int64_t in, const W* a, int64_t R,
                                 int64_t max_rank, float* tmp) {
  const T* xr[GROUP];
  for (int i = 0; i < GROUP; ++i) xr[i] = xp + rows[std::min(i, n - 1)] * in;  // short groups repeat a row
  for (int64_t r0 = 0; r0 < R; r0 += 4) {
    const int nr = static_cast<int>(std::min<int64_t>(4, R - r0));
    __m512 acc[4][GROUP];
    for (int q = 0; q < 4; ++q)
      for (int i = 0; i < GROUP; ++i) acc[q][i] = _mm512_setzero_ps();
    for (int64_t c = 0; c < in; c += 16) {
      const __mmask16 m = tail(in - c);
      __m512 xv[GROUP];
      for (int i = 0; i < GROUP; ++i) xv[i] = load16(xr[i] + c, m);
      for (int q = 0; q < 4; ++q) {
        if (q >= nr) break;
        const __m512 av = load16(a + (r0 + q) * in + c, m);
        for (int i = 0; i < GROUP; ++i) acc[q][i] = _mm512_fmadd_ps(av, xv[i], acc[q][i]);
      }
    }
    for (int q = 0; q < nr; ++q)
      for (int i = 0; i < n; ++i) tmp[rows[i] * max_rank + r0 + q] = _mm512_reduce_add_ps(acc[q][i]);
  }
}

// y[rows[i], o0:o0+w] += tmp[rows[i], r_lo:r_hi] B^T[r_lo:r_hi, o0:o0+w] for n <= GROUP rows of one
// adapter, 64 columns (4 registers) at a time: each output is y, then + tmp[r] * B^T[r] for r in
// order (fused), one store.
template <typename T, typename W>
TM_LORA_AVX512 void expand_group(T* yp, const int64_t* rows, int n, int64_t out, const W* bt, int64_t r_lo,
                                 int64_t r_hi, int64_t max_rank, const float* tmp, int64_t o0, int64_t w) {
  for (int64_t o = o0; o < o0 + w; o += 64) {
    __mmask16 m[4];
    for (int v = 0; v < 4; ++v) m[v] = tail(std::max<int64_t>(0, o0 + w - (o + 16 * v)));
    __m512 acc[GROUP][4];
    for (int i = 0; i < n; ++i)
      for (int v = 0; v < 4; ++v) acc[i][v] = load16(yp + rows[i] * out + o + 16 * v, m[v]);
    for (int64_t r = r_lo; r < r_hi; ++r) {
      __m512 bv[4];
      for (int v = 0; v < 4; ++v) bv[v] = load16(bt + r * out + o + 16 * v, m[v]);
      for (int i = 0; i < GROUP; ++i) {
        if (i >= n) break;
        const __m512 t = _mm512_set1_ps(tmp[rows[i] * max_rank + r]);
        for (int v = 0; v < 4; ++v) acc[i][v] = _mm512_fmadd_ps(t, bv[v], acc[i][v]);
      }
    }
    for (int i = 0; i < n; ++i)
      for (int v = 0; v < 4; ++v) store16(yp + rows[i] * out + o + 16 * v, acc[i][v], m[v]);
  }
}

// Every adapter's rows (segments[s]: row indices in order) in groups of GROUP: the shrink over groups,
// the expand over blocks of COLS_512 output columns, both spread over the threads.
template <typename T, typename W>
void delta_avx512(T* yp, const T* xp, const LoraLinear& lin, Scratch& sc) {
  const int64_t in = lin.in, out = lin.out, n_ad = lin.n, max_rank = lin.max_rank;
  const W* const* ap = a_data<W>(lin);
  const W* const* bp = bt_data<W>(lin);
  const std::vector<std::vector<int64_t>>& segments = sc.segments;
  const std::vector<int64_t>& rank = lin.rank;
  const std::vector<Spans>& spans = lin.spans;
  float* tmp = sc.tmp.data();
  std::vector<Group>& groups = sc.groups;
  groups.clear();
  int64_t adapted = 0;
  for (int64_t s = 0; s < n_ad; ++s) {
    if (rank[s] == 0) continue;
    const int64_t k = static_cast<int64_t>(segments[s].size());
    adapted += k;
    for (int64_t i = 0; i < k; i += GROUP) groups.push_back({s, i, static_cast<int>(std::min<int64_t>(GROUP, k - i))});
  }
  if (groups.empty()) return;
  const int64_t work = adapted * max_rank;  // multiply-adds per input or output column
  at::parallel_for(0, static_cast<int64_t>(groups.size()), std::max<int64_t>(1, (1 << 16) / std::max<int64_t>(1, work * in / static_cast<int64_t>(groups.size()))),
                   [&](int64_t g0, int64_t g1) {
                     for (int64_t g = g0; g < g1; ++g) {
                       const Group& gr = groups[g];
                       shrink_group(xp, segments[gr.s].data() + gr.first, gr.n, in, ap[gr.s], rank[gr.s], max_rank, tmp);
                     }
                   });
  constexpr int64_t COLS_512 = 128;
  const int64_t blocks = (out + COLS_512 - 1) / COLS_512;
  at::parallel_for(0, blocks, std::max<int64_t>(1, (1 << 15) / std::max<int64_t>(1, work * COLS_512)),
                   [&](int64_t b0, int64_t b1) {
                     for (int64_t b = b0; b < b1; ++b) {
                       const int64_t o0 = b * COLS_512, w = std::min(COLS_512, out - o0);
                       for (const Group& gr : groups)
                         for (const Span& sp : spans[gr.s]) {  // the span's part of the block, its ranks only
                           const int64_t c0 = std::max(o0, sp.c0), c1 = std::min(o0 + w, sp.c1);
                           if (c0 < c1 && sp.r0 < sp.r1)
                             expand_group(yp, segments[gr.s].data() + gr.first, gr.n, out, bp[gr.s], sp.r0, sp.r1,
                                          max_rank, tmp, c0, c1 - c0);
                         }
                     }
                   });
}

// ---- AMX (bf16 rows and pairs): 16 rows of one adapter per tile ------------------------------------

constexpr int AMX_ROWS = 16;  // rows of one adapter per group (a tile's rows)
using Bf = at::BFloat16;

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

void pack_pair(const Bf* a, const Bf* bt, int64_t R, int64_t in, int64_t out, const Spans& spans, Bf* pa, Bf* pb) {
  const int64_t kcs = in / 32;
  for (int64_t rt = 0; rt < (R + 15) / 16; ++rt)
    for (int64_t kc = 0; kc < kcs; ++kc) {
      Bf* d = pa + (rt * kcs + kc) * 512;
      for (int p = 0; p < 16; ++p)
        for (int r = 0; r < 16; ++r)
          for (int e = 0; e < 2; ++e) {
            const int64_t rank = 16 * rt + r;
            d[p * 32 + r * 2 + e] = rank < R ? a[rank * in + 32 * kc + 2 * p + e] : Bf(0.f);
          }
    }
  for (const Span& sp : spans) {
    if (sp.c0 >= sp.c1 || sp.r0 >= sp.r1) continue;
    const int64_t rw = sp.r0 & ~int64_t{15}, steps = span_steps(sp), blocks = span_blocks(sp);
    for (int64_t st = 0; st < steps; ++st)
      for (int64_t b = 0; b < blocks; ++b) {
        Bf* d = pb + (st * blocks + b) * 256;
        for (int p = 0; p < 8; ++p)
          for (int col = 0; col < 16; ++col)
            for (int e = 0; e < 2; ++e) {
              const int64_t rank = rw + 16 * st + 2 * p + e, o = sp.c0 + 16 * b + col;
              d[p * 32 + col * 2 + e] = rank >= sp.r0 && rank < sp.r1 && o < sp.c1 ? bt[rank * out + o] : Bf(0.f);
            }
      }
    pb += steps * blocks * 256;
  }
}

#ifdef TM_LORA_HAS_AMX
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
TM_LORA_AMX void amx_shrink(const Bf* xp, const int64_t* rows, int n, int64_t in, const Bf* pa, int64_t R,
                            int64_t rp, Bf* xg, uint16_t* terms) {
  for (int j = 0; j < n; ++j) std::memcpy(static_cast<void*>(xg + j * in), xp + rows[j] * in, in * sizeof(Bf));
  const int64_t kcs = in / 32;
  alignas(64) float c[4][16][16];
  for (int64_t rt = 0; rt < (R + 15) / 16; ++rt) {
    const Bf* at = pa + rt * kcs * 512;
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
TM_LORA_AMX inline void add_row(Bf* y, const float* c, int64_t cols) {
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
TM_LORA_AMX void amx_expand(Bf* yp, const std::vector<int64_t>& seg, int64_t g_lo, int64_t g_hi,
                            int64_t out, const Bf* pb, const Spans& spans, int64_t rp, const uint16_t* terms, int64_t q0,
                            int64_t q1, int& cfg) {
  constexpr int64_t CHUNK = 8;  // blocks of 16 columns per pass over y
  alignas(64) float cb[16 * CHUNK * 16];
  for (const Span& sp : spans) {
    if (sp.c0 >= sp.c1 || sp.r0 >= sp.r1) continue;
    const int64_t rw = sp.r0 & ~int64_t{15}, steps = span_steps(sp), blocks = span_blocks(sp);
    const Bf* span_pb = pb;
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
            const Bf* bb = span_pb + (st * blocks + b) * 256;
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

// The AMX path of a call: each adapter's pair in the tile layouts (pa, pb: given, else packed here),
// one parallel region (a decode step makes 120 of these calls: a second fork and join each would
// cost more than a shrink): thread t shrinks groups t, t + nt, ..., then expands those same groups
// over every column where there are enough groups to share, else (after a barrier) its share of the
// output columns for every adapter. lin: the call's adapters (pairs without a tile-layout copy are
// packed into sc for the call); sc: the call's lists. act: where y is a gated MLP's [gate | up] product,
// act[t] = silu(gate[t]) * up[t] (silu.h) for every row t of y after its delta, in the same parallel
// region; else null. Returns whether act was made (not where no row has an adapter that targets the
// linear).
bool delta_amx(Bf* yp, const Bf* xp, int64_t rows, const int64_t* slot, const LoraLinear& lin, Scratch& sc, Bf* act) {
  const int64_t in = lin.in, out = lin.out, n_ad = lin.n, max_rank = lin.max_rank;
  const Bf* const* ap = a_data<Bf>(lin);
  const Bf* const* bp = bt_data<Bf>(lin);
  const std::vector<std::vector<int64_t>>& segments = sc.segments;
  const std::vector<int64_t>& rank = lin.rank;
  const std::vector<Spans>& spans = lin.spans;
  const Bf* const* pa = lin.pa.data();
  const Bf* const* pb = lin.pb.data();
  std::vector<std::vector<Bf>> made;  // pairs packed for this call only (those without a tile-layout copy)
  for (int64_t s = 0; s < n_ad; ++s) {
    if (rank[s] == 0 || segments[s].empty() || (pa[s] != nullptr && pb[s] != nullptr)) continue;
    if (made.empty()) {
      sc.pa.assign(lin.pa.begin(), lin.pa.end());
      sc.pb.assign(lin.pb.begin(), lin.pb.end());
      pa = sc.pa.data(), pb = sc.pb.data();
    }
    made.emplace_back(static_cast<size_t>(packed_a_size(rank[s], in) + packed_b_size(spans[s])));
    Bf* base = made.back().data();
    pack_pair(ap[s], bp[s], rank[s], in, out, spans[s], base, base + packed_a_size(rank[s], in));
    sc.pa[s] = base, sc.pb[s] = base + packed_a_size(rank[s], in);
  }
  const int64_t rp = (max_rank + 15) / 16 * 16;  // a group's terms: [3][16][rp]
  std::vector<Group>& groups = sc.groups;
  std::vector<int64_t>& first_group = sc.first_group;
  groups.clear();
  first_group.assign(static_cast<size_t>(n_ad), -1);
  for (int64_t s = 0; s < n_ad; ++s) {
    if (rank[s] == 0) continue;
    const int64_t k = static_cast<int64_t>(segments[s].size());
    if (k > 0) first_group[s] = static_cast<int64_t>(groups.size());
    for (int64_t i = 0; i < k; i += AMX_ROWS)
      groups.push_back({s, i, static_cast<int>(std::min<int64_t>(AMX_ROWS, k - i))});
  }
  if (groups.empty()) return false;
  std::vector<int64_t>& plain = sc.plain;  // rows without a delta here: their activation is any thread's
  plain.clear();
  for (int64_t t = 0; act != nullptr && t < rows; ++t) {
    const int64_t s = slot[t];
    if (s < 0 || rank[s] == 0) plain.push_back(t);
  }
  const int64_t half = out / 2;
  auto activate = [&](int64_t t) {
    tokenmill::silu_mul_row(reinterpret_cast<const uint16_t*>(yp + t * out), reinterpret_cast<uint16_t*>(act + t * half), half);
  };
  std::vector<uint16_t>& terms = sc.terms;  // zero: ranks past an adapter's own multiply zero rows of B
  terms.assign(groups.size() * 48 * static_cast<size_t>(rp), 0);
  constexpr int64_t COLS_AMX = 64;  // output columns per share of the expand
  const int64_t blocks = (out + COLS_AMX - 1) / COLS_AMX;
  const int threads = at::in_parallel_region() ? 1 : static_cast<int>(std::min<int64_t>(at::get_num_threads(), blocks));
  const int64_t ng = static_cast<int64_t>(groups.size());
  // Enough groups to share evenly (4 adapters in a step, or one with 32 rows): each thread takes whole
  // groups, shrink then expand over every column, with no barrier (a group's rows are its thread's
  // alone; waiting at a barrier cost more than the imbalance of unequal groups). Else the threads share
  // the shrink's groups, then after a barrier the expand's columns.
  const bool by_group = threads > 1 && ng >= threads && (ng % threads == 0 || ng >= 3 * threads);
  auto work = [&](int t, int nt, auto&& barrier) {
    thread_local std::vector<Bf> xg;  // a group's rows gathered, kept across calls
    if (xg.size() < static_cast<size_t>(16 * in)) xg.resize(static_cast<size_t>(16 * in));
    int cfg = 0;
    for (int64_t g = t; g < ng; g += nt) {
      const Group& gr = groups[g];
      if (gr.n != cfg) tiles_for_shrink(cfg = gr.n);
      amx_shrink(xp, segments[gr.s].data() + gr.first, gr.n, in, pa[gr.s], rank[gr.s], rp, xg.data(),
                 terms.data() + g * 48 * rp);
    }
    cfg = 0;
    if (by_group) {
      for (int64_t g = t; g < ng; g += nt) {
        const Group& gr = groups[g];
        amx_expand(yp, segments[gr.s], gr.first / AMX_ROWS, gr.first / AMX_ROWS + 1, out, pb[gr.s], spans[gr.s], rp,
                   terms.data() + first_group[gr.s] * 48 * rp, 0, out, cfg);
        // the group's rows are whole now (every column of their own thread's expand)
        for (int j = 0; act != nullptr && j < gr.n; ++j) activate(segments[gr.s][gr.first + j]);
      }
      _tile_release();
      for (size_t i = t; act != nullptr && i < plain.size(); i += nt) activate(plain[i]);
      return;
    }
    barrier();
    const int64_t b0 = blocks * t / nt, b1 = blocks * (t + 1) / nt;
    for (int64_t s = 0; s < n_ad; ++s) {
      if (first_group[s] < 0 || b0 >= b1) continue;
      const int64_t k = static_cast<int64_t>(segments[s].size());
      amx_expand(yp, segments[s], 0, (k + AMX_ROWS - 1) / AMX_ROWS, out, pb[s], spans[s], rp,
                 terms.data() + first_group[s] * 48 * rp, b0 * COLS_AMX, std::min(out, b1 * COLS_AMX), cfg);
    }
    _tile_release();
    if (act == nullptr) return;
    barrier();  // every row's columns whole
    for (int64_t r = rows * t / nt; r < rows * (t + 1) / nt; ++r) activate(r);
  };
  if (threads <= 1) {
    work(0, 1, [] {});
    return act != nullptr;
  }
#pragma omp parallel num_threads(threads)
  work(omp_get_thread_num(), omp_get_num_threads(), [] {
#pragma omp barrier
  });
  return act != nullptr;
}
#endif

// ---- portable loops (CPUs without AVX-512) ----------------------------------------------------------

constexpr int64_t COLS = 128;  // output columns per expand task: a rank-16 B^T tile of 8 KiB stays in L1
constexpr int64_t SHRINK_GRAIN = 8;  // rows per shrink task: fewer run inline (no parallel region)

// Phase 1, shrink: tmp[t, :R_s] = A_s x[t] for each adapted row, parallel over rows.
template <typename T, typename W>
void shrink(const T* xp, int64_t rows, int64_t in, const int64_t* slot, const W* const* ap,
            const std::vector<int64_t>& rank, int64_t max_rank, float* tmp) {
  at::parallel_for(0, rows, SHRINK_GRAIN, [&](int64_t t0, int64_t t1) {
    std::vector<float> xf(static_cast<size_t>(in));
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t s = slot[t];
      if (s < 0 || rank[s] == 0) continue;
      const T* __restrict xr = xp + t * in;
      float* __restrict xw = xf.data();
      for (int64_t c = 0; c < in; ++c) xw[c] = static_cast<float>(xr[c]);
      for (int64_t r = 0; r < rank[s]; ++r) {
        const W* __restrict ar = ap[s] + r * in;
        float acc = 0.f;
#pragma omp simd reduction(+ : acc)  // vectorised: the sum's order is the compiler's lanes, then theirs
        for (int64_t c = 0; c < in; ++c) acc += static_cast<float>(ar[c]) * xw[c];
        tmp[t * max_rank + r] = acc;
      }
    }
  });
}

// Phase 2, expand: y[t, cols] += tmp[t, :R_s] B_s^T[:, cols], parallel over blocks of COLS output
// columns (so one row's expand uses every thread too); within a block the rows in order, so a run of
// one adapter's rows reuses its B^T tile from L1. Each output element: y, then + tmp[r] * B^T[r] for
// the ranks r of its span in order, in float32, one store (bf16: one rounding).
template <typename T, typename W>
void expand(T* yp, int64_t rows, int64_t out, const int64_t* slot, const W* const* bp,
            const std::vector<int64_t>& rank, const std::vector<Spans>& spans, int64_t max_rank, const float* tmp) {
  const int64_t blocks = (out + COLS - 1) / COLS;
  // at least ~32k multiply-adds a task: below that the parallel region costs more than the work
  const int64_t grain = std::max<int64_t>(1, (1 << 15) / std::max<int64_t>(1, rows * max_rank * COLS));
  at::parallel_for(0, blocks, grain, [&](int64_t b0, int64_t b1) {
    alignas(64) float acc[COLS];
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t o0 = b * COLS, w = std::min(COLS, out - o0);
      for (int64_t t = 0; t < rows; ++t) {
        const int64_t s = slot[t];
        if (s < 0 || rank[s] == 0) continue;
        for (const Span& sp : spans[s]) {  // the span's part of the block, its ranks only
          const int64_t c0 = std::max(o0, sp.c0), c1 = std::min(o0 + w, sp.c1);
          if (c0 >= c1 || sp.r0 >= sp.r1) continue;
          T* __restrict yr = yp + t * out + c0;
          for (int64_t o = 0; o < c1 - c0; ++o) acc[o] = static_cast<float>(yr[o]);
          for (int64_t r = sp.r0; r < sp.r1; ++r) {
            const float v = tmp[t * max_rank + r];
            const W* __restrict br = bp[s] + r * out + c0;
            for (int64_t o = 0; o < c1 - c0; ++o) acc[o] += v * static_cast<float>(br[o]);
          }
          for (int64_t o = 0; o < c1 - c0; ++o) yr[o] = static_cast<T>(acc[o]);
        }
      }
    }
  });
}

// Whether bf16 rows' deltas for lin run on the tile unit (delta_amx).
bool amx_delta(const LoraLinear& lin) {
#ifdef TM_LORA_HAS_AMX
  return lin.wtype == at::kBFloat16 && lin.in % 32 == 0 && avx512() && tokenmill::amx_usable();
#else
  return false;
#endif
}

// lin: the call's adapters (lora.h); sc: the call's lists; act: see delta_amx (bf16 on the tile unit
// only). Returns whether act was made.
template <typename T, typename W>
bool delta_rows(T* yp, const T* xp, int64_t rows, const int64_t* slot, const LoraLinear& lin, Scratch& sc,
                T* act = nullptr) {
  reset_lists(sc.segments, static_cast<size_t>(lin.n));
  for (int64_t t = 0; t < rows; ++t)
    if (slot[t] >= 0) sc.segments[slot[t]].push_back(t);
#ifdef TM_LORA_HAS_AMX
  if constexpr (std::is_same_v<T, at::BFloat16> && std::is_same_v<W, at::BFloat16>) {
    // the tile unit whatever the rows (one row on one adapter costs ~10% more than on the AVX-512
    // tiles, two rows or more adapters less), so a row's delta never depends on its neighbours
    // (batch-invariant mode): every path sums each row in its own fixed order
    if (amx_delta(lin)) return delta_amx(yp, xp, rows, slot, lin, sc, act);
  }
#endif
  sc.tmp.resize(static_cast<size_t>(rows * lin.max_rank));
  if (avx512()) {
    delta_avx512<T, W>(yp, xp, lin, sc);
    return false;
  }
  shrink(xp, rows, lin.in, slot, a_data<W>(lin), lin.rank, lin.max_rank, sc.tmp.data());
  expand(yp, rows, lin.out, slot, bt_data<W>(lin), lin.rank, lin.spans, lin.max_rank, sc.tmp.data());
  return false;
}

using Tensors = c10::ArrayRef<at::Tensor>;  // a list of the call's, or a part of the decode loop's: no copies

// lora.h: one linear's lists checked into lin (its vectors' capacity reused). in, out: -1 to take them
// from the adapters.
void prepare(LoraLinear& lin, int64_t in, int64_t out, Tensors a, Tensors bt, Tensors spans_in, Tensors packed_in) {
  TORCH_CHECK(a.size() == bt.size(), "lora_add_: one A and one B^T per adapter");
  TORCH_CHECK(spans_in.empty() || spans_in.size() == a.size(), "lora_add_: one spans tensor per adapter (or none)");
  TORCH_CHECK(packed_in.empty() || packed_in.size() == a.size(), "lora_add_: one packed tensor per adapter (or none)");
  const int64_t n = static_cast<int64_t>(a.size());
  lin.n = n, lin.max_rank = 0, lin.any = false;
  std::vector<int64_t>& rank = lin.rank;
  rank.assign(static_cast<size_t>(n), 0);
  lin.ap.assign(static_cast<size_t>(n), nullptr);
  lin.bp.assign(static_cast<size_t>(n), nullptr);
  for (int64_t s = 0; s < n; ++s) {
    if (a[s].numel() == 0 && bt[s].numel() == 0) continue;  // an adapter that does not target this linear
    const at::ScalarType st = a[s].scalar_type();
    TORCH_CHECK(a[s].device().is_cpu() && bt[s].device().is_cpu() && (st == at::kFloat || st == at::kBFloat16) &&
                    (!lin.any || lin.wtype == st) && bt[s].scalar_type() == st,
                "lora_add_: A and B^T must be float32 (or bf16 with bf16 rows) CPU tensors, one dtype for every "
                "adapter");
    TORCH_CHECK(a[s].dim() == 2 && a[s].is_contiguous() && bt[s].dim() == 2 && bt[s].is_contiguous(),
                "lora_add_: A must be contiguous [R, in], B^T contiguous [R, out]");
    if (in < 0) in = a[s].size(1);
    if (out < 0) out = bt[s].size(1);
    TORCH_CHECK(a[s].size(1) == in, "lora_add_: A must be contiguous [R, in]");
    TORCH_CHECK(bt[s].size(1) == out && bt[s].size(0) == a[s].size(0),
                "lora_add_: B^T must be contiguous [R, out] with A's rank");
    lin.any = true, lin.wtype = st;
    rank[s] = a[s].size(0);
    lin.max_rank = std::max(lin.max_rank, rank[s]);
    lin.ap[s] = a[s].data_ptr();
    lin.bp[s] = bt[s].data_ptr();
  }
  lin.in = in, lin.out = out;
  std::vector<Spans>& spans = lin.spans;
  reset_lists(spans, static_cast<size_t>(n));
  for (int64_t s = 0; s < n; ++s) {
    if (rank[s] == 0) continue;
    const at::Tensor* sp = !spans_in.empty() && spans_in[s].numel() > 0 ? &spans_in[s] : nullptr;
    if (sp == nullptr) {
      spans[s].push_back({0, out, 0, rank[s]});
      continue;
    }
    TORCH_CHECK(sp->scalar_type() == at::kLong && sp->dim() == 2 && sp->size(1) == 4 && sp->is_contiguous(),
                "lora_add_: spans must be contiguous int64 [S, 4] rows (c0, c1, r0, r1)");
    const int64_t* v = sp->data_ptr<int64_t>();
    for (int64_t i = 0; i < sp->size(0); ++i) {
      const Span q{v[4 * i], v[4 * i + 1], v[4 * i + 2], v[4 * i + 3]};
      TORCH_CHECK(0 <= q.c0 && q.c0 <= q.c1 && q.c1 <= out && 0 <= q.r0 && q.r0 <= q.r1 && q.r1 <= rank[s],
                  "lora_add_: span ", i, " of adapter ", s, " (", q.c0, ", ", q.c1, ", ", q.r0, ", ", q.r1,
                  ") is outside B^T [", rank[s], ", ", out, "]");
      TORCH_CHECK(i == 0 || q.c0 >= spans[s].back().c1, "lora_add_: spans of adapter ", s,
                  " must be in column order without overlap");
      spans[s].push_back(q);
    }
  }
  // each adapter's pair in the tile layouts (lora_pack_bf16), where given: [A's, then B^T's]
  lin.pa.assign(static_cast<size_t>(n), nullptr);
  lin.pb.assign(static_cast<size_t>(n), nullptr);
  for (int64_t s = 0; s < n && !packed_in.empty(); ++s) {
    const at::Tensor& pk = packed_in[s];
    if (rank[s] == 0 || pk.numel() == 0) continue;
    const int64_t na = in % 32 == 0 ? packed_a_size(rank[s], in) : -1, nb = packed_b_size(spans[s]);
    TORCH_CHECK(pk.scalar_type() == at::kBFloat16 && pk.dim() == 1 && pk.is_contiguous() && pk.numel() == na + nb,
                "lora_add_: packed pair of adapter ", s, " must be lora_pack_bf16's bf16 vector for these shapes "
                "and spans (", na + nb, " elements)");
    lin.pa[s] = pk.data_ptr<at::BFloat16>();
    lin.pb[s] = lin.pa[s] + na;
  }
}

// y += the delta of lin's adapters (prepared) on x's rows by slot; act: see delta_amx (the caller checked
// silu_fusable). Returns whether act was made.
bool add_linear(at::Tensor& y, const at::Tensor& x, const LoraLinear& lin, const at::Tensor& slots, Scratch& sc,
                at::BFloat16* act = nullptr) {
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  TORCH_CHECK(x.device().is_cpu() && (bf16 || x.scalar_type() == at::kFloat) && x.dim() == 2 && x.is_contiguous(),
              "lora_add_: x must be a contiguous float32 or bf16 CPU matrix [T, in]");
  TORCH_CHECK(y.device().is_cpu() && y.scalar_type() == x.scalar_type() && y.dim() == 2 && y.is_contiguous() &&
                  y.size(0) == x.size(0),
              "lora_add_: y must be a contiguous CPU matrix [T, out] of x's dtype with x's rows");
  TORCH_CHECK(slots.device().is_cpu() && slots.scalar_type() == at::kLong && slots.dim() == 1 &&
                  slots.numel() == x.size(0) && slots.is_contiguous(),
              "lora_add_: slots must be int64 [T]");
  const int64_t rows = x.size(0);
  const int64_t* slot = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < rows; ++t)
    TORCH_CHECK(slot[t] >= -1 && slot[t] < lin.n, "lora_add_: slot ", slot[t], " of row ", t, " is out of range");
  if (!lin.any) return false;  // no adapter targets this linear
  TORCH_CHECK(x.size(1) == lin.in, "lora_add_: x has ", x.size(1), " columns where the adapters' A [R, in] has ",
              lin.in);
  TORCH_CHECK(y.size(1) == lin.out, "lora_add_: y has ", y.size(1), " columns where the adapters' B^T [R, out] has ",
              lin.out);
  TORCH_CHECK(lin.wtype == at::kFloat || bf16,
              "lora_add_: A and B^T must be float32 (or bf16 with bf16 rows), one dtype for every adapter");
  if (bf16) {
    auto* yp = y.data_ptr<at::BFloat16>();
    const auto* xp = x.data_ptr<at::BFloat16>();
    if (lin.wtype == at::kBFloat16) return delta_rows<at::BFloat16, at::BFloat16>(yp, xp, rows, slot, lin, sc, act);
    delta_rows<at::BFloat16, float>(yp, xp, rows, slot, lin, sc);
  } else {
    delta_rows<float, float>(y.data_ptr<float>(), x.data_ptr<float>(), rows, slot, lin, sc);
  }
  return false;
}

// Whether lora_add_linear_silu takes the activation of lin's product for rows like x (lora.h).
bool silu_fusable(const LoraLinear& lin, const at::Tensor& x) {
#ifdef TM_LORA_HAS_AMX
  static const bool bf16_unit = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512bf16") != 0;
  }();
  return bf16_unit && lin.any && x.scalar_type() == at::kBFloat16 && lin.out % 2 == 0 && amx_delta(lin);
#else
  return false;
#endif
}

void add_linear_silu(at::Tensor& y, const at::Tensor& x, const LoraLinear& lin, const at::Tensor& slots,
                     at::Tensor& act, Scratch& sc) {
  TORCH_CHECK(silu_fusable(lin, x), "lora_add_linear_silu: not for these adapters and rows (silu_fusable)");
  const int64_t rows = x.size(0), half = lin.out / 2;
  TORCH_CHECK(act.scalar_type() == at::kBFloat16 && act.is_contiguous() && act.dim() == 2 && act.size(0) == rows &&
                  act.size(1) == half,
              "lora_add_linear_silu: act must be a contiguous bf16 [T, out / 2]");
  at::BFloat16* ap = act.data_ptr<at::BFloat16>();
  if (add_linear(y, x, lin, slots, sc, ap)) return;
#ifdef TM_LORA_HAS_AMX
  // no row had a delta here: the activation alone
  const uint16_t* src = reinterpret_cast<const uint16_t*>(y.data_ptr<at::BFloat16>());
  uint16_t* dst = reinterpret_cast<uint16_t*>(ap);
  at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / std::max<int64_t>(1, half)), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) tokenmill::silu_mul_row(src + r * lin.out, dst + r * half, half);
  });
#endif
}

void lora_add_(at::Tensor& y, const at::Tensor& x, const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& bt,
               const at::Tensor& slots, const c10::optional<std::vector<at::Tensor>>& spans_in,
               const c10::optional<std::vector<at::Tensor>>& packed_in) {
  Scratch& sc = scratch();
  TORCH_CHECK(x.dim() == 2 && y.dim() == 2, "lora_add_: x must be a contiguous float32 or bf16 CPU matrix [T, in]");
  prepare(sc.lin, x.size(1), y.size(1), a, bt, spans_in ? Tensors(*spans_in) : Tensors(),
          packed_in ? Tensors(*packed_in) : Tensors());
  add_linear(y, x, sc.lin, slots, sc);
}

// One adapter's pair in the tile layouts of the AMX path (pack_pair), as one bf16 vector: A's, then
// B^T's spans'. a: [R, in] bf16 with in a multiple of 32; bt: [R, out] bf16; spans as lora_add_'s.
at::Tensor lora_pack_bf16(const at::Tensor& a, const at::Tensor& bt, const at::Tensor& spans_t) {
  TORCH_CHECK(a.scalar_type() == at::kBFloat16 && bt.scalar_type() == at::kBFloat16 && a.dim() == 2 && bt.dim() == 2 &&
                  a.is_contiguous() && bt.is_contiguous() && a.size(0) == bt.size(0) && a.size(1) % 32 == 0,
              "lora_pack_bf16: A [R, in] and B^T [R, out], contiguous bf16, in a multiple of 32");
  const int64_t R = a.size(0), in = a.size(1), out = bt.size(1);
  Spans spans;
  if (spans_t.numel() == 0) {
    spans.push_back({0, out, 0, R});
  } else {
    TORCH_CHECK(spans_t.scalar_type() == at::kLong && spans_t.dim() == 2 && spans_t.size(1) == 4 && spans_t.is_contiguous(),
                "lora_pack_bf16: spans must be contiguous int64 [S, 4]");
    const int64_t* v = spans_t.data_ptr<int64_t>();
    for (int64_t i = 0; i < spans_t.size(0); ++i) {
      const Span q{v[4 * i], v[4 * i + 1], v[4 * i + 2], v[4 * i + 3]};
      TORCH_CHECK(0 <= q.c0 && q.c0 <= q.c1 && q.c1 <= out && 0 <= q.r0 && q.r0 <= q.r1 && q.r1 <= R,
                  "lora_pack_bf16: span ", i, " is outside B^T");
      spans.push_back(q);
    }
  }
  at::Tensor packed = at::empty({packed_a_size(R, in) + packed_b_size(spans)}, a.options());
  at::BFloat16* base = packed.data_ptr<at::BFloat16>();
  pack_pair(a.data_ptr<at::BFloat16>(), bt.data_ptr<at::BFloat16>(), R, in, out, spans, base,
            base + packed_a_size(R, in));
  return packed;
}

// Whether bf16 deltas may run on the tile unit (so a prompt chunk's hundreds of rows beat PyTorch's
// products too: engine/lora/batch.py).
bool lora_amx() {
#ifdef TM_LORA_HAS_AMX
  return avx512() && tokenmill::amx_usable();
#else
  return false;
#endif
}

}  // namespace

void tokenmill::lora_prepare(LoraLinear& lin, int64_t in, int64_t out, c10::ArrayRef<at::Tensor> a,
                             c10::ArrayRef<at::Tensor> bt, c10::ArrayRef<at::Tensor> spans,
                             c10::ArrayRef<at::Tensor> packed) {
  prepare(lin, in, out, a, bt, spans, packed);
}

void tokenmill::lora_add_linear(at::Tensor& y, const at::Tensor& x, const LoraLinear& lin, const at::Tensor& slots) {
  add_linear(y, x, lin, slots, scratch());
}

bool tokenmill::lora_silu_fusable(const LoraLinear& lin, const at::Tensor& x) { return silu_fusable(lin, x); }

void tokenmill::lora_add_linear_silu(at::Tensor& y, const at::Tensor& x, const LoraLinear& lin, const at::Tensor& slots,
                                     at::Tensor& act) {
  add_linear_silu(y, x, lin, slots, act, scratch());
}

TORCH_LIBRARY_FRAGMENT(tokenmill, m) {
  m.def("lora_add_(Tensor(a!) y, Tensor x, Tensor[] a, Tensor[] bt, Tensor slots, Tensor[]? spans=None, "
        "Tensor[]? packed=None) -> ()");
  m.impl("lora_add_", c10::DispatchKey::CPU, TORCH_FN(lora_add_));
  m.def("lora_amx() -> bool", &lora_amx);
  m.def("lora_pack_bf16(Tensor a, Tensor bt, Tensor spans) -> Tensor");
  m.impl("lora_pack_bf16", c10::DispatchKey::CPU, TORCH_FN(lora_pack_bf16));
}
