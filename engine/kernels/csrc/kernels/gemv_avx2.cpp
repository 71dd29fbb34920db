// The small-batch linear kernels on AVX2 + FMA (every x86-64 CPU since 2013-2015: AMD Zen 1-3, Intel
// Haswell on), for the packed layout of kernels/gemv.h, with the AVX-512 path's sums lane for lane:
//   bf16: a weight unit (w[2p], w[2p + 1]) widens to two float32 by a shift and a mask; x comes
//     widened (Job::xf). acc += w_odd x_odd, then acc += w_even x_even, each an FMA: the products of two
//     bf16 are exact in float32, so each step rounds once, as vdpbf16ps's two additions do. The same
//     bits as the AVX-512 path but where an input or a sum is denormal (vdpbf16ps flushes those).
//     The blocked order (oneDNN's, for the batch-invariant mode) sums even and odd columns in chains
//     of 16 pairs, as tile_bf16_blocked does.
//   INT8: int8 pairs widened to int16 (vpmovsxbw), multiplied by x's int16 pair and added in pairs
//     into int32 (vpmaddwd + vpaddd: vpdpwssd's sum), moved into float32 as the AVX-512 path does.
// Each register tile's sums go to a small buffer, then through one epilogue (bias, silu(gate) * up,
// rounding; kernels/silu_avx2.h). 16 ymm registers: tiles of 8 accumulators. Torch-free.
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "gemv.h"
#include "silu_avx2.h"

#define TM_AVX2 __attribute__((target("avx2,fma,f16c")))

namespace tokenmill::gemv::avx2 {

namespace {

using ::tokenmill::avx2::load_bf16;
using ::tokenmill::avx2::narrow_bf16;
using ::tokenmill::avx2::silu_mul;
using ::tokenmill::avx2::store_bf16;

constexpr int64_t MR = 4;  // most rows of x per register tile
constexpr int64_t CHUNK_OUT = NB * 16;  // outputs per chunk

// A row tile's sums for one chunk: [row][output of the chunk], float32.
using Sums = float[MR][CHUNK_OUT];

TM_AVX2 inline int32_t pair_at(const uint16_t* row, int64_t p) {
  int32_t v;
  std::memcpy(&v, row + 2 * p, sizeof(v));
  return v;
}

// ---- bf16 ----------------------------------------------------------------------------------------

// A unit vector of 8 (w[2p], w[2p + 1]) pairs as float32: the even elements (shifted up) and the odd
// ones (the low halves cleared).
TM_AVX2 inline __m256 even_of(__m256i wv) { return _mm256_castsi256_ps(_mm256_slli_epi32(wv, 16)); }
TM_AVX2 inline __m256 odd_of(__m256i wv) {
  return _mm256_castsi256_ps(_mm256_and_si256(wv, _mm256_set1_epi32(static_cast<int32_t>(0xFFFF0000u))));
}
TM_AVX2 inline __m256i unit_at(const uint16_t* w, int64_t kp, int64_t p, int v) {  // half v of the tile's blocks
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + ((v / 2) * kp + p) * 32 + (v % 2) * 16));
}

// The register tiles below keep their 8 accumulators in named variables (a0..a7, index r * V + v
// for row r and half v of V = 2 NBT): GCC 12 keeps an accumulator array that lives across the loop
// on the stack, storing it at every pair (the int8 tiles of kernels/gemv_avx512.h met the same); and
// each tile is a function of its own (noinline): inlined into the chunk loop, GCC spills them again.
#define TM_EACH8(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7)

template <int I, typename T>  // the I-th of eight named accumulators
TM_AVX2 inline T& acc(T& a0, T& a1, T& a2, T& a3, T& a4, T& a5, T& a6, T& a7) {
  if constexpr (I == 0) return a0;
  else if constexpr (I == 1) return a1;
  else if constexpr (I == 2) return a2;
  else if constexpr (I == 3) return a3;
  else if constexpr (I == 4) return a4;
  else if constexpr (I == 5) return a5;
  else if constexpr (I == 6) return a6;
  else return a7;
}

