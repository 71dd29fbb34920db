"""GGUF tensor data -> torch tensors in Hugging Face layout ([out_features, in_features] for matrices).

F32, F16 and BF16 are viewed in place (no copy until the loader casts them into the parameter);
quantized types are dequantized to float32 with `gguf.quants.dequantize` (numpy), one tensor at a time,
so the whole float32 model never exists beside the serving-dtype one.

INT8 seam: `q8_0_blocks` gives a Q8_0 tensor's int8 values and per-32 scales exactly as stored
(scale * int8 == the dequantized value, bit for bit). The engine's default on the CPU keeps Q4_0, Q4_1
and Q8_0 matrices as blocks instead (engine/weights/gguf/blocks.py); this module dequantizes the rest.
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType as Q
from gguf import ReaderTensor
from gguf.quants import dequantize

FLOAT_TYPES = frozenset({Q.F32, Q.F16, Q.BF16})
# MXFP4 (GPT-OSS's experts): dequantized at load like the rest (4.25 bits a value in the file, the serving
# dtype's 16 or 32 bits in memory; no kernel multiplies the packed blocks yet)
QUANTIZED_TYPES = frozenset({Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K,
                             Q.MXFP4})
# Ordered for error messages.
SUPPORTED_TYPES = tuple(sorted(FLOAT_TYPES | QUANTIZED_TYPES, key=lambda q: q.value))
Q8_0_BLOCK = 32  # values per Q8_0 block: one float16 scale, then 32 int8
# Rows dequantized per call: numpy's temporaries (several float32 copies of the input) stay at a few
# MiB instead of several times the largest tensor (SmolLM2's embedding is 113 MiB in float32).
_CHUNK_VALUES = 1 << 20


def to_torch(t: ReaderTensor) -> torch.Tensor:
    """The tensor's values in HF shape: a view of the file for float types, float32 for quantized."""
    if t.tensor_type in (Q.F32, Q.F16):
        return torch.from_numpy(t.data)  # the reader already typed it: [rows, cols] float32/float16
    if t.tensor_type == Q.BF16:
        # the reader leaves bf16 as bytes [rows, 2 * cols]; reinterpreting them needs no copy
        return torch.from_numpy(t.data).view(torch.bfloat16)
    if t.tensor_type in QUANTIZED_TYPES:
        return torch.from_numpy(_dequantize_rows(t))  # [rows, cols] float32
    raise ValueError(f"tensor {t.name!r}: type {t.tensor_type.name} cannot be dequantized")


def _dequantize_rows(t: ReaderTensor) -> np.ndarray:
    data = t.data.reshape(-1, t.data.shape[-1])  # [rows, row bytes]: a stack of experts' rows too
    rows = data.shape[0]
    first = dequantize(data[:1], t.tensor_type)  # [1, cols]
    out = np.empty((rows, first.shape[1]), dtype=np.float32)
    step = max(1, _CHUNK_VALUES // first.shape[1])
    for r in range(0, rows, step):
        out[r : r + step] = dequantize(data[r : r + step], t.tensor_type)
    return out.reshape(tuple(reversed([int(d) for d in t.shape])))


def q8_0_blocks(t: ReaderTensor) -> tuple[np.ndarray, np.ndarray]:
    """A Q8_0 tensor as stored: int8 values [rows, cols] and float16 scales [rows, cols / 32];
    value[r, c] = scale[r, c // 32] * q[r, c]."""
    if t.tensor_type != Q.Q8_0:
        raise ValueError(f"tensor {t.name!r} is {t.tensor_type.name}, not Q8_0")
    rows = t.data.shape[0] if t.data.ndim > 1 else 1
    blocks = np.asarray(t.data).reshape(rows, -1, 2 + Q8_0_BLOCK)  # [rows, blocks, fp16 scale + 32 int8]
    scales = blocks[..., :2].copy().view(np.float16)[..., 0]
    values = blocks[..., 2:].view(np.int8).reshape(rows, -1)
    return values, scales
