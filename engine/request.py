"""A request's mutable state inside the engine (owned by the scheduler)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from engine.outputs import FinishReason
from engine.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    """One generation request. Token state lives here; KV blocks live in the block manager."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int  # lower runs first
    arrival_time: float
    eos_token_ids: frozenset[int]
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    # Tokens whose K/V are in the cache. Reset to 0 on preemption (we recompute).
    num_computed_tokens: int = 0
    # Prompt tokens served from the prefix cache at the first schedule (reported as cached_tokens).
    num_cached_tokens: int = -1  # -1: not scheduled yet
    block_ids: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    num_preemptions: int = 0

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def tokens(self, start: int, end: int) -> list[int]:
        """Token ids [start, end) over prompt + output."""
        n = len(self.prompt_token_ids)
        if end <= n:
            return self.prompt_token_ids[start:end]
        if start >= n:
            return self.output_token_ids[start - n : end - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - n]

    def sort_key(self) -> tuple[int, float, str]:
        """The one ordering of requests: priority, then arrival, then id."""
        return (self.priority, self.arrival_time, self.request_id)
