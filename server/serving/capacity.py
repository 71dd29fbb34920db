"""How much one request may take: the model's context (or the KV cache when that holds fewer tokens), and
the engine's seats."""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger("tokenmill.server")


def usable_context(engine: Any) -> int:
    """min(max_model_len, KV cache tokens). A KV cache smaller than the context is a start-up warning:
    prompt + max_tokens is then checked against it, and chat's default max_tokens is clamped to it."""
    context = int(engine.max_model_len)
    block_size = getattr(engine, "block_size", None)
    if not isinstance(block_size, int):
        return context  # an engine that does not say how its cache is cut: trust its context
    kv_tokens = engine.stats().kv_blocks_total * block_size
    if kv_tokens >= context:
        return context
    log.warning("the KV cache holds %d tokens, less than the context (max_model_len %d): requests are "
                "limited to %d tokens (prompt + max_tokens); raise kv_cache_memory or lower max_model_len",
                kv_tokens, context, kv_tokens)  # fmt: skip
    return kv_tokens


def engine_seats(engine: Any, configured: int) -> int:
    """Requests the engine runs at once (its max_num_seqs); `configured` (the settings') for an engine
    that does not say."""
    scheduler = getattr(engine, "scheduler", None)  # the engine core's; its config is fixed
    seats = getattr(getattr(scheduler, "config", None), "max_num_seqs", None)
    return seats if isinstance(seats, int) and seats > 0 else configured
