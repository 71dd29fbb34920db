// The small-batch linear kernels on AVX-512 (kernels/gemv_avx512.h's register tiles): bf16 on
// AVX512-BF16, INT8 on VNNI. Torch-free; engine/csrc/cpu_gemv.cpp runs it where isa.h says the CPU has
// both.
#include "gemv_avx512.h"

namespace tokenmill::gemv::avx512 {

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

}  // namespace tokenmill::gemv::avx512