// sums[r][16 bc + 8 v + l] for R rows from m0 and NBT blocks from the chunk's block bc, one chain per
// output: per pair, + w_odd x_odd, then + w_even x_even. One row takes its x pair once and each unit
// as it is loaded; several rows take each unit once for all of them.
template <int R, int NBT>
TM_AVX2 __attribute__((noinline)) void tile_bf16(const Job& j, int64_t m0, int64_t b0, int64_t bc, Sums& sums) {
  constexpr int V = 2 * NBT;
  static_assert(R * V <= 8, "8 accumulators at most");
  const int64_t kp = j.g.k2 / 2, k2 = j.g.k2;
  const uint16_t* w = static_cast<const uint16_t*>(j.w) + (b0 + bc) * kp * 32;
  const float* xf = j.xf + m0 * k2;
  const __m256 z = _mm256_setzero_ps();
  __m256 a0 = z, a1 = z, a2 = z, a3 = z, a4 = z, a5 = z, a6 = z, a7 = z;
  for (int64_t p = 0; p < kp; ++p) {
    const float* x = xf + 2 * p;
    if constexpr (R == 1) {
      const __m256 xo = _mm256_broadcast_ss(x + 1), xe = _mm256_broadcast_ss(x);
#define TM_ONE(i)                                                                         \
  if constexpr (V > i) {                                                                  \
    const __m256i wv = unit_at(w, kp, p, i);                                              \
    a##i = _mm256_fmadd_ps(even_of(wv), xe, _mm256_fmadd_ps(odd_of(wv), xo, a##i));       \
  }
      TM_EACH8(TM_ONE)
#undef TM_ONE
    } else if constexpr (NBT == 1) {  // the block's two units once, then every row
      const __m256i w0 = unit_at(w, kp, p, 0), w1 = unit_at(w, kp, p, 1);
      const __m256 we[2] = {even_of(w0), even_of(w1)}, wo[2] = {odd_of(w0), odd_of(w1)};
#define TM_ROWS(i)                                                                                  \
  if constexpr (R * V > i) {                                                                        \
    constexpr int r = i / V, v = i % V;                                                             \
    a##i = _mm256_fmadd_ps(we[v], _mm256_broadcast_ss(x + r * k2),                                  \
                           _mm256_fmadd_ps(wo[v], _mm256_broadcast_ss(x + r * k2 + 1), a##i));      \
  }
      TM_EACH8(TM_ROWS)
#undef TM_ROWS
    } else {  // half by half (so a unit's even and odd values live only for its rows)
#define TM_ROWS(j)                                                                                  \
  if constexpr (R * V > j) {                                                                        \
    constexpr int r = j % R, v = j / R, i = r * V + v;                                              \
    const __m256i wv = unit_at(w, kp, p, v);                                                        \
    acc<i>(a0, a1, a2, a3, a4, a5, a6, a7) = _mm256_fmadd_ps(                                      \
        even_of(wv), _mm256_broadcast_ss(x + r * k2),                                               \
        _mm256_fmadd_ps(odd_of(wv), _mm256_broadcast_ss(x + r * k2 + 1), acc<i>(a0, a1, a2, a3, a4, a5, a6, a7))); \
  }
      TM_EACH8(TM_ROWS)
#undef TM_ROWS
    }
  }
#define TM_STORE(i) \
  if constexpr (R * V > i) _mm256_storeu_ps(sums[i / V] + bc * 16 + (i % V) * 8, a##i);
  TM_EACH8(TM_STORE)
#undef TM_STORE
}

// The blocked order (kernels/gemv_avx512.h tile_bf16_blocked): per 16 pairs, the even columns' products
// in one chain and the odd columns' in another, each from zero, then sums += (even + odd). One block
// (two halves) of R <= 2 rows: chains e0..e3 (even, index r * 2 + h) and o0..o3 (odd); the running
// sums stay in the buffer, touched once per 16 pairs.
template <int R>
TM_AVX2 __attribute__((noinline)) void tile_bf16_blocked(const Job& j, int64_t m0, int64_t b0, int64_t bc, Sums& sums) {
  static_assert(R <= 2, "two rows of even and odd chains");
  const int64_t kp = j.g.k2 / 2, k2 = j.g.k2;
  const uint16_t* w = static_cast<const uint16_t*>(j.w) + (b0 + bc) * kp * 32;
  const float* xf = j.xf + m0 * k2;
  const __m256 z = _mm256_setzero_ps();
  for (int r = 0; r < R; ++r)
    for (int h = 0; h < 2; ++h) _mm256_storeu_ps(sums[r] + bc * 16 + h * 8, z);
  for (int64_t p0 = 0; p0 < kp; p0 += 16) {
    __m256 e0 = z, e1 = z, e2 = z, e3 = z, o0 = z, o1 = z, o2 = z, o3 = z;
    const int64_t p1 = std::min(kp, p0 + 16);
    for (int64_t p = p0; p < p1; ++p) {
      const __m256i w0 = unit_at(w, kp, p, 0), w1 = unit_at(w, kp, p, 1);
      const __m256 we[2] = {even_of(w0), even_of(w1)}, wo[2] = {odd_of(w0), odd_of(w1)};
      const float* x = xf + 2 * p;
#define TM_CHAINS(i)                                                                  \
  if constexpr (2 * R > i) {                                                          \
    constexpr int r = i / 2, h = i % 2;                                               \
    e##i = _mm256_fmadd_ps(we[h], _mm256_broadcast_ss(x + r * k2), e##i);             \
    o##i = _mm256_fmadd_ps(wo[h], _mm256_broadcast_ss(x + r * k2 + 1), o##i);         \
  }
      TM_CHAINS(0) TM_CHAINS(1) TM_CHAINS(2) TM_CHAINS(3)
#undef TM_CHAINS
    }
#define TM_FOLD(i)                                                                                 \
  if constexpr (2 * R > i) {                                                                       \
    float* at = sums[i / 2] + bc * 16 + (i % 2) * 8;                                               \
    _mm256_storeu_ps(at, _mm256_add_ps(_mm256_loadu_ps(at), _mm256_add_ps(e##i, o##i)));           \
  }
    TM_FOLD(0) TM_FOLD(1) TM_FOLD(2) TM_FOLD(3)
#undef TM_FOLD
  }
}

// ---- INT8 ----------------------------------------------------------------------------------------

// isums[i] (i = r * V + v) = int32 sums of x[row m0 + r] . W[block v / 2, outputs 8 (v % 2)..] over
// pairs [p0, p1) (at most FLUSH_PAIRS), in named accumulators (see TM_EACH8).
template <int R, int NBT>
TM_AVX2 __attribute__((noinline)) void dot_int8(const Job& j, const int8_t* w, int64_t m0, int64_t p0, int64_t p1, __m256i (&isums)[8]) {
  constexpr int V = 2 * NBT;
  static_assert(R * V <= 8, "8 accumulators at most");
  const int64_t kp = j.g.k2 / 2, k2 = j.g.k2;
  const uint16_t* x = j.x + m0 * k2;
  const __m256i z = _mm256_setzero_si256();
  __m256i a0 = z, a1 = z, a2 = z, a3 = z, a4 = z, a5 = z, a6 = z, a7 = z;
  for (int64_t p = p0; p < p1; ++p) {
    __m256i wv[V];  // each half's 16 int8 widened to int16
    for (int v = 0; v < V; ++v)
      wv[v] = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + ((v / 2) * kp + p) * 32 + (v % 2) * 16)));
#define TM_DOT(i)                                                                                      \
  if constexpr (R * V > i) {                                                                           \
    constexpr int r = i / V, v = i % V;                                                                \
    a##i = _mm256_add_epi32(a##i, _mm256_madd_epi16(wv[v], _mm256_set1_epi32(pair_at(x + r * k2, p)))); \
  }
    TM_EACH8(TM_DOT)
#undef TM_DOT
  }
#define TM_SAVE(i) isums[i] = a##i;
  TM_EACH8(TM_SAVE)
#undef TM_SAVE
}

// sums = (sum over groups of float(int32 sums) * w_scale[group]) * x_scale[row], and for per-channel
// scales * w_scale at the end: tile_int8's arithmetic.
template <int R, int NBT>
TM_AVX2 inline void tile_int8(const Job& j, int64_t m0, int64_t b0, int64_t bc, Sums& sums) {
  const int64_t kp = j.g.k2 / 2, blk = b0 + bc;
  const int8_t* w = static_cast<const int8_t*>(j.w) + blk * kp * 32;
  const bool grouped = j.g.groups > 1;
  __m256 acc[R][2 * NBT];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < 2 * NBT; ++v) acc[r][v] = _mm256_setzero_ps();
  __m256i isums[8];
  for (int64_t gi = 0; gi < j.g.groups; ++gi) {
    const int64_t g_end = std::min(kp, (gi + 1) * j.g.group_pairs);
    for (int64_t p0 = gi * j.g.group_pairs; p0 < g_end; p0 += FLUSH_PAIRS) {
      dot_int8<R, NBT>(j, w, m0, p0, std::min(g_end, p0 + FLUSH_PAIRS), isums);
      for (int v = 0; v < 2 * NBT; ++v) {
        const __m256 sc = grouped ? _mm256_loadu_ps(j.w_scale + ((blk + v / 2) * j.g.groups + gi) * 16 + (v % 2) * 8)
                                  : _mm256_set1_ps(1.f);
        for (int r = 0; r < R; ++r) acc[r][v] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isums[r * 2 * NBT + v]), sc, acc[r][v]);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    const __m256 xs = _mm256_set1_ps(j.x_scale[m0 + r]);
    for (int v = 0; v < 2 * NBT; ++v) {
      const __m256 s = grouped ? xs : _mm256_mul_ps(xs, _mm256_loadu_ps(j.w_scale + (blk + v / 2) * 16 + (v % 2) * 8));
      _mm256_storeu_ps(sums[r] + bc * 16 + v * 8, _mm256_mul_ps(acc[r][v], s));
    }
  }
}

// ---- epilogue ------------------------------------------------------------------------------------

// n <= 8 floats from p (zeros past n).
TM_AVX2 inline __m256 load_f32(const float* p, int64_t n) {
  if (n >= 8) return _mm256_loadu_ps(p);
  alignas(32) float tmp[8] = {};
  for (int64_t i = 0; i < n; ++i) tmp[i] = p[i];
  return _mm256_load_ps(tmp);
}

// Row `row` of the output from a chunk's sums s (its NB blocks from b0): store_tile's arithmetic.
TM_AVX2 void store_row(const Job& j, int64_t row, int64_t b0, const float* s) {
  for (int b = 0; b < NB; b += j.silu ? 2 : 1) {
    int64_t col = (j.silu ? (b0 + b) / 2 : b0 + b) * 16;  // first output column of the block
    int64_t valid = std::min<int64_t>(16, j.out_cols - col);
    if (j.split) {  // gate block (b0 + b) / 2 (even) or up block (odd): to its plain column
      const int64_t half = j.out_cols / 2, at = (b0 + b) / 2 * 16;
      valid = std::min<int64_t>(16, half - at);
      col = at + ((b0 + b) % 2 ? half : 0);
    }
    for (int h = 0; h < 2; ++h) {
      const int64_t n = valid - 8 * h, c = col + 8 * h;
      if (n <= 0) break;  // padding
      const __m256 bias = j.bias ? load_f32(j.bias + c, n) : _mm256_setzero_ps();
      __m256 v = _mm256_add_ps(_mm256_loadu_ps(s + b * 16 + h * 8), bias);
      if (j.silu) {
        const __m256 up_bias = j.bias ? load_f32(j.bias + j.out_cols + c, n) : _mm256_setzero_ps();
        v = silu_mul(v, _mm256_add_ps(_mm256_loadu_ps(s + (b + 1) * 16 + h * 8), up_bias), j.out_bf16);
      }
      const int64_t at = row * j.out_cols + c;
      if (j.out_bf16) {
        store_bf16(static_cast<uint16_t*>(j.out) + at, narrow_bf16(v), n);
      } else if (n >= 8) {
        _mm256_storeu_ps(static_cast<float*>(j.out) + at, v);
      } else {
        alignas(32) float tmp[8];
        _mm256_store_ps(tmp, v);
        std::copy(tmp, tmp + n, static_cast<float*>(j.out) + at);
      }
    }
  }
}

// ---- driver --------------------------------------------------------------------------------------

// R rows from m0 against the chunk of blocks b0..b0 + NB - 1, in register tiles of 8 accumulators.
template <int R>
TM_AVX2 void rows(const Job& j, int64_t m0, int64_t b0, Sums& sums) {
  constexpr int NBT = R == 1 ? 4 : R == 2 ? 2 : 1;  // blocks per register tile
  for (int64_t bc = 0; bc < NB; bc += NBT) {
    if (j.w_scale) {
      tile_int8<R, NBT>(j, m0, b0, bc, sums);
    } else {
      tile_bf16<R, NBT>(j, m0, b0, bc, sums);
    }
  }
  for (int r = 0; r < R; ++r) store_row(j, m0 + r, b0, sums[r]);
}

template <int R>
TM_AVX2 void rows_blocked(const Job& j, int64_t m0, int64_t b0, Sums& sums) {
  for (int64_t bc = 0; bc < NB; ++bc) tile_bf16_blocked<R>(j, m0, b0, bc, sums);
  for (int r = 0; r < R; ++r) store_row(j, m0 + r, b0, sums[r]);
}

}  // namespace

