"""/v1/completions tokenizes a text prompt with the tokenizer's special tokens by default (vLLM's
CompletionRequest.add_special_tokens, default true: the <bos> Gemma and Llama expect);
`add_special_tokens: false` sends the text alone; chat requests get only what the template renders."""

from __future__ import annotations

import httpx
import pytest

from ..fake_engine import OFFSET, FakeEngine, FakeTokenizer
from ..helpers import make_settings, run_server

BOS_ID = 0  # the fake vocabulary's <|endoftext|>, standing for <bos>
PROMPT = "The Eiffel Tower is in"


class BosTokenizer(FakeTokenizer):
    """The fake tokenizer, putting <bos> first when asked for special tokens (as Gemma's does)."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return ([BOS_ID] if add_special_tokens else []) + super().encode(text)


@pytest.fixture(scope="module")
def srv():
    engine = FakeEngine()
    engine.tokenizer = BosTokenizer()
    with run_server(make_settings(), engine) as s:
        yield s


def _completion(srv, **extra) -> dict:
    body = {"model": "fake-model", "prompt": PROMPT, "max_tokens": 1, **extra}
    r = httpx.post(f"{srv.url}/v1/completions", json=body, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def test_text_prompt_gets_bos_by_default(srv):
    text = PROMPT.encode()
    default = _completion(srv)
    assert default["usage"]["prompt_tokens"] == len(text) + 1
    plain = _completion(srv, add_special_tokens=False)
    assert plain["usage"]["prompt_tokens"] == len(text)
    assert _completion(srv, add_special_tokens=True)["usage"]["prompt_tokens"] == len(text) + 1


def test_token_prompts_and_chat_get_no_bos(srv):
    ids = [b + OFFSET for b in PROMPT.encode()]
    r = httpx.post(f"{srv.url}/v1/completions", json={"prompt": ids, "max_tokens": 1}, timeout=30).json()
    assert r["usage"]["prompt_tokens"] == len(ids)  # token ids are sent as they are
    msgs = [{"role": "user", "content": "Hi"}]
    chat = httpx.post(f"{srv.url}/v1/chat/completions", json={"messages": msgs, "max_tokens": 1}, timeout=30).json()
    assert chat["usage"]["prompt_tokens"] == len(FakeTokenizer().apply_chat_template(msgs))
