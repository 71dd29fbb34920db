"""Random LoRA adapters in PEFT's format, which tokenmill and vLLM both read: what `bench lora` and
bench/peers/lora_peers.sh serve (the cost of an adapter does not depend on its values)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from engine.lora.shapes import TARGETS, BaseShapes


def write_adapter(folder: Path, shapes: BaseShapes, rank: int, seed: int) -> Path:
    """A PEFT-format LoRA folder with random A and B on every projection of every layer."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(shapes.num_layers):
        for module, (in_f, out_f) in shapes.projections.items():  # the base model's own targets
            part = "mlp" if TARGETS[module][0] in ("gate_up", "down") else "self_attn"
            key = f"base_model.model.model.layers.{layer}.{part}.{module}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, in_f, generator=g) / in_f**0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(out_f, rank, generator=g) * 0.01
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(shapes.projections), "bias": "none",
    }))  # fmt: skip
    return folder
