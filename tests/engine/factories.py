"""Small factories for scheduler and block-manager tests (no model, no torch)."""

from __future__ import annotations

from engine.block_manager import BlockManager
from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler, SchedulerConfig


def make_request(rid: str, n_prompt: int, priority: int = 0, arrival: float = 0.0, max_tokens: int = 8,
                 tokens: list[int] | None = None) -> Request:
    return Request(
        request_id=rid,
        prompt_token_ids=list(tokens) if tokens is not None else [100 + (i % 50) for i in range(n_prompt)],
        params=SamplingParams(max_tokens=max_tokens, temperature=0.0),
        priority=priority,
        arrival_time=arrival,
        eos_token_ids=frozenset({0}),
    )


def make_scheduler(num_blocks=64, block_size=4, max_num_seqs=8, max_tokens=64, prefix=True) -> Scheduler:
    bm = BlockManager(num_blocks, block_size, enable_prefix_caching=prefix)
    return Scheduler(SchedulerConfig(max_num_seqs, max_tokens), bm)


def fake_step(sched: Scheduler, token: int = 7) -> dict[str, int]:
    """Schedule, pretend the model ran, append one token to each request that samples.
    Returns request_id -> tokens computed this step."""
    out = sched.schedule()
    sched.advance(out)
    for s in out.scheduled:
        if s.sample:
            s.request.output_token_ids.append(token)
    return {s.request.request_id: s.num_tokens for s in out.scheduled}
