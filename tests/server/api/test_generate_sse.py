"""POST /generate over a real uvicorn server with the tiny real model: SSE (parsed with httpx-sse),
JSON, greedy equality with the offline engine, logprobs, metrics, health, the request log line."""

from __future__ import annotations

import json
import logging

import httpx
import pytest
from httpx_sse import connect_sse

from engine import SamplingParams
from server.prompt.codec import PromptCodec

from ..helpers import make_settings, metric, run_server

PROMPT = "def fibonacci(n):"


@pytest.fixture(scope="module")
def srv(real_engine):
    with run_server(make_settings(short_request_tokens=64), real_engine) as s:
        yield s


def stream(url: str, body: dict, timeout: float = 60) -> list:
    with httpx.Client(timeout=timeout) as client:
        with connect_sse(client, "POST", f"{url}/generate", json=body) as source:
            assert source.response.status_code == 200, source.response.read()
            assert source.response.headers["content-type"].startswith("text/event-stream")
            return [(e.event, json.loads(e.data)) for e in source.iter_sse()]


def test_stream_has_token_events_then_done(srv):
    events = stream(srv.url, {"prompt": PROMPT, "max_tokens": 12, "ignore_eos": True, "temperature": 0})
    tokens, (last_kind, done) = events[:-1], events[-1]
    assert last_kind == "done"
    assert [kind for kind, _ in tokens] == ["token"] * 12
    assert [t["index"] for _, t in tokens] == list(range(12))
    rid = done["id"]
    assert all(t["id"] == rid and isinstance(t["token_id"], int) and isinstance(t["text"], str) for _, t in tokens)
    assert "logprobs" not in tokens[0][1]
    assert done["finish_reason"] == "length"
    assert done["usage"] == {"prompt_tokens": len(srv.runtime.codec.encode_sync(PROMPT)), "completion_tokens": 12,
                             "cached_tokens": done["usage"]["cached_tokens"]}
    timing = done["timing"]
    assert 0 <= timing["queue_s"] <= timing["ttft_s"] <= timing["e2e_s"]


def test_greedy_output_over_http_equals_offline_engine(srv, offline_engine):
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    ref = offline_engine.generate([PROMPT], params)[0]
    body = {"prompt": PROMPT, "max_tokens": 24, "temperature": 0, "ignore_eos": True}

    events = stream(srv.url, body)
    assert [e["token_id"] for kind, e in events if kind == "token"] == ref.token_ids
    assert "".join(e["text"] for kind, e in events if kind == "token") == ref.text

    r = httpx.post(f"{srv.url}/generate", json={**body, "stream": False}, timeout=60)
    assert r.status_code == 200
    assert r.json()["token_ids"] == ref.token_ids and r.json()["text"] == ref.text

    by_ids = httpx.post(f"{srv.url}/generate", json={**body, "stream": False, "prompt": None,
                                                     "prompt_token_ids": ref.prompt_token_ids}, timeout=60)
    assert by_ids.json()["token_ids"] == ref.token_ids


def test_non_streaming_json_body(srv):
    r = httpx.post(f"{srv.url}/generate", json={"prompt": PROMPT, "max_tokens": 5, "stream": False,
                                                "ignore_eos": True, "request_id": "my-req.1"}, timeout=60)
    assert r.status_code == 200
    body = r.json()
    assert set(body) == {"id", "text", "token_ids", "finish_reason", "usage", "timing", "model_version"}
    assert body["model_version"] == r.headers["x-model-version"] == srv.runtime.primary.version
    assert body["id"] == "my-req.1"
    assert len(body["token_ids"]) == 5 and body["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 5


def test_request_id_is_echoed_in_stream(srv):
    events = stream(srv.url, {"prompt": PROMPT, "max_tokens": 3, "ignore_eos": True, "request_id": "abc-123"})
    assert {e["id"] for _, e in events} == {"abc-123"}


def test_logprobs_per_token(srv):
    events = stream(srv.url, {"prompt": PROMPT, "max_tokens": 4, "ignore_eos": True, "temperature": 0,
                              "logprobs": 2})
    tokens = [e for kind, e in events if kind == "token"]
    assert len(tokens) == 4
    for t in tokens:
        lp = t["logprobs"]
        assert lp["logprob"] <= 0 and len(lp["top"]) == 2
        assert lp["top"][0]["token_id"] == t["token_id"]  # greedy: the chosen token is the best


def test_stop_token_ids_and_min_tokens_reach_the_engine(srv, offline_engine):
    ref = offline_engine.generate([PROMPT], SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))[0]
    stop_at = ref.token_ids[3]
    r = httpx.post(f"{srv.url}/generate", json={"prompt": PROMPT, "max_tokens": 10, "temperature": 0,
                                                "ignore_eos": True, "stop_token_ids": [stop_at], "stream": False})
    body = r.json()
    assert body["finish_reason"] == "stop"
    assert body["token_ids"][-1] == stop_at and len(body["token_ids"]) <= 4


