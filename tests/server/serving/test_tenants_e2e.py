"""Tenants through the real HTTP stack over the fake engine (the real scheduler): the fair share inside a
lane, quotas answered 429 + Retry-After, keys resolved from either header and never shown."""

from __future__ import annotations

import logging
import statistics
import time

import httpx

from ..fake_engine import FakeEngine
from ..helpers import Background, ControlledEngine, make_settings, metric, run_server, wait_until

STEP_S = 0.01  # each engine step takes at least this long: steps, not HTTP noise, set the times
SEATS = 8
KEY_A, KEY_B = "sk-tenant-a-0123456789", "sk-tenant-b-9876543210"
TENANTS = [{"name": "big", "keys": [KEY_A]}, {"name": "small", "keys": [KEY_B]}]


def _post(url: str, key: str | None, tokens: int, prompt: str, header: str = "authorization") -> httpx.Response:
    headers = {} if key is None else {header: f"Bearer {key}" if header == "authorization" else key}
    body = {"prompt": prompt, "max_tokens": tokens, "ignore_eos": True, "stream": False}
    return httpx.post(f"{url}/generate", json=body, headers=headers, timeout=120)


def _server(weights=(), **settings):
    engine = ControlledEngine(FakeEngine(max_num_seqs=SEATS, tenant_weights=weights), step_delay_s=STEP_S)
    roomy = {"interactive_max_queued_requests": 256, "interactive_max_queued_tokens": 1 << 20}  # 96 queued at once
    return engine, run_server(make_settings(max_num_seqs=SEATS, **{**roomy, **settings}), engine)


def test_a_small_tenant_does_not_wait_behind_a_big_tenants_queue():
    _, server = _server(tenants=TENANTS)
    with server as srv, Background(max_workers=64) as bg:
        idle_timing = [_post(srv.url, KEY_B, 4, f"idle {i}").json()["timing"] for i in range(3)]
        idle = statistics.median(t["queue_s"] for t in idle_timing)
        assert [t["queue_steps"] for t in idle_timing] == [1, 1, 1]  # started in the first step after it came
        big = [bg.submit(_post, srv.url, KEY_A, 60, f"big {i}") for i in range(48)]
        wait_until(lambda: srv.health()["running"] == SEATS, what="big tenant holds every seat")
        small = [_post(srv.url, KEY_B, 4, f"small {i}") for i in range(4)]
        waits = [r.json()["timing"]["queue_s"] for r in small]
        assert all(r.status_code == 200 for r in small)
        # it takes a seat of the big tenant's (it is under its seat share) in the next step, instead of
        # waiting for the 40 requests queued before it: like idle, the first step after it came
        assert [r.json()["timing"]["queue_steps"] for r in small] == [1, 1, 1, 1]
        assert max(waits) <= idle + 2 * STEP_S + 0.1, (idle, waits)
        done = [f.result(timeout=120) for f in big]
        assert all(r.status_code == 200 and len(r.json()["token_ids"]) == 60 for r in done)  # nothing lost
        assert statistics.median(r.json()["timing"]["queue_s"] for r in done) > 10 * max(waits)
        assert statistics.median(r.json()["timing"]["queue_steps"] for r in done) > 20
        srv.wait_idle()


def _shares(weights, tenants) -> float:
    """Both tenants keep 48 requests queued; the big tenant's share of the generated tokens counted while
    both are backlogged."""
    _, server = _server(weights=weights, tenants=tenants)
    with server as srv, Background(max_workers=100) as bg:
        futures = [bg.submit(_post, srv.url, key, 20, f"{key[-4:]} {i}") for i in range(48) for key in (KEY_A, KEY_B)]
        wait_until(lambda: srv.health()["running"] == SEATS, what="saturated")
        time.sleep(1.0)
        text = httpx.get(f"{srv.url}/metrics", timeout=10).text
        a = metric(text, "tokenmill_tenant_generation_tokens_total", tenant="big")
        b = metric(text, "tokenmill_tenant_generation_tokens_total", tenant="small")
        assert srv.health()["engine_waiting"] > 0  # still backlogged when measured
        assert all(f.result(timeout=120).status_code == 200 for f in futures)
    assert a + b > 200, (a, b)
    return a / (a + b)


def test_two_backlogged_tenants_split_the_tokens_evenly():
    share = _shares((), TENANTS)
    assert 0.45 <= share <= 0.55, share


def test_weights_two_to_one():
    tenants = [{**TENANTS[0], "weight": 2.0}, TENANTS[1]]
    share = _shares((("big", 2.0),), tenants)
    assert 0.60 <= share <= 0.73, share


