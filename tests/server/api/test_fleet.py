"""The calls vllm-router makes to a worker besides the OpenAI routes (server/api/fleet.py), against a real
server (tiny model): /get_load and /load follow the requests in flight, /get_server_info and
/get_model_info describe the served model, /health_generate is readiness, and the render routes return
the token ids the generation routes would run."""

from __future__ import annotations

import threading

import httpx

from ..helpers import wait_until

MODEL = "tiny-llama"


def test_load_reports_requests_in_flight(srv):
    assert httpx.get(f"{srv.url}/get_load").json()["load"] == 0
    assert httpx.get(f"{srv.url}/load").json() == {"server_load": 0}
    # the longest answer the context holds: long enough to be seen in flight, cut short at the end
    body = {"model": MODEL, "prompt": "hello", "max_tokens": srv.runtime.max_model_len - 8, "ignore_eos": True}
    done = threading.Event()
    status: list[int] = []

    def long_request() -> None:
        try:
            r = httpx.post(f"{srv.url}/v1/completions", json=body, timeout=120)
            status.append(r.status_code)
        finally:
            done.set()

    thread = threading.Thread(target=long_request, daemon=True)
    thread.start()
    try:
        wait_until(lambda: httpx.get(f"{srv.url}/get_load").json()["load"] == 1 or done.is_set(), 30,
                   what="the request counted in /get_load")  # fmt: skip
        assert not done.is_set(), f"the request finished ({status}) before /get_load saw it"
        load = httpx.get(f"{srv.url}/get_load").json()
        assert load["load"] == 1 and load["num_reqs"] + load["num_waiting_reqs"] <= 1
        assert httpx.get(f"{srv.url}/load").json() == {"server_load": 1}
    finally:
        thread.join(120)
    assert status == [200]
    assert httpx.get(f"{srv.url}/get_load").json()["load"] == 0


def test_server_and_model_info(srv):
    info = httpx.get(f"{srv.url}/get_server_info").json()
    assert info["served_model_name"] == MODEL and info["context_length"] == srv.runtime.max_model_len
    assert info["dp_size"] == 1 and info["page_size"] > 0
    model = httpx.get(f"{srv.url}/get_model_info").json()
    assert model["is_generation"] is True and model["model_path"] == srv.runtime.primary.spec.path


def test_health_generate_is_readiness(srv):
    r = httpx.get(f"{srv.url}/health_generate")
    assert r.status_code == 200 and r.json() == {"status": "ok"}
    srv.runtime.readiness.draining = True
    try:
        r = httpx.get(f"{srv.url}/health_generate")
        assert r.status_code == 503 and r.json() == {"status": "draining"}
    finally:
        srv.runtime.readiness.draining = False


def test_render_routes_return_the_prompt_token_ids(srv, offline_engine):
    r = httpx.post(f"{srv.url}/v1/completions/render",
                   json={"model": MODEL, "prompt": ["import os", "def f():"], "max_tokens": 5, "temperature": 0})
    assert r.status_code == 200, r.text
    out = r.json()
    assert [o["token_ids"] for o in out] == [offline_engine.encode("import os"), offline_engine.encode("def f():")]
    assert out[0]["sampling_params"] == {"max_tokens": 5, "temperature": 0} and out[0]["model"] == MODEL
    msgs = [{"role": "user", "content": "Hi"}]
    chat = httpx.post(f"{srv.url}/v1/chat/completions/render", json={"messages": msgs, "stream": True}).json()
    assert chat["token_ids"] == offline_engine.apply_chat_template(msgs) and chat["stream"] is True
    bad = httpx.post(f"{srv.url}/v1/completions/render", json={"model": "gpt-4", "prompt": "x"})
    assert bad.status_code == 404 and bad.json()["error"]["param"] == "model"
    missing = httpx.post(f"{srv.url}/v1/chat/completions/render", json={"model": MODEL})
    assert missing.status_code == 400 and "messages" in missing.text
