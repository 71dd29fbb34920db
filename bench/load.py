"""HTTP load test against a running server: `python -m bench load --base-url URL ...`.

An asyncio client streams every request over `/generate` (SSE) or `/v1/completions` and times each
token event as it arrives. Arrivals: a fixed concurrency (closed loop: a new request as soon as one
ends) and/or Poisson arrivals at --request-rate (a concurrency limit then caps requests in flight).
Prompts: seeded synthetic prompts of exactly --prompt-len tokens from the model's tokenizer (sent as
token ids), or a JSONL file of {"prompt": text} / {"prompt_token_ids": [...]} lines with an optional
"max_tokens". A 429 counts as a finished request of status `rejected`; it is not retried.
Statistics and their definitions: bench/stats.py (and docs/BENCHMARKS.md).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

from bench.machine import cpu_sample, other_cores
from bench.stats import RequestRecord, Slo, summarize
from bench.streams import SseDecoder, parse_generate_event, parse_openai_event
from bench.workloads import DEFAULT_MODEL, resolve_model

ENDPOINTS = {"generate": "/generate", "completions": "/v1/completions"}
LANES = ("interactive", "standard", "batch")


@dataclass(frozen=True)
class LoadRequest:
    """One request to send."""

    prompt: str | tuple[int, ...]  # text, or token ids
    max_tokens: int
    lane: str | None = None  # priority; None: the server picks the lane


@dataclass(frozen=True)
class LoadConfig:
    """How to send the requests."""

    base_url: str
    endpoint: str = "generate"  # a key of ENDPOINTS
    concurrency: int | None = None  # most requests in flight; None: no limit
    request_rate: float = math.inf  # Poisson arrivals per second; inf: all at once
    ignore_eos: bool = True
    timeout_s: float = 600.0  # per request, client side
    seed: int = 0  # arrival times
    model_name: str | None = None  # the OpenAI `model` field

    def __post_init__(self) -> None:
        if self.endpoint not in ENDPOINTS:
            raise ValueError(f"endpoint must be one of {', '.join(ENDPOINTS)}, got {self.endpoint!r}")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {self.concurrency}")
        if not self.request_rate > 0:
            raise ValueError(f"request_rate must be positive, got {self.request_rate}")
        if math.isinf(self.request_rate) and self.concurrency is None:
            raise ValueError("give a concurrency, a finite request_rate, or both")


def request_body(req: LoadRequest, cfg: LoadConfig) -> dict:
    """The JSON body of one streaming request (greedy decoding, output length pinned by ignore_eos)."""
    body: dict = {"max_tokens": req.max_tokens, "stream": True, "temperature": 0.0, "ignore_eos": cfg.ignore_eos}
    if req.lane is not None:
        body["priority"] = req.lane
    if cfg.endpoint == "generate":
        body["prompt" if isinstance(req.prompt, str) else "prompt_token_ids"] = (
            req.prompt if isinstance(req.prompt, str) else list(req.prompt))
    else:
        body["model"] = cfg.model_name or "default"
        body["prompt"] = req.prompt if isinstance(req.prompt, str) else list(req.prompt)
        body["stream_options"] = {"include_usage": True}
    return body


# Error types the server streams when a deadline passed (server/serving/ticket.py kinds).
SERVER_TIMEOUT_ERRORS = ("queue_timeout:",)


async def send_one(client: httpx.AsyncClient, req: LoadRequest, cfg: LoadConfig) -> RequestRecord:
    """Send one request and record what came back; never raises for HTTP or stream failures."""
    prompt_len = 0 if isinstance(req.prompt, str) else len(req.prompt)
    rec = RequestRecord(sent_at=time.perf_counter(), prompt_tokens=prompt_len, lane=req.lane)
    try:
        await asyncio.wait_for(_stream(client, req, cfg, rec), cfg.timeout_s)
    except (asyncio.TimeoutError, httpx.TimeoutException):
        rec.status, rec.error = "timeout", "client timeout"
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        rec.status, rec.error = "error", f"{type(exc).__name__}: {exc}"
    if rec.done_at is None:
        rec.done_at = time.perf_counter()
    return rec


async def _stream(client: httpx.AsyncClient, req: LoadRequest, cfg: LoadConfig, rec: RequestRecord) -> None:
    parse = parse_generate_event if cfg.endpoint == "generate" else parse_openai_event
    async with client.stream("POST", ENDPOINTS[cfg.endpoint], json=request_body(req, cfg)) as resp:
        if resp.status_code != 200:
            text = (await resp.aread()).decode("utf-8", "replace")[:200]
            rec.done_at = time.perf_counter()
            rec.status = "rejected" if resp.status_code == 429 else "error"
            rec.error = f"HTTP {resp.status_code}: {text}"
            return
        decoder, finished = SseDecoder(), False
        async for chunk in resp.aiter_bytes():
            now = time.perf_counter()
            for event in decoder.feed(chunk):
                upd = parse(event)
                rec.token_times.extend([now] * upd.tokens)
                if upd.output_tokens is not None:
                    rec.output_tokens = upd.output_tokens
                if upd.prompt_tokens is not None:
                    rec.prompt_tokens = upd.prompt_tokens
                if upd.cached_tokens is not None:
                    rec.cached_tokens = upd.cached_tokens
                if upd.queue_s is not None:
                    rec.queue_s = upd.queue_s
                if upd.preemptions is not None:
                    rec.preemptions = upd.preemptions
                if upd.error is not None:
                    # A server deadline (the request waited too long in its lane) is a timeout too.
                    timed_out = upd.error.startswith(SERVER_TIMEOUT_ERRORS)
                    rec.status, rec.error = ("timeout" if timed_out else "error"), upd.error
                elif upd.finish_reason == "timeout":
                    rec.status, rec.error = "timeout", "server deadline"
                finished = finished or upd.finished
        rec.done_at = time.perf_counter()
        if not finished and rec.status == "ok":
            rec.status, rec.error = "error", "stream ended without its end event"


async def run_load(requests: Sequence[LoadRequest], cfg: LoadConfig,
                   on_done: Callable[[RequestRecord], None] | None = None) -> tuple[list[RequestRecord], float]:
    """Send `requests` in order (Poisson gaps when the rate is finite, at most `concurrency` in flight).
    Returns the records in request order and the duration: first send to last response end."""
    rng = random.Random(cfg.seed)
    limit = asyncio.Semaphore(cfg.concurrency) if cfg.concurrency else None
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=cfg.base_url, timeout=httpx.Timeout(cfg.timeout_s), limits=limits) as client:

        async def one(req: LoadRequest) -> RequestRecord:
            if limit is not None:
                async with limit:
                    rec = await send_one(client, req, cfg)
            else:
                rec = await send_one(client, req, cfg)
            if on_done is not None:
                on_done(rec)
            return rec

        start = time.perf_counter()
        tasks = []
        for i, req in enumerate(requests):
            if i and not math.isinf(cfg.request_rate):
                await asyncio.sleep(rng.expovariate(cfg.request_rate))
            tasks.append(asyncio.create_task(one(req)))
        records = list(await asyncio.gather(*tasks))
    end = max((r.done_at for r in records if r.done_at is not None), default=start)
    return records, max(end - start, 1e-9)


async def warm_up(cfg: LoadConfig, requests: Sequence[LoadRequest]) -> None:
    """Send `requests` one at a time, untimed (first-request costs stay out of the numbers)."""
    async with httpx.AsyncClient(base_url=cfg.base_url, timeout=httpx.Timeout(cfg.timeout_s)) as client:
        for req in requests:
            await send_one(client, req, cfg)


def warmup_request(req: LoadRequest) -> LoadRequest:
    """A short request like `req` whose prompt shares no prefix with it (a warm-up must not fill the
    server's prefix cache with the first timed prompt)."""
    prompt = "warm-up. " + req.prompt if isinstance(req.prompt, str) else tuple(reversed(req.prompt))
    if prompt == req.prompt:  # a palindrome of ids
        prompt = prompt[1:] + prompt[:1]
    return LoadRequest(prompt, min(req.max_tokens, 4), req.lane)


def served_model_name(base_url: str) -> str | None:
    """The first model `/v1/models` lists, or None."""
    try:
        data = httpx.get(f"{base_url}/v1/models", timeout=10).json()["data"]
        return data[0]["id"] if data else None
    except (httpx.HTTPError, KeyError, IndexError, ValueError):
        return None


# ---- prompts --------------------------------------------------------------------------------------


def synthetic_requests(tokenizer_path: str, num: int, prompt_len: int, output_len: int, seed: int) -> list[LoadRequest]:
    """`num` seeded prompts of exactly `prompt_len` ordinary tokens of the model's vocabulary."""
    from transformers import AutoConfig, AutoTokenizer

    from bench.workloads import fixed_workload, ordinary_token_ids

    vocab = ordinary_token_ids(AutoTokenizer.from_pretrained(tokenizer_path),
                               AutoConfig.from_pretrained(tokenizer_path).vocab_size)
    wl = fixed_workload(vocab, num, prompt_len, output_len, seed)
    return [LoadRequest(r.prompt_token_ids, r.output_len) for r in wl.requests]


def jsonl_requests(path: Path, num: int | None, output_len: int) -> list[LoadRequest]:
    """Requests from a JSONL file, cycled to `num` (None: each line once)."""
    reqs = []
    for lineno, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        obj = json.loads(line)
        if "prompt_token_ids" in obj:
            prompt: str | tuple[int, ...] = tuple(int(t) for t in obj["prompt_token_ids"])
        elif isinstance(obj.get("prompt"), str):
            prompt = obj["prompt"]
        else:
            raise ValueError(f"{path}:{lineno}: needs a string 'prompt' or a list 'prompt_token_ids'")
        reqs.append(LoadRequest(prompt, int(obj.get("max_tokens", output_len))))
    if not reqs:
        raise ValueError(f"{path}: no prompts")
    n = num or len(reqs)
    return [reqs[i % len(reqs)] for i in range(n)]


def parse_priority_mix(text: str | None) -> dict[str, float] | None:
    """"interactive=3,batch=1" -> lane weights (None for None/empty)."""
    if not text:
        return None
    mix = {}
    for part in text.split(","):
        lane, _, weight = part.partition("=")
        lane = lane.strip()
        if lane not in LANES:
            raise ValueError(f"priority mix: unknown lane {lane!r} (choose from {', '.join(LANES)})")
        mix[lane] = float(weight) if weight else 1.0
        if mix[lane] < 0:
            raise ValueError(f"priority mix: negative weight for {lane}")
    if sum(mix.values()) <= 0:
        raise ValueError("priority mix: the weights sum to zero")
    return mix


def assign_lanes(requests: Sequence[LoadRequest], mix: dict[str, float] | None, seed: int) -> list[LoadRequest]:
    """Each request gets a lane drawn from `mix` (seeded); unchanged without a mix."""
    if not mix:
        return list(requests)
    rng = random.Random(seed + 1)
    lanes, weights = list(mix), list(mix.values())
    return [LoadRequest(r.prompt, r.max_tokens, rng.choices(lanes, weights)[0]) for r in requests]


# ---- report ---------------------------------------------------------------------------------------


def run_point(requests: Sequence[LoadRequest], cfg: LoadConfig, slo: Slo | None, warmup: int = 1,
              progress: bool = True) -> dict:
    """Warm up, run the load, and return the report (summary, per-lane summaries, CPU noise)."""
    from tqdm import tqdm

    if warmup:
        asyncio.run(warm_up(cfg, [warmup_request(requests[0])] * warmup))
    bar = tqdm(total=len(requests), desc=f"load c={cfg.concurrency or '-'}", unit="req", file=sys.stderr,
               disable=not progress, leave=False)
    before = cpu_sample()
    records, duration = asyncio.run(run_load(requests, cfg, on_done=lambda _r: bar.update(1)))
    busy = other_cores(before, cpu_sample())
    bar.close()
    report = summarize(records, duration, slo)
    lanes = sorted({r.lane for r in records if r.lane is not None})
    if lanes:
        report["lanes"] = {lane: summarize([r for r in records if r.lane == lane], duration, slo) for lane in lanes}
    report["errors"] = sorted({r.error for r in records if r.error})[:10]
    report["client_other_cores"] = busy  # cores busy outside this client process (server included)
    return report


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


# ---- entry point ----------------------------------------------------------------------------------


def add_common_arguments(p: argparse.ArgumentParser) -> None:
    """Options `load` and `sweep` share: target, prompts, SLOs."""
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="server URL (default: %(default)s)")
    p.add_argument("--endpoint", choices=tuple(ENDPOINTS), default="generate",
                   help="generate: /generate SSE; completions: /v1/completions streaming (default: generate)")
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help="tokenizer for synthetic prompts: a model folder, smollm2-135m-instruct or a make_model preset "
                        "(default: %(default)s)")
    p.add_argument("--served-model-name", default=None, help="OpenAI `model` field (default: from /v1/models)")
    p.add_argument("--dataset", type=Path, default=None, help="JSONL prompts instead of synthetic ones")
    p.add_argument("--prompt-len", type=int, default=128, help="synthetic prompt tokens (default: 128)")
    p.add_argument("--output-len", type=int, default=128, help="max_tokens per request (default: 128)")
    p.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                   help="let requests stop at EOS (default: ignore_eos pins the output length)")
    p.add_argument("--priority-mix", default=None, metavar="LANE=W,...",
                   help="send each request with a priority drawn from these weights, e.g. interactive=3,batch=1")
    p.add_argument("--request-rate", type=float, default=math.inf, help="Poisson arrivals per second (default: inf)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0, help="client timeout per request, seconds")
    p.add_argument("--warmup", type=int, default=1, help="untimed short requests first (default: 1)")
    p.add_argument("--slo-ttft-ms", type=float, default=1000.0, help="goodput SLO on TTFT (default: 1000)")
    p.add_argument("--slo-tpot-ms", type=float, default=100.0, help="goodput SLO on TPOT (default: 100)")
    p.add_argument("--slo-e2e-ms", type=float, default=None, help="goodput SLO on end-to-end latency (default: none)")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")


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


def make_slo(args: argparse.Namespace) -> Slo:
    ms = lambda v: None if v is None else v / 1000  # noqa: E731
    return Slo(ttft=ms(args.slo_ttft_ms), tpot=ms(args.slo_tpot_ms), e2e=ms(args.slo_e2e_ms))


def build_requests(args: argparse.Namespace, num: int | None) -> list[LoadRequest]:
    """The run's requests: the dataset or synthetic prompts, with the priority mix applied."""
    if args.dataset is not None:
        reqs = jsonl_requests(args.dataset, num, args.output_len)
    else:
        reqs = synthetic_requests(str(resolve_model(args.model)), num or 8, args.prompt_len, args.output_len,
                                  args.seed)
    return assign_lanes(reqs, parse_priority_mix(args.priority_mix), args.seed)


def make_config(args: argparse.Namespace, base_url: str, concurrency: int | None) -> LoadConfig:
    name = args.served_model_name
    if args.endpoint == "completions" and name is None:
        name = served_model_name(base_url)
    try:
        return LoadConfig(base_url=base_url, endpoint=args.endpoint, concurrency=concurrency,
                          request_rate=args.request_rate, ignore_eos=args.ignore_eos, timeout_s=args.timeout,
                          seed=args.seed, model_name=name)
    except ValueError as exc:
        raise SystemExit(f"load: {exc}") from None


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
