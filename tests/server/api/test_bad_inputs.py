"""A table of bad requests, each with its 4xx and the field it names; the server keeps serving.
Also: API keys (401), the body size limit (413), unknown routes and methods."""

from __future__ import annotations

import types

import httpx
import openai
import pytest

from server.http.errors import ApiError
from server.prompt.codec import check_prompt_bytes

from ..helpers import TEST_MAX_MODEL_LEN, make_settings, run_server

OK = {"prompt": "hello", "max_tokens": 2, "stream": False}

# (path, body: dict | bytes, expected status, field the error names or None, text the message contains)
CASES = [
    ("/generate", b'{"prompt": ', 400, None, "malformed JSON"),
    ("/generate", b"", 400, None, "malformed JSON"),
    ("/generate", b"[1, 2]", 422, "body", ""),
    ("/generate", {**OK, "foo": 1}, 422, "foo", "Extra inputs"),
    ("/generate", {**OK, "prompt": 5}, 422, "prompt", ""),
    ("/generate", {**OK, "max_tokens": "5"}, 422, "max_tokens", "integer"),
    ("/generate", {**OK, "max_tokens": 2.5}, 422, "max_tokens", "integer"),
    ("/generate", {**OK, "max_tokens": 0}, 400, "max_tokens", ">= 1"),
    ("/generate", {**OK, "temperature": -1}, 400, "temperature", "[0.0, 100.0]"),
    ("/generate", {**OK, "top_p": 1.5}, 400, "top_p", "(0.0, 1.0]"),
    ("/generate", {**OK, "top_k": -5}, 400, "top_k", ">= 0"),
    ("/generate", {**OK, "logprobs": 50}, 400, "logprobs", "<= 20"),
    ("/generate", {**OK, "min_tokens": 5}, 400, "min_tokens", "max_tokens"),
    ("/generate", {**OK, "stop": [""]}, 400, "stop", "non-empty"),
    ("/generate", {**OK, "stop_token_ids": ["a"]}, 422, "stop_token_ids.0", ""),
    ("/generate", {**OK, "seed": 1.5}, 422, "seed", ""),
    ("/generate", {**OK, "stream": "yes"}, 422, "stream", "boolean"),
    ("/generate", {**OK, "ignore_eos": 1}, 422, "ignore_eos", "boolean"),
    ("/generate", {**OK, "priority": "urgent"}, 422, "priority", ""),
    ("/generate", {**OK, "priority": 7}, 400, "priority", "0-2"),
    ("/generate", {**OK, "timeout_s": 0}, 422, "timeout_s", "greater than 0"),
    ("/generate", {**OK, "first_token_timeout_s": -1}, 422, "first_token_timeout_s", "greater than 0"),
    ("/generate", {**OK, "request_id": "has spaces"}, 422, "request_id", "pattern"),
    ("/generate", {**OK, "prompt_token_ids": [1, 2]}, 400, "prompt", "exactly one"),
    ("/generate", {"max_tokens": 2}, 400, "prompt", "exactly one"),
    ("/generate", {**OK, "prompt": ""}, 400, "prompt", "empty"),
    ("/generate", {"prompt_token_ids": [], "max_tokens": 2}, 400, "prompt", "empty"),
    ("/generate", {"prompt_token_ids": [-1], "max_tokens": 2}, 422, "prompt_token_ids.0", ""),
    ("/generate", {"prompt_token_ids": [10**7], "max_tokens": 2, "stream": False}, 400, None, "prompt_token_ids"),
    ("/generate", {"prompt_token_ids": [10**7], "max_tokens": 2, "stream": True}, 400, None, "prompt_token_ids"),
    ("/generate", {**OK, "max_tokens": TEST_MAX_MODEL_LEN}, 400, "max_tokens", f"max_model_len ({TEST_MAX_MODEL_LEN})"),
    ("/generate", {"prompt_token_ids": [5] * (TEST_MAX_MODEL_LEN + 10), "max_tokens": 1}, 400, "prompt", "context"),
    ("/generate", b'{"prompt": "x", "temperature": NaN}', 422, "temperature", "finite"),
    ("/generate", {**OK, "stop": 5}, 422, "stop", ""),
    ("/v1/completions", b"{", 400, None, "malformed JSON"),
    ("/v1/completions", {"model": "tiny-llama", "max_tokens": 2}, 400, "prompt", "required"),
    ("/v1/completions", {"prompt": "x", "n": 0}, 400, "n", "n must be in [1, 64]"),
    ("/v1/completions", {"prompt": "x", "n": 2, "best_of": 3}, 400, "best_of", "not supported"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens", "0 only with echo"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"a": 1}}, 400, "logit_bias", "token ids"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"5": 200}}, 400, "logit_bias", "[-100.0, 100.0]"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"99999": 1}}, 400, "logit_bias", "not a token id"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"5": 1, " 5": -1}}, 400, "logit_bias", "token 5 twice"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"5": 1, "05": -1}}, 400, "logit_bias", "token 5 twice"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "logit_bias": {"+7": 1, "7 ": 2}},
     400, "logit_bias", "token 7 twice"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"5_0": 1}}, 400, "logit_bias", "token ids"),
    ("/v1/responses", {"input": "x", "max_output_tokens": TEST_MAX_MODEL_LEN}, 400, "max_output_tokens",
     f"max_output_tokens ({TEST_MAX_MODEL_LEN})"),
    ("/v1/responses", {"input": "x", "text": {"format": "json"}}, 400, "text.format", "object"),
    # the Responses shape is flat: errors name its own fields, not the chat shape plan_tools reads
    ("/v1/responses", {"input": "x", "tools": [{"type": "function", "name": "a b"}]}, 400, "tools.0.name",
     "tools.0.name must be 1-64"),
    ("/v1/responses", {"input": "x", "tools": [{"type": "function", "name": "f", "parameters": 3}]}, 400,
     "tools.0.parameters", "JSON schema"),
    ("/v1/responses", {"input": "x", "tools": [{"type": "function", "function": {"name": "a b"}}]}, 400,
     "tools.0.function.name", "tools.0.function.name must be"),
    ("/v1/responses", {"input": "x", "tools": [{"type": "function", "name": "f"}], "tool_choice": {"type": "x"}},
     400, "tool_choice", '{"type": "function", "name": ...}'),
    # input items as the Responses API documents them: a function_call has call_id, name and arguments; its
    # function_call_output a call_id and output
    ("/v1/responses", {"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, 400,
     "input.0.call_id", "function_call item needs `call_id`"),
    ("/v1/responses", {"input": [{"type": "function_call", "call_id": "", "name": "f", "arguments": "{}"}]}, 400,
     "input.0.call_id", "non-empty string"),
    ("/v1/responses", {"input": [{"role": "user", "content": "x"},
                                 {"type": "function_call", "call_id": 7, "name": "f", "arguments": "{}"}]}, 400,
     "input.1.call_id", "call_id"),
    ("/v1/responses", {"input": [{"type": "function_call", "call_id": "c", "arguments": "{}"}]}, 400,
     "input.0.name", "needs `name`"),
    ("/v1/responses", {"input": [{"type": "function_call", "call_id": "c", "name": "f"}]}, 400,
     "input.0.arguments", "needs `arguments`"),
    ("/v1/responses", {"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
                                 {"type": "function_call_output", "output": "done"}]}, 400,
     "input.1.call_id", "function_call_output item needs `call_id`"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens":
     TEST_MAX_MODEL_LEN}, 400, "max_completion_tokens", "max_completion_tokens"),
    ("/v1/completions", {"prompt": []}, 400, "prompt", "must not be empty"),
    ("/v1/completions", {"prompt": "x", "temperature": "hot"}, 400, "temperature", "number"),
    ("/v1/completions", {"prompt": "x", "max_tokens": -1}, 400, "max_tokens", ">= 1"),
    ("/v1/completions", {"prompt": "x", "suffix": "y"}, 400, "suffix", "not supported"),
    ("/v1/completions", {"prompt": "x", "use_beam_search": True}, 400, "use_beam_search", "not supported"),
    ("/v1/completions", {"prompt": "x", "prompt_logprobs": 1}, 400, "prompt_logprobs", "echo with logprobs"),
    ("/v1/completions", {"prompt": "x", "truncate_prompt_tokens": 0}, 400, "truncate_prompt_tokens", ""),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "functions": [{"name": "f"}]}, 400,
     "functions", "use tools"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "modalities": ["text", "audio"]},
     400, "modalities", "text output"),
    ("/v1/completions", {"prompt": "x", "model": "gpt-4"}, 404, "model", "not served"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages", "at least 1"),
    ("/v1/chat/completions", {"messages": "hi"}, 400, "messages", ""),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400,
     "messages.0.content.0.type", "text only"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": None}]}, 400, "messages.0.content",
     "only assistant"),
    ("/v1/chat/completions", {"messages": [{"role": "tool", "content": "x"}]}, 400, "messages.0.tool_call_id",
     "required"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "chat_template": "{{x}}"}, 400,
     "chat_template", "--chat-template"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "continue_final_message": True},
     400, "continue_final_message", "add_generation_prompt"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "chat_template_kwargs": {"tokenize": True}}, 400, "chat_template_kwargs.tokenize", ""),
    ("/v1/chat/completions", {"messages": [{"content": "no role"}]}, 400, "messages.0.role", "required"),
]


