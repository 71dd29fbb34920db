"""Model version swap and response cache, measured against a real server process: `python -m bench swap`.

Starts `python -m server` serving version A (`--models NAME@a=PATH_A`, admin API and response cache on)
and runs `--clients` closed-loop clients (greedy /generate requests with `cache: false`, so every one
runs in an engine). While they run it loads version B beside A (admin API: memory check, load, warm-up,
probe), promotes B, and waits until A has drained and unloaded; the clients go on for `--tail-s`.
Then, on the idle server, each of `--cache-prompts` distinct requests is sent twice: a generation (a
response-cache miss) and its replay (a hit). Reports:

- swap time: load, warm-up and probe as the server timed them, the promote call, drain + unload of A;
- requests during the run: sent, failed (a non-200 answer or a transport error: the target is 0), per
  version, and whether each (prompt, version) always gave the same tokens;
- memory: the server's RSS (/proc) before the load, its peak while both versions are loaded, and after
  A unloaded;
- cache: latency p50 of the generation against the hit, at the client (a fresh connection each) and in
  the server (timing.e2e_s).
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from bench.lib.server import free_port, server_command
from bench.lib.workloads import resolve_model

ADMIN_KEY = "bench-admin"
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "SELECT * FROM users WHERE",
           "import numpy as np", "The quick brown fox", "In 1492, Columbus", "Dear Sir or Madam,"]  # fmt: skip


@dataclass
class Result:
    """One client request of the run."""

    prompt: str
    sent: float  # time.monotonic()
    done: float
    status: int  # HTTP status; 0 for a transport error
    version: str | None = None
    tokens: tuple[int, ...] = ()
    error: str | None = None


@dataclass
class RssSampler:
    """Samples a process's resident memory every `interval_s` on a thread of its own."""

    pid: int
    interval_s: float = 0.02
    samples: list[tuple[float, int]] = field(default_factory=list)  # (monotonic time, bytes)
    _stop: threading.Event = field(default_factory=threading.Event)

    def start(self) -> None:
        threading.Thread(target=self._run, daemon=True).start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            rss = process_rss(self.pid)
            if rss is not None:
                self.samples.append((time.monotonic(), rss))
            time.sleep(self.interval_s)

    def peak(self, start: float, end: float) -> int | None:
        inside = [b for t, b in self.samples if start <= t <= end]
        return max(inside) if inside else None


def process_rss(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


@contextmanager
def versioned_server(name: str, path_a: Path, port: int, extra: list[str], log_path: Path,
                     ready_timeout_s: float = 600.0) -> Iterator[tuple[str, int]]:  # fmt: skip
    """`python -m server` serving `name@a` with the admin API and the response cache on; yields (URL, pid)."""
    args = ["--models", f"{name}@a={path_a}", "--admin-api-keys", ADMIN_KEY, *extra]
    with server_command(args, port, log_path, ready_timeout_s) as served:
        yield served


class Clients:
    """`n` closed-loop client threads sending greedy, uncached /generate requests until stopped."""

    def __init__(self, url: str, n: int, max_tokens: int) -> None:
        self.url = url
        self.max_tokens = max_tokens
        self.results: list[Result] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(n)]

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def stop(self) -> list[Result]:
        self._stop.set()
        for t in self._threads:
            t.join(120)
        return list(self.results)

    def _run(self, index: int) -> None:
        with httpx.Client(timeout=120) as http:
            i = index
            while not self._stop.is_set():
                prompt = PROMPTS[i % len(PROMPTS)]
                i += 1
                result = self._one(http, prompt)
                with self._lock:
                    self.results.append(result)

    def _one(self, http: httpx.Client, prompt: str) -> Result:
        body = {"prompt": prompt, "max_tokens": self.max_tokens, "temperature": 0.0, "ignore_eos": True,
                "stream": False, "cache": False}  # fmt: skip
        sent = time.monotonic()
        try:
            r = http.post(f"{self.url}/generate", json=body)
        except httpx.HTTPError as exc:
            return Result(prompt, sent, time.monotonic(), 0, error=f"{type(exc).__name__}: {exc}")
        done = time.monotonic()
        if r.status_code != 200:
            return Result(prompt, sent, done, r.status_code, error=r.text[:200])
        data = r.json()
        return Result(prompt, sent, done, 200, r.headers.get("x-model-version"), tuple(data["token_ids"]))


def admin(url: str, method: str, path: str, body: dict | None = None, timeout: float = 600) -> httpx.Response:
    return httpx.request(method, f"{url}/admin/models{path}", json=body,
                         headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=timeout)  # fmt: skip


def swap(url: str, name: str, path_b: Path, kv: str | None) -> dict[str, Any]:
    """Load B beside A, promote it, wait for A to unload; the times of each part."""
    marks = {"load_start": time.monotonic()}
    body: dict[str, Any] = {"version": "b", "path": str(path_b)}
    if kv:
        body["kv_cache_memory"] = kv
    r = admin(url, "POST", f"/{name}/versions", body)
    if r.status_code != 201:
        raise SystemExit(f"loading version b failed: {r.status_code} {r.text}")
    marks["loaded"] = time.monotonic()
    timings = r.json().get("timings", {})
    r = admin(url, "POST", f"/{name}/versions/b/promote")
    if r.status_code != 200:
        raise SystemExit(f"promote failed: {r.status_code} {r.text}")
    marks["promoted"] = time.monotonic()
    while True:
        versions = {v["version"] for v in admin(url, "GET", "", timeout=30).json()["data"][0]["versions"]}
        if versions == {"b"}:
            break
        time.sleep(0.01)
    marks["unloaded"] = time.monotonic()
    return {
        "marks": marks,
        "server_timings_s": timings,
        "load_call_s": marks["loaded"] - marks["load_start"],
        "promote_call_s": marks["promoted"] - marks["loaded"],
        "drain_and_unload_s": marks["unloaded"] - marks["promoted"],
        "total_s": marks["unloaded"] - marks["load_start"],
    }


