"""Replicas behind vllm-router, per routing policy: `python -m bench router [--model M] ...`.

For each policy a fresh fleet (bench/fleet/launcher.py: `--replicas` tokenmill processes, one engine thread each
unless --engine-threads says otherwise, and vllm-router in front) runs the same multi-tenant
shared-prefix workload: `--tenants` system prompts of about `--system-tokens` tokens, `--users` users
(user u belongs to tenant u % tenants), each asking `--questions` short questions, in a seeded shuffled
order, as streamed chat completions at `--concurrency` in flight (closed loop). Reported per policy:

- the prefix-cache hit rate of each replica and of the fleet: the deltas of `vllm:prefix_cache_hits`
  over `vllm:prefix_cache_queries` on each replica's /metrics (prompt tokens found / looked up);
- the requests each replica finished (`vllm:request_success_total`);
- TTFT p50/p99 (request sent -> first content chunk), request and output-token throughput.

Policies: `round_robin`, `cache_aware` (the router's own prefix tree per worker), `kv_aware` (the
workers' KV-cache events; only when this checkout's server has --kv-events-config), and `single`
(one replica, no router: the reference hit rate). Each run starts with empty caches.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from bench.fleet.launcher import Fleet, FleetConfig, router_binary
from bench.lib import prom
from bench.lib.machine import cpu_model
from bench.lib.prom import metric_sum
from bench.lib.server import REPO_ROOT, free_port
from bench.lib.stats import percentile
from bench.lib.workloads import DEFAULT_MODEL, resolve_model

POLICY_CHOICES = ("single", "round_robin", "cache_aware", "kv_aware")
_WORDS = ("account billing order refund invoice shipping delivery product warranty return policy customer "
          "support ticket priority status update payment card address change cancel subscription plan "
          "upgrade downgrade discount coupon price tax region store hours contact email phone manager "
          "escalate resolve issue error login password reset security privacy data export report weekly "
          "monthly annual summary detail item quantity stock supplier partner contract renewal term").split()


@dataclass(frozen=True)
class Workload:
    systems: tuple[str, ...]  # one system prompt per tenant
    requests: tuple[tuple[int, str], ...]  # (tenant, question), in sending order

    def messages(self, i: int) -> list[dict[str, str]]:
        tenant, question = self.requests[i]
        return [{"role": "system", "content": self.systems[tenant]}, {"role": "user", "content": question}]


def build_workload(tenants: int, system_words: int, users: int, questions: int, seed: int) -> Workload:
    """Seeded text: tenant t's system prompt is `system_words` words after a line naming the tenant
    (so prompts differ from their first tokens); each question is a short line of its own."""
    rng = random.Random(seed)
    systems = tuple(f"You are the support assistant of company number {t}. Follow these rules.\n"
                    + " ".join(rng.choice(_WORDS) for _ in range(system_words)) for t in range(tenants))  # fmt: skip
    reqs = [(u % tenants, f"User {u}, question {q}: " + " ".join(rng.choice(_WORDS) for _ in range(6)) + "?")
            for u in range(users) for q in range(questions)]  # fmt: skip
    rng.shuffle(reqs)
    return Workload(systems, tuple(reqs))


def words_for_tokens(url: str, model: str, tokens: int, seed: int) -> tuple[int, int]:
    """How many words make a system prompt of about `tokens` tokens (asked of a server's /tokenize),
    and the token count it gives."""
    words = tokens
    for _ in range(3):
        text = build_workload(1, words, 1, 1, seed).systems[0]
        got = httpx.post(f"{url}/tokenize", json={"model": model, "prompt": text}, timeout=60).json()["count"]
        words = max(1, round(words * tokens / got))
    text = build_workload(1, words, 1, 1, seed).systems[0]
    got = httpx.post(f"{url}/tokenize", json={"model": model, "prompt": text}, timeout=60).json()["count"]
    return words, got


def scrape(url: str) -> dict[str, float]:
    """The counters this benchmark reads from one replica's /metrics (summed over labels)."""
    text = prom.scrape(url)
    names = ("vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total", "vllm:request_success_total")
    return {name: metric_sum(text, name) for name in names}


async def _one(client: httpx.AsyncClient, url: str, model: str, messages: list[dict[str, str]],
               max_tokens: int) -> dict[str, Any]:  # fmt: skip
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    sent = time.monotonic()
    first: float | None = None
    tokens = 0
    try:
        async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                return {"ok": False, "error": f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"}
            async for line in r.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                if first is None and any(c.get("delta", {}).get("content") for c in chunk.get("choices", [])):
                    first = time.monotonic()
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
    except httpx.HTTPError as exc:
        return {"ok": False, "error": repr(exc)}
    done = time.monotonic()
    return {"ok": first is not None, "ttft": None if first is None else first - sent, "e2e": done - sent,
            "tokens": tokens, "error": "" if first is not None else "no content"}  # fmt: skip


async def drive(url: str, model: str, work: Workload, concurrency: int, max_tokens: int) -> tuple[list[dict], float]:
    """Every request of `work` through `url`, `concurrency` in flight; (results, wall seconds)."""
    queue = list(range(len(work.requests)))
    results: list[dict] = [{} for _ in queue]

    async def worker(client: httpx.AsyncClient) -> None:
        while queue:
            i = queue.pop(0)
            results[i] = await _one(client, url, model, work.messages(i), max_tokens)

    t0 = time.monotonic()
    async with httpx.AsyncClient(timeout=httpx.Timeout(600, connect=10)) as client:
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
    return results, time.monotonic() - t0


def kv_events_available() -> bool:
    """Whether this checkout's server takes --kv-events-config (the KV-cache events publisher)."""
    out = subprocess.run([sys.executable, "-m", "server", "serve", "--help"], cwd=REPO_ROOT, capture_output=True,
                         text=True, timeout=120).stdout  # fmt: skip
    return "--kv-events-config" in out


def kv_events_wiring(replicas: int) -> tuple[dict[int, list[str]], list[str]]:
    """Per replica its --kv-events-config (vLLM's JSON: a ZMQ PUB socket bound on a free port: vLLM binds
    an endpoint with `*`), and the endpoints the router connects to (its --kv-event-source
    WORKER_URL=ENDPOINT, which Fleet adds once the URLs are known)."""
    ports = [free_port() for _ in range(replicas)]
    per = {i: ["--kv-events-config", json.dumps({"enable_kv_cache_events": True, "publisher": "zmq",
                                                  "endpoint": f"tcp://*:{p}"})]  # fmt: skip
           for i, p in enumerate(ports)}
    return per, [f"tcp://127.0.0.1:{p}" for p in ports]


def run_policy(policy: str, args: argparse.Namespace, model: str, work: Workload, log_dir: Path) -> dict[str, Any]:
    replica_args = ["--device", "cpu", "--engine-threads", str(args.engine_threads), "--log-level", "warning",
                    "--max-num-seqs", str(args.max_num_seqs), "--block-size", str(args.block_size),
                    *(["--kv-cache-memory", args.kv_cache_memory] if args.kv_cache_memory else [])]  # fmt: skip
    per: dict[int, list[str]] = {}
    endpoints: list[str] = []
    router_args: list[str] = []
    if policy == "kv_aware":
        per, endpoints = kv_events_wiring(args.replicas)
        # the router tokenizes each request itself (the model folder's tokenizer) and hashes its blocks
        router_args = ["--kv-event-block-size", str(args.block_size), "--kv-event-model", model]
    cfg = FleetConfig(model=model, replicas=1 if policy == "single" else args.replicas,
                      policy="round_robin" if policy == "single" else policy, replica_args=replica_args,
                      router_args=router_args, log_dir=log_dir / policy, per_replica_args=per,
                      kv_event_endpoints=endpoints)  # fmt: skip
    with Fleet(cfg) as fleet:
        urls = [r.url for r in fleet.replicas]
        before = [scrape(u) for u in urls]
        target = urls[0] if policy == "single" else fleet.url
        results, wall = asyncio.run(drive(target, args.served_name or Path(model).name, work, args.concurrency,
                                          args.max_tokens))  # fmt: skip
        after = [scrape(u) for u in urls]
    per_replica = []
    for u, b, a in zip(urls, before, after, strict=True):
        hits = a["vllm:prefix_cache_hits_total"] - b["vllm:prefix_cache_hits_total"]
        queries = a["vllm:prefix_cache_queries_total"] - b["vllm:prefix_cache_queries_total"]
        per_replica.append({"url": u, "requests": a["vllm:request_success_total"] - b["vllm:request_success_total"],
                            "prefix_hit_tokens": hits, "prefix_query_tokens": queries,
                            "hit_rate": round(hits / queries, 4) if queries else None})  # fmt: skip
    hits = sum(r["prefix_hit_tokens"] for r in per_replica)
    queries = sum(r["prefix_query_tokens"] for r in per_replica)
    ok = [r for r in results if r.get("ok")]
    ttfts = [r["ttft"] for r in ok]
    return {"policy": policy, "replicas": len(urls), "requests": len(results), "ok": len(ok),
            "errors": sorted({r.get("error", "") for r in results if not r.get("ok")})[:5],
            "hit_rate": round(hits / queries, 4) if queries else None, "per_replica": per_replica,
            "ttft_p50_s": round(percentile(ttfts, 50), 4) if ttfts else None,
            "ttft_p99_s": round(percentile(ttfts, 99), 4) if ttfts else None,
            "requests_per_s": round(len(ok) / wall, 3), "output_tokens_per_s": round(sum(r["tokens"] for r in ok) / wall, 2),
            "wall_s": round(wall, 2)}  # fmt: skip


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| policy | replicas | hit rate (fleet) | hit rate per replica | requests per replica | TTFT p50 | "
             "TTFT p99 | req/s | out tok/s |", "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        per = " / ".join("-" if p["hit_rate"] is None else f"{p['hit_rate']:.3f}" for p in r["per_replica"])
        reqs = " / ".join(f"{p['requests']:.0f}" for p in r["per_replica"])
        lines.append(f"| {r['policy']} | {r['replicas']} | {r['hit_rate']} | {per} | {reqs} | {r['ttft_p50_s']} s | "
                     f"{r['ttft_p99_s']} s | {r['requests_per_s']} | {r['output_tokens_per_s']} |")  # fmt: skip
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    if router_binary() is None:
        print("bench router: vllm-router is not installed (pip install -e '.[router]')", file=sys.stderr)
        return 2
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    bad = [p for p in policies if p not in POLICY_CHOICES]
    if bad:
        print(f"bench router: --policies: {', '.join(bad)} not in {', '.join(POLICY_CHOICES)}", file=sys.stderr)
        return 2
    if "kv_aware" in policies and not kv_events_available():
        print("bench router: kv_aware skipped: this server has no --kv-events-config", file=sys.stderr)
        policies.remove("kv_aware")
    model = str(resolve_model(args.model))
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    with Fleet(FleetConfig(model=model, replicas=1, policy="round_robin", log_dir=out_dir / "sizing",
                           replica_args=["--device", "cpu", "--log-level", "warning"])) as sizing:  # fmt: skip
        words, system_tokens = words_for_tokens(sizing.replicas[0].url, args.served_name or Path(model).name,
                                                args.system_tokens, args.seed)  # fmt: skip
    work = build_workload(args.tenants, words, args.users, args.questions, args.seed)
    rows = [run_policy(p, args, model, work, out_dir) for p in policies]
    report = {"command": getattr(args, "command_line", None), "model": model, "cpu": cpu_model(),
              "workload": {"tenants": args.tenants, "system_prompt_tokens": system_tokens, "users": args.users,
                           "questions_per_user": args.questions, "requests": len(work.requests),
                           "max_tokens": args.max_tokens, "concurrency": args.concurrency},
              "results": rows}  # fmt: skip
    (out_dir / "router.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))
    print(table(rows))
    return 0 if all(r["ok"] == r["requests"] for r in rows) else 1


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("router", help="replicas behind vllm-router: prefix hit rate, TTFT, throughput per policy",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--model", default=DEFAULT_MODEL, help="model folder, a make_model preset, or " + DEFAULT_MODEL)
    p.add_argument("--served-name", default=None, help="the model's served name (default: its folder's name)")
    p.add_argument("--policies", default="single,round_robin,cache_aware,kv_aware",
                   help=f"comma-separated, of {', '.join(POLICY_CHOICES)}")  # fmt: skip
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--engine-threads", type=int, default=1, help="each replica's engine threads")
    p.add_argument("--tenants", type=int, default=8, help="system prompts")
    p.add_argument("--system-tokens", type=int, default=1000, help="tokens per system prompt (about)")
    p.add_argument("--users", type=int, default=64)
    p.add_argument("--questions", type=int, default=2, help="questions per user")
    p.add_argument("--max-tokens", type=int, default=8, help="tokens per answer (EOS ignored)")
    p.add_argument("--concurrency", type=int, default=8, help="requests in flight")
    p.add_argument("--max-num-seqs", type=int, default=8, help="each replica's max_num_seqs")
    p.add_argument("--kv-cache-memory", default=None, help="each replica's KV budget (e.g. 256MiB); default: the server's")
    p.add_argument("--block-size", type=int, default=32,
                   help="each replica's KV block size (the CPU default), which kv_aware's router is told too")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-dir", default="bench-results/router", help="router.json and the processes' logs")
    p.set_defaults(func=run)
