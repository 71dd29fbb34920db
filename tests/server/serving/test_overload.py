"""Admission under load: 429 with Retry-After past a lane's bound, strict priority between lanes,
aging. The real engine is wrapped so a test can hold the worker before its next step (the gate),
which makes "who is queued when" deterministic."""

from __future__ import annotations

import json
import logging
import time

import httpx
import pytest

from ..helpers import Background, ControlledEngine, make_settings, metric, park_filler, run_server, wait_until

PROMPT = "class Foo:"


def finish_order(caplog) -> list[str]:
    """Request ids in the order the worker finished them (its log lines), warm-up and filler left out."""
    ids = [json.loads(rec.getMessage())["id"] for rec in caplog.records if rec.name == "tokenmill.requests"]
    return [i for i in ids if i != "filler"]


def body(priority: str | None = None, max_tokens: int = 4, **extra) -> dict:
    b = {"prompt": PROMPT, "max_tokens": max_tokens, "ignore_eos": True, "stream": False, **extra}
    if priority:
        b["priority"] = priority
    return b


@pytest.fixture
def engine(real_engine):
    eng = ControlledEngine(real_engine)
    yield eng
    eng.gate.set()


def hold_worker(srv, engine: ControlledEngine, bg: Background) -> object:
    """Park one running request in the engine and hold the worker, so everything sent next stays queued."""
    return park_filler(srv, engine, bg, body("batch", request_id="filler"))


def lane_depth(srv, lane: str) -> int:
    return srv.health()["waiting"][lane]


def queue_one(srv, bg: Background, lane: str, request_id: str):
    """Send one request and return once it is queued in `lane` (the worker is held)."""
    before = lane_depth(srv, lane)
    future = bg.post(request_id, f"{srv.url}/generate", body(lane, request_id=request_id))
    wait_until(lambda: lane_depth(srv, lane) == before + 1, what=f"{request_id} queued")
    return future


def test_flood_over_the_lane_bound_gets_429_while_admitted_requests_complete(real_engine, engine):
    settings = make_settings(interactive_max_queued_requests=3)
    with run_server(settings, engine) as srv, Background() as bg:
        filler = hold_worker(srv, engine, bg)
        flood = [bg.post(f"r{i}", f"{srv.url}/generate", body("interactive")) for i in range(9)]
        # Three fit in the lane; the other six are refused at once, while the worker is still held.
        wait_until(lambda: sum(f.done() for f in flood) == 6, what="six immediate 429s")
        rejected = [f.result() for f in flood if f.done()]
        assert engine.waiting_at_gate.is_set()
        for r in rejected:
            assert r.status_code == 429
            assert int(r.headers["Retry-After"]) >= 1
            err = r.json()["error"]
            assert err["type"] == "overloaded" and err["lane"] == "interactive" and err["message"]
        assert lane_depth(srv, "interactive") == 3
        # A streaming request is refused the same way, before any stream byte.
        r = httpx.post(f"{srv.url}/generate", json=body("interactive", stream=True), timeout=10)
        assert r.status_code == 429 and r.headers["content-type"].startswith("application/json")
        # Other lanes have their own bounds.
        assert lane_depth(srv, "batch") == 0
        engine.gate.set()
        results = [f.result(timeout=60) for f in flood]
        assert sorted(r.status_code for r in results) == [200] * 3 + [429] * 6
        assert all(r.json()["usage"]["completion_tokens"] == 4 for r in results if r.status_code == 200)
        assert filler.result(timeout=60).status_code == 200
        metrics = httpx.get(f"{srv.url}/metrics", timeout=10).text
        assert metric(metrics, "tokenmill_requests_total", lane="interactive", reason="queue_requests",
                      status="rejected") == 7
        assert metric(metrics, "tokenmill_request_rejections_total", lane="interactive", reason="queue_requests") == 7
        srv.wait_idle()


def test_interactive_finishes_before_batch_submitted_earlier(engine_with, caplog):
    caplog.set_level(logging.INFO, logger="tokenmill.requests")
    engine = ControlledEngine(engine_with(max_num_seqs=1, aging_s=0))
    with run_server(make_settings(), engine) as srv, Background() as bg:
        filler = hold_worker(srv, engine, bg)
        batch = [queue_one(srv, bg, "batch", f"batch{i}") for i in range(3)]  # one by one: a known order
        inter = [queue_one(srv, bg, "interactive", f"inter{i}") for i in range(2)]
        engine.gate.set()
        for f in [filler, *batch, *inter]:
            assert f.result(timeout=60).status_code == 200
        assert finish_order(caplog) == ["inter0", "inter1", "batch0", "batch1", "batch2"]


def test_aging_lets_a_waiting_batch_request_through(engine_with, caplog):
    caplog.set_level(logging.INFO, logger="tokenmill.requests")
    aging_s = 0.25
    engine = ControlledEngine(engine_with(max_num_seqs=1, aging_s=aging_s))
    with run_server(make_settings(), engine) as srv, Background() as bg:
        filler = hold_worker(srv, engine, bg)
        old_batch = queue_one(srv, bg, "batch", "batch")
        # Let it age two lanes (batch -> interactive); the wait sets up the scenario, it asserts nothing.
        time.sleep(2 * aging_s + 0.05)
        inter = [queue_one(srv, bg, "interactive", f"inter{i}") for i in range(2)]
        engine.gate.set()
        for f in [filler, old_batch, *inter]:
            assert f.result(timeout=60).status_code == 200
        # The aged batch request runs first and, running at the interactive level, is not preempted.
        assert finish_order(caplog) == ["batch", "inter0", "inter1"]
