"""The HTTP load client the served benchmarks share: streams each request over `/generate` (SSE) or
`/v1/completions`, times every token event as it arrives, and sends a list of requests at a fixed
concurrency (closed loop: a new request as soon as one ends) and/or with Poisson arrivals. A 429 counts
as a finished request of status `rejected`; it is not retried. Statistics and their definitions:
bench/lib/stats.py. `python -m bench load` is the command over it (bench/served/load.py).
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import httpx

from bench.lib.machine import cpu_sample, other_cores
from bench.lib.stats import RequestRecord, Slo, summarize
from bench.lib.streams import SseDecoder, parse_generate_event, parse_openai_event

ENDPOINTS = {"generate": "/generate", "completions": "/v1/completions"}
LANES = ("interactive", "standard", "batch")


@dataclass(frozen=True)
class LoadRequest:
    """One request to send."""

    prompt: str | tuple[int, ...]  # text, or token ids
    max_tokens: int
    lane: str | None = None  # priority; None: the server picks the lane
    key: str | None = None  # sent as `Authorization: Bearer KEY` (a tenant's key); None: no header


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
    headers = {"Authorization": f"Bearer {req.key}"} if req.key else None
    async with client.stream("POST", ENDPOINTS[cfg.endpoint], json=request_body(req, cfg), headers=headers) as resp:
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
                if upd.queue_steps is not None:
                    rec.queue_steps = upd.queue_steps
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


# ---- a measured point ----------------------------------------------------------------------------


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
