"""GGUF quantized weights kept as the file stores them (Q4_0, Q4_1, Q8_0): the weight type, the linear
that multiplies from the blocks, and the embedding that looks rows up in them.

`GGMLWeight` holds a matrix's blocks unchanged (no repacking: each row is K / 32 blocks in the file's
byte layout, engine/kernels/csrc/kernels/ggml.h), so its memory is the file's tensor bytes. `GGMLLinear`
runs the C++ decode GEMV (torch.ops.tokenmill.ggml_gemv: each block read once per tile of rows and
decoded in registers, activations in float32) up to `max_rows` rows, measured per shape at start-up
against the other path (cpu_linear.measure_max_rows): the weight dequantized to x's dtype for the call
(ggml_dequantize) and multiplied by PyTorch. Without the kernels every call takes the latter.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engine.kernels import cpu_kernels
from engine.models.cpu_linear import silu_mul

# ggml type id -> (name, bytes per block of 32 values): the types the kernels take.
KERNEL_TYPES = {2: ("Q4_0", 18), 3: ("Q4_1", 20), 8: ("Q8_0", 34)}
BLOCK = 32


@dataclass(frozen=True)
class GGMLWeight:
    """W [n, k] as ggml blocks: `blocks` uint8 [n, k / 32 * block bytes], row r the file's row r."""

    blocks: torch.Tensor
    type: int  # ggml type id (KERNEL_TYPES)
    n: int
    k: int

    def __post_init__(self) -> None:
        if self.type not in KERNEL_TYPES:
            raise ValueError(f"ggml type {self.type} has no kernel (types: {sorted(KERNEL_TYPES)})")
        want = (self.n, self.k // BLOCK * KERNEL_TYPES[self.type][1])
        if self.k % BLOCK or self.blocks.dtype != torch.uint8 or tuple(self.blocks.shape) != want:
            raise ValueError(f"{self.type_name} blocks must be uint8 {want}, got {self.blocks.dtype} "
                             f"{tuple(self.blocks.shape)}")

    @property
    def type_name(self) -> str:
        return KERNEL_TYPES[self.type][0]

    @property
    def nbytes(self) -> int:
        return self.blocks.numel()

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """[n, k] in float32 (gguf.quants.dequantize's values) or bfloat16 (those rounded once)."""
        return dequantize_blocks(self.blocks, self.type, self.k, dtype)


def dequantize_blocks(blocks: torch.Tensor, type_: int, k: int, dtype: torch.dtype) -> torch.Tensor:
    """Rows of ggml blocks [r, k / 32 * block bytes] -> [r, k] in dtype: the C++ decoder, else gguf's numpy one."""
    if cpu_kernels.load("ggml") is None:
        return torch.ops.tokenmill.ggml_dequantize(blocks.contiguous(), type_, blocks.shape[0], k, dtype)
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    values = dequantize(blocks.numpy(), GGMLQuantizationType(type_))  # [r, k] float32
    return torch.from_numpy(values).to(dtype)


def concat_rows(parts: list[GGMLWeight]) -> GGMLWeight:
    """Shards of one fused weight (q/k/v, gate/up) stacked by rows: blocks never span two rows."""
    if len({(p.type, p.k) for p in parts}) != 1:
        raise ValueError("fused shards must share one type and K")
    return GGMLWeight(torch.cat([p.blocks for p in parts]), parts[0].type, sum(p.n for p in parts), parts[0].k)


class GGMLLinear(nn.Module):
    """y = x W^T + b from a GGMLWeight: the block kernel up to max_rows rows (kernel=True), else W
    dequantized to x's dtype for the call. x: [..., in_features] bf16 or float32; y in x's dtype.
    gate_up: a gated MLP's fused [gate; up] weight, offering silu_mul (the MLP's activation applied
    to the product)."""

    def __init__(self, weight: GGMLWeight, bias: torch.Tensor | None, max_rows: int, kernel: bool,
                 gate_up: bool = False) -> None:
        super().__init__()
        self.weight_q = weight
        self.out_features, self.in_features = weight.n, weight.k
        self.kernel = kernel
        self.max_rows = max_rows if kernel else 0
        self.interleave = gate_up  # (the plan key's field: a silu_mul product is timed as one)
        self.bias = None if bias is None else bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() // self.in_features <= self.max_rows:
            return torch.ops.tokenmill.ggml_gemv(x, self.weight_q.blocks, self.weight_q.type, self.out_features,
                                                 self.in_features, self.bias)
        return self._dequantized_linear(x)

    def silu_mul(self, x: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of the fused gate/up product: [..., out_features / 2]."""
        return silu_mul(self(x))

    def _dequantized_linear(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return F.linear(x, self.weight_q.dequantize(x.dtype), bias)

    def rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows `ids` of the dequantized weight: [len(ids), in_features] (an embedding lookup)."""
        return dequantize_blocks(self.weight_q.blocks[ids], self.weight_q.type, self.in_features, dtype)

    @property
    def weight_bytes(self) -> int:
        """Bytes stored and read per product: the blocks."""
        return self.weight_q.nbytes

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, type={self.weight_q.type_name}, "
                f"kernel={self.kernel}, max_rows={self.max_rows}")


class GGMLEmbedding(nn.Module):
    """Token embeddings looked up in ggml blocks (only the rows a step reads are dequantized): its own
    (untied) or the logits head's (tied)."""

    def __init__(self, source: GGMLLinear, dtype: torch.dtype) -> None:
        super().__init__()
        self.source = source
        self.dtype = dtype
        self.embedding_dim = source.in_features

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.source.rows(ids.reshape(-1), self.dtype).view(*ids.shape, self.embedding_dim)
