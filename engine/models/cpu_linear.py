"""Linear layers on the C++ small-batch kernels (engine/kernels/csrc/cpu_gemv.cpp).

`GemvLinear` (bf16 weights): the kernel for up to `max_rows` rows of x, where it streams the weight
at close to memory bandwidth and oneDNN pays a fixed cost per call; oneDNN's packed product
(packed_linear.py) above that, where its AMX/AVX-512 blocking wins. It keeps both layouts, so twice
the weight memory; `max_rows` is measured per shape at start-up (`measure_max_rows`).

`Int8Linear` (INT8 weight-only, engine/models/quantization.py): the kernel (int16 activations x int8
weights: VNNI, or AVX2's vpmaddwd) for up to `max_rows` rows; above that, and wherever the kernels cannot run, the
weight is dequantized for the call and multiplied by PyTorch. One int8 copy: half the bf16 bytes.
`Int8Embedding` looks token rows up in int8 (a tied model's in the logits head's own weight).

Both offer `silu_mul(x)` when built with `interleave=True` from a gated MLP's fused gate/up weight:
silu(gate) * up straight from the kernel's epilogue (one pass instead of three ops).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from engine.kernels import cpu_kernels
from engine.models.packed_linear import PackedLinear
from engine.models.quantization import Int8Weight

ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)  # row counts measure_max_rows times (it stops at a loss)
ALWAYS = 1 << 62  # max_rows: the kernel for every row count


def kernels_unavailable(kind: str) -> str | None:
    """None when the C++ linear kernels of `kind` ("bf16", "int8" or "f32") run here, else why not."""
    reason = cpu_kernels.load("linear")
    if reason is not None:
        return reason
    if kind == "f32":
        return None if torch.ops.tokenmill.gemv_f32_supported() else "this CPU lacks AVX2/FMA"
    if not cpu_supports(kind):
        return "this CPU lacks AVX2/FMA (the kernels' least path)"
    return None


def cpu_supports(kind: str) -> bool:
    """The loaded kernels' own check of this CPU's instructions (engine/kernels/csrc/isa.h): whether `kind`
    ("bf16", "int8"; "amx": bf16 calls of 1..32 rows on the tile unit) has a path here."""
    return cpu_kernels.load("linear") is None and bool(torch.ops.tokenmill.gemv_supported(kind))


def _rows(x: torch.Tensor, in_features: int) -> int:
    return x.numel() // in_features


def silu_mul(h: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of a fused gate/up product [..., 2I] -> [..., I] (PyTorch's three ops)."""
    gate, up = h.chunk(2, dim=-1)
    return F.silu(gate) * up


class GemvLinear(nn.Module):
    """bf16 y = x W^T + b: the C++ kernel up to max_rows rows, `large` (oneDNN packed, or F.linear
    when this torch has no oneDNN) above. x: [..., in_features]."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, max_rows: int, batch_hint: int,
                 interleave: bool = False, onednn: bool = True) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.max_rows = max_rows
        self.interleave = interleave  # packed as gate/up block pairs: only silu_mul uses the kernel
        self.packed = torch.ops.tokenmill.gemv_pack_bf16(weight.detach().contiguous(), interleave)
        self.bias = None if bias is None else bias.detach()
        # Above max_rows: oneDNN's packed weight, or the plain one for F.linear.
        self.large = PackedLinear(weight, bias, batch_hint) if onednn else None
        self.weight = weight.detach() if self.large is None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _rows(x, self.in_features) <= self.max_rows:  # interleaved: the plain [gate | up] product (LoRA steps)
            op = torch.ops.tokenmill.gemv_split if self.interleave else torch.ops.tokenmill.gemv
            return op(x, self.packed, None, self.out_features, self.in_features, self.bias)
        return self._large(x)

    def _large(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias) if self.large is None else self.large(x)

    def silu_mul(self, x: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of a fused gate/up weight: [..., out_features / 2]."""
        if _rows(x, self.in_features) <= self.max_rows:
            return torch.ops.tokenmill.gemv_silu_mul(x, self.packed, None, self.out_features, self.in_features, self.bias)
        return silu_mul(self._large(x))

    @property
    def weight_bytes(self) -> int:
        """Bytes one call reads at decode sizes: the kernel's layout (padded to whole blocks)."""
        return self.packed.numel() * 2

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, max_rows={self.max_rows}, "
                f"interleave={self.interleave}")


