"""The speculative-decoding settings (vLLM's `--speculative-config`): method, draft length and the
proposers' options; engine/spec/ runs them."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

METHODS = ("ngram", "suffix", "draft_model")


@dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's `--speculative-config` keys (the ones this engine implements)."""

    # the proposer: "ngram" (prompt lookup over the request's own tokens), "suffix" (the engine's
    # earlier outputs and the request's own tokens; engine/spec/suffix_tree.py), "draft_model" (a smaller
    # model with the same tokenizer, `model`; engine/runner/draft_model.py)
    method: str = "ngram"
    num_speculative_tokens: int = 4  # k: draft tokens per step at most (suffix, from a dict: the tree depth)
    prompt_lookup_max: int = 4  # longest n-gram matched (tried first); suffix: of the request's own tokens
    prompt_lookup_min: int = 2  # shortest n-gram matched
    # No speculation in a step with more running requests than this (vLLM's name); None: no fixed cap.
    # Below it the engine still turns speculation off at batch sizes where its measured step times say
    # verification costs more than it saves (engine/spec/gate.py).
    disable_by_batch_size: int | None = None
    model: str | None = None  # draft_model: the draft model's folder or GGUF file (same tokenizer)
    suffix_decoding_max_tree_depth: int = 24  # suffix: longest token sequence counted (match + draft)
    suffix_decoding_max_cached_requests: int = 1000  # suffix: earlier outputs held (LRU); 0: none
    suffix_decoding_max_spec_factor: float = 1.0  # suffix: draft at most this x the match length
    suffix_decoding_min_token_prob: float = 0.1  # suffix: a draft token's least share of its context's count

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative.method must be one of {METHODS}, got {self.method!r}")
        for name in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "disable_by_batch_size",
                     "suffix_decoding_max_tree_depth", "suffix_decoding_max_cached_requests"):  # fmt: skip
            value = getattr(self, name)
            if value is None and name == "disable_by_batch_size":
                continue
            low = 0 if name == "suffix_decoding_max_cached_requests" else 1
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"speculative.{name} must be an integer >= {low}, got {value!r}")
        for name, lo, hi in (("suffix_decoding_max_spec_factor", 0.0, math.inf), ("suffix_decoding_min_token_prob", 0.0, 1.0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not lo <= value <= hi:
                raise ValueError(f"speculative.{name} must be a number in [{lo}, {hi}], got {value!r}")
        if (self.method == "draft_model") != (self.model is not None):
            raise ValueError("speculative.model (the draft model's path) is needed for, and only for, method draft_model")
        if self.model is not None and (not isinstance(self.model, str) or not self.model):
            raise ValueError(f"speculative.model must be a path, got {self.model!r}")
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
        if "model" in value and "method" not in value:  # vLLM: a model without a method is a draft model
            value = {**value, "method": "draft_model"}
        if value.get("method") == "suffix" and "num_speculative_tokens" not in value:
            # vLLM: suffix decoding sizes each draft itself (match length, token shares); the setting is
            # only its ceiling, the tree's depth unless given
            depth = value.get("suffix_decoding_max_tree_depth", cls.suffix_decoding_max_tree_depth)
            value = {**value, "num_speculative_tokens": depth}
        return cls(**value)
