"""A GGUF file's tensors as a WeightSource: Hugging Face names, HF layout (Q/K rows unpermuted),
values dequantized one tensor at a time."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import torch
from gguf import GGMLQuantizationType as Q
from gguf import ReaderTensor

from engine.weights.gguf.config import LONGROPE_TENSORS, Architecture
from engine.weights.gguf.dequant import to_torch
from engine.weights.gguf.errors import GGUFError
from engine.weights.gguf.reader import GGUFFile
from engine.weights.gguf.tensors import hf_name, permuted_heads, unpermute

log = logging.getLogger("tokenmill.engine")


class GGUFWeights:
    """Iterates (HF name, tensor); float tensors view the memory map, quantized ones are float32 copies."""

    def __init__(self, gf: GGUFFile, arch: Architecture, num_heads: int, num_kv_heads: int) -> None:
        self.gf = gf  # the opened file
        self.arch = arch  # says whether Q/K rows were permuted
        self.num_heads = num_heads  # query heads (q_proj's permutation groups)
        self.num_kv_heads = num_kv_heads  # key/value heads (k_proj's)
        # the model's tensors (LongRoPE's factors went into the config: engine/weights/gguf/config.py)
        self.tensors = [t for t in gf.tensors if t.name not in LONGROPE_TENSORS]
        self.names = {t.name: _mapped(gf, t.name) for t in self.tensors}  # checked at once: fail before loading
        self._by_name = {t.name: t for t in self.tensors}
        self.held: set[str] = set()  # HF names the engine keeps quantized (gguf/blocks.py): not yielded
        _note_mxfp4(self.tensors)

    def __len__(self) -> int:
        return len(self.tensors)

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for t in self.tensors:
            if self.names[t.name] in self.held:
                continue
            yield self.names[t.name], self.tensor(t.name)
            self.gf.release(t)  # the consumer is done with it (WeightSource: valid until the next item)

    def tensor(self, name: str) -> torch.Tensor:
        """One tensor by its llama.cpp name, in HF layout (Gemma's norms: the 1 llama.cpp added, taken
        off in float32, as transformers' GGUF loader does)."""
        t, heads = self.stored(name)
        value = to_torch(t)
        if self.arch.norm_offset and self.names[name].endswith("norm.weight"):
            return value.float() - self.arch.norm_offset
        if value.dim() == 1 and self.names[name].endswith("shared_expert_gate.weight"):
            return value.unsqueeze(0)  # llama.cpp's [H] vector; the model's [1, H] row
        if value.dim() == 2 and self.names[name].endswith(".conv.conv.weight"):
            return value.unsqueeze(1)  # LFM2's conv, squeezed by llama.cpp: [hidden, L] -> [hidden, 1, L]
        return unpermute(value, heads) if heads else value

    def stored(self, name: str) -> tuple[ReaderTensor, int | None]:
        """The tensor as the file stores it, and the heads its rows must be unpermuted with (None: they
        are not permuted). The INT8 seam: `dequant.q8_0_blocks(t)` then `unpermute(values, heads)` and
        `unpermute(scales, heads)` give a Q8_0 matrix's int8 rows and scales in HF layout, no float copy."""
        heads = permuted_heads(name, self.num_heads, self.num_kv_heads) if self.arch.permuted_qk else None
        return self._by_name[name], heads


def _mapped(gf: GGUFFile, name: str) -> str:
    hf = hf_name(name, gf.architecture)
    if hf is None:
        raise GGUFError(gf.path, f"tensor {name!r} has no place in a {gf.architecture} model")
    return hf


def _note_mxfp4(tensors: list[ReaderTensor]) -> None:
    """Log what dequantizing MXFP4 tensors (GPT-OSS's experts) at load costs: no kernel multiplies the
    packed blocks yet, so their values take the serving dtype's 2 (bf16) or 4 (float32) bytes, not 17
    bytes per 32 values."""
    mx = [t for t in tensors if t.tensor_type == Q.MXFP4]
    if mx:
        values = sum(int(t.n_elements) for t in mx)
        packed = sum(int(t.n_bytes) for t in mx)
        log.info("GGUF: %d MXFP4 tensors (%.1f MiB packed) are dequantized at load: %.1f MiB in bf16, %.1f MiB "
                 "in float32", len(mx), packed / 2**20, values * 2 / 2**20, values * 4 / 2**20)  # fmt: skip
