"""Unit tests of the admission lanes (plain Python, a hand-driven clock)."""

from __future__ import annotations

import pytest

from server.lanes import Lane, LaneBounds, LaneQueue, QueuedRequest

BIG = LaneBounds(max_requests=100, max_tokens=10_000)


def make_queue(aging_s: float = 0.0, **bounds: LaneBounds) -> LaneQueue:
    return LaneQueue({lane: bounds.get(lane.label, BIG) for lane in Lane}, aging_s=aging_s)


def req(rid: str, lane: Lane, tokens: int = 10, deadline: float | None = None) -> QueuedRequest:
    return QueuedRequest(rid, lane, tokens, arrival=0.0, deadline=deadline)


def drain(q: LaneQueue, now: float) -> list[str]:
    out = []
    while (item := q.pop(now)) is not None:
        out.append(item.request_id)
    return out


def test_strict_priority_between_lanes_fifo_inside():
    q = make_queue()
    for i, (rid, lane) in enumerate([("b1", Lane.BATCH), ("s1", Lane.STANDARD), ("i1", Lane.INTERACTIVE),
                                     ("b2", Lane.BATCH), ("i2", Lane.INTERACTIVE)]):
        q.push(req(rid, lane), now=float(i))
    assert q.peek(10.0).request_id == "i1"
    assert drain(q, now=10.0) == ["i1", "i2", "s1", "b1", "b2"]
    assert len(q) == 0 and q.pop(11.0) is None


def test_equal_arrivals_keep_push_order():
    q = make_queue()
    for rid in ("a", "b", "c"):
        q.push(req(rid, Lane.STANDARD), now=5.0)
    assert drain(q, now=5.0) == ["a", "b", "c"]


def test_aging_lifts_one_lane_per_period():
    q = make_queue(aging_s=10.0)
    q.push(req("batch", Lane.BATCH), now=0.0)
    q.push(req("std", Lane.STANDARD), now=5.0)
    q.push(req("inter", Lane.INTERACTIVE), now=12.0)
    # At t=12 the batch request (waited 12s) counts as standard and is older than "std".
    assert q.peek(12.0).request_id == "inter"
    assert q.pop(12.0).request_id == "inter"
    assert q.peek(12.0).request_id == "batch"
    item = q.pop(12.0)
    assert item.effective_lane(12.0, 10.0) == Lane.STANDARD
    # After 2 periods a batch request outranks a fresh interactive one (it arrived earlier).
    q.push(req("old-batch", Lane.BATCH), now=20.0)
    q.push(req("fresh", Lane.INTERACTIVE), now=40.5)
    # "std" (arrived at 5) and "old-batch" (at 20) both count as interactive now, ahead of "fresh".
    assert drain(q, 40.5) == ["std", "old-batch", "fresh"]


def test_no_aging_means_batch_waits_behind_interactive():
    q = make_queue(aging_s=0.0)
    q.push(req("batch", Lane.BATCH), now=0.0)
    q.push(req("inter", Lane.INTERACTIVE), now=1000.0)
    assert drain(q, now=5000.0) == ["inter", "batch"]


def test_request_bound_and_token_bound():
    q = make_queue(interactive=LaneBounds(max_requests=2, max_tokens=100))
    assert q.fits(Lane.INTERACTIVE, 60)
    q.push(req("a", Lane.INTERACTIVE, tokens=60), now=0.0)
    assert not q.fits(Lane.INTERACTIVE, 41)  # 60 + 41 > 100 tokens
    assert q.fits(Lane.INTERACTIVE, 40)
    q.push(req("b", Lane.INTERACTIVE, tokens=40), now=0.0)
    assert not q.fits(Lane.INTERACTIVE, 1)  # 2 requests already
    assert q.fits(Lane.BATCH, 1)  # other lanes are bounded separately
    assert q.depth(Lane.INTERACTIVE) == 2 and q.queued_tokens(Lane.INTERACTIVE) == 100
    q.pop(0.0)
    assert q.fits(Lane.INTERACTIVE, 1) and q.queued_tokens(Lane.INTERACTIVE) == 40


def test_empty_lane_takes_a_request_larger_than_its_token_bound():
    q = make_queue(batch=LaneBounds(max_requests=5, max_tokens=100))
    assert q.fits(Lane.BATCH, 5000)
    q.push(req("huge", Lane.BATCH, tokens=5000), now=0.0)
    assert not q.fits(Lane.BATCH, 1)


def test_remove_and_duplicates():
    q = make_queue()
    q.push(req("a", Lane.STANDARD, tokens=7), now=0.0)
    q.push(req("b", Lane.STANDARD), now=1.0)
    with pytest.raises(ValueError, match="already queued"):
        q.push(req("a", Lane.BATCH), now=2.0)
    assert q.remove("a").request_id == "a"
    assert q.remove("a") is None
    assert "a" not in q and "b" in q
    assert q.queued_tokens(Lane.STANDARD) == 10
    assert drain(q, 3.0) == ["b"]


def test_expire_removes_only_requests_past_their_deadline():
    q = make_queue()
    q.push(req("soon", Lane.INTERACTIVE, deadline=5.0), now=0.0)
    q.push(req("later", Lane.BATCH, deadline=50.0), now=0.0)
    q.push(req("never", Lane.STANDARD), now=0.0)
    assert q.expire(4.9) == []
    assert [i.request_id for i in q.expire(5.0)] == ["soon"]
    assert [i.request_id for i in q.expire(60.0)] == ["later"]
    assert drain(q, 60.0) == ["never"]


def test_retry_after_follows_the_drain_rate():
    q = make_queue()
    assert q.retry_after(Lane.BATCH, now=0.0) == 1  # no history: the default
    for i in range(20):  # 20 requests left in 10 s: 2 per second
        q.push(req(f"r{i}", Lane.STANDARD), now=i * 0.5)
        q.pop(now=i * 0.5 + 0.5)
    for i in range(9):
        q.push(req(f"i{i}", Lane.INTERACTIVE), now=11.0)
    # batch waits for the 9 interactive ones and then its own head: 10 requests at 2/s = 5 s.
    assert q.retry_after(Lane.BATCH, now=10.5) == 5
    assert q.retry_after(Lane.INTERACTIVE, now=10.5) == 1
    # Nothing drained for a long time: the window forgets, back to the default.
    assert q.retry_after(Lane.BATCH, now=1000.0) == 1


def test_lane_parse():
    assert Lane.parse("interactive") is Lane.INTERACTIVE
    assert Lane.parse("BATCH") is Lane.BATCH
    assert Lane.parse(1) is Lane.STANDARD
    for bad in ("urgent", 3, -1, True):
        with pytest.raises(ValueError, match="priority"):
            Lane.parse(bad)


def test_bounds_are_validated():
    with pytest.raises(ValueError, match="max_requests"):
        LaneBounds(max_requests=0, max_tokens=1)
    with pytest.raises(ValueError, match="bounds missing"):
        LaneQueue({Lane.INTERACTIVE: BIG}, aging_s=1.0)
