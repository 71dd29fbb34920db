"""Statistics of a load test, from what a client saw of each request (plain Python, no I/O).

Definitions (the same as `vllm bench serve`):
  TTFT    request sent -> first token event
  ITL     the gaps between consecutive token events of a request (all requests' gaps pooled)
  TPOT    (e2e - TTFT) / (output_tokens - 1), per request with at least 2 output tokens
  E2E     request sent -> last byte of the response
  goodput successful requests meeting every SLO, per second of the benchmark's duration
Percentiles interpolate linearly between order statistics (numpy's default method).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

PERCENTILES = (50, 90, 99)
STATUSES = ("ok", "rejected", "timeout", "error")  # rejected: HTTP 429


@dataclass
class RequestRecord:
    """What the client saw of one request. Times are seconds on one monotonic clock."""

    sent_at: float  # when the request was sent
    status: str = "ok"  # one of STATUSES
    token_times: list[float] = field(default_factory=list)  # arrival of each token event
    done_at: float | None = None  # when the response ended (None: it never did)
    output_tokens: int | None = None  # tokens the server reported; None: count the token events
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens served by the server's prefix cache (when it says)
    lane: str | None = None  # the priority it was sent with
    error: str = ""  # why it failed, for the report
    queue_s: float | None = None  # the server's queue wait, when it says (/generate)
    preemptions: int = 0  # times the server preempted it, when it says (/generate)
    queue_steps: int | None = None  # the server's queue wait in engine steps (idle: 1), when it says (/generate)

    @property
    def num_output_tokens(self) -> int:
        return self.output_tokens if self.output_tokens is not None else len(self.token_times)

    @property
    def ttft(self) -> float | None:
        return self.token_times[0] - self.sent_at if self.token_times else None

    @property
    def e2e(self) -> float | None:
        return None if self.done_at is None else self.done_at - self.sent_at

    @property
    def itls(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:], strict=False)]

    @property
    def tpot(self) -> float | None:
        n, ttft, e2e = self.num_output_tokens, self.ttft, self.e2e
        if n < 2 or ttft is None or e2e is None:
            return None
        return (e2e - ttft) / (n - 1)


@dataclass(frozen=True)
class Slo:
    """Service-level objectives in seconds; None: not checked."""

    ttft: float | None = None
    tpot: float | None = None
    e2e: float | None = None

    def met_by(self, r: RequestRecord) -> bool:
        """Whether a successful request meets every objective (a TPOT objective passes with < 2 tokens)."""
        if r.status != "ok":
            return False
        if self.tpot is not None and r.tpot is not None and r.tpot > self.tpot:
            return False
        for limit, value in ((self.ttft, r.ttft), (self.e2e, r.e2e)):
            if limit is not None and (value is None or value > limit):
                return False
        return True

    def describe(self) -> dict:
        return {k: v for k, v in (("ttft_s", self.ttft), ("tpot_s", self.tpot), ("e2e_s", self.e2e)) if v is not None}


def percentile(values: Sequence[float], p: float) -> float:
    """The p-th percentile (0-100) with linear interpolation; raises ValueError on no values."""
    if not values:
        raise ValueError("percentile of no values")
    if not 0 <= p <= 100:
        raise ValueError(f"p must be in [0, 100], got {p}")
    xs = sorted(values)
    rank = p / 100 * (len(xs) - 1)
    lo = math.floor(rank)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (rank - lo)


def distribution(values: Sequence[float]) -> dict | None:
    """mean and the PERCENTILES of `values` (None when there are none)."""
    if not values:
        return None
    out = {"mean": sum(values) / len(values)}
    out.update({f"p{p}": percentile(values, p) for p in PERCENTILES})
    return out


def summarize(records: Sequence[RequestRecord], duration_s: float, slo: Slo | None = None) -> dict:
    """The report of one load test: counts by status, rates over `duration_s`, latency distributions
    (successful requests only) and goodput under `slo`."""
    if duration_s <= 0:
        raise ValueError(f"duration_s must be positive, got {duration_s}")
    ok = [r for r in records if r.status == "ok"]
    counts = {s: sum(r.status == s for r in records) for s in STATUSES}
    out_tokens = sum(r.num_output_tokens for r in ok)
    summary = {
        "requests": len(records),
        "counts": counts,
        "duration_s": duration_s,
        "request_per_s": len(ok) / duration_s,
        "output_tokens": out_tokens,
        "output_tok_per_s": out_tokens / duration_s,
        "prompt_tokens": sum(r.prompt_tokens for r in ok),
        "cached_prompt_tokens": sum(r.cached_tokens for r in ok),
        "ttft_s": distribution([r.ttft for r in ok if r.ttft is not None]),
        "itl_s": distribution([g for r in ok for g in r.itls]),
        "tpot_s": distribution([r.tpot for r in ok if r.tpot is not None]),
        "e2e_s": distribution([r.e2e for r in ok if r.e2e is not None]),
    }
    if slo is not None:
        good = sum(slo.met_by(r) for r in ok)
        summary["slo"] = slo.describe()
        summary["good_requests"] = good
        summary["goodput_req_per_s"] = good / duration_s
    return summary


def find_knee(xs: Sequence[float], throughput: Sequence[float], latency: Sequence[float],
              min_throughput_gain: float = 0.10, min_latency_growth: float = 0.50) -> int | None:
    """Index of the first point (after the first) where throughput grew less than `min_throughput_gain`
    over the previous point while latency grew more than `min_latency_growth`; None if there is none.
    The points must be ordered by `xs` (load: concurrency or rate)."""
    if not len(xs) == len(throughput) == len(latency):
        raise ValueError("xs, throughput and latency must have the same length")
    if any(b <= a for a, b in zip(xs, xs[1:], strict=False)):
        raise ValueError("xs must be strictly increasing")
    for i in range(1, len(xs)):
        t0, t1, l0, l1 = throughput[i - 1], throughput[i], latency[i - 1], latency[i]
        if t0 <= 0 or l0 <= 0:
            continue
        if t1 / t0 - 1 < min_throughput_gain and l1 / l0 - 1 > min_latency_growth:
            return i
    return None
