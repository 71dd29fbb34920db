"""Prometheus metrics: the one place where server events and engine stats become `tokenmill_*` series.

Each app has its own CollectorRegistry (no global default registry). Names follow vLLM's where one
exists (`vllm:num_requests_running` -> `tokenmill_num_requests_running`) so dashboards map 1:1.
Three sources feed it:

- the worker thread, per request (`observe_finished`, `observe_token_gap`) and per engine step
  (`observe_step`: step time by phase, tokens per step); prometheus_client metrics are thread-safe;
- the event loop, for requests refused at admission (`observe_rejected`);
- a collector that reads, at scrape time, the worker's latest `EngineStats` (cumulative engine counters
  become real counters: the engine never resets them), the lanes, and device memory.

Every admitted request is counted when it ends, whatever the outcome (timeouts and client aborts
included), and its queue time, end-to-end latency and lengths are observed too.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from engine.api import EngineStats, PreemptionCause
from server.admission import Lane

CONTENT_TYPE = CONTENT_TYPE_LATEST

# Label `status` of tokenmill_requests_total; `reason` says more (see REASONS).
STATUSES = ("ok", "rejected", "timeout", "cancelled", "error")
REASONS = {
    "ok": ("stop", "length"),  # the engine's finish reason
    "rejected": ("queue_requests", "queue_tokens", "invalid_request"),  # 429 (lane full), engine said 400
    "timeout": ("queue", "first_token", "total"),  # which deadline passed
    "cancelled": ("client", "shutdown", "slow_client"),  # client went away; shut down; stopped reading
    "error": ("engine_error", "worker_died"),
}
PHASES = ("prefill", "decode", "mixed")  # label `phase` of the step histogram

# Seconds, from a sub-millisecond CPU step to a request of several minutes. Edges at 1 s and 2 s keep
# the alert thresholds (queue wait p99 > 1 s, TTFT p99 > 2 s) exact.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.4, 0.5, 0.75, 1.0,
                   1.5, 2.0, 2.5, 5.0, 7.5, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0)
TOKEN_GAP_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1,
                     0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0)
STEP_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1,
                0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
LENGTH_BUCKETS = tuple(float(2**i) for i in range(18))  # 1 .. 131072 tokens


@dataclass(frozen=True)
class DeviceMemory:
    """Memory of the device the model runs on: CUDA memory, or the process RSS on CPU."""

    device: str  # label value: "cuda:0", or "cpu" for the process RSS against the host (or cgroup) limit
    used_bytes: int
    total_bytes: int


@dataclass(frozen=True)
class Snapshot:
    """What the engine-side collector reads at scrape time."""

    stats: EngineStats
    lanes: dict[Lane, tuple[int, int]]  # lane -> (queued requests, queued tokens)
    worker_alive: bool
    memory: DeviceMemory | None = None


@dataclass(frozen=True)
class ModelInfo:
    """Labels of tokenmill_model_info."""

    model: str
    dtype: str
    device: str
    version: str
    max_model_len: int


class ServerMetrics:
    """Counters and histograms the server feeds, plus engine gauges read at scrape time."""

    def __init__(self, info: ModelInfo, snapshot: Callable[[], Snapshot], clock: Callable[[], float] = time.monotonic):
        self.registry = CollectorRegistry()
        r = self.registry
        self._clock = clock
        self.last_step_at = clock()  # of the last engine step that ran; from creation until the first
        self.requests = Counter(
            "tokenmill_requests", "Requests that ended (admitted or refused), by lane, status and reason.",
            ["lane", "status", "reason"], registry=r,
        )  # fmt: skip
        self.rejections = Counter(
            "tokenmill_request_rejections", "Requests refused with 429 because their lane was full, by the bound hit.",
            ["lane", "reason"], registry=r,
        )  # fmt: skip
        self.finished = Counter(
            "tokenmill_request_success", "Requests the engine finished normally, by finish reason (vLLM's name).",
            ["finished_reason"], registry=r,
        )  # fmt: skip
        self.ttft = _histogram(r, "tokenmill_time_to_first_token_seconds", "Arrival to first token.", ["lane"])
        self.queue_time = _histogram(
            r, "tokenmill_request_queue_time_seconds",
            "Arrival until the request left its lane (started, or ended while queued).", ["lane"],
        )  # fmt: skip
        self.e2e = _histogram(
            r, "tokenmill_e2e_request_latency_seconds", "Arrival to the end, every outcome but 429.", ["lane", "status"]
        )
        self.prefill_time = _histogram(
            r, "tokenmill_request_prefill_time_seconds", "Start in the engine to first token.", ["lane"]
        )
        self.decode_time = _histogram(
            r, "tokenmill_request_decode_time_seconds", "First token to the end of the request.", ["lane"]
        )
        self.token_gap = _histogram(
            r, "tokenmill_inter_token_latency_seconds", "Time between two consecutive tokens of a request.",
            ["lane"], TOKEN_GAP_BUCKETS,
        )  # fmt: skip
        self.prompt_len = _histogram(
            r, "tokenmill_request_prompt_tokens", "Prompt length of admitted requests.", ["lane"], LENGTH_BUCKETS
        )
        self.generation_len = _histogram(
            r, "tokenmill_request_generation_tokens", "Tokens generated per admitted request (partial ones too).",
            ["lane"], LENGTH_BUCKETS,
        )  # fmt: skip
        self.step_time = _histogram(
            r, "tokenmill_engine_step_duration_seconds",
            "Wall time of one engine step (schedule, model, update), by phase.", ["phase"], STEP_BUCKETS,
        )  # fmt: skip
        self.step_tokens = _histogram(
            r, "tokenmill_iteration_tokens", "Tokens (prompt chunks + decodes) in one engine step.", [], LENGTH_BUCKETS
        )
        # Children resolved once: the worker observes these per step and per token.
        self._step_by_phase = {phase: self.step_time.labels(phase) for phase in PHASES}
        self._gap_by_lane = {lane: self.token_gap.labels(lane.label) for lane in Lane}
        self._create_series()
        ProcessCollector(registry=r)
        PlatformCollector(registry=r)
        r.register(_EngineCollector(info, snapshot, self))

    def _create_series(self) -> None:
        """Every lane's series exist at 0 from the start: rate() then counts a lane's first requests too
        (a series that appears with a value has no earlier sample to rise from), and shows 0, not nothing."""
        for lane in Lane:
            label = lane.label
            for status, reasons in REASONS.items():
                for reason in reasons:
                    self.requests.labels(label, status, reason)
                if status != "rejected":
                    self.e2e.labels(label, status)
            for reason in REASONS["rejected"][:2]:
                self.rejections.labels(label, reason)
            for histogram in (self.ttft, self.queue_time, self.prefill_time, self.decode_time, self.prompt_len,
                              self.generation_len):  # fmt: skip
                histogram.labels(label)
        for reason in REASONS["ok"]:
            self.finished.labels(reason)

    # -- worker thread -----------------------------------------------------------------------------------
    def observe_step(self, stats: EngineStats) -> None:
        """An engine step ran; `stats` is read right after it."""
        self.last_step_at = self._clock()
        prefill, decode = stats.last_step_prefill_tokens, stats.last_step_decode_tokens
        phase = "mixed" if prefill and decode else ("prefill" if prefill else "decode")
        self._step_by_phase[phase].observe(stats.last_step_time_s)
        self.step_tokens.observe(stats.last_step_tokens)

    def observe_token_gap(self, lane: Lane, seconds: float) -> None:
        """A request got a token `seconds` after its previous one."""
        self._gap_by_lane[lane].observe(seconds)

    def observe_finished(self, lane: Lane, status: str, reason: str, lengths: tuple[int, int],
                         timing: dict[str, float | None]) -> None:  # fmt: skip
        """An admitted request ended, any outcome. `lengths`: (prompt, generated) tokens; `timing`: seconds
        since arrival of start (`queue_s`), first token (`ttft_s`) and end (`e2e_s`), None if it never came."""
        label = lane.label
        self.requests.labels(label, status, reason).inc()
        if status == "ok":
            self.finished.labels(reason).inc()
        queue_s, ttft_s, e2e_s = timing.get("queue_s"), timing.get("ttft_s"), timing.get("e2e_s")
        waited = queue_s if queue_s is not None else e2e_s  # never started: it waited until it ended
        if waited is not None:
            self.queue_time.labels(label).observe(waited)
        if ttft_s is not None:
            self.ttft.labels(label).observe(ttft_s)
            if queue_s is not None:
                self.prefill_time.labels(label).observe(max(ttft_s - queue_s, 0.0))
            if e2e_s is not None:
                self.decode_time.labels(label).observe(max(e2e_s - ttft_s, 0.0))
        if e2e_s is not None:
            self.e2e.labels(label, status).observe(e2e_s)
        self.prompt_len.labels(label).observe(lengths[0])
        self.generation_len.labels(label).observe(lengths[1])

    # -- event loop --------------------------------------------------------------------------------------
    def observe_rejected(self, lane: Lane, reason: str) -> None:
        """A request was refused at admission with 429 (`reason`: queue_requests or queue_tokens)."""
        self.requests.labels(lane.label, "rejected", reason).inc()
        self.rejections.labels(lane.label, reason).inc()

    def seconds_since_last_step(self) -> float:
        return max(self._clock() - self.last_step_at, 0.0)

    def render(self) -> bytes:
        return generate_latest(self.registry)


def _histogram(registry: CollectorRegistry, name: str, doc: str, labels: list[str],
               buckets: tuple[float, ...] = LATENCY_BUCKETS) -> Histogram:  # fmt: skip
    return Histogram(name, doc, labels, buckets=buckets, registry=registry)


class _EngineCollector(Collector):
    """Engine stats, lane depth and device memory, read from the worker's latest snapshot when scraped."""

    def __init__(self, info: ModelInfo, snapshot: Callable[[], Snapshot], metrics: ServerMetrics) -> None:
        self._info = info
        self._snapshot = snapshot
        self._metrics = metrics

    def collect(self) -> Iterator[Metric]:
        snap = self._snapshot()
        st = snap.stats
        yield _gauge("tokenmill_num_requests_running", "Requests in the engine's running batch.", st.running)
        yield _gauge("tokenmill_num_requests_waiting", "Preempted requests waiting to resume (those never "
                     "scheduled yet are tokenmill_queue_depth, by lane).", st.waiting_preempted)  # fmt: skip
        yield _gauge("tokenmill_kv_cache_usage_ratio", "Share of KV blocks held by requests (0-1).", st.kv_cache_usage)
        yield _gauge("tokenmill_kv_cache_usage_perc", "Same as tokenmill_kv_cache_usage_ratio (vLLM's name; 0-1).",
                     st.kv_cache_usage)  # fmt: skip
        yield _gauge("tokenmill_kv_blocks_used", "KV blocks held by requests.", st.kv_blocks_used)
        yield _gauge("tokenmill_kv_blocks_capacity", "KV blocks in the cache (used + free).", st.kv_blocks_total)
        yield _gauge("tokenmill_seconds_since_last_step", "Seconds since the engine last ran a step (since "
                     "start when it never did); grows while idle too.", self._metrics.seconds_since_last_step())
        yield _gauge("tokenmill_worker_alive", "1 while the engine worker thread runs.", int(snap.worker_alive))
        yield self._model_info()
        yield from _lane_gauges(snap.lanes)
        yield _preemptions(st)
        yield from _memory_gauges(snap.memory)
        for name, doc, value in (
            ("tokenmill_prompt_tokens", "Prompt tokens computed by the engine (prefill work: prefix-cache hits "
             "excluded, recomputation after preemption included).", st.prompt_tokens),
            ("tokenmill_generation_tokens", "Tokens sampled by the engine.", st.generation_tokens),
            ("tokenmill_num_preemptions", "Requests preempted by the engine.", st.preemptions),
            ("tokenmill_prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", st.prefix_cache_queries),
            ("tokenmill_prefix_cache_hits", "Prompt tokens found in the prefix cache.", st.prefix_cache_hits),
            ("tokenmill_engine_steps", "Engine steps run.", st.steps),
        ):  # fmt: skip
            yield CounterMetricFamily(name, doc, value=value)

    def _model_info(self) -> Metric:
        i = self._info
        info = GaugeMetricFamily("tokenmill_model_info", "The served model and build (value 1).",
                                 labels=["model", "dtype", "device", "version", "max_model_len"])  # fmt: skip
        info.add_metric([i.model, i.dtype, i.device, i.version, str(i.max_model_len)], 1)
        return info


