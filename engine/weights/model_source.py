"""What the engine reads from a model path: `ModelSource` and its `WeightSource`. Which kind a path
is, and how each kind is opened, is engine/weights/model_open.py's job (the one place that decides); the
engine and the loader take a ModelSource and never look at files themselves.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch


class WeightSource(Protocol):
    """A model's tensors under Hugging Face names and in HF layout ([out, in] matrices, unpermuted),
    produced one at a time so the checkpoint is never held whole in memory. Iterable more than once."""

    def __len__(self) -> int:
        """How many tensors iteration yields (the progress bar's total)."""
        ...

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, tensor) pairs; a tensor may view the file and may be any float dtype: the loader
        casts it into its parameter. Valid until the next item is taken."""
        ...


@dataclass(frozen=True)
class ModelSource:
    """Everything the engine reads from a model path."""

    name: str  # default served name: the folder's name, or the .gguf file's stem
    path: Path  # the Hugging Face folder or the .gguf file
    format: str  # "safetensors" or "gguf"
    hf_config: Any  # transformers PretrainedConfig (config.json, or built from GGUF metadata)
    tokenizer: Any  # transformers fast tokenizer, with the chat template when the model has one
    eos_token_ids: frozenset[int]  # token ids that end a generation
    weights: WeightSource  # the tensors, not yet in the serving dtype
