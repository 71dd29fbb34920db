"""An MoE layer's routed experts in one C++ call on the CPU (engine/kernels/csrc/cpu_moe.cpp, the "moe"
kernel group).

After replace_linears each expert is two of the engine's linear modules; the PyTorch path (moe.py
grouped_experts) calls them expert by expert: 2 K calls a layer at batch 1, each paying the
interpreter and the dispatcher and each splitting only its own few chunks over the threads.
`CpuExperts` hands every expert's packed weights (the modules' own tensors: no copy) to one call that
sorts the tokens by expert, streams each active expert's weights once for all its tokens and spreads
(expert, chunk) items over the threads. Its arithmetic is the modules' kernels' and its sum back the
loop's, so it gives the loop's bits (tests/engine/test_cpu_moe.py); the loop stays as the fallback:
for steps of more rows than the modules' kernels take (prefill chunks: oneDNN or the dequantized
product wins there), for linears the kernel does not take (GGUF blocks, the batch-invariant mode's,
biases), for GPT-OSS's clamped SwiGLU (its own block forward), and where the moe group does not load.

Shapes: x [T, H], ids / weights [T, K] (the float32 routing), I an expert's intermediate size.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from engine.kernels import cpu_kernels
from engine.models.cpu_linear import GemvF32Linear, GemvLinear, Int8Linear


@dataclass
class CpuExperts:
    """One layer's experts as the kernel takes them: per expert, the packed gate/up (interleaved for
    bf16 and INT8, silu(gate) * up in the kernel's epilogue) and down weights, INT8's packed scales."""

    kind: str  # "bf16", "int8" or "f32" (the moe_path kinds)
    gate_up: list[torch.Tensor]
    gate_up_scales: list[torch.Tensor]  # INT8 only, else empty
    down: list[torch.Tensor]
    down_scales: list[torch.Tensor]
    inter: int
    max_rows: int  # the most rows (tokens) a step may have here: every expert module's kernel limit

    def applies(self, x: torch.Tensor) -> bool:
        """Whether this step's x [T, H] runs here: every expert's rows (at most T) on its kernel."""
        return x.dim() == 2 and x.shape[0] <= self.max_rows

    def __call__(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x [T, H], ids [T, K] int64, weights [T, K] float32 -> [T, H] in x's dtype."""
        return torch.ops.tokenmill.moe_experts(x, ids, weights, self.gate_up, self.gate_up_scales, self.down,
                                               self.down_scales, self.inter)


def cpu_experts(gate_up: Sequence[nn.Module], down: Sequence[nn.Module]) -> CpuExperts | str:
    """The kernel's operands for an MoE layer's per-expert modules, or why it cannot run them (the
    moe group not loaded: TOKENMILL_REQUIRE_KERNELS=1 makes that KernelsUnavailable)."""
    first = gate_up[0]
    if any(m.bias is not None for m in [*gate_up, *down] if hasattr(m, "bias")):
        return "experts with biases"
    if all(isinstance(m, GemvLinear) for m in [*gate_up, *down]):
        kind = "bf16"
        ok = all(m.interleave for m in gate_up) and not any(m.interleave for m in down)
    elif all(isinstance(m, Int8Linear) for m in [*gate_up, *down]):
        kind = "int8"
        ok = all(m.kernel and m.interleave for m in gate_up) and all(m.kernel and not m.interleave for m in down)
    elif all(isinstance(m, GemvF32Linear) for m in [*gate_up, *down]):
        kind = "f32"
        ok = True
    else:
        return f"the experts' linears are {type(first).__name__} / {type(down[0]).__name__}"
    if not ok:
        return f"the experts' {kind} linears are not packed for the kernel"
    reason = cpu_kernels.load("moe")
    if reason is not None:
        return f"moe kernels: {reason}"
    if torch.ops.tokenmill.moe_path(kind) == "none":
        return "this CPU lacks AVX2/FMA"
    max_rows = min(m.max_rows for m in [*gate_up, *down])
    if max_rows <= 0:
        return "the experts' kernels take no rows (their other path is faster for every batch)"

    def packed(m: nn.Module) -> torch.Tensor:
        return m.q if isinstance(m, Int8Linear) else m.packed

    scales = (lambda ms: [m.scales for m in ms]) if kind == "int8" else (lambda ms: [])
    return CpuExperts(kind, [packed(m) for m in gate_up], scales(gate_up), [packed(m) for m in down], scales(down),
                      first.out_features // 2, max_rows)
