"""The other Llama-like families (OLMo 2, Granite 3, SmolLM3, Phi-3, Gemma 2, Gemma 3) and the
mixture-of-experts ones (Qwen3-MoE, Qwen2-MoE, OLMoE, Mixtral) served over HTTP: /generate's greedy
tokens, several requests at once (batched in the engine), equal to transformers' generate in float32."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch

from ..helpers import build_real_engine, make_settings, run_server

PRESETS = ["tiny-olmo2", "tiny-granite", "tiny-smollm3", "tiny-phi3", "tiny-gemma2", "tiny-gemma3",
           "tiny-qwen3-moe", "tiny-qwen2-moe", "tiny-olmoe", "tiny-mixtral"]  # the last four: mixtures of experts
PROMPTS = ["def fibonacci(n):", "import os\nimport sys\n", "class Foo:\n    def __init__(self):", "print('hello')"]
N = 16


def _transformers_greedy(path: str, prompts: list[str]) -> list[list[int]]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(path)
    out = []
    with torch.no_grad():
        for text in prompts:
            ids = torch.tensor([tok.encode(text, add_special_tokens=False)])
            seq = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=N, min_new_tokens=N,
                                 do_sample=False, pad_token_id=model.config.eos_token_id)  # fmt: skip
            out.append(seq[0, ids.shape[1] :].tolist())
    return out


def assert_served_greedy_matches_transformers(preset: str, prompts: list[str]) -> None:
    """Serve `preset`, send `prompts` to /generate at once (batched in the engine): the greedy tokens
    equal transformers' generate in float32."""
    from engine.testing.make_model import ensure_model

    path = str(ensure_model(preset))
    want = _transformers_greedy(path, prompts)
    with run_server(make_settings(), build_real_engine(path)) as srv:
        def generate(text: str) -> list[int]:
            body = {"prompt": text, "max_tokens": N, "ignore_eos": True, "temperature": 0.0, "stream": False}
            r = httpx.post(f"{srv.url}/generate", json=body, timeout=120)
            assert r.status_code == 200, r.text
            return r.json()["token_ids"]

        with ThreadPoolExecutor(len(prompts)) as pool:
            got = list(pool.map(generate, prompts))
    assert got == want


@pytest.mark.parametrize("preset", PRESETS)
def test_family_served_greedy_matches_transformers(preset):
    assert_served_greedy_matches_transformers(preset, PROMPTS)
