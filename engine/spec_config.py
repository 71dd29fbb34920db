"""The speculative-decoding settings (engine/speculative.py), apart so engine/config.py imports nothing
else of the engine."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

METHODS = ("ngram",)


@dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's `--speculative-config` keys (the ones this engine implements)."""

    method: str = "ngram"  # the proposer: "ngram" (prompt lookup over the request's own tokens)
    num_speculative_tokens: int = 4  # k: draft tokens per step at most
    prompt_lookup_max: int = 4  # longest n-gram matched (tried first)
    prompt_lookup_min: int = 2  # shortest n-gram matched
    # No speculation in a step with more running requests than this (vLLM's name): a large batch is
    # bound by compute, not weight reads, and verification would cost more than it saves.
    disable_by_batch_size: int = 8

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative.method must be one of {METHODS}, got {self.method!r}")
        for name in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "disable_by_batch_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"speculative.{name} must be a positive integer, got {value!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"speculative.prompt_lookup_min ({self.prompt_lookup_min}) must be <= "
                             f"prompt_lookup_max ({self.prompt_lookup_max})")  # fmt: skip

    @classmethod
    def from_dict(cls, value: dict[str, Any]) -> SpeculativeConfig:
        """From vLLM's JSON object; unknown keys raise ValueError naming them."""
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative config: unknown keys {unknown} (known: {sorted(known)})")
        return cls(**value)
