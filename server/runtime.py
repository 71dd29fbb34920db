"""What one app shares, built in the lifespan and kept on `app.state.runtime`: settings, the loaded
model versions (server/registry.py; each version has its own engine, worker thread, admission counters
and tokenizer copy, server/deployment.py), the rollout operations, the response cache, request records
and feedback, metrics, readiness and drain.
"""

from __future__ import annotations

import asyncio
import enum
import importlib.metadata
import json
import logging
import math
import time
from typing import Any

from engine.api import Deadline, EngineProtocol
from server.admission import Lane
from server.deployment import Deployment, VersionState
from server.errors import ApiError
from server.feedback import FeedbackStore, RequestRecord, RequestRecords
from server.metrics import CacheStats, ServerMetrics, VersionSnapshot
from server.registry import ModelRegistry
from server.response_cache import CacheKey, ResponseCache
from server.rollout import Rollout, VersionLoader
from server.settings import ServerSettings
from server.ticket import ServerError, Ticket
from server.tokens import PromptCodec
from server.versions import ModelSpec
from server.worker import Rejection, Worker

log = logging.getLogger("tokenmill.server")
request_log = logging.getLogger("tokenmill.requests")

_FLUSH_AFTER_ABORT_S = 5.0


class Status(str, enum.Enum):
    STARTING = "starting"  # loaded, warm-up not done
    OK = "ok"
    DRAINING = "draining"  # shutting down: finishing in-flight requests, refusing new ones
    UNHEALTHY = "unhealthy"  # worker dead or stalled, or warm-up failed


def demo_model_path() -> str:
    """The embedded tiny demo model (built on first use, cached)."""
    from engine.testing.make_model import ensure_model

    return str(ensure_model("tiny-llama"))


def build_engine(settings: ServerSettings) -> EngineProtocol:
    """Load the model named by the settings (blocking: call it in a thread). Imports torch."""
    from engine import Engine

    return Engine(settings.engine_config(settings.model or demo_model_path()))


def load_version(settings: ServerSettings, spec: ModelSpec, kv_cache_memory: int | None) -> EngineProtocol:
    """Load one model version with the server's settings (and its own KV budget when given). Blocking."""
    update: dict[str, Any] = {"model": spec.path}
    if kv_cache_memory is not None:
        update["kv_cache_memory"] = kv_cache_memory
    return build_engine(settings.model_copy(update=update))


