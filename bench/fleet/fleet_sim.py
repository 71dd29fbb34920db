"""The router policies at fleet scale, simulated: `python -m bench fleet-sim [--replicas N] ...`.

A seeded discrete-event simulation in plain Python (no torch, no servers) of `--replicas` replicas
behind a router, `--tenants` tenants with Zipf(`--zipf`) popularity, each with a system prompt of
`--system-tokens` tokens; a request is its tenant's system prompt + `--question-tokens` tokens, and
asks for `--output-tokens` tokens. Poisson arrivals at `--load` x the fleet's capacity with every system
prompt computed (`--capacity-basis cold`: what a fleet without prefix reuse sustains, so every policy
is stable and all see the same offered rate) or with every one cached (`warm`: a perfect router's).

Each replica:
- a prefix cache of `--cache-tokens` tokens, LRU over whole system prompts (it holds
  cache_tokens // system_tokens of them). A prompt becomes findable when its prefill ends (then
  stored, evicting the least recently used); a request looks it up when it is admitted;
- serves at most `--slots` requests at once (max_num_seqs), the rest wait FIFO; the admitted ones
  share the replica's compute equally (processor sharing, the continuous-batching approximation);
- a request's work is prefill (uncached prompt tokens x `--prefill-ms` + cached tokens x
  `--cached-ms`), then decode (`--output-tokens` x `--decode-ms`). TTFT = arrival -> its prefill
  work done (queueing included).

Default costs, from docs/benchmarks/log.md "Replicas behind vllm-router, per policy", the kv_aware run
(three policies in one run, 2 replicas, 8 in flight, 8 output tokens, prompts of ~1,040 tokens: the
1,000-token system prompt + ~40 of question and chat template). Replica-seconds per request =
replicas / req/s: round_robin 2/2.43 = 0.823 s at hit rate 0.566 (451 uncached tokens), cache_aware
2/4.47 = 0.447 s at 0.900 (104 uncached). A line through the two: 1.08 ms per uncached prompt token
and 0.335 s per request otherwise, which is put on the 8 output tokens (42 ms each, at the measured
~4 in flight per replica); a cached token's cost does not show apart from that, so `--cached-ms` is 0.
The line predicts kv_aware's 0.487 s (measured 0.449). The per-replica cache is the measured
128 MiB budget: 5,824 tokens.

Router policies (the router counts requests in flight per replica as its load):
- `round_robin`; `power_of_two`: the less loaded of two replicas drawn at random;
- `cache_aware`, as vllm-router's (SGLang's) cache_aware: if max load - min load >
  `--balance-abs-threshold` and max load > min load x `--balance-rel-threshold`, the least loaded
  replica; otherwise the replica whose router-side prefix tree matches most of the request when the
  match is over `--cache-threshold` of it (ties: the least loaded), else the one with the smallest
  tree. Each routed request is inserted into its replica's tree; the tree never learns of the
  replica's evictions (its max_tree_size, 2^24 characters per replica, is far above this workload);
- `kv_aware` (a model of it, not read from vllm-router's source): the same imbalance check, then
  the least loaded replica that holds the prompt according to the replicas' KV events (stored /
  removed), seen `--event-lag-s` after they happen; none holds it: the least loaded replica.

Ignored: block granularity (a prompt is cached whole or not at all), the running requests' own KV
(the cache holds only the shared prefixes), the questions' reuse, preemption, network and router
time, per-step batching effects beyond the measured averages, and the router's tree eviction.
Reported per policy, over the requests after the first `--warmup` fraction: the fleet's prefix hit
rate (cached prompt tokens / prompt tokens), TTFT mean/p50/p99 (p50 is a hit's or a miss's TTFT,
depending on which side of half the requests hit), throughput against the offered rate, the
fleet's busy share (their work / replicas x time: the headroom left), the load imbalance (max / mean
requests per replica, all requests) and the longest queue a replica had.
"""

from __future__ import annotations

import argparse
import bisect
import heapq
import json
import random
from collections import OrderedDict, deque
from dataclasses import asdict, dataclass

from bench.lib.stats import percentile

