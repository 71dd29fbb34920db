"""What LoRA adapters cost: throughput and TPOT at each concurrency with 0, 1, 4 and 16 distinct
adapters in the batch (engine, no HTTP), against the base model alone.

Each run submits `c` requests at once (random prompts of --input-len tokens, --output-len tokens out,
ignore_eos, greedy) and steps the engine until all finish; the requests are spread round-robin over
the run's adapters (0: every request on the base model). Adapters are random rank-r PEFT folders on all
seven projections (written here with safetensors: the cost does not depend on the values). Reports
output tok/s (total output tokens / wall) and TPOT (per request, first token to last, over its tokens
after the first; median over requests). With --rounds R each concurrency runs every adapter count R
times, the order reversed every other round (so a slow spell of a shared machine does not fall on one
count), and reports each count's median round. Target (issue 24): 4 adapters cost <= 15% throughput
at c32.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from bench.lib.adapters import write_adapter
from bench.lib.machine import machine_info
from bench.lib.workloads import DEFAULT_MODEL, resolve_model
from engine import Engine, EngineConfig, SamplingParams
from engine.config.lora import LoraConfig
from engine.lora.shapes import BaseShapes


def one_run(engine: Engine, names: list[str | None], c: int, input_len: int, output_len: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    for i in range(c):
        prompt = torch.randint(100, 2000, (input_len,), generator=g).tolist()
        params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True, lora_name=names[i % len(names)])
        engine.add_request(f"r{seed}-{i}", prompt_token_ids=prompt, params=params)
    t0 = time.perf_counter()
    tokens = 0
    while engine.has_unfinished():
        for out in engine.step():
            now = time.perf_counter()
            if out.new_token_ids:
                tokens += len(out.new_token_ids)
                first.setdefault(out.request_id, now)
                last[out.request_id] = now
    wall = time.perf_counter() - t0
    tpots = [(last[r] - first[r]) / (output_len - 1) for r in first if output_len > 1]
    return {"output_tok_s": tokens / wall, "tpot_ms": 1000 * statistics.median(tpots) if tpots else None, "wall_s": wall}


def run(args: argparse.Namespace) -> int:
    path = resolve_model(args.model)
    from transformers import AutoConfig

    shapes = BaseShapes.from_hf_config(AutoConfig.from_pretrained(str(path)))
    most = max(args.adapters)
    results = []
    with tempfile.TemporaryDirectory(prefix="tokenmill-lora-bench-") as tmp:
        modules = tuple((f"a{i}", str(write_adapter(Path(tmp) / f"a{i}", shapes, args.rank, i))) for i in range(most))
        cfg = EngineConfig(model=str(path), dtype=args.dtype, max_num_seqs=max(args.concurrency), show_progress=False,
                           lora=LoraConfig(max_loras=max(most, 1), max_lora_rank=args.rank, modules=modules))  # fmt: skip
        engine = Engine(cfg)
        one_run(engine, [None], 2, 8, 4, seed=999)  # warm-up
        for c in args.concurrency:
            rounds: dict[int, list[dict]] = {n: [] for n in args.adapters}
            for rnd in range(args.rounds):
                for n in (args.adapters if rnd % 2 == 0 else args.adapters[::-1]):
                    names: list[str | None] = [f"a{i}" for i in range(n)] or [None]
                    rounds[n].append(one_run(engine, names, c, args.input_len, args.output_len, seed=c * 100 + n))
            base = None
            for n in args.adapters:
                runs = sorted(rounds[n], key=lambda x: x["output_tok_s"])
                r = dict(runs[len(runs) // 2])  # the median round
                r["rounds_tok_s"] = [round(x["output_tok_s"], 1) for x in rounds[n]]
                base = r["output_tok_s"] if n == 0 else base
                # each round against the base's round of the same pass (run next to it), the median of those:
                # steadier than the medians' ratio on a machine whose speed drifts between passes
                paired = [x["output_tok_s"] / b["output_tok_s"] for x, b in zip(rounds[n], rounds.get(0, []), strict=False)]
                r.update(concurrency=c, adapters=n, vs_base=r["output_tok_s"] / base if base else None,
                         vs_base_paired=statistics.median(paired) if paired else None)  # fmt: skip
                results.append(r)
                tpot = f"{r['tpot_ms']:.1f}" if r["tpot_ms"] is not None else "-"
                rel = f"{r['vs_base']:.3f}" if r["vs_base"] is not None else "-"
                pair = f"{r['vs_base_paired']:.3f}" if r["vs_base_paired"] is not None else "-"
                print(f"c{c:<3} adapters={n:<3} {r['output_tok_s']:8.1f} tok/s  TPOT {tpot} ms  vs base {rel}  "
                      f"(paired {pair})  rounds {r['rounds_tok_s']}", flush=True)
    report = {"command": getattr(args, "command_line", ""), "model": str(path), "rank": args.rank,
              "input_len": args.input_len, "output_len": args.output_len, "dtype": args.dtype, "rounds": args.rounds,
              "machine": machine_info(torch.get_num_threads(), torch.__version__), "results": results}  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("lora", help="LoRA adapters' cost in throughput and TPOT (engine, no HTTP)",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--model", default=DEFAULT_MODEL, help=f"model folder or preset (default: {DEFAULT_MODEL})")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--adapters", type=int, nargs="+", default=[0, 1, 4, 16], help="distinct adapters per run")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 32])
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--rounds", type=int, default=1, help="rounds per adapter count, order alternating; median reported")
    p.add_argument("--json", type=Path, default=None)
    p.set_defaults(func=run)
