"""Linears whose rows do not depend on the batch (batch-invariant mode, engine/batch_invariant.py).

`TiledLinear` (bf16): oneDNN's packed product in calls of at most CALL_ROWS rows, within which oneDNN
computes each row as it computes it alone (checked per weight shape by `rows_agree` at start-up).
`RowLinear` (float32): `F.linear` one row at a time.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.models.packed_linear import PackedLinear

CALL_ROWS = 32  # most rows of one oneDNN call in the mode (docs/BENCHMARKS.md: 33+ rows change them)


class RowLinear(nn.Module):
    """float32 y = x W^T + b, one `F.linear` per row of x: each row's product has the same shape (and so
    the same reduction order) whatever the batch. x: [..., in_features]."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.weight = weight.detach()
        self.bias = None if bias is None else bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)  # [M, K]
        out = rows.new_empty(rows.shape[0], self.out_features)  # [M, N]
        for i in range(rows.shape[0]):
            out[i : i + 1] = F.linear(rows[i : i + 1], self.weight, self.bias)
        return out.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class TiledLinear(nn.Module):
    """bf16 y = x W^T + b on oneDNN's packed weight, in calls of at most `call_rows` consecutive rows of
    x (no padding). x: [..., in_features]."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, call_rows: int = CALL_ROWS) -> None:
        super().__init__()
        self.inner = PackedLinear(weight, bias, call_rows)
        self.out_features, self.in_features = weight.shape
        self.call_rows = call_rows
        self.packed, self.bias = self.inner.packed, self.inner.bias  # read by the C++ layer loop

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)  # [M, K]
        if rows.shape[0] <= self.call_rows:
            return self.inner(x)
        parts = [self.inner(rows[i : i + self.call_rows]) for i in range(0, rows.shape[0], self.call_rows)]
        return torch.cat(parts).view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, call_rows={self.call_rows}"


def rows_agree(lin: nn.Module, in_features: int, dtype: torch.dtype, rows: int = CALL_ROWS) -> bool:
    """Whether `lin` gives every row of a batch of 1..rows rows (random inputs) the bits it gives that
    row alone: the start-up check of a TiledLinear's weight shape."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(rows, in_features, generator=g).to(dtype)
    with torch.inference_mode():
        alone = torch.cat([lin(x[i : i + 1]) for i in range(rows)])
        return all(torch.equal(lin(x[:m]), alone[:m]) for m in range(2, rows + 1))
