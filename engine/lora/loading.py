"""The torch engine's registry: adapters read against this base model, placed on its device and dtype."""

from __future__ import annotations

import functools

import torch

from engine.config.lora import LoraConfig
from engine.lora.adapter import LoraAdapter, read_adapter
from engine.lora.registry import LoraRegistry
from engine.lora.shapes import BaseShapes


def make_registry(config: LoraConfig, hf_config, device: torch.device, dtype: torch.dtype) -> LoraRegistry:
    shapes = BaseShapes.from_hf_config(hf_config)

    def place(adapter: LoraAdapter):
        return adapter.to(device, dtype)

    read = functools.partial(_read, shapes=shapes, max_rank=config.max_lora_rank)
    return LoraRegistry(config, read, place)


def _read(name: str, path: str, *, shapes: BaseShapes, max_rank: int) -> LoraAdapter:
    return read_adapter(name, path, shapes, max_rank)
