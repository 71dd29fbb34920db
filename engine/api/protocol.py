"""`EngineProtocol`: the methods the server may call on an engine. The real `Engine` and the tests' fake
engine both satisfy it (checked by mypy in CI, engine/conformance.py). Torch-free."""

from __future__ import annotations

from typing import Any, Protocol

from engine.api.outputs import Deadlines, EngineStats, LoraInfo, RequestOutput
from engine.api.sampling_params import SamplingParams
from engine.structured.backend import GrammarCompiler


class EngineProtocol(Protocol):
    """What the server may call on an engine. Not thread-safe: one thread (the server's worker) owns
    the engine and makes every call but the read-only attributes, which are fixed after construction."""

    @property
    def model_name(self) -> str:
        """The model folder's (or file's) name."""
        ...

    @property
    def max_model_len(self) -> int:
        """Longest prompt + output, in tokens."""
        ...

    @property
    def dtype_name(self) -> str:
        """"bfloat16", "float32", ..."""
        ...

    @property
    def device_name(self) -> str:
        """"cpu", "cuda:0", ..."""
        ...

    @property
    def tokenizer(self) -> Any:
        """A transformers tokenizer; the server copies it before the worker starts."""
        ...

    @property
    def grammar_compiler(self) -> GrammarCompiler | None:
        """Compiles GrammarSpecs for this model's tokenizer; thread-safe, for the server to call off the
        engine thread (a request's spec then carries its compiled grammar). None: no grammar backend."""
        ...

    def add_request(
        self,
        request_id: str,
        prompt: str | None = None,
        prompt_token_ids: list[int] | None = None,
        params: SamplingParams | None = None,
        priority: int = 0,
        arrival_time: float | None = None,
        deadlines: Deadlines | None = None,
        tenant: str = "",
    ) -> int:
        """Queue a request; returns its prompt length. Raises InvalidParam naming the field.
        `priority`: lower runs first; `arrival_time`: time.monotonic() seconds (default: now);
        `tenant`: who it is billed to, for the fair share inside its priority ("": the default tenant)."""
        ...

    def set_tenant_weights(self, weights: dict[str, float]) -> None:
        """Replace the tenants' fair-share weights (others weigh 1); service already counted stays."""
        ...

    def abort(self, request_id: str) -> bool:
        """End a request now and free its KV blocks; False when it is unknown or already finished."""
        ...

    def load_lora(self, name: str, path: str) -> LoraInfo:
        """Read, validate and register the PEFT adapter at `path` as `name` (requests then select it
        with params.lora_name). Raises LoraError (its `status` and `field` say what to answer);
        nothing is registered on error."""
        ...

    def unload_lora(self, name: str) -> LoraInfo:
        """Forget adapter `name` now (new requests naming it fail); requests in flight on it finish, and
        its weights go after them. Raises LoraError (unknown name, or LoRA off)."""
        ...

    def list_loras(self) -> list[LoraInfo]:
        """The adapters registered, in load order (empty when LoRA is off)."""
        ...

    def step(self) -> list[RequestOutput]:
        """Schedule, run, update once. Never raises for a failed forward pass: that step's requests
        come back finished with FinishReason.ERROR."""
        ...

    def has_unfinished(self) -> bool: ...

    def stats(self) -> EngineStats: ...

    def device_memory(self) -> dict[str, int] | None:
        """Device memory in bytes (`used_bytes`, `total_bytes`, ...) on CUDA; None on the CPU."""
        ...

    def expert_counts(self) -> list[list[int]] | None:
        """Tokens routed to each expert since start-up, per sparse layer (a mixture-of-experts model;
        None for a dense one): for debugging, never a metric label."""
        ...

    def retire_kv_events(self) -> None:
        """The engine's last call (its version unloads, its worker ends): publish the removal of every
        block it still caches (engine/kv/events.py); a no-op without KV events."""
        ...
