"""The OpenAI-compatible API, driven by the official `openai` client (unchanged) against a real server
with the tiny model; plus the raw request a load tool (vllm bench serve) sends."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from engine import SamplingParams

from ..helpers import metric

PROMPT = "import os\nimport sys\n"
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hello."}]
GREEDY = {"temperature": 0.0, "max_tokens": 16}
IGNORE_EOS = {"ignore_eos": True}


@pytest.fixture(scope="module")
def ref_completion(offline_engine):
    return offline_engine.generate([PROMPT], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))[0]


@pytest.fixture(scope="module")
def ref_chat(offline_engine):
    ids = offline_engine.apply_chat_template(MESSAGES)
    return offline_engine.generate([ids], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))[0]


def test_models(client):
    models = client.models.list().data
    assert [m.id for m in models] == ["tiny-llama"]


def test_completion_non_streaming_equals_offline(client, ref_completion):
    r = client.completions.create(model="tiny-llama", prompt=PROMPT, extra_body=IGNORE_EOS, **GREEDY)
    assert r.object == "text_completion" and r.id.startswith("cmpl-")
    assert r.choices[0].text == ref_completion.text
    assert r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == len(ref_completion.prompt_token_ids)
    assert r.usage.completion_tokens == 16 and r.usage.total_tokens == r.usage.prompt_tokens + 16


def test_completion_streaming_with_usage(client, ref_completion):
    chunks = list(client.completions.create(model="tiny-llama", prompt=PROMPT, stream=True,
                                            stream_options={"include_usage": True}, extra_body=IGNORE_EOS,
                                            **GREEDY))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == ref_completion.text
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert reasons[-1] == "length" and set(reasons[:-1]) == {None}
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 16
    assert all(c.usage is None for c in chunks[:-1])


def test_chat_non_streaming_uses_the_chat_template(client, ref_chat):
    r = client.chat.completions.create(model="tiny-llama", messages=MESSAGES, extra_body=IGNORE_EOS, **GREEDY)
    assert r.object == "chat.completion"
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == ref_chat.text
    assert r.usage.prompt_tokens == len(ref_chat.prompt_token_ids)


def test_chat_streaming(client, ref_chat):
    stream = client.chat.completions.create(model="tiny-llama", messages=MESSAGES, stream=True,
                                            stream_options={"include_usage": True}, extra_body=IGNORE_EOS,
                                            **GREEDY)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == ref_chat.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 16


def test_chat_max_completion_tokens(client):
    r = client.chat.completions.create(model="tiny-llama", messages=MESSAGES, temperature=0.0,
                                       extra_body={"max_completion_tokens": 3, **IGNORE_EOS})
    assert r.usage.completion_tokens == 3


def test_logprobs(client):
    r = client.completions.create(model="tiny-llama", prompt=PROMPT, logprobs=2, extra_body=IGNORE_EOS, **GREEDY)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 16
    assert "".join(lp.tokens) == r.choices[0].text
    assert all(len(top) <= 2 for top in lp.top_logprobs)
    c = client.chat.completions.create(model="tiny-llama", messages=MESSAGES, logprobs=True, top_logprobs=2,
                                       extra_body=IGNORE_EOS, **GREEDY)
    content = c.choices[0].logprobs.content
    assert len(content) == 16 and all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in content)


def test_extensions_are_accepted(client, srv):
    r = client.completions.create(
        model="tiny-llama", prompt=PROMPT, max_tokens=8, temperature=0.7, seed=7,
        extra_body={"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1, "ignore_eos": True,
                    "priority": "batch", "min_tokens": 8},
    )  # fmt: skip
    assert r.usage.completion_tokens == 8
    again = client.completions.create(
        model="tiny-llama", prompt=PROMPT, max_tokens=8, temperature=0.7, seed=7,
        extra_body={"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1, "ignore_eos": True},
    )  # fmt: skip
    assert again.choices[0].text == r.choices[0].text  # same seed, same sample
    metrics = httpx.get(f"{srv.url}/metrics", timeout=10).text
    assert metric(metrics, "tokenmill_requests_total", lane="batch", reason="length", status="ok") == 1


def test_openai_error_bodies(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="no-such-model", prompt=PROMPT, max_tokens=2)
    assert e.value.body["type"] == "model_not_found" and e.value.body["param"] == "model"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny-llama", prompt=PROMPT, max_tokens=2, temperature=-1)
    assert e.value.body["param"] == "temperature" and e.value.body["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny-llama", messages=MESSAGES, n=65)
    assert e.value.body["param"] == "n"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny-llama", prompt=PROMPT, max_tokens=5000)
    assert "max_model_len" in e.value.body["message"] and e.value.body["param"] == "max_tokens"


def test_raw_load_tool_request(srv):
    """What `vllm bench serve --backend vllm --endpoint /v1/completions --ignore-eos` sends."""
    body = {"model": "tiny-llama", "prompt": PROMPT, "temperature": 0.0, "max_tokens": 10, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}, "logprobs": None, "repetition_penalty": 1.0,
            "unknown_tool_field": {"x": 1}}  # fmt: skip
    with httpx.stream("POST", f"{srv.url}/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        data = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    chunks = [json.loads(d) for d in data[:-1]]
    assert chunks[-1]["usage"]["completion_tokens"] == 10
    assert sum(1 for c in chunks if c["choices"] and c["choices"][0]["text"]) >= 1


@pytest.mark.parametrize("path", ["/v1/completions", "/generate"])
def test_events_split_on_a_blank_line_even_when_reads_coalesce(srv, path):
    """`vllm bench serve` finds events by splitting its buffer on "\\n\\n": with "\\r\\n" line ends, two
    events in one read were one unparseable message and the request was lost. Read the whole stream
    as one buffer (the worst coalescing) and split it that way."""
    body = {"prompt": PROMPT, "max_tokens": 8, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{srv.url}{path}", json=body, timeout=60) as r:
        raw = r.read().decode()
    assert "\r" not in raw
    messages = [m.strip() for m in raw.split("\n\n") if m.strip() and not m.startswith(":")]
    datas = [line.removeprefix("data: ") for m in messages for line in m.splitlines() if line.startswith("data: ")]
    parsed = [json.loads(d) for d in datas if d != "[DONE]"]
    assert len(parsed) >= 8  # one event per token at least, each one whole JSON
