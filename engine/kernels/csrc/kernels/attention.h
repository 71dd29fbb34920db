// Paged decode attention's per-item arithmetic (torch-free; engine/kernels/csrc/cpu_attention.cpp checks the
// tensors and spreads the items over the threads). One body (kernels/attention_body.inc) compiled for
// AVX-512, AVX2 and no extension (kernels/attention_isa.cpp); each path gives the same bits, but for
// the portable one (no FMA).
#pragma once

#include <cstdint>

namespace tokenmill::attention {

struct Shapes {
  int64_t num_seqs, heads, dim, kv_heads, group, block_size, head_slots, width;
};

// One call's operands: q [num_seqs, heads, D] (rows strided by q_s0, q_s1), the caches [kv_heads,
// slots, D] (K used dimension-major per block, V token-major), the tables [num_seqs, width], the
// context lengths, out [num_seqs, heads, D]; float32, or bf16 where `bf16`. window > 0: the query
// (at position ctx - 1) sees only positions ctx - window .. ctx - 1, and blocks before them are never
// read; softcap > 0: each scaled score s becomes softcap * tanh(s / softcap) before the softmax;
// sinks (nullptr: none): float32 [heads], query head h's sink logit joins its softmax's denominator
// (m = max(m, sink), l += exp(sink - m); no value: GPT-OSS's learned attention sinks).
struct Call {
  const void* q;
  int64_t q_s0, q_s1;
  const void* k;
  const void* v;
  const int64_t* tables;
  const int64_t* lens;
  void* out;
  Shapes sh;
  float scale;
  int64_t max_context;
  bool bf16;
  int64_t window;
  float softcap;
  const float* sinks;
};

// Items [begin, end) of a call: item = sequence * kv_heads + KV head.
namespace avx512 {
void items(const Call& c, int64_t begin, int64_t end);
}
namespace avx2 {
void items(const Call& c, int64_t begin, int64_t end);
}
namespace portable {
void items(const Call& c, int64_t begin, int64_t end);
}

}  // namespace tokenmill::attention
