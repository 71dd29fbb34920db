"""What the engine hands back: per-request outputs of one step, and engine stats."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the model's context length
    ABORT = "abort"  # aborted by the caller
    ERROR = "error"  # the step that ran this request failed


@dataclass
class TokenLogprob:
    """Log-probability of one sampled token, and the top-N alternatives."""

    token_id: int
    logprob: float
    # (token_id, logprob) pairs, best first; empty when top-N was not asked for.
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class RequestOutput:
    """What one request produced in one engine step (a delta, not the whole output)."""

    request_id: str
    new_token_ids: list[int]  # tokens sampled this step (0 or 1 today)
    text_delta: str  # newly decodable text; stop strings are never included
    logprobs: list[TokenLogprob] | None  # one per new token, when asked for
    finished: bool
    finish_reason: FinishReason | None
    prompt_tokens: int
    completion_tokens: int  # total so far
    cached_tokens: int  # prompt tokens served from the prefix cache (first schedule)
    error: str | None = None  # message when finish_reason is ERROR
    kv_blocks: int = 0  # KV blocks the request held in this step (shared prefix blocks included)


@dataclass
class EngineStats:
    """A snapshot of the engine, read after a step. Plain numbers: no Prometheus here."""

    running: int = 0
    waiting: int = 0
    kv_blocks_used: int = 0  # blocks held by requests (cached free blocks are not counted)
    kv_blocks_total: int = 0
    prefix_cache_queries: int = 0  # cumulative prompt tokens looked up
    prefix_cache_hits: int = 0  # cumulative prompt tokens found in the cache
    preemptions: int = 0  # cumulative
    prompt_tokens: int = 0  # cumulative prompt tokens computed (prefill work)
    generation_tokens: int = 0  # cumulative sampled tokens
    last_step_tokens: int = 0  # tokens in the last step's batch
    last_step_prefill_tokens: int = 0
    last_step_decode_tokens: int = 0
    last_step_time_s: float = 0.0  # wall time of the last step
    steps: int = 0  # cumulative

    @property
    def kv_cache_usage(self) -> float:
        return self.kv_blocks_used / self.kv_blocks_total if self.kv_blocks_total else 0.0
