"""The speculation workloads over HTTP, for any OpenAI-compatible server: `python -m bench spec-http`.

Sends the chat prompts of bench/lib/spec_prompts.py (code-edit, summarise, rag) to `/v1/chat/completions`
(greedy, `max_tokens`), `--concurrency` at a time, and reports output tokens per second (the servers'
`usage.completion_tokens` over the wall time) and the mean request time. The same client against
tokenmill with and without `--speculative-config` and against llama.cpp's server with and without its
`--spec-type` is the side by side of issue 25 (bench/peers/spec_peers.sh runs all four). `--warm-prompts N`
first sends N other prompts of the workload, untimed: a server that has served such traffic, which is
what suffix decoding drafts from. Each concurrency point sends the same prompts, so a second point of a
learning proposer drafts from the first point's answers: give it one concurrency per server start.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import time
from pathlib import Path

import httpx

from bench.lib.spec_prompts import CHAT_WORKLOADS


def one(client: httpx.Client, url: str, model: str, text: str, max_tokens: int) -> tuple[int, float, str]:
    """(completion tokens, seconds, answer) of one greedy chat request."""
    body = {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens,
            "temperature": 0.0, "seed": 0}  # fmt: skip
    t0 = time.perf_counter()
    r = client.post(f"{url}/v1/chat/completions", json=body, timeout=600)
    r.raise_for_status()
    data = r.json()
    return int(data["usage"]["completion_tokens"]), time.perf_counter() - t0, data["choices"][0]["message"]["content"]


def warm_up(url: str, workload: str, prompts: int, warm_prompts: int, max_tokens: int) -> None:
    """One short request, then `warm_prompts` other prompts of the workload (after the measured ones),
    one at a time: the earlier traffic a learning proposer (suffix decoding) drafts from."""
    with httpx.Client() as client:
        model = client.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
        one(client, url, model, CHAT_WORKLOADS[workload](0), 8)
        for i in range(prompts, prompts + warm_prompts):
            one(client, url, model, CHAT_WORKLOADS[workload](i), max_tokens)


def run_point(url: str, workload: str, prompts: int, concurrency: int, max_tokens: int) -> dict:
    with httpx.Client() as client:
        model = client.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
        texts = [CHAT_WORKLOADS[workload](i) for i in range(prompts)]
        t0 = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
            results = list(pool.map(lambda t: one(client, url, model, t, max_tokens), texts))
        wall = time.perf_counter() - t0
    tokens = sum(n for n, _, _ in results)
    return {"url": url, "model": model, "workload": workload, "prompts": prompts, "concurrency": concurrency,
            "max_tokens": max_tokens, "output_tokens": tokens, "wall_s": round(wall, 3),
            "output_tok_s": round(tokens / wall, 2), "mean_request_s": round(sum(s for _, s, _ in results) / len(results), 3),
            "answers": [a for _, _, a in results]}  # fmt: skip


def run(args: argparse.Namespace) -> int:
    rows = []
    warm_up(args.base_url, args.workload, args.prompts, args.warm_prompts, args.max_tokens)
    for c in args.concurrency:
        row = run_point(args.base_url, args.workload, args.prompts, c, args.max_tokens)
        rows.append(row)
        print(f"{args.label or args.base_url} {args.workload} c{c}: {row['output_tok_s']:.1f} tok/s, "
              f"{row['output_tokens']} tokens in {row['wall_s']:.1f} s, mean request {row['mean_request_s']:.2f} s",
              flush=True)  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps({"label": args.label, "rows": rows}, indent=2))
    return 0


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("spec-http", help="speculation workloads against any OpenAI-compatible server",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--base-url", required=True)
    p.add_argument("--workload", default="code-edit", choices=sorted(CHAT_WORKLOADS))
    p.add_argument("--prompts", type=int, default=20)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1])
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--warm-prompts", type=int, default=0,
                   help="other prompts of the workload sent first, one at a time, untimed (default: 0)")
    p.add_argument("--label", default="")
    p.add_argument("--json", type=Path, default=None)
    p.set_defaults(func=run)
