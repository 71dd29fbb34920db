// Paged decode attention for the CPU, reading the paged KV cache in place (no gather copy; K and V
// each read once per layer): per work item the scores q k^T, their softmax and the sum p v, in one
// op, torch.ops.tokenmill.paged_decode_attention (one parallel region a layer, no [num_seqs, heads,
// context] tensors; the scores, PyTorch's softmax and the values as three ops cost two more regions).
// The KV store is torch.ops.tokenmill.paged_store_kv.
//
// Cache layout, per layer (engine/attention/cpu_backend.py): both tensors are allocated
// [kv_heads, num_blocks * block_size, D], but K is used as [kv_heads, num_blocks, D, block_size]
// (each block dimension-major, so q . k for a block's tokens is a run of vertical multiply-adds
// over contiguous token lanes, no horizontal sums) and V as [kv_heads, num_blocks, block_size, D]
// (token-major, so p * v accumulates over contiguous head-dim lanes). Token t of sequence s is in
// block block_tables[s][t / block_size] at offset t % block_size.
//
// Work items are (sequence, KV head) pairs spread over ATen's intra-op threads; an item serves the
// `group` query heads that share its KV head (GQA without repeating K/V). Float32 accumulation.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "widen.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

using tokenmill::exp_nonpositive;
using tokenmill::to_float;

struct Shapes {
  int64_t num_seqs, heads, dim, kv_heads, group, block_size, head_slots, width;
};

Shapes check(const at::Tensor& q, const at::Tensor& cache, const at::Tensor& tables, const at::Tensor& lens,
             int64_t block_size) {
  TORCH_CHECK(q.device().is_cpu() && cache.device().is_cpu(), "paged decode: CPU tensors only");
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1, "paged decode: q must be [num_seqs, heads, D], D contiguous");
  TORCH_CHECK(cache.dim() == 3 && cache.is_contiguous(), "paged decode: cache must be contiguous [kv_heads, slots, D]");
  TORCH_CHECK(q.scalar_type() == cache.scalar_type(), "paged decode: q and the cache must share a dtype");
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16, "paged decode: float32 or bfloat16");
  TORCH_CHECK(q.size(1) % cache.size(0) == 0 && q.size(2) == cache.size(2), "paged decode: head shapes");
  TORCH_CHECK(block_size > 0 && cache.size(1) % block_size == 0, "paged decode: bad block_size");
  TORCH_CHECK(tables.scalar_type() == at::kLong && tables.dim() == 2 && tables.is_contiguous() &&
                  tables.size(0) == q.size(0),
              "paged decode: block_tables must be contiguous int64 [num_seqs, width]");
  TORCH_CHECK(lens.scalar_type() == at::kLong && lens.dim() == 1 && lens.size(0) == q.size(0) && lens.is_contiguous(),
              "paged decode: context_lens must be contiguous int64 [num_seqs]");
  return {q.size(0), q.size(1), q.size(2), cache.size(0), q.size(1) / cache.size(0), block_size, cache.size(1),
          tables.size(1)};
}

// Every block a sequence's first min(len, max_context) tokens lie in is a block of the cache: a bad
// table (a bug upstream) fails the call with its sequence and entry instead of reading outside the
// cache. One comparison per block in use, before the parallel region (~1 us a layer at 32 x 64 blocks).
void check_tables(const int64_t* tables, const int64_t* lens, const Shapes& sh, int64_t max_context) {
  const int64_t num_blocks = sh.head_slots / sh.block_size;
  for (int64_t s = 0; s < sh.num_seqs; ++s) {
    const int64_t ctx = std::min(lens[s], max_context);
    const int64_t used = (std::max<int64_t>(ctx, 0) + sh.block_size - 1) / sh.block_size;
    TORCH_CHECK(used <= sh.width, "paged decode: sequence ", s, " has ", ctx, " tokens of context but a table of ",
                sh.width, " blocks of ", sh.block_size);
    const int64_t* row = tables + s * sh.width;
    for (int64_t b = 0; b < used; ++b)
      TORCH_CHECK(row[b] >= 0 && row[b] < num_blocks, "paged decode: block table entry ", b, " of sequence ", s,
                  " is ", row[b], ", not a block of the cache (", num_blocks, " blocks)");
  }
}

