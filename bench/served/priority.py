"""Priority under saturation, against a running server: `python -m bench priority --base-url URL ...`.

Three phases, one after the other, on the same server:
1. idle: a few interactive requests alone (their TTFT is the reference);
2. mixed: `--batch-streams` closed-loop batch streams (more than the server's max_num_seqs, so every
   seat is taken) plus Poisson interactive arrivals at `--interactive-rate`, for `--duration` seconds;
3. one lane: the same load with every request in the batch lane (what priority costs in throughput).

Reports per-lane TTFT and queue wait (the server's `timing.queue_s`), preemptions per 1,000 generated
tokens (from /metrics), and output throughput of phases 2 and 3. The targets of the priority design:
interactive TTFT p99 under saturation <= 3 x idle TTFT + one engine step (the mean step of phase 2,
from /metrics), and mixed throughput within 10% of the one-lane run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import time
from pathlib import Path

import httpx

from bench.lib.client import LoadConfig, LoadRequest, send_one
from bench.lib.prom import metric_sum, scrape
from bench.lib.stats import RequestRecord, distribution
from bench.lib.workloads import fixed_workload, ordinary_token_ids, resolve_model


async def run_phase(cfg: LoadConfig, batch: list[LoadRequest], interactive: list[LoadRequest], streams: int,
                    rate: float, duration_s: float, seed: int) -> tuple[list[RequestRecord], float]:  # fmt: skip
    """`streams` closed-loop batch senders and Poisson interactive arrivals until `duration_s`; then wait
    for what is in flight. Returns the records and the time from start to the last response."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    records: list[RequestRecord] = []
    async with httpx.AsyncClient(base_url=cfg.base_url, timeout=httpx.Timeout(cfg.timeout_s), limits=limits) as client:
        start = time.perf_counter()
        end = start + duration_s

        async def batch_loop(i: int) -> None:
            n = 0
            while time.perf_counter() < end:
                records.append(await send_one(client, batch[(i + n * streams) % len(batch)], cfg))
                n += 1

        async def interactive_arrivals() -> None:
            rng, tasks, n = random.Random(seed), [], 0
            while True:
                await asyncio.sleep(rng.expovariate(rate))
                if time.perf_counter() >= end:
                    break
                tasks.append(asyncio.create_task(send_one(client, interactive[n % len(interactive)], cfg)))
                n += 1
            records.extend(await asyncio.gather(*tasks))

        jobs = [batch_loop(i) for i in range(streams)] + ([interactive_arrivals()] if rate > 0 else [])
        await asyncio.gather(*jobs)
    last = max((r.done_at for r in records if r.done_at is not None), default=start)
    return records, max(last - start, 1e-9)


def phase_report(records: list[RequestRecord], duration_s: float, before: str, after: str) -> dict:
    ok = [r for r in records if r.status == "ok"]
    tokens = sum(r.num_output_tokens for r in ok)
    generated = metric_sum(after, "tokenmill_generation_tokens_total") - metric_sum(before, "tokenmill_generation_tokens_total")
    preempt = {cause: metric_sum(after, "tokenmill_preemptions_total", cause=cause)
               - metric_sum(before, "tokenmill_preemptions_total", cause=cause) for cause in ("slots", "kv", "budget")}  # fmt: skip
    steps = metric_sum(after, "tokenmill_engine_step_duration_seconds_count") - metric_sum(before, "tokenmill_engine_step_duration_seconds_count")
    step_s = metric_sum(after, "tokenmill_engine_step_duration_seconds_sum") - metric_sum(before, "tokenmill_engine_step_duration_seconds_sum")
    lanes = {}
    for lane in sorted({r.lane for r in records if r.lane}):
        mine = [r for r in ok if r.lane == lane]
        lanes[lane] = {
            "requests": sum(r.lane == lane for r in records), "ok": len(mine),
            "ttft_s": distribution([r.ttft for r in mine if r.ttft is not None]),
            "queue_s": distribution([r.queue_s for r in mine if r.queue_s is not None]),
            "preempted_requests": sum(r.preemptions > 0 for r in mine),
        }
    return {
        "duration_s": duration_s, "requests": len(records), "ok": len(ok),
        "not_ok": sorted({f"{r.status}: {r.error}" for r in records if r.status != "ok"})[:5],
        "output_tokens": tokens, "output_tok_per_s": tokens / duration_s,
        "preemptions": preempt, "preemptions_per_1k_tokens": 1000 * sum(preempt.values()) / max(generated, 1),
        "mean_step_s": step_s / steps if steps else None, "lanes": lanes,
    }


def build_requests(model: str, prompt_len: int, batch_len: int, interactive_len: int, n: int, seed: int):
    from transformers import AutoConfig, AutoTokenizer

    path = str(resolve_model(model))
    vocab = ordinary_token_ids(AutoTokenizer.from_pretrained(path), AutoConfig.from_pretrained(path).vocab_size)
    batch = fixed_workload(vocab, n, prompt_len, batch_len, seed).requests
    inter = fixed_workload(vocab, n, prompt_len, interactive_len, seed + 1).requests
    return ([LoadRequest(r.prompt_token_ids, r.output_len, "batch") for r in batch],
            [LoadRequest(r.prompt_token_ids, r.output_len, "interactive") for r in inter])


