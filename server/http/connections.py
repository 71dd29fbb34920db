"""The connection layer's limits: what a client may hold open, and for how long, before it sends a
whole request or while it stops reading. uvicorn has no header or body timeout, no per-connection
write timeout and no connection cap that keeps serving under a flood, so a small guard does it
(`guarded_protocol.GuardedH11Protocol`, uvicorn's own h11 protocol with timers); see docs/SERVER.md.

`ConnectionGuard` is the shared part: the live connections (oldest first), the client sockets the
process holds (the budget `server/http/acceptor.py` accepts within, so a burst of connections never
takes the files the process needs), one sweep task that checks every connection's deadline and write
progress each `tick_s`, counters for /metrics, and accept() failures counted and logged once per
interval.

The open files: the default cap is the open-files limit less FD_RESERVE, and the sockets held never
exceed the cap + max_lingering (refused connections still answered) + accept_batch (sockets accepted
and not yet counted, or closing: evicted, refused at once). At 1,024 open files: a cap of 896, at
most 960 client sockets, 64 files left for the process's own (13 when serving, measured: stdio, the
event loop's epoll and pipes, the listening socket) and for what it opens later (a new version's
files, the feedback database).
"""

from __future__ import annotations

import asyncio
import logging
import resource
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

log = logging.getLogger("tokenmill.connections")

OWN_FILES = 64  # open files kept for the process's own use (13 measured while serving; model files, logs)
MAX_LINGERING = 32  # refused connections read at once (each holds a socket for linger_s)
ACCEPT_BATCH = 32  # sockets accepted per wake-up at most, and the budget's share for sockets being closed
FD_RESERVE = OWN_FILES + MAX_LINGERING + ACCEPT_BATCH  # the default cap: the open-files limit less this


