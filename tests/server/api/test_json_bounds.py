"""Every JSON the server parses from a client has a depth bound (server/http/json_limits.py): the body
itself and JSON given as text inside it. Too deep is a 400 naming the field, never a 500 RecursionError,
and the connection goes on serving. Any 500 that is left says `Connection: close` and closes cleanly."""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest

from server.http.json_limits import MAX_JSON_DEPTH, too_deep

DEEP = 5000  # deep enough for Python's parser to raise RecursionError


def nested(depth: int) -> str:
    """A JSON schema nesting `depth` objects: {"properties": {"a": {"properties": ... }}}."""
    return '{"properties": {"a": ' * depth + '{"type": "string"}' + "}}" * depth


def deep_array(depth: int) -> str:
    return "[" * depth + "1" + "]" * depth


USER = {"role": "user", "content": "hi"}
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]


def history_call(arguments: str) -> list[dict]:
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": arguments}}
    return [USER, {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": "done"}, USER]  # fmt: skip


# (path, body, the field the 400 names)
DEEP_STRINGS = [
    ("/v1/chat/completions", {"messages": [USER], "guided_json": nested(DEEP)}, "guided_json"),
    ("/v1/completions", {"prompt": "x", "guided_json": deep_array(DEEP)}, "guided_json"),
    ("/v1/chat/completions", {"messages": [USER], "structured_outputs": {"json": nested(DEEP)}},
     "structured_outputs.json"),
    ("/v1/chat/completions", {"messages": [USER], "response_format": {
        "type": "json_schema", "json_schema": {"name": "s", "schema": nested(DEEP)}}},
     "response_format.json_schema.schema"),
    ("/v1/chat/completions", {"messages": history_call(deep_array(DEEP)), "max_tokens": 2},
     "messages.1.tool_calls.0.function.arguments"),
    ("/v1/chat/completions", {"messages": history_call(deep_array(DEEP)), "tools": TOOLS, "max_tokens": 2},
     "messages.1.tool_calls.0.function.arguments"),
]


@pytest.mark.parametrize(("path", "body", "param"), DEEP_STRINGS, ids=[c[2] + c[0] for c in DEEP_STRINGS])
def test_deep_json_text_in_a_field_is_a_400_naming_it(srv, path, body, param):
    with httpx.Client(base_url=srv.url, timeout=30) as c:
        r = c.post(path, json=body)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == param and f"deeper than {MAX_JSON_DEPTH}" in error["message"], error
        ok = c.post("/v1/completions", json={"prompt": "hello", "max_tokens": 1})  # the same connection
        assert ok.status_code == 200, ok.text


def test_a_deep_body_is_a_400_on_every_route(srv):
    deep = '{"messages": [{"role": "user", "content": "hi"}], "metadata": ' + deep_array(DEEP) + "}"
    with httpx.Client(base_url=srv.url, timeout=30) as c:
        for path in ("/v1/chat/completions", "/v1/responses", "/generate", "/tokenize", "/detokenize", "/"):
            r = c.post(path, content=deep.encode())
            assert r.status_code == 400, (path, r.text)
            if path != "/":  # TGI's error is a string (its message names the field)
                assert r.json()["error"]["param"] == "body", (path, r.text)
            assert f"body nests deeper than {MAX_JSON_DEPTH}" in r.text
        r = c.post("/generate", json={"prompt": "hi", "max_tokens": 1, "stream": False})
        assert r.status_code == 200


def test_json_at_the_bound_is_accepted(srv):
    """MAX_JSON_DEPTH levels are fine: the body (an ignored field) and a history call's arguments."""
    body = {"messages": history_call(deep_array(MAX_JSON_DEPTH - 1)), "max_tokens": 1,
            "metadata": json.loads(deep_array(MAX_JSON_DEPTH - 3))}  # the body adds its own levels
    r = httpx.post(f"{srv.url}/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 200, r.text


def test_the_depth_of_raw_text():
    assert not too_deep(deep_array(64)) and too_deep(deep_array(65)) and too_deep("[" * DEEP)
    assert not too_deep('{"a": "' + "[" * DEEP + '"}')  # brackets in strings do not count
    assert not too_deep('["\\"", ' + "[]," * DEEP + "1]")  # an escaped quote does not end a string
    assert too_deep('{"a": ' * 65 + "1" + "}" * 65) and not too_deep('{"a": ' * 64 + "1" + "}" * 64)
    assert not too_deep(json.dumps([[i] for i in range(10000)]))
    # Linear time in C: a 1 MiB body of brackets is measured in well under a second.
    for text in (b"[" * (1 << 20), b"[]" * (1 << 19), b"[" * 64 + b"[]" * (1 << 19) + b"]" * 64):
        start = time.perf_counter()
        too_deep(text)
        assert time.perf_counter() - start < 0.5


# -- /v1/responses: a malformed text.format ---------------------------------------------------------------
@pytest.mark.parametrize("fmt", ["json", ["text"], 5, {"type": 5}, {"type": None}])
def test_a_malformed_text_format_is_a_400_naming_it(srv, fmt):
    r = httpx.post(f"{srv.url}/v1/responses", json={"input": "hi", "text": {"format": fmt}}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "text.format", r.text


# -- any 500: Connection: close, then a clean close -------------------------------------------------------
def _raw_get(port: int, path: str) -> tuple[bytes, bytes]:
    """(the response, what came after it before the close) of a keep-alive GET on a fresh socket."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(f"GET {path} HTTP/1.1\r\nHost: t\r\nConnection: keep-alive\r\n\r\n".encode())
        data = b""
        while b"\r\n\r\n" not in data:
            data += s.recv(65536)
        head, _, body = data.partition(b"\r\n\r\n")
        length = int(next(line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")))
        while len(body) < length:
            body += s.recv(65536)
        rest = s.recv(65536)  # b"" is a clean close (FIN); a reset raises ConnectionResetError
        return head + b"\r\n\r\n" + body[:length], rest + body[length:]


def test_a_500_closes_the_connection_cleanly(srv, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("a bug")

    monkeypatch.setattr(srv.runtime.models, "cards", broken)  # /v1/models now fails inside its handler
    response, after = _raw_get(srv.port, "/v1/models")
    head, _, body = response.partition(b"\r\n\r\n")
    lines = [line.lower() for line in head.split(b"\r\n")]
    assert lines[0].startswith(b"http/1.1 500") and b"connection: close" in lines, head
    error = json.loads(body)["error"]
    assert error["type"] == "internal_error" and "RuntimeError" in error["message"] and "a bug" not in body.decode()
    assert after == b""  # closed by the server after the response, nothing else sent
    with httpx.Client(base_url=srv.url, timeout=10) as c:  # keep-alive client: the next request works
        assert c.get("/v1/models").status_code == 500
        assert c.get("/health").status_code == 200
    monkeypatch.undo()
    assert httpx.get(f"{srv.url}/v1/models", timeout=10).status_code == 200
    text = httpx.get(f"{srv.url}/metrics", timeout=10).text
    assert 'tokenmill_http_errors_total{endpoint="/v1/models",reason="internal_error",status="500"}' in text
