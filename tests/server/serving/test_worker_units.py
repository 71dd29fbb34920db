"""The worker's side of admission units (server/serving/worker.py submit_unit): the choices of one request
admitted together, some held until release(); a held choice aborted before its release ends at once and
frees its room in the lane. Over the fake engine, no HTTP."""

from __future__ import annotations

import asyncio
import gc
import weakref

import pytest

from engine.api import SamplingParams
from server.config.lanes import Lane, LaneBounds
from server.serving.admission import Admission
from server.serving.ticket import Collector, Ticket
from server.serving.worker import Worker, WorkerUnavailable

from ..fake_engine import FakeEngine
from ..helpers import ControlledEngine, wait_until


def test_held_choices_wait_for_release_and_an_abort_frees_them():
    loop = asyncio.new_event_loop()
    engine = FakeEngine()
    admission = Admission({lane: LaneBounds(max_requests=1, max_tokens=1000) for lane in Lane})
    worker = Worker(engine, admission)
    worker.start()
    try:
        tickets = [Ticket(f"c{i}", [5, 6, 7], SamplingParams(max_tokens=2), Lane.INTERACTIVE, Collector(loop))
                   for i in range(3)]  # fmt: skip
        assert worker.submit_unit(tickets, held={"c1", "c2"}) is None
        other = Ticket("other", [5], SamplingParams(max_tokens=1), Lane.INTERACTIVE, Collector(loop))
        assert worker.submit(other) is not None  # the lane holds one request: the unit
        wait_until(lambda: tickets[0].finished_at is not None, 5, what="the first choice ran")
        assert tickets[0].finish_reason == "length" and tickets[1].started_at is None
        assert worker.lane_load()[Lane.INTERACTIVE] == (1, 2 * 5)  # the held two still count
        worker.abort("c1")  # the client left before c1 was handed to the engine
        wait_until(lambda: tickets[1].finished_at is not None, 5, what="the held choice aborted")
        assert tickets[1].finish_reason == "abort" and tickets[1].started_at is None
        worker.release(tickets[2])
        wait_until(lambda: tickets[2].finished_at is not None, 5, what="the released choice ran")
        assert tickets[2].finish_reason == "length" and tickets[2].arrival == tickets[0].arrival
        assert worker.lane_load()[Lane.INTERACTIVE] == (0, 0) and worker.in_flight() == 0
        assert worker.submit(other) is None
    finally:
        worker.stop(5)
        loop.close()


def test_a_stopped_worker_answers_late_calls_and_lets_go_of_its_engine():
    """A call and a request queued behind the stop are answered (never left waiting), nothing is admitted
    after it, and the engine is freed by reference count while the Worker object itself is still held."""
    loop = asyncio.new_event_loop()
    engine = ControlledEngine(FakeEngine())
    admission = Admission({lane: LaneBounds(max_requests=4, max_tokens=1000) for lane in Lane})
    worker = Worker(engine, admission)
    worker.start()
    try:
        first = Ticket("first", [5, 6], SamplingParams(max_tokens=50), Lane.STANDARD, Collector(loop))
        engine.close_gate_after(1)  # the worker stops before its second step
        assert worker.submit(first) is None
        wait_until(engine.waiting_at_gate.is_set, 5, what="the worker held at the gate")
        worker.stop(0)  # _STOP queued; the thread is still alive inside a step
        late_call = worker.call(lambda e: "ran")
        late = Ticket("late", [5], SamplingParams(max_tokens=2), Lane.STANDARD, Collector(loop))
        assert worker.submit(late) is None  # admitted: the thread has not seen the stop yet
        engine.gate.set()
        assert isinstance(late_call.exception(timeout=5), WorkerUnavailable)
        wait_until(lambda: not worker.thread_running, 5, what="the thread ended")
        for ticket in (first, late):
            assert ticket.finish_reason == "abort" and ticket.error is not None and ticket.error.status == 503
        with pytest.raises(WorkerUnavailable):
            worker.submit(Ticket("after", [5], SamplingParams(max_tokens=2), Lane.STANDARD, Collector(loop)))
        with pytest.raises(WorkerUnavailable):
            worker.call(lambda e: "ran")
        held = weakref.ref(engine)
        gc.disable()
        try:
            del engine
            assert held() is None, "the stopped worker still holds its engine"
        finally:
            gc.enable()
        assert worker.in_flight() == 0 and worker.lane_load()[Lane.STANDARD] == (0, 0)
    finally:
        worker.stop(5)
        loop.close()
