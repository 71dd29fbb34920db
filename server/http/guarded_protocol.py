"""uvicorn's h11 protocol with the connection layer's limits (`connections.ConnectionLimits`).

Each connection is in one phase, and a phase change sets its deadline:

    IDLE     no request in progress (new, or between keep-alive requests)  keep_alive_timeout_s, closed
    HEADERS  a request's first bytes came, not all its headers               header_timeout_s, 408
    BODY     headers in, the declared body not all in                         body_timeout_s, 408
    ACTIVE   the whole request is in; the app answers it                      none (write progress only)

In every phase, bytes queued for the client that it accepts none of for write_timeout_s drop the
connection (`slow_client`): the transport is aborted, its buffer discarded, and the app sees the
disconnect (a stream then aborts its request in the engine). At the connection cap a new connection
evicts the oldest idle, then unfinished, one; when every connection has a request being answered it
gets 503 + Retry-After and is closed. Sockets are taken off the listening socket only as far as the
guard's budget allows (server/http/acceptor.py). Framing a proxy could read differently is refused (framing.py).
"""

from __future__ import annotations

import asyncio
import enum
import json
import logging
import socket
import struct
from collections.abc import Mapping
from typing import Any

import h11
from starlette.types import ASGIApp, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from server.http.connections import ConnectionGuard
from server.http.errors import ApiError, error_response
from server.http.framing import HeadScanner, framing_problem

log = logging.getLogger("tokenmill.connections")

CONNECTION_SCOPE_KEY = "tokenmill.connection"  # the request's GuardedH11Protocol, in the ASGI scope


class Phase(enum.Enum):
    IDLE = "idle"
    HEADERS = "headers"
    BODY = "body"
    ACTIVE = "active"


def raw_response(status: int, reason: str, kind: str, message: str, retry_after_s: int | None = None) -> bytes:
    """A complete HTTP/1.1 error response that closes the connection, for when no request (or no
    ASGI cycle) exists to answer through."""
    body = json.dumps({"error": {"type": kind, "message": message}}).encode()
    head = [f"HTTP/1.1 {status} {reason}", "content-type: application/json", f"content-length: {len(body)}",
            "connection: close"]  # fmt: skip
    if retry_after_s is not None:
        head.append(f"retry-after: {retry_after_s}")
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


