"""A response-cache hit, answered with a Handle like any other (server/serving/handle.py): the stored
steps come back as the same Tokens events a generation sends (same token ids, text and
log-probabilities, step by step), then Finished; it is counted, timed and logged as a request."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from fastapi import Request

from engine.api import RequestOutput
from server.serving.gateway import GenerationRequest
from server.serving.handle import Completed
from server.serving.response_cache import CachedResponse
from server.serving.ticket import Collector, Finished, ServerError, Ticket, Tokens

if TYPE_CHECKING:
    from server.serving.deployment import Lease
    from server.serving.runtime import Runtime


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
        ticket = Ticket(req.request_id, req.prompt_token_ids, req.params, lane, Collector(asyncio.get_running_loop()),
                        record=req.record)  # fmt: skip
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
        self.runtime.accounting.cache_hit(self.lease.deployment, ticket)
        return self.finished

    def release(self) -> None:
        pass  # nothing waits in an engine

    async def aclose(self) -> None:
        self.close()

    def close(self, error: ServerError | None = None) -> None:
        """Nothing runs in an engine: `error` (why a stream was cut) changes nothing."""
        if not self._closed:
            self._closed = True
            self.runtime.open_responses -= 1
            self.lease.release()
