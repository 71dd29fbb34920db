"""HTTP load test against a running server: `python -m bench load --base-url URL ...`.

An asyncio client (bench/lib/client.py) streams every request over `/generate` (SSE) or
`/v1/completions` and times each token event as it arrives. Arrivals: a fixed concurrency (closed loop:
a new request as soon as one ends) and/or Poisson arrivals at --request-rate (a concurrency limit then
caps requests in flight). Prompts: seeded synthetic prompts of exactly --prompt-len tokens from the
model's tokenizer (sent as token ids), or a JSONL file of {"prompt": text} / {"prompt_token_ids": [...]}
lines with an optional "max_tokens". A 429 counts as a finished request of status `rejected`; it is not
retried. Statistics and their definitions: bench/lib/stats.py (and docs/benchmarks/log.md, "HTTP load").
"""

from __future__ import annotations

import argparse
import json
import math
import os
from pathlib import Path

from bench.lib.client import run_point
from bench.lib.load_requests import parse_priority_mix
from bench.served.load_options import add_common_arguments, build_requests, make_config, make_slo


def format_table(report: dict) -> str:
    """A table for people: rates, counts and the latency distributions in milliseconds."""
    c = report["counts"]
    lines = [
        f"requests {report['requests']}: ok {c['ok']}, 429 {c['rejected']}, timeout {c['timeout']}, "
        f"error {c['error']}; duration {report['duration_s']:.2f} s",
        f"request/s {report['request_per_s']:.3f}   output tok/s {report['output_tok_per_s']:.1f}   "
        f"output tokens {report['output_tokens']}   prompt tokens {report['prompt_tokens']} "
        f"({report['cached_prompt_tokens']} from the server's prefix cache)",
    ]
    if "goodput_req_per_s" in report:
        slo = ", ".join(f"{k[:-2]} <= {v * 1000:g} ms" for k, v in report["slo"].items())
        lines.append(f"goodput {report['goodput_req_per_s']:.3f} req/s ({report['good_requests']} requests met {slo})")
    head = ("metric (ms)", "mean", "p50", "p90", "p99")
    rows = [head]
    for key, name in (("ttft_s", "TTFT"), ("itl_s", "ITL"), ("tpot_s", "TPOT"), ("e2e_s", "E2E")):
        d = report.get(key)
        rows.append((name, *(f"{d[k] * 1000:.1f}" if d else "-" for k in ("mean", "p50", "p90", "p99"))))
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    for row in rows:
        lines.append("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths,
                                                                                                   strict=True))))
    for err in report.get("errors", []):
        lines.append(f"  error: {err}")
    return "\n".join(lines)


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("load", help="HTTP load test against a running server", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_arguments(p)
    p.add_argument("-c", "--concurrency", "--max-concurrency", type=int, default=None,
                   help="requests in flight at most (closed loop without --request-rate)")
    p.add_argument("-n", "--num-requests", type=int, default=None,
                   help="requests to send (default: max(8, 2 x concurrency); a dataset: its lines)")
    p.add_argument("--json", type=Path, default=None, help="also write the report as JSON here")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """The `load` subcommand: prints the table, writes --json; returns 0 (1 if no request succeeded)."""
    num = args.num_requests or (None if args.dataset else max(8, 2 * (args.concurrency or 4)))
    cfg = make_config(args, args.base_url.rstrip("/"), args.concurrency)
    requests = build_requests(args, num)
    print(f"command: {args.command_line}")
    print(f"load average (1/5/15 min): {' '.join(f'{x:.2f}' for x in os.getloadavg())} on {os.cpu_count()} CPUs")
    report = run_point(requests, cfg, make_slo(args), args.warmup, args.progress)
    report = {"command": args.command_line, "base_url": cfg.base_url, "endpoint": cfg.endpoint,
              "concurrency": cfg.concurrency, "request_rate": cfg.request_rate if math.isfinite(cfg.request_rate)
              else None, "prompt_len": None if args.dataset else args.prompt_len, "output_len": args.output_len,
              "ignore_eos": cfg.ignore_eos, "priority_mix": parse_priority_mix(args.priority_mix),
              "load_after": list(os.getloadavg()), **report}
    print(format_table(report))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0 if report["counts"]["ok"] else 1
