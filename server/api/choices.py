"""Several engine requests behind one HTTP request: a list of prompts, `n` samples of each, or both.
One choice is one engine request (its own ticket, lane admission, response-cache lookup and lease on
the version the route picked); choice `index` = prompt index x n + sample index, as OpenAI numbers them.

Samples of one prompt share its KV blocks through the prefix cache: the first sample is admitted at
once, the others when its prompt has run (its first token came), so they find the prompt's full
blocks cached and compute only the last partial block. Sample j of a seeded request uses seed + j
(vLLM's rule), so the samples differ and each is reproducible. Admission happens before anything is
sent: a 429 for any choice closes the others and answers 429.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping
from typing import TYPE_CHECKING

from fastapi import Request
from sse_starlette import EventSourceResponse
from starlette.background import BackgroundTask

from engine.api import SamplingParams
from server.api.stream_guard import StreamGuard
from server.http import sse
from server.http.errors import ApiError
from server.serving.dispatch import start
from server.serving.gateway import GenerationRequest
from server.serving.handle import Completed, Handle
from server.serving.ticket import Finished, Tokens

if TYPE_CHECKING:
    from server.serving.deployment import Lease
    from server.serving.runtime import Runtime

_POLL_S = 0.005  # how often a staged sample checks whether the first one's prompt has run
_DISCONNECT_CHECK_S = 0.25
_DONE = object()


def sample_params(params: SamplingParams, j: int) -> SamplingParams:
    """Sample j's params: seed + j when the request is seeded (wrapping within the seed range)."""
    if j == 0 or params.seed is None:
        return params
    seed = params.seed + j
    return params.with_seed(seed if seed <= 2**64 - 1 else seed % 2**64)


async def start_choices(rt: Runtime, request: Request, lease: Lease,
                        groups: list[list[GenerationRequest]]) -> list[Handle]:  # fmt: skip
    """Admit every choice (`groups`: one list of samples per prompt) on the leased version, in index
    order. Takes over `lease` (the first choice's); every other choice gets its own lease. Raises
    ApiError (400, 429, 503, 499 when the client left) with every choice closed."""
    started: list[Handle] = []  # in start order, to close on failure
    handles: list[Handle] = []  # in index order
    dep = lease.deployment
    try:
        for i, group in enumerate(groups):
            started.append(start(rt, lease, group[0]) if i == 0 else _start_leased(rt, dep.acquire(), group[0]))
        for first, group in zip(list(started), groups, strict=True):
            handles.append(first)
            if len(group) > 1:
                await _prompt_ran(first, request)
                for req in group[1:]:
                    started.append(_start_leased(rt, dep.acquire(), req))
                    handles.append(started[-1])
    except BaseException:
        for h in started:
            h.close()
        raise
    return handles


def _start_leased(rt: Runtime, lease: Lease, req: GenerationRequest) -> Handle:
    try:
        return start(rt, lease, req)
    except BaseException:
        lease.release()
        raise


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
    """Every choice's whole output, in index order. The first failure closes the rest and is raised."""
    tasks = [asyncio.ensure_future(h.collect(request)) for h in handles]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:
            task.cancel()
        for h in handles:
            h.close()
        raise


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
            for task in tasks:
                task.cancel()

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
