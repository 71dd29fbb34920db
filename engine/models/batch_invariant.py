"""Batch-invariant mode (`EngineConfig.deterministic`, `--deterministic`): a row's result depends on its
own tokens only, never on how many rows share the step, where it sits, how its prompt was chunked or
cached, or which thread ran it, so a greedy or seeded request gives the same tokens alone, beside 31
others, after a prefix-cache hit, and after preemption by recompute.

Outside the mode the engine picks, per row count, the fastest kernel (oneDNN's AMX GEMM above a few
rows, SDPA for prefill attention), and those change their reduction order with the shape: in bf16 a
prompt served from the prefix cache can then differ from the computed one within a few tokens. In the
mode every kernel of a step reduces each row in one fixed order:

- Linears, bf16: oneDNN's packed product in calls of at most CALL_ROWS (32) rows (`TiledLinear`). Up
  to 32 rows oneDNN (3.12, AMX) computes each row exactly as it computes that row alone; from 33 rows
  on it switches to another blocking and rows change (measured: docs/benchmarks/log.md). That is checked
  per weight shape at start-up (`rows_agree`); a shape that fails it takes the C++ kernel in oneDNN's
  order (below) at every row count instead (cpu_weights._kernel_everywhere: one summation order
  whatever the rows, checked on cancelling inputs at start-up). Below oneDNN, for the few rows of a
  decode step, the C++ kernel that sums in oneDNN's own order (`tokenmill::gemv_blocked`: per 32
  columns an even and an odd chain, as AMX's tdpbf16ps sums them; on an AMX CPU its calls of up to 32
  rows run on the tile unit) where `kernel_agrees` finds its bits equal to oneDNN's for the shape (on
  random and on cancelling inputs): as fast as the default's kernel, and the same bits as oneDNN
  gives the row in any batch. INT8 weights: their C++ kernel at every row count (the same
  argument, vpdpwssd). float32 weights: `F.linear` one row at a time (`RowLinear`; MKL's float32
  products change rows with the batch too).
- Attention: every query row, prefill or decode, through the paged decode kernel
  (engine/kernels/csrc/cpu_attention.cpp): a prompt chunk is packed as one decode per position
  (model_runner.py, as speculation's verification rows already are), so its scores, softmax and
  value sums run over the row's own context in cache order, whatever the chunk size or cached prefix.
- Norms and residual adds: the C++ per-row kernel (cpu_layers.cpp) in every dtype.
- Sampling: per-row already (engine/sample/sampler.py: each row's draw from its request's own generator).
- Mixture-of-experts routers: float32 logits from the float32 kernel at every row count (one-row
  products without it; cpu_weights._invariant_routers); the experts are linears as above, the sum
  back per token in expert order (engine/models/moe.py).
- LoRA deltas: tokenmill::lora_add_ at every row count (LoraBatch.invariant: no PyTorch products for
  prompt chunks), each row summed in a fixed order on every path of engine/kernels/csrc/cpu_lora.cpp.

The bf16 results do not depend on the thread count either (no reduction is split across threads);
float32's one-row products are MKL's, split as MKL decides for the thread count, which is fixed for the
process. CPU only; the kernels must build (a compiler; AVX2 and FMA at least for bf16/INT8 weights): else the
engine refuses to start rather than serve a mode it cannot keep.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.models.invariant_linear import RowLinear


def unsupported(device: torch.device, attention_backend: str) -> str | None:
    """Why the mode cannot run with this device and attention backend name, or None."""
    if device.type != "cpu":
        return f"runs on the CPU only (device is {device})"
    if attention_backend != "cpu":
        return f"needs the C++ attention kernels (attention backend is {attention_backend!r})"
    return None


def row_linears(model: nn.Module) -> None:
    """Every linear of `model` (a LlamaForCausalLM), the logits head included, as a RowLinear."""
    model.replace_linears(lambda weight, bias, role: RowLinear(weight, bias))
