"""The real Gemma 3 270M base file (Q4_K_M GGUF: Q5_0, Q4_K, Q6_K, Q8_0 and F32 tensors) over HTTP:
greedy tokens equal to transformers' on the same dequantized weights (its own GGUF load, float32) for the
first tokens of a few prompts, and a continuation that knows Paris."""

from __future__ import annotations

import httpx
import pytest
import torch

from ..helpers import build_real_engine, make_settings, run_server
from ..real_model import require_gemma3_270m

NAME = "gemma-3-270m"
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, there was a", "1, 2, 3, 4,"]
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def model_file():
    return require_gemma3_270m()


@pytest.fixture(scope="module")
def srv(model_file):
    engine = build_real_engine(str(model_file), kv_cache_memory=64 << 20, max_model_len=512)
    assert engine.dtype == torch.float32
    # start-up builds per-token tables over the 262,144-token vocabulary: minutes on a busy 2-core machine
    with run_server(make_settings(served_model_name=NAME, max_model_len=512), engine, startup_s=900) as s:
        yield s


def test_greedy_equals_transformers_on_the_same_weights(srv, model_file):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_file.parent), gguf_file=model_file.name)
    hf = AutoModelForCausalLM.from_pretrained(str(model_file.parent), gguf_file=model_file.name,
                                              dtype=torch.float32).eval()  # fmt: skip
    assert type(hf).__name__ == "Gemma3ForCausalLM"
    mismatched = []
    for prompt in PROMPTS:
        ids = tok.encode(prompt)  # <bos> first: the file says add_bos_token
        assert ids[0] == tok.bos_token_id
        with torch.no_grad():
            out = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                              max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=tok.pad_token_id)
        want = out[0, len(ids):].tolist()
        body = {"prompt_token_ids": ids, "max_tokens": NEW_TOKENS, "temperature": 0, "stream": False}
        r = httpx.post(f"{srv.url}/generate", json=body, timeout=300)
        assert r.status_code == 200, r.text
        if r.json()["token_ids"] != want:
            mismatched.append((prompt, r.json()["token_ids"], want))
    assert mismatched == []


def test_completion_knows_paris(srv):
    # <bos> first, which Gemma needs: a text prompt gets the tokenizer's special tokens by default (vLLM's
    # add_special_tokens, default true)
    body = {"model": NAME, "prompt": "The Eiffel Tower is located in the city of", "max_tokens": 12, "temperature": 0}
    r = httpx.post(f"{srv.url}/v1/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    assert "Paris" in r.json()["choices"][0]["text"]
