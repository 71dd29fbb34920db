"""Small factories for scheduler and block-manager tests (no model, no torch)."""

from __future__ import annotations

from engine.api import Deadlines
from engine.api.sampling_params import SamplingParams
from engine.kv.block_manager import BlockManager
from engine.request import Request
from engine.sched.scheduler import Scheduler, SchedulerConfig


class Clock:
    """A clock the test moves by hand."""

    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def make_request(rid: str, n_prompt: int, priority: int = 0, arrival: float = 0.0, max_tokens: int = 8,
                 tokens: list[int] | None = None, deadlines: Deadlines | None = None) -> Request:  # fmt: skip
    return Request(
        request_id=rid,
        prompt_token_ids=list(tokens) if tokens is not None else [100 + (i % 50) for i in range(n_prompt)],
        params=SamplingParams(max_tokens=max_tokens, temperature=0.0),
        priority=priority,
        arrival_time=arrival,
        eos_token_ids=frozenset({0}),
        deadlines=deadlines or Deadlines(),
    )


def make_scheduler(num_blocks=64, block_size=4, max_num_seqs=8, max_tokens=64, prefix=True, aging_s=0.0,
                   clock: Clock | None = None) -> Scheduler:  # fmt: skip
    bm = BlockManager(num_blocks, block_size, enable_prefix_caching=prefix)
    return Scheduler(SchedulerConfig(max_num_seqs, max_tokens, aging_s), bm, clock or Clock())


def context_token(tokens: list[int]) -> int:
    """A fake model's next token: a function of the whole context, so a request recomputed after a
    preemption gets the same tokens only if its tokens and state were kept exactly."""
    h = 0
    for t in tokens:
        h = (h * 31 + t) % 1_000_003
    return 1 + h % 997


def fake_step(sched: Scheduler, token: int | None = 7, finish: bool = False) -> dict[str, int]:
    """Schedule, pretend the model ran, append one token to each request that samples (`token`, or
    None: `context_token` of its tokens); with `finish`, end those that reached max_tokens.
    Returns request_id -> tokens computed this step."""
    from engine.api import FinishReason

    out = sched.schedule()
    sched.advance(out)
    for s in out.scheduled:
        req = s.request
        if s.sample:
            req.output_token_ids.append(token if token is not None else context_token(req.tokens(0, req.num_tokens)))
            if finish and req.num_output_tokens >= req.params.max_tokens:
                sched.finish(req, FinishReason.LENGTH)
    return {s.request.request_id: s.num_tokens for s in out.scheduled}
