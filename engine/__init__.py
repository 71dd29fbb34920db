"""tokenmill's inference engine: continuous batching over a paged KV cache (no HTTP, no threads)."""

from engine.config import EngineConfig
from engine.engine import Engine, GenerationResult
from engine.outputs import EngineStats, FinishReason, RequestOutput, TokenLogprob
from engine.sampling_params import SamplingParams

__all__ = [
    "Engine",
    "EngineConfig",
    "EngineStats",
    "FinishReason",
    "GenerationResult",
    "RequestOutput",
    "SamplingParams",
    "TokenLogprob",
]
