"""Structured outputs: grammar specs (spec.py), the backend interface and its cache (backend.py), the
xgrammar backend (xgrammar_backend.py) and the logits masks (masks.py, torch).

Importing this package loads neither torch nor xgrammar; `make_compiler` imports the backend it builds.
"""

from __future__ import annotations

import logging
from typing import Any

from engine.config.engine_config import GRAMMAR_BACKENDS
from engine.structured.backend import (
    CachingCompiler,
    CompiledGrammar,
    CompilerStats,
    GrammarCompiler,
    GrammarMatcher,
)
from engine.structured.spec import (
    GRAMMAR_KINDS,
    GrammarDeadEnd,
    GrammarError,
    GrammarSpec,
    GrammarTimeout,
    GrammarTooLarge,
)

__all__ = [
    "GRAMMAR_BACKENDS",
    "GRAMMAR_KINDS",
    "CachingCompiler",
    "CompiledGrammar",
    "CompilerStats",
    "GrammarCompiler",
    "GrammarDeadEnd",
    "GrammarError",
    "GrammarMatcher",
    "GrammarSpec",
    "GrammarTimeout",
    "GrammarTooLarge",
    "make_compiler",
]

log = logging.getLogger("tokenmill.engine")


def make_compiler(backend: str, tokenizer: Any, vocab_size: int, stop_token_ids: frozenset[int],
                  cache_bytes: int = 256 << 20, processes: bool = False) -> GrammarCompiler | None:  # fmt: skip
    """The compiler of `backend` for this tokenizer, or None for "none" (structured outputs off) and
    when the library is missing (logged once here; such requests get a 400 naming the field).
    `cache_bytes`: its cache's byte bound; `processes`: compile in worker processes (budgeted)."""
    if backend == "none":
        return None
    if backend != "xgrammar":
        raise ValueError(f"grammar_backend must be one of {GRAMMAR_BACKENDS}, got {backend!r}")
    try:
        from engine.structured.xgrammar_backend import XGrammarCompiler
    except ImportError as exc:
        log.warning("structured outputs are off: xgrammar is not installed (%s)", exc)
        return None
    return XGrammarCompiler(tokenizer, vocab_size, stop_token_ids, max_bytes=cache_bytes, processes=processes)
