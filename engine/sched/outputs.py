"""The scheduler's output and the runner's: what a step runs (`SchedulerOutput`), what it sampled
(`ModelRunnerOutput`), and `StepRunner`, the contract between the step loop and whatever runs the
model. Plain data, torch-free."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from engine.api import Deadline, TokenLogprob
from engine.request import Request


@dataclass
class ScheduledRequest:
    request: Request
    start: int  # first token position computed this step (== num_computed_tokens before the step)
    num_tokens: int  # tokens computed this step (1 for a decode), draft tokens included
    sample: bool  # whether this step ends the request's known tokens, so a new token is sampled
    # Draft tokens run after the known ones (speculative decoding; engine/spec/drafts.py): the runner
    # verifies them and the core settles the accepted ones (Scheduler.settle_drafts). [] : none.
    draft_token_ids: list[int] = field(default_factory=list)
    # A hybrid model's state checkpoints (engine/state/checkpoints.py): the checkpoint slot copied into the
    # request's state slot before the step (it resumes from a checkpointed prefix), and the one its state
    # is copied into after the step (the step ends at a checkpoint position); None: no copy.
    state_load: int | None = None
    state_save: int | None = None


@dataclass
class SchedulerOutput:
    """What the model runner runs this step, and what the scheduler decided besides."""

    scheduled: list[ScheduledRequest] = field(default_factory=list)  # model work, one entry per request
    started: list[Request] = field(default_factory=list)  # scheduled for the first time in this step
    expired: list[tuple[Request, Deadline]] = field(default_factory=list)  # ended by a deadline (freed)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled



@dataclass
class ModelRunnerOutput:
    """What was sampled this step, for the requests whose scheduled tokens ended their sequence."""

    sampled: dict[str, int]  # request_id -> new token id
    logprobs: dict[str, TokenLogprob]  # request_id -> logprob of that token (when asked for)
    failed: list[str] = field(default_factory=list)  # request_ids whose logits were not finite: no token
    # request_id -> log-probabilities of the prompt tokens this step's chunk predicted, in order (for
    # requests with params.prompt_logprobs; engine/sample/prompt_logprobs.py)
    prompt_logprobs: dict[str, list[TokenLogprob]] = field(default_factory=dict)
    # request_id -> the tokens a row with draft tokens emits: its accepted drafts, then the target's
    # correction or bonus token (engine/sample/verify.py); such a row is not in `sampled`
    spec_tokens: dict[str, list[int]] = field(default_factory=dict)
    # request_id -> the logprobs of those tokens, one each (requests with params.logprobs)
    spec_logprobs: dict[str, list[TokenLogprob]] = field(default_factory=dict)


class StepRunner(Protocol):
    """What runs the model for the step loop (engine/core/step_loop.py): the torch engine's
    engine/runner/model_runner.py ModelRunner, or a test's fake that makes up tokens."""

    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        """Run the scheduled tokens through the model and sample for the entries with `sample`."""
        ...
