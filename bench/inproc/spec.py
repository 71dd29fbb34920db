"""Speculative decoding in the engine (no HTTP): output tokens/s and TPOT with and without the n-gram
proposer, on a prompt-grounded workload, at each concurrency.

Prompt-grounded workloads (bench/lib/spec_prompts.py; generated, the same on every run; greedy, up to
--max-tokens, stopping at EOS): the answer copies spans of the prompt, which is what prompt lookup
drafts from. `code-edit`: "rename this variable in the following function, output the whole
function", over generated Python functions. `summarise`: summarise a generated incident report in
three sentences, each quoting the report verbatim. `rag`: answer a question from a given passage of
generated facts, quoting the supporting sentence. `random`: random token prompts of --input-len
tokens and exactly --max-tokens output tokens (ignore_eos; 128/128 by default): nothing to copy from
the prompt, what speculation costs when it cannot help. Each concurrency runs a closed loop: c requests in
flight, the next one added as one finishes. --warm-prompts N first runs N other prompts of the workload
(untimed) through both engines: the earlier traffic suffix decoding drafts from. The arms alternate per round (off, on, off, on, ...) and
each arm's median round is reported, with the acceptance rate and whether both arms' outputs agree.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from bench.lib.closed_loop import chat_prompts, random_prompts, run_closed_loop
from bench.lib.machine import machine_info
from bench.lib.spec_prompts import CHAT_WORKLOADS
from bench.lib.workloads import default_gguf
from engine import Engine, EngineConfig, SamplingParams
from engine.config.speculative import SpeculativeConfig


def run(args: argparse.Namespace) -> int:
    model = args.model or default_gguf()
    spec = {"method": args.method, "num_speculative_tokens": args.k, "prompt_lookup_max": args.lookup_max,
            "prompt_lookup_min": args.lookup_min, "disable_by_batch_size": args.disable_by_batch_size or None}  # fmt: skip
    if args.method == "draft_model":
        spec["model"] = args.draft_model
    base = dict(model=model, dtype=args.dtype, show_progress=False, max_num_seqs=max(args.concurrency))
    on = EngineConfig(**base, speculative=SpeculativeConfig.from_dict(spec))
    engines = {"off": Engine(EngineConfig(**base)), "on": Engine(on)}
    # Prompt sets: one for every round (a new one per round with --fresh-rounds), then the warm-up traffic.
    sets = args.rounds if args.fresh_rounds else 1
    total = args.prompts * sets + args.warm_prompts
    every = (random_prompts(engines["off"].vocab_size, total, args.input_len) if args.workload == "random"
             else chat_prompts(engines["off"], args.workload, total))  # fmt: skip
    round_prompts = [every[(r % sets) * args.prompts : (r % sets + 1) * args.prompts] for r in range(args.rounds)]
    prompts = round_prompts[0]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=args.workload == "random")
    for e in engines.values():  # warm-up
        run_closed_loop(e, prompts[:1], 1, SamplingParams(max_tokens=8, temperature=0.0))
    if args.warm_prompts:  # earlier traffic of the same kind (other prompts), for a proposer that learns from it
        for e in engines.values():
            run_closed_loop(e, every[args.prompts * sets :], 1, params)
    report = {"workload": args.workload, "model": str(model), "speculative": spec, "prompts": args.prompts,
              "warm_prompts": args.warm_prompts,
              "max_tokens": args.max_tokens, "machine": machine_info(torch.get_num_threads(), torch.__version__),
              "dtype": engines["off"].dtype_name, "results": []}  # fmt: skip
    for c in args.concurrency:
        rounds: dict[str, list[dict]] = {"off": [], "on": []}
        for r in range(args.rounds):
            for arm in (("off", "on") if r % 2 == 0 else ("on", "off")):
                rounds[arm].append(run_closed_loop(engines[arm], round_prompts[r], c, params))
        row: dict = {"concurrency": c}
        # each round's own ratio (the same prompts in both arms, run back to back)
        ratios = [on["output_tok_s"] / off["output_tok_s"] for off, on in zip(rounds["off"], rounds["on"], strict=True)]
        row["round_speedups"] = [round(x, 2) for x in ratios]
        for arm, runs in rounds.items():
            med = sorted(runs, key=lambda x: x["wall_s"])[len(runs) // 2]
            row[arm] = {k: v for k, v in med.items() if k != "outputs"}
            row[arm]["rounds_tok_s"] = [round(x["output_tok_s"], 1) for x in runs]
            row[arm]["best_tok_s"] = max(x["output_tok_s"] for x in runs)  # the least disturbed round
            row[arm]["best_tpot_ms"] = min(x["tpot_ms"] for x in runs if x["tpot_ms"] is not None)
        same = sum(a == b for a, b in zip(rounds["off"][0]["outputs"], rounds["on"][0]["outputs"], strict=True))
        row["identical_outputs"] = f"{same}/{len(prompts)}"
        row["speedup"] = (statistics.median(ratios) if args.fresh_rounds
                          else row["on"]["output_tok_s"] / row["off"]["output_tok_s"])  # fmt: skip
        row["best_speedup"] = row["on"]["best_tok_s"] / row["off"]["best_tok_s"]
        on = row["on"]
        row["acceptance"] = on["accepted_tokens"] / on["draft_tokens"] if on["draft_tokens"] else None
        report["results"].append(row)
        _print_row(row)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0


def _print_row(row: dict) -> None:
    off, on = row["off"], row["on"]
    acc = f"{row['acceptance']:.2f}" if row["acceptance"] is not None else "-"
    print(f"c{row['concurrency']}: median off {off['output_tok_s']:.1f} tok/s TPOT {off['tpot_ms']:.1f} ms | "
          f"on {on['output_tok_s']:.1f} tok/s TPOT {on['tpot_ms']:.1f} ms | x{row['speedup']:.2f}; best off "
          f"{off['best_tok_s']:.1f} / {off['best_tpot_ms']:.1f} ms, on {on['best_tok_s']:.1f} / {on['best_tpot_ms']:.1f} ms"
          f" | x{row['best_speedup']:.2f} | steps {off['steps']} -> {on['steps']} | acceptance {acc} "
          f"({on['accepted_tokens']}/{on['draft_tokens']}) | identical {row['identical_outputs']} | rounds "
          f"{' '.join(f'x{x}' for x in row['round_speedups'])}", flush=True)  # fmt: skip


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("spec", help="speculative decoding on/off (engine, no HTTP)", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--model", default=None, help="model path (default: the installed SmolLM2 GGUF)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--workload", choices=(*CHAT_WORKLOADS, "random"), default="code-edit",
                   help="code-edit, summarise, rag (chat prompts, stop at EOS) or random (--input-len random "
                        "tokens, --max-tokens with ignore_eos); default: code-edit")  # fmt: skip
    p.add_argument("--prompts", type=int, default=20, help="prompts per run (default: 20)")
    p.add_argument("--input-len", type=int, default=128, help="random: prompt tokens (default: 128)")
    p.add_argument("--max-tokens", type=int, default=128, help="output tokens at most (default: 128)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4])
    p.add_argument("--rounds", type=int, default=3,
                   help="rounds per arm, alternating (default: 3; with --method suffix give --fresh-rounds: a "
                        "later round would draft from the same prompts' earlier answers)")  # fmt: skip
    p.add_argument("--fresh-rounds", action="store_true",
                   help="a new set of prompts for each round (both arms the same), and the median of the rounds' "
                        "own speedups: for a proposer that learns from earlier answers (suffix)")  # fmt: skip
    p.add_argument("--warm-prompts", type=int, default=0,
                   help="before measuring, run this many other prompts of the workload through both engines "
                        "(a server that has served such traffic: what suffix decoding learns from; default: 0)")  # fmt: skip
    p.add_argument("--k", type=int, default=4, help="num_speculative_tokens (default: 4)")
    p.add_argument("--lookup-max", type=int, default=4)
    p.add_argument("--lookup-min", type=int, default=2)
    p.add_argument("--disable-by-batch-size", type=int, default=8, help="0: no fixed cap (the measured gate alone)")
    p.add_argument("--method", choices=("ngram", "suffix", "draft_model"), default="ngram")
    p.add_argument("--draft-model", default=None, help="draft_model: the draft model's path")
    p.add_argument("--json", type=Path, default=None)
    p.set_defaults(func=run)
