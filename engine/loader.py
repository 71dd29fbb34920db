"""Load a Hugging Face model folder (config.json + safetensors) into our model classes.

Safetensors files are opened lazily (memory-mapped); each tensor is read, cast and copied into
its parameter one at a time, so the checkpoint is never held whole in RAM.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm.auto import tqdm

from engine.models import model_class
from engine.models.llama import LlamaForCausalLM


def checkpoint_files(path: Path) -> list[Path]:
    """The safetensors files of a folder, from the sharded index when present."""
    index = path / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [path / f for f in sorted(set(weight_map.values()))]
    single = path / "model.safetensors"
    if single.exists():
        return [single]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors weights in {path} (only safetensors checkpoints are supported)")
    return files


def load_model(
    path: str | os.PathLike, hf_config, dtype: torch.dtype, device: torch.device, max_positions: int,
    show_progress: bool = True,
) -> LlamaForCausalLM:
    path = Path(path)
    cls = model_class(getattr(hf_config, "architectures", None))
    with torch.device("meta"):
        model = cls(hf_config, max_positions)
    model = model.to(dtype=dtype).to_empty(device=device)
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    files = checkpoint_files(path)
    with tqdm(desc=f"loading {path.name}", unit="tensor", disable=not show_progress) as bar:
        for f in files:
            with safe_open(str(f), framework="pt") as st:
                for name in st.keys():
                    target = _load_one(model, params, name, st.get_tensor(name))
                    if target:
                        loaded.add(target)
                    bar.update(1)
    _check_complete(model, params, loaded)
    model.after_load(dtype, device)
    return model.eval()


def _load_one(model: LlamaForCausalLM, params: dict, name: str, tensor: torch.Tensor) -> str | None:
    """Copy one checkpoint tensor into its (possibly fused) parameter. Returns a loaded-key tag."""
    if "rotary_emb" in name:
        return None
    if name == "lm_head.weight" and model.tie_word_embeddings:
        return None  # some tied checkpoints carry a copy
    parts = name.split(".")
    for sub, (fused, shard) in model.packed.items():
        if sub in parts:
            fused_name = name.replace(sub, fused)
            param = params.get(fused_name)
            if param is None:
                raise ValueError(f"checkpoint tensor {name!r} has no place in the model")
            sizes = model.shard_sizes(fused)
            offset = sum(sizes[:shard])
            dst = param.data.narrow(0, offset, sizes[shard])
            _copy(dst, tensor, name)
            return f"{fused_name}#{shard}"
    param = params.get(name)
    if param is None:
        raise ValueError(f"checkpoint tensor {name!r} has no place in the model")
    _copy(param.data, tensor, name)
    return name


def _copy(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
    if dst.shape != src.shape:
        raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(src.shape)}, expected {tuple(dst.shape)}")
    dst.copy_(src)  # casts to the model dtype and moves to its device


def _check_complete(model: LlamaForCausalLM, params: dict, loaded: set[str]) -> None:
    expected: set[str] = set()
    for name in params:
        fused = next((f for f, _ in model.packed.values() if f"{f}." in name), None)
        if fused is None:
            expected.add(name)
        else:
            n = len(model.shard_sizes(fused))
            expected.update(f"{name}#{i}" for i in range(n))
    missing = sorted(expected - loaded)
    if missing:
        raise ValueError(f"checkpoint is missing {len(missing)} tensors, e.g. {missing[:5]}")
