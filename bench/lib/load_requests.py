"""The requests a load sends: seeded synthetic prompts of an exact token length, prompts from a JSONL
file, and priority lanes drawn from a mix."""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from pathlib import Path

from bench.lib.client import LANES, LoadRequest


def synthetic_requests(tokenizer_path: str, num: int, prompt_len: int, output_len: int, seed: int) -> list[LoadRequest]:
    """`num` seeded prompts of exactly `prompt_len` ordinary tokens of the model's vocabulary."""
    from transformers import AutoConfig, AutoTokenizer

    from bench.lib.workloads import fixed_workload, ordinary_token_ids

    vocab = ordinary_token_ids(AutoTokenizer.from_pretrained(tokenizer_path),
                               AutoConfig.from_pretrained(tokenizer_path).vocab_size)
    wl = fixed_workload(vocab, num, prompt_len, output_len, seed)
    return [LoadRequest(r.prompt_token_ids, r.output_len) for r in wl.requests]


def jsonl_requests(path: Path, num: int | None, output_len: int) -> list[LoadRequest]:
    """Requests from a JSONL file, cycled to `num` (None: each line once)."""
    reqs = []
    for lineno, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        obj = json.loads(line)
        if "prompt_token_ids" in obj:
            prompt: str | tuple[int, ...] = tuple(int(t) for t in obj["prompt_token_ids"])
        elif isinstance(obj.get("prompt"), str):
            prompt = obj["prompt"]
        else:
            raise ValueError(f"{path}:{lineno}: needs a string 'prompt' or a list 'prompt_token_ids'")
        reqs.append(LoadRequest(prompt, int(obj.get("max_tokens", output_len))))
    if not reqs:
        raise ValueError(f"{path}: no prompts")
    n = num or len(reqs)
    return [reqs[i % len(reqs)] for i in range(n)]


def parse_priority_mix(text: str | None) -> dict[str, float] | None:
    """"interactive=3,batch=1" -> lane weights (None for None/empty)."""
    if not text:
        return None
    mix = {}
    for part in text.split(","):
        lane, _, weight = part.partition("=")
        lane = lane.strip()
        if lane not in LANES:
            raise ValueError(f"priority mix: unknown lane {lane!r} (choose from {', '.join(LANES)})")
        mix[lane] = float(weight) if weight else 1.0
        if mix[lane] < 0:
            raise ValueError(f"priority mix: negative weight for {lane}")
    if sum(mix.values()) <= 0:
        raise ValueError("priority mix: the weights sum to zero")
    return mix


def assign_lanes(requests: Sequence[LoadRequest], mix: dict[str, float] | None, seed: int) -> list[LoadRequest]:
    """Each request gets a lane drawn from `mix` (seeded); unchanged without a mix."""
    if not mix:
        return list(requests)
    rng = random.Random(seed + 1)
    lanes, weights = list(mix), list(mix.values())
    return [LoadRequest(r.prompt, r.max_tokens, rng.choices(lanes, weights)[0]) for r in requests]
