"""The engine's small-batch linear kernels on and off, side by side (engine, no HTTP): output tok/s
and TPOT per concurrency for each `cpu_gemv` setting, one engine per setting in one process, the
settings alternating per round.

Each round runs c random prompts of --input-len tokens to --output-len tokens (greedy, ignore_eos) in
a closed loop at concurrency c (bench/lib/closed_loop.py). On a CPU that serves in float32 (no AVX-512 BF16)
`auto` is the float32 kernel up to 32 rows (engine/kernels/csrc/cpu_gemv_f32.cpp) and `off` is MKL's F.linear;
in bf16 `auto` is the measured small-batch plan against oneDNN only.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from bench.lib.closed_loop import random_prompts, run_closed_loop
from bench.lib.machine import machine_info
from bench.lib.workloads import default_gguf
from engine import Engine, EngineConfig, SamplingParams


def run(args: argparse.Namespace) -> int:
    model = args.model or default_gguf()
    engines = {v: Engine(EngineConfig(model=str(model), dtype=args.dtype, show_progress=False,
                                      max_num_seqs=max(args.concurrency), cpu_gemv=v)) for v in args.variants}  # fmt: skip
    vocab = next(iter(engines.values())).vocab_size
    for e in engines.values():  # warm-up
        run_closed_loop(e, random_prompts(vocab, 2, 16), 1, SamplingParams(max_tokens=4, temperature=0.0))
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    results = []
    for c in args.concurrency:
        prompts = random_prompts(vocab, c, args.input_len)
        runs: dict[str, list[dict]] = {v: [] for v in args.variants}
        for r in range(args.rounds):
            for v in (args.variants if r % 2 == 0 else args.variants[::-1]):
                runs[v].append(run_closed_loop(engines[v], prompts, c, params))
        row = {"concurrency": c}
        for v, rs in runs.items():
            row[v] = {"rounds_tok_s": [round(x["output_tok_s"], 1) for x in rs],
                      "rounds_tpot_ms": [round(x["tpot_ms"], 1) for x in rs if x["tpot_ms"] is not None],
                      "median_tok_s": statistics.median(x["output_tok_s"] for x in rs)}  # fmt: skip
        results.append(row)
        print(f"c{c}: " + " | ".join(f"{v}: tok/s {row[v]['rounds_tok_s']} TPOT ms {row[v]['rounds_tpot_ms']}"
                                     for v in args.variants), flush=True)  # fmt: skip
    if args.json:
        report = {"model": str(model), "dtype": next(iter(engines.values())).dtype_name, "results": results,
                  "input_len": args.input_len, "output_len": args.output_len,
                  "machine": machine_info(torch.get_num_threads(), torch.__version__)}  # fmt: skip
        args.json.write_text(json.dumps(report, indent=2))
    return 0


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("linear-ab", help="small-batch linear kernels on vs off, served in the engine",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--model", default=None, help="model path (default: the installed SmolLM2 GGUF)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--variants", nargs="+", default=["off", "auto"], choices=("off", "auto", "on"))
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 32])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--json", type=Path, default=None)
    p.set_defaults(func=run)