TM_AVX2 void run_rows(const Job& j, int64_t c, int64_t r0, int64_t r1) {
  // Every row of the range against one chunk of NB blocks: the chunk stays in L1/L2 across the row
  // tiles, so the weights are read from memory once per range whatever its rows.
  alignas(32) Sums sums;
  const int64_t b0 = c * NB;
  int64_t m0 = r0;
  if (j.blocked) {  // tiles of at most 2 rows
    for (; m0 + 2 <= r1; m0 += 2) rows_blocked<2>(j, m0, b0, sums);
    if (m0 < r1) rows_blocked<1>(j, m0, b0, sums);
    return;
  }
  for (; m0 + MR <= r1; m0 += MR) rows<MR>(j, m0, b0, sums);
  switch (r1 - m0) {
    case 3: rows<3>(j, m0, b0, sums); break;
    case 2: rows<2>(j, m0, b0, sums); break;
    case 1: rows<1>(j, m0, b0, sums); break;
    default: break;
  }
}

TM_AVX2 void silu_rows(const uint16_t* gu, int64_t ld, uint16_t* out, int64_t half, int64_t r0, int64_t r1) {
  for (int64_t r = r0; r < r1; ++r) ::tokenmill::avx2::silu_mul_row(gu + r * ld, out + r * half, half);
}