def request_report(results: list[Result], marks: dict[str, float]) -> dict[str, Any]:
    """Failures, versions, and greedy consistency of the clients' requests."""
    failed = [r for r in results if r.status != 200]
    outputs: dict[tuple[str, str | None], set[tuple[int, ...]]] = {}
    for r in results:
        if r.status == 200:
            outputs.setdefault((r.prompt, r.version), set()).add(r.tokens)
    during = [r for r in results if r.done >= marks["load_start"] and r.sent <= marks["unloaded"]]
    return {
        "sent": len(results),
        "failed": len(failed),
        "failures": [f"{r.status} {r.error}" for r in failed[:5]],
        "during_swap": len(during),
        "failed_during_swap": sum(r.status != 200 for r in during),
        "by_version": dict(Counter(r.version for r in results if r.status == 200)),
        "after_promote_on_a": sum(r.version == "a" for r in results if r.sent > marks["promoted"]),
        "consistent": all(len(v) == 1 for v in outputs.values()),
    }


def cache_latency(url: str, n: int, max_tokens: int) -> dict[str, Any]:
    """Each of `n` distinct deterministic requests twice: generation (miss) then replay (hit)."""
    client = {"miss": [], "hit": []}
    server = {"miss": [], "hit": []}
    identical = True
    for i in range(n):
        body = {"prompt": f"{PROMPTS[i % len(PROMPTS)]} #{i}", "max_tokens": max_tokens, "temperature": 0.0,
                "ignore_eos": True, "stream": False}  # fmt: skip
        answers = []
        for kind in ("miss", "hit"):
            started = time.perf_counter()
            r = httpx.post(f"{url}/generate", json=body, timeout=120)  # a fresh connection each
            client[kind].append(time.perf_counter() - started)
            data = r.json()
            if bool(data["usage"].get("cached")) != (kind == "hit"):
                raise SystemExit(f"request {i}: expected a cache {kind}, got usage {data['usage']}")
            server[kind].append(data["timing"]["e2e_s"])
            answers.append((data["token_ids"], data["text"]))
        identical &= answers[0] == answers[1]
    med = statistics.median
    return {"requests": n, "identical": identical,
            "client_p50_s": {k: med(v) for k, v in client.items()},
            "server_e2e_p50_s": {k: med(v) for k, v in server.items()}}  # fmt: skip


def run(args: argparse.Namespace) -> int:
    path_a, path_b = resolve_model(args.model_a), resolve_model(args.model_b)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    extra = ["--response-cache-bytes", args.cache_bytes, "--max-num-seqs", str(args.max_num_seqs),
             "--dtype", args.dtype, *(["--kv-cache-memory", args.kv_cache_memory] if args.kv_cache_memory else [])]
    with versioned_server(args.name, path_a, free_port(), extra, out_dir / "swap-server.log") as (url, pid):
        rss = RssSampler(pid)
        rss.start()
        clients = Clients(url, args.clients, args.max_tokens)
        clients.start()
        time.sleep(args.warm_s)
        before = process_rss(pid)
        times = swap(url, args.name, path_b, args.kv_cache_memory)
        time.sleep(args.tail_s)
        results = clients.stop()
        after = process_rss(pid)
        rss.stop()
        marks = times.pop("marks")
        cache = cache_latency(url, args.cache_prompts, args.max_tokens)
    report = {
        "command": getattr(args, "command_line", None),
        "models": {"a": str(path_a), "b": str(path_b)},
        "swap": times,
        "requests": request_report(results, marks),
        "memory_bytes": {"before": before, "overlap_peak": rss.peak(marks["load_start"], marks["unloaded"]),
                         "after": after},  # fmt: skip
        "cache": cache,
    }
    text = json.dumps(report, indent=2)
    (out_dir / "swap.json").write_text(text + "\n")
    print(text)
    failed = report["requests"]["failed"]
    return 0 if failed == 0 and report["requests"]["consistent"] and cache["identical"] else 1


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("swap", help="blue-green swap of a model version under load; response cache latency",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-a", default="tiny-llama", help="model folder or make_model preset of version a")
    p.add_argument("--model-b", default="tiny-llama-b", help="model folder or make_model preset of version b")
    p.add_argument("--name", default="bench", help="the model's served name")
    p.add_argument("--clients", type=int, default=4, help="closed-loop client threads")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens per request (EOS ignored)")
    p.add_argument("--max-num-seqs", type=int, default=16, help="the server's max_num_seqs")
    p.add_argument("--dtype", default="auto", help="the server's dtype")
    p.add_argument("--kv-cache-memory", default=None, help="KV budget of each version (e.g. 256MiB)")
    p.add_argument("--cache-bytes", default="64MiB", help="the server's response cache size")
    p.add_argument("--cache-prompts", type=int, default=20, help="distinct requests of the cache latency phase")
    p.add_argument("--warm-s", type=float, default=3.0, help="load before the swap starts, seconds")
    p.add_argument("--tail-s", type=float, default=3.0, help="load after version a unloaded, seconds")
    p.add_argument("--out-dir", default="bench-results", help="where swap.json and the server log go")
    p.set_defaults(func=run)
