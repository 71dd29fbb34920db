"""Batch-invariant mode in the engine (no HTTP): output tokens/s at each concurrency with and without
`EngineConfig.deterministic`, side by side, and whether each arm's outputs at concurrency c are
token-identical to its own outputs at concurrency 1 (the mode's promise; outside it bf16 may differ).

Workload: `--prompts` chat prompts (bench/lib/closed_loop.py's code-edit prompts: a request and a ~150-token
function), greedy, up to `--max-tokens` each, stopping at EOS. Each concurrency runs a closed loop (c
requests in flight, the next added as one finishes); the arms alternate per round (off, on, on, off,
...) and each arm's median round is reported with its best.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from bench.lib.closed_loop import code_edit_prompts, run_closed_loop
from bench.lib.machine import machine_info
from bench.lib.workloads import default_gguf
from engine import Engine, EngineConfig, SamplingParams


def run(args: argparse.Namespace) -> int:
    model = args.model or default_gguf()
    base = dict(model=model, dtype=args.dtype, show_progress=False, max_num_seqs=max(args.concurrency))
    engines = {"off": Engine(EngineConfig(**base)), "on": Engine(EngineConfig(**base, deterministic=True))}
    prompts = code_edit_prompts(engines["off"], args.prompts)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    for e in engines.values():  # warm-up
        run_closed_loop(e, prompts[:1], 1, SamplingParams(max_tokens=8, temperature=0.0))
    report = {"model": str(model), "prompts": args.prompts, "max_tokens": args.max_tokens,
              "machine": machine_info(torch.get_num_threads(), torch.__version__),
              "dtype": engines["off"].dtype_name, "results": []}  # fmt: skip
    first: dict[str, list[list[int]]] = {}  # each arm's outputs at the first concurrency
    for c in args.concurrency:
        rounds: dict[str, list[dict]] = {"off": [], "on": []}
        for r in range(args.rounds):
            for arm in (("off", "on") if r % 2 == 0 else ("on", "off")):
                rounds[arm].append(run_closed_loop(engines[arm], prompts, c, params))
        row: dict = {"concurrency": c}
        for arm, runs in rounds.items():
            med = sorted(runs, key=lambda x: x["wall_s"])[len(runs) // 2]
            row[arm] = {k: med[k] for k in ("output_tokens", "wall_s", "output_tok_s", "tpot_ms", "steps")}
            row[arm]["rounds_tok_s"] = [round(x["output_tok_s"], 1) for x in runs]
            row[arm]["best_tok_s"] = max(x["output_tok_s"] for x in runs)
            outs = first.setdefault(arm, runs[0]["outputs"])
            row[arm]["same_as_first"] = f"{sum(a == b for a, b in zip(outs, runs[0]['outputs'], strict=True))}/{len(outs)}"
        row["cost"] = 1 - row["on"]["output_tok_s"] / row["off"]["output_tok_s"]
        row["best_cost"] = 1 - row["on"]["best_tok_s"] / row["off"]["best_tok_s"]
        report["results"].append(row)
        _print_row(row, args.concurrency[0])
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0


def _print_row(row: dict, c0: int) -> None:
    off, on = row["off"], row["on"]
    print(f"c{row['concurrency']}: median off {off['output_tok_s']:.1f} tok/s, on {on['output_tok_s']:.1f} tok/s "
          f"(cost {100 * row['cost']:.1f}%); best off {off['best_tok_s']:.1f}, on {on['best_tok_s']:.1f} "
          f"(cost {100 * row['best_cost']:.1f}%) | same tokens as c{c0}: off {off['same_as_first']}, "
          f"on {on['same_as_first']}", flush=True)  # fmt: skip


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("determinism", help="batch-invariant mode on/off (engine, no HTTP)",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--model", default=None, help="model path (default: the installed SmolLM2 GGUF)")
    p.add_argument("--dtype", default="auto", help="auto: bf16 for the GGUF on a bf16 CPU")
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 32])
    p.add_argument("--rounds", type=int, default=2, help="rounds per arm, alternating (default: 2)")
    p.add_argument("--json", type=Path, default=None)
    p.set_defaults(func=run)
