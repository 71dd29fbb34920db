"""A Hugging Face model folder as a ModelSource: config.json, the tokenizer files, and safetensors
weights (single or sharded) opened lazily, memory-mapped, one tensor at a time."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from engine.weights.model_source import ModelSource


class SafetensorsWeights:
    """The tensors of a folder's safetensors files, in file order (a WeightSource)."""

    def __init__(self, files: list[Path]) -> None:
        self.files = files  # the checkpoint files, from the shard index when there is one

    def __len__(self) -> int:
        total = 0
        for f in self.files:
            with safe_open(str(f), framework="pt") as st:
                total += len(st.keys())
        return total

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for f in self.files:
            with safe_open(str(f), framework="pt") as st:
                for name in st.keys():
                    yield name, st.get_tensor(name)


def open_hf_folder(path: Path) -> ModelSource:
    from transformers import AutoConfig, AutoTokenizer

    hf_config = AutoConfig.from_pretrained(str(path))
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    return ModelSource(
        name=path.name,
        path=path,
        format="safetensors",
        hf_config=hf_config,
        tokenizer=tokenizer,
        eos_token_ids=eos_token_ids(path, hf_config, tokenizer),
        weights=SafetensorsWeights(checkpoint_files(path)),
    )


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
        raise FileNotFoundError(f"no .safetensors weights in {path} (only safetensors and GGUF checkpoints "
                                "are supported)")  # fmt: skip
    return files


def eos_token_ids(path: Path, hf_config, tokenizer) -> frozenset[int]:
    ids: set[int] = set()
    for source in (hf_config, _generation_config(path)):
        value = getattr(source, "eos_token_id", None) if source is not None else None
        if isinstance(value, int):
            ids.add(value)
        elif value:
            ids.update(int(v) for v in value)
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return frozenset(ids)


def _generation_config(path: Path):
    if not (path / "generation_config.json").exists():
        return None
    from transformers import GenerationConfig

    return GenerationConfig.from_pretrained(str(path))
