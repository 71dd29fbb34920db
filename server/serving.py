"""From a parsed request to what answers it, shared by every generation route: pick the model version
(a lease on it, server/registry.py), look the request up in the response cache, and either replay the
stored result (`ReplayHandle`: the same events a generation sends, from memory) or admit it to that
version's engine (`RequestHandle`), recording the result when it may be cached.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import time
from collections.abc import AsyncIterator, Iterator
from typing import TYPE_CHECKING

from fastapi import Request

from engine.api import RequestOutput
from server.gateway import Completed, GenerationRequest, RequestHandle, admit
from server.response_cache import CachedResponse, Recorder
from server.ticket import Collector, Finished, ServerError, Ticket, Tokens

if TYPE_CHECKING:
    from server.deployment import Lease
    from server.registry import ModelSlot
    from server.runtime import Runtime

MODEL_VERSION_HEADER = "X-Model-Version"


@contextlib.contextmanager
def picked(rt: Runtime, model: str | None) -> Iterator[tuple[ModelSlot, Lease]]:
    """The slot `model` names and a lease on the version that serves this request. The lease is released
    when the block raises; otherwise the handle built in the block owns it. Raises ApiError 404/503."""
    slot, lease = rt.models.acquire(model)
    try:
        yield slot, lease
    except BaseException:
        lease.release()
        raise


def cache_scope(rt: Runtime, request: Request, user: str | None) -> str:
    """Whose response-cache entries a request may see: its API key's (unless response_cache_scope is
    global) and its `user`'s; "" when neither applies (shared)."""
    parts = []
    if rt.settings.response_cache_scope == "api_key" and rt.settings.accepted_api_keys():
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        parts.append(f"key:{token.strip()}")
    if user:
        parts.append(f"user:{user}")
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:32] if parts else ""


def start(rt: Runtime, lease: Lease, req: GenerationRequest) -> RequestHandle | ReplayHandle:
    """A handle that answers `req` on the leased version: from the response cache when it holds this exact
    request, else admitted to the engine. Takes over the lease. Raises ApiError as admit() does."""
    rt.check_accepting()
    dep = lease.deployment
    key = rt.cache.key(dep.name, dep.version, req.scope, req.prompt_token_ids, req.params, req.cache)
    if key is not None:
        hit = rt.cache.get(key)
        if hit is not None:
            dep.metrics.cache_hits.inc()
            return ReplayHandle(rt, lease, req, hit)
        dep.metrics.cache_misses.inc()
    handle = admit(rt, lease, req)
    if key is not None:
        handle.recorder = Recorder(rt.cache, key)
    return handle


class ReplayHandle:
    """A response-cache hit with RequestHandle's interface: the stored steps come back as Tokens events
    (same token ids, text and log-probabilities, step by step), then Finished; usage says `cached`."""

    cached = True

    def __init__(self, rt: Runtime, lease: Lease, req: GenerationRequest, entry: CachedResponse) -> None:
        self.runtime = rt
        self.lease = lease
        self.version = lease.deployment.version
        self.entry = entry
        n = len(req.prompt_token_ids)
        lane = req.lane if req.lane is not None else rt.lane_for_size(n + req.params.max_tokens)
        ticket = Ticket(req.request_id, req.prompt_token_ids, req.params, lane, Collector(asyncio.get_running_loop()))
        ticket.arrival = ticket.started_at = time.monotonic()
        ticket.prompt_tokens, ticket.cached_tokens = entry.prompt_tokens, entry.cached_tokens
        self.ticket = ticket
        self.finished: Finished | None = None
        self._closed = False
        rt.open_responses += 1

    @property
    def request_id(self) -> str:
        return self.ticket.request_id

    async def wait_started(self, hold_s: float, request: Request | None = None) -> bool:
        return True

    async def events(self) -> AsyncIterator[Tokens | Finished]:
        emitted = 0
        for step in self.entry.steps:
            emitted += len(step.token_ids)
            if step.token_ids and self.ticket.first_token_at is None:
                self.ticket.first_token_at = time.monotonic()
            logprobs = list(step.logprobs) if step.logprobs is not None else None
            yield Tokens(RequestOutput(self.request_id, list(step.token_ids), step.text, logprobs, False, None,
                                       self.entry.prompt_tokens, emitted, self.entry.cached_tokens))  # fmt: skip
        yield self._finish()

    async def collect(self, request: Request) -> Completed:
        done = Completed(self.ticket, Finished("abort"))
        try:
            async for event in self.events():
                if isinstance(event, Tokens):
                    done.token_ids.extend(event.output.new_token_ids)
                    done.text += event.output.text_delta
                    done.logprobs.extend(event.output.logprobs or [])
                else:
                    done.finished = event
        finally:
            self.close()
        return done

    def _finish(self) -> Finished:
        ticket = self.ticket
        ticket.finished_at = ticket.last_token_at = time.monotonic()
        ticket.finish_reason = self.entry.finish_reason
        ticket.completion_tokens = self.entry.completion_tokens
        self.finished = Finished(self.entry.finish_reason)
        self.runtime.on_cache_hit(self.lease.deployment, ticket)
        return self.finished

    async def aclose(self) -> None:
        self.close()

    def close(self, error: ServerError | None = None) -> None:
        """Nothing runs in an engine: `error` (why a stream was cut) changes nothing."""
        if not self._closed:
            self._closed = True
            self.runtime.open_responses -= 1
            self.lease.release()
