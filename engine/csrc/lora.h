// tokenmill::lora_add_ as a C++ call (cpu_lora.cpp), for the decode loop (cpu_decode.cpp): its 120
// calls a step skip the dispatcher's boxing of five tensor lists and the checks of every adapter's
// tensors: the loop's adapters are checked and laid out once per set of adapters (LoraLinear, held by
// the decode loop's LoraSet), each call then only sorts the step's rows by adapter.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <vector>

namespace tokenmill {

struct LoraSpan {  // B^T is non-zero only at output columns [c0, c1) from ranks [r0, r1)
  int64_t c0, c1, r0, r1;
};

// One linear's adapters (one per segment of a step: the rows' slots index them), checked: each
// adapter's rank (0: it does not target the linear), its spans, and pointers to A [R, in], B^T
// [R, out] (of dtype wtype) and to their tile layouts (lora_pack_bf16; null where not given). The
// tensors pointed to are the holder's to keep alive.
struct LoraLinear {
  int64_t in = 0, out = 0, n = 0, max_rank = 0;
  bool any = false;  // some adapter targets the linear
  at::ScalarType wtype = at::kFloat;
  std::vector<int64_t> rank;
  std::vector<std::vector<LoraSpan>> spans;
  std::vector<const void*> ap, bp;
  std::vector<const at::BFloat16*> pa, pb;
};

// lin from one linear's lists, one tensor per adapter (spans, packed: or empty for none), as
// tokenmill::lora_add_ takes them, for rows of `in` columns into y of `out` columns (-1: as the
// adapters' A and B^T say, the same for all). Throws on tensors the kernel cannot take.
void lora_prepare(LoraLinear& lin, int64_t in, int64_t out, c10::ArrayRef<at::Tensor> a, c10::ArrayRef<at::Tensor> bt,
                  c10::ArrayRef<at::Tensor> spans, c10::ArrayRef<at::Tensor> packed);

// y[t] += row t's adapter delta (slots[t]: its adapter in lin, -1: none) for x [T, in], y [T, out].
void lora_add_linear(at::Tensor& y, const at::Tensor& x, const LoraLinear& lin, const at::Tensor& slots);

// Whether lora_add_linear_silu runs for lin and rows like x: bf16 rows and pairs on the AMX tile
// unit, a CPU with AVX-512 BF16 (silu.h), an even `out`.
bool lora_silu_fusable(const LoraLinear& lin, const at::Tensor& x);

// lora_add_linear on y, a gated MLP's [gate | up] product, then act[t] = silu(gate[t]) * up[t] for
// every row (silu.h: the fused product's activation, bit for bit) in the same parallel region, each
// thread on rows whose delta it finished: one pass fewer than a separate activation. act: bf16
// [T, out / 2], contiguous.
void lora_add_linear_silu(at::Tensor& y, const at::Tensor& x, const LoraLinear& lin, const at::Tensor& slots,
                          at::Tensor& act);

}  // namespace tokenmill