def test_server_tokenizer_copy_matches_engine(offline_engine):
    codec = PromptCodec(offline_engine.tokenizer)
    try:
        for text in (PROMPT, "héllo wörld 你好 🙂", "  leading spaces\n\ttabs", "<|im_start|>user"):
            assert codec.encode_sync(text) == offline_engine.encode(text)
        messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
        assert codec.chat_sync(messages) == offline_engine.apply_chat_template(messages)
    finally:
        codec.close()


def test_lane_chosen_by_size_and_metrics(srv):
    # short_request_tokens=64 here: 4-ish prompt tokens + 8 is interactive, + 100 is standard.
    for max_tokens in (8, 100):
        r = httpx.post(f"{srv.url}/generate", json={"prompt": PROMPT, "max_tokens": max_tokens, "stream": False,
                                                    "ignore_eos": True}, timeout=60)
        assert r.status_code == 200
    r = httpx.get(f"{srv.url}/metrics", timeout=10)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    text = r.text
    assert metric(text, "tokenmill_requests_total", lane="interactive", reason="length", status="ok") >= 1
    assert metric(text, "tokenmill_requests_total", lane="standard", reason="length", status="ok") >= 1
    assert metric(text, "tokenmill_queue_depth", lane="batch") == 0
    assert metric(text, "tokenmill_time_to_first_token_seconds_count", lane="standard") >= 1
    assert metric(text, "tokenmill_generation_tokens_total") >= 108
    assert 0 <= metric(text, "tokenmill_kv_cache_usage_perc") <= 1
    assert metric(text, "tokenmill_worker_alive") == 1


def test_health_and_liveness(srv):
    r = httpx.get(f"{srv.url}/health", timeout=10)
    assert r.status_code == 200
    h = r.json()
    assert h["status"] == "ok" and h["model"] == "tiny-llama"
    assert h["uptime_s"] > 0 and h["running"] == 0
    assert h["waiting"] == {"interactive": 0, "standard": 0, "batch": 0}
    assert 0 <= h["kv_cache_usage"] <= 1 and h["last_step_age_s"] >= 0
    assert httpx.get(f"{srv.url}/health/live", timeout=10).status_code == 200


def test_one_json_log_line_per_request_without_prompt_text(srv, caplog):
    caplog.set_level(logging.INFO, logger="tokenmill.requests")
    secret = "my secret prompt"
    r = httpx.post(f"{srv.url}/generate", json={"prompt": secret, "max_tokens": 3, "stream": False,
                                                "request_id": "logged-1", "ignore_eos": True}, timeout=60)
    assert r.status_code == 200
    lines = [json.loads(rec.getMessage()) for rec in caplog.records if rec.name == "tokenmill.requests"]
    mine = [line for line in lines if line["id"] == "logged-1"]
    assert len(mine) == 1
    line = mine[0]
    for key in ("lane", "status", "finish_reason", "prompt_tokens", "completion_tokens", "cached_tokens",
                "queue_s", "ttft_s", "e2e_s", "kv_blocks_peak"):
        assert key in line
    assert line["status"] == "ok" and line["completion_tokens"] == 3 and line["kv_blocks_peak"] >= 1
    assert secret not in json.dumps(lines)
