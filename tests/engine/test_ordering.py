"""The one ordering of requests (engine/sched/ordering.py), stated as tests:

- key = (effective priority, arrival time, request id), smallest runs first;
- effective priority = priority, one level better per aging_s of waiting in all (before the first run
  and after each preemption), never past level 0; it holds while the request runs;
- a request may take another's place only with a strictly better effective priority, and never one of
  its own priority (inside a lane the oldest waiting request gets the next free seat);
- the victim is the least important running request, then the least computed work, then the latest
  arrival;
- the waiting queue always yields the request with the smallest key.
"""

from __future__ import annotations

import random

import pytest

from engine.request import RequestStatus
from engine.sched.ordering import PriorityPolicy
from engine.sched.waiting_queue import WaitingQueue

from .factories import make_request


def waiting(rid, priority, arrival, waited_before=0.0, since=None, preemptions=0):
    r = make_request(rid, 4, priority=priority, arrival=arrival)
    r.waited_s = waited_before
    r.waiting_since = arrival if since is None else since
    r.num_preemptions = preemptions
    return r


def test_key_is_priority_then_arrival_then_id():
    p = PriorityPolicy(aging_s=0)
    reqs = [waiting("b", 1, 5.0), waiting("a", 1, 5.0), waiting("late", 0, 9.0), waiting("early", 2, 0.0)]
    assert [r.request_id for r in sorted(reqs, key=lambda r: p.key(r, now=10.0))] == ["late", "a", "b", "early"]


def test_aging_gains_one_level_per_period_of_waiting_and_stops_at_zero():
    p = PriorityPolicy(aging_s=10.0)
    r = waiting("batch", 2, arrival=0.0)
    assert [p.effective_priority(r, t) for t in (0.0, 9.99, 10.0, 19.99, 20.0, 500.0)] == [2, 2, 1, 1, 0, 0]
    special = waiting("special", -1, arrival=0.0)  # already above the top level: aging leaves it
    assert p.effective_priority(special, 500.0) == -1
    assert PriorityPolicy(aging_s=0).effective_priority(r, 500.0) == 2  # 0 turns aging off


def test_a_running_request_keeps_its_level_and_a_preempted_one_resumes_its_wait():
    p = PriorityPolicy(aging_s=10.0)
    r = waiting("batch", 2, arrival=0.0)
    r.status, r.waited_s = RequestStatus.RUNNING, 12.0  # started after 12 s of waiting: level 1
    assert p.effective_priority(r, 1000.0) == 1  # running does not age it further
    r.status, r.waiting_since = RequestStatus.WAITING, 1000.0  # preempted at t=1000
    assert p.effective_priority(r, 1007.0) == 1
    assert p.effective_priority(r, 1008.0) == 0  # 12 + 8 s waited in all


def test_outranks_is_strict():
    p = PriorityPolicy(aging_s=10.0)
    batch, inter = waiting("b", 2, 0.0), waiting("i", 0, 30.0)
    batch.status = RequestStatus.RUNNING  # started at once: it runs at level 2
    assert p.outranks(inter, batch, now=30.0) and not p.outranks(batch, inter, now=30.0)
    aged = waiting("aged", 2, 0.0)  # at t=20 it counts as interactive: equal, neither outranks
    assert not p.outranks(inter, aged, now=30.0) and not p.outranks(aged, inter, now=30.0)


def test_a_lane_never_preempts_itself_however_long_it_waited():
    p = PriorityPolicy(aging_s=10.0)
    running = waiting("running-batch", 2, 0.0)
    running.status = RequestStatus.RUNNING
    starved = waiting("starved-batch", 2, 1.0)  # waited 99 s: level 0, but the same lane
    assert p.effective_priority(starved, 100.0) == 0
    assert not p.outranks(starved, running, now=100.0)
    std = waiting("running-std", 1, 0.0)
    std.status = RequestStatus.RUNNING
    assert p.outranks(starved, std, now=100.0)  # another lane: aging lets it through


def test_victim_is_least_important_then_least_work_then_latest():
    p = PriorityPolicy(aging_s=0)
    running = []
    for rid, prio, arrival, computed in [("vip", 0, 9.0, 1), ("old", 2, 1.0, 50), ("busy", 2, 5.0, 80),
                                         ("fresh", 2, 2.0, 10), ("twin", 2, 3.0, 10)]:  # fmt: skip
        r = make_request(rid, 4, priority=prio, arrival=arrival)
        r.status, r.num_computed_tokens = RequestStatus.RUNNING, computed
        running.append(r)
    order = sorted(running, key=lambda r: p.victim_key(r, 0.0), reverse=True)
    assert [r.request_id for r in order] == ["twin", "fresh", "old", "busy", "vip"]


@pytest.mark.parametrize("seed", range(5))
def test_waiting_queue_yields_the_smallest_key(seed):
    """Fresh and preempted requests of several priorities, removed and re-added, at many times: peek()
    equals the brute-force minimum of key()."""
    rnd = random.Random(seed)
    p = PriorityPolicy(aging_s=3.0)
    q = WaitingQueue(p)
    members = {}
    now = 0.0
    for i in range(300):
        now += rnd.random()
        action = rnd.random()
        if action < 0.5 or not members:
            arrival = now - rnd.random() * 20
            preempted = rnd.random() < 0.3
            r = waiting(f"r{i}", rnd.choice([0, 1, 2]), arrival, waited_before=rnd.random() * 5 if preempted else 0,
                        since=now - rnd.random() * 3 if preempted else arrival, preemptions=int(preempted))
            q.add(r)
            members[r.request_id] = r
        else:
            r = members.pop(rnd.choice(sorted(members)))
            assert q.remove(r) and not q.remove(r)
        best = min(members.values(), key=lambda r: p.key(r, now)) if members else None
        assert q.peek(now) is best
        assert len(q) == len(members)
