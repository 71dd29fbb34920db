"""Who runs next: the one ordering of requests. Every decision of the scheduler (which waiting request
starts, who gets the step's token budget first, who is preempted) reads it from here.

**Effective priority.** A request's `priority` (lower = more important; the server's lanes are
interactive 0, standard 1, batch 2) improves by one level for every `aging_s` seconds it has spent
waiting in all (before it first ran, and after each preemption), never past level 0 (a priority
already below 0 stays where it is). While a request runs its wait does not grow, so its level holds:
a batch request that waited `2 * aging_s` runs as an interactive one and is not preempted for one.

**Order.** `key(r) = (effective priority, its tenant holds its seat share, its tenant's service, arrival
time, request id)`, smallest first. The service is the tenant's virtual token counter and the seat share
its part of max_num_seqs (engine/sched/fair_share.py; with one tenant neither changes the order), so inside
a level tenants under their share of the seats go first, then the least served. The arrival time is the client's (given by
the caller), and a preempted request keeps it: it keeps its place in line.
- Waiting requests start in key order, strictly: none starts before an earlier one that cannot.
- The step's token budget is spent in key order over running and waiting requests together, so a long
  low-priority prefill is chunked behind more important work instead of holding the step.
- A waiting request may take a running request's place (its seat, its KV blocks) only when it
  `outranks` it: a strictly better effective priority, and another priority of its own. Equal
  effective priorities never preempt each other, and neither do requests of one priority (lane):
  inside a lane the oldest waiting request simply gets the next free seat, so taking a running
  request's seat would only trade one wait for another and pay a recompute. The one exception is
  between tenants: at one effective level, a request of a tenant under its share of the seats takes
  the seat of a tenant over its own (fair_share.py). The victim is the least
  important running request; ties go to the most served tenant's, then the one with the least computed
  work, then the latest arrival (`victim_key`, largest first).

**Churn.** Each preemption needs a strictly more important request of another lane, and levels only
ever improve (while waiting) and stop at 0. A preempted request can take its place back from its
preemptor only after waiting until it is strictly better than the level that one runs at, so a pair of
requests trades places at most `levels apart` times, at least `aging_s` apart; with aging off, never.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.request import Request, RequestStatus
from engine.sched.fair_share import FairShare

TOP_LEVEL = 0  # aging lifts a request up to this level (the server's interactive lane), no further


@dataclass(frozen=True)
class PriorityPolicy:
    aging_s: float = 0.0  # seconds of waiting per level gained; 0 turns aging off
    # Tenants' service counters (engine/sched/fair_share.py): the order inside a level; None: one tenant
    fair: FairShare | None = None

    def __post_init__(self) -> None:
        if isinstance(self.aging_s, bool) or not isinstance(self.aging_s, (int, float)) or not self.aging_s >= 0:
            raise ValueError(f"aging_s must be a number >= 0, got {self.aging_s!r}")

    def effective_priority(self, req: Request, now: float) -> int:
        """req.priority, improved by one level per aging_s of waiting in all (see the module docs)."""
        if self.aging_s <= 0:
            return req.priority
        waited = req.waited_s + (max(0.0, now - req.waiting_since) if req.status == RequestStatus.WAITING else 0.0)
        levels = int(waited // self.aging_s)
        return max(min(req.priority, TOP_LEVEL), req.priority - levels)

    def service(self, req: Request) -> float:
        """The service counter of req's tenant (0 without fair share)."""
        return 0.0 if self.fair is None else self.fair.counter(req.tenant)

    def key(self, req: Request, now: float) -> tuple[int, bool, float, float, str]:
        """The one order: smaller runs first."""
        full = self.fair is not None and self.fair.at_share(req.tenant)
        return (self.effective_priority(req, now), full, self.service(req), req.arrival_time, req.request_id)

    def victim_key(self, req: Request, now: float) -> tuple[int, float, int, float]:
        """Among running requests, the largest is preempted first."""
        return (self.effective_priority(req, now), self.service(req), -req.num_computed_tokens, req.arrival_time)

    def outranks(self, a: Request, b: Request, now: float) -> bool:
        """Whether a may take b's place: a strictly better effective priority, and not b's own priority;
        or, at the same effective priority, a's tenant under its seat share and b's over its own
        (engine/sched/fair_share.py)."""
        ea, eb = self.effective_priority(a, now), self.effective_priority(b, now)
        if a.priority != b.priority and ea < eb:
            return True
        return ea == eb and self.fair is not None and self.fair.outranks(a.tenant, b.tenant)
