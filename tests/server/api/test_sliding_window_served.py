"""Sliding-window models (Mistral with its window on every layer, Qwen2 with it on some layers) served over
HTTP: prompts far longer than the window are accepted (the context is no longer capped to it) and
/generate's greedy tokens, several requests at once, equal transformers' generate in float32."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from ..helpers import build_real_engine, make_settings, run_server
from .test_model_families import N, _transformers_greedy

# windows of 12 and 16 tokens (engine/testing/make_model.py): every prompt and its answer run past them
PROMPTS = [
    "def fibonacci(n):",
    "import os\nimport sys\n" * 8,
    "class Foo:\n    def __init__(self):\n        self.x = 1\n        self.y = 2\n" * 4,
    "print('hello')",
]


@pytest.mark.parametrize("preset", ["tiny-mistral-swa", "tiny-qwen2-swa"])
def test_sliding_window_model_served_greedy_matches_transformers(preset):
    from engine.testing.make_model import ensure_model

    path = str(ensure_model(preset))
    want = _transformers_greedy(path, PROMPTS)
    with run_server(make_settings(), build_real_engine(path)) as srv:
        def generate(text: str) -> list[int]:
            body = {"prompt": text, "max_tokens": N, "ignore_eos": True, "temperature": 0.0, "stream": False}
            r = httpx.post(f"{srv.url}/generate", json=body, timeout=120)
            assert r.status_code == 200, r.text
            return r.json()["token_ids"]

        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            got = list(pool.map(generate, PROMPTS))
    assert got == want
