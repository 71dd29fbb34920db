"""A fixed pool of per-sequence state slots, accounted like KV blocks. Plain Python, no torch.

A hybrid model (engine/models/lfm2.py) keeps, per running sequence, a fixed-size state for each of its
recurrent layers (a conv window: engine/state/conv_cache.py) in one preallocated slot. The scheduler
takes a slot when it admits a request (no admission without a free slot) and frees it when the request
finishes, is aborted or is preempted. Preemption is by recompute: the state is not saved; the request
runs its prompt (and the tokens it generated) again from position 0, which rebuilds the state from a zero
window. The slot a request holds is on the request (Request.state_slot, written only here).
"""

from __future__ import annotations

from collections.abc import Iterable

from engine.request import Request


class StatePool:
    def __init__(self, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError(f"a state pool needs at least one slot, got {num_slots}")
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))  # a stack: pop() hands out the lowest slot first

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_slots - len(self._free)

    def has_free(self) -> bool:
        return bool(self._free)

    def take(self, request: Request) -> int:
        """The request's slot, taking a free one if it holds none (RuntimeError when none is free: the
        scheduler checks has_free() before admitting)."""
        if request.state_slot is not None:
            return request.state_slot
        if not self._free:
            raise RuntimeError(f"no free state slot for request {request.request_id!r}")
        request.state_slot = self._free.pop()
        return request.state_slot

    def free(self, request: Request) -> None:
        """Give the request's slot back (nothing when it holds none). Its contents are left as they are:
        the next holder starts from position 0, which reads a zero window, not the slot."""
        if request.state_slot is None:
            return
        self._free.append(request.state_slot)
        request.state_slot = None

    def check_integrity(self, requests: Iterable[Request]) -> None:
        """RuntimeError unless every slot is either free or held by exactly one of the live `requests`."""
        held = [r.state_slot for r in requests if r.state_slot is not None]
        if len(set(held)) != len(held):
            raise RuntimeError(f"a state slot is held twice: {sorted(held)}")
        if set(held) & set(self._free) or len(held) + len(self._free) != self.num_slots:
            raise RuntimeError(f"state slots: {len(held)} held + {len(self._free)} free != {self.num_slots}")
