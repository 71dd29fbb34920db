"""Grammar faults over real sockets (issue 21): a grammar that allows no token is a 400 naming its field
(at compile time when no token can start it, at run time when it reaches a dead end), never a 500
engine_error, and the keep-alive connection serves the next request; a request refused for its context
length, a field combination, room in its lane or its grammar's size compiles nothing; the grammar series
on /metrics."""

from __future__ import annotations

import http.client
import json
from typing import Any

import httpx
import pytest

from ..helpers import Background, ControlledEngine, make_settings, metric, park_filler, run_server, wait_until

# A raw control character in a JSON string: xgrammar's pattern allows it, the control-character mask
# (valid JSON needs none) forbids it, so the grammar runs into a dead end after the opening quote.
CONTROL_PATTERN = {"type": "string", "pattern": "\u0001+"}


@pytest.fixture(scope="module")
def srv(real_engine):
    with run_server(make_settings(structured_max_grammar_bytes=48 << 10), real_engine) as s:
        yield s


class KeepAlive:
    """One HTTP/1.1 connection; `post` fails if the server closed it (it must not reconnect)."""

    def __init__(self, srv) -> None:
        self.conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=60)
        self.conn.connect()
        self.sock = self.conn.sock

    def post(self, path: str, body: dict[str, Any]) -> tuple[int, dict[str, str], dict[str, Any]]:
        assert self.conn.sock is self.sock, "the server closed the keep-alive connection"
        self.conn.request("POST", path, json.dumps(body), {"content-type": "application/json"})
        r = self.conn.getresponse()
        data = json.loads(r.read())
        return r.status, {k.lower(): v for k, v in r.getheaders()}, data

    def close(self) -> None:
        self.conn.close()


@pytest.mark.parametrize(("path", "field", "value", "param", "says"), [
    ("/v1/completions", "guided_regex", r"[^\s\S]", "guided_regex", "allows no output"),
    ("/v1/completions", "guided_json", CONTROL_PATTERN, "guided_json", "allows no next token"),
    ("/v1/chat/completions", "response_format",
     {"type": "json_schema", "json_schema": {"name": "x", "schema": CONTROL_PATTERN}},
     "response_format.json_schema.schema", "allows no next token"),
    ("/v1/completions", "structured_outputs", {"regex": r"[^\s\S]"}, "structured_outputs.regex", "allows no output"),
])  # fmt: skip
def test_a_grammar_that_allows_no_token_is_a_400_naming_its_field(srv, path, field, value, param, says):
    body: dict[str, Any] = {"max_tokens": 16, "temperature": 0, field: value}
    body.update({"messages": [{"role": "user", "content": "hi"}]} if "chat" in path else {"prompt": "hello"})
    conn = KeepAlive(srv)
    try:
        status, headers, answer = conn.post(path, body)
        assert status == 400, answer
        assert answer["error"]["param"] == param and says in answer["error"]["message"], answer
        assert "non-finite" not in answer["error"]["message"] and headers.get("connection") != "close"
        status, _, again = conn.post("/v1/completions", {"prompt": "hello", "max_tokens": 2})  # same socket
        assert status == 200 and again["usage"]["completion_tokens"] == 2, again
    finally:
        conn.close()
    text = httpx.get(f"{srv.url}/metrics", timeout=10).text
    reason = "allows_nothing" if says == "allows no output" else "no_next_token"
    assert metric(text, "tokenmill_grammar_rejections_total", reason=reason) >= 1
    assert metric(text, "tokenmill_requests_total", status="error", reason="engine_error") == 0


