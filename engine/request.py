"""A request's mutable state inside the engine. Everything a request needs across steps lives here, each
field with one writer (named in its comment), so no side table keyed by request id has to be cleaned
when it ends."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from engine.api import Deadlines, FinishReason
from engine.api.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class GroupTable:
    """A request's block table in one extra KV-cache group (engine/kv/groups.py): the same four fields as
    the Request's own table (group 0's), with the same meanings, over that group's block pool."""

    block_ids: list[int] = field(default_factory=list)
    num_freed_blocks: int = 0
    num_hashed_blocks: int = 0
    last_block_hash: int | None = None


@dataclass(eq=False)
class Request:
    """One generation request. The block table is here; the blocks themselves live in the block manager."""

    # -- given at creation, never changed --------------------------------------------------------------
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int  # lower runs first (engine/sched/ordering.py)
    arrival_time: float  # clock seconds the caller received it; orders requests and anchors deadlines
    eos_token_ids: frozenset[int]
    deadlines: Deadlines = field(default_factory=Deadlines)
    # The LoRA adapter it runs on (engine/lora/registry.py LoraInfo.lora_id, unique per load); 0: the base
    # model. Salts its prefix-cache hashes, so no block is shared across adapters (engine/kv/block_manager.py).
    lora_id: int = 0
    tenant: str = ""  # who it is billed to (engine/sched/fair_share.py); "": the default tenant
    # -- the scheduler's --------------------------------------------------------------------------------
    status: RequestStatus = RequestStatus.WAITING
    waiting_since: float = 0.0  # clock seconds it (re)entered the waiting queue: arrival, or preemption
    waited_s: float = 0.0  # seconds spent waiting before the current wait (it ages by the total)
    num_charged_prompt_tokens: int = 0  # prompt tokens counted as its tenant's service (once each)
    started: bool = False  # scheduled at least once (its queue deadline no longer applies)
    num_preemptions: int = 0
    budget_deferred: bool = False  # left out of a step by more important work; counted once until it runs
    spec_acceptance: float = 1.0  # recent share of draft tokens accepted (engine/spec/drafts.py); sets k
    # Tokens whose K/V are in the cache. Reset to 0 on preemption (we recompute).
    num_computed_tokens: int = 0
    # Prompt tokens served from the prefix cache at the first schedule (reported as cached_tokens).
    num_cached_tokens: int = -1  # -1: not scheduled yet
    finish_reason: FinishReason | None = None
    # -- the block manager's ------------------------------------------------------------------------------
    block_ids: list[int] = field(default_factory=list)
    # leading blocks freed as they left a sliding window (their block_ids entries: NULL_BLOCK placeholders)
    num_freed_blocks: int = 0
    num_hashed_blocks: int = 0  # leading blocks registered in the prefix cache
    last_block_hash: int | None = None  # chained hash of the last registered block
    # the other KV-cache groups' tables (group g at index g - 1; engine/kv/groups.py); empty with one group
    kv_groups: list[GroupTable] = field(default_factory=list)
    # -- the state pool's (engine/state/pool.py; hybrid models only) ---------------------------------------
    state_slot: int | None = None  # the slot of its recurrent state while it runs; None: it holds none
    # -- the checkpoint index's (engine/state/checkpoints.py; hybrid models with prefix reuse) ---------------
    checkpoint_slot: int | None = None  # the checkpoint slot its state is saved into; None: it holds none
    # -- the output processor's (token appends, text) ------------------------------------------------------
    output_token_ids: list[int] = field(default_factory=list)
    text: Any = None  # RequestTextState: detokenizer and stop-string filter, kept across preemptions
    # Prompt token log-probabilities computed so far (params.prompt_logprobs): entry i is token i's, the
    # first None; kept across preemptions (a recompute does not redo them)
    prompt_logprobs: list[Any] = field(default_factory=list)
    # -- the sampler's ------------------------------------------------------------------------------------
    generator: Any = None  # torch.Generator drawn from for sampled tokens; None until first used
    # GrammarMatcher of params.structured, advanced past every sampled token (past a verified row's tokens
    # by the engine core, as it appends them); None until first used.
    # Kept across preemptions, like the output tokens it has seen (nothing is rolled back).
    grammar: Any = None
    # params.logit_bias as a dense [vocab] float32 row on the logits' device, built once on first use;
    # None until then (and for requests without a bias)
    bias: Any = None

    def __post_init__(self) -> None:
        self.waiting_since = self.arrival_time

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Prompt log-probabilities were asked for and some are not computed yet: the prompt must run
        through the model (not come from the prefix cache)."""
        return self.params.prompt_logprobs is not None and len(self.prompt_logprobs) < self.num_prompt_tokens

    def tokens(self, start: int, end: int) -> list[int]:
        """Token ids [start, end) over prompt + output."""
        n = len(self.prompt_token_ids)
        if end <= n:
            return self.prompt_token_ids[start:end]
        if start >= n:
            return self.output_token_ids[start - n : end - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - n]