// One block's scores for the G query rows of a KV head: sc[g][j] = q_g . k_j, j < BS, with the K
// block dimension-major [D, BS]. Each K row is widened once and used by all G rows; BS and G are
// compile-time constants so the G x BS accumulators live in registers. Partial blocks are computed
// whole (the rows past the end lie in the same allocated block) and only their valid part kept.
template <typename T, int BS, int G>
inline void block_scores(const float* qf, const T* kb, int64_t D, float* sc) {
  float acc[G][BS] = {};
  for (int64_t d = 0; d < D; ++d) {
    const T* kr = kb + d * BS;
    float k[BS];
#pragma omp simd
    for (int j = 0; j < BS; ++j) k[j] = to_float(kr[j]);
    for (int g = 0; g < G; ++g) {
      const float qd = qf[g * D + d];
#pragma omp simd
      for (int j = 0; j < BS; ++j) acc[g][j] += qd * k[j];
    }
  }
  std::memcpy(sc, acc, sizeof(acc));
}

template <typename T>
inline void block_scores_any(const float* qf, const T* kb, int64_t D, int64_t bs, int64_t G, float* sc) {
  std::fill(sc, sc + G * bs, 0.f);
  for (int64_t d = 0; d < D; ++d) {
    const T* kr = kb + d * bs;
    for (int64_t g = 0; g < G; ++g) {
      const float qd = qf[g * D + d];
      float* sg = sc + g * bs;
#pragma omp simd
      for (int64_t j = 0; j < bs; ++j) sg[j] += qd * to_float(kr[j]);
    }
  }
}

template <typename T, int BS>
inline bool block_scores_fixed(const float* qf, const T* kb, int64_t D, int64_t G, float* sc) {
  switch (G) {
    case 1: block_scores<T, BS, 1>(qf, kb, D, sc); return true;
    case 2: block_scores<T, BS, 2>(qf, kb, D, sc); return true;
    case 3: block_scores<T, BS, 3>(qf, kb, D, sc); return true;
    case 4: block_scores<T, BS, 4>(qf, kb, D, sc); return true;
    case 5: block_scores<T, BS, 5>(qf, kb, D, sc); return true;
    case 6: block_scores<T, BS, 6>(qf, kb, D, sc); return true;
    case 7: block_scores<T, BS, 7>(qf, kb, D, sc); return true;
    case 8: block_scores<T, BS, 8>(qf, kb, D, sc); return true;
    default: return false;
  }
}

// One (sequence s, KV head h) item's scores: rows[g * stride + t] = scale * q[s, h * G + g] . k_t for
// t < ctx. qf: [G, D] and tmp: [G, bs] scratch.
template <typename T>
void item_scores(const at::Tensor& q, const T* kp, const int64_t* table, int64_t s, int64_t h, int64_t ctx,
                 const Shapes& sh, float scale, float* qf, float* tmp, float* rows, int64_t stride) {
  const T* qp = q.data_ptr<T>();
  const int64_t D = sh.dim, G = sh.group, bs = sh.block_size;
  for (int64_t g = 0; g < G; ++g)  // q rows may be strided (a view into the fused QKV output)
    for (int64_t d = 0; d < D; ++d) qf[g * D + d] = to_float(qp[s * q.stride(0) + (h * G + g) * q.stride(1) + d]) * scale;
  const T* kh = kp + h * sh.head_slots * D;
  for (int64_t t0 = 0; t0 < ctx; t0 += bs) {
    const int64_t n = std::min(bs, ctx - t0);
    const T* kb = kh + table[t0 / bs] * bs * D;  // [D, bs]
    const bool done = (bs == 32 && block_scores_fixed<T, 32>(qf, kb, D, G, tmp)) ||
                      (bs == 16 && block_scores_fixed<T, 16>(qf, kb, D, G, tmp));
    if (!done) block_scores_any<T>(qf, kb, D, bs, G, tmp);
    for (int64_t g = 0; g < G; ++g) std::copy(tmp + g * bs, tmp + g * bs + n, rows + g * stride + t0);
  }
}

