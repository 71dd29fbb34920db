"""What structured outputs cost, against a running server: `python -m bench structured --base-url URL`.

1. Throughput at --concurrency (closed loop) over /v1/chat/completions, rounds alternating between
   `plain` (unconstrained, ignore_eos) and `json` (a JSON schema whose shortest output is longer than
   --output-len), so every request of both arms generates exactly --output-len tokens from the same
   prompt: the difference is the masks (bitmask fill, apply, matcher advance) and the request path.
   Reported: output tokens/s per round, the medians per arm, the cost 1 - json / plain (target < 10%)
   and the median of the paired rounds' costs (each json round against the plain round before it).
2. TTFT, one request at a time, streamed: `plain`, `cached` (the same schema each time: the compile
   cache answers) and `cold` (a schema never seen, so its compile is on the request's path). Reported:
   medians, and cold - cached (TTFT added by compilation) and cached - plain (the first masked step).

The machine's other load distorts both (see docs/benchmarks/log.md): rounds alternate arms so drift hits
both, and the report records the load average before and after.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
import uuid
from pathlib import Path
from typing import Any

import httpx

from bench.lib.client import served_model_name

PROMPT = "List the players of a football team with their positions and ages."


def long_schema(tag: str = "") -> dict[str, Any]:
    """An array of 16 player objects: its shortest valid text is well over 100 tokens. `tag` makes the
    schema new to the compile cache (property names change)."""
    player = {
        "type": "object",
        "properties": {
            f"name{tag}": {"type": "string", "maxLength": 24},
            f"position{tag}": {"type": "string", "enum": ["goalkeeper", "defender", "midfielder", "forward"]},
            f"age{tag}": {"type": "integer", "minimum": 16, "maximum": 45},
            f"captain{tag}": {"type": "boolean"},
        },
        "required": [f"name{tag}", f"position{tag}", f"age{tag}", f"captain{tag}"],
        "additionalProperties": False,
    }
    return {"type": "array", "items": player, "minItems": 16, "maxItems": 16}


def chat_body(model: str, max_tokens: int, schema: dict[str, Any] | None, stream: bool) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "messages": [{"role": "user", "content": PROMPT}], "temperature": 0,
                            "max_tokens": max_tokens, "ignore_eos": True, "stream": stream}  # fmt: skip
    if stream:
        body["stream_options"] = {"include_usage": True}
    if schema is not None:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "team", "schema": schema}}
    return body


async def timed_stream(client: httpx.AsyncClient, body: dict[str, Any]) -> tuple[float, int]:
    """(seconds to the first content token, completion tokens) of one streamed chat request."""
    started = time.perf_counter()
    first, tokens = None, 0
    async with client.stream("POST", "/v1/chat/completions", json=body) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"HTTP {resp.status_code}: {(await resp.aread())[:300]!r}")
        async for line in resp.aiter_lines():
            if not line.startswith("data: {"):
                continue
            data = json.loads(line[6:])
            if data.get("usage"):
                tokens = data["usage"]["completion_tokens"]
            choices = data.get("choices") or []
            if first is None and choices and choices[0]["delta"].get("content"):
                first = time.perf_counter() - started
    if first is None:
        raise RuntimeError("no content token came back")
    return first, tokens


async def throughput_round(client: httpx.AsyncClient, bodies: list[dict[str, Any]], concurrency: int) -> dict:
    """Send `bodies` `concurrency` at a time (closed loop); output tokens per second of the round."""
    queue = list(bodies)
    tokens: list[int] = []

    async def worker() -> None:
        while queue:
            body = queue.pop()
            tokens.append((await timed_stream(client, body))[1])

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    elapsed = time.perf_counter() - started
    return {"requests": len(tokens), "output_tokens": sum(tokens), "seconds": round(elapsed, 3),
            "tokens_per_s": round(sum(tokens) / elapsed, 2), "min_tokens": min(tokens)}  # fmt: skip


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    model = served_model_name(args.base_url) or "default"
    limits = httpx.Limits(max_connections=args.concurrency + 4)
    async with httpx.AsyncClient(base_url=args.base_url, timeout=args.timeout, limits=limits) as client:
        schema = long_schema()
        for warm in (None, schema):  # the compile and the prompt's KV out of the way
            await timed_stream(client, chat_body(model, 4, warm, True))
        rounds: dict[str, list[dict]] = {"plain": [], "json": []}
        for _ in range(args.rounds):
            for arm, arm_schema in (("plain", None), ("json", schema)):
                bodies = [chat_body(model, args.output_len, arm_schema, True) for _ in range(args.requests)]
                rounds[arm].append(await throughput_round(client, bodies, args.concurrency))
        ttft: dict[str, list[float]] = {"plain": [], "cached": [], "cold": []}
        for _ in range(args.ttft_requests):
            for arm, arm_schema in (("plain", None), ("cached", schema), ("cold", long_schema(uuid.uuid4().hex[:8]))):
                ttft[arm].append((await timed_stream(client, chat_body(model, 2, arm_schema, True)))[0])
    return {"model": model, "rounds": rounds, "ttft_s": ttft}


def summarize(raw: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    tps = {arm: statistics.median(r["tokens_per_s"] for r in rounds) for arm, rounds in raw["rounds"].items()}
    ttft = {arm: statistics.median(v) for arm, v in raw["ttft_s"].items()}
    pinned = all(r["min_tokens"] == args.output_len for rounds in raw["rounds"].values() for r in rounds)
    return {
        **raw,
        "concurrency": args.concurrency,
        "output_len": args.output_len,
        "every_request_full_length": pinned,
        "median_tokens_per_s": tps,
        "throughput_cost": round(1 - tps["json"] / tps["plain"], 4),
        # Each json round against the plain round just before it: drift between rounds cancels.
        "paired_cost_median": round(statistics.median(
            1 - j["tokens_per_s"] / p["tokens_per_s"] for p, j in zip(raw["rounds"]["plain"], raw["rounds"]["json"],
                                                                      strict=True)), 4),  # fmt: skip
        "throughput_target_met": 1 - tps["json"] / tps["plain"] < 0.10,
        "median_ttft_s": {k: round(v, 4) for k, v in ttft.items()},
        "ttft_added_by_compile_s": round(ttft["cold"] - ttft["cached"], 4),
        "ttft_added_by_masks_s": round(ttft["cached"] - ttft["plain"], 4),
    }


def format_report(r: dict[str, Any]) -> str:
    tps, ttft = r["median_tokens_per_s"], r["median_ttft_s"]
    lines = [f"model {r['model']}, c{r['concurrency']}, {r['output_len']} output tokens per request "
             f"(all full length: {r['every_request_full_length']})"]  # fmt: skip
    for arm, rounds in r["rounds"].items():
        lines.append(f"  {arm:6} tok/s per round: {', '.join(str(x['tokens_per_s']) for x in rounds)}  "
                     f"median {tps[arm]:.1f}")  # fmt: skip
    met = "met" if r["throughput_target_met"] else "MISSED"
    lines.append(f"throughput cost of the JSON schema: {100 * r['throughput_cost']:.1f}% ({met}, target < 10%); "
                 f"median of paired rounds {100 * r['paired_cost_median']:.1f}%")  # fmt: skip
    lines.append(f"TTFT median: plain {1000 * ttft['plain']:.1f} ms, cached schema {1000 * ttft['cached']:.1f} ms, "
                 f"new schema {1000 * ttft['cold']:.1f} ms")  # fmt: skip
    lines.append(f"  added by compiling: {1000 * r['ttft_added_by_compile_s']:.1f} ms; by the first masked step: "
                 f"{1000 * r['ttft_added_by_masks_s']:.1f} ms")  # fmt: skip
    if r.get("load_average") is not None:
        lines.append(f"1-minute load average before / after: {r['load_average'][0]:.2f} / {r['load_average'][1]:.2f}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    before = os.getloadavg()[0]
    raw = asyncio.run(measure(args))
    report = summarize(raw, args)
    report["load_average"] = [round(before, 2), round(os.getloadavg()[0], 2)]
    report["command"] = getattr(args, "command_line", None)
    print(format_report(report))
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2))
    return 0


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("structured", help="throughput and TTFT cost of structured outputs",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--requests", type=int, default=32, help="requests per throughput round (default: 32)")
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3, help="rounds per arm, alternating (default: 3)")
    p.add_argument("--ttft-requests", type=int, default=10, help="TTFT samples per arm (default: 10)")
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--json", type=Path, default=None)
    p.set_defaults(func=run)
