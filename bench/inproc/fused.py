"""Decode steps with the C++ layer loop (EngineConfig.fused_decode) against the Python layers, side by side.

    python -m bench fused --model bench-135m --dtype bfloat16 --threads 1 --batch 1 8 32

Two engines on the same weights decode the same requests (prompts of `--prompt` tokens, greedy, no
EOS); each timed step runs once on each engine in turn, so a change in the machine's load hits both
alike. The table gives the median step per batch size, and `tokens_equal` whether the two engines
sampled the same tokens over the timed steps (they must: the loop is bit-identical).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import asdict, dataclass


@dataclass
class FusedResult:
    batch: int
    python_ms: float  # median decode step, the Python layer loop
    fused_ms: float  # median decode step, the C++ layer loop
    saved_ms: float
    speedup: float  # python_ms / fused_ms
    tokens_equal: bool


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("fused", help="decode step time: C++ layer loop vs the Python layers")
    p.add_argument("--model", default="bench-135m", help="model folder, GGUF file or make_model preset")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--prompt", type=int, default=128, help="prompt tokens per request")
    p.add_argument("--steps", type=int, default=40, help="timed decode steps per batch size")
    p.add_argument("--json", default=None)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import torch

    from bench.lib.workloads import resolve_model
    from engine import Engine, EngineConfig, SamplingParams

    torch.set_num_threads(args.threads)
    model = str(resolve_model(args.model))
    blocks = max(args.batch) * ((args.prompt + args.steps + 16) // 16 + 2)
    engines = {f: Engine(EngineConfig(model=model, dtype=args.dtype, device="cpu", show_progress=False,
                                      fused_decode=f, num_kv_blocks=blocks, block_size=16,
                                      max_num_seqs=max(args.batch)))
               for f in (False, True)}  # fmt: skip
    results = []
    for batch in args.batch:
        params = SamplingParams(max_tokens=args.steps + 8, temperature=0.0, ignore_eos=True)
        tokens: dict[bool, list[list[int]]] = {False: [], True: []}
        for engine in engines.values():
            for i in range(batch):  # distinct prompts: no prefix sharing between the rows
                ids = [(1000 + 7 * i + j) % 30000 + 10 for j in range(args.prompt)]
                engine.add_request(f"b{batch}-{i}", prompt_token_ids=ids, params=params)
            while engine.stats().running < batch or engine.stats().waiting:  # prefill outside the timing
                engine.step()
            engine.step()
        times: dict[bool, list[float]] = {False: [], True: []}
        for _ in range(args.steps):
            for f, engine in engines.items():
                t = time.perf_counter()
                outs = engine.step()
                times[f].append(time.perf_counter() - t)
                tokens[f].append(sorted((o.request_id, tuple(o.new_token_ids)) for o in outs))
        for engine in engines.values():
            for i in range(batch):
                engine.abort(f"b{batch}-{i}")
            while engine.has_unfinished():
                engine.step()
        py, fu = (statistics.median(times[f]) * 1000 for f in (False, True))
        results.append(FusedResult(batch, round(py, 3), round(fu, 3), round(py - fu, 3), round(py / fu, 3),
                                   tokens[False] == tokens[True]))  # fmt: skip
    print(f"{'batch':>5} {'python ms':>10} {'fused ms':>9} {'saved ms':>9} {'speedup':>8}  tokens equal")
    for r in results:
        print(f"{r.batch:>5} {r.python_ms:>10.2f} {r.fused_ms:>9.2f} {r.saved_ms:>9.2f} {r.speedup:>7.2f}x  {r.tokens_equal}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(r) for r in results], f, indent=2)
    return 0 if all(r.tokens_equal for r in results) else 1