// One sequence-head's sum over its context: acc[g] = sum_t p[g][t] v_t, V blocks token-major [bs, D].
// Each V row is widened once for the G query rows; G and D compile-time constants keep the G x D
// accumulators in registers.
template <typename T, int G, int DIM>
inline void sum_values(const float* prow, int64_t p_stride, const T* vh, const int64_t* table, int64_t bs,
                       int64_t ctx, float* out) {
  float acc[G][DIM] = {};
  for (int64_t t0 = 0; t0 < ctx; t0 += bs) {
    const int64_t n = std::min(bs, ctx - t0);
    const T* vb = vh + table[t0 / bs] * bs * DIM;
    for (int64_t j = 0; j < n; ++j) {
      const T* vr = vb + j * DIM;
      float w[DIM];
#pragma omp simd
      for (int d = 0; d < DIM; ++d) w[d] = to_float(vr[d]);
      for (int g = 0; g < G; ++g) {
        const float pg = prow[g * p_stride + t0 + j];
#pragma omp simd
        for (int d = 0; d < DIM; ++d) acc[g][d] += pg * w[d];
      }
    }
  }
  std::memcpy(out, acc, sizeof(acc));
}

template <typename T>
inline void sum_values_any(const float* prow, int64_t p_stride, const T* vh, const int64_t* table, int64_t bs,
                           int64_t ctx, int64_t G, int64_t D, float* acc) {
  std::fill(acc, acc + G * D, 0.f);
  for (int64_t t0 = 0; t0 < ctx; t0 += bs) {
    const int64_t n = std::min(bs, ctx - t0);
    const T* vb = vh + table[t0 / bs] * bs * D;
    for (int64_t j = 0; j < n; ++j)
      for (int64_t g = 0; g < G; ++g) {
        const float pg = prow[g * p_stride + t0 + j];
        float* ag = acc + g * D;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) ag[d] += pg * to_float(vb[j * D + d]);
      }
  }
}

template <typename T, int DIM>
inline bool sum_values_fixed(const float* prow, int64_t p_stride, const T* vh, const int64_t* table, int64_t bs,
                             int64_t ctx, int64_t G, float* acc) {
  switch (G) {
    case 1: sum_values<T, 1, DIM>(prow, p_stride, vh, table, bs, ctx, acc); return true;
    case 2: sum_values<T, 2, DIM>(prow, p_stride, vh, table, bs, ctx, acc); return true;
    case 3: sum_values<T, 3, DIM>(prow, p_stride, vh, table, bs, ctx, acc); return true;
    case 4: sum_values<T, 4, DIM>(prow, p_stride, vh, table, bs, ctx, acc); return true;
    case 5: sum_values<T, 5, DIM>(prow, p_stride, vh, table, bs, ctx, acc); return true;
    case 6: sum_values<T, 6, DIM>(prow, p_stride, vh, table, bs, ctx, acc); return true;
    case 7: sum_values<T, 7, DIM>(prow, p_stride, vh, table, bs, ctx, acc); return true;
    case 8: sum_values<T, 8, DIM>(prow, p_stride, vh, table, bs, ctx, acc); return true;
    default: return false;
  }
}