class GuardedH11Protocol(H11Protocol):
    """One connection. uvicorn builds it with `functools.partial(GuardedH11Protocol, guard=guard)`."""

    def __init__(self, config, server_state, app_state, _loop=None, *, guard: ConnectionGuard) -> None:
        super().__init__(config, server_state, app_state, _loop)
        self.guard = guard
        self.app = _ConnectionApp(self.app, self)
        self.phase = Phase.IDLE
        self.deadline: float | None = None  # when the current phase's limit passes
        self.close_reason: str | None = None  # why the server closes it (None: it does not)
        self._refused = False  # answered 503 at the cap; read and discarded until it closes
        self._head = HeadScanner()
        self._write_since: float | None = None  # since when bytes wait with no progress
        self._write_left = 0  # bytes waiting at the last check

    # -- asyncio.Protocol --------------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        sock = transport.get_extra_info("socket")
        if sock is not None:
            self.guard.arrived(sock.fileno())  # accepted by server/http/acceptor.py: now live or refused
        if not self.guard.make_room():
            self._refuse(transport)
            return
        super().connection_made(transport)
        self.guard.add(self)
        self._enter(Phase.IDLE)
        size = self.guard.limits.send_buffer_bytes
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            # asyncio sets TCP_NODELAY only on sockets made with proto IPPROTO_TCP, and uvicorn binds with 0:
            # without it, Nagle holds a response's body (a second write) until the client ACKs its headers,
            # and a delayed ACK makes that ~40 ms on every JSON answer.
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if size is not None and sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, size)  # bounds what the kernel holds for it

    def connection_lost(self, exc: Exception | None) -> None:
        self.guard.lost(self)
        if not self._refused:
            super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._refused or self.close_reason is not None:
            return  # being closed: what it sends is read only so the close is clean
        if self.conn.their_state is h11.IDLE:  # bytes of a new request's head
            if self.phase is Phase.IDLE:
                self._enter(Phase.HEADERS)
            problem = self._head.feed(data)
            if problem is not None:
                self._bad_framing(problem)
                return
        super().data_received(data)
        self._track()

    def on_response_complete(self) -> None:
        self._head = HeadScanner()  # the next request's head starts after this response
        if self.conn.our_state is h11.DONE and self.conn.their_state is h11.DONE:
            problem = self._head.feed(self.conn.trailing_data[0])  # a pipelined request, if any
            if problem is not None:
                self._bad_framing(problem)
        super().on_response_complete()
        self._track()

    def shutdown(self) -> None:
        if self.close_reason is None and not self._refused:
            super().shutdown()

    # -- the guard's side ------------------------------------------------------------------------------
    def eviction_rank(self) -> int | None:
        return {Phase.IDLE: 0, Phase.HEADERS: 1, Phase.BODY: 1, Phase.ACTIVE: None}[self.phase]

    def check(self, now: float) -> None:
        """Called every tick by the guard's sweep."""
        if self.deadline is not None and now >= self.deadline and self.close_reason is None:
            self._expire()
            return
        left = self.transport.get_write_buffer_size()
        if left == 0:
            self._write_since = None
        elif self._write_since is None or left < self._write_left:
            self._write_since = now  # the client took some bytes since the last check
        elif now - self._write_since >= self.guard.limits.write_timeout_s:
            log.info("%s: accepted no bytes for %.2fs (%d bytes unsent): dropped as a slow client",
                     _peer(self.client), now - self._write_since, left)  # fmt: skip
            self.drop("slow_client", abort=True, force=True)
        self._write_left = left

    def drop(self, reason: str, abort: bool = False, response: bytes | None = None, force: bool = False) -> None:
        """Close the connection for `reason` (counted once). `response`: bytes sent first unless a
        response is being sent. `abort`: discard unsent bytes. `force`: also when already closing."""
        if self.close_reason is not None and not force:
            return
        if self.close_reason is None:
            self.close_reason = reason
            self.guard.closing(self, reason)
        cycle = self.cycle
        answering = cycle is not None and cycle.response_started and not cycle.response_complete
        if response is not None and not answering:
            self.transport.write(response)
        if cycle is not None and not cycle.response_complete:
            cycle.disconnected = True  # uvicorn's flag: its send() stops writing, receive() says disconnect
            cycle.message_event.set()
        if self.flow is not None:
            self.flow.resume_writing()  # a send() waiting for the client returns now
        if abort:
            _reset(self.transport)
        else:
            self.transport.close()

    # -- internals -----------------------------------------------------------------------------------
    def _enter(self, phase: Phase) -> None:
        limits = self.guard.limits
        timeout = {Phase.IDLE: limits.keep_alive_timeout_s, Phase.HEADERS: limits.header_timeout_s,
                   Phase.BODY: limits.body_timeout_s, Phase.ACTIVE: None}[phase]  # fmt: skip
        self.phase = phase
        self.deadline = None if timeout is None else self.guard.clock() + timeout

    def _track(self) -> None:
        """Move to the phase h11's state says (after parsing, and after a response)."""
        if self.close_reason is not None or self.transport.is_closing():
            return
        state = self.conn.their_state
        if state is h11.IDLE:
            phase = Phase.HEADERS if self.conn.trailing_data[0] else Phase.IDLE
        elif state is h11.SEND_BODY:
            phase = Phase.BODY
        else:  # DONE or MUST_CLOSE: the request is in
            phase = Phase.ACTIVE
        if phase is not self.phase:
            self._enter(phase)

    def _expire(self) -> None:
        limits = self.guard.limits
        if self.phase is Phase.IDLE:
            self.drop("keep_alive_timeout")
        elif self.phase is Phase.HEADERS:
            self.drop("header_timeout", response=raw_response(
                408, "Request Timeout", "request_timeout",
                f"the request headers did not arrive within {limits.header_timeout_s:g}s"))  # fmt: skip
        elif self.phase is Phase.BODY:
            self.drop("body_timeout", response=raw_response(
                408, "Request Timeout", "request_timeout",
                f"the request body did not arrive within {limits.body_timeout_s:g}s"))  # fmt: skip

    def _bad_framing(self, problem: str) -> None:
        self.drop("bad_framing", response=raw_response(400, "Bad Request", "invalid_request", problem))

    def _refuse(self, transport: asyncio.Transport) -> None:
        """At the cap with every connection busy: 503 now, then read and discard until the client closes
        (or linger_s passed), so the kernel does not reset the connection over unread request bytes."""
        self._refused = True
        self.transport = transport
        self.close_reason = "refused"
        lingers = self.guard.refuse(self)
        limits = self.guard.limits
        transport.write(raw_response(
            503, "Service Unavailable", "overloaded",
            f"the server holds its maximum of {limits.max_connections} connections; retry after "
            f"{limits.retry_after_s}s", retry_after_s=limits.retry_after_s))  # fmt: skip
        if lingers and transport.can_write_eof():
            transport.write_eof()
        else:
            transport.close()

    def end_linger(self) -> None:
        """A refused connection read for linger_s: close it, whatever it still sends."""
        _reset(self.transport)

    def evict(self) -> None:
        """Make room at the cap: an idle connection is closed, an unfinished request gets 503."""
        if self.phase is Phase.IDLE:
            self.drop("evicted")
            return
        limits = self.guard.limits
        self.drop("evicted", response=raw_response(
            503, "Service Unavailable", "overloaded",
            f"the server is at its maximum of {limits.max_connections} connections and this request was "
            f"the slowest to arrive; retry after {limits.retry_after_s}s", retry_after_s=limits.retry_after_s))  # fmt: skip


class _ConnectionApp:
    """The per-connection ASGI entry: refuses ambiguous framing (400, closed) and puts the connection
    in the scope (`CONNECTION_SCOPE_KEY`) for the streams' slow-client handling."""

    def __init__(self, app: ASGIApp, conn: GuardedH11Protocol) -> None:
        self._app = app
        self._conn = conn

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            problem = framing_problem(scope["http_version"], scope["headers"])
            if problem is not None:
                err = ApiError(400, "invalid_request", problem, headers={"Connection": "close"})
                await error_response(scope["path"], err)(scope, receive, send)
                self._conn.drop("bad_framing")
                return
        scope[CONNECTION_SCOPE_KEY] = self._conn
        await self._app(scope, receive, send)


def _reset(transport: asyncio.Transport) -> None:
    """Abort with a TCP reset: the unsent bytes are dropped by the kernel too (a plain close would
    keep them queued, and the connection alive, for a client that never reads)."""
    sock = transport.get_extra_info("socket")
    if sock is not None:
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        except OSError:
            pass  # already closed
    transport.abort()


def _peer(client: tuple[str, int] | None) -> str:
    return f"{client[0]}:{client[1]}" if client else "client"


def connection_of(scope: Mapping[str, Any]) -> GuardedH11Protocol | None:
    """The connection a request came on, when it came through the guard."""
    return scope.get(CONNECTION_SCOPE_KEY)
