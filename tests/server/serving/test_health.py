"""Readiness: 'starting' until the warm-up generation is done, 'unhealthy' when a busy engine stops
stepping; liveness stays 200 through both."""

from __future__ import annotations

import httpx

from ..fake_engine import FakeEngine
from ..helpers import Background, make_settings, run_server, wait_until


def test_not_ready_until_warm_up_is_done():
    engine = FakeEngine()
    engine.step_gate.clear()  # the warm-up generation cannot step yet
    try:
        with run_server(make_settings(), engine, wait_ready=False) as srv:
            r = httpx.get(f"{srv.url}/health", timeout=10)
            assert r.status_code == 503 and r.json()["status"] == "starting"
            assert httpx.get(f"{srv.url}/health/live", timeout=10).status_code == 200
            r = httpx.post(f"{srv.url}/generate", json={"prompt": "hi", "stream": False}, timeout=10)
            assert r.status_code == 503 and r.json()["error"]["type"] == "starting"
            engine.step_gate.set()
            wait_until(lambda: httpx.get(f"{srv.url}/health", timeout=10).status_code == 200, what="ready")
            assert srv.health()["status"] == "ok"
    finally:
        engine.step_gate.set()


def test_stalled_engine_turns_readiness_503():
    engine = FakeEngine()
    try:
        with run_server(make_settings(stall_timeout_s=0.3), engine) as srv, Background() as bg:
            engine.step_gate.clear()
            pending = bg.post("stuck", f"{srv.url}/generate", {"prompt": "hi", "max_tokens": 3, "stream": False})
            r = wait_until(lambda: (h := httpx.get(f"{srv.url}/health", timeout=10)).status_code == 503 and h,
                           timeout=10, what="503 on stall")
            body = r.json()
            assert body["status"] == "unhealthy" and "not completed a step" in body["reason"]
            assert httpx.get(f"{srv.url}/health/live", timeout=10).status_code == 200
            engine.step_gate.set()
            assert pending.result(timeout=30).status_code == 200
            wait_until(lambda: httpx.get(f"{srv.url}/health", timeout=10).status_code == 200, what="recovered")
    finally:
        engine.step_gate.set()
