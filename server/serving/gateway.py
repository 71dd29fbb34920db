"""The route side of a request's life in an engine: admission of its choices as one unit (lane, bounds,
the per-request share of seats, 429) on the model version the route picked (their leases), then its
events (`RequestHandle`, a server/serving/handle.py Handle). Runs on the event loop only. Whether the
server accepts requests at all is checked once per request, before any of this (server/api/respond.py
`generation`).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Collection, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from fastapi import Request

from engine.api import SamplingParams
from server.config.lanes import Lane
from server.config.tenants import DEFAULT_TENANT
from server.http.errors import ApiError
from server.ops.feedback import RecordKey
from server.serving.accounting import request_log
from server.serving.handle import Completed
from server.serving.tenants import TenantUnit
from server.serving.ticket import Collector, Event, Finished, ServerError, Started, Ticket, Tokens
from server.serving.worker import DuplicateRequestId, WorkerUnavailable

if TYPE_CHECKING:
    from server.serving.deployment import Deployment, Lease
    from server.serving.response_cache import Recorder
    from server.serving.runtime import Runtime

_POLL_S = 0.25  # how often a waiting non-streaming request checks for a disconnected client


@dataclass(frozen=True)
class GenerationRequest:
    """A validated, tokenized request, ready for a lane."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    lane: Lane | None = None  # the client's `priority`; None: chosen by size
    timeout_s: float | None = None
    first_token_timeout_s: float | None = None
    cache: bool = True  # the client's `cache` field: False never reads or writes the response cache
    scope: str = ""  # whose cache entries it may see (server/serving/dispatch.py cache_scope)
    max_tokens_field: str = "max_tokens"  # the body's name for max_tokens, as errors name it
    record: RecordKey | None = None  # whose request it is and the id feedback rates it by; None: request_id
    tenant: str = DEFAULT_TENANT  # who it is billed to (server/serving/tenants.py request_tenant)


def admit_unit(runtime: Runtime, choices: Sequence[tuple[Lease, GenerationRequest]], held: Collection[int] = (),
               param: str = "n", size: int | None = None) -> list[RequestHandle]:  # fmt: skip
    """Admit the choices of one request (each with its lease on one version, in index order) as one unit:
    all or none, one lane (the client's `priority`, else chosen by the largest choice), one request
    against its request bound and their tokens in all against its token bound. Choices past the
    request's share of the engine's seats (`seat_share`) run one priority level lower, so another
    client's request starts promptly. Choices whose positions are in `held` wait for their handle's
    release(). `size`: the request's choices, these and any the response cache answered (default: these).
    The unit is charged to its tenant's quotas first (server/serving/tenants.py).
    Takes over the leases. Raises ApiError: 400 (empty or too long; a unit its lane can
    never hold, naming `param`), 409 (request_id in flight), 429 (lane full, or a tenant quota), 503 (not serving)."""
    dep = choices[0][0].deployment
    for _, req in choices:
        check_context(dep.max_model_len, len(req.prompt_token_ids), req.params.max_tokens, req.max_tokens_field)
    req0 = choices[0][1]
    largest = max(len(req.prompt_token_ids) + req.params.max_tokens for _, req in choices)
    lane = req0.lane if req0.lane is not None else runtime.lane_for_size(largest)
    share = seat_share(dep.max_num_seqs)
    tickets = [_ticket(runtime, req, lane, None if k < share else int(lane) + 1)
               for k, (_, req) in enumerate(choices)]  # fmt: skip
    for t in tickets:
        t.choices = size or len(tickets)
    _check_unit_fits(dep, lane, sum(t.tokens for t in tickets), len(tickets), param)
    prompt_tokens = sum(len(t.prompt_token_ids) for t in tickets)
    unit = _charge_tenant(runtime, tickets[0], prompt_tokens, len(tickets))
    for t in tickets:
        t.tenant_unit = unit
    try:
        _submit(runtime, dep, tickets, {tickets[k].request_id for k in held})
    except ApiError as exc:
        runtime.tenants.refund(unit, prompt_tokens)
        if exc.status == 429:
            runtime.tenant_metrics.observe_rejected(tickets[0].tenant, "lane_full")
        raise
    return [RequestHandle(runtime, ticket, lease) for ticket, (lease, _) in zip(tickets, choices, strict=True)]


