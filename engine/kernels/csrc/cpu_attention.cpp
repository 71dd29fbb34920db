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

#include "isa.h"
#include "kernels/attention.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <vector>

namespace {

using tokenmill::Isa;
using tokenmill::attention::Shapes;

// The path of this process's attention: AVX-512, AVX2, or portable (isa.h).
Isa path() { return tokenmill::vector_isa(); }

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

// out[s, h * group + g] = softmax(scale q k^T) v per (sequence, KV head) item (kernels/attention.h).
void attention_impl(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                    const at::Tensor& tables_t, const at::Tensor& lens_t, at::Tensor& out, const Shapes& sh,
                    float scale, int64_t max_context, int64_t window, float softcap, const float* sinks) {
  const int64_t* tables = tables_t.data_ptr<int64_t>();
  const int64_t* lens = lens_t.data_ptr<int64_t>();
  check_tables(tables, lens, sh, max_context);
  const tokenmill::attention::Call c{q.data_ptr(), q.stride(0), q.stride(1), k_cache.data_ptr(), v_cache.data_ptr(),
                                     tables, lens, out.data_ptr(), sh, scale, max_context,
                                     q.scalar_type() == at::kBFloat16, window, softcap, sinks};
  const Isa p = path();
  at::parallel_for(0, sh.num_seqs * sh.kv_heads, 1, [&](int64_t begin, int64_t end) {
    if (p == Isa::Avx512) {
      tokenmill::attention::avx512::items(c, begin, end);
    } else if (p == Isa::Avx2) {
      tokenmill::attention::avx2::items(c, begin, end);
    } else {
      tokenmill::attention::portable::items(c, begin, end);
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
                                  int64_t max_context, double scale, int64_t window, double softcap,
                                  const std::optional<at::Tensor>& sinks = std::nullopt) {
  // q: [num_seqs, heads, D]. Returns [num_seqs, heads, D] in the cache's dtype. window: a sliding
  // window (0: none), softcap: attention-logit soft-capping (0: none), sinks: [heads] attention-sink
  // logits (none: none; any float dtype, read as float32); see kernels/attention.h.
  const Shapes sh = check(q, k_cache, block_tables, context_lens, block_size);
  TORCH_CHECK(v_cache.sizes() == k_cache.sizes() && v_cache.scalar_type() == k_cache.scalar_type() &&
                  v_cache.is_contiguous(),
              "paged decode: k_cache and v_cache must match");
  TORCH_CHECK(max_context >= 0, "paged decode: max_context must be >= 0");
  TORCH_CHECK(window >= 0 && softcap >= 0, "paged decode: window and softcap must be >= 0 (0: none)");
  at::Tensor sinks_f;  // float32 [heads], kept alive through the call
  if (sinks.has_value()) {
    TORCH_CHECK(sinks->dim() == 1 && sinks->size(0) == sh.heads, "paged decode: sinks must be [heads] (",
                sh.heads, ")");
    sinks_f = sinks->to(at::kFloat).contiguous();
  }
  auto out = at::empty({sh.num_seqs, sh.heads, sh.dim}, v_cache.options());
  attention_impl(q, k_cache, v_cache, block_tables, context_lens, out, sh, static_cast<float>(scale), max_context,
                 window, static_cast<float>(softcap), sinks_f.defined() ? sinks_f.data_ptr<float>() : nullptr);
  return out;
}

// paged_decode_attention with learned attention sinks (GPT-OSS), an op of its own: the schema of
// paged_decode_attention stays as the C++ decode loop (cpu_decode.cpp) calls it.
at::Tensor paged_decode_attention_sinks(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                        const at::Tensor& block_tables, const at::Tensor& context_lens,
                                        int64_t block_size, int64_t max_context, double scale, int64_t window,
                                        double softcap, const at::Tensor& sinks) {
  return paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, block_size, max_context, scale,
                                window, softcap, sinks);
}

at::Tensor paged_decode_attention_plain(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                        const at::Tensor& block_tables, const at::Tensor& context_lens,
                                        int64_t block_size, int64_t max_context, double scale, int64_t window,
                                        double softcap) {
  return paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, block_size, max_context, scale,
                                window, softcap);
}

std::string attention_path() { return tokenmill::isa_name(path()); }

}  // namespace

TORCH_LIBRARY_FRAGMENT(tokenmill, m) {
  m.def("paged_store_kv(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_mapping, "
        "int block_size) -> ()");
  m.def("paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor context_lens, int block_size, int max_context, float scale, int window=0, float softcap=0.0) -> Tensor");
  m.def("paged_decode_attention_sinks(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor context_lens, int block_size, int max_context, float scale, int window, float softcap, "
        "Tensor sinks) -> Tensor");
  m.impl("paged_decode_attention", c10::DispatchKey::CPU, TORCH_FN(paged_decode_attention_plain));
  m.impl("paged_decode_attention_sinks", c10::DispatchKey::CPU, TORCH_FN(paged_decode_attention_sinks));
  m.impl("paged_store_kv", c10::DispatchKey::CPU, TORCH_FN(paged_store_kv));
  m.def("attention_path() -> str", &attention_path);
}
