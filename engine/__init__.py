"""tokenmill's inference engine: continuous batching over a paged KV cache (no HTTP, no threads).

Importing `engine` (or `engine.api`) loads no torch: `Engine` is resolved on first use, so the server
can use the boundary types without pulling in the model code.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from engine.api import EngineStats, FinishReason, InvalidParam, RequestOutput, SamplingParams, TokenLogprob
from engine.config import EngineConfig

if TYPE_CHECKING:
    from engine.engine import Engine, GenerationResult

__all__ = [
    "Engine",
    "EngineConfig",
    "EngineStats",
    "FinishReason",
    "GenerationResult",
    "InvalidParam",
    "RequestOutput",
    "SamplingParams",
    "TokenLogprob",
]

_LAZY = {"Engine": "engine.engine", "GenerationResult": "engine.engine"}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