def test_quotas_answer_429_with_retry_after_and_admitted_requests_finish(caplog):
    tenants = [{"name": "limited", "keys": [KEY_A], "requests_per_minute": 2},
               {"name": "tokens", "keys": [KEY_B], "tokens_per_minute": 300}]  # fmt: skip
    caplog.set_level(logging.INFO)
    engine, server = _server(tenants=tenants)
    with server as srv:
        assert [_post(srv.url, KEY_A, 4, "one").status_code, _post(srv.url, KEY_A, 4, "two").status_code] == [200, 200]
        refused = _post(srv.url, KEY_A, 4, "three", header="x-api-key")  # Anthropic's header reaches it too
        assert refused.status_code == 429
        assert refused.headers["retry-after"] == "30"
        error = refused.json()["error"]
        assert "'limited'" in error["message"] and "requests_per_minute" in error["message"]
        # tokens: a 300-token bucket (5 a second): one long answer drains it below zero, and it still finishes
        engine.step_delay_s = 0.0
        long = _post(srv.url, KEY_B, 400, "x" * 50)
        assert long.status_code == 200 and len(long.json()["token_ids"]) == 400
        again = _post(srv.url, KEY_B, 4, "x" * 50)
        assert again.status_code == 429 and "tokens_per_minute" in again.json()["error"]["message"]
        # 450 charged from 300: -150 after the settlement (plus what refilled meanwhile); 200 more needed at 5/s
        assert 30 <= int(again.headers["retry-after"]) <= 40, again.headers["retry-after"]
        assert _post(srv.url, None, 4, "anonymous").status_code == 200  # the default tenant has no quota
        text = httpx.get(f"{srv.url}/metrics", timeout=10).text
        assert metric(text, "tokenmill_tenant_rejections_total", tenant="limited", reason="requests_per_minute") == 1
        assert metric(text, "tokenmill_tenant_requests_total", tenant="default") == 1
        assert metric(text, "tokenmill_tenant_requests_total", tenant="tokens") == 1
        assert metric(text, "tokenmill_tenant_rejections_total", tenant="tokens", reason="tokens_per_minute") == 1
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert '"tenant": "limited"' in logged
    for key in (KEY_A, KEY_B):
        assert key not in logged and key not in text


def test_max_concurrent():
    engine, server = _server(tenants=[{"name": "one", "keys": [KEY_A], "max_concurrent": 1}])
    with server as srv, Background() as bg:
        first = bg.submit(_post, srv.url, KEY_A, 50, "first")
        wait_until(lambda: srv.health()["running"] == 1, what="first running")
        second = _post(srv.url, KEY_A, 4, "second")
        assert second.status_code == 429 and "max_concurrent" in second.json()["error"]["message"]
        assert first.result(timeout=60).status_code == 200
        assert _post(srv.url, KEY_A, 4, "third").status_code == 200


def test_tenant_keys_beside_an_api_key():
    _, server = _server(api_key="sk-main", tenants=TENANTS)
    with server as srv:
        assert _post(srv.url, KEY_A, 2, "bearer").status_code == 200
        assert _post(srv.url, KEY_B, 2, "x-api-key", header="x-api-key").status_code == 200
        assert _post(srv.url, "sk-main", 2, "main key: default tenant").status_code == 200
        assert _post(srv.url, "sk-other", 2, "no").status_code == 401
        assert _post(srv.url, None, 2, "no").status_code == 401
        text = httpx.get(f"{srv.url}/metrics", timeout=10).text
        assert metric(text, "tokenmill_tenant_requests_total", tenant="big") == 1
        assert metric(text, "tokenmill_tenant_requests_total", tenant="small") == 1
        assert metric(text, "tokenmill_tenant_requests_total", tenant="default") == 1


def test_a_user_within_a_key_is_its_own_tenant():
    """One application key, end users named by `user` (OpenAI) or metadata.user_id (Anthropic): the
    configured users are tenants of their own, every other user is the key's tenant."""
    tenants = [{"name": "app", "keys": [KEY_A]}, {"name": "alice", "keys": [KEY_A], "users": ["alice"]}]
    _, server = _server(tenants=tenants)
    headers = {"authorization": f"Bearer {KEY_A}"}
    with server as srv:
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        assert httpx.post(f"{srv.url}/v1/chat/completions", json={**chat, "user": "alice"}, headers=headers,
                          timeout=60).status_code == 200  # fmt: skip
        assert httpx.post(f"{srv.url}/v1/chat/completions", json={**chat, "user": "carol"}, headers=headers,
                          timeout=60).status_code == 200  # fmt: skip
        model = httpx.get(f"{srv.url}/v1/models", timeout=10).json()["data"][0]["id"]
        messages = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                    "metadata": {"user_id": "alice"}}  # fmt: skip
        assert httpx.post(f"{srv.url}/v1/messages", json=messages, headers=headers, timeout=60).status_code == 200
        text = httpx.get(f"{srv.url}/metrics", timeout=10).text
        assert metric(text, "tokenmill_tenant_requests_total", tenant="alice") == 2
        assert metric(text, "tokenmill_tenant_requests_total", tenant="app") == 1