@pytest.fixture(scope="module")
def srv(real_engine):
    with run_server(make_settings(max_body_bytes=64 * 1024), real_engine) as s:
        yield s


@pytest.mark.parametrize(("path", "body", "status", "param", "text"), CASES,
                         ids=[f"{i}:{c[0]}:{c[2]}" for i, c in enumerate(CASES)])
def test_bad_input_gets_its_4xx(srv, path, body, status, param, text):
    kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
    r = httpx.post(f"{srv.url}{path}", timeout=30, **kwargs)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    if path.startswith("/v1/"):
        assert set(error) >= {"message", "type", "param", "code"} and error["code"] == status
    if param is not None:
        assert error["param"] == param, error
    assert text in error["message"], error


def test_the_prompt_size_check_names_the_bodys_max_tokens_field():
    """The byte-count check before tokenizing (server/prompt/codec.py) names the route's own field."""
    codec = types.SimpleNamespace(max_bytes_per_token=4, min_tokens=lambda n: -(-n // 4))
    with pytest.raises(ApiError) as err:
        check_prompt_bytes(codec, ["x" * 20000], 600, 5200, "input", max_tokens_field="max_output_tokens")
    assert err.value.param == "max_output_tokens" and "max_output_tokens (600)" in err.value.message
    with pytest.raises(ApiError) as err:
        check_prompt_bytes(codec, ["x" * 20000], 600, 5200, "prompt")
    assert err.value.param == "max_tokens"


def test_server_still_serves_after_the_table(srv):
    r = httpx.post(f"{srv.url}/generate", json=OK, timeout=30)
    assert r.status_code == 200 and len(r.json()["token_ids"]) >= 1
    h = srv.wait_idle()
    assert h["status"] == "ok"
    assert srv.runtime.worker.alive


def test_body_too_large_is_413(srv):
    big = {"prompt": "x" * (70 * 1024), "max_tokens": 1}
    r = httpx.post(f"{srv.url}/generate", json=big, timeout=30)
    assert r.status_code == 413 and r.json()["error"]["type"] == "request_too_large"
    # Without Content-Length (chunked): counted while reading.
    chunks = iter([b'{"prompt": "', b"y" * (70 * 1024), b'"}'])
    r = httpx.post(f"{srv.url}/v1/completions", content=chunks, timeout=30)
    assert r.status_code == 413 and r.json()["error"]["code"] == 413


def test_unknown_route_and_wrong_method(srv):
    r = httpx.get(f"{srv.url}/nope", timeout=10)
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found"
    r = httpx.get(f"{srv.url}/generate", timeout=10)
    assert r.status_code == 405 and "error" in r.json()


def test_text_plain_content_type_is_still_parsed_as_json(srv):
    r = httpx.post(f"{srv.url}/generate", content=b'{"prompt": "hi", "max_tokens": 1, "stream": false}',
                   headers={"content-type": "text/plain"}, timeout=30)
    assert r.status_code == 200


def test_api_keys(real_engine, monkeypatch):
    monkeypatch.setenv("TOKENMILL_API_KEYS", "second-key, third-key")
    with run_server(make_settings(api_key="first-key"), real_engine) as srv:
        r = httpx.post(f"{srv.url}/generate", json=OK, timeout=30)
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
        assert r.json()["error"]["type"] == "unauthorized"
        bad = httpx.post(f"{srv.url}/generate", json=OK, headers={"Authorization": "Bearer nope"}, timeout=30)
        assert bad.status_code == 401
        assert httpx.get(f"{srv.url}/v1/models", timeout=10).status_code == 401
        for key in ("first-key", "second-key", "third-key"):
            ok = httpx.post(f"{srv.url}/generate", json=OK, headers={"Authorization": f"Bearer {key}"}, timeout=30)
            assert ok.status_code == 200
        for open_path in ("/health", "/health/live", "/metrics"):
            assert httpx.get(f"{srv.url}{open_path}", timeout=10).status_code == 200
        with openai.OpenAI(base_url=f"{srv.url}/v1", api_key="third-key", max_retries=0) as client:
            assert client.completions.create(model="tiny-llama", prompt="hi", max_tokens=2).usage.completion_tokens
        with openai.OpenAI(base_url=f"{srv.url}/v1", api_key="wrong", max_retries=0) as client:
            with pytest.raises(openai.AuthenticationError):
                client.models.list()
