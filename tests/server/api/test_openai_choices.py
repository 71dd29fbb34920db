"""Completions extras through the official `openai` client against a real server (tiny model): n samples
(distinct, seeded, the prompt's KV shared through the prefix cache), echo with prompt logprobs and
max_tokens 0 (equal to transformers' within 1e-4, float32), lists of prompts (one choice each, index
right, streaming too), logit_bias, and chat n."""

from __future__ import annotations

import math

import httpx
import pytest
import torch

from ..helpers import metric

PROMPT = "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n" * 2
PROMPTS = ["import os\n", "class Foo:\n", "print('hello')\n"]
MODEL = "tiny-llama"
TOL = 1e-4


@pytest.fixture(scope="module")
def hf(tiny_model_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(tiny_model_path)


def hf_prompt_logprobs(hf, text: str) -> tuple[list[int], torch.Tensor]:
    model, tok = hf
    ids = tok.encode(text, add_special_tokens=False)
    with torch.no_grad():
        return ids, torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)


def test_n_gives_distinct_seeded_samples_sharing_the_prompt(client, srv):
    before = metric(httpx.get(f"{srv.url}/metrics").text, "tokenmill_prefix_cache_hits_total")
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=1.0, seed=123, n=3,
              extra_body={"ignore_eos": True})  # fmt: skip
    r = client.completions.create(**kw)
    assert [c.index for c in r.choices] == [0, 1, 2]
    texts = [c.text for c in r.choices]
    assert len(set(texts)) == 3  # independent samples
    assert r.usage.completion_tokens == 36
    assert r.usage.prompt_tokens == client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1).usage.prompt_tokens
    assert [c.text for c in client.completions.create(**kw).choices] == texts  # seeded: reproducible
    # Sample j is the single request seeded seed + j.
    single = client.completions.create(**{**kw, "n": 1, "seed": 124})
    assert single.choices[0].text == texts[1]
    hits = metric(httpx.get(f"{srv.url}/metrics").text, "tokenmill_prefix_cache_hits_total") - before
    block = srv.runtime.primary.worker.stats.block_size
    assert hits >= 2 * (r.usage.prompt_tokens // block) * block > 0  # samples 1 and 2 found the prompt cached


def test_n_streams_every_choice(client):
    stream = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=1.0, seed=5, n=2,
                                       stream=True, stream_options={"include_usage": True},
                                       extra_body={"ignore_eos": True})  # fmt: skip
    texts, reasons = {0: "", 1: ""}, {}
    chunks = list(stream)
    for c in chunks:
        for choice in c.choices:
            texts[choice.index] += choice.text
            if choice.finish_reason:
                reasons[choice.index] = choice.finish_reason
    assert reasons == {0: "length", 1: "length"}
    full = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=1.0, seed=5, n=2,
                                     extra_body={"ignore_eos": True})  # fmt: skip
    assert [texts[0], texts[1]] == [c.text for c in full.choices]
    assert chunks[-1].usage.completion_tokens == 12


def test_echo_logprobs_max_tokens_0_match_transformers(client, hf):
    r = client.completions.create(model=MODEL, prompt=PROMPT, echo=True, logprobs=2, max_tokens=0)
    ids, ref = hf_prompt_logprobs(hf, PROMPT)
    choice = r.choices[0]
    assert choice.text == PROMPT and choice.finish_reason == "length"
    assert r.usage.completion_tokens == 0 and r.usage.prompt_tokens == len(ids)
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(ids)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for i in range(1, len(ids)):
        assert abs(lp.token_logprobs[i] - float(ref[i - 1][ids[i]])) < TOL
        assert len(lp.top_logprobs[i]) == 2
        assert max(lp.top_logprobs[i].values()) == pytest.approx(float(ref[i - 1].max()), abs=TOL)
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)


def test_echo_then_generate_lists_prompt_then_completion(client):
    gen = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0, logprobs=1,
                                    extra_body={"ignore_eos": True})  # fmt: skip
    echo = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0, logprobs=1,
                                     echo=True, extra_body={"ignore_eos": True})  # fmt: skip
    c = echo.choices[0]
    assert c.text == PROMPT + gen.choices[0].text
    n_prompt = echo.usage.prompt_tokens
    assert len(c.logprobs.tokens) == n_prompt + 5
    assert c.logprobs.token_logprobs[n_prompt:] == pytest.approx(gen.choices[0].logprobs.token_logprobs, abs=1e-5)
    plain = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=0, echo=True)
    assert plain.choices[0].text == PROMPT and plain.choices[0].logprobs is None
    stream = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0, echo=True,
                                            stream=True, extra_body={"ignore_eos": True}))  # fmt: skip
    assert "".join(ch.choices[0].text for ch in stream if ch.choices) == c.text


