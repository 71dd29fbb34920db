"""uvicorn, run with the connection guard: `guarded_config` builds its Config (the guarded h11
protocol, the keep-alive timeout, a short graceful-shutdown bound) and `GuardedServer` runs the
guard's sweep, installs the accept-error log, and closes what is left at shutdown.

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
from typing import Any

import uvicorn

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
    """uvicorn.Server with the guard's sweep and accept-error log; `app.state.connection_guard` lets
    the app export the guard's counters."""

    def __init__(self, config: uvicorn.Config, app: Any, guard: ConnectionGuard) -> None:
        super().__init__(config)
        self.guard = guard
        app.state.connection_guard = guard

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        loop = asyncio.get_running_loop()
        loop.set_exception_handler(self.guard.loop_exception_handler)
        self.guard.start(loop)
        await super().startup(sockets)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        # Whatever is still open after the drain is closed now: a stalled reader must not hold the
        # process (uvicorn would wait for it forever).
        self.guard.drop_all("shutdown")
        try:
            await super().shutdown(sockets)
        finally:
            self.guard.stop()
