"""A request's life as the worker and the routes share it: the `Ticket`, the events the worker posts
to the request's `Collector`, and why a request failed (`ServerError`)."""

from __future__ import annotations

import asyncio
import sys
from dataclasses import dataclass, field

from engine.api import Deadline, Deadlines, RequestOutput, SamplingParams
from server.config.lanes import Lane
from server.config.tenants import DEFAULT_TENANT
from server.ops.feedback import RecordKey
from server.serving.tenants import TenantUnit


@dataclass(frozen=True)
class ServerError:
    """Why a request ended without a normal finish; `status` is its HTTP answer if nothing was sent yet."""

    kind: str  # queue_timeout, shutdown, invalid_request, engine_error, worker_died
    message: str
    status: int
    param: str | None = None  # the request field at fault (invalid_request), from InvalidParam.field


@dataclass(frozen=True)
class Started:
    """The engine scheduled the request for the first time: it left its lane's queue."""


@dataclass(frozen=True)
class Tokens:
    """New tokens and text of one engine step."""

    output: RequestOutput


@dataclass(frozen=True)
class Finished:
    """The last event of every request. Usage and timing are on the ticket, set before this is posted."""

    reason: str  # stop, length, timeout, abort, error
    error: ServerError | None = None

    @property
    def never_started(self) -> bool:
        """Its queue deadline ended it before the engine scheduled it: nothing of it ran."""
        return self.error is not None and self.error.kind == "queue_timeout"


Event = Started | Tokens | Finished


class Collector:
    """One request's mailbox on the event loop: the worker posts, the route awaits."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.queue: asyncio.Queue[Event] = asyncio.Queue()

    async def next(self, timeout: float) -> Event | None:
        """The next event, or None after `timeout` seconds without one.

        Not `asyncio.wait_for(queue.get(), timeout)`: before Python 3.12 that returns an event which
        arrives together with the caller's cancellation instead of raising CancelledError (the route
        goes on as if its client were still there; tests/server/serving/test_collector.py). A choice
        stream's pump that lost its cancel that way waited forever on a queue nobody read, was garbage
        collected pending, and CPython 3.11 then crashed in task_step (a segmentation fault, reproduced
        with n=8 streams dropped repeatedly; gone with this). Here (3.11+) a cancellation always raises,
        the event left queued, and an event already queued (most are: the worker posts a step's events
        at once) costs no task and no timer."""
        try:
            return self.queue.get_nowait()
        except asyncio.QueueEmpty:
            pass
        if timeout <= 0:
            return None
        if sys.version_info < (3, 11):  # no asyncio.timeout
            try:
                return await asyncio.wait_for(self.queue.get(), timeout)
            except asyncio.TimeoutError:
                return None
        try:
            async with asyncio.timeout(timeout):
                return await self.queue.get()
        except TimeoutError:
            return None


@dataclass(eq=False)
class Ticket:
    """One request's life in the server: built by a route, advanced by the worker."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    lane: Lane
    collector: Collector
    queue_timeout_s: float | None = None
    first_token_timeout_s: float | None = None
    timeout_s: float | None = None
    internal: bool = False  # warm-up: not counted in metrics or logs
    record: RecordKey | None = None  # whose it is and the ids feedback rates it by; None: (no owner, request_id)
    # the engine priority it runs at: its lane's (None), or one level lower for a request's choices past
    # its share of the engine's seats (server/serving/gateway.py admit_unit)
    priority: int | None = None
    choices: int = 1  # choices admitted with it as one unit (n, or prompts x n); what vllm:request_params_n reads
    tenant: str = DEFAULT_TENANT  # who it is billed to (server/serving/tenants.py); the engine's fair share too
    tenant_unit: TenantUnit | None = None  # its request's quota charge, settled when it ends (None: no quota book)
    # -- written by the worker; read by the route once Finished arrived -----------------------------------
    arrival: float = 0.0  # clock time it was admitted; the engine orders it and times its deadlines by it
    started_at: float | None = None  # the engine first scheduled it
    added_at_step: int = 0  # the worker's step count when it reached the engine
    queue_steps: int | None = None  # engine steps from reaching the engine to its first step's end (idle: 1)
    first_token_at: float | None = None
    last_token_at: float | None = None
    finished_at: float | None = None
    finish_reason: str | None = None
    error: ServerError | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    kv_blocks_peak: int = 0  # most KV blocks the request held at once (from RequestOutput.kv_blocks)
    preemptions: int = 0  # times the engine preempted it (RequestOutput.num_preemptions)
    deadline_hit: Deadline | None = None  # which deadline ended it, when finish_reason is "timeout"
    output_token_ids: list[int] = field(default_factory=list)  # kept only when the server logs outputs

    @property
    def record_key(self) -> RecordKey:
        return self.record or RecordKey("", self.request_id)

    @property
    def engine_priority(self) -> int:
        return int(self.lane) if self.priority is None else self.priority

    @property
    def tokens(self) -> int:
        """The work it brings: prompt + max_tokens."""
        return len(self.prompt_token_ids) + self.params.max_tokens

    def deadlines(self) -> Deadlines:
        """Its deadlines, in seconds after arrival, for the engine's scheduler."""
        return Deadlines(self.queue_timeout_s, self.first_token_timeout_s, self.timeout_s)

    def timing(self) -> dict[str, float | int | None]:
        def since(t: float | None) -> float | None:
            return None if t is None else round(t - self.arrival, 6)

        return {"queue_s": since(self.started_at), "ttft_s": since(self.first_token_at),
                "e2e_s": since(self.finished_at), "queue_steps": self.queue_steps, "preemptions": self.preemptions}
