"""Admission lanes: a bounded multi-level priority queue with aging. Plain Python, no locks, no I/O.

Three lanes, strict priority between them (interactive before standard before batch), FIFO inside a
lane. A request that has waited `aging_s` is treated as one lane higher, two lanes higher after
`2 * aging_s`, so batch traffic cannot starve. Each lane is bounded in queued requests and queued
tokens (prompt + max_tokens); the caller asks `fits()` before `push()` and answers 429 when it does
not, with `retry_after()` estimated from the recent drain rate.

The caller (the worker) owns the lock; every method takes `now` so tests drive the clock.
"""

from __future__ import annotations

import enum
import math
from collections import OrderedDict, deque
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any


class Lane(enum.IntEnum):
    """A lane's value is the engine priority it maps to: lower runs first."""

    INTERACTIVE = 0
    STANDARD = 1
    BATCH = 2

    @property
    def label(self) -> str:
        return self.name.lower()

    @classmethod
    def parse(cls, value: str | int) -> Lane:
        """A lane from its name ("interactive") or its number (0); ValueError otherwise."""
        if isinstance(value, bool):
            raise ValueError(f"priority must be one of {cls.names()} or 0-2, got {value!r}")
        if isinstance(value, int):
            if value in (0, 1, 2):
                return cls(value)
        elif isinstance(value, str) and value.lower() in cls.names():
            return cls[value.upper()]
        raise ValueError(f"priority must be one of {cls.names()} or 0-2, got {value!r}")

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(lane.label for lane in cls)


@dataclass(frozen=True)
class LaneBounds:
    """How much one lane may hold: size it as expected requests/s x the queue wait you accept."""

    max_requests: int
    max_tokens: int

    def __post_init__(self) -> None:
        for name in ("max_requests", "max_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")


@dataclass(eq=False)
class QueuedRequest:
    """One waiting request. `payload` is the caller's object, carried untouched."""

    request_id: str
    lane: Lane
    tokens: int  # prompt + max_tokens: the work it brings, counted against the lane's token bound
    arrival: float  # clock seconds when queued; set by push()
    deadline: float | None = None  # leave the queue by then (expire() removes it)
    payload: Any = None
    seq: int = field(default=0, compare=False)  # push order; breaks ties between equal arrivals

    def effective_lane(self, now: float, aging_s: float) -> int:
        """The lane it counts as now: one higher per `aging_s` waited, never above interactive."""
        if aging_s <= 0:
            return int(self.lane)
        steps = int(max(0.0, now - self.arrival) // aging_s)
        return max(0, int(self.lane) - steps)

    def key(self, now: float, aging_s: float) -> tuple[int, float, int]:
        """The one ordering of waiting requests: (effective lane, arrival, push order); smaller first."""
        return (self.effective_lane(now, aging_s), self.arrival, self.seq)


class LaneQueue:
    """Bounded lanes with strict priority and aging. Not thread-safe: the caller holds a lock."""

    def __init__(
        self,
        bounds: Mapping[Lane, LaneBounds],
        aging_s: float,
        rate_window_s: float = 30.0,
        default_retry_after_s: int = 1,
        max_retry_after_s: int = 60,
    ) -> None:
        missing = [lane.label for lane in Lane if lane not in bounds]
        if missing:
            raise ValueError(f"bounds missing for lanes {missing}")
        self._bounds = dict(bounds)
        self._aging_s = aging_s
        self._lanes: dict[Lane, OrderedDict[str, QueuedRequest]] = {lane: OrderedDict() for lane in Lane}
        self._tokens = dict.fromkeys(Lane, 0)
        self._seq = 0
        self._rate_window_s = rate_window_s
        self._default_retry_after_s = default_retry_after_s
        self._max_retry_after_s = max_retry_after_s
        self._pops: deque[float] = deque(maxlen=512)  # clock times of recent pops: the drain rate

    def __len__(self) -> int:
        return sum(len(q) for q in self._lanes.values())

    def __contains__(self, request_id: str) -> bool:
        return any(request_id in q for q in self._lanes.values())

    def __iter__(self) -> Iterator[QueuedRequest]:
        for q in self._lanes.values():
            yield from q.values()

    @property
    def aging_s(self) -> float:
        return self._aging_s

    def depth(self, lane: Lane) -> int:
        return len(self._lanes[lane])

    def queued_tokens(self, lane: Lane) -> int:
        return self._tokens[lane]

    def bounds(self, lane: Lane) -> LaneBounds:
        return self._bounds[lane]

    def fits(self, lane: Lane, tokens: int) -> bool:
        """Whether a request of `tokens` may join `lane` now. An empty lane takes any one request,
        so a request larger than the token bound is slow, not impossible."""
        bound = self._bounds[lane]
        if not self._lanes[lane]:
            return True
        return len(self._lanes[lane]) < bound.max_requests and self._tokens[lane] + tokens <= bound.max_tokens

    def push(self, item: QueuedRequest, now: float) -> None:
        """Queue `item` at the tail of its lane; its arrival becomes `now`. Call fits() first."""
        if item.request_id in self:
            raise ValueError(f"request_id {item.request_id!r} is already queued")
        self._seq += 1
        item.seq = self._seq
        item.arrival = now
        self._lanes[item.lane][item.request_id] = item
        self._tokens[item.lane] += item.tokens

    def peek(self, now: float) -> QueuedRequest | None:
        """The request pop() would return, left in place."""
        # Inside a lane the head is the oldest, so it also has the smallest key: compare heads only.
        heads = [next(iter(q.values())) for q in self._lanes.values() if q]
        if not heads:
            return None
        return min(heads, key=lambda item: item.key(now, self._aging_s))

    def pop(self, now: float) -> QueuedRequest | None:
        """Remove and return the request to run next, or None when all lanes are empty."""
        item = self.peek(now)
        if item is None:
            return None
        self._take(item)
        self._pops.append(now)
        return item

    def remove(self, request_id: str) -> QueuedRequest | None:
        """Remove a queued request (cancelled); None when it is not queued."""
        for q in self._lanes.values():
            item = q.get(request_id)
            if item is not None:
                self._take(item)
                return item
        return None

    def expire(self, now: float) -> list[QueuedRequest]:
        """Remove and return every request whose deadline has passed."""
        expired = [item for item in self if item.deadline is not None and item.deadline <= now]
        for item in expired:
            self._take(item)
        return expired

    def retry_after(self, lane: Lane, now: float) -> int:
        """Seconds until `lane` likely has room, from the pops of the last `rate_window_s`.

        A slot opens in `lane` when its head leaves, which under strict priority waits for every
        request queued in the lanes above it.
        """
        recent = [t for t in self._pops if now - t <= self._rate_window_s]
        if len(recent) < 2:
            return self._default_retry_after_s
        span = max(now - recent[0], 1e-3)
        rate = len(recent) / span  # requests leaving the queue per second
        ahead = 1 + sum(len(self._lanes[higher]) for higher in Lane if higher < lane)
        return max(1, min(self._max_retry_after_s, math.ceil(ahead / rate)))

    def _take(self, item: QueuedRequest) -> None:
        del self._lanes[item.lane][item.request_id]
        self._tokens[item.lane] -= item.tokens
