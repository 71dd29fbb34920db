"""Chat messages as the OpenAI API defines them, against the real SmolLM2-135M-Instruct chat template
(which concatenates `message['content']` as a string): text parts (the openai client, guidellm's default
request shape), assistant turns with `content: null` and `tool_calls`, `tool` messages, `name`,
`add_generation_prompt`, `continue_final_message`, `chat_template_kwargs` and `--chat-template FILE`.
Prompt token counts are checked against transformers' own rendering of the same conversation."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from server.prompt.codec import PARTS, STRING, probe_content_format

from ..helpers import build_real_engine, make_settings, run_server
from ..real_model import QUESTION, require_default_model

NAME = "smollm2-135m-instruct"
TEMPLATE = (  # a template with a variable, given with --chat-template
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{{ prefix | default('') }}{% endif %}"
)


@pytest.fixture(scope="module")
def model_file():
    return require_default_model()


@pytest.fixture(scope="module")
def engine(model_file):
    return build_real_engine(str(model_file), kv_cache_memory=128 << 20, max_model_len=2048)


@pytest.fixture(scope="module")
def srv(engine):
    with run_server(make_settings(served_model_name=NAME, max_model_len=2048), engine) as s:
        yield s


@pytest.fixture(scope="module")
def client(srv):
    with openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def hf_tok(model_file):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_file.parent), gguf_file=model_file.name)


def hf_count(tok, messages, **kw) -> int:
    ids = tok.apply_chat_template(messages, **{"add_generation_prompt": True, **kw})
    return len(ids["input_ids"] if hasattr(ids, "keys") else ids)


def test_the_probe_tells_string_templates_from_part_templates(hf_tok, real_engine):
    assert probe_content_format(hf_tok, {}) == STRING  # SmolLM2: `+ message['content']`
    assert probe_content_format(real_engine.tokenizer, {}) == PARTS  # the tiny models' template renders parts


def test_guidellm_default_chat_request_gets_200(srv, hf_tok):
    """What guidellm's OpenAI backend posts by default: text parts, streaming with usage, both token
    limits, `stop: null`, `ignore_eos`."""
    body = {"model": NAME, "messages": [{"role": "user", "content": [{"type": "text", "text": QUESTION}]}],
            "stream": True, "stream_options": {"include_usage": True}, "max_tokens": 16,
            "max_completion_tokens": 16, "stop": None, "ignore_eos": True}  # fmt: skip
    with httpx.stream("POST", f"{srv.url}/v1/chat/completions", json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        data = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    usage = json.loads(data[-2])["usage"]
    assert usage["completion_tokens"] == 16
    assert usage["prompt_tokens"] == hf_count(hf_tok, [{"role": "user", "content": QUESTION}])


def test_openai_client_content_parts_equal_string_content(client):
    parts = [{"type": "text", "text": "What is the capital "}, {"type": "text", "text": "of France?"}]
    a = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": parts}], temperature=0,
                                       max_tokens=24)  # fmt: skip
    b = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": QUESTION}], temperature=0,
                                       max_tokens=24)  # fmt: skip
    assert a.choices[0].message.content == b.choices[0].message.content and "Paris" in b.choices[0].message.content
    assert a.usage.prompt_tokens == b.usage.prompt_tokens


def test_tool_call_history_with_null_content_and_tool_messages(client, hf_tok):
    call = {"id": "call_1", "type": "function", "function": {"name": "get_capital", "arguments": '{"country": "France"}'}}
    messages = [
        {"role": "system", "content": "You answer briefly."},
        {"role": "user", "content": QUESTION, "name": "alice"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "Paris"},
    ]
    r = client.chat.completions.create(model=NAME, messages=messages, temperature=0, max_tokens=24)
    assert r.choices[0].finish_reason in ("stop", "length")
    # SmolLM2's template renders content only, so the server writes the call in the Hermes form as the
    # assistant's text (the null content is "") and the result as a user turn (server/prompt/tools.py).
    rendered = [messages[0], messages[1],
                {"role": "assistant", "content": '<tool_call>\n{"name": "get_capital", "arguments": {"country": '
                                                 '"France"}}\n</tool_call>'},
                {"role": "user", "content": "<tool_response>\nParis\n</tool_response>"}]  # fmt: skip
    assert r.usage.prompt_tokens == hf_count(hf_tok, rendered)


def test_add_generation_prompt_and_continue_final_message(client, srv, hf_tok):
    msgs = [{"role": "user", "content": QUESTION}, {"role": "assistant", "content": "The capital of France is"}]
    r = client.chat.completions.create(model=NAME, messages=msgs, temperature=0, max_tokens=8,
                                       extra_body={"add_generation_prompt": False, "continue_final_message": True})  # fmt: skip
    assert "Paris" in r.choices[0].message.content
    assert r.usage.prompt_tokens == hf_count(hf_tok, msgs, add_generation_prompt=False, continue_final_message=True)
    tokenized = httpx.post(f"{srv.url}/tokenize", json={"messages": msgs[:1], "add_generation_prompt": False}).json()
    assert tokenized["count"] == hf_count(hf_tok, msgs[:1], add_generation_prompt=False)


def test_chat_template_file_and_kwargs(engine, tmp_path, hf_tok):
    path = tmp_path / "template.jinja"
    path.write_text(TEMPLATE)
    with run_server(make_settings(served_model_name=NAME, max_model_len=2048, chat_template=str(path)), engine) as s:
        msgs = [{"role": "user", "content": QUESTION}]
        plain = httpx.post(f"{s.url}/tokenize", json={"messages": msgs}).json()
        assert plain["count"] == hf_count(hf_tok, msgs, chat_template=TEMPLATE)  # no system prompt added: ours
        body = {"messages": msgs, "chat_template_kwargs": {"prefix": "Sure! The capital is"}}
        with_prefix = httpx.post(f"{s.url}/tokenize", json=body).json()
        assert with_prefix["count"] == hf_count(hf_tok, msgs, chat_template=TEMPLATE, prefix="Sure! The capital is")
        assert with_prefix["count"] > plain["count"]
        r = httpx.post(f"{s.url}/v1/chat/completions", json={**body, "max_tokens": 4, "temperature": 0}).json()
        assert r["usage"]["prompt_tokens"] == with_prefix["count"]
        info = httpx.get(f"{s.url}/tokenizer_info").json()
        assert info["chat_template"] == TEMPLATE
