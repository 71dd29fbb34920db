"""Engine threads under contention: `python -m bench contention`.

For each engine-thread count and libgomp wait policy, starts `python -m server serve` on the default
model, runs one closed-loop load (bench/lib/client.py's client), then the same load again beside a
co-located CPU hog (one process spinning on one core: a sidecar, a client, another tenant's job), and
prints output tok/s for both. With the adaptive thread count on, the timed run follows
`--settle-requests` untimed ones on the same server (beside the hog when busy): the steady figure,
after the governor's first probes (a fixed count has nothing to settle). The question it answers: which default never falls below the one-thread
figure when a core is taken, and how much it gives up on a quiet machine. Figures: docs/BENCHMARKS.md;
how they were reached: docs/benchmarks/log.md ("Engine threads under contention").

The rows alternate (all configurations quiet, then all busy, `--rounds` times) so machine drift lands
on every configuration alike.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from bench.lib import prom
from bench.lib.client import LoadConfig, run_point
from bench.lib.load_requests import synthetic_requests
from bench.lib.prom import metric_sum
from bench.lib.server import free_port, server_command
from bench.lib.workloads import DEFAULT_MODEL, resolve_model

HOG = "import time\nwhile True:\n    sum(range(10000))\n"  # one core, pure Python, no syscalls


@dataclass(frozen=True)
class Variant:
    """One server configuration: engine threads, the OpenMP wait policy ('' = libgomp's default) and
    whether the thread count adapts to measured step times (`--adaptive-threads`) or stays fixed."""

    threads: int
    wait_policy: str  # PASSIVE, ACTIVE, SPIN=<GOMP_SPINCOUNT>, or '' (libgomp's default)
    fixed: bool = False

    @property
    def label(self) -> str:
        mode = ", fixed" if self.fixed or self.threads == 1 else ", adaptive"
        return f"{self.threads} thread{'s' if self.threads > 1 else ''}, {self.wait_policy or 'default'}{mode}"

    @property
    def adaptive(self) -> bool:
        return self.threads > 1 and not self.fixed

    def serve_args(self) -> list[str]:
        return ["--engine-threads", str(self.threads), "--adaptive-threads" if self.adaptive else "--no-adaptive-threads"]


def parse_variant(text: str) -> Variant:
    """`2` (libgomp's default wait, adaptive), `2:fixed`, `2:PASSIVE:fixed`, `1:ACTIVE`, `2:SPIN=30000000`."""
    threads, *rest = text.split(":")
    policy = next((r.upper() for r in rest if r.upper() in ("PASSIVE", "ACTIVE")
                   or (r.upper().startswith("SPIN=") and r[5:].isdigit())), "")  # fmt: skip
    fixed = "fixed" in rest
    if not threads.isdigit() or int(threads) < 1 or len(rest) != bool(policy) + fixed:
        raise argparse.ArgumentTypeError(f"variant must be THREADS[:PASSIVE|ACTIVE|SPIN=N][:fixed], got {text!r}")
    return Variant(int(threads), policy, fixed)


def server_env(variant: Variant) -> dict[str, str | None]:
    """The OpenMP variables the server starts with: only the variant's wait policy (or spin count)."""
    env: dict[str, str | None] = dict.fromkeys(("OMP_WAIT_POLICY", "OMP_NUM_THREADS", "GOMP_SPINCOUNT"))
    if variant.wait_policy.startswith("SPIN="):
        env["GOMP_SPINCOUNT"] = variant.wait_policy[5:]
    elif variant.wait_policy:
        env["OMP_WAIT_POLICY"] = variant.wait_policy
    return env


def measure(variant: Variant, busy: bool, args: argparse.Namespace, requests: list) -> dict:
    """One point: output tok/s (and TPOT p50) of this variant, quiet or beside the hog."""
    log = args.log_dir / f"{variant.threads}-{variant.wait_policy}-{variant.fixed}.log"
    with server_command([*variant.serve_args(), *args.server_arg], free_port(), log, 300,
                        server_env(variant)) as (url, _pid):  # fmt: skip
        hog = subprocess.Popen([sys.executable, "-c", HOG]) if busy else None
        try:
            cfg = LoadConfig(base_url=url, concurrency=args.concurrency)
            settle = args.settle_requests if variant.adaptive else 0
            if settle:  # untimed, beside the hog too: the steady figure, not the governor's first probes
                run_point(requests[:settle], cfg, None, warmup=args.warmup, progress=False)
            report = run_point(requests, cfg, None, warmup=0 if settle else args.warmup, progress=False)
            text = prom.scrape(url)
        finally:
            if hog is not None:
                hog.kill()
                hog.wait()
    tpot = report.get("tpot_s") or {}
    return {"variant": variant.label, "busy": busy, "output_tok_s": report["output_tok_per_s"],
            "tpot_p50_ms": 1000 * tpot["p50"] if "p50" in tpot else None, "ok": report["counts"]["ok"],
            "load_after": os.getloadavg()[0], "threads_at_end": metric_sum(text, "tokenmill_engine_threads"),
            "thread_switches": metric_sum(text, "tokenmill_engine_thread_switches_total")}  # fmt: skip


def run(args: argparse.Namespace) -> int:
    args.log_dir.mkdir(parents=True, exist_ok=True)
    requests = synthetic_requests(str(resolve_model(args.model)), args.num_requests, args.prompt_len,
                                  args.output_len, args.seed)  # fmt: skip
    rows: list[dict] = []
    for _ in range(args.rounds):
        for busy in (False, True):
            for variant in args.variants:
                row = measure(variant, busy, args, requests)
                rows.append(row)
                print(f"{row['variant']:<22} {'busy' if busy else 'quiet':<5} {row['output_tok_s']:8.1f} tok/s  "
                      f"TPOT p50 {row['tpot_p50_ms'] or 0:6.1f} ms  ok {row['ok']}  load {row['load_after']:.2f}  "
                      f"threads at end {row['threads_at_end']}, switches {row['thread_switches']}",
                      flush=True)  # fmt: skip
    print(format_summary(rows))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
    return 0


def format_summary(rows: list[dict]) -> str:
    """Mean output tok/s per variant, quiet and busy, as a Markdown table."""
    out = ["| variant | quiet tok/s | busy tok/s |", "|---|---|---|"]
    for label in dict.fromkeys(r["variant"] for r in rows):
        means = []
        for busy in (False, True):
            vals = [r["output_tok_s"] for r in rows if r["variant"] == label and r["busy"] == busy]
            means.append(f"{sum(vals) / len(vals):.1f}" if vals else "-")
        out.append(f"| {label} | {means[0]} | {means[1]} |")
    return "\n".join(out)


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("contention", help="engine threads and OpenMP wait policy beside a CPU hog",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variants", type=parse_variant, nargs="+",
                   default=[parse_variant(v) for v in ("1", "2:fixed", "2:PASSIVE:fixed", "2")],
                   help="THREADS[:PASSIVE|ACTIVE|SPIN=N][:fixed] each (SPIN: GOMP_SPINCOUNT); without `fixed` the server's adaptive thread "
                   "count is on (default: 1 2:fixed 2:PASSIVE:fixed 2)")
    p.add_argument("--model", default=DEFAULT_MODEL, help="the tokenizer for the synthetic prompts")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--settle-requests", type=int, default=32,
                   help="adaptive variants: requests run untimed before the timed run (with the hog on when busy), "
                   "so the figure is the steady one, after the first probes; 0: time from the start")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--server-arg", action="append", default=[], help="one more `serve` argument (repeatable)")
    p.add_argument("--log-dir", type=Path, default=Path("/tmp/tokenmill-contention"))
    p.add_argument("--json", type=Path, default=None)
    p.set_defaults(func=run)
