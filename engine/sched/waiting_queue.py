"""The waiting requests, in the order of engine/sched/ordering.py, without sorting them all every step.

Inside one priority and one tenant, requests that never ran wait since their arrival and share their
tenant's service counter, so arrival order is also their effective order: one heap per (priority,
tenant) by (arrival, id) holds them, and its head is that pair's best. Preempted requests wait since
their preemption, which breaks that; they are few (one per preemption not yet resumed) and are compared
one by one. `peek` costs O(priorities x tenants waiting + preempted).
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator

from engine.request import Request
from engine.sched.ordering import PriorityPolicy


class WaitingQueue:
    def __init__(self, policy: PriorityPolicy) -> None:
        self._policy = policy
        # (priority, tenant) -> heap of (arrival, id, request) for requests never preempted; lazy removal
        self._fresh: dict[tuple[int, str], list[tuple[float, str, Request]]] = {}
        self._resumed: dict[str, Request] = {}  # preempted, waiting again
        self._members: dict[str, Request] = {}  # everything queued (both kinds)
        self.changes = 0  # bumped by every add and remove (callers cache peek() by it)

    def add(self, req: Request) -> None:
        """Queue req. A request that ran before (num_preemptions > 0) goes to the resumed set."""
        if req.request_id in self._members:
            raise ValueError(f"request {req.request_id!r} is already queued")
        self._members[req.request_id] = req
        self.changes += 1
        if req.num_preemptions:
            self._resumed[req.request_id] = req
        else:
            key = (req.priority, req.tenant)
            heapq.heappush(self._fresh.setdefault(key, []), (req.arrival_time, req.request_id, req))

    def peek(self, now: float) -> Request | None:
        """The waiting request that runs next, left in place."""
        best: Request | None = None
        best_key = None
        empty = []
        for key, heap in self._fresh.items():
            self._drop_dead(heap)
            if heap:
                best, best_key = _better(self._policy, heap[0][2], now, best, best_key)
            else:
                empty.append(key)
        for key in empty:  # a tenant's heap goes when it drains: tenants come and go
            del self._fresh[key]
        for req in self._resumed.values():
            best, best_key = _better(self._policy, req, now, best, best_key)
        return best

    def remove(self, req: Request) -> bool:
        """Take req out of the queue (it starts, or it ended); False when it was not queued."""
        if self._members.get(req.request_id) is not req:
            return False
        del self._members[req.request_id]
        self.changes += 1
        self._resumed.pop(req.request_id, None)  # a fresh one stays in its heap until it surfaces
        return True

    def __contains__(self, req: Request) -> bool:
        return self._members.get(req.request_id) is req

    def __len__(self) -> int:
        return len(self._members)

    @property
    def num_resumed(self) -> int:
        """Queued requests that ran before (preempted, waiting to resume)."""
        return len(self._resumed)

    def __iter__(self) -> Iterator[Request]:
        return iter(list(self._members.values()))

    def _drop_dead(self, heap: list[tuple[float, str, Request]]) -> None:
        # Dead: removed, or it ran since and is queued again among the resumed.
        while heap and (self._members.get(heap[0][1]) is not heap[0][2] or heap[0][1] in self._resumed):
            heapq.heappop(heap)


def _better(policy: PriorityPolicy, req: Request, now: float, best: Request | None, best_key) -> tuple:
    key = policy.key(req, now)
    if best is None or key < best_key:
        return req, key
    return best, best_key