def _lane_gauges(lanes: dict[Lane, tuple[int, int]]) -> Iterator[Metric]:
    depth = GaugeMetricFamily("tokenmill_queue_depth", "Requests waiting in an admission lane.", labels=["lane"])
    tokens = GaugeMetricFamily("tokenmill_queue_tokens", "Tokens (prompt + max) queued in a lane.", labels=["lane"])
    for lane, (requests, queued_tokens) in lanes.items():
        depth.add_metric([lane.label], requests)
        tokens.add_metric([lane.label], queued_tokens)
    yield depth
    yield tokens


def _preemptions(st: EngineStats) -> Metric:
    """Cumulative preemptions by the victim's lane and the limit it lost its place at; every
    (lane, cause) series exists from the start, at 0."""
    family = CounterMetricFamily("tokenmill_preemptions", "Running requests that gave way to more important "
                                 "ones, by the victim's lane and cause: slots (max_num_seqs), kv (KV blocks), "
                                 "budget (the step's token budget).", labels=["lane", "cause"])  # fmt: skip
    counts = {(lane.label, cause.value): 0 for lane in Lane for cause in PreemptionCause}
    for (priority, cause), n in st.preemptions_by.items():
        counts[(lane_label(priority), cause.value)] = n
    for labels, n in sorted(counts.items()):
        family.add_metric(list(labels), n)
    return family


