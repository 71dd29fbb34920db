"""Prompt tokenization on the server side, on private copies of the engine's tokenizer: the engine
itself belongs to the worker thread. Uses the engine's own tokenization functions
(engine/text/tokenization.py), so both sides agree.

Two tokenize threads, each with its own tokenizer copy (a copy is not safe to share across threads):
prompts up to LARGE_PROMPT_CHARS go to one, longer ones to the other, so a small request never waits
behind a huge one. The small-prompt thread also builds, once, the text of every token id (`token_texts`,
one batch decode): log-probabilities name thousands of tokens per answer (echo with prompt logprobs: a
prompt's tokens x top-N), looked up there instead of decoded one by one. Before any of that, a prompt whose byte length alone proves it cannot fit the
context is refused (`check_prompt_bytes`): its tokenization would only end in a 400.
"""

from __future__ import annotations

import asyncio
import copy
import functools
import math
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from engine.text.tokenization import chat_prompt_ids, encode_prompt, max_bytes_per_token, message_texts
from server.http.errors import ApiError

LARGE_PROMPT_CHARS = 16384  # prompts longer than this tokenize on the large-prompt thread
STRING, PARTS = "string", "openai"  # the two content formats of chat templates (vLLM's names for them)
_PROBE_TEXT = "\ue000tokenmill-probe\ue001"


class _TokenizeThread:
    """One thread and the tokenizer copy only it uses."""

    def __init__(self, tokenizer: Any, name: str) -> None:
        self.tok = copy.deepcopy(tokenizer)
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)