@dataclass(frozen=True)
class ConnectionLimits:
    """Connection-layer limits (settings: `header_timeout_s` ...). Seconds unless named otherwise."""

    header_timeout_s: float  # first byte of a request to the end of its headers; then 408 and close
    body_timeout_s: float  # end of the headers to the end of the declared body; then 408 and close
    keep_alive_timeout_s: float  # no request in progress (new, or between requests); then closed
    write_timeout_s: float  # bytes wait for the client and it accepts none for this long: dropped
    max_connections: int  # at the cap, the oldest idle or unfinished connection makes room, else 503
    send_buffer_bytes: int | None = None  # SO_SNDBUF of client sockets; None: the kernel's autotuning
    retry_after_s: int = 1  # Retry-After of a 503 refusal at the cap
    linger_s: float = 2.0  # a refused connection is read (and discarded) this long, so the 503 arrives
    max_lingering: int = MAX_LINGERING  # refused connections read at once; more are closed right after the 503
    accept_batch: int = ACCEPT_BATCH  # sockets accepted per wake-up at most (server/http/acceptor.py)
    tick_s: float = 0.25  # how often deadlines are checked: each fires at most this late
    accept_log_interval_s: float = 10.0  # accept() failures are logged at most once per interval

    def __post_init__(self) -> None:
        for name in ("header_timeout_s", "body_timeout_s", "keep_alive_timeout_s", "write_timeout_s",
                     "linger_s", "tick_s", "accept_log_interval_s"):  # fmt: skip
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.send_buffer_bytes is not None and self.send_buffer_bytes < 1:
            raise ValueError(f"send_buffer_bytes must be >= 1, got {self.send_buffer_bytes}")
        for name in ("max_connections", "accept_batch"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_lingering < 0:
            raise ValueError(f"max_lingering must be >= 0, got {self.max_lingering}")

    @property
    def max_sockets(self) -> int:
        """Client sockets held at most: the cap's connections, refused ones still answered, and a batch
        accepted but not yet counted or being closed (evicted, refused at once)."""
        return self.max_connections + self.max_lingering + self.accept_batch


class GuardedConnection(Protocol):
    """What the guard needs of a connection (GuardedH11Protocol)."""

    close_reason: str | None  # set once the server decided to close it

    def eviction_rank(self) -> int | None:
        """Which to close first to make room: 0 idle, 1 still sending its request; None when a request
        of it is being answered (never evicted)."""

    def check(self, now: float) -> None:
        """Enforce its deadline and write progress at `now`."""

    def drop(self, reason: str, abort: bool = False) -> None:
        """Close it now, for `reason` (counted)."""

    def evict(self) -> None:
        """Close it to make room for a new connection (counted as `evicted`)."""

    def end_linger(self) -> None:
        """Close a refused connection that was read for linger_s."""


class ConnectionGuard:
    """The live connections of one server and the counters /metrics reads. Event loop only."""

    def __init__(self, limits: ConnectionLimits, clock: Callable[[], float] = time.monotonic) -> None:
        self.limits = limits
        self.clock = clock
        self._live: dict[GuardedConnection, None] = {}  # not yet lost, oldest first
        self._closing: set[GuardedConnection] = set()  # live ones the server is closing
        self._refused: dict[GuardedConnection, float | None] = {}  # refused -> when its linger ends (None: closed at once)
        self._pending: set[int] = set()  # file descriptors accepted whose connection is not made yet
        self._room_waiters: list[Callable[[], None]] = []  # acceptors paused for want of room
        self.closed: Counter[str] = Counter()  # connections the server closed, by reason
        self.accept_errors = 0  # accept() failures (open-files limit), ever
        self._accept_unlogged = 0  # ... since the last log line
        self._accept_logged_at: float | None = None
        self._last_accept_error: BaseException | None = None
        self._task: asyncio.Task | None = None

    # -- the socket budget (server/http/acceptor.py) ----------------------------------------------------
    @property
    def sockets_held(self) -> int:
        """Client sockets the process holds: accepted and not yet made, live (closing ones too), refused."""
        return len(self._pending) + len(self._live) + len(self._refused)

    def room(self) -> int:
        """How many more sockets may be accepted now."""
        return max(0, self.limits.max_sockets - self.sockets_held)

    def accepted(self, fd: int) -> None:
        """A socket was accepted; its connection is made on a later loop iteration (`arrived`)."""
        self._pending.add(fd)

    def arrived(self, fd: int) -> None:
        """The accepted socket's connection is made: from now on it is live or refused."""
        self._pending.discard(fd)

    def abandoned(self, fd: int) -> bool:
        """The accepted socket's connection could not be made; True when it was still counted as pending
        (the caller closes the socket)."""
        if fd not in self._pending:
            return False
        self._pending.discard(fd)
        self._wake()
        return True

    def when_room(self, callback: Callable[[], None]) -> None:
        """Call `callback` whenever a socket is released (an acceptor that paused resumes)."""
        self._room_waiters.append(callback)

    def _wake(self) -> None:
        if self.room() > 0:
            for callback in self._room_waiters:
                callback()

    # -- registry ------------------------------------------------------------------------------------
    @property
    def open_connections(self) -> int:
        """Connections counted against the cap: live and not being closed by the server."""
        return len(self._live) - len(self._closing)

    def make_room(self) -> bool:
        """Room for one more connection, evicting the oldest idle (then unfinished) one at the cap.
        False: every connection has a request being answered; the new one is refused."""
        if self.open_connections < self.limits.max_connections:
            return True
        unfinished = None  # the oldest connection still sending its request, in case none is idle
        for conn in self._live:  # oldest first
            if conn.close_reason is not None:
                continue
            rank = conn.eviction_rank()
            if rank == 0:
                conn.evict()
                return True
            if rank is not None and unfinished is None:
                unfinished = conn
        if unfinished is None:
            return False
        unfinished.evict()
        return True

    def add(self, conn: GuardedConnection) -> None:
        self._live[conn] = None

    def lost(self, conn: GuardedConnection) -> None:
        """The connection's socket is closed: its room in the budget is free again."""
        self._live.pop(conn, None)
        self._closing.discard(conn)
        self._refused.pop(conn, None)
        self._wake()

    def refuse(self, conn: GuardedConnection) -> bool:
        """Track a refused connection until its socket is closed. True: it is read for linger_s (so its
        503 arrives); False: too many linger already, it is closed at once."""
        self.closed["refused"] += 1
        lingering = sum(1 for until in self._refused.values() if until is not None)
        until = self.clock() + self.limits.linger_s if lingering < self.limits.max_lingering else None
        self._refused[conn] = until
        return until is not None

    def closing(self, conn: GuardedConnection, reason: str) -> None:
        """The server started closing `conn` for `reason` (counted once): no longer against the cap."""
        self.closed[reason] += 1
        if conn in self._live:
            self._closing.add(conn)

    def drop_all(self, reason: str) -> None:
        """Close every connection now (shutdown after the drain): those with a request in progress
        are aborted, unsent bytes discarded; idle ones are closed."""
        for conn in list(self._live):
            if conn.close_reason is None:
                conn.drop(reason, abort=conn.eviction_rank() is None)
        for conn in list(self._refused):
            conn.end_linger()

    # -- sweep -----------------------------------------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        if self._task is None:
            self._task = loop.create_task(self._sweep_forever())

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None

    async def _sweep_forever(self) -> None:
        while True:
            await asyncio.sleep(self.limits.tick_s)
            try:
                self.sweep(self.clock())
            except Exception:  # a bug here must not end the sweep: every timeout hangs on it
                log.exception("connection sweep failed")

    def sweep(self, now: float) -> None:
        for conn in list(self._live):
            conn.check(now)
        for conn, until in list(self._refused.items()):
            if until is not None and now >= until:
                conn.end_linger()
        self._flush_accept_log(now)
        self._wake()  # an acceptor paused for room never waits longer than a tick, whatever was missed

    # -- accept() failures --------------------------------------------------------------------------------
    def accept_failed(self, exc: OSError) -> None:
        """accept() failed for want of files or memory (the acceptor retries shortly): counted, and
        logged once per interval, not once per attempt."""
        self.accept_errors += 1
        self._accept_unlogged += 1
        self._last_accept_error = exc
        now = self.clock()
        if self._accept_logged_at is None or now - self._accept_logged_at >= self.limits.accept_log_interval_s:
            self._log_accept_errors(now)

    def _flush_accept_log(self, now: float) -> None:
        due = self._accept_logged_at is not None and now - self._accept_logged_at >= self.limits.accept_log_interval_s
        if self._accept_unlogged and due:
            self._log_accept_errors(now)

    def _log_accept_errors(self, now: float) -> None:
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        since = "" if self._accept_logged_at is None else f" in the last {now - self._accept_logged_at:.0f}s"
        log.warning("accept() failed %d times%s (%d in all): %s; %d connections open, open-files limit %d",
                    self._accept_unlogged, since, self.accept_errors, self._last_accept_error,
                    self.open_connections, soft)  # fmt: skip
        self._accept_unlogged = 0
        self._accept_logged_at = now


# -- the process's open-files limit -----------------------------------------------------------------------
def raise_open_files_limit(target: int = 1 << 20) -> tuple[int, int, int]:
    """Raise the soft RLIMIT_NOFILE toward the hard limit (at most `target`). Returns (before, after,
    hard); `after == before` when it could not be raised."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = target if hard == resource.RLIM_INFINITY else min(hard, target)
    if want <= soft:
        return soft, soft, hard
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    except (ValueError, OSError):
        return soft, soft, hard
    return soft, want, hard


def default_max_connections(open_files: int) -> int:
    """The cap when none is configured: what the open-files limit leaves after the process's own."""
    return max(16, open_files - FD_RESERVE)
