"""The other Llama-like families (OLMo 2, Granite 3, SmolLM3, Phi-3, Gemma 2, Gemma 3), the
mixture-of-experts ones (Qwen3-MoE, Qwen2-MoE, OLMoE, Mixtral) and the hybrids LFM2, Qwen3.5 and Granite 4
served over HTTP: /generate's greedy tokens, several requests at once (batched in the engine), equal to
transformers' generate in float32."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch

from ..helpers import build_real_engine, make_settings, run_server

PRESETS = ["tiny-olmo2", "tiny-granite", "tiny-smollm3", "tiny-phi3", "tiny-gemma2", "tiny-gemma3",
           "tiny-qwen3-moe", "tiny-qwen2-moe", "tiny-olmoe", "tiny-mixtral",  # mixtures of experts
           "tiny-lfm2",  # hybrid: short convolutions with a state per sequence (engine/state/)
           "tiny-qwen35",  # hybrid: Gated DeltaNet (conv window + recurrent matrix per sequence) and gated attention
           "tiny-granite4", "tiny-granite4-dense"]  # hybrid: Mamba2 with a conv and SSM state per sequence
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


def assert_served_greedy_matches_transformers(preset: str, prompts: list[str], served: str | None = None) -> None:
    """Serve `preset` (or `served`, a file made from it: a GGUF file), send `prompts` to /generate at once
    (batched in the engine): the greedy tokens equal transformers' generate on the preset in float32."""
    from engine.testing.make_model import ensure_model

    path = str(ensure_model(preset))
    want = _transformers_greedy(path, prompts)
    with run_server(make_settings(), build_real_engine(served or path)) as srv:
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


@pytest.mark.parametrize("preset", ["tiny-qwen2-moe", "tiny-mixtral"])
def test_moe_gguf_served_greedy_matches_transformers(preset, tmp_path):
    """A mixture-of-experts GGUF file (F32; qwen2moe with its shared expert, Mixtral as llama with
    experts) served over HTTP: its own tokenizer and weights give transformers' tokens on the folder."""
    from engine.testing.make_gguf import write_gguf
    from engine.testing.make_model import ensure_model

    gguf = write_gguf(ensure_model(preset), tmp_path / f"{preset}.gguf", "F32")
    assert_served_greedy_matches_transformers(preset, PROMPTS, served=str(gguf))
