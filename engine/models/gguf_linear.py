"""GGUF quantized weights kept as the file stores them (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K):
the weight type, the linear that multiplies from the blocks, and the embedding that looks rows up in them.

`GGMLWeight` holds a matrix's blocks unchanged (no repacking: each row is K / block values blocks in the
file's byte layout, engine/kernels/csrc/kernels/ggml.h), so its memory is the file's tensor bytes; a
fused weight whose shards the file stores in different types (q/k/v of a Q4_K_M file: Q5_0, Q5_0, Q8_0)
is a `GGMLStack` of them. `GGMLLinear` runs the C++ GEMV from the blocks (each block read once per tile
of rows and decoded in registers) up to `max_rows` rows, measured per shape at start-up against the
other path (cpu_linear.measure_max_rows): the weight dequantized for the call (ggml_dequantize, ~0.3 ns
a value on AVX2) and multiplied by PyTorch, in float32 where the CPU has no bf16 instructions (PyTorch's
bf16 products there run ~4x slower than its float32 ones: measured on Zen 3) and the result rounded to
x's dtype. Without the kernels every call takes the latter.
The kernel's activations, per linear (engine/weights/cpu_weights.py picks them from
EngineConfig.gguf_activations): "int8" (ggml_gemv_q8: x quantized per 32 values, integer dot products,
llama.cpp's vec_dot; within kernels/ggml.h's bound of the float product) or "float" (ggml_gemv: float32,
bit-exact to the dequantized weight's product in its summation order).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engine.kernels import cpu_kernels
from engine.kernels.cpu_kernels import cpu_has_bf16
from engine.models.layers import silu_mul

# ggml type id -> (name, values per block, bytes per block): the types the kernels take.
KERNEL_TYPES = {2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20), 6: ("Q5_0", 32, 22), 7: ("Q5_1", 32, 24),
                8: ("Q8_0", 32, 34), 12: ("Q4_K", 256, 144), 13: ("Q5_K", 256, 176), 14: ("Q6_K", 256, 210)}
ACTIVATIONS = ("int8", "float")


@dataclass(frozen=True)
class GGMLWeight:
    """W [n, k] as ggml blocks: `blocks` uint8 [n, k / block values * block bytes], row r the file's row r."""

    blocks: torch.Tensor
    type: int  # ggml type id (KERNEL_TYPES)
    n: int
    k: int

    def __post_init__(self) -> None:
        if self.type not in KERNEL_TYPES:
            raise ValueError(f"ggml type {self.type} has no kernel (types: {sorted(KERNEL_TYPES)})")
        _, values, size = KERNEL_TYPES[self.type]
        want = (self.n, self.k // values * size)
        if self.k % values or self.blocks.dtype != torch.uint8 or tuple(self.blocks.shape) != want:
            raise ValueError(f"{self.type_name} blocks must be uint8 {want}, got {self.blocks.dtype} "
                             f"{tuple(self.blocks.shape)}")

    @property
    def type_name(self) -> str:
        return KERNEL_TYPES[self.type][0]

    @property
    def nbytes(self) -> int:
        return self.blocks.numel()

    @property
    def parts(self) -> tuple[GGMLWeight, ...]:
        return (self,)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """[n, k] in float32 (gguf.quants.dequantize's values) or bfloat16 (those rounded once)."""
        return dequantize_blocks(self.blocks, self.type, self.k, dtype)


@dataclass(frozen=True)
class GGMLStack:
    """W [n, k] as row ranges of different types, stacked in order (a fused weight's shards)."""

    parts: tuple[GGMLWeight, ...]

    def __post_init__(self) -> None:
        if len(self.parts) < 2 or len({p.k for p in self.parts}) != 1:
            raise ValueError("a stack needs two or more parts with one K")

    @property
    def n(self) -> int:
        return sum(p.n for p in self.parts)

    @property
    def k(self) -> int:
        return self.parts[0].k

    @property
    def type_name(self) -> str:
        return "+".join(p.type_name for p in self.parts)

    @property
    def types(self) -> list[str]:
        return [p.type_name for p in self.parts]

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.cat([p.dequantize(dtype) for p in self.parts])


def dequantize_blocks(blocks: torch.Tensor, type_: int, k: int, dtype: torch.dtype) -> torch.Tensor:
    """Rows of ggml blocks [r, k / 32 * block bytes] -> [r, k] in dtype: the C++ decoder, else gguf's numpy one."""
    if cpu_kernels.load("ggml") is None:
        return torch.ops.tokenmill.ggml_dequantize(blocks.contiguous(), type_, blocks.shape[0], k, dtype)
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    values = dequantize(blocks.numpy(), GGMLQuantizationType(type_))  # [r, k] float32
    return torch.from_numpy(values).to(dtype)


def concat_rows(parts: list[GGMLWeight]) -> GGMLWeight | GGMLStack:
    """Shards of one fused weight (q/k/v, gate/up) stacked by rows (blocks never span two rows): one
    GGMLWeight where they share a type, else a GGMLStack of runs of one type."""
    if len({p.k for p in parts}) != 1:
        raise ValueError("fused shards must share K")
    runs: list[list[GGMLWeight]] = []
    for p in parts:
        if runs and runs[-1][0].type == p.type:
            runs[-1].append(p)
        else:
            runs.append([p])
    merged = [GGMLWeight(torch.cat([p.blocks for p in run]), run[0].type, sum(p.n for p in run), run[0].k)
              if len(run) > 1 else run[0] for run in runs]
    return merged[0] if len(merged) == 1 else GGMLStack(tuple(merged))


class GGMLLinear(nn.Module):
    """y = x W^T + b from a GGMLWeight (or GGMLStack): the block kernel up to max_rows rows (kernel=True),
    with int8 or float activations (`activations`), else W dequantized to x's dtype for the call.
    x: [..., in_features] bf16 or float32; y in x's dtype. gate_up: a gated MLP's fused [gate; up]
    weight, offering silu_mul (the MLP's activation applied to the product)."""

    def __init__(self, weight: GGMLWeight | GGMLStack, bias: torch.Tensor | None, max_rows: int, kernel: bool,
                 gate_up: bool = False, activations: str = "int8") -> None:
        super().__init__()
        if activations not in ACTIVATIONS:
            raise ValueError(f"activations must be one of {ACTIVATIONS}, got {activations!r}")
        self.weight_q = weight
        self.out_features, self.in_features = weight.n, weight.k
        self.kernel = kernel
        self.max_rows = max_rows if kernel else 0
        self.interleave = gate_up  # (the plan key's field: a silu_mul product is timed as one)
        self.bias = None if bias is None else bias.detach()
        self.activations = activations
        self._op = torch.ops.tokenmill.ggml_gemv_q8 if activations == "int8" else torch.ops.tokenmill.ggml_gemv
        # each part's row range of the bias (a stack's parts are multiplied one by one, outputs concatenated)
        bounds = [0]
        for p in weight.parts:
            bounds.append(bounds[-1] + p.n)
        self._part_bias = [None if self.bias is None else self.bias[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() // self.in_features <= self.max_rows:
            parts = self.weight_q.parts
            if len(parts) == 1:
                return self._op(x, parts[0].blocks, parts[0].type, parts[0].n, self.in_features, self.bias)
            return torch.cat([self._op(x, p.blocks, p.type, p.n, self.in_features, b)
                              for p, b in zip(parts, self._part_bias, strict=True)], dim=-1)
        return self._dequantized_linear(x)

    def silu_mul(self, x: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of the fused gate/up product: [..., out_features / 2] (layers.silu_mul: the
        arithmetic the C++ decode loop applies after its GGML product, so both give the same bits)."""
        return silu_mul(self(x))

    def _dequantized_linear(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype if x.dtype != torch.bfloat16 or cpu_has_bf16() else torch.float32
        bias = None if self.bias is None else self.bias.to(dtype)
        return F.linear(x.to(dtype), self.weight_q.dequantize(dtype), bias).to(x.dtype)

    def rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows `ids` of the dequantized weight: [len(ids), in_features] (an embedding lookup)."""
        if not isinstance(self.weight_q, GGMLWeight):
            raise ValueError("an embedding's blocks are one type")
        return dequantize_blocks(self.weight_q.blocks[ids], self.weight_q.type, self.in_features, dtype)

    @property
    def weight_bytes(self) -> int:
        """Bytes stored and read per product: the blocks."""
        return self.weight_q.nbytes

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, type={self.weight_q.type_name}, "
                f"kernel={self.kernel}, max_rows={self.max_rows}, activations={self.activations}")


class GGMLEmbedding(nn.Module):
    """Token embeddings looked up in ggml blocks (only the rows a step reads are dequantized): its own
    (untied) or the logits head's (tied)."""

    def __init__(self, source: nn.Module, dtype: torch.dtype) -> None:  # GGMLLinear or TritonGGMLLinear: rows()
        super().__init__()
        self.source = source
        self.dtype = dtype
        self.embedding_dim = source.in_features

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.source.rows(ids.reshape(-1), self.dtype).view(*ids.shape, self.embedding_dim)
