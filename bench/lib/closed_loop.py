"""The engine in a closed loop, no HTTP: c requests in flight, the next added as one finishes; and the
prompts the in-process benchmarks feed it (chat prompts of bench/lib/spec_prompts.py's workloads,
seeded random token prompts). Used by `spec`, `determinism` and `linear-ab`."""

from __future__ import annotations

import statistics
import time

import torch

from bench.lib.spec_prompts import CHAT_WORKLOADS
from engine import Engine, SamplingParams


def chat_prompts(engine: Engine, workload: str, n: int) -> list[list[int]]:
    """n chat prompts of a prompt-grounded workload (bench/lib/spec_prompts.py), through the model's template."""
    message = CHAT_WORKLOADS[workload]
    return [engine.apply_chat_template([{"role": "user", "content": message(i)}]) for i in range(n)]


def code_edit_prompts(engine: Engine, n: int) -> list[list[int]]:
    """n chat prompts: rename one variable of a small generated function."""
    return chat_prompts(engine, "code-edit", n)


def random_prompts(vocab: int, n: int, length: int = 128) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(100, vocab, (length,), generator=g).tolist() for _ in range(n)]


def run_closed_loop(engine: Engine, prompts: list[list[int]], concurrency: int, params: SamplingParams) -> dict:
    """Every prompt through the engine, `concurrency` at a time. Output tokens, wall time, mean TPOT
    (per request: (last token - first token) / (tokens - 1)), the outputs."""
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    outs: dict[str, list[int]] = {}
    pending = list(range(len(prompts)))
    inflight = 0
    before = engine.stats()
    t0 = time.perf_counter()
    while pending or engine.has_unfinished():
        while pending and inflight < concurrency:
            i = pending.pop(0)
            engine.add_request(f"p{i}", prompt_token_ids=prompts[i], params=params)
            outs[f"p{i}"] = []
            inflight += 1
        for out in engine.step():
            now = time.perf_counter()
            if out.new_token_ids:
                first.setdefault(out.request_id, now)
                last[out.request_id] = now
                outs[out.request_id].extend(out.new_token_ids)
            if out.finished:
                inflight -= 1
    wall = time.perf_counter() - t0
    after = engine.stats()
    tpots = [(last[r] - first[r]) / (len(o) - 1) for r, o in outs.items() if len(o) > 1]
    tokens = sum(len(o) for o in outs.values())
    drafted = after.spec_draft_tokens - before.spec_draft_tokens
    return {
        "output_tokens": tokens, "wall_s": wall, "output_tok_s": tokens / wall,
        "tpot_ms": 1000 * statistics.mean(tpots) if tpots else None,
        "draft_tokens": drafted, "accepted_tokens": after.spec_accepted_tokens - before.spec_accepted_tokens,
        "steps": after.steps - before.steps,
        "outputs": [outs[f"p{i}"] for i in range(len(prompts))],
    }  # fmt: skip
