"""The waiting queue: requests ordered by (priority, arrival_time, request_id)."""

from __future__ import annotations

import heapq

from engine.request import Request


class _Entry:
    __slots__ = ("key", "request", "alive")

    def __init__(self, request: Request) -> None:
        self.key = request.sort_key()
        self.request = request
        self.alive = True

    def __lt__(self, other: _Entry) -> bool:
        return self.key < other.key


class RequestQueue:
    """A heap with lazy removal. add/pop/peek O(log n); remove O(1)."""

    def __init__(self) -> None:
        self._heap: list[_Entry] = []
        self._entries: dict[str, _Entry] = {}

    def add(self, request: Request) -> None:
        if request.request_id in self._entries:
            raise ValueError(f"request {request.request_id!r} is already queued")
        entry = _Entry(request)
        self._entries[request.request_id] = entry
        heapq.heappush(self._heap, entry)

    def peek(self) -> Request | None:
        self._drop_dead()
        return self._heap[0].request if self._heap else None

    def pop(self) -> Request:
        self._drop_dead()
        entry = heapq.heappop(self._heap)
        del self._entries[entry.request.request_id]
        return entry.request

    def remove(self, request_id: str) -> Request | None:
        entry = self._entries.pop(request_id, None)
        if entry is None:
            return None
        entry.alive = False
        return entry.request

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def _drop_dead(self) -> None:
        while self._heap and not self._heap[0].alive:
            heapq.heappop(self._heap)