def lane_label(priority: int) -> str:
    """The lane name of an engine priority (a priority no lane maps to keeps its number)."""
    try:
        return Lane(priority).label
    except ValueError:
        return str(priority)


def _memory_gauges(memory: DeviceMemory | None) -> Iterator[Metric]:
    if memory is None:
        return
    used = GaugeMetricFamily("tokenmill_device_memory_used_bytes", "Device memory in use: CUDA memory "
                             "reserved by this process, or the process RSS on CPU.", labels=["device"])  # fmt: skip
    total = GaugeMetricFamily("tokenmill_device_memory_total_bytes", "Device memory: the GPU's, or on CPU the "
                              "host's (or the cgroup limit when lower).", labels=["device"])  # fmt: skip
    used.add_metric([memory.device], memory.used_bytes)
    total.add_metric([memory.device], memory.total_bytes)
    yield used
    yield total


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


# -- device memory ----------------------------------------------------------------------------------------
def memory_probe(engine: Any) -> Callable[[], DeviceMemory | None]:
    """How to read device memory at scrape time (from the event loop, while the worker steps). An engine
    may offer `device_memory()` -> a dict with `used_bytes` and `total_bytes` (device-wide, as
    nvidia-smi counts), or None on CPU; otherwise, and on CPU, the process RSS against the host memory
    (or the cgroup limit)."""
    method = getattr(engine, "device_memory", None)
    device = str(getattr(engine, "device_name", "cpu"))

    def probe() -> DeviceMemory | None:
        if callable(method):
            try:
                got = method()
                if got is not None:
                    return DeviceMemory(device, int(got["used_bytes"]), int(got["total_bytes"]))
            except Exception:  # a scrape must not fail because of it: fall back to the process
                pass
        return process_memory()

    return probe


def process_memory() -> DeviceMemory | None:
    """This process's RSS, and the memory it may use: the host's, or the cgroup limit when lower."""
    page = os.sysconf("SC_PAGE_SIZE")
    try:
        rss = int(Path("/proc/self/statm").read_text().split()[1]) * page
    except (OSError, ValueError, IndexError):
        return None
    limits = [os.sysconf("SC_PHYS_PAGES") * page]
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = Path(path).read_text().strip()
        except OSError:
            continue
        if text.isdigit() and 0 < int(text) < limits[0]:
            limits.append(int(text))
    return DeviceMemory("cpu", rss, min(limits))