class Runtime:
    """The app's shared state: the registry of loaded model versions (each with its own engine, worker
    and admission counters), the response cache, request records and feedback, metrics, readiness and
    drain. Methods run on the event loop unless they say otherwise."""

    def __init__(
        self,
        settings: ServerSettings,
        initial: list[tuple[ModelSpec, EngineProtocol, set[str]]],
        loader: VersionLoader,
        feedback: FeedbackStore | None = None,
    ) -> None:
        self.settings = settings
        self.loop = asyncio.get_running_loop()
        self.metrics = ServerMetrics(_version(), self._snapshots, cache_stats=self._cache_stats)
        self.cache = ResponseCache(settings.response_cache_bytes, settings.response_cache_ttl_s,
                                   on_evict=self._on_evict)  # fmt: skip
        self.records = RequestRecords(settings.request_records, settings.request_record_ttl_s)
        self.feedback = feedback
        self.models = ModelRegistry()
        for spec, engine, aliases in initial:
            self.models.add_slot(self.new_deployment(spec, engine), aliases)
        self.rollout = Rollout(self, loader)
        self.started_at = time.monotonic()
        self.created = int(time.time())
        self.ready = False  # warm-up of the startup versions done
        self.draining = False
        self.failure: str | None = None
        self.open_responses = 0  # request handles not closed yet (their responses are still being sent)
        self._tasks: set[asyncio.Task] = set()

    def new_deployment(self, spec: ModelSpec, engine: EngineProtocol) -> Deployment:
        return Deployment(spec, engine, self.settings, self.metrics.version(spec.name, spec.version), self._on_finish)

    # -- the default model's promoted version (what single-model code and /health report) -------------
    @property
    def primary(self) -> Deployment:
        slot = self.models.default
        return slot.versions[slot.promoted]

    @property
    def worker(self) -> Worker:
        return self.primary.worker

    @property
    def codec(self) -> PromptCodec:
        return self.primary.codec

    @property
    def max_model_len(self) -> int:
        return self.primary.max_model_len

    @property
    def model_name(self) -> str:
        return self.models.default.name

    @property
    def engine_desc(self) -> dict[str, str]:
        return self.primary.engine_desc

    # -- lifecycle -----------------------------------------------------------------------------------
    def start(self) -> None:
        """Start every worker thread and, in the background, the warm-up."""
        for _, dep in self.models.deployments():
            dep.start()
        task = self.loop.create_task(self.warm_up())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def close(self) -> None:
        """Abort what is left and stop the workers (end of the lifespan)."""
        self.draining = True
        for task in list(self._tasks):
            task.cancel()
        await self.rollout.close()
        await asyncio.gather(*(dep.unload() for _, dep in self.models.deployments()))
        if self.feedback is not None:
            await asyncio.to_thread(self.feedback.close)

    async def warm_up(self) -> None:
        """One short greedy generation per startup version; ready only if every one works."""
        deployments = [dep for _, dep in self.models.deployments()]
        try:
            if self.settings.warmup:
                for dep in deployments:
                    await dep.warm_up(math.inf)
            for dep in deployments:
                dep.state, dep.ready_at = VersionState.READY, time.time()
            self.ready = True
            log.info("warm-up done: %s ready", ", ".join(dep.spec.ref for dep in deployments))
        except Exception as exc:
            self.failure = f"warm-up failed: {exc}"
            log.error(self.failure)

    async def drain(self) -> None:
        """Refuse new requests, let in-flight ones finish within drain_timeout_s, abort the rest with an
        error (event), and return once their responses were sent (or a few seconds passed)."""
        self.draining = True
        timeout = self.settings.drain_timeout_s
        log.info("draining: %d requests in flight, up to %.0fs", self._in_flight(), timeout)
        deadline = self.loop.time() + timeout
        while (self.open_responses or self._in_flight()) and self.loop.time() < deadline:
            await asyncio.sleep(0.05)
        if self._in_flight():
            log.warning("drain timeout: aborting %d requests", self._in_flight())
            error = ServerError("shutdown", f"the server shut down (drain timeout {timeout:g}s)", 503)
            for _, dep in self.models.deployments():
                dep.worker.abort_all(error)
        end = self.loop.time() + _FLUSH_AFTER_ABORT_S
        while self.open_responses and self.loop.time() < end:
            await asyncio.sleep(0.05)
        log.info("drained")

    def _in_flight(self) -> int:
        return sum(dep.worker.in_flight() for _, dep in self.models.deployments())

    # -- state ---------------------------------------------------------------------------------------
    def status(self) -> tuple[Status, str | None]:
        """Readiness, from the promoted version of every model: a candidate that fails never changes it."""
        if self.draining:
            return Status.DRAINING, "the server is shutting down"
        promoted = self.models.promoted()
        dead = [dep.spec.ref for dep in promoted if not dep.worker.alive]
        if dead:
            return Status.UNHEALTHY, "the engine worker is not running" + (f" ({', '.join(dead)})" if len(promoted) > 1 else "")
        if self.failure:
            return Status.UNHEALTHY, self.failure
        for dep in promoted:
            stalled_s = time.monotonic() - dep.worker.heartbeat
            if dep.worker.in_flight() and stalled_s > self.settings.stall_timeout_s:
                return Status.UNHEALTHY, f"the busy engine has not completed a step for {stalled_s:.0f}s"
        if not self.ready:
            return Status.STARTING, "warming up"
        return Status.OK, None

    def check_accepting(self) -> None:
        """Raise ApiError 503 unless new requests are taken now. A stalled engine still queues them:
        the lane bounds and deadlines protect it."""
        if self.draining:
            status, reason = Status.DRAINING, "the server is shutting down"
        elif any(not dep.worker.alive for dep in self.models.promoted()):
            status, reason = Status.UNHEALTHY, "the engine worker is not running"
        elif self.failure:
            status, reason = Status.UNHEALTHY, self.failure
        elif not self.ready:
            status, reason = Status.STARTING, "the server is warming up"
        else:
            return
        raise ApiError(503, status.value, reason, headers={"Retry-After": "1"})

    def lane_for_size(self, tokens: int) -> Lane:
        return Lane.INTERACTIVE if tokens <= self.settings.short_request_tokens else Lane.STANDARD

    def _snapshots(self) -> list[VersionSnapshot]:
        out = []
        for slot, dep in self.models.deployments():
            if dep.state is VersionState.UNLOADED:
                continue
            weight = slot.weight if slot.canary == dep.version else 0
            out.append(dep.snapshot(slot.role(dep.version), weight))
        return out

    def _cache_stats(self) -> list[CacheStats]:
        return self.cache.stats()

    def _on_evict(self, key: CacheKey) -> None:
        self.metrics.version(key.model, key.version).cache_evictions.inc()

    # -- accounting (metrics + one JSON log line per request) --------------------------------------------
    def record_rejection(self, dep: Deployment, ticket: Ticket, rejection: Rejection) -> None:
        dep.metrics.observe_rejected(ticket.lane, rejection.reason)
        request_log.info(json.dumps({
            "event": "request", "id": ticket.request_id, "model": dep.name, "version": dep.version,
            "lane": ticket.lane.label, "status": "rejected", "reason": rejection.reason, "finish_reason": None,
            "prompt_tokens": len(ticket.prompt_token_ids), "retry_after_s": rejection.retry_after_s,
        }))  # fmt: skip

    def _on_finish(self, dep: Deployment, ticket: Ticket) -> None:
        """Runs on the version's worker thread when any admitted request ends."""
        if ticket.internal:
            return
        status, reason = request_status(ticket)
        timing = ticket.timing()
        lengths = (len(ticket.prompt_token_ids), ticket.completion_tokens)
        dep.metrics.observe_finished(ticket.lane, status, reason, lengths, timing)
        self._account(dep, ticket, status, reason, cached=False)

    def on_cache_hit(self, dep: Deployment, ticket: Ticket) -> None:
        """A request answered from the response cache: counted, timed, logged and recorded (for feedback)
        like any other; the engine counters do not move."""
        reason = ticket.finish_reason or "stop"
        lengths = (len(ticket.prompt_token_ids), ticket.completion_tokens)
        dep.metrics.observe_finished(ticket.lane, "ok", reason, lengths, ticket.timing())
        self._account(dep, ticket, "ok", reason, cached=True)

    def _account(self, dep: Deployment, ticket: Ticket, status: str, reason: str, cached: bool) -> None:
        timing = ticket.timing()
        line: dict[str, Any] = {
            "event": "request", "id": ticket.request_id, "model": dep.name, "version": dep.version,
            "lane": ticket.lane.label, "status": status, "reason": reason, "finish_reason": ticket.finish_reason,
            "prompt_tokens": len(ticket.prompt_token_ids), "completion_tokens": ticket.completion_tokens,
            "cached_tokens": ticket.cached_tokens, **timing, "kv_blocks_peak": ticket.kv_blocks_peak,
            "response_cached": cached,
        }  # fmt: skip
        if ticket.error is not None:
            line["error"] = ticket.error.message
        if self.settings.log_prompts:
            line["prompt_token_ids"] = ticket.prompt_token_ids
            line["output_token_ids"] = ticket.output_token_ids
        request_log.info(json.dumps(line))
        self.records.put(RequestRecord(
            ticket.request_id, dep.name, dep.version, ticket.lane.label, status, ticket.finish_reason,
            len(ticket.prompt_token_ids), ticket.completion_tokens, ticket.cached_tokens, timing["queue_s"],
            timing["ttft_s"], timing["e2e_s"], ticket.kv_blocks_peak, ticket.preemptions, cached, time.time(),
        ))  # fmt: skip


def request_status(ticket: Ticket) -> tuple[str, str]:
    """(status, reason) of an ended request, as metrics and the request log label it (server/metrics.py
    REASONS lists them)."""
    if ticket.error is not None:
        kind = ticket.error.kind
        return _ERROR_STATUS.get(kind, ("error", kind if kind == "worker_died" else "engine_error"))
    reason = ticket.finish_reason or "stop"
    if reason == "timeout":
        return "timeout", "first_token" if ticket.deadline_hit is Deadline.FIRST_TOKEN else "total"
    if reason == "abort":
        return "cancelled", "client"
    if reason == "error":
        return "error", "engine_error"
    return "ok", reason


_ERROR_STATUS = {
    "queue_timeout": ("timeout", "queue"),
    "shutdown": ("cancelled", "shutdown"),
    "slow_client": ("cancelled", "slow_client"),  # stopped reading its stream (server/stream_guard.py)
    "invalid_request": ("rejected", "invalid_request"),
}


def _version() -> str:
    try:
        return importlib.metadata.version("tokenmill")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"
