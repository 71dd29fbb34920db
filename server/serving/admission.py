"""Admission: per-lane bounds on what may wait, and Retry-After for what may not. Plain Python, no locks,
no I/O. Who runs next is not decided here: lanes are the engine scheduler's priority levels
(engine/ordering.py: interactive 0, standard 1, batch 2, with aging and deadlines).

A request counts against its lane from admission until it starts (the engine scheduled it for the
first time) or ends. Each lane is bounded in such requests and in their tokens (prompt + max_tokens);
the caller asks `fits()` before `admit()` and answers 429 when it does not, with `retry_after()`
estimated from the recent start rate. The caller (the worker) holds the lock; methods that need the
time take `now`, so tests drive the clock.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping

from server.config.lanes import Lane, LaneBounds


class Admission:
    """Requests admitted and not yet started, per lane. Not thread-safe: the caller holds a lock."""

    def __init__(
        self,
        bounds: Mapping[Lane, LaneBounds],
        rate_window_s: float = 30.0,
        default_retry_after_s: int = 1,
        max_retry_after_s: int = 60,
    ) -> None:
        missing = [lane.label for lane in Lane if lane not in bounds]
        if missing:
            raise ValueError(f"bounds missing for lanes {missing}")
        self._bounds = dict(bounds)
        self._queued: dict[str, tuple[Lane, int]] = {}  # request id -> (lane, tokens), until it starts
        self._depth = dict.fromkeys(Lane, 0)
        self._tokens = dict.fromkeys(Lane, 0)
        self._rate_window_s = rate_window_s
        self._default_retry_after_s = default_retry_after_s
        self._max_retry_after_s = max_retry_after_s
        self._starts: deque[float] = deque(maxlen=512)  # clock times of recent starts: the drain rate

    def __len__(self) -> int:
        return len(self._queued)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._queued

    def depth(self, lane: Lane) -> int:
        return self._depth[lane]

    def queued_tokens(self, lane: Lane) -> int:
        return self._tokens[lane]

    def bounds(self, lane: Lane) -> LaneBounds:
        return self._bounds[lane]

    def fits(self, lane: Lane, tokens: int) -> bool:
        """Whether a request of `tokens` may join `lane` now. An empty lane takes any one request,
        so a request larger than the token bound is slow, not impossible."""
        if not self._depth[lane]:
            return True
        bound = self._bounds[lane]
        return self._depth[lane] < bound.max_requests and self._tokens[lane] + tokens <= bound.max_tokens

    def full_reason(self, lane: Lane) -> str:
        """Which bound a refused request hit: queue_requests or queue_tokens."""
        return "queue_requests" if self._depth[lane] >= self._bounds[lane].max_requests else "queue_tokens"

    def admit(self, request_id: str, lane: Lane, tokens: int) -> None:
        """Count a request against its lane until started() or ended(). Call fits() first."""
        if request_id in self._queued:
            raise ValueError(f"request_id {request_id!r} is already queued")
        self._queued[request_id] = (lane, tokens)
        self._depth[lane] += 1
        self._tokens[lane] += tokens

    def started(self, request_id: str, now: float) -> None:
        """The request left the queue (first scheduled): its lane has room again."""
        if self._release(request_id):
            self._starts.append(now)

    def ended(self, request_id: str) -> None:
        """The request ended (any way); a no-op when it had started."""
        self._release(request_id)

    def retry_after(self, lane: Lane, now: float) -> int:
        """Seconds until `lane` likely has room, from the starts of the last `rate_window_s`.

        A slot opens in `lane` when its head starts, which under strict priority waits for every
        request queued in the lanes above it.
        """
        recent = [t for t in self._starts if now - t <= self._rate_window_s]
        if len(recent) < 2:
            return self._default_retry_after_s
        span = max(now - recent[0], 1e-3)
        rate = len(recent) / span  # requests starting per second
        ahead = 1 + sum(self._depth[higher] for higher in Lane if higher < lane)
        return max(1, min(self._max_retry_after_s, math.ceil(ahead / rate)))

    def _release(self, request_id: str) -> bool:
        entry = self._queued.pop(request_id, None)
        if entry is None:
            return False
        lane, tokens = entry
        self._depth[lane] -= 1
        self._tokens[lane] -= tokens
        return True
