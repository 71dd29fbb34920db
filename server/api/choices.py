"""Several engine requests behind one HTTP request: a list of prompts, `n` samples of each, or both.
One choice is one engine request (its own ticket, response-cache lookup and lease on the version the
route picked); choice `index` = prompt index x n + sample index, as OpenAI numbers them.

The choices are admitted as one unit (server/serving/admission.py): all at once or none (one 429, or a
400 when the lane can never hold them), counting as one request against the lane's request bound and
their tokens in all against its token bound, before anything is sent. Each still has its own queue
deadline once admitted: a choice it ends before the choice started is answered empty and marked
(finish_reason `timeout` with an `error`), and the choices that ran are kept; the request is a 503
only when none started (server/api/openai_shapes.py lays the marks out). Choices past the request's share
of the engine's seats (a quarter of max_num_seqs, server/serving/gateway.py seat_share) run one priority
level lower, so a large `n` never holds every seat against another client's request.

Samples of one prompt share its KV blocks through the prefix cache: the first sample goes to the engine
at once, the others (admitted with it, held) when its prompt has run (its first token came), so they
find the prompt's full blocks cached and compute only the last partial block. Sample j of a seeded
request uses seed + j (vLLM's rule), so the samples differ and each is reproducible.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import TYPE_CHECKING

from fastapi import Request
from sse_starlette import EventSourceResponse
from starlette.background import BackgroundTask

from engine.api import SamplingParams
from server.api.stream_guard import StreamGuard
from server.http import sse
from server.http.errors import ApiError
from server.serving.dispatch import start_unit
from server.serving.gateway import GenerationRequest, start_error
from server.serving.handle import Completed, Handle
from server.serving.ticket import Finished, Tokens

if TYPE_CHECKING:
    from server.serving.deployment import Lease
    from server.serving.runtime import Runtime

_POLL_S = 0.005  # how often a staged sample checks whether the first one's prompt has run
_DISCONNECT_CHECK_S = 0.25
_DONE = object()
_CANCEL_RETRY_S = 0.05  # how often a choice task that outlived its cancellation is cancelled again


def sample_params(params: SamplingParams, j: int) -> SamplingParams:
    """Sample j's params: seed + j when the request is seeded (wrapping within the seed range)."""
    if j == 0 or params.seed is None:
        return params
    seed = params.seed + j
    return params.with_seed(seed if seed <= 2**64 - 1 else seed % 2**64)


async def start_choices(rt: Runtime, request: Request, lease: Lease,
                        groups: list[list[GenerationRequest]]) -> list[Handle]:  # fmt: skip
    """Admit every choice (`groups`: one list of samples per prompt) on the leased version as one unit, in
    index order; each prompt's later samples go to the engine once its first sample's prompt ran. Takes
    over `lease` (the first choice's); every other choice gets its own lease. Raises ApiError (400, 429,
    503, 499 when the client left) with every choice closed."""
    flat = [req for group in groups for req in group]
    leases = [lease] + [lease.sibling() for _ in flat[1:]]
    firsts: list[int] = []  # position of each prompt's first sample
    held: set[int] = set()  # the later samples' positions
    for group in groups:
        firsts.append(len(held) + len(firsts))
        held.update(range(firsts[-1] + 1, firsts[-1] + len(group)))
    param = "n" if any(len(group) > 1 for group in groups) else "prompt"
    handles = start_unit(rt, list(zip(leases, flat, strict=True)), held, param)
    try:
        for first, group in zip(firsts, groups, strict=True):
            if len(group) > 1:
                await _prompt_ran(handles[first], request)
                for h in handles[first + 1 : first + len(group)]:
                    h.release()
    except BaseException:
        for h in handles:
            h.close()
        raise
    return handles


async def _prompt_ran(handle: Handle, request: Request) -> None:
    """Wait until the first sample's prompt has run through the model (a first token, or its end), so
    its full blocks are in the prefix cache. A cache replay ran nothing, and samples that want prompt
    log-probabilities run their whole prompt anyway: no wait for them."""
    if handle.cached or handle.ticket.params.prompt_logprobs is not None:
        return
    ticket = handle.ticket
    loop = asyncio.get_running_loop()
    next_check = loop.time() + _DISCONNECT_CHECK_S
    while ticket.first_token_at is None and ticket.finished_at is None:
        await asyncio.sleep(_POLL_S)
        if loop.time() >= next_check:
            next_check = loop.time() + _DISCONNECT_CHECK_S
            if await request.is_disconnected():
                raise ApiError(499, "client_disconnected", "the client closed the connection")


