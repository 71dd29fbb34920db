"""Admission: per-lane bounds on what may wait, and Retry-After for what may not. Plain Python, no locks,
no I/O. Who runs next is not decided here: lanes are the engine scheduler's priority levels
(engine/sched/ordering.py: interactive 0, standard 1, batch 2, with aging and deadlines).

What is admitted is a *unit*: the engine requests of one HTTP request (its choices: a list of prompts,
`n` samples), admitted or refused together. A unit counts as one request against its lane's request
bound, from admission until every member started (the engine scheduled it for the first time) or
ended; each member's tokens (prompt + max_tokens) count against the token bound until that member
starts or ends. The caller asks `fits()` before `admit_unit()` and answers 429 when it does not, with
`retry_after()` estimated from the recent start rate. An empty lane takes any single request, however
large; a unit of several requests above the token bound can never be admitted (`never_fits`: the
caller answers 400 naming the bound). The caller (the worker) holds the lock; methods that need the
time take `now`, so tests drive the clock.
"""

from __future__ import annotations

import itertools
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
        # request id -> (lane, tokens, its unit's key), until it starts or ends
        self._queued: dict[str, tuple[Lane, int, int]] = {}
        self._unit_left: dict[int, int] = {}  # unit key -> its members still queued
        self._keys = itertools.count()
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

    def never_fits(self, lane: Lane, tokens: int, requests: int) -> bool:
        """Whether a unit of `requests` requests and `tokens` tokens in all can never be admitted: several
        requests above the lane's token bound (only a single request may exceed it, in an empty lane)."""
        return requests > 1 and tokens > self._bounds[lane].max_tokens

    def full_reason(self, lane: Lane) -> str:
        """Which bound a refused request hit: queue_requests or queue_tokens."""
        return "queue_requests" if self._depth[lane] >= self._bounds[lane].max_requests else "queue_tokens"

    def admit(self, request_id: str, lane: Lane, tokens: int) -> None:
        """Count one request (a unit of one) against its lane until started() or ended(). Call fits() first."""
        self.admit_unit(lane, {request_id: tokens})

    def admit_unit(self, lane: Lane, members: Mapping[str, int]) -> None:
        """Count a unit (request id -> its tokens) as one request against `lane`, its tokens in all against
        the token bound, until each member started() or ended(). Call fits() with the total first."""
        if not members:
            raise ValueError("a unit has at least one request")
        for request_id in members:
            if request_id in self._queued:
                raise ValueError(f"request_id {request_id!r} is already queued")
        if len(set(members)) != len(members):
            raise ValueError("a unit names a request twice")
        key = next(self._keys)
        for request_id, tokens in members.items():
            self._queued[request_id] = (lane, tokens, key)
            self._tokens[lane] += tokens
        self._unit_left[key] = len(members)
        self._depth[lane] += 1

    def started(self, request_id: str, now: float) -> None:
        """The request left the queue (first scheduled): its tokens free their room, and its unit's place
        in the lane once it was the unit's last member queued."""
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
        """Stop counting `request_id`; True when that took its unit out of the lane."""
        entry = self._queued.pop(request_id, None)
        if entry is None:
            return False
        lane, tokens, key = entry
        self._tokens[lane] -= tokens
        self._unit_left[key] -= 1
        if self._unit_left[key]:
            return False
        del self._unit_left[key]
        self._depth[lane] -= 1
        return True
