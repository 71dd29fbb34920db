// The AVX-512 register tiles of the small-batch linear kernels and their epilogue (AVX512-BF16 for
// bf16, VNNI for INT8), shared by the AVX-512 path (kernels/gemv_avx512.cpp) and the AMX path, whose
// tile-unit sums go through the same epilogue (kernels/gemv_amx.cpp). Torch-free.
//
// bf16: float32 sums of vdpbf16ps, rounded to bf16 once at the end, as oneDNN does.
// INT8 (weight-only quantization): each row of x is quantized to int16 on entry (symmetric, its own
// scale: 2^-15 of its largest element, finer than bf16's 2^-8 of each element for all but the
// smallest), and int8 weights widened to int16 with one vpmovsxbw multiply-add in pairs into int32
// (vpdpwssd, AVX512-VNNI): one conversion per 32 weights, where int8 -> float -> bf16 takes five.
// (int8 activations with vpdpbusd fail the quality gate on SmolLM2-135M: docs/benchmarks/log.md.) The
// int32 sums are moved into float32 at least every 256 columns (127 * 32767 * 256 < 2^31: no
// overflow whatever the data) and at the end of each scale group; weight scales are per output
// row and group of input columns (group = K: per channel; 32: Q8_0's blocks).
//
// Gated MLP layout (interleave=true): the gate's and the up projection's blocks alternate (gate
// block j, up block j, ...), each half padded on its own, so a register tile holds both halves of 16
// channels and the epilogue writes silu(gate) * up, rounding where PyTorch's three bf16 ops round.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "gemv.h"
#include "silu_avx512.h"

#define TM_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx512vnni,fma")))

namespace tokenmill::gemv::avx512 {

constexpr int64_t MR = 4;  // most rows of x per register tile

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

using ::tokenmill::avx512::exp512;
using ::tokenmill::avx512::round_bf16;
using ::tokenmill::avx512::silu_mul;
using ::tokenmill::avx512::silu_mul_row;
using ::tokenmill::avx512::widen_bf16;

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

}  // namespace tokenmill::gemv::avx512
