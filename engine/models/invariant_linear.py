"""Linears whose rows do not depend on the batch (batch-invariant mode, engine/models/batch_invariant.py).

`TiledLinear` (bf16): oneDNN's packed product in calls of at most CALL_ROWS rows, within which oneDNN
computes each row as it computes it alone (checked per weight shape by `rows_agree` at start-up), and
up to `kernel_rows` rows the C++ kernel that sums in oneDNN's own order (`tokenmill::gemv_blocked`),
where the start-up check `kernel_agrees` finds its bits equal to oneDNN's: a one-row decode then reads
the weight as fast as the default's small-batch kernel, with the bits the row has in a prefill chunk.
`RowLinear` (float32): `F.linear` one row at a time.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.models.packed_linear import PackedLinear

CALL_ROWS = 32  # most rows of one oneDNN call in the mode (docs/benchmarks/log.md: 33+ rows change them)


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
        self.kernel_rows = 0  # up to this many rows: gemv_blocked (use_kernel); 0: oneDNN only
        self.gemv_packed: torch.Tensor | None = None  # the kernel's layout (cpu_gemv.cpp), once used

    def use_kernel(self, weight: torch.Tensor) -> None:
        """Keep the kernel's layout of `weight` too (twice the weight bytes); kernel_rows is set apart."""
        self.gemv_packed = torch.ops.tokenmill.gemv_pack_bf16(weight.detach().contiguous(), False)

    def kernel(self, x: torch.Tensor) -> torch.Tensor:
        """The C++ product in oneDNN's order (whatever kernel_rows says). x: [..., in_features] bf16."""
        return torch.ops.tokenmill.gemv_blocked(x, self.gemv_packed, self.out_features, self.in_features, self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)  # [M, K]
        if rows.shape[0] <= self.kernel_rows:
            return self.kernel(x)
        if rows.shape[0] <= self.call_rows:
            return self.inner(x)
        parts = [self.inner(rows[i : i + self.call_rows]) for i in range(0, rows.shape[0], self.call_rows)]
        return torch.cat(parts).view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, call_rows={self.call_rows}, "
                f"kernel_rows={self.kernel_rows}")


def rows_agree(lin: nn.Module, in_features: int, dtype: torch.dtype, rows: int = CALL_ROWS) -> bool:
    """Whether `lin` gives every row of a batch of 1..rows rows (random inputs) the bits it gives that
    row alone: the start-up check of a TiledLinear's weight shape."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(rows, in_features, generator=g).to(dtype)
    with torch.inference_mode():
        alone = torch.cat([lin(x[i : i + 1]) for i in range(rows)])
        return all(torch.equal(lin(x[:m]), alone[:m]) for m in range(2, rows + 1))


def cancelling_inputs(rows: int, in_features: int, out_features: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(x [rows, K], W [N, K]) in bf16 whose products nearly cancel: x = [u, u], W = [a, -a(1 + e)] with
    |e| ~ 2^-9, so each output is small against its partial sums and any change in the order they are
    summed in shows in most outputs' bf16 bits (random inputs show it in ~1 of 10^4)."""
    g = torch.Generator().manual_seed(seed)
    half = in_features // 2
    a = torch.randn(out_features, half, generator=g) * 0.05
    e = torch.randn(out_features, half, generator=g) * 2.0**-9
    w = torch.cat([a, -a * (1 + e), torch.zeros(out_features, in_features - 2 * half)], 1)
    u = torch.randn(rows, half, generator=g)
    x = torch.cat([u, u, torch.zeros(rows, in_features - 2 * half)], 1)
    return x.bfloat16(), w.bfloat16()


def kernel_agrees(lin: TiledLinear, weight: torch.Tensor, rows: int = CALL_ROWS) -> bool:
    """Whether gemv_blocked gives oneDNN's bits for `weight`'s shape: 1 and `rows` rows, on random inputs
    and on cancelling ones (a weight of the same shape), against lin's oneDNN product (rows_agree
    passed: oneDNN's rows do not change within `rows`). The start-up check; it leaves `lin` holding the
    kernel's copy of `weight` (use_kernel)."""
    n, k = weight.shape
    g = torch.Generator().manual_seed(1)
    cases = [(torch.randn(rows, k, generator=g).bfloat16(), lin)]
    x, w = cancelling_inputs(rows, k, n)
    probe = TiledLinear(w, None if lin.bias is None else torch.zeros_like(lin.bias), lin.call_rows)
    cases.append((x, probe))
    with torch.inference_mode():
        for x, tiled in cases:
            tiled.use_kernel(w if tiled is probe else weight)
            for m in (1, rows):
                if not torch.equal(tiled.kernel(x[:m]), tiled.inner(x[:m])):
                    return False
    return True
