"""The real SmolLM2-135M-Instruct GGUF file over HTTP: a chat answer that knows Paris and stops on
<|im_end|>, real text streamed by /generate and through the openai client, and greedy output equal to
transformers' on the same dequantized weights (its own GGUF load) for 8 chat prompts (float32)."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
import torch
from httpx_sse import connect_sse

from ..helpers import build_real_engine, make_settings, run_server
from ..real_model import QUESTION, require_default_model

NAME = "smollm2-135m-instruct"
PROMPTS = [
    QUESTION,
    "Name three primary colors.",
    "Write a haiku about the sea.",
    "What is 12 times 12?",
    "Translate 'good morning' into Spanish.",
    "Explain what a CPU does in one sentence.",
    "Give me a synonym for happy.",
    "Who wrote Romeo and Juliet?",
]
NEW_TOKENS = 20


@pytest.fixture(scope="module")
def model_file():
    return require_default_model()


@pytest.fixture(scope="module")
def srv(model_file):
    engine = build_real_engine(str(model_file), kv_cache_memory=256 << 20, max_model_len=2048)
    assert engine.dtype == torch.float32  # dtype auto on the CPU: a quantized file serves in float32
    with run_server(make_settings(served_model_name=NAME, max_model_len=2048), engine) as s:
        yield s


def _chat(srv, content: str | list, **extra) -> dict:
    body = {"model": NAME, "messages": [{"role": "user", "content": content}], "temperature": 0,
            "max_tokens": 64, **extra}  # fmt: skip
    r = httpx.post(f"{srv.url}/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_chat_knows_paris_and_stops_on_im_end(srv):
    body = _chat(srv, QUESTION, logprobs=True)
    choice = body["choices"][0]
    assert "Paris" in choice["message"]["content"]
    assert choice["finish_reason"] == "stop"
    tokens = [entry["token"] for entry in choice["logprobs"]["content"]]
    assert tokens[-1] == "<|im_end|>" and "<|im_end|>" not in choice["message"]["content"]
    assert body["usage"]["completion_tokens"] == len(tokens) < 64
    assert httpx.get(f"{srv.url}/v1/models").json()["data"][0]["id"] == NAME


def test_text_content_parts_work_with_a_string_only_template(srv):
    """SmolLM2's template concatenates `message['content']` as a string: text parts are joined first."""
    parts = [{"type": "text", "text": "What is the capital "}, {"type": "text", "text": "of France?"}]
    as_parts = _chat(srv, parts)
    assert as_parts["choices"][0]["message"]["content"] == _chat(srv, QUESTION)["choices"][0]["message"]["content"]
    assert as_parts["usage"]["prompt_tokens"] == _chat(srv, QUESTION)["usage"]["prompt_tokens"]


def test_generate_streams_real_text(srv):
    body = {"prompt": "The capital of France is", "max_tokens": 12, "temperature": 0}
    with httpx.Client(timeout=120) as client, connect_sse(client, "POST", f"{srv.url}/generate", json=body) as src:
        events = [(e.event, json.loads(e.data)) for e in src.iter_sse()]
    assert events[-1][0] == "done" and len(events) > 2
    text = "".join(data["text"] for kind, data in events if kind == "token")
    assert "Paris" in text


def test_openai_client_streams_the_chat(srv):
    with openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0, timeout=120) as client:
        chunks = list(client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": QUESTION}],
                                                     temperature=0, max_tokens=64, stream=True))  # fmt: skip
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert len([c for c in chunks if c.choices and c.choices[0].delta.content]) > 3  # token by token
    assert "Paris" in text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"


def test_greedy_equals_transformers_on_the_same_weights(srv, model_file):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_file.parent), gguf_file=model_file.name)
    hf = AutoModelForCausalLM.from_pretrained(str(model_file.parent), gguf_file=model_file.name,
                                              dtype=torch.float32).eval()  # fmt: skip
    mismatched = []
    for prompt in PROMPTS:
        ids = _ids(tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True))
        with torch.no_grad():
            out = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                              max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=tok.pad_token_id)
        want = out[0, len(ids):].tolist()
        body = {"prompt_token_ids": ids, "max_tokens": NEW_TOKENS, "temperature": 0, "stream": False}
        got = httpx.post(f"{srv.url}/generate", json=body, timeout=120).json()["token_ids"]
        if got != want:
            mismatched.append((prompt, got, want))
    assert mismatched == []


def _ids(encoded) -> list[int]:
    return list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)


USER_SCHEMA = {"properties": {"name": {"title": "Name", "type": "string"}, "age": {"title": "Age", "type": "integer"}},
               "required": ["name", "age"], "title": "UserDetail", "type": "object"}  # fmt: skip
# instructor's system prompt in its JSON modes (the schema as pydantic writes it, indented)
INSTRUCTOR_SYSTEM = ("As a genius expert, your task is to understand the content and provide the parsed objects in "
                     "json that match the following json_schema:\n\n" + json.dumps(USER_SCHEMA, indent=2) +
                     "\n\nMake sure to return an instance of the JSON, not the schema itself")  # fmt: skip


@pytest.mark.parametrize("system", [INSTRUCTOR_SYSTEM, None], ids=["instructor", "bare"])
def test_a_json_schema_answer_is_the_right_object_and_stops(srv, system):
    """instructor-style JSON_SCHEMA extraction on the default model. Compact JSON (`{"` forced first) made
    the bare request's name "25"; with bounded whitespace SmolLM2 writes `{\n"name": "Jason", ...}`."""
    messages = [{"role": "user", "content": "Extract Jason is 25 years old"}]
    if system is not None:
        messages.insert(0, {"role": "system", "content": system})
    body = {"model": NAME, "messages": messages, "temperature": 0, "max_tokens": 64,
            "response_format": {"type": "json_schema", "json_schema": {"name": "UserDetail", "schema": USER_SCHEMA}}}
    r = httpx.post(f"{srv.url}/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop", choice
    user = json.loads(choice["message"]["content"])
    assert set(user) == {"name", "age"} and type(user["age"]) is int, user
    assert user == {"name": "Jason", "age": 25}, choice["message"]["content"]