// One (sequence, KV head h) item's sums acc[g] = sum_t p[g][t] v_t, t < ctx; p rows `stride` apart.
template <typename T>
void item_values(const float* prow, int64_t stride, const T* vp, const int64_t* table, int64_t h, int64_t ctx,
                 const Shapes& sh, float* acc) {
  const int64_t D = sh.dim, G = sh.group, bs = sh.block_size;
  const T* vh = vp + h * sh.head_slots * D;
  const bool done = (D == 64 && sum_values_fixed<T, 64>(prow, stride, vh, table, bs, ctx, G, acc)) ||
                    (D == 128 && sum_values_fixed<T, 128>(prow, stride, vh, table, bs, ctx, G, acc));
  if (!done) sum_values_any<T>(prow, stride, vh, table, bs, ctx, G, D, acc);
}

// softmax over each of the G rows' first ctx entries, in place (max, exp(x - max), times 1 / sum, as
// PyTorch's CPU softmax orders it; exp by the vectorised polynomial).
inline void rows_softmax(float* rows, int64_t stride, int64_t G, int64_t ctx) {
  for (int64_t g = 0; g < G; ++g) {
    float* r = rows + g * stride;
    float mx = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : mx)
    for (int64_t t = 0; t < ctx; ++t) mx = r[t] > mx ? r[t] : mx;
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t t = 0; t < ctx; ++t) {
      r[t] = exp_nonpositive(r[t] - mx);
      sum += r[t];
    }
    const float inv = 1.f / sum;
#pragma omp simd
    for (int64_t t = 0; t < ctx; ++t) r[t] *= inv;
  }
}

// out[s, h * group + g] = softmax(scale q k^T) v per (sequence, KV head) item: the scores into a
// [G, context] scratch row, the softmax there, the values from it. A sequence with no context gets 0.
template <typename T>
void attention_impl(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                    const at::Tensor& tables_t, const at::Tensor& lens_t, at::Tensor& out, const Shapes& sh,
                    float scale, int64_t max_context) {
  const T* kp = k_cache.data_ptr<T>();
  const T* vp = v_cache.data_ptr<T>();
  const int64_t* tables = tables_t.data_ptr<int64_t>();
  const int64_t* lens = lens_t.data_ptr<int64_t>();
  T* op = out.data_ptr<T>();
  const int64_t D = sh.dim, G = sh.group, bs = sh.block_size;
  check_tables(tables, lens, sh, max_context);
  at::parallel_for(0, sh.num_seqs * sh.kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(G * D), tmp(G * bs), rows(G * max_context), acc(G * D);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t s = item / sh.kv_heads, h = item % sh.kv_heads;
      const int64_t ctx = std::min(lens[s], max_context);
      const int64_t* table = tables + s * sh.width;
      std::fill(acc.begin(), acc.end(), 0.f);
      if (ctx > 0) {
        item_scores<T>(q, kp, table, s, h, ctx, sh, scale, qf.data(), tmp.data(), rows.data(), max_context);
        rows_softmax(rows.data(), max_context, G, ctx);
        item_values<T>(rows.data(), max_context, vp, table, h, ctx, sh, acc.data());
      }
      T* o = op + (s * sh.heads + h * G) * D;
      for (int64_t i = 0; i < G * D; ++i) o[i] = static_cast<T>(acc[i]);
    }
  });
}

// k_cache[h, slot // bs, :, slot % bs] = k[t, h]; v_cache[h, slot] = v[t, h]; slot -1: skipped.
template <typename T>
void store_impl(const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache, at::Tensor& v_cache,
                const at::Tensor& slots_t, int64_t bs) {
  const int64_t T_ = k.size(0), kvh = k.size(1), D = k.size(2), head_slots = k_cache.size(1);
  const int64_t* slots = slots_t.data_ptr<int64_t>();
  for (int64_t t = 0; t < T_; ++t)  // a slot outside the cache would write outside it
    TORCH_CHECK(slots[t] < head_slots, "paged_store_kv: slot ", slots[t], " of row ", t, " is outside the cache (",
                head_slots, " slots)");
  const T* kp = k.data_ptr<T>();
  const T* vp = v.data_ptr<T>();
  T* kc = k_cache.data_ptr<T>();
  T* vc = v_cache.data_ptr<T>();
  const int64_t ks0 = k.stride(0), ks1 = k.stride(1), vs0 = v.stride(0), vs1 = v.stride(1);
  at::parallel_for(0, T_, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t slot = slots[t];
      if (slot < 0) continue;
      const int64_t blk = slot / bs, off = slot % bs;
      for (int64_t h = 0; h < kvh; ++h) {
        T* kb = kc + (h * head_slots + blk * bs) * D + off;  // [D, bs] block, column `off`
        const T* kr = kp + t * ks0 + h * ks1;
        for (int64_t d = 0; d < D; ++d) kb[d * bs] = kr[d];
        std::memcpy(vc + (h * head_slots + slot) * D, vp + t * vs0 + h * vs1, D * sizeof(T));
      }
    }
  });
}