def test_a_streamed_dead_end_ends_with_an_error_event_naming_the_field(srv):
    body = {"prompt": "hello", "max_tokens": 16, "temperature": 0, "stream": True, "guided_json": CONTROL_PATTERN}
    with httpx.stream("POST", f"{srv.url}/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert events[0]["choices"][0]["text"] == '"'  # it started: the quote came before the dead end
    error = events[-1]["error"]
    assert error["param"] == "guided_json" and error["code"] == 400 and error["type"] == "invalid_request", error


def _schema(tag: str, words: int) -> dict[str, Any]:
    return {"type": "object", "properties": {"pick": {"enum": [f"{tag}-{i}" for i in range(words)]}},
            "required": ["pick"]}  # fmt: skip


@pytest.mark.parametrize(("extra", "param"), [
    ({"max_tokens": 100000}, "max_tokens"),  # the context check, before the compile
    ({"max_tokens": 4, "prompt": "word " * 2000}, "prompt"),
    ({"max_tokens": 4, "min_tokens": 2}, "min_tokens"),  # a combination the engine refuses
])  # fmt: skip
def test_a_request_refused_for_its_other_fields_compiles_nothing(srv, real_engine, extra, param):
    compiler = real_engine.grammar_compiler
    body = {"prompt": "hello", "guided_json": _schema(param[:3], 3000), **extra}
    assert 30_000 < len(json.dumps(body["guided_json"])) < 48 << 10  # big, but under the size bound
    before = compiler.stats()
    r = httpx.post(f"{srv.url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    after = compiler.stats()
    assert (after.misses, after.hits, after.entries) == (before.misses, before.hits, before.entries)


def test_a_grammar_over_the_size_bound_is_a_400_before_anything_else(srv, real_engine):
    before = real_engine.grammar_compiler.stats()
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
            "response_format": {"type": "json_schema", "json_schema": {"name": "big", "schema": _schema("big", 8000)}}}
    r = httpx.post(f"{srv.url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "response_format.json_schema.schema" and "structured_max_grammar_bytes" in error["message"]
    assert real_engine.grammar_compiler.stats().misses == before.misses
    text = httpx.get(f"{srv.url}/metrics", timeout=10).text
    assert metric(text, "tokenmill_grammar_rejections_total", reason="source_too_large") >= 1


def test_compiles_and_the_grammar_cache_show_on_metrics(srv):
    body = {"prompt": "hello", "max_tokens": 4, "guided_choice": ["metrics-a", "metrics-b"]}
    assert httpx.post(f"{srv.url}/v1/completions", json=body, timeout=60).status_code == 200
    text = httpx.get(f"{srv.url}/metrics", timeout=10).text
    assert metric(text, "tokenmill_grammar_compile_seconds_count", outcome="ok") >= 1
    assert metric(text, "tokenmill_grammar_cache_entries") >= 1 and metric(text, "tokenmill_grammar_cache_bytes") > 0


def test_a_request_its_lane_has_no_room_for_compiles_nothing(real_engine):
    held = ControlledEngine(real_engine)
    settings = make_settings(interactive_max_queued_requests=1, warmup=False)
    small = {"prompt": "hello", "max_tokens": 4, "ignore_eos": True, "priority": "interactive"}
    try:
        with run_server(settings, held) as srv, Background() as bg:
            filler = park_filler(srv, held, bg, {**small, "priority": "batch", "request_id": "filler"})
            queued = bg.post("queued", f"{srv.url}/generate", small)
            wait_until(lambda: srv.health()["waiting"]["interactive"] == 1, what="the lane full")
            before = real_engine.grammar_compiler.stats()
            body = {**small, "guided_json": _schema("lan", 3000)}
            r = httpx.post(f"{srv.url}/v1/completions", json=body, timeout=30)
            assert r.status_code == 429 and r.json()["error"]["type"] == "overloaded", r.text
            after = real_engine.grammar_compiler.stats()
            assert (after.misses, after.hits) == (before.misses, before.hits)
            text = httpx.get(f"{srv.url}/metrics", timeout=10).text
            assert metric(text, "tokenmill_request_rejections_total", lane="interactive", reason="queue_requests") == 1
            held.gate.set()
            assert queued.result(timeout=30).status_code == 200 and filler.result(timeout=30).status_code == 200
    finally:
        held.gate.set()
