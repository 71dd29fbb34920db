"""uvicorn, run with the connection guard: `guarded_config` builds its Config (the guarded h11
protocol, the keep-alive timeout, a short graceful-shutdown bound) and `GuardedServer` runs the
guard's sweep, serves its listening sockets with the guard's accept loop (server/http/acceptor.py)
instead of asyncio's, and closes what is left at shutdown.

Why a guard around uvicorn and not another server: uvicorn already carries the app, the drain and
the tests; what it lacks (header/body/write timeouts, a cap that evicts idle connections, a stalled
reader that cannot hold the shutdown) takes one subclass of its h11 protocol, whose parser state
(their_state, trailing_data) gives the phases for free. Another ASGI server would trade that for a
second set of timeout semantics to verify, and one whose connections live outside Python (granian)
could not hand the connection to the stream that must abort its engine request.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import socket
import sys
from typing import Any

import uvicorn
from uvicorn.config import STARTUP_FAILURE

from server.http.acceptor import Acceptor
from server.http.connections import ConnectionGuard
from server.http.guarded_protocol import GuardedH11Protocol

log = logging.getLogger("tokenmill.server")

# After the drain, how long uvicorn waits for responses still running before it cancels them.
GRACEFUL_SHUTDOWN_S = 0.5


def guarded_config(app: Any, guard: ConnectionGuard, keep_alive_timeout_s: float, **options: Any) -> uvicorn.Config:
    """A uvicorn Config serving `app` through the guard. `options`: host, port, log_level, ..."""
    base: dict[str, Any] = {"lifespan": "on", "access_log": False, "log_config": None, "loop": "asyncio"}
    # uvicorn types these as a protocol class and ints; it accepts any protocol factory and float seconds.
    return uvicorn.Config(
        app,
        http=functools.partial(GuardedH11Protocol, guard=guard),  # type: ignore[arg-type]
        timeout_keep_alive=keep_alive_timeout_s,  # type: ignore[arg-type]
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,  # type: ignore[arg-type]
        **{**base, **options},
    )


class GuardedServer(uvicorn.Server):
    """uvicorn.Server with the guard's sweep and accept loop; `app.state.connection_guard` lets the app
    export the guard's counters."""

    def __init__(self, config: uvicorn.Config, app: Any, guard: ConnectionGuard) -> None:
        super().__init__(config)
        self.guard = guard
        app.state.connection_guard = guard

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        """uvicorn's startup (the app's lifespan, then the listening sockets: `sockets`, else one bound
        from the config's host and port, fd or uds), each served by an Acceptor."""
        loop = asyncio.get_running_loop()
        self.guard.start(loop)
        await self.lifespan.startup()
        if self.lifespan.should_exit:
            sys.exit(STARTUP_FAILURE)
        config = self.config
        try:
            listeners = sockets if sockets is not None else [config.bind_socket()]  # it logs the address
        except SystemExit:  # the address is taken (bind_socket logged it): end the app as uvicorn does
            await self.lifespan.shutdown()
            raise

        def new_connection() -> asyncio.Protocol:
            return config.http_protocol_class(config=config, server_state=self.server_state,  # type: ignore[call-arg]
                                              app_state=self.lifespan.state, _loop=loop)  # fmt: skip

        acceptors = [Acceptor(loop, sock, new_connection, self.guard, config.backlog, config.ssl) for sock in listeners]
        self.servers = acceptors  # type: ignore[assignment]  # uvicorn only calls close() and wait_closed()
        self.started = True

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        # Whatever is still open after the drain is closed now: a stalled reader must not hold the
        # process (uvicorn would wait for it forever).
        self.guard.drop_all("shutdown")
        try:
            await super().shutdown(sockets)
        finally:
            self.guard.stop()