def test_prompt_lists_one_choice_each(client, hf):
    r = client.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=4, temperature=0,
                                  extra_body={"ignore_eos": True})  # fmt: skip
    assert [c.index for c in r.choices] == [0, 1, 2]
    for c, p in zip(r.choices, PROMPTS, strict=True):
        alone = client.completions.create(model=MODEL, prompt=p, max_tokens=4, temperature=0,
                                          extra_body={"ignore_eos": True})  # fmt: skip
        assert c.text == alone.choices[0].text
    assert r.usage.completion_tokens == 12
    _, tok = hf
    assert r.usage.prompt_tokens == sum(len(tok.encode(p, add_special_tokens=False)) for p in PROMPTS)
    # Token-id prompts, with n: index = prompt x n + sample.
    ids = [tok.encode(p, add_special_tokens=False) for p in PROMPTS[:2]]
    both = client.completions.create(model=MODEL, prompt=ids, max_tokens=3, n=2, temperature=0.8, seed=1,
                                     extra_body={"ignore_eos": True})  # fmt: skip
    assert [c.index for c in both.choices] == [0, 1, 2, 3]
    first = client.completions.create(model=MODEL, prompt=ids[1], max_tokens=3, temperature=0.8, seed=2,
                                      extra_body={"ignore_eos": True})  # fmt: skip
    assert both.choices[3].text == first.choices[0].text  # prompt 1, sample 1: seed + 1


def test_prompt_lists_stream_with_indexes(client):
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=4, temperature=0, stream=True,
                                            extra_body={"ignore_eos": True}))  # fmt: skip
    texts: dict[int, str] = {}
    for c in chunks:
        for choice in c.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
    full = client.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=4, temperature=0,
                                     extra_body={"ignore_eos": True})  # fmt: skip
    assert [texts[i] for i in range(3)] == [c.text for c in full.choices]


def test_logit_bias_forces_and_bans(client, hf):
    _, tok = hf
    forced = tok.encode(" the", add_special_tokens=False)[-1]
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0, logprobs=0,
                                  logit_bias={str(forced): 100}, extra_body={"ignore_eos": True})  # fmt: skip
    assert r.choices[0].logprobs.tokens == [tok.decode([forced])] * 3
    greedy = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, temperature=0, logprobs=0)
    top = tok.encode(greedy.choices[0].logprobs.tokens[0], add_special_tokens=False)[0]
    banned = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, temperature=0, logprobs=0,
                                       logit_bias={str(top): -100})  # fmt: skip
    assert banned.choices[0].text != greedy.choices[0].text
    assert math.isfinite(banned.choices[0].logprobs.token_logprobs[0])


def test_truncate_prompt_tokens_and_add_special_tokens(client, hf):
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, echo=True,
                                  extra_body={"truncate_prompt_tokens": 3})  # fmt: skip
    _, tok = hf
    ids = tok.encode(PROMPT, add_special_tokens=False)
    assert r.usage.prompt_tokens == 3 and r.choices[0].text.startswith(tok.decode(ids[-3:]))
    with_specials = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1,
                                              extra_body={"add_special_tokens": True})  # fmt: skip
    assert with_specials.usage.prompt_tokens == len(tok.encode(PROMPT, add_special_tokens=True))


def test_chat_n(client):
    msgs = [{"role": "user", "content": "Say something."}]
    r = client.chat.completions.create(model=MODEL, messages=msgs, n=3, max_tokens=8, temperature=1.0, seed=3,
                                       extra_body={"ignore_eos": True})  # fmt: skip
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert len({c.message.content for c in r.choices}) == 3
    chunks = list(client.chat.completions.create(model=MODEL, messages=msgs, n=3, max_tokens=8, temperature=1.0,
                                                 seed=3, stream=True, extra_body={"ignore_eos": True}))  # fmt: skip
    streamed: dict[int, str] = {}
    for c in chunks:
        for choice in c.choices:
            streamed[choice.index] = streamed.get(choice.index, "") + (choice.delta.content or "")
    assert [streamed[i] for i in range(3)] == [c.message.content for c in r.choices]
