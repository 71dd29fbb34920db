"""Numbers in a request are bounded before they are parsed (server/http/numbers.py): whatever their size,
a 400 (or the route's 422) naming the field, never a 500, and never the value echoed back whole.

Issue 45: a `logit_bias` key of more than 4,300 digits answered 500 (int() refused it), and one of
exactly 4,300 digits was a 400 quoting the whole key."""

from __future__ import annotations

import json
import re

import httpx
import pytest

from server.http.numbers import MAX_NUMBER_DIGITS, cut, json_int, number_field

from ..helpers import make_settings, run_server

HUGE = "9" * 5000  # past Python's int() limit (4,300 digits) and the body parser's
AT_LIMIT = "9" * MAX_NUMBER_DIGITS
WIDE = str(10**30)  # parses, but past every integer field's 64-bit range
USER = [{"role": "user", "content": "hi"}]
ADMIN = {"authorization": "Bearer admin-key"}


def raw(template: str, number: str) -> bytes:
    """A body with `number` written into it as a JSON number (json.dumps cannot write 5,000 digits)."""
    return template.replace("N", number).encode()


# (path, body, the field the error names)
CASES = [
    # logit_bias keys: token ids as strings, read with int()
    ("/v1/completions", {"prompt": "x", "logit_bias": {HUGE: 1}}, "logit_bias"),
    ("/v1/chat/completions", {"messages": USER, "logit_bias": {HUGE: 1}}, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {AT_LIMIT: 1}}, "logit_bias"),
    ("/v1/chat/completions", {"messages": USER, "logit_bias": {" " * 5000 + "5": 1}}, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {WIDE: 1}}, "logit_bias"),
    # seeds
    ("/generate", raw('{"prompt": "x", "max_tokens": 1, "seed": N}', HUGE), "seed"),
    ("/generate", raw('{"prompt": "x", "max_tokens": 1, "seed": -N}', HUGE), "seed"),
    ("/v1/completions", raw('{"prompt": "x", "seed": N}', WIDE), "seed"),
    ("/v1/chat/completions", raw('{"messages": [{"role": "user", "content": "hi"}], "seed": N}', HUGE), "seed"),
    ("/", raw('{"inputs": "x", "parameters": {"seed": N}}', HUGE), "parameters.seed"),
    ("/", raw('{"inputs": "x", "parameters": {"seed": N}}', WIDE), "parameters.seed"),
    # token ids
    ("/generate", raw('{"prompt_token_ids": [1, N], "max_tokens": 1}', HUGE), "prompt_token_ids.1"),
    ("/generate", raw('{"prompt_token_ids": [N], "max_tokens": 1}', WIDE), "prompt_token_ids.0"),
    ("/v1/completions", raw('{"prompt": [[5, 6], [7, N]]}', HUGE), "prompt.1.1"),
    ("/generate", raw('{"prompt": "x", "stop_token_ids": [N]}', HUGE), "stop_token_ids.0"),
    ("/detokenize", raw('{"tokens": [3, N]}', HUGE), "tokens.1"),
    ("/detokenize", raw('{"tokens": [N]}', WIDE), "tokens.0"),
    # any other number: token limits, counts, a rating, a number in a schema given as text
    ("/v1/completions", raw('{"prompt": "x", "max_tokens": N}', WIDE), "max_tokens"),
    ("/v1/completions", raw('{"prompt": "x", "n": N}', HUGE), "n"),
    ("/v1/responses", raw('{"input": "x", "max_output_tokens": N}', WIDE), "max_output_tokens"),
    ("/v1/responses", raw('{"input": "x", "top_logprobs": N}', HUGE), "top_logprobs"),
    ("/", raw('{"inputs": "x", "parameters": {"max_new_tokens": N}}', WIDE), "parameters.max_new_tokens"),
    ("/generate", raw('{"prompt": "x", "temperature": 1N}', HUGE), "temperature"),
    ("/v1/feedback", raw('{"request_id": "r", "rating": N}', WIDE), "rating"),
    ("/v1/feedback", raw('{"request_id": "r", "rating": N}', HUGE), "rating"),
    ("/v1/chat/completions", {"messages": USER, "guided_json": '{"type": "array", "maxItems": N}'.replace("N", HUGE)},
     "guided_json"),
]


@pytest.fixture(scope="module")
def srv(real_engine, tmp_path_factory):
    feedback_db = str(tmp_path_factory.mktemp("numbers") / "fb.sqlite3")
    with run_server(make_settings(feedback_db=feedback_db, admin_api_keys=["admin-key"]), real_engine) as s:
        yield s


def no_long_echo(text: str) -> bool:
    """No run of digits or spaces longer than a 64-bit integer's in the answer: the value was not echoed."""
    return re.search(r"[0-9 ]{41,}", text) is None and len(text) < 600


@pytest.mark.parametrize(("path", "body", "param"), CASES, ids=[f"{i}:{c[0]}:{c[2]}" for i, c in enumerate(CASES)])
def test_a_huge_number_is_a_4xx_naming_its_field(srv, path, body, param):
    kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
    with httpx.Client(base_url=srv.url, timeout=30) as c:
        r = c.post(path, **kwargs)
        assert r.status_code in (400, 422), r.text[:500]
        assert no_long_echo(r.text), r.text[:500]
        error = r.json()["error"]
        if path == "/":  # TGI's error is a string naming the field
            assert param in error, error
        else:
            assert error["param"] == param, error
        ok = c.post("/generate", json={"prompt": "hi", "max_tokens": 1, "stream": False})  # the same connection
        assert ok.status_code == 200, ok.text


def test_a_huge_number_in_a_query_is_a_4xx_naming_it(srv):
    r = httpx.get(f"{srv.url}/admin/feedback", params={"limit": HUGE}, headers=ADMIN, timeout=30)
    assert r.status_code == 422 and r.json()["error"]["param"] == "query.limit", r.text[:500]
    assert no_long_echo(r.text), r.text[:500]


def test_the_bounds_in_units():
    assert json_int("-" + AT_LIMIT) == -int(AT_LIMIT)
    with pytest.raises(ValueError, match=f"more than {MAX_NUMBER_DIGITS} digits"):
        json_int(AT_LIMIT + "9")
    assert cut("x" * 5000) == repr("x" * 5000)[:40] + "... (5,000 characters)" and cut("5") == "'5'"
    detail = "number out of range at line 2 column 4310"
    text = '{"a": {"\u20ac\u20ac": [1,\n' + " " * 3 + HUGE + "]}}"  # a byte column past non-ASCII keys
    assert number_field(text, detail) == "a.\u20ac\u20ac.1"
    assert number_field(json.dumps({"a": 1}), "EOF while parsing a value at line 1 column 5") is None
