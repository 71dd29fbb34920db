"""What one app shares, built in the lifespan and kept on `app.state.runtime`: settings, the worker
(and through it the engine), the lanes, the tokenizer copy, metrics, readiness and drain.
"""

from __future__ import annotations

import asyncio
import enum
import importlib.metadata
import json
import logging
import time
import uuid
from typing import Any

from engine.api import Deadline, EngineProtocol, SamplingParams
from server.admission import Admission, Lane
from server.capacity import usable_context
from server.errors import ApiError
from server.gateway import RequestHandle
from server.metrics import ModelInfo, ServerMetrics, Snapshot, memory_probe
from server.settings import ServerSettings
from server.ticket import Collector, Finished, ServerError, Ticket
from server.tokens import PromptCodec
from server.worker import Rejection, Worker

log = logging.getLogger("tokenmill.server")
request_log = logging.getLogger("tokenmill.requests")

_STOP_JOIN_S = 10.0
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


class Runtime:
    """The app's shared state. Methods run on the event loop unless they say otherwise."""

    def __init__(self, settings: ServerSettings, engine: EngineProtocol) -> None:
        self.settings = settings
        self.loop = asyncio.get_running_loop()
        self.model_name = settings.served_model_name or engine.model_name
        self.model_aliases = {self.model_name, engine.model_name} | ({settings.model} if settings.model else set())
        self.max_model_len: int = usable_context(engine)  # the KV cache's size when that is smaller
        self.engine_desc = {"dtype": engine.dtype_name, "device": engine.device_name}
        self.codec = PromptCodec(engine.tokenizer)  # copied before the worker owns the engine
        self.admission = Admission(settings.lane_bounds())
        info = ModelInfo(self.model_name, self.engine_desc["dtype"], self.engine_desc["device"], _version(),
                         self.max_model_len)  # fmt: skip
        self.metrics = ServerMetrics(info, self._snapshot)
        self._memory = memory_probe(engine)
        self.worker = Worker(
            engine,
            self.admission,
            on_finish=self._on_finish,
            on_step=self.metrics.observe_step,
            on_token_gap=self.metrics.observe_token_gap,
            keep_outputs=settings.log_prompts,
        )
        self.started_at = time.monotonic()
        self.created = int(time.time())
        self.ready = False  # warm-up done
        self.draining = False
        self.failure: str | None = None
        self.open_responses = 0  # RequestHandles not closed yet (their responses are still being sent)
        self._tasks: set[asyncio.Task] = set()

    # -- lifecycle -----------------------------------------------------------------------------------
    def start(self) -> None:
        """Start the worker thread and, in the background, the warm-up."""
        self.worker.start()
        task = self.loop.create_task(self.warm_up())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def close(self) -> None:
        """Abort what is left and stop the worker (end of the lifespan)."""
        self.draining = True
        for task in list(self._tasks):
            task.cancel()
        await asyncio.to_thread(self.worker.stop, _STOP_JOIN_S)
        self.codec.close()

    async def warm_up(self) -> None:
        """One short greedy generation through the whole path; ready only if it works."""
        if not self.settings.warmup:
            self.ready = True
            return
        try:
            ids = await self.codec.encode("Hello") or [0]
            params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
            ticket = Ticket(f"warmup-{uuid.uuid4().hex}", ids, params, Lane.INTERACTIVE, Collector(self.loop),
                            internal=True)
            if self.worker.submit(ticket) is not None:
                raise RuntimeError("warm-up request was refused")
            handle = RequestHandle(self, ticket)
            try:
                event = None
                while not isinstance(event, Finished):
                    event = await handle.next_event(timeout=1.0)
            finally:
                handle.close()
            if event.error is not None or event.reason == "error":
                raise RuntimeError(event.error.message if event.error else "engine error")
            self.ready = True
            log.info("warm-up done: %s ready", self.model_name)
        except Exception as exc:
            self.failure = f"warm-up failed: {exc}"
            log.error(self.failure)

    async def drain(self) -> None:
        """Refuse new requests, let in-flight ones finish within drain_timeout_s, abort the rest with an
        error (event), and return once their responses were sent (or a few seconds passed)."""
        self.draining = True
        timeout = self.settings.drain_timeout_s
        log.info("draining: %d requests in flight, up to %.0fs", self.worker.in_flight(), timeout)
        deadline = self.loop.time() + timeout
        while (self.open_responses or self.worker.in_flight()) and self.loop.time() < deadline:
            await asyncio.sleep(0.05)
        if self.worker.in_flight():
            log.warning("drain timeout: aborting %d requests", self.worker.in_flight())
            self.worker.abort_all(ServerError("shutdown", f"the server shut down (drain timeout {timeout:g}s)", 503))
        end = self.loop.time() + _FLUSH_AFTER_ABORT_S
        while self.open_responses and self.loop.time() < end:
            await asyncio.sleep(0.05)
        log.info("drained")

    # -- state ---------------------------------------------------------------------------------------
    def status(self) -> tuple[Status, str | None]:
        if self.draining:
            return Status.DRAINING, "the server is shutting down"
        if not self.worker.alive:
            return Status.UNHEALTHY, "the engine worker is not running"
        if self.failure:
            return Status.UNHEALTHY, self.failure
        stalled_s = time.monotonic() - self.worker.heartbeat
        if self.worker.in_flight() and stalled_s > self.settings.stall_timeout_s:
            return Status.UNHEALTHY, f"the busy engine has not completed a step for {stalled_s:.0f}s"
        if not self.ready:
            return Status.STARTING, "warming up"
        return Status.OK, None

    def check_accepting(self) -> None:
        """Raise ApiError 503 unless new requests are taken now. A stalled engine still queues them:
        the lane bounds and deadlines protect it."""
        if self.draining:
            status, reason = Status.DRAINING, "the server is shutting down"
        elif not self.worker.alive:
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

    def _snapshot(self) -> Snapshot:
        return Snapshot(stats=self.worker.stats, lanes=self.worker.lane_load(), worker_alive=self.worker.alive,
                        memory=self._memory())  # fmt: skip

    # -- accounting (metrics + one JSON log line per request) --------------------------------------------
    def record_rejection(self, ticket: Ticket, rejection: Rejection) -> None:
        self.metrics.observe_rejected(ticket.lane, rejection.reason)
        request_log.info(json.dumps({
            "event": "request", "id": ticket.request_id, "lane": ticket.lane.label, "status": "rejected",
            "reason": rejection.reason, "finish_reason": None, "prompt_tokens": len(ticket.prompt_token_ids),
            "retry_after_s": rejection.retry_after_s,
        }))  # fmt: skip

    def _on_finish(self, ticket: Ticket) -> None:
        """Runs on the worker thread when any admitted request ends."""
        if ticket.internal:
            return
        status, reason = request_status(ticket)
        timing = ticket.timing()
        lengths = (len(ticket.prompt_token_ids), ticket.completion_tokens)
        self.metrics.observe_finished(ticket.lane, status, reason, lengths, timing)
        line: dict[str, Any] = {
            "event": "request", "id": ticket.request_id, "lane": ticket.lane.label, "status": status, "reason": reason,
            "finish_reason": ticket.finish_reason, "prompt_tokens": len(ticket.prompt_token_ids),
            "completion_tokens": ticket.completion_tokens, "cached_tokens": ticket.cached_tokens,
            **timing, "kv_blocks_peak": ticket.kv_blocks_peak,
        }  # fmt: skip
        if ticket.error is not None:
            line["error"] = ticket.error.message
        if self.settings.log_prompts:
            line["prompt_token_ids"] = ticket.prompt_token_ids
            line["output_token_ids"] = ticket.output_token_ids
        request_log.info(json.dumps(line))


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
