"""Tenants on a real server: `python -m bench tenants [--model M] ...` (docs/OPERATIONS.md "Tenants").

Each phase starts its own `python -m server` with a `tenants:` config and drives closed-loop streams, one
tenant key per stream (`/generate`, greedy, output length pinned), for `--duration` seconds:
1. small beside big: `--big` streams of tenant big, `--small` of tenant small (weights 1:1); small's queue
   wait (the server's `timing.queue_s`) against its idle queue wait (small alone), and big's;
2. share: both tenants with `--big` streams: big's share of the tokens generated inside the window;
3. weights 2:1: the same with big at weight 2;
4. overhead: `--overhead-streams` streams spread over 16 tenants, against the same streams from one tenant:
   output throughput ratio. Plus the scheduler's own cost per step (in-process: Scheduler.schedule +
   advance over a saturated batch, one tenant against 16).
Targets (issue 44): small's queue p50 within a step or two of idle; shares 45-55% and 60-73%; 16 tenants'
throughput within 3% of one tenant's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from pathlib import Path

import httpx
import yaml

from bench.lib.client import LoadConfig, LoadRequest, send_one
from bench.lib.prom import metric_sum, scrape
from bench.lib.server import free_port, server_process
from bench.lib.stats import RequestRecord, distribution
from bench.lib.workloads import resolve_model


def key(tenant: str) -> str:
    return f"sk-bench-{tenant}"


async def closed_loop(url: str, streams: dict[str, int], prompt_len: int, max_tokens: int,
                      duration_s: float) -> dict[str, list[RequestRecord]]:  # fmt: skip
    """streams[tenant] closed-loop senders until `duration_s`; records per tenant, of requests that ended
    inside the window (those in flight at its end are cut off and not counted)."""
    cfg = LoadConfig(url, concurrency=sum(streams.values()), timeout_s=600.0)
    out: dict[str, list[RequestRecord]] = {t: [] for t in streams}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(600.0), limits=limits) as client:
        end = time.perf_counter() + duration_s

        async def loop(tenant: str, i: int) -> None:
            n = 0
            while time.perf_counter() < end:
                prompt = f"{tenant} stream {i} request {n}: " + "tell me a story. " * max(1, prompt_len // 5)
                rec = await send_one(client, LoadRequest(prompt, max_tokens, key=key(tenant)), cfg)
                if rec.done_at is not None and rec.done_at <= end:
                    out[tenant].append(rec)
                n += 1

        tasks = [asyncio.create_task(loop(t, i)) for t, n in streams.items() for i in range(n)]
        await asyncio.sleep(duration_s)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return out


def tenants_config(weights: dict[str, float], path: Path) -> Path:
    path.write_text(yaml.safe_dump({"tenants": [{"name": t, "keys": [key(t)], "weight": w} for t, w in weights.items()]}))
    return path


def tokens(records: list[RequestRecord]) -> int:
    return sum(r.num_output_tokens for r in records if r.status == "ok")


def phase(args: argparse.Namespace, weights: dict[str, float], streams: dict[str, int], tmp: Path,
          idle_probe: str | None = None) -> dict:  # fmt: skip
    port = free_port()
    config = tenants_config(weights, tmp / f"tenants-{port}.yaml")
    extra = ["--config", str(config), "--standard-max-queued-requests", "1024", "--interactive-max-queued-requests",
             "1024", "--interactive-max-queued-tokens", "4194304", *args.server_arg]  # fmt: skip
    with server_process(args.model_path, port, args.max_num_seqs, args.dtype, extra, tmp / f"server-{port}.log") as url:
        idle = idle_steps = None
        if idle_probe is not None:
            probe = asyncio.run(closed_loop(url, {idle_probe: 1}, args.prompt_len, args.max_tokens, args.idle_s))
            idle = distribution([r.queue_s for r in probe[idle_probe] if r.queue_s is not None])
            idle_steps = distribution([r.queue_steps for r in probe[idle_probe] if r.queue_steps is not None])
        before = scrape(url)
        got = asyncio.run(closed_loop(url, streams, args.prompt_len, args.max_tokens, args.duration))
        after = scrape(url)
    steps = metric_sum(after, "tokenmill_engine_step_duration_seconds_count") - metric_sum(before, "tokenmill_engine_step_duration_seconds_count")
    step_s = metric_sum(after, "tokenmill_engine_step_duration_seconds_sum") - metric_sum(before, "tokenmill_engine_step_duration_seconds_sum")
    total = sum(tokens(r) for r in got.values())
    print(f"phase {weights} {streams}: " + ", ".join(f"{t} {tokens(r)} tokens" for t, r in got.items()), flush=True)
    return {
        "weights": weights, "streams": streams, "idle_queue_s": idle, "idle_queue_steps": idle_steps,
        "mean_step_s": step_s / steps if steps else None,
        "output_tok_s": total / args.duration,
        "tenants": {t: {"requests": len(r), "tokens": tokens(r), "share": tokens(r) / total if total else None,
                        "queue_s": distribution([x.queue_s for x in r if x.queue_s is not None]),
                        "queue_steps": distribution([x.queue_steps for x in r if x.queue_steps is not None]),
                        "errors": sum(x.status != "ok" for x in r)} for t, r in got.items()},
    }  # fmt: skip


def scheduler_cost(tenants: int, seats: int = 64, steps: int = 2000) -> float:
    """Seconds per schedule() + advance() of a saturated batch (`seats` running, as many waiting), the
    requests spread over `tenants` tenants."""
    from engine.api import FinishReason
    from engine.api.sampling_params import SamplingParams
    from engine.kv.block_manager import BlockManager
    from engine.request import Request
    from engine.sched.scheduler import Scheduler, SchedulerConfig

    sched = Scheduler(SchedulerConfig(seats, 4096), BlockManager(1 << 16, 16, enable_prefix_caching=False))
    serial = iter(range(1 << 30))

    def add() -> None:
        n = next(serial)
        sched.add(Request(f"r{n}", [100 + n % 50] * 32, SamplingParams(max_tokens=32), 1, float(n), frozenset({0}),
                          tenant=f"t{n % tenants}"))  # fmt: skip

    for _ in range(2 * seats):
        add()
    elapsed = 0.0
    for _ in range(steps):
        t0 = time.perf_counter()
        out = sched.schedule()
        sched.advance(out)
        elapsed += time.perf_counter() - t0
        for s in out.scheduled:
            if s.sample:
                s.request.output_token_ids.append(7)
                if s.request.num_output_tokens >= s.request.params.max_tokens:
                    sched.finish(s.request, FinishReason.LENGTH)
                    add()
    return elapsed / steps


def run(args: argparse.Namespace) -> int:
    args.model_path = resolve_model(args.model)
    big, small = args.big, args.small
    report: dict = {"model": args.model, "max_num_seqs": args.max_num_seqs, "duration_s": args.duration,
                    "max_tokens": args.max_tokens, "prompt_len": args.prompt_len}  # fmt: skip
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        report["small_beside_big"] = phase(args, {"big": 1, "small": 1}, {"big": big, "small": small}, tmp, "small")
        report["share_1_1"] = phase(args, {"big": 1, "small": 1}, {"big": big, "small": big}, tmp)
        report["share_2_1"] = phase(args, {"big": 2, "small": 1}, {"big": big, "small": big}, tmp)
        if args.overhead_streams:
            n = args.overhead_streams
            many = {f"t{i}": n // 16 + (i < n % 16) for i in range(16)}
            # alternated rounds (one, sixteen, one, sixteen, ...): a shared machine's drift hits both alike
            rounds = [(phase(args, {"t0": 1}, {"t0": n}, tmp), phase(args, dict.fromkeys(many, 1.0), many, tmp))
                      for _ in range(args.rounds)]  # fmt: skip
            report["overhead_rounds"] = [{"one": a["output_tok_s"], "sixteen": b["output_tok_s"],
                                          "ratio": b["output_tok_s"] / a["output_tok_s"]} for a, b in rounds]  # fmt: skip
            report["one_tenant"], report["sixteen_tenants"] = rounds[-1]
    report["scheduler_s_per_step"] = {"1_tenant": scheduler_cost(1), "16_tenants": scheduler_cost(16)}
    print(format_report(report))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    return 0


def format_report(r: dict) -> str:
    def q(d: dict | None, p: str = "p50") -> str:
        return "-" if not d else f"{d[p] * 1000:.0f} ms"

    def n(d: dict | None, p: str = "p50") -> str:
        return "-" if not d else f"{d[p]:.1f}"

    sb = r["small_beside_big"]
    lines = [f"tenants on {r['model']} (max_num_seqs {r['max_num_seqs']}, {r['duration_s']:.0f} s a phase, "
             f"{r['max_tokens']} tokens a request)",
             f"small beside big: small queue p50 {q(sb['tenants']['small']['queue_s'])} p99 "
             f"{q(sb['tenants']['small']['queue_s'], 'p99')} (idle p50 {q(sb['idle_queue_s'])}, mean step "
             f"{(sb['mean_step_s'] or 0) * 1000:.0f} ms); big queue p50 {q(sb['tenants']['big']['queue_s'])}",
             f"  in engine steps (idle: 1): small p50 {n(sb['tenants']['small']['queue_steps'])} p99 "
             f"{n(sb['tenants']['small']['queue_steps'], 'p99')} (idle p50 {n(sb['idle_queue_steps'])}); big p50 "
             f"{n(sb['tenants']['big']['queue_steps'])}"]  # fmt: skip
    for name in ("share_1_1", "share_2_1"):
        t = r[name]["tenants"]
        lines.append(f"{name}: big {t['big']['share']:.1%} of {t['big']['tokens'] + t['small']['tokens']} tokens")
    for k, o in enumerate(r.get("overhead_rounds", [])):
        lines.append(f"overhead round {k + 1}: 16 tenants {o['sixteen']:.1f} tok/s vs one {o['one']:.1f} tok/s "
                     f"({o['ratio']:.3f}x)")  # fmt: skip
    cost = r["scheduler_s_per_step"]
    lines.append(f"scheduler per step (64 running, 64 waiting): 1 tenant {cost['1_tenant'] * 1e6:.0f} us, "
                 f"16 tenants {cost['16_tenants'] * 1e6:.0f} us")  # fmt: skip
    return "\n".join(lines)


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("tenants", help="fair share and overhead of tenants on a served model",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--model", default="smollm2-135m-instruct", help="a model folder or preset (bench.lib.workloads)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--big", type=int, default=48, help="streams of the big tenant")
    p.add_argument("--small", type=int, default=4, help="streams of the small tenant")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=32, help="about this many prompt tokens")
    p.add_argument("--duration", type=float, default=30.0, help="seconds of each phase")
    p.add_argument("--idle-s", type=float, default=5.0, help="seconds of the idle probe")
    p.add_argument("--overhead-streams", type=int, default=32, help="streams of the overhead phases; 0: skip")
    p.add_argument("--rounds", type=int, default=2, help="alternated one-tenant / 16-tenant rounds")
    p.add_argument("--server-arg", action="append", default=[], help="extra flag for the server (repeatable)")
    p.add_argument("--out", help="write the JSON report here")
    p.set_defaults(func=run)