def run(args: argparse.Namespace) -> int:
    base = args.base_url.rstrip("/")
    cfg = LoadConfig(base_url=base, concurrency=None, request_rate=1.0, timeout_s=args.timeout)
    batch, inter = build_requests(args.model, args.prompt_len, args.batch_output_len, args.interactive_output_len,
                                  max(256, args.batch_streams * 4), args.seed)  # fmt: skip
    print(f"command: {args.command_line}")
    print(f"load average (1/5/15 min): {' '.join(f'{x:.2f}' for x in os.getloadavg())} on {os.cpu_count()} CPUs")
    idle = [asyncio.run(_one(cfg, r)) for r in inter[: args.idle_requests + 1]][1:]  # the first warms up
    idle_ttft = statistics.median(r.ttft for r in idle if r.ttft is not None)
    phases = {}
    for name, interactive_rate, batch_reqs in (("mixed", args.interactive_rate, batch),
                                               ("one_lane", args.interactive_rate, batch)):  # fmt: skip
        # One lane: the interactive arrivals are sent in the batch lane too (same work, no priority).
        inter_reqs = inter if name == "mixed" else [LoadRequest(r.prompt, r.max_tokens, "batch") for r in inter]
        before = scrape(base)
        records, duration = asyncio.run(run_phase(cfg, batch_reqs, inter_reqs, args.batch_streams, interactive_rate,
                                                  args.duration, args.seed))  # fmt: skip
        if name == "one_lane":  # tell the two kinds apart in the report
            for r in records:
                r.lane = "batch" if r.num_output_tokens > args.interactive_output_len else "interactive-as-batch"
        phases[name] = phase_report(records, duration, before, scrape(base))
    report = _verdict(idle_ttft, phases)
    report.update(command=args.command_line, idle_ttft_s=idle_ttft, phases=phases, load_after=list(os.getloadavg()))
    print(format_report(report))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


async def _one(cfg: LoadConfig, req: LoadRequest) -> RequestRecord:
    async with httpx.AsyncClient(base_url=cfg.base_url, timeout=httpx.Timeout(cfg.timeout_s)) as client:
        return await send_one(client, req, cfg)


def _verdict(idle_ttft: float, phases: dict) -> dict:
    mixed, one = phases["mixed"], phases["one_lane"]
    ttft = (mixed["lanes"].get("interactive") or {}).get("ttft_s")
    step = mixed["mean_step_s"] or 0.0
    bound = 3 * idle_ttft + step
    ratio = mixed["output_tok_per_s"] / one["output_tok_per_s"] if one["output_tok_per_s"] else None
    return {
        "interactive_ttft_p99_s": ttft["p99"] if ttft else None, "ttft_bound_s": bound,
        "ttft_target_met": bool(ttft and ttft["p99"] <= bound),
        "throughput_ratio": ratio, "throughput_target_met": bool(ratio and ratio >= 0.9),
    }


def format_report(r: dict) -> str:
    ms = lambda v: "-" if v is None else f"{v * 1000:.0f}"  # noqa: E731
    lines = [f"idle interactive TTFT p50 {ms(r['idle_ttft_s'])} ms"]
    for name, ph in r["phases"].items():
        lines.append(f"{name}: {ph['ok']}/{ph['requests']} ok in {ph['duration_s']:.1f} s, {ph['output_tok_per_s']:.1f} "
                     f"output tok/s, mean step {ms(ph['mean_step_s'])} ms, preemptions {ph['preemptions']} "
                     f"({ph['preemptions_per_1k_tokens']:.2f} per 1k tokens)")  # fmt: skip
        for lane, d in ph["lanes"].items():
            t, q = d["ttft_s"] or {}, d["queue_s"] or {}
            lines.append(f"  {lane:<22} n={d['ok']:<5} TTFT p50/p99 {ms(t.get('p50'))}/{ms(t.get('p99'))} ms   "
                         f"queue p50/p99 {ms(q.get('p50'))}/{ms(q.get('p99'))} ms   preempted {d['preempted_requests']}")  # fmt: skip
        for err in ph["not_ok"]:
            lines.append(f"  not ok: {err}")
    lines.append(f"interactive TTFT p99 {ms(r['interactive_ttft_p99_s'])} ms vs bound 3 x idle + one step = "
                 f"{ms(r['ttft_bound_s'])} ms: {'met' if r['ttft_target_met'] else 'MISSED'}")
    ratio = r["throughput_ratio"]
    lines.append(f"throughput mixed / one lane = {ratio:.3f}: {'met' if r['throughput_target_met'] else 'MISSED'} "
                 f"(target >= 0.90)" if ratio else "throughput: no data")
    return "\n".join(lines)


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("priority", help="interactive latency under batch saturation, and its cost",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--model", default="bench-135m", help="tokenizer for the prompts: a folder or a preset")
    p.add_argument("--batch-streams", type=int, default=80, help="closed-loop batch streams (default: 80)")
    p.add_argument("--batch-output-len", type=int, default=300)
    p.add_argument("--interactive-rate", type=float, default=1.0, help="interactive arrivals per second")
    p.add_argument("--interactive-output-len", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--duration", type=float, default=60.0, help="seconds of each phase's arrivals")
    p.add_argument("--idle-requests", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=900.0)
    p.add_argument("--json", type=Path, default=None)
    p.set_defaults(func=run)
