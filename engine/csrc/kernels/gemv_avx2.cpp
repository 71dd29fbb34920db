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

// sums[r][16 b + 8 h + l] for R rows from m0 and NBT blocks from b0 (b0 relative to the chunk: bc),
// one chain per output: per pair, + w_odd x_odd, then + w_even x_even.
template <int R, int NBT>
TM_AVX2 inline void tile_bf16(const Job& j, int64_t m0, int64_t b0, int64_t bc, Sums& sums) {
  const int64_t kp = j.g.k2 / 2;
  const uint16_t* w = static_cast<const uint16_t*>(j.w) + (b0 + bc) * kp * 32;
  const __m256i hi_mask = _mm256_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
  __m256 acc[R][2 * NBT];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < 2 * NBT; ++v) acc[r][v] = _mm256_setzero_ps();
  const float* xf = j.xf + m0 * j.g.k2;
  for (int64_t p = 0; p < kp; ++p) {
    for (int v = 0; v < 2 * NBT; ++v) {  // block v / 2, outputs 8 (v % 2) ..
      const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + ((v / 2) * kp + p) * 32 + (v % 2) * 16));
      const __m256 we = _mm256_castsi256_ps(_mm256_slli_epi32(wv, 16));
      const __m256 wo = _mm256_castsi256_ps(_mm256_and_si256(wv, hi_mask));
      for (int r = 0; r < R; ++r) {
        const float* xr = xf + r * j.g.k2 + 2 * p;
        acc[r][v] = _mm256_fmadd_ps(wo, _mm256_broadcast_ss(xr + 1), acc[r][v]);
        acc[r][v] = _mm256_fmadd_ps(we, _mm256_broadcast_ss(xr), acc[r][v]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < 2 * NBT; ++v) _mm256_storeu_ps(sums[r] + bc * 16 + v * 8, acc[r][v]);
}

// The blocked order (kernels/gemv_avx512.h tile_bf16_blocked): per 16 pairs, the even columns' products
// in one chain and the odd columns' in another, each from zero, then acc += (even + odd). One block.
template <int R>
TM_AVX2 inline void tile_bf16_blocked(const Job& j, int64_t m0, int64_t b0, int64_t bc, Sums& sums) {
  const int64_t kp = j.g.k2 / 2;
  const uint16_t* w = static_cast<const uint16_t*>(j.w) + (b0 + bc) * kp * 32;
  const __m256i hi_mask = _mm256_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
  const float* xf = j.xf + m0 * j.g.k2;
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t p0 = 0; p0 < kp; p0 += 16) {
    __m256 even[R][2], odd[R][2];
    for (int r = 0; r < R; ++r) even[r][0] = even[r][1] = odd[r][0] = odd[r][1] = _mm256_setzero_ps();
    const int64_t p1 = std::min(kp, p0 + 16);
    for (int64_t p = p0; p < p1; ++p)
      for (int h = 0; h < 2; ++h) {
        const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + p * 32 + h * 16));
        const __m256 we = _mm256_castsi256_ps(_mm256_slli_epi32(wv, 16));
        const __m256 wo = _mm256_castsi256_ps(_mm256_and_si256(wv, hi_mask));
        for (int r = 0; r < R; ++r) {
          const float* xr = xf + r * j.g.k2 + 2 * p;
          even[r][h] = _mm256_fmadd_ps(we, _mm256_broadcast_ss(xr), even[r][h]);
          odd[r][h] = _mm256_fmadd_ps(wo, _mm256_broadcast_ss(xr + 1), odd[r][h]);
        }
      }
    for (int r = 0; r < R; ++r)
      for (int h = 0; h < 2; ++h) acc[r][h] = _mm256_add_ps(acc[r][h], _mm256_add_ps(even[r][h], odd[r][h]));
  }
  for (int r = 0; r < R; ++r)
    for (int h = 0; h < 2; ++h) _mm256_storeu_ps(sums[r] + bc * 16 + h * 8, acc[r][h]);
}

// ---- INT8 ----------------------------------------------------------------------------------------

// isums[r][v] = int32 sums of x[row m0 + r] . W[block bc + v / 2, outputs 8 (v % 2)..] over pairs
// [p0, p1) (at most FLUSH_PAIRS).
template <int R, int NBT>
TM_AVX2 inline void dot_int8(const Job& j, const int8_t* w, int64_t m0, int64_t p0, int64_t p1,
                             __m256i (&isums)[R][2 * NBT]) {
  const int64_t kp = j.g.k2 / 2;
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < 2 * NBT; ++v) isums[r][v] = _mm256_setzero_si256();
  for (int64_t p = p0; p < p1; ++p) {
    __m256i xb[R];
    for (int r = 0; r < R; ++r) xb[r] = _mm256_set1_epi32(pair_at(j.x + (m0 + r) * j.g.k2, p));
    for (int v = 0; v < 2 * NBT; ++v) {
      const __m256i wv = _mm256_cvtepi8_epi16(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + ((v / 2) * kp + p) * 32 + (v % 2) * 16)));
      for (int r = 0; r < R; ++r) isums[r][v] = _mm256_add_epi32(isums[r][v], _mm256_madd_epi16(wv, xb[r]));
    }
  }
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
  __m256i isums[R][2 * NBT];
  for (int64_t gi = 0; gi < j.g.groups; ++gi) {
    const int64_t g_end = std::min(kp, (gi + 1) * j.g.group_pairs);
    for (int64_t p0 = gi * j.g.group_pairs; p0 < g_end; p0 += FLUSH_PAIRS) {
      dot_int8<R, NBT>(j, w, m0, p0, std::min(g_end, p0 + FLUSH_PAIRS), isums);
      for (int v = 0; v < 2 * NBT; ++v) {
        const __m256 sc = grouped ? _mm256_loadu_ps(j.w_scale + ((blk + v / 2) * j.g.groups + gi) * 16 + (v % 2) * 8)
                                  : _mm256_set1_ps(1.f);
        for (int r = 0; r < R; ++r) acc[r][v] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isums[r][v]), sc, acc[r][v]);
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

TM_AVX2 void run_chunks(const Job& j, int64_t c0, int64_t c1) {
  // Every row of x against one chunk of NB blocks at a time: the chunk stays in L1/L2 across the
  // row tiles, so the weights are read from memory once per call whatever the row count.
  alignas(32) Sums sums;
  for (int64_t c = c0; c < c1; ++c) {
    const int64_t b0 = c * NB;
    int64_t m0 = 0;
    if (j.blocked) {  // tiles of at most 2 rows
      for (; m0 + 2 <= j.m; m0 += 2) rows_blocked<2>(j, m0, b0, sums);
      if (m0 < j.m) rows_blocked<1>(j, m0, b0, sums);
      continue;
    }
    for (; m0 + MR <= j.m; m0 += MR) rows<MR>(j, m0, b0, sums);
    switch (j.m - m0) {
      case 3: rows<3>(j, m0, b0, sums); break;
      case 2: rows<2>(j, m0, b0, sums); break;
      case 1: rows<1>(j, m0, b0, sums); break;
      default: break;
    }
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

}  // namespace tokenmill::gemv::avx2