class GemvF32Linear(nn.Module):
    """float32 y = x W^T + b: the AVX2 kernel (engine/kernels/csrc/cpu_gemv_f32.cpp) up to max_rows rows, where
    it streams the weight once and MKL re-reads it per call; MKL's F.linear above. It keeps both
    layouts, so twice the weight memory. x: [..., in_features] float32."""

    interleave = False  # no fused activation: the MLP applies silu(gate) * up to the product

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, max_rows: int) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.max_rows = max_rows
        self.packed = torch.ops.tokenmill.gemv_pack_f32(weight.detach())  # [Nb, K, 8]
        self.weight = weight.detach()  # [N, K], for F.linear above max_rows
        self.bias = None if bias is None else bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _rows(x, self.in_features) <= self.max_rows:
            return torch.ops.tokenmill.gemv_f32(x, self.packed, self.out_features, self.in_features, self.bias)
        return self._large(x)

    def _large(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    @property
    def weight_bytes(self) -> int:
        """Bytes one call reads at decode sizes (the kernel's layout, padded to whole blocks)."""
        return self.packed.numel() * 4

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, max_rows={self.max_rows}"


class Int8Linear(nn.Module):
    """y = x (q * scales)^T + b with int8 q. kernel=True: the packed C++ layout, the kernel up to
    max_rows rows; otherwise (or above max_rows) W is dequantized for the call. x: [..., in_features]
    in bf16 or float32; y in x's dtype."""

    def __init__(self, weight: Int8Weight, bias: torch.Tensor | None, max_rows: int, kernel: bool,
                 interleave: bool = False) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.q.shape
        self.kernel = kernel
        self.max_rows = max_rows if kernel else 0
        self.interleave = interleave and kernel  # packed gate/up block pairs (kernel layout only)
        self.group_size = weight.group_size
        self.bias = None if bias is None else bias.detach()
        if kernel:  # packed: [Nb, K2 / 2, 16, 2] int8 and [Nb, G, 16] float32 scales
            self.q, self.scales = torch.ops.tokenmill.gemv_pack_int8(weight.q, weight.scales, self.interleave)
        else:  # as given: [N, K] int8, [N, G] float32
            self.q, self.scales = weight.q, weight.scales

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.interleave and _rows(x, self.in_features) <= self.max_rows:
            return torch.ops.tokenmill.gemv(x, self.q, self.scales, self.out_features, self.in_features, self.bias)
        return self._dequantized_linear(x)

    def silu_mul(self, x: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of a fused gate/up weight: [..., out_features / 2]."""
        if self.interleave and _rows(x, self.in_features) <= self.max_rows:
            return torch.ops.tokenmill.gemv_silu_mul(x, self.q, self.scales, self.out_features, self.in_features, self.bias)
        return silu_mul(self._dequantized_linear(x))

    def _dequantized_linear(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return F.linear(x, self.dequantize(x.dtype), bias)

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight as [out_features, in_features] in `dtype` (in the checkpoint's row order)."""
        if self.kernel:
            return torch.ops.tokenmill.gemv_unpack(self.q, self.scales, self.out_features, self.in_features,
                                                   self.interleave, dtype)
        return Int8Weight(self.q, self.scales).dequantize(dtype)

    def rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows `ids` of the dequantized weight: [len(ids), in_features] (a tied embedding's lookup)."""
        if not self.kernel:
            q, scales = self.q[ids], self.scales[ids]  # [T, K], [T, G]
        else:  # row r is lane r % 16 of block r // 16 (never interleaved: only the logits head is looked up)
            blk, lane = ids // 16, ids % 16
            q = self.q[blk, :, lane, :].reshape(ids.numel(), -1)[:, : self.in_features]  # [T, K]
            scales = self.scales[blk, :, lane]  # [T, G]
        return (q.float() * scales.repeat_interleave(self.group_size, dim=1)).to(dtype)

    @property
    def weight_bytes(self) -> int:
        """Bytes stored and read per product: int8 values and float32 scales (packed: with padding)."""
        return self.q.numel() + self.scales.numel() * 4

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, kernel={self.kernel}, "
                f"max_rows={self.max_rows}, group_size={self.group_size}, interleave={self.interleave}")


class Int8Embedding(nn.Module):
    """Token embeddings looked up in INT8 rows: its own (untied) or the logits head's (tied)."""

    def __init__(self, source: Int8Linear, dtype: torch.dtype) -> None:
        super().__init__()
        self.source = source  # its rows() are the embeddings
        self.dtype = dtype
        self.embedding_dim = source.in_features

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.source.rows(ids.reshape(-1), self.dtype).view(*ids.shape, self.embedding_dim)


def measure_max_rows(kernel: Callable[[torch.Tensor], torch.Tensor], other: Callable[[torch.Tensor], torch.Tensor],
                     in_features: int, dtype: torch.dtype, limit: int, reps: int = 7, margin: float = 0.97) -> int:
    """The largest row bucket (ROW_BUCKETS, at most `limit`) up to which `kernel` beats `other`
    at every bucket by `margin`; 0 when it loses at one row. Each is timed `reps` times, the two in
    turn, and compared by their fastest call: another process on the machine can only add time, so
    the minimum is the estimate that load moves least (medians flipped plans on a busy 2-core VM)."""
    best = 0
    for rows in ROW_BUCKETS:
        if rows > limit:
            break
        x = torch.randn(rows, in_features).to(dtype)
        t_kernel, t_other = _alternating_minima((kernel, other), x, reps)
        if t_kernel > margin * t_other:
            break
        best = rows
    return best


def _alternating_minima(fns, x: torch.Tensor, reps: int) -> list[float]:
    runs: list[list[float]] = [[] for _ in fns]
    for fn in fns:  # warm-up
        fn(x)
    for _ in range(reps):
        for fn, r in zip(fns, runs, strict=True):
            t = time.perf_counter()
            fn(x)
            r.append(time.perf_counter() - t)
    return [min(r) for r in runs]
