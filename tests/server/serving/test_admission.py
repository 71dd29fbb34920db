"""Unit tests of admission: per-lane bounds on requests not yet started, and Retry-After (plain Python,
a hand-driven clock). Ordering, aging and deadlines are the engine scheduler's (tests/engine/test_ordering.py)."""

from __future__ import annotations

import pytest

from server.config.lanes import Lane, LaneBounds
from server.serving.admission import Admission

BIG = LaneBounds(max_requests=100, max_tokens=10_000)


def make_admission(**bounds: LaneBounds) -> Admission:
    return Admission({lane: bounds.get(lane.label, BIG) for lane in Lane})


def test_request_bound_and_token_bound():
    a = make_admission(interactive=LaneBounds(max_requests=2, max_tokens=100))
    assert a.fits(Lane.INTERACTIVE, 60)
    a.admit("a", Lane.INTERACTIVE, 60)
    assert not a.fits(Lane.INTERACTIVE, 41)  # 60 + 41 > 100 tokens
    assert a.full_reason(Lane.INTERACTIVE) == "queue_tokens"
    assert a.fits(Lane.INTERACTIVE, 40)
    a.admit("b", Lane.INTERACTIVE, 40)
    assert not a.fits(Lane.INTERACTIVE, 1)  # 2 requests already
    assert a.full_reason(Lane.INTERACTIVE) == "queue_requests"
    assert a.fits(Lane.BATCH, 1)  # other lanes are bounded separately
    assert a.depth(Lane.INTERACTIVE) == 2 and a.queued_tokens(Lane.INTERACTIVE) == 100
    a.started("a", now=0.0)
    assert a.fits(Lane.INTERACTIVE, 1) and a.queued_tokens(Lane.INTERACTIVE) == 40


def test_a_started_request_no_longer_counts_and_ending_it_changes_nothing():
    a = make_admission()
    a.admit("a", Lane.STANDARD, 7)
    a.admit("b", Lane.STANDARD, 3)
    a.started("a", now=1.0)
    assert "a" not in a and a.depth(Lane.STANDARD) == 1 and a.queued_tokens(Lane.STANDARD) == 3
    a.ended("a")  # finished after it started: already released
    assert a.depth(Lane.STANDARD) == 1
    a.ended("b")  # ended while queued (timeout, abort): releases its room
    assert len(a) == 0 and a.queued_tokens(Lane.STANDARD) == 0


def test_empty_lane_takes_a_request_larger_than_its_token_bound():
    a = make_admission(batch=LaneBounds(max_requests=5, max_tokens=100))
    assert a.fits(Lane.BATCH, 5000)
    a.admit("huge", Lane.BATCH, 5000)
    assert not a.fits(Lane.BATCH, 1)


def test_duplicates_are_refused():
    a = make_admission()
    a.admit("a", Lane.STANDARD, 7)
    with pytest.raises(ValueError, match="already queued"):
        a.admit("a", Lane.BATCH, 1)


def test_retry_after_follows_the_start_rate():
    a = make_admission()
    assert a.retry_after(Lane.BATCH, now=0.0) == 1  # no history: the default
    for i in range(20):  # 20 requests started in 10 s: 2 per second
        a.admit(f"r{i}", Lane.STANDARD, 1)
        a.started(f"r{i}", now=i * 0.5 + 0.5)
    for i in range(9):
        a.admit(f"i{i}", Lane.INTERACTIVE, 1)
    # batch waits for the 9 interactive ones and then its own head: 10 requests at 2/s = 5 s.
    assert a.retry_after(Lane.BATCH, now=10.5) == 5
    assert a.retry_after(Lane.INTERACTIVE, now=10.5) == 1
    # Nothing started for a long time: the window forgets, back to the default.
    assert a.retry_after(Lane.BATCH, now=1000.0) == 1


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
        Admission({Lane.INTERACTIVE: BIG})


def test_a_unit_counts_as_one_request_with_all_its_tokens():
    a = make_admission(interactive=LaneBounds(max_requests=2, max_tokens=100))
    a.admit("solo", Lane.INTERACTIVE, 10)
    assert a.fits(Lane.INTERACTIVE, 80)
    a.admit_unit(Lane.INTERACTIVE, {"c0": 30, "c1": 30, "c2": 20})  # three choices: one request, 80 tokens
    assert a.depth(Lane.INTERACTIVE) == 2 and a.queued_tokens(Lane.INTERACTIVE) == 90 and len(a) == 4
    assert not a.fits(Lane.INTERACTIVE, 1) and a.full_reason(Lane.INTERACTIVE) == "queue_requests"
    a.started("c0", now=1.0)  # a member's tokens go when it starts; the unit's place when its last one does
    assert a.depth(Lane.INTERACTIVE) == 2 and a.queued_tokens(Lane.INTERACTIVE) == 60
    a.ended("c1")
    a.started("c2", now=2.0)
    assert a.depth(Lane.INTERACTIVE) == 1 and a.queued_tokens(Lane.INTERACTIVE) == 10 and len(a) == 1
    with pytest.raises(ValueError, match="already queued"):
        a.admit_unit(Lane.INTERACTIVE, {"x": 1, "solo": 1})
    assert a.depth(Lane.INTERACTIVE) == 1  # a refused unit changed nothing


def test_several_requests_over_the_token_bound_never_fit_one_may():
    a = make_admission(batch=LaneBounds(max_requests=5, max_tokens=100))
    assert a.never_fits(Lane.BATCH, 101, requests=2)
    assert not a.never_fits(Lane.BATCH, 100, requests=40)
    assert not a.never_fits(Lane.BATCH, 5000, requests=1)  # an empty lane takes one request, however large