// INT8 -> bf16 (k even), per block and column pair: 32 weights widened, scaled per row and group,
// rounded to bf16 (vcvtneps2bf16's rounding), each row's pair stored as one 32-bit unit.
TM_AVX2 void unpack_int8(const int8_t* packed, const float* scales, const Geometry& g, const RowMap& map,
                         uint16_t* out, int64_t b0, int64_t b1) {
  const int64_t kp = g.k2 / 2, group = g.groups == 1 ? g.k2 : 2 * g.group_pairs;
  const __m256i dup_lo = _mm256_set_epi32(3, 3, 2, 2, 1, 1, 0, 0);  // lane -> its row's scale (pairs)
  uint32_t* units = reinterpret_cast<uint32_t*>(out);
  for (int64_t blk = b0; blk < b1; ++blk) {
    int64_t row_unit[16];  // first 32-bit unit of each lane's output row, -1: padding
    for (int l = 0; l < 16; ++l) {
      const int64_t r = map.half ? (blk % 2) * map.half + (blk / 2) * 16 + l : blk * 16 + l;
      const bool ok = map.half ? (blk / 2) * 16 + l < map.half : r < g.n;
      row_unit[l] = ok ? r * kp : -1;
    }
    for (int64_t p = 0; p < kp; ++p) {
      const int8_t* src = packed + (blk * kp + p) * 32;
      const float* sc = scales + (blk * g.groups + 2 * p / group) * 16;
      alignas(32) uint32_t pairs[16];
      for (int q = 0; q < 4; ++q) {  // 8 weights: rows 4q..4q+3, both columns
        const __m256 wf = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(src + 8 * q))));
        const __m256 s = _mm256_permutevar8x32_ps(_mm256_castps128_ps256(_mm_loadu_ps(sc + 4 * q)), dup_lo);
        const __m256i h = ::tokenmill::avx2::bf16_lanes(_mm256_mul_ps(wf, s));  // [row][column] bf16 in 32-bit lanes
        alignas(32) uint32_t lanes[8];  // a row's two columns in lanes 2i, 2i + 1: one unit
        _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), h);
        for (int i = 0; i < 4; ++i) pairs[4 * q + i] = (lanes[2 * i] & 0xFFFFu) | (lanes[2 * i + 1] << 16);
      }
      for (int l = 0; l < 16; ++l)
        if (row_unit[l] >= 0) units[row_unit[l] + p] = pairs[l];
    }
  }
}

// Four independent 256-bit lanes of sums, so the loads are the limit (bench floor's bandwidth).
TM_AVX2 uint64_t sum_words(const uint64_t* p, int64_t b, int64_t e) {
  __m256i s0 = _mm256_setzero_si256(), s1 = s0, s2 = s0, s3 = s0;
  int64_t i = b;
  for (; i + 16 <= e; i += 16) {
    s0 = _mm256_add_epi64(s0, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i)));
    s1 = _mm256_add_epi64(s1, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i + 4)));
    s2 = _mm256_add_epi64(s2, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i + 8)));
    s3 = _mm256_add_epi64(s3, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i + 12)));
  }
  alignas(32) uint64_t lanes[4];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), _mm256_add_epi64(_mm256_add_epi64(s0, s1), _mm256_add_epi64(s2, s3)));
  uint64_t s = lanes[0] + lanes[1] + lanes[2] + lanes[3];
  for (; i < e; ++i) s += p[i];
  return s;
}

}  // namespace tokenmill::gemv::avx2