POLICIES = ("round_robin", "power_of_two", "cache_aware", "kv_aware")
_DONE_EPS_S = 1e-9  # remaining work under this is finished (floating-point slack of processor sharing)


@dataclass(frozen=True)
class SimConfig:
    replicas: int = 100
    tenants: int = 10_000
    zipf: float = 1.0  # tenant k (0-based) is drawn with weight 1 / (k + 1) ** zipf
    system_tokens: int = 1000
    question_tokens: int = 40
    output_tokens: int = 8
    cache_tokens: int = 5824  # each replica's prefix cache
    slots: int = 8  # requests a replica serves at once
    prefill_ms: float = 1.08  # per uncached prompt token
    cached_ms: float = 0.0  # per cached prompt token
    decode_ms: float = 42.0  # per output token
    load: float = 0.75  # arrival rate / the fleet's capacity on `capacity_basis`
    capacity_basis: str = "cold"  # cold: every system prompt computed; warm: every one cached
    requests: int = 40_000
    warmup: float = 0.2  # fraction of the first requests left out of the statistics
    balance_abs_threshold: int = 32
    balance_rel_threshold: float = 1.0001
    cache_threshold: float = 0.5
    event_lag_s: float = 0.01
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("replicas", "tenants", "system_tokens", "output_tokens", "slots", "requests"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("question_tokens", "cache_tokens", "prefill_ms", "cached_ms", "decode_ms", "zipf",
                     "event_lag_s", "balance_abs_threshold"):  # fmt: skip
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.capacity_basis not in ("cold", "warm"):
            raise ValueError(f"capacity_basis must be cold or warm, got {self.capacity_basis!r}")
        if self.load <= 0:
            raise ValueError(f"load must be > 0, got {self.load}")
        if not 0 <= self.warmup < 1:
            raise ValueError(f"warmup must be in [0, 1), got {self.warmup}")
        if not 0 <= self.cache_threshold <= 1:
            raise ValueError(f"cache_threshold must be in [0, 1], got {self.cache_threshold}")

    @property
    def prompt_tokens(self) -> int:
        return self.system_tokens + self.question_tokens

    def work_s(self, cached: bool) -> float:
        """One request's replica-seconds, its system prompt cached or not."""
        per_system_token = self.cached_ms if cached else self.prefill_ms
        prefill = self.question_tokens * self.prefill_ms + self.system_tokens * per_system_token
        return (prefill + self.output_tokens * self.decode_ms) / 1000

    def arrival_rate(self) -> float:
        return self.load * self.replicas / self.work_s(self.capacity_basis == "warm")


@dataclass(frozen=True)
class PolicyResult:
    policy: str
    requests: int  # requests arrived (all of them, warm-up included)
    served: int  # requests that finished; each finishes once, so == requests
    hit_rate: float  # cached prompt tokens / prompt tokens, after warm-up
    ttft_mean_s: float
    ttft_p50_s: float
    ttft_p99_s: float
    requests_per_s: float  # finished after warm-up / the time they took
    offered_per_s: float  # the arrival rate
    utilisation: float  # the kept requests' work / (replicas x the time they took): the fleet's busy share
    imbalance: float  # max / mean requests per replica (all requests)
    max_waiting: int  # the longest FIFO queue any replica had


class PrefixLRU:
    """A replica's prefix cache: tenants' system prompts, least recently used evicted first."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity  # whole prompts
        self._items: OrderedDict[int, None] = OrderedDict()

    def lookup(self, tenant: int) -> bool:
        if tenant in self._items:
            self._items.move_to_end(tenant)
            return True
        return False

    def store(self, tenant: int) -> list[int]:
        """Store (or touch) a prompt; returns the tenants evicted for it."""
        if self.capacity == 0:
            return []
        if tenant in self._items:
            self._items.move_to_end(tenant)
            return []
        self._items[tenant] = None
        evicted = []
        while len(self._items) > self.capacity:
            evicted.append(self._items.popitem(last=False)[0])
        return evicted


class Replica:
    """Up to `slots` admitted requests share the replica equally; the rest wait FIFO."""

    def __init__(self, slots: int, cache_prompts: int) -> None:
        self.slots = slots
        self.cache = PrefixLRU(cache_prompts)
        self.active: list[list] = []  # [remaining work s, in_prefill, request index]
        self.waiting: deque[int] = deque()
        self.clock = 0.0  # time up to which `active` has been advanced
        self.version = 0  # bumps when the next completion time changes (stale heap entries skipped)
        self.max_waiting = 0

    def advance(self, now: float) -> None:
        if self.active:
            share = (now - self.clock) / len(self.active)
            for job in self.active:
                job[0] -= share
        self.clock = now

    def next_done(self) -> float | None:
        if not self.active:
            return None
        return self.clock + min(job[0] for job in self.active) * len(self.active)


class Router:
    """The policy's state: loads as the router counts them, and what it knows of the caches."""

    def __init__(self, policy: str, cfg: SimConfig, rng: random.Random) -> None:
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {policy!r}")
        self.policy, self.cfg, self.rng = policy, cfg, rng
        self.loads = [0] * cfg.replicas
        self.next_rr = 0
        self.tree_holders: dict[int, set[int]] = {}  # cache_aware: tenant -> replicas whose tree has it
        self.tree_size = [0] * cfg.replicas  # cache_aware: tokens inserted in each replica's tree
        self.kv_holders: dict[int, set[int]] = {}  # kv_aware: tenant -> replicas holding it (events seen)
        self.events: deque[tuple[float, bool, int, int]] = deque()  # (time, stored, replica, tenant)

    def least_loaded(self, among: set[int] | None = None) -> int:
        if among is None:
            return self.loads.index(min(self.loads))
        return min(among, key=lambda r: (self.loads[r], r))

    def imbalanced(self) -> bool:
        hi, lo = max(self.loads), min(self.loads)
        return hi - lo > self.cfg.balance_abs_threshold and hi > lo * self.cfg.balance_rel_threshold

    def route(self, tenant: int, now: float) -> int:
        if self.policy == "round_robin":
            r, self.next_rr = self.next_rr, (self.next_rr + 1) % self.cfg.replicas
        elif self.policy == "power_of_two":
            a, b = self.rng.sample(range(self.cfg.replicas), 2) if self.cfg.replicas > 1 else (0, 0)
            r = a if self.loads[a] <= self.loads[b] else b
        elif self.policy == "cache_aware":
            r = self._cache_aware(tenant)
        else:
            r = self._kv_aware(tenant, now)
        self.loads[r] += 1
        return r

    def _cache_aware(self, tenant: int) -> int:
        if self.imbalanced():
            r = self.least_loaded()
        else:
            holders = self.tree_holders.get(tenant)
            match = self.cfg.system_tokens / self.cfg.prompt_tokens if holders else 0.0
            if holders and match > self.cfg.cache_threshold:
                r = self.least_loaded(holders)
            else:
                r = self.tree_size.index(min(self.tree_size))
        holders = self.tree_holders.setdefault(tenant, set())
        if r not in holders:
            holders.add(r)
            self.tree_size[r] += self.cfg.system_tokens
        self.tree_size[r] += self.cfg.question_tokens
        return r

    def _kv_aware(self, tenant: int, now: float) -> int:
        while self.events and self.events[0][0] + self.cfg.event_lag_s <= now:
            _, stored, replica, t = self.events.popleft()
            holders = self.kv_holders.setdefault(t, set())
            (holders.add if stored else holders.discard)(replica)
        if self.imbalanced():
            return self.least_loaded()
        holders = self.kv_holders.get(tenant)
        return self.least_loaded(holders) if holders else self.least_loaded()

    def cache_event(self, now: float, stored: bool, replica: int, tenant: int) -> None:
        if self.policy == "kv_aware":
            self.events.append((now, stored, replica, tenant))


def arrivals(cfg: SimConfig) -> tuple[list[float], list[int]]:
    """Poisson arrival times and Zipf tenants, the same for every policy (a seed of their own)."""
    rng = random.Random(cfg.seed)
    cum, total = [], 0.0
    for k in range(cfg.tenants):
        total += 1.0 / (k + 1) ** cfg.zipf
        cum.append(total)
    rate, t = cfg.arrival_rate(), 0.0
    times, tenants = [], []
    for _ in range(cfg.requests):
        t += rng.expovariate(rate)
        times.append(t)
        tenants.append(min(bisect.bisect_left(cum, rng.random() * total), cfg.tenants - 1))
    return times, tenants


class _Run:
    """One policy's simulation: the event loop and what it records per request."""

    def __init__(self, cfg: SimConfig, policy: str, times: list[float], tenants: list[int]) -> None:
        self.cfg, self.times, self.tenants = cfg, times, tenants
        self.router = Router(policy, cfg, random.Random(cfg.seed + 1))
        cache_prompts = cfg.cache_tokens // cfg.system_tokens
        self.replicas = [Replica(cfg.slots, cache_prompts) for _ in range(cfg.replicas)]
        self.heap: list[tuple[float, int, int]] = []  # (time, replica, its version then)
        n = len(times)
        self.where = [-1] * n  # replica each request went to
        self.hit = [False] * n
        self.work = [0.0] * n  # replica-seconds each request cost (prefill + decode)
        self.ttft: list[float | None] = [None] * n
        self.done: list[float | None] = [None] * n
        self.served = 0

    def run(self) -> None:
        i = 0
        while i < len(self.times) or self.heap:
            if i < len(self.times) and (not self.heap or self.times[i] <= self.heap[0][0]):
                self._arrive(i)
                i += 1
                continue
            t, r, version = heapq.heappop(self.heap)
            if version == self.replicas[r].version:
                self._finish_due(r, t)

    def _arrive(self, i: int) -> None:
        now = self.times[i]
        r = self.router.route(self.tenants[i], now)
        self.where[i] = r
        rep = self.replicas[r]
        rep.advance(now)
        rep.waiting.append(i)
        rep.max_waiting = max(rep.max_waiting, len(rep.waiting))
        self._admit(r)
        self._reschedule(r)

    def _admit(self, r: int) -> None:
        rep, cfg = self.replicas[r], self.cfg
        while rep.waiting and len(rep.active) < rep.slots:
            i = rep.waiting.popleft()
            hit = rep.cache.lookup(self.tenants[i])
            self.hit[i] = hit
            uncached = cfg.question_tokens + (0 if hit else cfg.system_tokens)
            work = (uncached * cfg.prefill_ms + (cfg.system_tokens if hit else 0) * cfg.cached_ms) / 1000
            rep.active.append([work, True, i])  # prefill first; its decode work is set when it ends
            self.work[i] = work + cfg.output_tokens * cfg.decode_ms / 1000

    def _finish_due(self, r: int, now: float) -> None:
        rep = self.replicas[r]
        rep.advance(now)
        still = []
        for job in rep.active:
            if job[0] > _DONE_EPS_S:
                still.append(job)
            elif job[1]:  # prefill done: first token, and the prompt becomes findable
                i = job[2]
                self.ttft[i] = now - self.times[i]
                self.router.cache_event(now, True, r, self.tenants[i])
                for gone in rep.cache.store(self.tenants[i]):
                    self.router.cache_event(now, False, r, gone)
                still.append([self.cfg.output_tokens * self.cfg.decode_ms / 1000, False, i])
            else:
                self.done[job[2]] = now
                self.served += 1
                self.router.loads[r] -= 1
        rep.active = still
        self._admit(r)
        self._reschedule(r)

    def _reschedule(self, r: int) -> None:
        rep = self.replicas[r]
        rep.version += 1
        t = rep.next_done()
        if t is not None:
            heapq.heappush(self.heap, (t, r, rep.version))

    def result(self, policy: str) -> PolicyResult:
        cfg = self.cfg
        start = int(len(self.times) * cfg.warmup)
        kept = range(start, len(self.times))
        hits = sum(cfg.system_tokens for i in kept if self.hit[i])
        ttfts = [t for t in (self.ttft[i] for i in kept) if t is not None]
        dones = [d for d in (self.done[i] for i in kept) if d is not None]
        span = max(dones) - self.times[start] if dones else 0.0
        per_replica = [0] * cfg.replicas
        for r in self.where:
            per_replica[r] += 1
        mean = len(self.where) / cfg.replicas
        busy = sum(self.work[i] for i in kept) / (cfg.replicas * span) if span > 0 else 0.0
        return PolicyResult(
            policy=policy, requests=len(self.times), served=self.served,
            hit_rate=hits / (len(kept) * cfg.prompt_tokens), ttft_mean_s=sum(ttfts) / len(ttfts), ttft_p50_s=percentile(ttfts, 50),
            ttft_p99_s=percentile(ttfts, 99), requests_per_s=len(dones) / span if span > 0 else 0.0,
            offered_per_s=cfg.arrival_rate(), utilisation=busy, imbalance=max(per_replica) / mean,
            max_waiting=max(rep.max_waiting for rep in self.replicas))  # fmt: skip


def simulate(cfg: SimConfig, policy: str) -> PolicyResult:
    times, tenants = arrivals(cfg)
    sim = _Run(cfg, policy, times, tenants)
    sim.run()
    return sim.result(policy)


def table(rows: list[PolicyResult]) -> str:
    lines = ["| policy | prefix hit rate (fleet) | TTFT mean | TTFT p50 | TTFT p99 | req/s (offered) | fleet busy | "
             "imbalance (max/mean) | longest queue |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    for r in rows:
        lines.append(f"| {r.policy} | {r.hit_rate:.3f} | {r.ttft_mean_s:.2f} s | {r.ttft_p50_s:.2f} s | {r.ttft_p99_s:.2f} s | "
                     f"{r.requests_per_s:.1f} ({r.offered_per_s:.1f}) | {r.utilisation:.2f} | {r.imbalance:.2f} | {r.max_waiting} |")  # fmt: skip
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    bad = [p for p in policies if p not in POLICIES]
    if bad:
        print(f"bench fleet-sim: --policies: {', '.join(bad)} not in {', '.join(POLICIES)}")
        return 2
    fields = {f: getattr(args, f) for f in SimConfig.__dataclass_fields__}
    try:
        cfg = SimConfig(**fields)
    except ValueError as e:
        print(f"bench fleet-sim: {e}")
        return 2
    rows = [simulate(cfg, p) for p in policies]
    report = {"command": getattr(args, "command_line", None), "config": asdict(cfg),
              "arrival_rate_per_s": cfg.arrival_rate(), "results": [asdict(r) for r in rows]}  # fmt: skip
    print(json.dumps(report, indent=2))
    print(table(rows))
    return 0 if all(r.served == r.requests for r in rows) else 1


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("fleet-sim", help="router policies at 100 replicas / 10,000 tenants, simulated",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    d = SimConfig()
    p.add_argument("--policies", default=",".join(POLICIES), help=f"comma-separated, of {', '.join(POLICIES)}")
    for name, help_text in (
        ("replicas", "replicas"), ("tenants", "tenants (one system prompt each)"),
        ("zipf", "tenant popularity: Zipf exponent (0: uniform)"), ("system_tokens", "tokens per system prompt"),
        ("question_tokens", "tokens per request after the system prompt"), ("output_tokens", "tokens per answer"),
        ("cache_tokens", "each replica's prefix cache, tokens"), ("slots", "requests a replica serves at once"),
        ("prefill_ms", "ms per uncached prompt token"), ("cached_ms", "ms per cached prompt token"),
        ("decode_ms", "ms per output token"), ("load", "arrival rate / the fleet's capacity on --capacity-basis"),
        ("capacity_basis", "cold: capacity with every system prompt computed; warm: with every one cached"),
        ("requests", "requests simulated"), ("warmup", "fraction of first requests left out of the statistics"),
        ("balance_abs_threshold", "cache_aware/kv_aware: load difference that triggers balancing"),
        ("balance_rel_threshold", "cache_aware/kv_aware: load ratio that triggers balancing"),
        ("cache_threshold", "cache_aware: match fraction above which the matching replica is used"),
        ("event_lag_s", "kv_aware: seconds from a cache change to the router seeing its event"),
        ("seed", "seed of arrivals, tenants and power_of_two's draws"),
    ):  # fmt: skip
        default = getattr(d, name)
        p.add_argument("--" + name.replace("_", "-"), dest=name, type=type(default), default=default,
                       help=f"{help_text} (default {default})")  # fmt: skip
    p.set_defaults(func=run)