async def collect_choices(handles: list[Handle], request: Request) -> list[Completed]:
    """Every choice's whole output, in index order. Of several choices, one that its queue deadline ended
    before it started comes back empty, marked (`finished.never_started`), beside what the others ran;
    only when none of them started is the request the 503 one choice gets. Any other failure closes
    the rest and is raised."""
    several = len(handles) > 1
    tasks = [asyncio.ensure_future(_collect(h, request, several)) for h in handles]
    try:
        done = list(await asyncio.gather(*tasks))
    except BaseException:
        for h in handles:
            h.close()
        await _cancelled(tasks)
        raise
    first_error = done[0].finished.error
    if several and first_error is not None and all(d.finished.never_started for d in done):
        raise start_error(first_error)
    return done


async def _collect(handle: Handle, request: Request, keep_unstarted: bool) -> Completed:
    """handle.collect(); with `keep_unstarted`, a queue timeout (the choice never ran) is its empty result."""
    try:
        return await handle.collect(request)
    except ApiError as exc:
        ticket = handle.ticket
        if keep_unstarted and exc.type == "queue_timeout" and ticket.error is not None:
            return Completed(ticket, Finished(ticket.finish_reason or "timeout", ticket.error))
        raise


async def _cancelled(tasks: Sequence[asyncio.Future]) -> None:
    """Cancel `tasks` and wait until each has ended. A task left pending with nothing referring to it is
    garbage collected mid-flight ("Task was destroyed but it is pending!"), and one cancel may not end a
    task: Python 3.10-3.11's asyncio.wait_for returns a result that came with the cancellation instead
    of raising it, so a pump went on to wait forever on the merged queue nobody read any more. So: cancel
    again every _CANCEL_RETRY_S until none is left, shielded so that the caller's own cancellation (the
    response's task group closing) cannot leave them behind either."""
    pending = {t for t in tasks if not t.done()}

    async def settle() -> None:
        nonlocal pending
        while pending:
            for task in pending:
                task.cancel()
            _, pending = await asyncio.wait(pending, timeout=_CANCEL_RETRY_S)

    if pending:
        await asyncio.shield(settle())


class ChoiceStreams:
    """The streamed choices of one response: one StreamGuard per choice (each bounds its own backlog),
    their events merged in arrival order through a one-slot queue, so an event counts as taken only
    when the response takes it and a slow client is still detected."""

    def __init__(self, request: Request, handles: list[Handle], max_pending_tokens: int) -> None:
        self.guards = [StreamGuard.for_request(request, h, max_pending_tokens) for h in handles]

    async def events(self) -> AsyncIterator[tuple[int, Tokens | Finished]]:
        """(choice index, event) until every choice finished or the connection closed."""
        if len(self.guards) == 1:
            async for event in self.guards[0].events():
                yield 0, event
            return
        queue: asyncio.Queue = asyncio.Queue(maxsize=1)
        tasks = [asyncio.ensure_future(self._pump(i, g, queue)) for i, g in enumerate(self.guards)]
        try:
            left = len(tasks)
            while left:
                index, event = await queue.get()
                if event is _DONE:
                    left -= 1
                elif isinstance(event, BaseException):
                    raise event
                else:
                    yield index, event
        finally:
            await _cancelled(tasks)

    @staticmethod
    async def _pump(index: int, guard: StreamGuard, queue: asyncio.Queue) -> None:
        try:
            async for event in guard.events():
                await queue.put((index, event))
        except Exception as exc:  # handed to the response, which fails the stream
            await queue.put((index, exc))
        await queue.put((index, _DONE))

    def response(self, content: AsyncIterator, ping_s: float,
                 headers: Mapping[str, str] | None = None) -> EventSourceResponse:  # fmt: skip
        return EventSourceResponse(content, ping=ping_s, headers=headers, background=BackgroundTask(self.aclose),
                                   data_sender_callable=self.watch, sep=sse.SEP)  # fmt: skip

    async def watch(self) -> None:
        await asyncio.gather(*(g.watch() for g in self.guards))

    def close(self) -> None:
        for g in self.guards:
            g.close()

    async def aclose(self) -> None:
        self.close()
