"""Prometheus metrics: the one place where server events and engine stats become `tokenmill_*` series.

Each app has its own CollectorRegistry (no global default registry). Names follow vLLM's where one
exists (`vllm:num_requests_running` -> `tokenmill_num_requests_running`) so dashboards map 1:1.
Every series but the process-wide ones (process_*, device memory) carries `model` and `version`: one
`VersionMetrics` per loaded model version binds them. Three sources feed it:

- each version's worker thread, per request (`observe_finished`, `observe_token_gap`) and per engine
  step (`observe_step`: step time by phase, tokens per step); prometheus_client metrics are thread-safe;
- the event loop, for requests refused at admission (`observe_rejected`), response cache hits and
  misses, feedback ratings and rollout events;
- a collector that reads, at scrape time, each loaded version's latest `EngineStats` (cumulative engine
  counters become real counters: an engine never resets them), its lanes and rollout state, the
  response cache's size, and device memory.

Every admitted request is counted when it ends, whatever the outcome (timeouts and client aborts
included), and its queue time, end-to-end latency and lengths are observed too. Series of a version
that was unloaded stay (counters keep their last value); its scrape-time gauges go.

vLLM's request and step series (`vllm:time_to_first_token_seconds`, `vllm:request_success_total`, ...;
`VllmSeries`) are filled by the same `observe_*` calls as their `tokenmill_*` twins, with vLLM's buckets
and labels (`model_name`, `engine="0"`; the versions of one model share them); vLLM's engine counters
(`vllm:prompt_tokens_total`, ...) are read from the same `EngineStats` at scrape time.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

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
from server.config.lanes import Lane
from server.ops.feedback import RATINGS
from server.ops.memory import DeviceMemory

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

# vLLM v1's bucket boundaries (vllm/v1/metrics/loggers.py), so its dashboards' quantiles read the same.
VLLM_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                     10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
VLLM_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                    20.0, 40.0, 80.0)
VLLM_REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                        120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
VLLM_N_BUCKETS = (1, 2, 5, 10, 20)
VLLM_ITERATION_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)  # eager mode's
VLLM_ENGINE = "0"  # label `engine`: vLLM's engine index; one engine per served model version here
# vllm:request_success_total's finished_reason by our (status, reason); a request refused is not counted
VLLM_FINISHED = {"ok": None, "timeout": "abort", "cancelled": "abort", "error": "error"}  # ok: stop/length
VLLM_REASONS = ("stop", "length", "abort", "error")


def vllm_finished_reason(status: str, reason: str) -> str:
    """vLLM's finished_reason for one of our (status, reason) pairs: a finished request's own stop/length;
    timeouts and cancellations abort; anything else (an engine error, a grammar dead end answered 400) is
    an error."""
    mapped = VLLM_FINISHED.get(status, "error")
    if mapped is None:
        return reason if reason in VLLM_REASONS else "stop"
    return mapped


def build_1_2_5_buckets(limit: int) -> tuple[float, ...]:
    """1, 2, 5, 10, 20, 50, ... up to `limit` (vLLM's token-count buckets for a context of `limit`)."""
    out: list[float] = []
    exponent = 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > limit:
                return tuple(out)
            out.append(float(value))
        exponent += 1


@dataclass(frozen=True)
class Snapshot:
    """What the engine-side collector reads at scrape time, for one loaded model version."""

    stats: EngineStats
    lanes: dict[Lane, tuple[int, int]]  # lane -> (queued requests, queued tokens)
    worker_alive: bool
    memory: DeviceMemory | None = None  # process-wide: read from the first version only
    grammar_cache: tuple[int, int] | None = None  # compiled grammars cached: (entries, bytes); None: no backend
    waiting_adapters: frozenset[str] = frozenset()  # LoRA adapters of requests admitted, not started (lanes too)


@dataclass(frozen=True)
class ModelInfo:
    """Labels of tokenmill_model_info, for one loaded model version."""

    model: str
    dtype: str
    device: str
    version: str  # the model's version (the build's is tokenmill_model_info's `server_version`)
    max_model_len: int


@dataclass(frozen=True)
class VersionSnapshot:
    """One loaded version at scrape time: who it is, its rollout state, its engine."""

    info: ModelInfo
    state: str  # loading, ready, draining (server/serving/deployment.py VersionState)
    role: str  # promoted, canary, previous or candidate (server/serving/registry.py)
    canary_weight: int  # share of new requests (0-100) when it is the canary, else 0
    snapshot: Snapshot
    seconds_since_last_step: float


@dataclass(frozen=True)
class CacheStats:
    """Response cache contents of one version at scrape time."""

    model: str
    version: str
    entries: int
    bytes: int


class ServerMetrics:
    """Counters and histograms the server feeds, plus engine gauges read at scrape time. Every series but
    the process-wide ones (process_*, device memory) carries `model` and `version`."""

    def __init__(
        self,
        server_version: str,
        versions: Callable[[], list[VersionSnapshot]],
        clock: Callable[[], float] = time.monotonic,
        cache_stats: Callable[[], list[CacheStats]] = list,
        max_model_len: int = 131072,
    ) -> None:
        """`max_model_len`: the longest context served (the top of vLLM's token-count buckets)."""
        self.registry = CollectorRegistry()
        r = self.registry
        self.vllm = VllmSeries(r, max_model_len)
        self.server_version = server_version
        self.clock = clock
        self._versions: dict[tuple[str, str], VersionMetrics] = {}
        mv = ["model", "version"]
        self.requests = Counter(
            "tokenmill_requests", "Requests that ended (admitted or refused), by lane, status and reason.",
            [*mv, "lane", "status", "reason"], registry=r,
        )  # fmt: skip
        self.rejections = Counter(
            "tokenmill_request_rejections", "Requests refused with 429 because their lane was full, by the bound hit.",
            [*mv, "lane", "reason"], registry=r,
        )  # fmt: skip
        self.finished = Counter(
            "tokenmill_request_success", "Requests the engine finished normally, by finish reason (vLLM's name).",
            [*mv, "finished_reason"], registry=r,
        )  # fmt: skip
        self.ttft = _histogram(r, "tokenmill_time_to_first_token_seconds", "Arrival to first token.", [*mv, "lane"])
        self.queue_time = _histogram(
            r, "tokenmill_request_queue_time_seconds",
            "Arrival until the request left its lane (started, or ended while queued).", [*mv, "lane"],
        )  # fmt: skip
        self.e2e = _histogram(
            r, "tokenmill_e2e_request_latency_seconds", "Arrival to the end, every outcome but 429.",
            [*mv, "lane", "status"],
        )  # fmt: skip
        self.prefill_time = _histogram(
            r, "tokenmill_request_prefill_time_seconds", "Start in the engine to first token.", [*mv, "lane"]
        )
        self.decode_time = _histogram(
            r, "tokenmill_request_decode_time_seconds", "First token to the end of the request.", [*mv, "lane"]
        )
        self.token_gap = _histogram(
            r, "tokenmill_inter_token_latency_seconds", "Time between two consecutive tokens of a request.",
            [*mv, "lane"], TOKEN_GAP_BUCKETS,
        )  # fmt: skip
        self.prompt_len = _histogram(
            r, "tokenmill_request_prompt_tokens", "Prompt length of admitted requests.", [*mv, "lane"], LENGTH_BUCKETS
        )
        self.generation_len = _histogram(
            r, "tokenmill_request_generation_tokens", "Tokens generated per admitted request (partial ones too).",
            [*mv, "lane"], LENGTH_BUCKETS,
        )  # fmt: skip
        self.step_time = _histogram(
            r, "tokenmill_engine_step_duration_seconds",
            "Wall time of one engine step (schedule, model, update), by phase.", [*mv, "phase"], STEP_BUCKETS,
        )  # fmt: skip
        self.step_tokens = _histogram(
            r, "tokenmill_iteration_tokens", "Tokens (prompt chunks + decodes) in one engine step.", mv, LENGTH_BUCKETS
        )
        self.cache_hits = Counter("tokenmill_response_cache_hits", "Deterministic requests answered from the "
                                  "response cache.", mv, registry=r)  # fmt: skip
        self.cache_misses = Counter("tokenmill_response_cache_misses", "Cacheable requests not found in the "
                                    "response cache (they ran in the engine).", mv, registry=r)  # fmt: skip
        self.cache_evictions = Counter("tokenmill_response_cache_evictions", "Response cache entries dropped "
                                       "before their TTL (LRU, byte bound).", mv, registry=r)  # fmt: skip
        self.feedback = Counter("tokenmill_feedback_ratings", "Ratings received on POST /v1/feedback, by rating.",
                                [*mv, "rating"], registry=r)  # fmt: skip
        self.http_errors = Counter(
            "tokenmill_http_errors", "Error answers (status >= 400: invalid, refused, unknown path, 5xx) by "
            "endpoint (route path), status and reason (the error type).", ["endpoint", "status", "reason"],
            registry=r,
        )  # fmt: skip
        self.version_events = Counter(
            "tokenmill_model_version_events", "Rollout events: loaded, load_failed, probe_failed, promoted, "
            "rolled_back, unloaded.", [*mv, "event"], registry=r,
        )  # fmt: skip
        # -- LoRA adapters: requests and tokens per adapter (the base model's requests are not counted) --
        self.lora_requests = Counter("tokenmill_lora_requests", "Requests on a LoRA adapter that ended, by "
                                     "adapter (`lora`) and status.", [*mv, "lora", "status"], registry=r)  # fmt: skip
        self.lora_tokens = Counter("tokenmill_lora_generation_tokens", "Tokens generated on a LoRA adapter.",
                                   [*mv, "lora"], registry=r)  # fmt: skip
        self.lora_feedback = Counter("tokenmill_lora_feedback_ratings", "Ratings received on POST /v1/feedback "
                                     "of requests on a LoRA adapter, by adapter and rating.", [*mv, "lora", "rating"],
                                     registry=r)  # fmt: skip
        # -- structured outputs (server/prompt/structured.py) --
        self.grammar_compile = _histogram(
            r, "tokenmill_grammar_compile_seconds", "Grammar compiles (cache misses) from submit to answer, by "
            "outcome: ok, error (does not compile, too large, allows nothing), timeout (stopped at the budget).",
            [*mv, "outcome"],
        )  # fmt: skip
        self.grammar_rejections = Counter(
            "tokenmill_grammar_rejections", "Requests refused for their grammar, by reason (source_too_large, "
            "compiled_too_large, invalid, allows_nothing, timeout, queue_full, no_backend; no_next_token: it "
            "allowed no token during generation).", [*mv, "reason"], registry=r,
        )  # fmt: skip
        ProcessCollector(registry=r)
        PlatformCollector(registry=r)
        r.register(_EngineCollector(self, versions, cache_stats))

    def clock_wall(self) -> float:
        """Wall-clock seconds (the value of vllm:lora_requests_info)."""
        return time.time()

    def version(self, model: str, version: str) -> VersionMetrics:
        """The series of one model version (created at 0 on first use; kept after it unloads)."""
        key = (model, version)
        if key not in self._versions:
            self._versions[key] = VersionMetrics(self, model, version)
        return self._versions[key]

    def render(self) -> bytes:
        return generate_latest(self.registry)


class VersionMetrics:
    """What one model version's worker and routes observe, with its `model` and `version` labels bound."""

    def __init__(self, metrics: ServerMetrics, model: str, version: str) -> None:
        self._m = metrics
        self.labels = (model, version)
        self._clock = metrics.clock
        self.last_step_at = self._clock()  # of the last engine step that ran; from creation until the first
        m, mv = metrics, self.labels
        # Children resolved once: the worker observes these per step and per token.
        self._step_by_phase = {phase: m.step_time.labels(*mv, phase) for phase in PHASES}
        self._step_tokens = m.step_tokens.labels(*mv)
        self._gap_by_lane = {lane: m.token_gap.labels(*mv, lane.label) for lane in Lane}
        self._vllm = m.vllm.bind(model)
        self.cache_hits = m.cache_hits.labels(*mv)
        self.cache_misses = m.cache_misses.labels(*mv)
        self.cache_evictions = m.cache_evictions.labels(*mv)
        self._create_series()

    def _create_series(self) -> None:
        """Every lane's series exist at 0 from the start: rate() then counts a lane's first requests too
        (a series that appears with a value has no earlier sample to rise from), and shows 0, not nothing."""
        m, mv = self._m, self.labels
        for lane in Lane:
            label = lane.label
            for status, reasons in REASONS.items():
                for reason in reasons:
                    m.requests.labels(*mv, label, status, reason)
                if status != "rejected":
                    m.e2e.labels(*mv, label, status)
            for reason in REASONS["rejected"][:2]:
                m.rejections.labels(*mv, label, reason)
            for histogram in (m.ttft, m.queue_time, m.prefill_time, m.decode_time, m.prompt_len, m.generation_len):
                histogram.labels(*mv, label)
        for reason in REASONS["ok"]:
            m.finished.labels(*mv, reason)
        for rating in RATINGS:
            m.feedback.labels(*mv, str(rating))

    # -- worker thread -----------------------------------------------------------------------------------
    def observe_step(self, stats: EngineStats) -> None:
        """An engine step ran; `stats` is read right after it."""
        self.last_step_at = self._clock()
        prefill, decode = stats.last_step_prefill_tokens, stats.last_step_decode_tokens
        phase = "mixed" if prefill and decode else ("prefill" if prefill else "decode")
        self._step_by_phase[phase].observe(stats.last_step_time_s)
        self._step_tokens.observe(stats.last_step_tokens)
        self._vllm.iteration_tokens.observe(stats.last_step_tokens)

    def observe_token_gap(self, lane: Lane, seconds: float) -> None:
        """A request got a token `seconds` after its previous one."""
        self._gap_by_lane[lane].observe(seconds)
        self._vllm.itl.observe(seconds)
        self._vllm.tpot.observe(seconds)

    def observe_finished(self, lane: Lane, status: str, reason: str, lengths: tuple[int, int],
                         timing: dict[str, float | None], params: tuple[int, int] | None = None,
                         lora: str | None = None) -> None:  # fmt: skip
        """An admitted request ended, any outcome. `lengths`: (prompt, generated) tokens; `timing`: seconds
        since arrival of start (`queue_s`), first token (`ttft_s`) and end (`e2e_s`), None if it never came;
        `params`: (max_tokens, n) when this ticket stands for its client request (its first choice), else
        None. Feeds the `tokenmill_*` series and their vLLM twins from the same values."""
        m, mv, label, v = self._m, self.labels, lane.label, self._vllm
        m.requests.labels(*mv, label, status, reason).inc()
        if lora is not None:  # `lora`: the adapter it ran on
            m.lora_requests.labels(*mv, lora, status).inc()
            m.lora_tokens.labels(*mv, lora).inc(lengths[1])
        if status == "ok":
            m.finished.labels(*mv, reason).inc()
        v.success[vllm_finished_reason(status, reason)].inc()
        queue_s, ttft_s, e2e_s = timing.get("queue_s"), timing.get("ttft_s"), timing.get("e2e_s")
        waited = queue_s if queue_s is not None else e2e_s  # never started: it waited until it ended
        if waited is not None:
            _observe(waited, m.queue_time.labels(*mv, label), v.queue_time)
        if ttft_s is not None:
            _observe(ttft_s, m.ttft.labels(*mv, label), v.ttft)
            if queue_s is not None:
                _observe(max(ttft_s - queue_s, 0.0), m.prefill_time.labels(*mv, label), v.prefill_time)
            if e2e_s is not None:
                decode_s = max(e2e_s - ttft_s, 0.0)
                _observe(decode_s, m.decode_time.labels(*mv, label), v.decode_time)
                if lengths[1] > 1:  # the request's mean gap between tokens
                    v.request_tpot.observe(decode_s / (lengths[1] - 1))
        if e2e_s is not None:
            _observe(e2e_s, m.e2e.labels(*mv, label, status), v.e2e)
            if queue_s is not None:  # it ran: scheduled until its end (prefill + decode)
                v.inference_time.observe(max(e2e_s - queue_s, 0.0))
        _observe(lengths[0], m.prompt_len.labels(*mv, label), v.prompt_len)
        _observe(lengths[1], m.generation_len.labels(*mv, label), v.generation_len)
        if params is not None:
            v.max_tokens.observe(params[0])
            v.n.observe(params[1])

    # -- event loop --------------------------------------------------------------------------------------
    def observe_rejected(self, lane: Lane, reason: str) -> None:
        """A request was refused at admission with 429 (`reason`: queue_requests or queue_tokens)."""
        self._m.requests.labels(*self.labels, lane.label, "rejected", reason).inc()
        self._m.rejections.labels(*self.labels, lane.label, reason).inc()

    def observe_grammar_compile(self, outcome: str, seconds: float) -> None:
        self._m.grammar_compile.labels(*self.labels, outcome).observe(seconds)

    def observe_grammar_rejected(self, reason: str) -> None:
        self._m.grammar_rejections.labels(*self.labels, reason).inc()

    def observe_feedback(self, rating: int, lora: str | None = None) -> None:
        """A rating of a request of this version; `lora`: the adapter that request ran on."""
        self._m.feedback.labels(*self.labels, str(rating)).inc()
        if lora is not None:
            self._m.lora_feedback.labels(*self.labels, lora, str(rating)).inc()

    def observe_event(self, event: str) -> None:
        """A rollout event of this version (loaded, promoted, ...)."""
        self._m.version_events.labels(*self.labels, event).inc()

    def seconds_since_last_step(self) -> float:
        return max(self._clock() - self.last_step_at, 0.0)


def _observe(value: float, *histograms: Histogram) -> None:
    """One observation into a `tokenmill_*` series and its vLLM twin."""
    for h in histograms:
        h.observe(value)


class VllmSeries:
    """vLLM v1's request and step series (its names, types, buckets and `model_name`/`engine` labels),
    fed by VersionMetrics from the same observations as the `tokenmill_*` ones."""

    def __init__(self, registry: CollectorRegistry, max_model_len: int) -> None:
        r, labels, tokens = registry, ["model_name", "engine"], build_1_2_5_buckets(max_model_len)

        def h(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets, registry=r)

        self.ttft = h("vllm:time_to_first_token_seconds", "Arrival to first token.", VLLM_TTFT_BUCKETS)
        self.e2e = h("vllm:e2e_request_latency_seconds", "Arrival to the end of a request, every outcome but "
                     "429.", VLLM_REQUEST_BUCKETS)  # fmt: skip
        self.itl = h("vllm:inter_token_latency_seconds", "Time between two consecutive tokens of a request.",
                     VLLM_ITL_BUCKETS)  # fmt: skip
        self.tpot = h("vllm:time_per_output_token_seconds", "Same observations as vllm:inter_token_latency_seconds "
                      "(the name before vLLM 0.10).", VLLM_ITL_BUCKETS)  # fmt: skip
        self.request_tpot = h("vllm:request_time_per_output_token_seconds", "Per request: first token to the "
                              "end over generated tokens - 1.", VLLM_ITL_BUCKETS)  # fmt: skip
        self.queue_time = h("vllm:request_queue_time_seconds", "Arrival until the request left its lane.",
                            VLLM_REQUEST_BUCKETS)  # fmt: skip
        self.prefill_time = h("vllm:request_prefill_time_seconds", "Start in the engine to first token.",
                              VLLM_REQUEST_BUCKETS)  # fmt: skip
        self.decode_time = h("vllm:request_decode_time_seconds", "First token to the end of the request.",
                             VLLM_REQUEST_BUCKETS)  # fmt: skip
        self.inference_time = h("vllm:request_inference_time_seconds", "Start in the engine to the end of the "
                                "request (prefill + decode).", VLLM_REQUEST_BUCKETS)  # fmt: skip
        self.prompt_len = h("vllm:request_prompt_tokens", "Prompt length of admitted requests.", tokens)
        self.generation_len = h("vllm:request_generation_tokens", "Tokens generated per admitted request.", tokens)
        self.max_tokens = h("vllm:request_params_max_tokens", "max_tokens of admitted client requests.", tokens)
        self.n = h("vllm:request_params_n", "Choices per prompt (n) of admitted client requests.", VLLM_N_BUCKETS)
        self.iteration_tokens = h("vllm:iteration_tokens_total", "Tokens (prompt chunks + decodes) in one engine "
                                  "step.", VLLM_ITERATION_BUCKETS)  # fmt: skip
        self.success = Counter("vllm:request_success", "Requests that ended, by finish reason (stop, length; "
                               "abort: timed out or cancelled; error).", [*labels, "finished_reason"],
                               registry=r)  # fmt: skip

    def bind(self, model_name: str) -> VllmChildren:
        return VllmChildren(self, model_name)


class VllmChildren:
    """VllmSeries' children of one served model (`model_name`, engine "0"), resolved once."""

    def __init__(self, series: VllmSeries, model_name: str) -> None:
        s, labels = series, (model_name, VLLM_ENGINE)
        self.ttft, self.e2e = s.ttft.labels(*labels), s.e2e.labels(*labels)
        self.itl, self.tpot = s.itl.labels(*labels), s.tpot.labels(*labels)
        self.request_tpot = s.request_tpot.labels(*labels)
        self.queue_time, self.prefill_time = s.queue_time.labels(*labels), s.prefill_time.labels(*labels)
        self.decode_time, self.inference_time = s.decode_time.labels(*labels), s.inference_time.labels(*labels)
        self.prompt_len, self.generation_len = s.prompt_len.labels(*labels), s.generation_len.labels(*labels)
        self.max_tokens, self.n = s.max_tokens.labels(*labels), s.n.labels(*labels)
        self.iteration_tokens = s.iteration_tokens.labels(*labels)
        # every reason at 0 from the start, as the tokenmill_* outcome series
        self.success = {reason: s.success.labels(*labels, reason) for reason in VLLM_REASONS}


def _histogram(registry: CollectorRegistry, name: str, doc: str, labels: list[str],
               buckets: tuple[float, ...] = LATENCY_BUCKETS) -> Histogram:  # fmt: skip
    return Histogram(name, doc, labels, buckets=buckets, registry=registry)


class _EngineCollector(Collector):
    """Per loaded version: engine stats, lane depth and rollout state, read when scraped; the response
    cache's size; device memory once (it is the process's)."""

    def __init__(self, metrics: ServerMetrics, versions: Callable[[], list[VersionSnapshot]],
                 cache_stats: Callable[[], list[CacheStats]]) -> None:  # fmt: skip
        self._metrics = metrics
        self._versions = versions
        self._cache_stats = cache_stats

    def collect(self) -> Iterator[Metric]:
        versions = self._versions()
        families = _VersionFamilies()
        for v in versions:
            families.add(v, self._metrics.server_version)
        yield from families.all()
        yield from router_families(versions, self._metrics.clock_wall())
        yield from spec_decode_families(versions)
        yield from vllm_engine_counters(versions)
        yield from _cache_gauges(self._cache_stats())
        yield from _grammar_gauges(versions)
        memory = next((v.snapshot.memory for v in versions if v.snapshot.memory is not None), None)
        yield from _memory_gauges(memory)


_MV = ["model", "version"]


class _VersionFamilies:
    """The scrape-time families, one sample per loaded version (and lane or cause)."""

    def __init__(self) -> None:
        g = GaugeMetricFamily
        self.gauges = {
            "running": g("tokenmill_num_requests_running", "Requests in the engine's running batch.", labels=_MV),
            "waiting": g("tokenmill_num_requests_waiting", "Preempted requests waiting to resume (those never "
                         "scheduled yet are tokenmill_queue_depth, by lane; all of them: "
                         "tokenmill_requests_waiting).", labels=_MV),
            "all_waiting": g("tokenmill_requests_waiting", "Every request admitted and not running: queued in a "
                             "lane (never scheduled yet) or preempted (vllm:num_requests_waiting).", labels=_MV),
            "usage": g("tokenmill_kv_cache_usage_ratio", "Share of KV blocks held by requests (0-1).", labels=_MV),
            "usage_perc": g("tokenmill_kv_cache_usage_perc", "Same as tokenmill_kv_cache_usage_ratio (vLLM's name; "
                            "0-1).", labels=_MV),
            "used": g("tokenmill_kv_blocks_used", "KV blocks held by requests.", labels=_MV),
            "capacity": g("tokenmill_kv_blocks_capacity", "KV blocks in the cache (used + free).", labels=_MV),
            "since": g("tokenmill_seconds_since_last_step", "Seconds since the engine last ran a step (since "
                       "start when it never did); grows while idle too.", labels=_MV),
            "alive": g("tokenmill_worker_alive", "1 while the engine worker thread runs.", labels=_MV),
            "weight": g("tokenmill_canary_weight", "Share of new requests (0-100) sent to a canary version.",
                        labels=_MV),
            "threads": g("tokenmill_engine_threads", "CPU threads the engine's last step ran at (the adaptive "
                         "count: fewer while another process holds a core); 0: fixed or not a CPU engine.",
                         labels=_MV),
        }  # fmt: skip
        self.info = g("tokenmill_model_info", "A loaded model version and the build serving it (value 1).",
                      labels=[*_MV, "dtype", "device", "server_version", "max_model_len"])  # fmt: skip
        self.cache_config = g("tokenmill_cache_config_info", "The KV cache of a loaded version (value 1): tokens "
                              "per block and blocks (vllm:cache_config_info).",
                              labels=[*_MV, "block_size", "num_gpu_blocks"])  # fmt: skip
        self.state = g("tokenmill_model_version", "A loaded model version's state (loading, ready, draining) and "
                       "role (promoted, canary, previous, candidate); value 1.",
                       labels=[*_MV, "state", "role"])  # fmt: skip
        self.depth = g("tokenmill_queue_depth", "Requests waiting in an admission lane.", labels=[*_MV, "lane"])
        self.tokens = g("tokenmill_queue_tokens", "Tokens (prompt + max) queued in a lane.", labels=[*_MV, "lane"])
        self.preemptions = CounterMetricFamily(
            "tokenmill_preemptions", "Running requests that gave way to more important ones, by the victim's "
            "lane and cause: slots (max_num_seqs), kv (KV blocks), budget (the step's token budget).",
            labels=[*_MV, "lane", "cause"],
        )  # fmt: skip
        self.counters = {
            name: CounterMetricFamily(name, doc, labels=_MV) for name, doc in _ENGINE_COUNTERS.items()
        }

    def add(self, v: VersionSnapshot, server_version: str) -> None:
        mv = [v.info.model, v.info.version]
        st = v.snapshot.stats
        values = {"running": st.running, "waiting": st.waiting_preempted, "usage": st.kv_cache_usage,
                  "all_waiting": waiting_total(v.snapshot),
                  "usage_perc": st.kv_cache_usage, "used": st.kv_blocks_used, "capacity": st.kv_blocks_total,
                  "since": v.seconds_since_last_step, "alive": int(v.snapshot.worker_alive),
                  "weight": v.canary_weight, "threads": st.cpu_threads}  # fmt: skip
        for key, value in values.items():
            self.gauges[key].add_metric(mv, value)
        i = v.info
        self.info.add_metric([*mv, i.dtype, i.device, server_version, str(i.max_model_len)], 1)
        self.cache_config.add_metric([*mv, str(st.block_size), str(st.kv_blocks_total)], 1)
        self.state.add_metric([*mv, v.state, v.role], 1)
        for lane, (requests, queued_tokens) in v.snapshot.lanes.items():
            self.depth.add_metric([*mv, lane.label], requests)
            self.tokens.add_metric([*mv, lane.label], queued_tokens)
        counts = {(lane.label, cause.value): 0 for lane in Lane for cause in PreemptionCause}
        for (priority, cause), n in st.preemptions_by.items():
            counts[(lane_label(priority), cause.value)] = n
        for labels, n in sorted(counts.items()):
            self.preemptions.add_metric([*mv, *labels], n)
        for name, value in (("tokenmill_prompt_tokens", st.prompt_tokens),
                            ("tokenmill_generation_tokens", st.generation_tokens),
                            ("tokenmill_num_preemptions", st.preemptions),
                            ("tokenmill_prefix_cache_queries", st.prefix_cache_queries),
                            ("tokenmill_prefix_cache_hits", st.prefix_cache_hits),
                            ("tokenmill_engine_steps", st.steps),
                            ("tokenmill_engine_thread_switches", st.cpu_thread_switches)):  # fmt: skip
            self.counters[name].add_metric(mv, value)

    def all(self) -> Iterator[Metric]:
        yield from self.gauges.values()
        yield self.info
        yield self.cache_config
        yield self.state
        yield self.depth
        yield self.tokens
        yield self.preemptions
        yield from self.counters.values()


_ENGINE_COUNTERS = {
    "tokenmill_prompt_tokens": "Prompt tokens computed by the engine (prefill work: prefix-cache hits excluded, "
    "recomputation after preemption included).",
    "tokenmill_generation_tokens": "Tokens sampled by the engine.",
    "tokenmill_num_preemptions": "Requests preempted by the engine.",
    "tokenmill_prefix_cache_queries": "Prompt tokens looked up in the prefix cache.",
    "tokenmill_prefix_cache_hits": "Prompt tokens found in the prefix cache.",
    "tokenmill_engine_steps": "Engine steps run.",
    "tokenmill_engine_thread_switches": "Times the adaptive CPU thread count changed (a core taken or freed).",
}


def waiting_total(snapshot: Snapshot) -> int:
    """Requests admitted and not running: queued in a lane (admitted, never scheduled) + preempted."""
    return sum(requests for requests, _ in snapshot.lanes.values()) + snapshot.stats.waiting_preempted


def router_families(versions: list[VersionSnapshot], now: float) -> Iterator[Metric]:
    """The Gateway API Inference Extension's model-server protocol under vLLM's names, one series per
    `model_name` (the versions of one model summed: a router balances replicas, not versions).
    `vllm:lora_requests_info` names the LoRA adapters with requests running and waiting (comma-separated,
    vLLM's labels; the versions' summed; waiting includes requests still in a lane), and its value is the
    time, as vLLM's. KV usage goes out under both names, `vllm:kv_cache_usage_perc` and the older
    `vllm:gpu_cache_usage_perc`."""
    g = GaugeMetricFamily
    waiting = g("vllm:num_requests_waiting", "Requests admitted and not running (lanes + preempted).",
                labels=["model_name"])  # fmt: skip
    running = g("vllm:num_requests_running", "Requests in the engine's running batch.", labels=["model_name"])
    usage = g("vllm:kv_cache_usage_perc", "Share of KV blocks held by requests (0-1).", labels=["model_name"])
    # vLLM's name before v1 (0.10 dropped it), still read by production-stack's router and AIBrix
    old_usage = g("vllm:gpu_cache_usage_perc", "Share of KV blocks held by requests (0-1); the same as "
                  "vllm:kv_cache_usage_perc, under vLLM's older name.", labels=["model_name"])  # fmt: skip
    config = g("vllm:cache_config_info", "KV cache configuration (value 1).",
               labels=["model_name", "block_size", "num_gpu_blocks"])  # fmt: skip
    lora = g("vllm:lora_requests_info", "LoRA adapters with requests running and waiting; value: the time.",
             labels=["model_name", "max_lora", "running_lora_adapters", "waiting_lora_adapters"])  # fmt: skip
    by_name: dict[str, list[VersionSnapshot]] = {}
    for v in versions:
        by_name.setdefault(v.info.model, []).append(v)
    for name, group in by_name.items():
        stats = [v.snapshot.stats for v in group]
        waiting.add_metric([name], sum(waiting_total(v.snapshot) for v in group))
        running.add_metric([name], sum(st.running for st in stats))
        total = sum(st.kv_blocks_total for st in stats)
        share = sum(st.kv_blocks_used for st in stats) / total if total else 0.0
        usage.add_metric([name], share)
        old_usage.add_metric([name], share)
        head = next((v for v in group if v.role == "promoted"), group[0]).snapshot.stats
        config.add_metric([name, str(head.block_size), str(head.kv_blocks_total)], 1)
        running_loras = sorted({a for st in stats for a in st.lora_running})
        waiting_loras = sorted({a for st in stats for a in st.lora_waiting}
                               | {a for v in group for a in v.snapshot.waiting_adapters})  # fmt: skip
        lora.add_metric([name, str(head.max_loras), ",".join(running_loras), ",".join(waiting_loras)], now)
    yield from (waiting, running, usage, old_usage, config, lora)


_VLLM_COUNTERS = {  # vLLM's name -> (the EngineStats field, also tokenmill_<field>_total's; help)
    "vllm:prompt_tokens": ("prompt_tokens", "Prompt tokens computed (prefill: prefix-cache hits excluded)."),
    "vllm:generation_tokens": ("generation_tokens", "Tokens sampled."),
    "vllm:num_preemptions": ("preemptions", "Requests preempted by the engine."),
    "vllm:prefix_cache_queries": ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache."),
    "vllm:prefix_cache_hits": ("prefix_cache_hits", "Prompt tokens found in the prefix cache."),
}


def vllm_engine_counters(versions: list[VersionSnapshot]) -> Iterator[Metric]:
    """The engine's cumulative counters under vLLM's names, per `model_name` (the loaded versions of one
    model summed; a version that unloads takes its part with it, which rate() reads as a reset), engine "0";
    the same EngineStats fields as tokenmill_prompt_tokens_total and its neighbours."""
    families = {name: CounterMetricFamily(name, doc, labels=["model_name", "engine"])
                for name, (_, doc) in _VLLM_COUNTERS.items()}  # fmt: skip
    by_name: dict[str, list[EngineStats]] = {}
    for v in versions:
        by_name.setdefault(v.info.model, []).append(v.snapshot.stats)
    for model_name, stats in by_name.items():
        for name, (field, _) in _VLLM_COUNTERS.items():
            families[name].add_metric([model_name, VLLM_ENGINE], sum(getattr(st, field) for st in stats))
    yield from families.values()


def spec_decode_families(versions: list[VersionSnapshot]) -> Iterator[Metric]:
    """Speculative decoding's counters under vLLM's names, per `model_name` (versions summed): rows
    verified with drafts, draft tokens, accepted drafts, and accepted drafts by position (0 first)."""
    c = CounterMetricFamily
    drafts = c("vllm:spec_decode_num_drafts", "Rows verified with draft tokens.", labels=["model_name"])
    tokens = c("vllm:spec_decode_num_draft_tokens", "Draft tokens verified.", labels=["model_name"])
    accepted = c("vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted.", labels=["model_name"])
    per_pos = c("vllm:spec_decode_num_accepted_tokens_per_pos", "Draft tokens accepted at each draft position.",
                labels=["model_name", "position"])  # fmt: skip
    by_name: dict[str, list[EngineStats]] = {}
    for v in versions:
        by_name.setdefault(v.info.model, []).append(v.snapshot.stats)
    for name, stats in by_name.items():
        drafts.add_metric([name], sum(st.spec_drafts for st in stats))
        tokens.add_metric([name], sum(st.spec_draft_tokens for st in stats))
        accepted.add_metric([name], sum(st.spec_accepted_tokens for st in stats))
        width = max(len(st.spec_accepted_per_pos) for st in stats)
        for pos in range(width):
            n = sum(st.spec_accepted_per_pos[pos] for st in stats if pos < len(st.spec_accepted_per_pos))
            per_pos.add_metric([name, str(pos)], n)
    yield from (drafts, tokens, accepted, per_pos)


def _cache_gauges(stats: list[CacheStats]) -> Iterator[Metric]:
    entries = GaugeMetricFamily("tokenmill_response_cache_entries", "Responses held in the response cache.",
                                labels=_MV)  # fmt: skip
    size = GaugeMetricFamily("tokenmill_response_cache_bytes", "Estimated bytes held by the response cache "
                             "(what its byte bound counts).", labels=_MV)  # fmt: skip
    for s in stats:
        entries.add_metric([s.model, s.version], s.entries)
        size.add_metric([s.model, s.version], s.bytes)
    yield entries
    yield size


def _grammar_gauges(versions: list[VersionSnapshot]) -> Iterator[Metric]:
    entries = GaugeMetricFamily("tokenmill_grammar_cache_entries", "Compiled grammars held in a version's "
                                "grammar cache.", labels=_MV)  # fmt: skip
    size = GaugeMetricFamily("tokenmill_grammar_cache_bytes", "Bytes of compiled grammars held in a version's "
                             "grammar cache (what structured_cache_bytes bounds).", labels=_MV)  # fmt: skip
    for v in versions:
        if v.snapshot.grammar_cache is not None:
            entries.add_metric([v.info.model, v.info.version], v.snapshot.grammar_cache[0])
            size.add_metric([v.info.model, v.info.version], v.snapshot.grammar_cache[1])
    yield entries
    yield size


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
