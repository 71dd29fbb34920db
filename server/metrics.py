"""Prometheus metrics: the one place where server events and engine stats become `tokenmill_*` series.
Each app has its own CollectorRegistry (no global default registry). Names follow vLLM's where one
exists (`vllm:num_requests_running` -> `tokenmill_num_requests_running`) so dashboards map 1:1.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from engine.outputs import EngineStats
from server.lanes import Lane

CONTENT_TYPE = CONTENT_TYPE_LATEST
# Outcomes a request can end with (label `status` of tokenmill_requests_total).
STATUSES = ("ok", "timeout", "aborted", "error", "overloaded", "queue_timeout", "shutdown", "invalid_request")
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)


@dataclass(frozen=True)
class Snapshot:
    """What the engine-side collector reads at scrape time."""

    stats: EngineStats
    lanes: dict[Lane, tuple[int, int]]  # lane -> (queued requests, queued tokens)
    worker_alive: bool


class ServerMetrics:
    """Counters and histograms the server feeds, plus engine gauges read at scrape time."""

    def __init__(self, model_name: str, snapshot: Callable[[], Snapshot]) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "tokenmill_requests", "Requests that ended, by lane and outcome.", ["lane", "status"], registry=r
        )
        self.finished = Counter(
            "tokenmill_request_success", "Requests finished by the engine, by finish reason.",
            ["finished_reason"], registry=r,
        )  # fmt: skip
        self.ttft = Histogram(
            "tokenmill_time_to_first_token_seconds", "Arrival to first token.", ["lane"],
            buckets=_LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.e2e = Histogram(
            "tokenmill_e2e_request_latency_seconds", "Arrival to last token.", ["lane"],
            buckets=_LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.queue_time = Histogram(
            "tokenmill_request_queue_time_seconds", "Time spent in the admission lane.", ["lane"],
            buckets=_LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        for lane in Lane:
            for status in STATUSES:
                self.requests.labels(lane.label, status)
        r.register(_EngineCollector(model_name, snapshot))

    def observe_finished(
        self, lane: Lane, status: str, reason: str, timing: dict[str, float | None]
    ) -> None:
        """A request that was admitted has ended (any outcome). Thread-safe."""
        self.requests.labels(lane.label, status).inc()
        if status == "ok":
            self.finished.labels(reason).inc()
        if timing.get("queue_s") is not None:
            self.queue_time.labels(lane.label).observe(timing["queue_s"])
        if timing.get("ttft_s") is not None:
            self.ttft.labels(lane.label).observe(timing["ttft_s"])
        if status == "ok" and timing.get("e2e_s") is not None:
            self.e2e.labels(lane.label).observe(timing["e2e_s"])

    def observe_rejected(self, lane: Lane, status: str) -> None:
        """A request was refused at admission (429)."""
        self.requests.labels(lane.label, status).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _EngineCollector(Collector):
    """Engine stats and lane depth, read from the worker's latest snapshot when scraped."""

    def __init__(self, model_name: str, snapshot: Callable[[], Snapshot]) -> None:
        self._model = model_name
        self._snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        snap = self._snapshot()
        st = snap.stats
        yield _gauge("tokenmill_num_requests_running", "Requests in the engine's running batch.", st.running)
        yield _gauge("tokenmill_num_requests_waiting", "Requests in the engine's own waiting queue.", st.waiting)
        yield _gauge("tokenmill_kv_cache_usage_perc", "Share of KV blocks held by requests (0-1).", st.kv_cache_usage)
        yield _gauge("tokenmill_kv_blocks_used", "KV blocks held by requests.", st.kv_blocks_used)
        yield _gauge("tokenmill_kv_blocks_total", "KV blocks in the cache.", st.kv_blocks_total)
        info = GaugeMetricFamily("tokenmill_model_info", "The served model (value 1).", labels=["model"])
        info.add_metric([self._model], 1)
        yield info
        yield _gauge("tokenmill_worker_alive", "1 while the engine worker thread runs.", int(snap.worker_alive))
        depth = GaugeMetricFamily("tokenmill_queue_depth", "Requests waiting in an admission lane.", labels=["lane"])
        tokens = GaugeMetricFamily("tokenmill_queue_tokens", "Tokens (prompt + max) queued in a lane.", labels=["lane"])
        for lane, (requests, queued_tokens) in snap.lanes.items():
            depth.add_metric([lane.label], requests)
            tokens.add_metric([lane.label], queued_tokens)
        yield depth
        yield tokens
        for name, doc, value in (
            ("tokenmill_prompt_tokens", "Prompt tokens computed (prefill work).", st.prompt_tokens),
            ("tokenmill_generation_tokens", "Tokens sampled.", st.generation_tokens),
            ("tokenmill_num_preemptions", "Requests preempted by the engine.", st.preemptions),
            ("tokenmill_prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", st.prefix_cache_queries),
            ("tokenmill_prefix_cache_hits", "Prompt tokens found in the prefix cache.", st.prefix_cache_hits),
            ("tokenmill_engine_steps", "Engine steps run.", st.steps),
        ):
            yield CounterMetricFamily(name, doc, value=value)


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)
