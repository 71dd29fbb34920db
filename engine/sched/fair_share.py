"""Fair share between tenants: a virtual token counter per tenant (after the VTC scheduler of "Fairness in
Serving Large Language Models", OSDI 2024). Plain Python, no torch; the scheduler owns one.

**Service.** Each tenant's counter is the service it received, in weighted tokens divided by its weight:
a computed prompt token counts `prompt_weight`, a generated token `output_weight` (generating costs a
step per token, a prompt token a fraction of one). Within one priority level, the backlogged tenant with
the smallest counter goes first (engine/sched/ordering.py puts the counter right after the effective
priority in the one order), so over time each backlogged tenant's service is proportional to its weight.

**No banking.** A tenant that becomes active (its first request queued while it had none queued or running)
is lifted to the smallest counter among the active tenants, and when no tenant is active every counter
restarts at 0: idle time never becomes credit, so a tenant that returns does not get a burst above its share.

**Seats.** Inside a lane requests do not preempt each other (ordering.py), except across tenants, by
seats: each active tenant's seat share is `max_num_seqs * weight / (sum of the active tenants' weights)`,
and a waiting request may take the seat of another tenant's running request when its own tenant would
still be within its share after the move, the other would still hold at least its own, and its own has
received no more service (`outranks`). So a tenant arriving at a server whose seats another holds starts
at once instead of waiting for one of them to end, and a move cannot be undone by the reverse move (that
would need the opposite inequalities), so seats do not trade back and forth; a move happens only while
the seats are split unfairly. Free seats go first to tenants under their share (ordering.py), then to the
least served tenant's request even past its share (the seat would otherwise idle); the service condition
keeps that from being taken back at once.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping

DEFAULT_TENANT = ""  # requests that name no tenant


class FairShare:
    """Per-tenant virtual token counters. Not thread-safe: the scheduler's thread owns it."""

    def __init__(self, weights: Mapping[str, float] | None = None, prompt_weight: float = 1.0,
                 output_weight: float = 2.0, max_seats: int | None = None) -> None:  # fmt: skip
        for name, w in (("prompt_weight", prompt_weight), ("output_weight", output_weight)):
            if not w >= 0:
                raise ValueError(f"{name} must be >= 0, got {w!r}")
        if max_seats is not None and not (isinstance(max_seats, int) and max_seats >= 1):
            raise ValueError(f"max_seats must be an integer >= 1 or None, got {max_seats!r}")
        self.prompt_weight = float(prompt_weight)
        self.output_weight = float(output_weight)
        self.max_seats = max_seats  # the scheduler's max_num_seqs; None: tenants never take each other's seats
        self._counter: dict[str, float] = {}  # tenant -> weighted service / weight, since the last idle moment
        self._active: Counter[str] = Counter()  # tenant -> its requests queued or running
        self._active_weight = 0.0  # the active tenants' weights summed (seat shares divide by it)
        self._seats: Counter[str] = Counter()  # tenant -> its requests running
        self.changes = 0  # bumped whenever a seat share or a seat count moves (callers cache orders by it)
        self._weights: dict[str, float] = {}
        self.set_weights(weights or {})

    def set_weights(self, weights: Mapping[str, float]) -> None:
        """Replace the weights (a config reload). Counters already earned stay: only future service is
        divided by the new weight. A tenant not named has weight 1."""
        bad = {t: w for t, w in weights.items() if not (isinstance(w, (int, float)) and w > 0)}
        if bad:
            raise ValueError(f"tenant weights must be numbers > 0, got {bad!r}")
        self._weights = {t: float(w) for t, w in weights.items()}
        self._active_weight = sum(self.weight(t) for t in self._active)
        self.changes += 1

    def weight(self, tenant: str) -> float:
        return self._weights.get(tenant, 1.0)

    def counter(self, tenant: str) -> float:
        """The tenant's service so far (0 for one never seen or since every tenant went idle)."""
        return self._counter.get(tenant, 0.0)

    @property
    def multi_tenant(self) -> bool:
        """Whether more than one tenant has requests: only then can the counters change an order."""
        return len(self._active) > 1

    def arrived(self, tenant: str) -> None:
        """A request of `tenant` entered the scheduler."""
        if not self._active[tenant]:
            others = [self.counter(t) for t in self._active]
            if others:
                self._counter[tenant] = max(self.counter(tenant), min(others))
            else:  # nobody active: everyone restarts level
                self._counter.clear()
            self._active_weight += self.weight(tenant)
            self.changes += 1
        self._active[tenant] += 1

    def left(self, tenant: str) -> None:
        """A request of `tenant` left the scheduler (finished, aborted, expired)."""
        if self._active[tenant] <= 1:
            del self._active[tenant]
            self._active_weight = sum(self.weight(t) for t in self._active)  # (no float drift)
            self.changes += 1
        else:
            self._active[tenant] -= 1

    def seated(self, tenant: str) -> None:
        """A request of `tenant` took a seat (started, or resumed after a preemption)."""
        self._seats[tenant] += 1
        self.changes += 1

    def unseated(self, tenant: str) -> None:
        """A running request of `tenant` left its seat (finished or preempted)."""
        self.changes += 1
        if self._seats[tenant] <= 1:
            del self._seats[tenant]
        else:
            self._seats[tenant] -= 1

    def seats(self, tenant: str) -> int:
        return self._seats.get(tenant, 0)

    def seat_share(self, tenant: str) -> float:
        """max_seats * the tenant's weight over the active tenants' weights (0 without max_seats)."""
        if self.max_seats is None:
            return 0.0
        return self.max_seats * self.weight(tenant) / (self._active_weight or self.weight(tenant))

    def at_share(self, tenant: str) -> bool:
        """Whether the tenant holds its seat share or more while another tenant is active (so, in one
        step's walk, seats freed together are dealt out by share instead of all to the least served)."""
        return self.max_seats is not None and len(self._active) > 1 and self.seats(tenant) >= self.seat_share(tenant)

    def under_share(self, tenant: str) -> bool:
        """Whether the tenant holds fewer seats than its share while another tenant is active (its
        seats counted with any it just took)."""
        return self.max_seats is not None and len(self._active) > 1 and self.seats(tenant) < self.seat_share(tenant)

    def charge(self, tenant: str, prompt_tokens: int, output_tokens: int) -> None:
        """Count service just given to `tenant`: prompt tokens computed, tokens generated."""
        cost = self.prompt_weight * prompt_tokens + self.output_weight * output_tokens
        if cost:
            self._counter[tenant] = self.counter(tenant) + cost / self.weight(tenant)

    def outranks(self, waiting: str, running: str) -> bool:
        """Whether a waiting request of tenant `waiting` may take the seat of a running one of `running`
        in the same lane: another tenant, served no more than it, and after the move the first is still
        within its seat share and the second still holds at least its own."""
        if self.max_seats is None or waiting == running or self.counter(waiting) > self.counter(running):
            return False
        return (self.seats(waiting) + 1 <= self.seat_share(waiting)
                and self.seats(running) - 1 >= self.seat_share(running))  # fmt: skip
