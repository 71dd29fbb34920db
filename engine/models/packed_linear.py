"""oneDNN-packed linear weights for bf16 on CPU.

A plain bf16 `F.linear` on CPU hands oneDNN a row-major weight that it re-lays into its blocked
(AMX/AVX-512) format on every call: for decode-sized inputs that reorder costs about as much as
the product itself. Packing each weight once at start-up removes it; measured on bench-135m's
linears (2 threads): 1.8x faster at 1 row, 1.5x at 32 rows, no slower at 512. The results are
bit-identical to `F.linear` in bf16 (tests/engine/test_packed_linear.py), so greedy output does not
change. float32 is left alone: there oneDNN's packed kernel rounds differently from `F.linear`.
"""

from __future__ import annotations

import functools

import torch
from torch import nn


def packing_supported(device: torch.device, dtype: torch.dtype) -> bool:
    return (
        device.type == "cpu"
        and dtype == torch.bfloat16
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and _cpu_packs_bf16()
    )


@functools.lru_cache(maxsize=1)
def _cpu_packs_bf16() -> bool:
    """oneDNN's bf16 reorder needs AVX512-BW/VL/DQ or AVX-NE-CONVERT; an AVX2-only CPU (a Zen 3, say)
    refuses it at the first weight. Asked once by packing a tiny weight: torch has no public flag."""
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=torch.bfloat16), 1)
    except RuntimeError:
        return False
    return True


class PackedLinear(nn.Module):
    """y = x W^T + b with W held in oneDNN's blocked layout. x: [..., in_features]."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, batch_hint: int) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        # An opaque mkldnn tensor: it cannot be viewed, sliced or copied back, only multiplied.
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), batch_hint)
        self.bias = None if bias is None else bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def pack_linears(model: nn.Module, batch_hint: int) -> int:
    """Replace every nn.Linear in `model` by a PackedLinear (in place); returns how many.
    batch_hint: the row count oneDNN tunes the layout for (any count works; it matters little)."""
    targets = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
               if isinstance(child, nn.Linear)]
    for parent, name, child in targets:
        setattr(parent, name, PackedLinear(child.weight, child.bias, batch_hint))
    return len(targets)
