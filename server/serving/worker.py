"""The one background thread that owns the engine.

It blocks only when idle (nothing in the engine). Otherwise, each iteration: take commands (new
requests, aborts, stop), step the engine once, and post every request's events to that request's own
`Collector` on the event loop with `loop.call_soon_threadsafe`, one call per iteration; it never
waits for a client. New requests go to the engine at once: its scheduler alone decides who runs next
(lanes are its priority levels, with aging and deadlines); the worker keeps only the per-lane admission
counts that 429s are decided on. The choices of one HTTP request are admitted together (`submit_unit`);
those it holds (a prompt's later samples, until its first sample's prompt ran) go to the engine on
`release`, and an abort before that ends them at once.

Threads: `submit`, `submit_unit`, `release`, `abort`, `abort_all`, `stop` and the read-only properties
are called from the event loop; everything else runs on the worker thread, the only thread that touches
the engine.

When the thread ends (stopped, or dead) it closes: nothing more is admitted, a call or request that
reached its inbox too late is answered (WorkerUnavailable, or a 503 shutdown error), never left waiting,
and it lets go of the engine, so the weights and KV cache are freed then even while something still
holds this Worker (a finishing request's frame, a snapshot, a stale reference to its version).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import cast

from engine.api import EngineProtocol, EngineStats, FinishReason, InvalidParam, RequestOutput
from server.config.lanes import Lane
from server.serving.admission import Admission
from server.serving.ticket import Collector, Event, Finished, ServerError, Started, Ticket, Tokens

log = logging.getLogger("tokenmill.worker")


@dataclass(frozen=True)
class Rejection:
    """A lane had no room: answer 429 with Retry-After."""

    lane: Lane
    retry_after_s: int
    reason: str  # the bound hit: queue_requests or queue_tokens


# -- commands from the event loop ---------------------------------------------------------------------
@dataclass(frozen=True)
class _Submit:
    ticket: Ticket


@dataclass(frozen=True)
class _Abort:
    request_id: str
    error: ServerError | None


@dataclass(frozen=True)
class _AbortAll:
    error: ServerError


@dataclass(frozen=True)
class _Call:
    """Run fn(engine) on the worker thread between steps (adapter loads); its result or error goes to
    `future`."""

    fn: Callable[[EngineProtocol], object]
    future: concurrent.futures.Future


_STOP = object()


class DuplicateRequestId(ValueError):
    pass


class WorkerUnavailable(RuntimeError):
    pass


class _ReleasedEngine:
    """What a closed worker holds instead of its engine: any use says the worker is gone."""

    def __getattr__(self, name: str) -> object:
        raise WorkerUnavailable(f"the engine worker has stopped and released its engine (engine.{name})")


class Worker:
    """Owns the engine on its own thread; see the module docstring for the loop."""

    def __init__(
        self,
        engine: EngineProtocol,
        admission: Admission,
        *,
        on_finish: Callable[[Ticket], None] = lambda ticket: None,
        on_step: Callable[[EngineStats], None] = lambda stats: None,
        on_token_gap: Callable[[Lane, float], None] = lambda lane, seconds: None,
        keep_outputs: bool = False,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._engine = engine
        self._admission = admission
        self._on_finish = on_finish
        self._on_step = on_step  # after each step the engine ran, with its stats (metrics)
        self._on_token_gap = on_token_gap  # time between two tokens of a request (metrics)
        self._keep_outputs = keep_outputs
        self._clock = clock  # the engine's clock too: arrival times cross over as they are
        self._lock = threading.Lock()  # guards _admission, _tickets and _closed, shared with the event loop
        self._closed = False  # the thread has ended: nothing more is admitted or queued
        self._tickets: dict[str, Ticket] = {}  # every request admitted and not finished
        self._in_engine: dict[str, Ticket] = {}  # worker thread only
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._outbox: list[tuple[Collector, Event]] = []
        self._thread = threading.Thread(target=self._run, name="tokenmill-worker", daemon=True)
        # -- read by any thread (each a single reference, replaced whole) --------------------------------
        self.stats: EngineStats = engine.stats()
        self.heartbeat: float = clock()  # end of the last loop iteration, or when it woke from idle
        self.last_step_at: float | None = None
        # engine steps run so far: a request's queue wait in steps (Ticket.queue_steps) does not depend on
        # how long each step took, so it compares across machines and loads
        self._steps = 0
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
        """Admit `ticket` to its lane and hand it to the engine, or say why not.
        Raises DuplicateRequestId, WorkerUnavailable."""
        return self.submit_unit([ticket])

    def submit_unit(self, unit: Sequence[Ticket], held: Collection[str] = ()) -> Rejection | None:
        """Admit the tickets of one request (its choices; one lane) as one unit (server/serving/admission.py),
        or say why not; hand them to the engine, except those named in `held`, which wait (admitted,
        counted in the lane) for release(). Raises DuplicateRequestId, WorkerUnavailable."""
        if not self.alive:
            raise WorkerUnavailable("the engine worker is not running")
        lane, tokens = unit[0].lane, sum(t.tokens for t in unit)
        now = self._clock()
        with self._lock:
            if self._closed:
                raise WorkerUnavailable("the engine worker is not running")
            for ticket in unit:
                if ticket.request_id in self._tickets:
                    raise DuplicateRequestId(f"request_id {ticket.request_id!r} is already in flight")
            if not self._admission.fits(lane, tokens):
                reason = self._admission.full_reason(lane)
                return Rejection(lane, self._admission.retry_after(lane, now), reason)
            self._admission.admit_unit(lane, {t.request_id: t.tokens for t in unit})
            for ticket in unit:
                ticket.arrival = now
                self._tickets[ticket.request_id] = ticket
        for ticket in unit:
            if ticket.request_id not in held:
                self._inbox.put(_Submit(ticket))
        return None

    def release(self, ticket: Ticket) -> None:
        """Hand a ticket submit_unit() held to the engine (it keeps its arrival time and place in line)."""
        self._inbox.put(_Submit(ticket))

    def room(self, lane: Lane, tokens: int) -> Rejection | None:
        """submit()'s lane check alone (nothing is admitted): None when `tokens` fit in `lane` now."""
        with self._lock:
            if self._admission.fits(lane, tokens):
                return None
            return Rejection(lane, self._admission.retry_after(lane, self._clock()), self._admission.full_reason(lane))

    def abort(self, request_id: str, error: ServerError | None = None) -> None:
        """End a queued or running request (no-op when it already finished)."""
        self._inbox.put(_Abort(request_id, error))

    def abort_all(self, error: ServerError) -> None:
        self._inbox.put(_AbortAll(error))

    def end_all_now(self, error: ServerError) -> None:
        """Post Finished("abort", error) to every admitted request's collector now, from the caller's thread,
        not after the engine's step in flight: a step can take seconds (a long prompt chunk, a loaded
        machine), and at the drain deadline each response must send its error event before the
        connections close. The requests stay the worker's: abort_all() ends them in the engine and counts
        them, and its own Finished comes second (a handle keeps the first)."""
        with self._lock:
            collectors = [ticket.collector for ticket in self._tickets.values()]
        for collector in collectors:
            try:
                collector.loop.call_soon_threadsafe(collector.queue.put_nowait, Finished("abort", error))
            except RuntimeError:
                pass  # the loop is closed: nobody is listening any more

    def call(self, fn: Callable[[EngineProtocol], object]) -> concurrent.futures.Future:
        """fn(engine) on the worker thread, between two steps (the engine has one owner); await the result
        with asyncio.wrap_future. Raises WorkerUnavailable."""
        if not self.alive:
            raise WorkerUnavailable("the engine worker is not running")
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:  # queued before _close() drains the inbox, or refused here: never left unanswered
            if self._closed:
                raise WorkerUnavailable("the engine worker is not running")
            self._inbox.put(_Call(fn, future))
        return future

    def stop(self, timeout: float) -> None:
        """Abort everything, end the thread, wait up to `timeout` seconds for it."""
        self._inbox.put(_STOP)
        if self._thread.is_alive():
            self._thread.join(timeout)

    def in_flight(self) -> int:
        with self._lock:
            return len(self._tickets)

    def lane_load(self) -> dict[Lane, tuple[int, int]]:
        """Per lane: (requests admitted and not started, their tokens)."""
        with self._lock:
            return {lane: (self._admission.depth(lane), self._admission.queued_tokens(lane)) for lane in Lane}

    def waiting_adapters(self) -> frozenset[str]:
        """The LoRA adapters of requests admitted and not started yet (in a lane or the engine's queue):
        the engine sees only those it was handed, a router asks about every one waiting."""
        with self._lock:
            return frozenset(t.params.lora_name for t in self._tickets.values()
                             if t.started_at is None and t.params.lora_name is not None)  # fmt: skip

    # -- worker thread ------------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while self._take_commands():
                self._iterate()
        except BaseException as exc:  # noqa: BLE001 - the worker must report any death, then end
            self.died = exc
            log.critical("engine worker died: %s: %s", type(exc).__name__, exc, exc_info=exc)
            exc.__traceback__ = None  # its frames hold the engine; the log above has them
        finally:  # _close() fails what is left (503 worker_died)
            self._close()
            self._flush()
            self._retire()
            self._log_experts()
            self._engine = cast(EngineProtocol, _ReleasedEngine())  # the weights and KV cache go now

    def _close(self) -> None:
        """Admit nothing more, then answer what the inbox still holds (calls get WorkerUnavailable) and fail
        any request admitted since the stop (a 503, as the ones the stop ended)."""
        with self._lock:
            self._closed = True
        while True:
            try:
                cmd = self._inbox.get_nowait()
            except queue.Empty:
                break
            if isinstance(cmd, _Call) and cmd.future.set_running_or_notify_cancel():
                cmd.future.set_exception(WorkerUnavailable("the engine worker stopped before running the call"))
        if self.died is None:
            self._fail_all(ServerError("shutdown", "the server is shutting down", 503))
        else:
            self._fail_all(ServerError("worker_died", f"the engine worker died: {type(self.died).__name__}", 503))

    def _retire(self) -> None:
        """The engine serves nothing more: consumers of its KV events must drop its blocks."""
        try:
            self._engine.retire_kv_events()
        except Exception:  # noqa: BLE001 - the thread is ending either way
            log.exception("engine.retire_kv_events failed")

    def _log_experts(self) -> None:
        """A mixture-of-experts engine's last word: the tokens each expert received (debugging)."""
        try:
            counts = self._engine.expert_counts()
        except Exception:  # noqa: BLE001 - the thread is ending either way
            log.exception("engine.expert_counts failed")
            return
        if counts:
            log.info("experts: tokens routed to each expert since start-up, per sparse layer: %s", counts)

    def _iterate(self) -> None:
        self.stats = before = self._engine.stats()  # fresh for /health during a long step
        if self._engine.has_unfinished():
            self._step()
        self.stats = self._engine.stats()
        if self.stats.steps != before.steps:
            self._on_step(self.stats)
        self._flush()
        self.heartbeat = self._clock()

    def _take_commands(self) -> bool:
        """Apply all pending commands; block for one first when idle. False once told to stop."""
        block = not self._engine.has_unfinished()
        while True:
            try:
                cmd = self._inbox.get(block=block)
            except queue.Empty:
                return True
            if block:
                self.heartbeat = self._clock()  # woke from idle: not a stall
                block = False
            if cmd is _STOP:  # _close() fails what is left
                return False
            if isinstance(cmd, _Submit):
                self._add(cmd.ticket)
            elif isinstance(cmd, _Abort):
                self._abort(cmd.request_id, cmd.error)
            elif isinstance(cmd, _AbortAll):
                self._fail_all(cmd.error)
            elif isinstance(cmd, _Call):
                _run_call(self._engine, cmd)

    def _add(self, ticket: Ticket) -> None:
        if ticket.finished_at is not None:
            return  # failed (shutdown, abort-all) before the worker took it
        try:
            self._engine.add_request(
                ticket.request_id,
                prompt_token_ids=ticket.prompt_token_ids,
                params=ticket.params,
                priority=ticket.engine_priority,
                arrival_time=ticket.arrival,
                deadlines=ticket.deadlines(),
                tenant=ticket.tenant,
            )
        except InvalidParam as exc:
            self._finish(ticket, "error", ServerError("invalid_request", exc.message, 400, exc.field))
            return
        except Exception as exc:
            log.exception("engine.add_request failed for %s", ticket.request_id)
            self._finish(ticket, "error", ServerError("engine_error", f"{type(exc).__name__}: {exc}", 500))
            return
        ticket.added_at_step = self._steps
        self._in_engine[ticket.request_id] = ticket

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
        self._steps += 1
        for out in outputs:
            self._route(out, now)

    def _route(self, out: RequestOutput, now: float) -> None:
        ticket = self._in_engine.get(out.request_id)
        if ticket is None:
            return  # aborted after it was scheduled
        if ticket.started_at is None and (out.started or out.new_token_ids):
            self._mark_started(ticket, now)
        if out.new_token_ids:
            if ticket.first_token_at is None:
                ticket.first_token_at = now
            elif not ticket.internal and ticket.last_token_at is not None:
                self._on_token_gap(ticket.lane, now - ticket.last_token_at)
            ticket.last_token_at = now
        ticket.prompt_tokens = out.prompt_tokens
        ticket.completion_tokens = out.completion_tokens
        ticket.cached_tokens = max(ticket.cached_tokens, out.cached_tokens)
        ticket.kv_blocks_peak = max(ticket.kv_blocks_peak, out.kv_blocks)
        ticket.preemptions = out.num_preemptions
        if self._keep_outputs:
            ticket.output_token_ids.extend(out.new_token_ids)
        if out.new_token_ids or out.text_delta or out.prompt_logprobs is not None:
            self._post(ticket, Tokens(out))
        if out.finished:
            self._finish_output(ticket, out)

    def _mark_started(self, ticket: Ticket, now: float) -> None:
        ticket.started_at = now
        ticket.queue_steps = self._steps - ticket.added_at_step
        with self._lock:
            self._admission.started(ticket.request_id, now)
        self._post(ticket, Started())

    def _finish_output(self, ticket: Ticket, out: RequestOutput) -> None:
        if out.finish_reason is FinishReason.ERROR and out.error_param is not None:  # the request's fault
            self._finish(ticket, "error", ServerError("invalid_request", out.error or "invalid request", 400,
                                                      out.error_param))  # fmt: skip
        elif out.finish_reason is FinishReason.ERROR:
            self._finish(ticket, "error", ServerError("engine_error", out.error or "the engine step failed", 500))
        elif out.finish_reason is FinishReason.TIMEOUT:
            ticket.deadline_hit = out.deadline
            if ticket.started_at is None:  # never left the queue: a clean 503 where nothing was sent
                waited = self._clock() - ticket.arrival
                message = f"waited {waited:.1f}s in the {ticket.lane.label} lane without starting; try again later"
                self._finish(ticket, "timeout", ServerError("queue_timeout", message, 503))
            else:
                self._finish(ticket, "timeout")
        else:
            self._finish(ticket, out.finish_reason.value if out.finish_reason else "stop")

    def _abort(self, request_id: str, error: ServerError | None) -> None:
        ticket = self._in_engine.get(request_id)
        if ticket is not None:
            self._safe_abort(request_id)
            self._finish(ticket, "abort", error)
            return
        with self._lock:
            held = self._tickets.get(request_id)  # admitted, never handed to the engine (submit_unit held it)
        if held is not None and held.finished_at is None:
            self._finish(held, "abort", error)

    def _fail_all(self, error: ServerError) -> None:
        with self._lock:
            tickets = list(self._tickets.values())
        for ticket in tickets:
            if ticket.request_id in self._in_engine:
                self._safe_abort(ticket.request_id)
            self._finish(ticket, "abort", error)

    def _safe_abort(self, request_id: str) -> None:
        try:
            self._engine.abort(request_id)
        except Exception:
            log.exception("engine.abort(%s) failed", request_id)

    def _finish(self, ticket: Ticket, reason: str, error: ServerError | None = None) -> None:
        self._in_engine.pop(ticket.request_id, None)
        with self._lock:
            self._tickets.pop(ticket.request_id, None)
            self._admission.ended(ticket.request_id)
        ticket.finished_at = self._clock()
        ticket.finish_reason = reason
        ticket.error = error
        if ticket.tenant_unit is not None:  # settled before the client hears of the end: its next request sees it
            ticket.tenant_unit.member_done(ticket.completion_tokens)
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


def _run_call(engine: EngineProtocol, cmd: _Call) -> None:
    if not cmd.future.set_running_or_notify_cancel():
        return
    try:
        cmd.future.set_result(cmd.fn(engine))
    except Exception as exc:  # the caller's to report (a LoraError is a 4xx)
        cmd.future.set_exception(exc)


def _deliver(batch: list[tuple[Collector, Event]]) -> None:
    for collector, event in batch:
        collector.queue.put_nowait(event)

