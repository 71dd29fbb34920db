"""Bounded output for one streamed response.

The worker never waits for a client: it posts every step's tokens to the request's queue. A client
that stops reading blocks the stream's send (uvicorn stops writing once the transport holds 64 KiB),
so the queue would grow with every token. Two limits end that:

- backlog: tokens the engine generated that the stream has not yet taken, checked every `POLL_S`;
  over `stream_max_pending_tokens` the request is aborted in the engine (its KV blocks freed) and the
  connection dropped;
- write progress: the connection guard drops a connection whose queued bytes the client accepts none
  of for `write_timeout_s`; the stream then sees the disconnect and aborts the same way.

Either way the request ends with status `cancelled`, reason `slow_client` (metrics, request log).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

from fastapi import Request

from server.http.guarded_protocol import GuardedH11Protocol, connection_of
from server.serving.handle import Handle
from server.serving.ticket import Finished, ServerError, Tokens

log = logging.getLogger("tokenmill.server")

POLL_S = 0.25  # how often a stream's backlog is checked
SLOW_CLIENT = ServerError("slow_client", "the client did not read its stream; it was disconnected", 499)


class StreamGuard:
    """One streamed request: its events, counted as the stream takes them, and the backlog watch."""

    def __init__(self, handle: Handle, conn: GuardedH11Protocol | None, max_pending_tokens: int) -> None:
        self.handle = handle
        self._conn = conn  # None when not served through the guard (ASGI test transport)
        self._max_pending = max_pending_tokens
        self._taken = 0  # output tokens the stream has taken from the queue
        self._dropped = False

    @classmethod
    def for_request(cls, request: Request, handle: Handle, max_pending_tokens: int) -> StreamGuard:
        return cls(handle, connection_of(request.scope), max_pending_tokens)

    async def events(self) -> AsyncIterator[Tokens | Finished]:
        """The request's events until it ends, or until its connection is closed (nothing more
        can be sent: the backlog is dropped, not rendered)."""
        async for event in self.handle.events():
            if self._dropped or (self._conn is not None and self._conn.close_reason is not None):
                return
            if isinstance(event, Tokens):
                self._taken += len(event.output.new_token_ids)
            yield event

    @property
    def backlog(self) -> int:
        """Tokens generated but not yet taken by the stream (the worker updates the count first)."""
        return self.handle.ticket.completion_tokens - self._taken

    async def watch(self) -> None:
        """Runs beside the stream until it ends: drops the client once its backlog passes the bound."""
        while not self._dropped:
            await asyncio.sleep(POLL_S)
            if self.backlog > self._max_pending:
                self.drop()

    def drop(self) -> None:
        """Abort the request (KV freed by the worker's next iteration) and drop the connection."""
        self._dropped = True
        log.info("request %s: the client is %d tokens behind (bound %d); disconnecting it",
                 self.handle.request_id, self.backlog, self._max_pending)  # fmt: skip
        self.handle.close(SLOW_CLIENT)
        if self._conn is not None:
            self._conn.drop("slow_client", abort=True)

    def close(self) -> None:
        """The stream ended (sent, client gone, or dropped): abort the request if it still runs."""
        slow = self._dropped or (self._conn is not None and self._conn.close_reason == "slow_client")
        self.handle.close(SLOW_CLIENT if slow else None)

    async def aclose(self) -> None:
        """close() for Starlette background tasks."""
        self.close()
