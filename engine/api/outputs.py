"""What comes back from the engine: a request's outputs step by step, why it finished, the stats a
caller may read, and the adapters it has. Plain data, torch-free."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from engine.api.errors import InvalidParam


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the model's context length
    ABORT = "abort"  # aborted by the caller
    ERROR = "error"  # the step that ran this request failed
    TIMEOUT = "timeout"  # one of its deadlines passed (RequestOutput.deadline says which)


class Deadline(str, enum.Enum):
    """Which of a request's deadlines ended it."""

    QUEUE = "queue"  # never scheduled within Deadlines.queue_s of arrival
    FIRST_TOKEN = "first_token"  # no token within Deadlines.first_token_s of arrival
    TOTAL = "total"  # not finished within Deadlines.total_s of arrival


class PreemptionCause(str, enum.Enum):
    """The limit at which a more important request took a running request's place."""

    SLOTS = "slots"  # max_num_seqs: a waiting request took the victim's seat (blocks freed, recompute)
    KV = "kv"  # KV blocks ran out (blocks freed, recompute)
    BUDGET = "budget"  # the step's token budget went to more important work (the victim keeps its blocks)


@dataclass(frozen=True)
class Deadlines:
    """A request's deadlines in seconds after its arrival time; None: no limit. The scheduler checks
    them every step, against the arrival time the caller gave (the client's, not the hand-off's)."""

    queue_s: float | None = None  # to be scheduled for the first time
    first_token_s: float | None = None  # to produce its first token
    total_s: float | None = None  # to finish

    def __post_init__(self) -> None:
        for name in ("queue_s", "first_token_s", "total_s"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                      or not value > 0 or value != value):  # fmt: skip
                raise InvalidParam(name, f"{name} must be a positive number of seconds, got {value!r}")


@dataclass
class TokenLogprob:
    """Log-probability of one sampled token, and the top-N alternatives."""

    token_id: int
    logprob: float
    # (token_id, logprob) pairs, best first; empty when top-N was not asked for.
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class RequestOutput:
    """What one request did in one engine step (a delta, not the whole output). A step returns one for
    every request that started, sampled a token or finished in it."""

    request_id: str
    new_token_ids: list[int]  # tokens emitted this step (0 or 1; up to k + 1 with speculative decoding)
    text_delta: str  # newly decodable text; stop strings are never included
    logprobs: list[TokenLogprob] | None  # one per new token, when asked for
    finished: bool
    finish_reason: FinishReason | None
    prompt_tokens: int
    completion_tokens: int  # total so far
    cached_tokens: int  # prompt tokens served from the prefix cache (first schedule)
    error: str | None = None  # message when finish_reason is ERROR
    # the request's field at fault when the error is the request's, not the engine's (its grammar
    # allowed no next token: GrammarSpec.param); None: an engine error
    error_param: str | None = None
    kv_blocks: int = 0  # KV blocks the request held in this step (shared prefix blocks included)
    started: bool = False  # this step scheduled the request for the first time (it left the queue)
    num_preemptions: int = 0  # times it was preempted so far (every cause)
    deadline: Deadline | None = None  # which deadline passed, when finish_reason is TIMEOUT
    # Every prompt token's log-probability (the first None), once, on the output that ends the prompt's
    # run (its first token, or its finish with max_tokens 0); None when not asked for (prompt_logprobs)
    prompt_logprobs: list[TokenLogprob | None] | None = None


@dataclass
class EngineStats:
    """A snapshot of the engine, read after a step. Plain numbers: no Prometheus here."""

    running: int = 0
    waiting: int = 0  # every request not running: never scheduled, or preempted
    waiting_preempted: int = 0  # of those, the preempted ones (they ran before)
    kv_blocks_used: int = 0  # blocks held by requests (cached free blocks are not counted)
    kv_blocks_total: int = 0
    block_size: int = 0  # tokens per KV block
    prefix_cache_queries: int = 0  # cumulative prompt tokens looked up
    prefix_cache_hits: int = 0  # cumulative prompt tokens found in the cache
    preemptions: int = 0  # cumulative, every cause
    # cumulative, by (the victim's own priority, cause)
    preemptions_by: dict[tuple[int, PreemptionCause], int] = field(default_factory=dict)
    # cumulative: LongRoPE requests computed again from their first token when they grew past the
    # switch (engine/models/rope.py; not preemptions: they keep their seat)
    rope_recomputes: int = 0
    prompt_tokens: int = 0  # cumulative prompt tokens computed (prefill work)
    generation_tokens: int = 0  # cumulative sampled tokens
    last_step_tokens: int = 0  # tokens in the last step's batch
    last_step_prefill_tokens: int = 0
    last_step_decode_tokens: int = 0
    last_step_time_s: float = 0.0  # wall time of the last step
    steps: int = 0  # cumulative
    cpu_threads: int = 0  # CPU threads the last step ran at (engine/core/thread_governor.py); 0: not governed
    cpu_thread_switches: int = 0  # cumulative: times the governor changed the chosen count
    # Speculative decoding, cumulative (vLLM's spec_decode counters): rows verified with drafts, draft
    # tokens verified, drafts accepted, and accepted by position (entry i: drafts accepted at index i)
    spec_drafts: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_accepted_per_pos: list[int] = field(default_factory=list)
    # LoRA (vLLM's lora_requests_info): adapter name -> requests running / waiting on it, the limit of
    # adapters in one step (0: LoRA off), and device copies made (cumulative count and seconds)
    lora_running: dict[str, int] = field(default_factory=dict)
    lora_waiting: dict[str, int] = field(default_factory=dict)
    max_loras: int = 0
    lora_loads: int = 0
    lora_load_s: float = 0.0

    def record_drafts(self, drafted: int, accepted: int) -> None:
        """Count one verified row: `drafted` draft tokens, of which the first `accepted` were taken."""
        self.spec_drafts += 1
        self.spec_draft_tokens += drafted
        self.spec_accepted_tokens += accepted
        if len(self.spec_accepted_per_pos) < drafted:
            self.spec_accepted_per_pos.extend([0] * (drafted - len(self.spec_accepted_per_pos)))
        for i in range(accepted):
            self.spec_accepted_per_pos[i] += 1

    @property
    def kv_cache_usage(self) -> float:
        return self.kv_blocks_used / self.kv_blocks_total if self.kv_blocks_total else 0.0


@dataclass(frozen=True)
class LoraInfo:
    """One registered adapter, as the server lists it."""

    name: str
    lora_id: int  # unique per load in this engine (a reload under the same name gets a new one); > 0
    path: str
    rank: int
    targets: tuple[str, ...]
    nbytes: int  # host copy
