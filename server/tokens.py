"""Prompt tokenization on the server side, on a private copy of the engine's tokenizer: the engine
itself belongs to the worker thread. Uses the engine's own tokenization functions
(engine/tokenization.py), so both sides agree. Calls run on one dedicated thread so long prompts
never stall the loop.
"""

from __future__ import annotations

import asyncio
import copy
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from engine.tokenization import chat_prompt_ids, encode_prompt


class PromptCodec:
    """Text <-> token ids for requests. `encode`/`chat` are awaited; `token_text` is cheap and sync."""

    def __init__(self, tokenizer: Any) -> None:
        self._tok = copy.deepcopy(tokenizer)  # the tokenize thread's; never shared with the engine's
        self._loop_tok = copy.deepcopy(tokenizer)  # the event loop's, for token_text
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenmill-tokenize")

    async def encode(self, text: str) -> list[int]:
        return await asyncio.get_running_loop().run_in_executor(self._pool, self.encode_sync, text)

    async def chat(self, messages: list[dict[str, Any]]) -> list[int]:
        return await asyncio.get_running_loop().run_in_executor(self._pool, self.chat_sync, messages)

    def encode_sync(self, text: str) -> list[int]:
        return encode_prompt(self._tok, text)

    def chat_sync(self, messages: list[dict[str, Any]]) -> list[int]:
        return chat_prompt_ids(self._tok, messages)

    def token_text(self, token_id: int) -> str:
        return self._loop_tok.decode([token_id])

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
