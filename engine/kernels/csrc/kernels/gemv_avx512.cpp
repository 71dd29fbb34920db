// The small-batch linear kernels on AVX-512 (kernels/gemv_avx512.h's register tiles): bf16 on
// AVX512-BF16, INT8 on VNNI. Torch-free; engine/kernels/csrc/cpu_gemv.cpp runs it where isa.h says the CPU has
// both.
#include "gemv_avx512.h"

namespace tokenmill::gemv::avx512 {

TM_AVX512 void run_rows(const Job& j, int64_t c, int64_t r0, int64_t r1) {
  // Every row of the range against one chunk of NB blocks: the chunk stays in L1/L2 across the row
  // tiles, so the weights are read from memory once per range whatever its rows.
  const int64_t b0 = c * NB;
  int64_t m0 = r0;
  if (j.blocked) {  // tiles of at most 2 rows (tile_bf16_blocked)
    for (; m0 + 2 <= r1; m0 += 2) tile<2>(j, m0, b0);
    if (m0 < r1) tile<1>(j, m0, b0);
    return;
  }
  for (; m0 + MR <= r1; m0 += MR) tile<MR>(j, m0, b0);
  switch (r1 - m0) {
    case 3: tile<3>(j, m0, b0); break;
    case 2: tile<2>(j, m0, b0); break;
    case 1: tile<1>(j, m0, b0); break;
    default: break;
  }
}

TM_AVX512 void silu_rows(const uint16_t* gu, int64_t ld, uint16_t* out, int64_t half, int64_t r0, int64_t r1) {
  for (int64_t r = r0; r < r1; ++r) silu_mul_row(gu + r * ld, out + r * half, half);
}

// INT8 -> bf16 for even K, vectorised (the large-batch path dequantizes every call): per block and
// column pair, 32 weights widened, scaled per row and group, rounded to bf16, and scattered as 16
// 32-bit pairs into their rows.
TM_AVX512 static void unpack_int8_block(const int8_t* packed, const float* scales, const Geometry& g, const RowMap& map,
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

TM_AVX512 void unpack_int8(const int8_t* packed, const float* scales, const Geometry& g, const RowMap& map, uint16_t* out,
                 int64_t b0, int64_t b1) {
  for (int64_t blk = b0; blk < b1; ++blk) unpack_int8_block(packed, scales, g, map, out, blk);
}

// Four independent 512-bit lanes of sums, so the loads are the limit (bench floor's bandwidth).
TM_AVX512 uint64_t sum_words(const uint64_t* p, int64_t b, int64_t e) {
  __m512i s0 = _mm512_setzero_si512(), s1 = s0, s2 = s0, s3 = s0;
  int64_t i = b;
  for (; i + 32 <= e; i += 32) {
    s0 = _mm512_add_epi64(s0, _mm512_loadu_si512(p + i));
    s1 = _mm512_add_epi64(s1, _mm512_loadu_si512(p + i + 8));
    s2 = _mm512_add_epi64(s2, _mm512_loadu_si512(p + i + 16));
    s3 = _mm512_add_epi64(s3, _mm512_loadu_si512(p + i + 24));
  }
  uint64_t s = static_cast<uint64_t>(_mm512_reduce_add_epi64(_mm512_add_epi64(_mm512_add_epi64(s0, s1), _mm512_add_epi64(s2, s3))));
  for (; i < e; ++i) s += p[i];
  return s;
}

}  // namespace tokenmill::gemv::avx512
