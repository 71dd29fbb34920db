"""INT8 weight-only quantization: symmetric int8 weights with float32 scales per output row (and,
optionally, per group of input columns), activations left in bf16/float32.

`quantize_int8` turns a float weight into an `Int8Weight`; `int8_from_blocks` is the entry for
weights that arrive quantized (a GGUF Q8_0 tensor is int8 values with one scale per 32 columns of a
row): they go into the same kernels without a round trip through float. The kernels and modules
that multiply with them are in engine/models/cpu_linear.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

INT8_MAX = 127  # symmetric: -127..127, so -q is always representable


@dataclass(frozen=True)
class Int8Weight:
    """W ~= q * scales, the scales broadcast over groups of K / G columns of each row."""

    q: torch.Tensor  # int8 [N, K] (quantize_int8 keeps |q| <= 127)
    scales: torch.Tensor  # float32 [N, G]; G = 1: per output channel, else per group of K / G columns

    def __post_init__(self) -> None:
        if self.q.dtype != torch.int8 or self.q.dim() != 2:
            raise ValueError(f"q must be an int8 [N, K] tensor, got {self.q.dtype} {tuple(self.q.shape)}")
        n, k = self.q.shape
        if self.scales.dtype != torch.float32 or self.scales.dim() != 2 or self.scales.shape[0] != n:
            raise ValueError(f"scales must be float32 [{n}, G], got {self.scales.dtype} {tuple(self.scales.shape)}")
        g = self.scales.shape[1]
        if g < 1 or k % g or (g > 1 and (k // g) % 2):
            raise ValueError(f"scales: {g} groups must split K = {k} into groups of an even size")

    @property
    def group_size(self) -> int:
        """Input columns per scale (K for per-channel scales)."""
        return self.q.shape[1] // self.scales.shape[1]

    @property
    def nbytes(self) -> int:
        return self.q.numel() + self.scales.numel() * self.scales.element_size()

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """[N, K] in `dtype` (computed in float32, rounded once)."""
        scales = self.scales.repeat_interleave(self.group_size, dim=1)
        return (self.q.float() * scales).to(dtype)


def quantize_int8(weight: torch.Tensor, group_size: int | None = None) -> Int8Weight:
    """Symmetric per-output-channel INT8 (group_size None), or per group of `group_size` columns.
    Each scale is the group's largest |w| / 127, so the largest element is exact up to float32."""
    if weight.dim() != 2 or not weight.is_floating_point():
        raise ValueError(f"weight must be a floating-point [N, K] tensor, got {weight.dtype} {tuple(weight.shape)}")
    n, k = weight.shape
    group = k if group_size is None else group_size
    if group <= 0 or k % group or (group != k and group % 2):
        raise ValueError(f"group_size must be an even divisor of K = {k}, got {group_size}")
    w = weight.detach().float().reshape(n, k // group, group)  # [N, G, group]
    scales = w.abs().amax(dim=2) / INT8_MAX  # [N, G]
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))  # an all-zero group: q = 0, any scale
    q = torch.round(w / scales.unsqueeze(2)).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return Int8Weight(q.reshape(n, k).contiguous(), scales.contiguous())


def group_for(k: int, group_size: int | None) -> int | None:
    """The group size quantize_int8 uses for K columns: group_size when it divides K, else None
    (one scale per output row)."""
    return group_size if group_size is not None and k % group_size == 0 and group_size < k else None


def int8_from_blocks(q: torch.Tensor, block_scales: torch.Tensor) -> Int8Weight:
    """Weights that come quantized: int8 values [N, K] and one scale per block of K / B columns of
    each row, [N, B] in any float dtype (Q8_0: B = K / 32, float16 scales). The kernels take the
    whole int8 range, -128 included."""
    if q.dtype != torch.int8:
        raise ValueError(f"q must be int8, got {q.dtype}")
    if not block_scales.is_floating_point():
        raise ValueError(f"block_scales must be floating point, got {block_scales.dtype}")
    return Int8Weight(q.contiguous(), block_scales.float().contiguous())