def _charge_tenant(runtime: Runtime, ticket: Ticket, prompt_tokens: int, members: int) -> TenantUnit:
    """Charge a unit to its tenant's quotas; ApiError 429 naming the tenant and the quota when one refuses."""
    got = runtime.tenants.admit(ticket.tenant, prompt_tokens, members)
    if isinstance(got, TenantUnit):
        return got
    runtime.tenant_metrics.observe_rejected(got.tenant, got.reason)
    request_log.info(json.dumps({"event": "request", "id": ticket.request_id, "tenant": got.tenant,
                                 "lane": ticket.lane.label, "status": "rejected", "reason": got.reason,
                                 "prompt_tokens": prompt_tokens, "retry_after_s": got.retry_after_s}))  # fmt: skip
    raise ApiError(429, "rate_limited", got.message, headers={"Retry-After": str(got.retry_after_s)},
                   extra={"tenant": got.tenant, "quota": got.reason}, accounted=True)  # fmt: skip


def _check_unit_fits(dep: Deployment, lane: Lane, total: int, count: int, param: str) -> None:
    """400 naming `param` when `count` choices needing `total` tokens can never fit in `lane`."""
    if dep.admission.never_fits(lane, total, count):
        bound = dep.admission.bounds(lane).max_tokens
        raise ApiError(
            400, "invalid_request",
            f"this request's {count} choices need {total} tokens (prompt + max_tokens each), more than "
            f"the {lane.label} lane ever holds ({lane.label}_max_queued_tokens = {bound}); send fewer choices "
            "or fewer max_tokens, or another priority", param=param,
        )  # fmt: skip


