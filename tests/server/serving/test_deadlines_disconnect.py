"""Deadlines (queue, first token, total) and client disconnects: each ends the request in the engine
and frees its KV blocks; nothing is left running."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from httpx_sse import aconnect_sse, connect_sse

from ..helpers import Background, ControlledEngine, make_settings, metric, park_filler, run_server, wait_until

PROMPT = "while True:"
LONG = {"prompt": PROMPT, "max_tokens": 900, "ignore_eos": True}


def sse_events(url: str, body: dict, timeout: float = 60) -> tuple[int, list[tuple[str, dict]]]:
    with httpx.Client(timeout=timeout) as client, connect_sse(client, "POST", f"{url}/generate", json=body) as src:
        if src.response.status_code != 200:
            src.response.read()
            return src.response.status_code, [("json", src.response.json())]
        return 200, [(e.event, json.loads(e.data)) for e in src.iter_sse()]


def counter(url: str, lane: str, status: str, reason: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return metric(text, "tokenmill_requests_total", lane=lane, status=status, reason=reason)


@pytest.fixture
def slow(real_engine):
    eng = ControlledEngine(real_engine, step_delay_s=0.02)
    yield eng
    eng.gate.set()


def test_total_timeout_aborts_and_frees_kv(slow):
    with run_server(make_settings(), slow) as srv:
        status, events = sse_events(srv.url, {**LONG, "timeout_s": 0.4})
        assert status == 200
        kind, done = events[-1]
        assert kind == "done" and done["finish_reason"] == "timeout"
        tokens = [e for k, e in events if k == "token"]
        assert 0 < len(tokens) < 900 and done["usage"]["completion_tokens"] == len(tokens)
        assert 0.4 <= done["timing"]["e2e_s"] < 5
        r = httpx.post(f"{srv.url}/generate", json={**LONG, "stream": False, "timeout_s": 0.3}, timeout=30)
        assert r.status_code == 200 and r.json()["finish_reason"] == "timeout"
        h = srv.wait_idle()
        assert h["kv_blocks_used"] == 0 and h["running"] == 0
        assert counter(srv.url, "standard", "timeout", "total") == 2


def test_first_token_timeout(engine_with):
    # 16-token prefill chunks, 0.1 s a step: a 100-token prompt starts in the first step and would
    # give its first token after 7 steps, long past its 0.25 s first-token deadline.
    slow_prefill = ControlledEngine(engine_with(max_num_batched_tokens=16), step_delay_s=0.1)
    with run_server(make_settings(warmup=False), slow_prefill) as srv:
        prompt = {"prompt_token_ids": [5 + i for i in range(100)], "ignore_eos": True}
        status, events = sse_events(srv.url, {**prompt, "max_tokens": 5, "first_token_timeout_s": 0.25})
        assert status == 200
        assert [k for k, _ in events] == ["done"]
        assert events[-1][1]["finish_reason"] == "timeout" and events[-1][1]["usage"]["completion_tokens"] == 0
        assert counter(srv.url, "interactive", "timeout", "first_token") == 1
        # Generous first-token deadline: the same request completes.
        status, events = sse_events(srv.url, {**prompt, "max_tokens": 2, "first_token_timeout_s": 30})
        assert events[-1][1]["finish_reason"] == "length"
        srv.wait_idle()


def test_a_deadline_that_passes_before_the_request_starts_is_a_queue_timeout(real_engine):
    slow = ControlledEngine(real_engine, step_delay_s=0.5)  # the first schedule comes after 0.5 s
    with run_server(make_settings(warmup=False), slow) as srv:
        status, events = sse_events(srv.url, {**LONG, "max_tokens": 5, "first_token_timeout_s": 0.2})
        assert status == 503 and events[0][1]["error"]["type"] == "queue_timeout"
        assert counter(srv.url, "interactive", "timeout", "queue") == 1
        srv.wait_idle()


def test_queue_timeout_is_503_before_streaming_and_an_error_event_after(engine_with):
    slow = ControlledEngine(engine_with(max_num_seqs=1), step_delay_s=0.05)
    settings = make_settings(interactive_queue_timeout_s=0.4, sse_ping_s=0.15, warmup=False)
    with run_server(settings, slow) as srv, Background() as bg:
        # Holds the only engine seat for 3 s (its own deadline ends it); of the same lane, so it is
        # not preempted.
        blocker = bg.post("blocker", f"{srv.url}/generate", {**LONG, "stream": False, "priority": "interactive",
                                                             "timeout_s": 3.0})
        wait_until(lambda: srv.health()["running"] == 1, what="blocker running")
        short = {"prompt": PROMPT, "max_tokens": 2, "priority": "interactive"}
        r = httpx.post(f"{srv.url}/generate", json={**short, "stream": False}, timeout=30)
        assert r.status_code == 503 and r.json()["error"]["type"] == "queue_timeout"
        assert "Retry-After" in r.headers
        # Streaming: headers are held one ping interval (0.15 s), then the stream starts; the queue
        # timeout (0.4 s) then arrives as an error event.
        status, events = sse_events(srv.url, short)
        assert status == 200
        assert events == [("error", {"error": {"type": "queue_timeout", "message": events[0][1]["error"]["message"]}})]
        assert counter(srv.url, "interactive", "timeout", "queue") == 2
        assert blocker.result(timeout=60).json()["finish_reason"] == "timeout"
        srv.wait_idle()


def test_hundred_clients_disconnecting_mid_stream_leave_nothing_behind(real_engine):
    settings = make_settings(interactive_max_queued_requests=128)
    with run_server(settings, real_engine) as srv:

        async def client_that_leaves(client: httpx.AsyncClient, i: int) -> int:
            body = {**LONG, "prompt": f"{PROMPT} {i}", "max_tokens": 500}
            async with aconnect_sse(client, "POST", f"{srv.url}/generate", json=body) as src:
                assert src.response.status_code == 200
                seen = 0
                async for event in src.aiter_sse():
                    seen += event.event == "token"
                    if seen == 2:
                        break  # leaving the block closes the connection mid-stream
            return seen

        async def main() -> list[int]:
            limits = httpx.Limits(max_connections=120)
            async with httpx.AsyncClient(timeout=60, limits=limits) as client:
                return await asyncio.wait_for(asyncio.gather(*(client_that_leaves(client, i) for i in range(100))), 60)

        assert asyncio.run(main()) == [2] * 100
        h = srv.wait_idle(timeout=30)
        assert h["kv_blocks_used"] == 0 and h["running"] == 0 and h["engine_waiting"] == 0
        assert counter(srv.url, "interactive", "cancelled", "client") + counter(srv.url, "standard", "cancelled", "client") == 100
        # The server still serves.
        r = httpx.post(f"{srv.url}/generate", json={"prompt": PROMPT, "max_tokens": 3, "stream": False}, timeout=30)
        assert r.status_code == 200


def test_non_streaming_client_that_leaves_is_aborted(slow):
    with run_server(make_settings(), slow) as srv:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{srv.url}/generate", json={**LONG, "stream": False}, timeout=0.5)
        h = srv.wait_idle(timeout=10)  # 900 tokens at >= 20 ms per step would take > 18 s
        assert h["kv_blocks_used"] == 0
        assert counter(srv.url, "standard", "cancelled", "client") == 1


def test_long_queue_wait_streams_keepalive_pings_then_tokens(real_engine):
    held = ControlledEngine(real_engine)
    settings = make_settings(sse_ping_s=0.2, warmup=False)
    try:
        with run_server(settings, held) as srv, Background() as bg:
            filler = park_filler(srv, held, bg, {"prompt": PROMPT, "max_tokens": 2, "stream": False})
            lines = []
            body = {"prompt": PROMPT, "max_tokens": 3, "ignore_eos": True}
            with httpx.stream("POST", f"{srv.url}/generate", json=body, timeout=30) as r:
                assert r.status_code == 200  # headers came after one ping interval, while still queued
                for line in r.iter_lines():
                    lines.append(line)
                    if not held.gate.is_set() and sum(x.startswith(":") for x in lines) == 2:
                        assert srv.health()["waiting"]["interactive"] == 1
                        held.gate.set()
            assert [x for x in lines if x.startswith("event:")][-1] == "event: done"
            assert sum(x == "event: token" for x in lines) == 3
            assert filler.result(timeout=30).status_code == 200
    finally:
        held.gate.set()


def test_streaming_client_leaving_while_queued_is_aborted(real_engine):
    held = ControlledEngine(real_engine)
    settings = make_settings(sse_ping_s=30, warmup=False)  # headers held up to 30 s
    try:
        with run_server(settings, held) as srv, Background() as bg:
            filler = park_filler(srv, held, bg, {"prompt": PROMPT, "max_tokens": 2, "stream": False})
            with pytest.raises(httpx.ReadTimeout):
                httpx.post(f"{srv.url}/generate", json={"prompt": PROMPT, "max_tokens": 5}, timeout=0.5)
            # Noticed within a poll interval, long before the 30 s hold ends.
            wait_until(lambda: srv.runtime.open_responses == 1, timeout=3, what="queued stream closed")
            held.gate.set()
            assert filler.result(timeout=30).status_code == 200
            srv.wait_idle()
            assert counter(srv.url, "interactive", "cancelled", "client") == 1
    finally:
        held.gate.set()
