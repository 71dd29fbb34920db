"""GGUF quantized weights on CUDA: the linear and embedding that multiply from the blocks with the Triton
kernels (engine/models/triton_ggml.py), the GPU counterpart of gguf_linear.GGMLLinear.

`TritonGGMLLinear`: up to `max_rows` rows of x (decode, small batches) the dequantize-in-kernel GEMV
(each block read once per tile of x rows, float32 sums); above (prefill chunks) the weight dequantized
by the kernel to x's dtype for the call (float32: gguf.quants.dequantize's values; bf16: those rounded
once) and multiplied by PyTorch's matmul. `max_rows` is not measured: DEFAULT_MAX_ROWS (the GEMV decodes
the weight once per 4 rows of x, so past a few tiles the dequantized matmul's tensor cores win; not
tuned on a GPU yet).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.models.cpu_linear import silu_mul
from engine.models.gguf_linear import GGMLStack, GGMLWeight
from engine.models.triton_ggml import ggml_dequantize_triton, ggml_gemv_triton

DEFAULT_MAX_ROWS = 8


def to_device(weight: GGMLWeight | GGMLStack, device: torch.device) -> GGMLWeight | GGMLStack:
    """The same blocks on `device`."""
    moved = tuple(GGMLWeight(p.blocks.to(device), p.type, p.n, p.k) for p in weight.parts)
    return moved[0] if isinstance(weight, GGMLWeight) else GGMLStack(moved)


def dequantize_triton(weight: GGMLWeight | GGMLStack, dtype: torch.dtype) -> torch.Tensor:
    """W [n, k] in dtype (float32 / bf16 from the kernel, float16 through float32)."""
    kernel_dtype = dtype if dtype in (torch.float32, torch.bfloat16) else torch.float32
    parts = [ggml_dequantize_triton(p.blocks, p.type, p.n, p.k, kernel_dtype) for p in weight.parts]
    w = parts[0] if len(parts) == 1 else torch.cat(parts)
    return w.to(dtype)


class TritonGGMLLinear(nn.Module):
    """y = x W^T + b from a GGMLWeight (or GGMLStack) whose blocks are on x's device. x: [..., in_features]
    float32 / bf16 / float16; y in x's dtype. gate_up: a gated MLP's fused [gate; up] weight (silu_mul)."""

    def __init__(self, weight: GGMLWeight | GGMLStack, bias: torch.Tensor | None,
                 max_rows: int = DEFAULT_MAX_ROWS, gate_up: bool = False) -> None:  # fmt: skip
        super().__init__()
        self.weight_q = weight
        self.out_features, self.in_features = weight.n, weight.k
        self.max_rows = max_rows
        self.interleave = gate_up
        self.bias = None if bias is None else bias.detach()
        bounds = [0]
        for p in weight.parts:
            bounds.append(bounds[-1] + p.n)
        self._part_bias = [None if self.bias is None else self.bias[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() // self.in_features <= self.max_rows:
            outs = [ggml_gemv_triton(x, p.blocks, p.type, p.n, p.k, None if b is None else b.to(x.dtype))
                    for p, b in zip(self.weight_q.parts, self._part_bias, strict=True)]
            return outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return F.linear(x, dequantize_triton(self.weight_q, x.dtype), bias)

    def silu_mul(self, x: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of the fused gate/up product: [..., out_features / 2]."""
        return silu_mul(self(x))

    def rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows `ids` of the dequantized weight: [len(ids), in_features] (an embedding lookup)."""
        if not isinstance(self.weight_q, GGMLWeight):
            raise ValueError("an embedding's blocks are one type")
        w = self.weight_q
        picked = GGMLWeight(w.blocks[ids].contiguous(), w.type, ids.numel(), w.k)
        return dequantize_triton(picked, dtype)

    @property
    def weight_bytes(self) -> int:
        """Bytes stored and read per product: the blocks."""
        return self.weight_q.nbytes

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, type={self.weight_q.type_name}, "
                f"triton=True, max_rows={self.max_rows}")
