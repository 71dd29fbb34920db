"""The listening socket's accept loop, in place of asyncio's: a socket is accepted only when the
connection guard's budget has room for it (server/http/connections.py `ConnectionGuard.room`).

Why not asyncio's own: `loop.create_server` accepts up to `backlog` sockets (uvicorn's 2,048) each
time the listening socket is readable, and the cap is applied later, in each connection's
connection_made. Under `prlimit --nofile=1024` a burst of 1,600 connections took every file that way:
accept() then failed ~3,000 times a second and /health waited up to 3.7 s (issue 45). Here a wake-up
accepts at most min(accept_batch, room) sockets, and with no room the listening socket is not read
(new connections wait in the kernel's backlog) until a socket is released: the process never holds
more client sockets than the cap + max_lingering + accept_batch. A connection past the cap still
makes room by evicting an idle one, or is refused with 503 and closed (server/http/guarded_protocol.py).
"""

from __future__ import annotations

import asyncio
import errno
import functools
import logging
import socket
import ssl as ssl_module
from collections.abc import Callable

from server.http.connections import ConnectionGuard

log = logging.getLogger("tokenmill.connections")

RETRY_S = 0.25  # after accept() failed for want of files (EMFILE ...): the next try, or sooner if one is freed
_OUT_OF_RESOURCES = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)


class Acceptor:
    """Serves one listening socket. It stands where uvicorn keeps its asyncio servers
    (`uvicorn.Server.servers`): close() stops accepting, wait_closed() returns once it has."""

    def __init__(self, loop: asyncio.AbstractEventLoop, sock: socket.socket,
                 protocol_factory: Callable[[], asyncio.Protocol], guard: ConnectionGuard, backlog: int,
                 ssl: ssl_module.SSLContext | None = None) -> None:  # fmt: skip
        self._loop = loop
        self._sock = sock
        self._factory = protocol_factory
        self._guard = guard
        self._ssl = ssl
        self._reading = False
        self._closed = False
        self._making: set[asyncio.Task] = set()  # connections being made (kept referenced until done)
        sock.setblocking(False)
        sock.listen(backlog)  # the kernel's queue: connections wait there while there is no room
        guard.when_room(self._resume)
        self._resume()

    def close(self) -> None:
        """Stop accepting and close the listening socket (connections already made stay open)."""
        self._closed = True
        self._pause()
        self._sock.close()

    async def wait_closed(self) -> None:
        """Nothing to wait for once close() returned (asyncio's Server has the same method)."""

    # -- the accept loop ----------------------------------------------------------------------------------
    def _resume(self) -> None:
        if not self._reading and not self._closed:
            self._loop.add_reader(self._sock.fileno(), self._accept_some)
            self._reading = True

    def _pause(self) -> None:
        if self._reading:
            self._loop.remove_reader(self._sock.fileno())
            self._reading = False

    def _accept_some(self) -> None:
        """Accept what the budget allows, at most accept_batch, then stop reading when it is spent."""
        for _ in range(min(self._guard.limits.accept_batch, self._guard.room())):
            try:
                conn, _ = self._sock.accept()
            except (BlockingIOError, InterruptedError, ConnectionAbortedError):
                return  # the kernel's queue is empty
            except OSError as exc:
                if exc.errno not in _OUT_OF_RESOURCES:
                    log.warning("accept() failed: %s", exc)
                    return
                self._guard.accept_failed(exc)
                self._pause()
                self._loop.call_later(RETRY_S, self._resume)
                return
            self._start(conn)
        if self._guard.room() == 0:
            self._pause()  # the guard calls _resume when a socket is released

    def _start(self, conn: socket.socket) -> None:
        conn.setblocking(False)
        self._guard.accepted(conn.fileno())
        made = self._loop.connect_accepted_socket(self._factory, conn, ssl=self._ssl)
        task = self._loop.create_task(made)
        self._making.add(task)
        task.add_done_callback(functools.partial(self._made, conn, conn.fileno()))

    def _made(self, conn: socket.socket, fd: int, task: asyncio.Task) -> None:
        self._making.discard(task)
        failed = task.cancelled() or task.exception() is not None
        if failed and self._guard.abandoned(fd):  # never reached connection_made: nobody else closes it
            conn.close()
