"""Extreme sampling values over HTTP on the tiny real model: each is a 400 naming the field or a
valid result whose meaning is stated (tiny temperatures, top_p and min_p that keep one token are the
greedy output); a NaN logits row fails only its own request."""

from __future__ import annotations

import json
import threading

import httpx
import pytest
from httpx_sse import connect_sse

from ..helpers import make_settings, run_server

PROMPT = "def fibonacci(n):"
N = 12


@pytest.fixture(scope="module")
def srv(real_engine):
    with run_server(make_settings(), real_engine) as s:
        yield s


def generate(srv, **fields) -> httpx.Response:
    body = {"prompt": PROMPT, "max_tokens": N, "ignore_eos": True, "stream": False, **fields}
    return httpx.post(f"{srv.url}/generate", json=body, timeout=60)


@pytest.fixture(scope="module")
def greedy_ids(srv) -> list[int]:
    r = generate(srv, temperature=0.0)
    assert r.status_code == 200
    return r.json()["token_ids"]


# (fields, outcome): "greedy" = 200 and exactly the greedy tokens; "400"/"422" = refused naming the
# first field. Why each valid one is greedy: below GREEDY_TEMPERATURE_EPS (1e-5) sampling is greedy;
# top_p 1e-9 and min_p 1 keep only the most likely token; penalties 0 and 1e-300 change no float32 logit.
TABLE = [
    ({"temperature": 1e-45}, "greedy"),
    ({"temperature": 1e-300}, "greedy"),
    ({"temperature": 1e-6, "seed": 5}, "greedy"),
    ({"temperature": 1e308}, "400"),
    ({"repetition_penalty": 0.0}, "400"),
    ({"repetition_penalty": 1e-300}, "400"),
    ({"repetition_penalty": 1e300}, "400"),
    ({"temperature": 0.0, "presence_penalty": 0.0}, "greedy"),
    ({"temperature": 0.0, "presence_penalty": 1e-300}, "greedy"),
    ({"presence_penalty": 1e300}, "400"),
    ({"temperature": 0.0, "frequency_penalty": 0.0}, "greedy"),
    ({"temperature": 0.0, "frequency_penalty": 1e-300}, "greedy"),
    ({"frequency_penalty": -1e300}, "400"),
    ({"temperature": 1.0, "top_p": 1e-9, "seed": 1}, "greedy"),
    ({"temperature": 1.0, "min_p": 1.0, "seed": 2}, "greedy"),
    ({"top_p": 0.0}, "400"),
    ({"min_p": 1.5}, "400"),
]


@pytest.mark.parametrize("fields, outcome", TABLE, ids=[json.dumps(f) for f, _ in TABLE])
def test_extreme_values(srv, greedy_ids, fields, outcome):
    r = generate(srv, **fields)
    if outcome == "greedy":
        assert r.status_code == 200, r.text
        assert r.json()["token_ids"] == greedy_ids
    else:
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        field = next(iter(fields)) if len(fields) == 1 else next(f for f in fields if f != "temperature")
        assert err["param"] == field and field in err["message"], err


@pytest.mark.parametrize("raw", ["1e400", "-1e400"])
def test_overflowing_json_numbers_are_refused_naming_the_field(srv, raw):
    body = '{"prompt": "hi", "max_tokens": 2, "stream": false, "temperature": ' + raw + "}"
    r = httpx.post(f"{srv.url}/generate", content=body, timeout=30)
    assert r.status_code == 422 and r.json()["error"]["param"] == "temperature", r.text
    r = httpx.post(f"{srv.url}/v1/completions", content=body, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "temperature", r.text


def test_tiny_temperature_is_greedy_on_the_openai_routes_too(srv):
    messages = [{"role": "user", "content": "Say hi"}]
    answers = []
    for temperature in (0.0, 1e-45):
        r = httpx.post(f"{srv.url}/v1/chat/completions", timeout=60, json={
            "messages": messages, "max_tokens": N, "temperature": temperature, "ignore_eos": True})  # fmt: skip
        assert r.status_code == 200, r.text
        answers.append(r.json()["choices"][0]["message"]["content"])
    assert answers[0] == answers[1]


def test_a_nan_logits_row_fails_only_its_request(srv, real_engine, greedy_ids):
    real = real_engine.sampler.sample

    def poison(logits, reqs):  # the model "produces" NaN logits for requests named poison-*
        rows = [i for i, r in enumerate(reqs) if r.request_id.startswith("poison-")]
        if rows:
            logits = logits.clone()
            logits[rows] = float("nan")
        return real(logits, reqs)

    real_engine.sampler.sample = poison
    try:
        results: dict[str, httpx.Response] = {}
        healthy = threading.Thread(target=lambda: results.setdefault("healthy", generate(srv, temperature=0.0)))
        healthy.start()
        bad = generate(srv, temperature=0.0, request_id="poison-json")
        healthy.join(60)
        body = {"prompt": PROMPT, "max_tokens": N, "request_id": "poison-sse", "temperature": 0.7}
        with httpx.Client(timeout=60) as client, connect_sse(client, "POST", f"{srv.url}/generate", json=body) as src:
            events = [(e.event, json.loads(e.data)) for e in src.iter_sse()]
    finally:
        real_engine.sampler.sample = real
    assert bad.status_code == 500, bad.text
    assert bad.json()["error"]["type"] == "engine_error" and "non-finite logits" in bad.json()["error"]["message"]
    assert results["healthy"].status_code == 200 and results["healthy"].json()["token_ids"] == greedy_ids
    assert [kind for kind, _ in events] == ["error"], events  # no token came from the NaN row
    assert "non-finite logits" in events[0][1]["error"]["message"]
    srv.wait_idle()