class PromptCodec:
    """Text <-> token ids for requests. `encode`/`chat` are awaited; `token_text` is cheap and sync.
    `chat_template`: the server's --chat-template (None: the tokenizer's own)."""

    def __init__(self, tokenizer: Any, chat_template: str | None = None) -> None:
        self._small = _TokenizeThread(tokenizer, "tokenmill-tokenize")
        self._large = _TokenizeThread(tokenizer, "tokenmill-tokenize-large")
        self._loop_tok = copy.deepcopy(tokenizer)  # the event loop's, for token_text
        self.tokenizer = self._loop_tok  # read-only uses on the event loop (decode, /tokenizer_info)
        # Most bytes one token can stand for (None: no bound holds for this tokenizer).
        self.max_bytes_per_token = max_bytes_per_token(tokenizer)
        self._template = {"chat_template": chat_template} if chat_template is not None else {}
        # The template that renders chats: the server's, else the tokenizer's own (None: no chat)
        self.chat_template: str | None = chat_template or getattr(tokenizer, "chat_template", None)
        # Whether the chat template renders text parts or takes strings only (`probe_content_format`)
        self.content_format = probe_content_format(self._loop_tok, self._template)
        # The text of each token id, built on the small-prompt thread (off the loop, once per tokenizer)
        self._texts: Future[list[str]] = self._small.pool.submit(token_text_table, self._small.tok)

    def min_tokens(self, text_bytes: int) -> int:
        """A lower bound on the tokens of `text_bytes` bytes of text (0 when no bound is known)."""
        if not self.max_bytes_per_token:
            return 0
        return math.ceil(text_bytes / self.max_bytes_per_token)

    async def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`; prompts add no special tokens (templates add their own), /tokenize may."""
        return await self._run(len(text), _encode_with_specials if add_special_tokens else encode_prompt, text)

    async def chat(self, messages: list[dict[str, Any]], render: dict[str, Any] | None = None,
                   tools: list[dict[str, Any]] | None = None) -> list[int]:  # fmt: skip
        """`render`: apply_chat_template's options (server/prompt/chat.py render_options); `tools`: for the
        chat template's `tools` argument (server/prompt/tools.py), when it renders them (only then passed)."""
        options = {**(render or {}), **({"tools": tools} if tools else {}), **self._template}
        fn = functools.partial(chat_prompt_ids, **options)
        return await self._run(_chars(messages), fn, messages)

    async def _run(self, chars: int, fn, arg) -> list[int]:
        lane = self._large if chars > LARGE_PROMPT_CHARS else self._small
        return await asyncio.get_running_loop().run_in_executor(lane.pool, fn, lane.tok, arg)

    def encode_sync(self, text: str) -> list[int]:
        """encode() on the calling thread (tests, tools): only while no request tokenizes."""
        return encode_prompt(self._small.tok, text)

    def chat_sync(self, messages: list[dict[str, Any]], render: dict[str, Any] | None = None) -> list[int]:
        return chat_prompt_ids(self._small.tok, messages, **{**(render or {}), **self._template})

    def token_text(self, token_id: int) -> str:
        """The text of one token id: from the table once it is built (else one decode, on this thread)."""
        table = self.text_table()
        if table is not None and 0 <= token_id < len(table):
            return table[token_id]
        return self._loop_tok.decode([token_id])

    def text_table(self) -> list[str] | None:
        """The text of every token id (index = id), or None while it is being built (or failed to build, or
        the codec closed first); ids past its end (none for a tokenizer that reports its size) need
        token_text."""
        if not self._texts.done() or self._texts.cancelled() or self._texts.exception() is not None:
            return None
        return self._texts.result()

    def token_texts(self) -> list[str]:
        """text_table(), waiting for it if it is still being built: call it off the event loop."""
        return self._texts.result()

    def decode(self, token_ids: list[int]) -> str:
        """Text of token ids, special tokens kept (cheap enough for the event loop: no model work)."""
        return self._loop_tok.decode(list(token_ids))

    def close(self) -> None:
        for lane in (self._small, self._large):
            lane.pool.shutdown(wait=False, cancel_futures=True)


def check_prompt_bytes(codec: PromptCodec, texts: list[str], max_tokens: int, max_model_len: int, param: str,
                       max_tokens_field: str = "max_tokens") -> None:  # fmt: skip
    """Raise ApiError 400 when `texts` are too many bytes to fit the context with `max_tokens`, before
    anything tokenizes them. Prompts up to LARGE_PROMPT_CHARS are left to the exact check after
    tokenization (cheap for them, and its message counts tokens). `param`: the prompt's field;
    `max_tokens_field`: the body's name for max_tokens (max_output_tokens on /v1/responses)."""
    if sum(len(t) for t in texts) <= LARGE_PROMPT_CHARS:
        return
    nbytes = text_bytes(texts)
    least = codec.min_tokens(nbytes)
    if least + max_tokens > max_model_len:
        param = param if least >= max_model_len else max_tokens_field
        raise ApiError(
            400, "invalid_request",
            f"prompt ({nbytes} bytes: at least {least} tokens, as no token is longer than "
            f"{codec.max_bytes_per_token} bytes) + {max_tokens_field} ({max_tokens}) exceeds the context length "
            f"max_model_len ({max_model_len})", param=param,
        )  # fmt: skip


def token_text_table(tokenizer: Any) -> list[str]:
    """decode([i]) for every token id i of `tokenizer`, in one batch decode when it has one (a fast
    tokenizer decodes the whole vocabulary in milliseconds)."""
    ids = [[i] for i in range(len(tokenizer))]
    batch = getattr(tokenizer, "batch_decode", None)
    return list(batch(ids)) if batch is not None else [tokenizer.decode(i) for i in ids]


def _encode_with_specials(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=True))


def text_bytes(texts: list[str]) -> int:
    """UTF-8 bytes of `texts` (surrogates count as the 3 bytes they are replaced by)."""
    return sum(len(t.encode("utf-8", "surrogatepass")) for t in texts)


def _chars(messages: list[dict[str, Any]]) -> int:
    return sum(len(t) for t in message_texts(messages))


def probe_content_format(tokenizer: Any, render: dict[str, Any]) -> str:
    """PARTS when the chat template renders a text part exactly as the same text given as a string;
    STRING when it does not, or fails on parts."""
    def rendered(content: Any) -> str | None:
        try:
            return tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                                 **{"add_generation_prompt": True, **render})  # fmt: skip
        except Exception:
            return None

    as_parts = rendered([{"type": "text", "text": _PROBE_TEXT}])
    return PARTS if as_parts is not None and as_parts == rendered(_PROBE_TEXT) else STRING
