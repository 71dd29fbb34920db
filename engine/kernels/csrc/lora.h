// The LoRA group's calls for the decode loop (cpu_decode.cpp), as a table of functions: the decode
// group neither links to nor builds against the LoRA group (each builds and loads on its own:
// engine/kernels/cpu_kernels.py); it asks the dispatcher once for tokenmill::lora_api, the table's address in
// this process, and refuses adapters where the LoRA group did not load. Its 120 calls a step skip the
// dispatcher's boxing of five tensor lists and the checks of every adapter's tensors: the loop's
// adapters are checked and laid out once per set of adapters (LoraLinear, held by the decode loop's
// LoraSet), each call then only sorts the step's rows by adapter.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

#include "kernels/lora.h"

namespace tokenmill {

struct LoraApi {
  // lin from one linear's lists, one tensor per adapter (spans, packed: or empty for none), as
  // tokenmill::lora_add_ takes them, for rows of `in` columns into y of `out` columns (-1: as the
  // adapters' A and B^T say, the same for all). Throws on tensors the kernel cannot take.
  void (*prepare)(LoraLinear& lin, int64_t in, int64_t out, c10::ArrayRef<at::Tensor> a, c10::ArrayRef<at::Tensor> bt,
                  c10::ArrayRef<at::Tensor> spans, c10::ArrayRef<at::Tensor> packed);
  // y[t] += row t's adapter delta (slots[t]: its adapter in lin, -1: none) for x [T, in], y [T, out].
  void (*add_linear)(at::Tensor& y, const at::Tensor& x, const LoraLinear& lin, const at::Tensor& slots);
  // Whether add_linear_silu runs for lin and rows like x: bf16 rows and pairs on the AMX tile unit, an
  // even `out`.
  bool (*silu_fusable)(const LoraLinear& lin, const at::Tensor& x);
  // add_linear on y, a gated MLP's [gate | up] product, then act[t] = silu(gate[t]) * up[t] for every
  // row (the fused product's activation, bit for bit) in the same parallel region, each thread on rows
  // whose delta it finished: one pass fewer than a separate activation. act: bf16 [T, out / 2].
  void (*add_linear_silu)(at::Tensor& y, const at::Tensor& x, const LoraLinear& lin, const at::Tensor& slots,
                          at::Tensor& act);
};

}  // namespace tokenmill