def seat_share(max_num_seqs: int) -> int:
    """How many choices of one request run at its lane's priority: a quarter of the engine's seats (at least
    one). The rest run a level lower, so they never hold every seat against another client's request."""
    return max(1, max_num_seqs // 4)


def _ticket(runtime: Runtime, req: GenerationRequest, lane: Lane, priority: int | None) -> Ticket:
    defaults = runtime.settings.lane_deadlines(lane)
    return Ticket(
        request_id=req.request_id,
        prompt_token_ids=req.prompt_token_ids,
        params=req.params,
        lane=lane,
        collector=Collector(asyncio.get_running_loop()),
        queue_timeout_s=defaults.queue_s,
        first_token_timeout_s=req.first_token_timeout_s or defaults.first_token_s,
        timeout_s=req.timeout_s or defaults.total_s,
        record=req.record,
        priority=priority,
        tenant=req.tenant,
    )


def check_context(max_len: int, n: int, max_tokens: int, field: str = "max_tokens") -> None:
    """Raises ApiError 400 when a prompt of `n` tokens is empty or, with max_tokens, does not fit `max_len`.
    `field`: the body's name for max_tokens, as the error names it."""
    if n == 0:
        raise ApiError(400, "invalid_request", "prompt must not be empty", param="prompt")
    if n + max_tokens > max_len:
        raise ApiError(
            400, "invalid_request",
            f"prompt ({n} tokens) + {field} ({max_tokens}) = {n + max_tokens} exceeds the context length "
            f"max_model_len ({max_len})",
            param="prompt" if n >= max_len else field,
        )  # fmt: skip


def precheck(runtime: Runtime, lease: Lease, reqs: Sequence[GenerationRequest], copies: int = 1,
             param: str = "n") -> None:
    """admit_unit()'s checks without admitting anything, for a unit of `reqs` each run `copies` times (n):
    each prompt's context length (400) and room in the unit's lane now for all their tokens (429). A route
    runs them before costly work (a grammar compile), so a request admit_unit() would refuse costs
    nothing; admit_unit() checks again."""
    dep = lease.deployment
    for req in reqs:
        check_context(dep.max_model_len, len(req.prompt_token_ids), req.params.max_tokens, req.max_tokens_field)
    sizes = [len(req.prompt_token_ids) + req.params.max_tokens for req in reqs]
    lane = reqs[0].lane if reqs[0].lane is not None else runtime.lane_for_size(max(sizes))
    _check_unit_fits(dep, lane, sum(sizes) * copies, len(reqs) * copies, param)
    rejection = dep.worker.room(lane, sum(sizes) * copies)
    if rejection is not None:
        dep.metrics.observe_rejected(lane, rejection.reason)
        raise ApiError(429, "overloaded", f"the {lane.label} lane is full; retry after {rejection.retry_after_s}s",
                       headers={"Retry-After": str(rejection.retry_after_s)}, extra={"lane": lane.label})  # fmt: skip


def _submit(runtime: Runtime, dep: Deployment, tickets: list[Ticket], held: set[str]) -> None:
    """Hand the unit to the version's worker. Raises ApiError 409, 429 (counted and logged once), 503."""
    try:
        rejection = dep.worker.submit_unit(tickets, held)
    except DuplicateRequestId as exc:
        raise ApiError(409, "conflict", str(exc), param="request_id") from None
    except WorkerUnavailable as exc:
        raise ApiError(503, "unhealthy", str(exc), headers={"Retry-After": "5"}) from None
    if rejection is not None:
        lane = tickets[0].lane
        runtime.accounting.rejected(dep, tickets[0], rejection)  # one request, however many choices
        raise ApiError(
            429, "overloaded",
            f"the {lane.label} lane is full; retry after {rejection.retry_after_s}s",
            headers={"Retry-After": str(rejection.retry_after_s)},
            extra={"lane": lane.label},
            accounted=True,  # counted and logged by accounting.rejected
        )  # fmt: skip


def start_error(error: ServerError) -> ApiError:
    """The HTTP answer for a request that failed before anything was sent."""
    headers = {"Retry-After": "1"} if error.status == 503 else None
    return ApiError(error.status, error.kind, error.message, param=error.param, headers=headers, accounted=True)


class RequestHandle:
    """An admitted request as a route sees it. close() it exactly when the response is done:
    it aborts the request if it has not finished (client gone, handler failed), and releases the
    route's lease on its model version."""

    cached = False  # answered by the engine (server/serving/replay.py ReplayHandle answers from the cache)

    def __init__(self, runtime: Runtime, ticket: Ticket, lease: Lease) -> None:
        self.runtime = runtime
        self.ticket = ticket
        self.lease = lease
        self.worker = lease.deployment.worker
        self.version = lease.deployment.version
        self.finished: Finished | None = None
        self.recorder: Recorder | None = None  # set when the result may go to the response cache
        self._closed = False
        runtime.open_responses += 1

    @property
    def request_id(self) -> str:
        return self.ticket.request_id

    async def next_event(self, timeout: float) -> Event | None:
        """The next event, or None after `timeout` seconds without one."""
        if self.finished is not None:
            return self.finished
        event = await self.ticket.collector.next(timeout)
        if event is None:
            if not self.worker.thread_running:  # no event will ever come
                event = Finished("error", ServerError("worker_died", "the engine worker is not running", 503))
            else:
                return None
        if isinstance(event, Finished):
            self.finished = event
        if self.recorder is not None:
            self.recorder.observe(event, self.ticket)
        return event

    async def wait_started(self, hold_s: float, request: Request | None = None) -> bool:
        """True once the engine scheduled the request; False if it is still queued after `hold_s`.
        Raises ApiError when it failed first (queue timeout, invalid for the engine, shutdown) or the
        client left (the request is then aborted)."""
        loop = asyncio.get_running_loop()
        end = loop.time() + hold_s
        while True:
            event = await self.next_event(max(0.0, min(_POLL_S, end - loop.time())))
            if isinstance(event, Finished):
                self.close()
                raise start_error(event.error or ServerError("aborted", "the request was aborted", 503))
            if event is not None:  # Started; it always comes before any Tokens
                return True
            if request is not None and await request.is_disconnected():
                self.close()
                raise ApiError(499, "client_disconnected", "the client closed the connection")
            if loop.time() >= end:
                return False

    async def events(self) -> AsyncIterator[Tokens | Finished]:
        """Tokens events, then one Finished."""
        while True:
            event = await self.next_event(timeout=1.0)
            if event is None or isinstance(event, Started):
                continue
            yield event
            if isinstance(event, Finished):
                return

    async def collect(self, request: Request) -> Completed:
        """Wait for the whole output (non-streaming). Aborts when the client goes away.
        Raises ApiError when the request failed."""
        done = Completed(self.ticket, Finished("abort"))
        loop = asyncio.get_running_loop()
        next_check = loop.time() + _POLL_S
        try:
            while True:
                event = await self.next_event(_POLL_S)
                if loop.time() >= next_check:  # tokens may keep coming: check on a clock, not when idle
                    next_check = loop.time() + _POLL_S
                    if await request.is_disconnected():
                        raise ApiError(499, "client_disconnected", "the client closed the connection")
                if isinstance(event, Tokens):
                    done.token_ids.extend(event.output.new_token_ids)
                    done.text += event.output.text_delta
                    done.logprobs.extend(event.output.logprobs or [])
                    if event.output.prompt_logprobs is not None:
                        done.prompt_logprobs = event.output.prompt_logprobs
                elif isinstance(event, Finished):
                    done.finished = event
                    break
        finally:
            self.close()
        if done.finished.error is not None:
            raise start_error(done.finished.error)
        return done

    async def aclose(self) -> None:
        """close() for Starlette background tasks (a sync one would run on a thread pool)."""
        self.close()

    def release(self) -> None:
        """Hand a held choice (admit_unit's `held`) to the engine."""
        self.worker.release(self.ticket)

    def close(self, error: ServerError | None = None) -> None:
        """`error`: why it is aborted if it has not finished (None: the client went away)."""
        if self._closed:
            return
        self._closed = True
        self.runtime.open_responses -= 1
        if self.finished is None:
            self.worker.abort(self.request_id, error)
        self.lease.release()
