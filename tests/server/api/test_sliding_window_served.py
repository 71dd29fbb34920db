"""Sliding-window models (Mistral with its window on every layer, Qwen2 with it on some layers) served over
HTTP: prompts far longer than the window are accepted (the context is no longer capped to it) and
/generate's greedy tokens, several requests at once, equal transformers' generate in float32."""

from __future__ import annotations

import pytest

from .test_model_families import assert_served_greedy_matches_transformers

# windows of 12 and 16 tokens (engine/testing/make_model.py): every prompt and its answer run past them
PROMPTS = [
    "def fibonacci(n):",
    "import os\nimport sys\n" * 8,
    "class Foo:\n    def __init__(self):\n        self.x = 1\n        self.y = 2\n" * 4,
    "print('hello')",
]


@pytest.mark.parametrize("preset", ["tiny-mistral-swa", "tiny-qwen2-swa"])
def test_sliding_window_model_served_greedy_matches_transformers(preset):
    assert_served_greedy_matches_transformers(preset, PROMPTS)
