"""Faults: a model-runner call that raises fails only the requests of that step (the engine keeps
serving); an engine.step() that raises anyway is survived by the worker; a dead worker turns /health
and /health/live to 503."""

from __future__ import annotations

import asyncio
import json
import threading

import httpx
import pytest
from httpx_sse import aconnect_sse

from ..fake_engine import FakeEngine
from ..helpers import make_settings, run_server, wait_until

PROMPT = "for i in range(10):"


class Fault:
    """Wraps runner.execute: raises RuntimeError on the next call once armed, then behaves."""

    def __init__(self, original) -> None:
        self.original = original
        self.armed = threading.Event()
        self.fired = 0

    def __call__(self, *args, **kwargs):
        if self.armed.is_set():
            self.armed.clear()
            self.fired += 1
            raise RuntimeError("injected fault")
        return self.original(*args, **kwargs)


@pytest.fixture
def fault(real_engine, monkeypatch):
    f = Fault(real_engine.runner.execute)
    monkeypatch.setattr(real_engine.runner, "execute", f)
    return f


def test_failed_step_fails_its_requests_and_the_next_ones_succeed(real_engine, fault):
    with run_server(make_settings(), real_engine) as srv:

        async def stream_until_error(client: httpx.AsyncClient, i: int, first: list[asyncio.Event]) -> list[str]:
            body = {"prompt": f"{PROMPT} {i}", "max_tokens": 800, "ignore_eos": True}
            kinds = []
            async with aconnect_sse(client, "POST", f"{srv.url}/generate", json=body) as src:
                async for event in src.aiter_sse():
                    kinds.append(event.event)
                    if len(kinds) == 1:
                        first[i].set()
                    if event.event == "error":
                        assert json.loads(event.data)["error"]["type"] == "engine_error"
                        assert "injected fault" in json.loads(event.data)["error"]["message"]
            return kinds

        async def main() -> list[list[str]]:
            first = [asyncio.Event(), asyncio.Event()]
            async with httpx.AsyncClient(timeout=60) as client:
                tasks = [asyncio.create_task(stream_until_error(client, i, first)) for i in range(2)]
                await asyncio.wait_for(asyncio.gather(*(e.wait() for e in first)), 30)
                fault.armed.set()  # both requests are running: the next step holds both
                return await asyncio.wait_for(asyncio.gather(*tasks), 60)

        for kinds in asyncio.run(main()):
            assert kinds[-1] == "error" and "done" not in kinds and set(kinds[:-1]) == {"token"}
        assert fault.fired == 1
        srv.wait_idle()  # their KV blocks were freed
        # The engine serves the next requests.
        for _ in range(2):
            r = httpx.post(f"{srv.url}/generate", json={"prompt": PROMPT, "max_tokens": 4, "stream": False}, timeout=30)
            assert r.status_code == 200 and len(r.json()["token_ids"]) >= 1
        # Non-streaming: the failure is a 500 with an error body.
        fault.armed.set()
        r = httpx.post(f"{srv.url}/generate", json={"prompt": PROMPT, "max_tokens": 4, "stream": False}, timeout=30)
        assert r.status_code == 500 and r.json()["error"]["type"] == "engine_error"
        r = httpx.post(f"{srv.url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 4}, timeout=30)
        assert r.status_code == 200
        assert srv.health()["status"] == "ok"


def test_worker_survives_a_step_that_raises():
    engine = FakeEngine()
    calls = {"n": 0}
    real_step = engine.step

    def step_once_broken():
        calls["n"] += 1
        if calls["n"] == 2:  # the request's second step
            raise RuntimeError("step broke its contract")
        return real_step()

    engine.step = step_once_broken
    with run_server(make_settings(warmup=False), engine) as srv:
        r = httpx.post(f"{srv.url}/generate", json={"prompt": "hi", "max_tokens": 5, "stream": False}, timeout=30)
        assert r.status_code == 500 and r.json()["error"]["type"] == "engine_error"
        assert "step broke its contract" in r.json()["error"]["message"]
        r = httpx.post(f"{srv.url}/generate", json={"prompt": "hi", "max_tokens": 5, "stream": False}, timeout=30)
        assert r.status_code == 200 and r.json()["text"]
        assert srv.health()["status"] == "ok"
        srv.wait_idle()


class WorkerKiller(BaseException):
    """Not an Exception: nothing in the engine or the worker's step handling catches it."""


def test_dead_worker_fails_health_liveness_and_requests():
    engine = FakeEngine(step_delay_s=0.01)
    with run_server(make_settings(warmup=False), engine) as srv:
        assert httpx.get(f"{srv.url}/health/live", timeout=10).status_code == 200

        def die(batch):
            raise WorkerKiller("boom")

        engine.runner.execute = die
        r = httpx.post(f"{srv.url}/generate", json={"prompt": "hi", "max_tokens": 50, "stream": False}, timeout=30)
        assert r.status_code == 503 and r.json()["error"]["type"] == "worker_died"
        wait_until(lambda: not srv.runtime.worker.thread_running, what="worker thread ended")
        health = httpx.get(f"{srv.url}/health", timeout=10)
        assert health.status_code == 503 and health.json()["status"] == "unhealthy"
        live = httpx.get(f"{srv.url}/health/live", timeout=10)
        assert live.status_code == 503
        r = httpx.post(f"{srv.url}/generate", json={"prompt": "hi", "max_tokens": 5}, timeout=10)
        assert r.status_code == 503
