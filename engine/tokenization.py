"""Prompt tokenization shared by the engine and the server (which runs it on its own tokenizer copy)."""

from __future__ import annotations

from typing import Any


def encode_prompt(tokenizer: Any, text: str) -> list[int]:
    """Token ids of a text prompt; no special tokens added (chat templates add their own)."""
    return list(tokenizer.encode(text, add_special_tokens=False))


def chat_prompt_ids(tokenizer: Any, messages: list[dict[str, Any]]) -> list[int]:
    """Token ids of messages rendered by the tokenizer's chat template, ready for the assistant turn."""
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if hasattr(ids, "keys"):  # transformers v5 returns a BatchEncoding
        ids = ids["input_ids"]
    return list(ids)
