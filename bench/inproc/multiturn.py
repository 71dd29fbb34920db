"""Turn-2 time to first token of a hybrid model's chat, with state checkpoints (prefix reuse) and without.

    python -m bench multiturn --model bench-lfm2 --threads 2 --context 2000 --rounds 3

Each round is one conversation of `--context` tokens: a turn-1 prompt of context - answer random tokens,
answered greedily with `--answer` tokens; turn 2 is that prompt + the answer + `--user` new tokens. The
time to first token of turn 2 (add_request to the step that emits its first token, the engine alone:
no HTTP) is measured on two engines over the same model: checkpoints on (the default: turn 2 resumes
from the checkpoint at the end of turn 1, aligned down to a block, and prefills the rest) and off
(`num_state_checkpoints=0`: a hybrid then recomputes the whole conversation). Each round's conversation
is new (no reuse across rounds); the arms alternate which goes first. Both arms' turn-2 tokens must be
the same (the checkpoint is exact). The ratio is the median on over the median off (issue 42's target:
<= 0.2x).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import asdict, dataclass

import torch

from engine import Engine, EngineConfig, SamplingParams


@dataclass
class MultiturnResult:
    model: str
    threads: int
    dtype: str
    context: int  # turn-1 prompt + answer tokens
    turn2_prompt: int  # turn-2 prompt tokens
    block_size: int
    cached_tokens: list[int]  # turn 2's, checkpoints on (per round)
    ttft_on_ms: list[float]
    ttft_off_ms: list[float]
    ratio: float  # median on / median off
    same_tokens: bool  # turn 2's tokens equal with and without checkpoints, every round


def _engine(folder: str, args: argparse.Namespace, checkpoints: bool) -> Engine:
    return Engine(EngineConfig(model=folder, dtype=args.dtype, device="cpu", show_progress=False,
                               max_num_seqs=4, num_state_checkpoints=None if checkpoints else 0))  # fmt: skip


def turn2_ttft(engine: Engine, prompt: list[int], max_tokens: int) -> tuple[float, int, list[int]]:
    """(seconds to the first token, cached tokens, tokens) of one request alone on the engine."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    engine.add_request("turn2", prompt_token_ids=prompt, params=params)
    first, cached, tokens = None, 0, []
    while engine.has_unfinished():
        for out in engine.step():
            if out.new_token_ids and first is None:
                first = time.perf_counter() - t0
            cached = out.cached_tokens
            tokens.extend(out.new_token_ids)
    assert first is not None
    return first, cached, tokens


def _round(engines: dict[str, Engine], args: argparse.Namespace, seed: int, order: tuple[str, str]) -> dict:
    g = torch.Generator().manual_seed(seed)
    vocab = min(int(engines["on"].vocab_size), 2048)
    prompt1 = torch.randint(10, vocab, (args.context - args.answer,), generator=g).tolist()
    user2 = torch.randint(10, vocab, (args.user,), generator=g).tolist()
    params = SamplingParams(max_tokens=args.answer, temperature=0.0, ignore_eos=True)
    row: dict = {}
    for arm in order:
        answer = engines[arm].generate([prompt1], [params])[0].token_ids
        row[arm] = turn2_ttft(engines[arm], prompt1 + answer + user2, args.max_tokens)
        row[f"{arm}_len"] = len(prompt1 + answer + user2)
    return row


def run(args: argparse.Namespace) -> int:
    from bench.lib.workloads import resolve_model

    torch.set_num_threads(args.threads)
    folder = str(resolve_model(args.model))
    engines = {"on": _engine(folder, args, True), "off": _engine(folder, args, False)}
    for e in engines.values():  # warm-up (and the kernels' first calls)
        e.generate([[11, 12, 13] * 40], [SamplingParams(max_tokens=4, temperature=0.0)])
    rows = [_round(engines, args, 1000 + r, ("on", "off") if r % 2 == 0 else ("off", "on")) for r in range(args.rounds)]
    on = [row["on"][0] * 1e3 for row in rows]
    off = [row["off"][0] * 1e3 for row in rows]
    same = all(row["on"][2] == row["off"][2] for row in rows)
    r = MultiturnResult(args.model, args.threads, engines["on"].dtype_name, args.context, rows[0]["on_len"],
                        engines["on"].block_size, [row["on"][1] for row in rows], [round(x, 1) for x in on],
                        [round(x, 1) for x in off], round(statistics.median(on) / statistics.median(off), 3),
                        same)  # fmt: skip
    print(f"{r.model} ({r.dtype}, {r.threads} thread(s)): turn 2 of a {r.context}-token conversation "
          f"({r.turn2_prompt}-token prompt): TTFT median {statistics.median(on):.1f} ms with checkpoints "
          f"(cached {r.cached_tokens} tokens) vs {statistics.median(off):.1f} ms without: {r.ratio:.3f}x; "
          f"same tokens: {same}")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(asdict(r), f, indent=2)
    return 0 if same else 1


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("multiturn", help="a hybrid model's turn-2 TTFT with state checkpoints vs without",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--model", default="bench-lfm2", help="hybrid model folder or make_model preset")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--context", type=int, default=2000, help="turn-1 prompt + answer tokens")
    p.add_argument("--answer", type=int, default=64, help="turn-1 answer tokens")
    p.add_argument("--user", type=int, default=64, help="new tokens of turn 2")
    p.add_argument("--max-tokens", type=int, default=8, help="turn-2 tokens generated (compared across arms)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", default=None)
    p.set_defaults(func=run)
