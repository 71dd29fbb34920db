"""Which tensors of a GGUF file the engine keeps quantized (`quantization="gguf"`, opt-in: `blocks_for`):
the matrices of a
type the block kernels take (engine/models/gguf_linear.py: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K,
Q6_K), as the file stores them, Q/K rows unpermuted (a block never spans two rows). The loader skips
them (no float copy is made), and engine/weights/cpu_weights.py builds their linears and embedding
from the blocks.

A fused parameter (q/k/v -> qkv_proj, gate/up -> gate_up_proj) is kept when every shard is kept: its
blocks are the shards' stacked in shard order (a GGMLStack where their types differ, as a Q4_K_M file's
q/k/v: Q5_0, Q5_0, Q8_0). The others, and every quantized tensor of another type (Q2_K, Q3_K, IQ*, ...),
are dequantized into the serving dtype as before; the engine-ready line names them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from engine.models.gguf_linear import KERNEL_TYPES, GGMLStack, GGMLWeight, concat_rows
from engine.weights.gguf.dequant import QUANTIZED_TYPES
from engine.weights.gguf.tensors import ROUTERS, unpermute
from engine.weights.gguf.weights import GGUFWeights


@dataclass
class BlockPlan:
    """What stays quantized: weights by model parameter name, and what was dequantized instead."""

    weights: dict[str, GGMLWeight | GGMLStack] = field(default_factory=dict)  # parameter name -> its blocks
    held: set[str] = field(default_factory=set)  # checkpoint (HF) tensor names the loader skips
    dequantized: dict[str, str] = field(default_factory=dict)  # checkpoint name -> type, quantized but not kept

    @property
    def types(self) -> list[str]:
        return sorted({p.type_name for w in self.weights.values() for p in w.parts})

    def describe(self) -> str:
        """`gguf (Q4_1, Q8_0)`, and the dequantized tensors' types and count where there are some."""
        text = f"gguf ({', '.join(self.types)})"
        if self.dequantized:
            counts: dict[str, int] = {}
            for t in self.dequantized.values():
                counts[t] = counts.get(t, 0) + 1
            text += "; dequantized: " + ", ".join(f"{n} {t}" for t, n in sorted(counts.items()))
        return text


def plan_blocks(weights: GGUFWeights, packed: dict[str, tuple[str, int]], shards: dict[str, int],
                tied: bool) -> BlockPlan:
    """packed: the model class's checkpoint sub-name -> (fused parameter, shard) table; shards: the
    fused parameter's shard count; tied: the model ties its head to the embedding (a file's
    output.weight is then not loaded)."""
    plan = BlockPlan()
    candidates: dict[str, dict[int, tuple[str, GGMLWeight]]] = {}  # parameter -> shard -> (HF name, blocks)
    for t in weights.tensors:
        hf = weights.names[t.name]
        if t.tensor_type not in QUANTIZED_TYPES or (tied and hf == "lm_head.weight"):
            continue
        # not kept: other types, stacked experts (3-D, engine/models/moe.py multiplies them in dtype), and
        # routers (not linears: their logits are float32)
        if int(t.tensor_type) not in KERNEL_TYPES or len(t.shape) != 2 or hf.endswith(ROUTERS):
            plan.dequantized[hf] = t.tensor_type.name
            continue
        param, shard = _target(hf, packed)
        candidates.setdefault(param, {})[shard] = (hf, _blocks(weights, t.name))
    for param, parts in candidates.items():
        fused = param.split(".")[-2] in set(shards)
        whole = not fused or len(parts) == shards[param.split(".")[-2]]
        if not whole:
            plan.dequantized.update({hf: w.type_name for hf, w in parts.values()})
            continue
        ordered = [parts[i] for i in sorted(parts)]
        plan.weights[param] = concat_rows([w for _, w in ordered]) if fused else ordered[0][1]
        plan.held.update(hf for hf, _ in ordered)
    return plan


def _target(hf: str, packed: dict[str, tuple[str, int]]) -> tuple[str, int]:
    parts = hf.split(".")
    for sub, (fused, shard) in packed.items():
        if sub in parts:
            return hf.replace(sub, fused), shard
    return hf, 0


def _blocks(weights: GGUFWeights, name: str) -> GGMLWeight:
    t, heads = weights.stored(name)
    data = np.asarray(t.data).reshape(int(t.shape[1]), -1)  # [rows, row bytes]
    if heads:
        data = unpermute(data, heads)
    blocks = torch.from_numpy(np.ascontiguousarray(data).copy())  # off the file's pages
    weights.gf.release(t)
    return GGMLWeight(blocks, int(t.tensor_type), int(t.shape[1]), int(t.shape[0]))



def blocks_for(source, config, device: torch.device) -> BlockPlan | None:
    """The block plan of a model source under config.quantization (an EngineConfig): "gguf" asks for it
    (ValueError where it cannot apply; on CUDA the blocks take the Triton kernels,
    engine/models/triton_ggml.py); anything else, the default included, dequantizes (None). Opt-in: served
    side by side on an AVX2 CPU the blocks were slower than the dequantized bf16 model (docs/ENGINE.md,
    "GGUF quantized weights"). Sets the source's held names (the loader skips them)."""
    from engine.models import model_class

    if config.quantization != "gguf":
        return None
    if source.format != "gguf" or not isinstance(source.weights, GGUFWeights):
        raise ValueError(f"quantization 'gguf' needs a GGUF file; {source.path.name} is {source.format}")
    if device.type != "cpu" and (reason := _triton_reason(device)) is not None:
        raise ValueError(f"quantization 'gguf' on {device} needs the Triton kernels ({reason}); use 'none'")
    cls = model_class(getattr(source.hf_config, "architectures", None))
    shards: dict[str, int] = {}
    for fused, _ in cls.packed.values():
        shards[fused] = shards.get(fused, 0) + 1
    tied = bool(getattr(source.hf_config, "tie_word_embeddings", False))
    plan = plan_blocks(source.weights, cls.packed, shards, tied)
    if not plan.weights:
        raise ValueError("quantization 'gguf': the file holds no Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 / Q4_K / Q5_K / "
                         "Q6_K matrix (those types have kernels; the others are dequantized)")
    source.weights.held = set(plan.held)
    return plan


def _triton_reason(device: torch.device) -> str | None:
    """Why the Triton GGUF kernels cannot run on `device` (the attention backend's probe: triton
    importable, a compiler, a test kernel compiled), or None."""
    from engine.attention import triton_unavailable_reason

    return triton_unavailable_reason(device)
