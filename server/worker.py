"""The one background thread that owns the engine.

It blocks only when idle (no queued and no running request). Otherwise, each iteration:
take commands (aborts, stop), expire deadlines, feed the engine from the lanes as fast as it can start
work, step once, and post every request's events to that request's own `Collector` on the event loop
with `loop.call_soon_threadsafe`, one call per iteration; it never waits for a client.

Threads: `submit`, `abort`, `abort_all`, `stop` and the read-only properties are called from the
event loop; everything else runs on the worker thread, the only thread that touches the engine.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

from engine.outputs import EngineStats, FinishReason, RequestOutput
from server.lanes import Lane, LaneQueue, QueuedRequest
from server.ticket import Collector, Event, Finished, ServerError, Started, Ticket, Tokens

log = logging.getLogger("tokenmill.worker")


@dataclass(frozen=True)
class Rejection:
    """A lane had no room: answer 429 with Retry-After."""

    lane: Lane
    retry_after_s: int
    reason: str  # the bound hit: queue_requests or queue_tokens


# -- commands from the event loop ---------------------------------------------------------------------
@dataclass(frozen=True)
class _Abort:
    request_id: str
    error: ServerError | None


@dataclass(frozen=True)
class _AbortAll:
    error: ServerError


_WAKE = object()
_STOP = object()


class DuplicateRequestId(ValueError):
    pass


class WorkerUnavailable(RuntimeError):
    pass


class Worker:
    """Owns the engine on its own thread; see the module docstring for the loop."""

    def __init__(
        self,
        engine,
        lanes: LaneQueue,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        on_finish: Callable[[Ticket], None] = lambda ticket: None,
        on_step: Callable[[EngineStats], None] = lambda stats: None,
        on_token_gap: Callable[[Lane, float], None] = lambda lane, seconds: None,
        keep_outputs: bool = False,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._engine = engine
        self._lanes = lanes
        self._max_num_seqs = max_num_seqs
        self._max_batched = max_num_batched_tokens
        self._on_finish = on_finish
        self._on_step = on_step  # after each step the engine ran, with its stats (metrics)
        self._on_token_gap = on_token_gap  # time between two tokens of a request (metrics)
        self._keep_outputs = keep_outputs
        self._clock = clock
        self._lock = threading.Lock()  # guards _lanes and _tickets, shared with the event loop
        self._tickets: dict[str, Ticket] = {}  # every request queued or running
        self._in_engine: dict[str, Ticket] = {}  # worker thread only
        self._pending_prefill = 0  # prompt tokens added to the engine that produced no output yet
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._outbox: list[tuple[Collector, Event]] = []
        self._thread = threading.Thread(target=self._run, name="tokenmill-worker", daemon=True)
        # -- read by any thread (each a single reference, replaced whole) --------------------------------
        self.stats: EngineStats = engine.stats()
        self.heartbeat: float = clock()  # end of the last loop iteration, or when it woke from idle
        self.last_step_at: float | None = None
        self.died: BaseException | None = None

    # -- event-loop side ------------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.died is None

    @property
    def thread_running(self) -> bool:
        """The thread still runs (it may be failing its requests after dying)."""
        return self._thread.is_alive()

    def submit(self, ticket: Ticket) -> Rejection | None:
        """Queue `ticket` in its lane, or say why not. Raises DuplicateRequestId, WorkerUnavailable."""
        if not self.alive:
            raise WorkerUnavailable("the engine worker is not running")
        now = self._clock()
        with self._lock:
            if ticket.request_id in self._tickets:
                raise DuplicateRequestId(f"request_id {ticket.request_id!r} is already in flight")
            if not self._lanes.fits(ticket.lane, ticket.tokens):
                full = self._lanes.depth(ticket.lane) >= self._lanes.bounds(ticket.lane).max_requests
                reason = "queue_requests" if full else "queue_tokens"
                return Rejection(ticket.lane, self._lanes.retry_after(ticket.lane, now), reason)
            ticket.arrival = now
            item = QueuedRequest(ticket.request_id, ticket.lane, ticket.tokens, now, ticket.queue_deadline(), ticket)
            self._lanes.push(item, now)
            self._tickets[ticket.request_id] = ticket
        self._inbox.put(_WAKE)
        return None

    def abort(self, request_id: str, error: ServerError | None = None) -> None:
        """End a queued or running request (no-op when it already finished)."""
        self._inbox.put(_Abort(request_id, error))

    def abort_all(self, error: ServerError) -> None:
        self._inbox.put(_AbortAll(error))

    def stop(self, timeout: float) -> None:
        """Abort everything, end the thread, wait up to `timeout` seconds for it."""
        self._inbox.put(_STOP)
        if self._thread.is_alive():
            self._thread.join(timeout)

    def in_flight(self) -> int:
        with self._lock:
            return len(self._tickets)

    def lane_load(self) -> dict[Lane, tuple[int, int]]:
        """Per lane: (queued requests, queued tokens)."""
        with self._lock:
            return {lane: (self._lanes.depth(lane), self._lanes.queued_tokens(lane)) for lane in Lane}

    # -- worker thread ------------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while self._take_commands():
                self._iterate()
        except BaseException as exc:  # noqa: BLE001 - the worker must report any death, then end
            self.died = exc
            log.critical("engine worker died: %s: %s", type(exc).__name__, exc, exc_info=exc)
            self._fail_all(ServerError("worker_died", f"the engine worker died: {type(exc).__name__}", 503))
        finally:
            self._flush()

    def _iterate(self) -> None:
        now = self._clock()
        self._expire(now)
        self._feed(now)
        self.stats = before = self._engine.stats()  # fresh for /health during a long step
        if self._engine.has_unfinished():
            self._step()
        self.stats = self._engine.stats()
        if self.stats.steps != before.steps:
            self._on_step(self.stats)
        self._flush()
        self.heartbeat = self._clock()

    def _busy(self) -> bool:
        with self._lock:
            queued = len(self._lanes)
        return queued > 0 or self._engine.has_unfinished()

    def _take_commands(self) -> bool:
        """Apply all pending commands; block for one first when idle. False once told to stop."""
        block = not self._busy()
        while True:
            try:
                cmd = self._inbox.get(block=block)
            except queue.Empty:
                return True
            if block:
                self.heartbeat = self._clock()  # woke from idle: not a stall
                block = False
            if cmd is _STOP:
                self._fail_all(ServerError("shutdown", "the server is shutting down", 503))
                return False
            if isinstance(cmd, _Abort):
                self._abort(cmd.request_id, cmd.error)
            elif isinstance(cmd, _AbortAll):
                self._fail_all(cmd.error)

    def _expire(self, now: float) -> None:
        with self._lock:
            expired = self._lanes.expire(now)
        for item in expired:
            ticket: Ticket = item.payload
            waited = now - ticket.arrival
            message = f"waited {waited:.1f}s in the {ticket.lane.label} lane without starting; try again later"
            self._finish(ticket, "timeout", ServerError("queue_timeout", message, 503))
        self._expire_running(now)

    def _expire_running(self, now: float) -> None:
        """Abort requests past their first-token or total deadline; their blocks are freed at once."""
        for ticket in list(self._in_engine.values()):
            deadlines = [d for d in (ticket.deadline(), ticket.first_token_deadline()) if d is not None]
            if deadlines and now >= min(deadlines):
                self._safe_abort(ticket.request_id)
                self._finish(ticket, "timeout")

    def _feed(self, now: float) -> None:
        """Hand queued requests to the engine while it can start them this step, so the lanes, not the
        engine's own queue, decide the order."""
        stats = self._engine.stats()
        free = self._max_num_seqs - stats.running - stats.waiting
        while free > 0 and self._pending_prefill < self._max_batched:
            with self._lock:
                item = self._lanes.pop(now)
            if item is None:
                return
            if self._add(item, now):
                free -= 1

    def _add(self, item: QueuedRequest, now: float) -> bool:
        ticket: Ticket = item.payload
        try:
            self._engine.add_request(
                ticket.request_id,
                prompt_token_ids=ticket.prompt_token_ids,
                params=ticket.params,
                priority=item.effective_lane(now, self._lanes.aging_s),
            )
        except ValueError as exc:
            self._finish(ticket, "error", ServerError("invalid_request", str(exc), 400))
            return False
        except Exception as exc:
            log.exception("engine.add_request failed for %s", ticket.request_id)
            self._finish(ticket, "error", ServerError("engine_error", f"{type(exc).__name__}: {exc}", 500))
            return False
        ticket.started_at = now
        ticket.prefilling = True
        self._pending_prefill += len(ticket.prompt_token_ids)
        self._in_engine[ticket.request_id] = ticket
        self._post(ticket, Started())
        return True

    def _step(self) -> None:
        try:
            outputs = self._engine.step()
        except Exception as exc:  # the engine contract says step() does not raise; if it does, recover
            log.exception("engine.step raised; failing the %d requests in the engine", len(self._in_engine))
            error = ServerError("engine_error", f"engine step failed: {type(exc).__name__}: {exc}", 500)
            for ticket in list(self._in_engine.values()):
                self._safe_abort(ticket.request_id)
                self._finish(ticket, "error", error)
            outputs = []
        now = self._clock()
        self.last_step_at = now
        self._expire_running(now)  # a token that came after its deadline is not delivered
        for out in outputs:
            self._route(out, now)

    def _route(self, out: RequestOutput, now: float) -> None:
        ticket = self._in_engine.get(out.request_id)
        if ticket is None:
            return  # aborted or timed out after it was scheduled
        self._clear_prefill(ticket)
        if out.new_token_ids:
            if ticket.first_token_at is None:
                ticket.first_token_at = now
            elif not ticket.internal:
                self._on_token_gap(ticket.lane, now - ticket.last_token_at)
            ticket.last_token_at = now
        ticket.prompt_tokens = out.prompt_tokens
        ticket.completion_tokens = out.completion_tokens
        ticket.cached_tokens = max(ticket.cached_tokens, out.cached_tokens)
        ticket.kv_blocks_peak = max(ticket.kv_blocks_peak, out.kv_blocks)
        if self._keep_outputs:
            ticket.output_token_ids.extend(out.new_token_ids)
        if out.new_token_ids or out.text_delta:
            self._post(ticket, Tokens(out))
        if out.finished:
            if out.finish_reason is FinishReason.ERROR:
                error = ServerError("engine_error", out.error or "the engine step failed", 500)
                self._finish(ticket, "error", error)
            else:
                self._finish(ticket, out.finish_reason.value if out.finish_reason else "stop")

    def _abort(self, request_id: str, error: ServerError | None) -> None:
        with self._lock:
            item = self._lanes.remove(request_id)
        if item is not None:
            self._finish(item.payload, "abort", error)
            return
        ticket = self._in_engine.get(request_id)
        if ticket is not None:
            self._engine.abort(request_id)
            self._finish(ticket, "abort", error)

    def _fail_all(self, error: ServerError) -> None:
        with self._lock:
            ids = list(self._tickets)
        for request_id in ids:
            with self._lock:
                item = self._lanes.remove(request_id)
                ticket = self._tickets.get(request_id)
            if item is None and ticket is not None and request_id in self._in_engine:
                self._safe_abort(request_id)
            if ticket is not None:
                self._finish(ticket, "abort", error)

    def _safe_abort(self, request_id: str) -> None:
        try:
            self._engine.abort(request_id)
        except Exception:
            log.exception("engine.abort(%s) failed", request_id)

    def _clear_prefill(self, ticket: Ticket) -> None:
        if ticket.prefilling:
            ticket.prefilling = False
            self._pending_prefill -= len(ticket.prompt_token_ids)

    def _finish(self, ticket: Ticket, reason: str, error: ServerError | None = None) -> None:
        self._clear_prefill(ticket)
        self._in_engine.pop(ticket.request_id, None)
        with self._lock:
            self._tickets.pop(ticket.request_id, None)
        ticket.finished_at = self._clock()
        ticket.finish_reason = reason
        ticket.error = error
        self._post(ticket, Finished(reason, error))
        try:
            self._on_finish(ticket)
        except Exception:
            log.exception("finish hook failed for %s", ticket.request_id)

    def _post(self, ticket: Ticket, event: Event) -> None:
        self._outbox.append((ticket.collector, event))

    def _flush(self) -> None:
        """Deliver this iteration's events: one call_soon_threadsafe per event loop."""
        if not self._outbox:
            return
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[Collector, Event]]] = defaultdict(list)
        for collector, event in self._outbox:
            by_loop[collector.loop].append((collector, event))
        self._outbox = []
        for loop, batch in by_loop.items():
            try:
                loop.call_soon_threadsafe(_deliver, batch)
            except RuntimeError:
                pass  # the loop is closed: nobody is listening any more


def _deliver(batch: list[tuple[Collector, Event]]) -> None:
    for collector, event in batch:
        collector.queue.put_nowait(event)
