"""The engine's boundary, torch-free: what a caller (the HTTP server, a benchmark, a test's fake) sends
in (`SamplingParams`, `Deadlines`), what comes back (`RequestOutput`, `EngineStats`, `LoraInfo`), the
errors it may catch (`InvalidParam`, `LoraError`), and `EngineProtocol`, the methods the server may
call. `import engine.api` loads no torch. Grammar types are engine/structured's (GrammarSpec, its
errors), imported from there.
"""

from __future__ import annotations

from engine.api.errors import InvalidParam, LoraError
from engine.api.outputs import (
    Deadline,
    Deadlines,
    EngineStats,
    FinishReason,
    LoraInfo,
    PreemptionCause,
    RequestOutput,
    TokenLogprob,
)
from engine.api.protocol import EngineProtocol
from engine.api.sampling_params import SamplingParams

__all__ = [
    "Deadline",
    "Deadlines",
    "EngineProtocol",
    "EngineStats",
    "FinishReason",
    "InvalidParam",
    "LoraError",
    "LoraInfo",
    "PreemptionCause",
    "RequestOutput",
    "SamplingParams",
    "TokenLogprob",
]