void paged_store_kv(const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache, at::Tensor& v_cache,
                    const at::Tensor& slot_mapping, int64_t block_size) {
  // k, v: [T, kv_heads, D] (rows may be strided; head_dim contiguous). slot_mapping: int64 [T].
  TORCH_CHECK(k.dim() == 3 && v.sizes() == k.sizes() && k.stride(2) == 1 && v.stride(2) == 1,
              "paged_store_kv: k and v must be [T, kv_heads, D] with contiguous D");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.sizes() == v_cache.sizes() &&
                  k_cache.size(0) == k.size(1) && k_cache.size(2) == k.size(2),
              "paged_store_kv: cache shapes");
  TORCH_CHECK(k.scalar_type() == k_cache.scalar_type() && v.scalar_type() == v_cache.scalar_type() &&
                  k.scalar_type() == v.scalar_type(),
              "paged_store_kv: dtypes differ");
  TORCH_CHECK(block_size > 0 && k_cache.size(1) % block_size == 0, "paged_store_kv: bad block_size");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() &&
                  slot_mapping.numel() == k.size(0),
              "paged_store_kv: slot_mapping must be contiguous int64 [T]");
  if (k.scalar_type() == at::kFloat) {
    store_impl<float>(k, v, k_cache, v_cache, slot_mapping, block_size);
  } else if (k.scalar_type() == at::kBFloat16) {
    store_impl<c10::BFloat16>(k, v, k_cache, v_cache, slot_mapping, block_size);
  } else {
    TORCH_CHECK(false, "paged_store_kv: float32 or bfloat16 only");
  }
}

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& block_tables, const at::Tensor& context_lens, int64_t block_size,
                                  int64_t max_context, double scale) {
  // q: [num_seqs, heads, D]. Returns [num_seqs, heads, D] in the cache's dtype.
  const Shapes sh = check(q, k_cache, block_tables, context_lens, block_size);
  TORCH_CHECK(v_cache.sizes() == k_cache.sizes() && v_cache.scalar_type() == k_cache.scalar_type() &&
                  v_cache.is_contiguous(),
              "paged decode: k_cache and v_cache must match");
  TORCH_CHECK(max_context >= 0, "paged decode: max_context must be >= 0");
  auto out = at::empty({sh.num_seqs, sh.heads, sh.dim}, v_cache.options());
  if (q.scalar_type() == at::kFloat) {
    attention_impl<float>(q, k_cache, v_cache, block_tables, context_lens, out, sh, static_cast<float>(scale), max_context);
  } else {
    attention_impl<c10::BFloat16>(q, k_cache, v_cache, block_tables, context_lens, out, sh, static_cast<float>(scale),
                                  max_context);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tokenmill, m) {
  m.def("paged_store_kv(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_mapping, "
        "int block_size) -> ()");
  m.def("paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor context_lens, int block_size, int max_context, float scale) -> Tensor");
  m.impl("paged_decode_attention", c10::DispatchKey::CPU, TORCH_FN(paged_decode_attention));
  m.impl("paged_store_kv", c10::DispatchKey::CPU, TORCH_FN(paged_store_kv));
}
