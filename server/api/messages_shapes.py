"""The Message object and its stream, as Anthropic's Messages API lays them out (server/api/messages.py).

A message's `content` is blocks: the text (a `text` block) and each tool call (a `tool_use` block:
`id`, `name`, `input`). Streamed: `message_start`, then per block `content_block_start`,
`content_block_delta`... (`text_delta`, or `input_json_delta` with the arguments' JSON text as it is
written), `content_block_stop`; then `message_delta` (stop_reason, stop_sequence, usage) and
`message_stop`. A failure after the stream began is an `error` event. `stop_reason`: end_turn,
max_tokens, stop_sequence (with the one that matched), tool_use; a deadline's `timeout` or an `abort`
passes as it is. Usage: `input_tokens` (those not read from the prefix cache),
`cache_read_input_tokens`, `output_tokens` (reasoning included, as Anthropic counts it). With a reasoning
parser the reasoning is a `thinking` block first (`thinking`, `signature`), streamed as `thinking_delta`s
and one `signature_delta` before its `content_block_stop`.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncGenerator
from typing import Any

from sse_starlette import ServerSentEvent

from server.api.respond import ChoiceEvents
from server.http import json_limits, sse
from server.http.errors import ANTHROPIC_TYPES
from server.prompt.codec import PromptCodec
from server.prompt.output_reader import OutputDelta, OutputReader
from server.prompt.reasoning import ReasoningPlan
from server.prompt.tool_parser import ToolCall, ToolParser
from server.prompt.tools import ToolPlan
from server.serving.handle import Completed, Handle
from server.serving.ticket import Finished, Ticket, Tokens

_TOKENS_PER_CHAR = 4  # a stop string's character spans at most this many tokens (byte-level pieces)


class MessageShape:
    """The Message object and its stream events, for one request. With tools, the text goes through the
    tool-call parser: content becomes a text block, each call a tool_use block after it."""

    def __init__(self, model: str, tools: ToolPlan, stops: list[str], codec: PromptCodec,
                 reasoning: ReasoningPlan | None = None) -> None:  # fmt: skip
        self.model = model
        self.id = f"msg_{uuid.uuid4().hex[:24]}"
        self.signature = uuid.uuid4().hex  # the thinking block's (opaque: nothing here verifies it)
        self._parser: ToolParser | None = tools.new_parser()
        self._reader = OutputReader(reasoning, self._parser)  # reasoning, then text and calls
        self._stops = stops
        self._codec = codec
        self._tail: list[int] = []  # the last output tokens, where a stop string would be (streamed)
        self._open: str | None = None  # the open block's type
        self._index = -1  # the open (or last) block's index
        self._texted = False  # a text block was opened

    # -- the two answers (server/api/respond.py Shape) ------------------------------------------------
    def body(self, handles: list[Handle], done: list[Completed]) -> dict[str, Any]:
        piece = self._reader.read_all(done[0].text, done[0].token_ids)
        text, calls = piece.content, self._reader.calls
        blocks = [self._thinking(piece.reasoning)] if piece.reasoning else []
        blocks += [{"type": "text", "text": text}] if text or not calls else []
        blocks += [_tool_use(c, json_input(c.arguments)) for c in calls]
        reason, sequence = self._stop(done[0].finished.reason, calls, done[0].token_ids)
        return self.message(done[0].ticket, blocks, reason, sequence)

    async def stream(self, handles: list[Handle], events: ChoiceEvents) -> AsyncGenerator[ServerSentEvent, None]:
        """message_start, each block's start, deltas and stop, message_delta, message_stop; `error` ends it."""
        ticket = handles[0].ticket
        yield self.event("message_start", message=self.message(ticket, [], None, None))
        async for _, event in events:
            if isinstance(event, Tokens):
                self._tail = (self._tail + event.output.new_token_ids)[-self._tail_tokens() :]
                pieces = self._reader.feed(event.output.text_delta)
                for e in self._deltas(pieces):
                    yield e
            elif event.error is not None:
                kind = ANTHROPIC_TYPES.get(event.error.status, "api_error")
                yield self.event("error", error={"type": kind, "message": event.error.message})
                return
            else:
                for e in self._end(ticket, event):
                    yield e

    def _end(self, ticket: Ticket, finished: Finished) -> list[ServerSentEvent]:
        out = self._deltas(self._reader.finish())
        calls = self._reader.calls
        if not self._texted and not calls:  # no text at all: one empty text block, as the JSON answer has
            out += self._start("text", {"type": "text", "text": ""})
        out += self._stop_block()
        reason, sequence = self._stop(finished.reason, calls, self._tail)
        usage = self.usage(ticket)
        out.append(self.event("message_delta", delta={"stop_reason": reason, "stop_sequence": sequence},
                              usage=usage))  # fmt: skip
        out.append(self.event("message_stop"))
        return out

    def _deltas(self, piece: OutputDelta) -> list[ServerSentEvent]:
        out = []
        if piece.reasoning:
            if self._open != "thinking":
                out += self._start("thinking", {"type": "thinking", "thinking": "", "signature": ""})
            out.append(self.event("content_block_delta", index=self._index,
                                  delta={"type": "thinking_delta", "thinking": piece.reasoning}))  # fmt: skip
        pieces = piece.parsed()
        if pieces.content:
            self._texted = True
            if self._open != "text":
                out += self._start("text", {"type": "text", "text": ""})
            out.append(self.event("content_block_delta", index=self._index,
                                  delta={"type": "text_delta", "text": pieces.content}))  # fmt: skip
        for c in pieces.calls:
            if c.id is not None:
                out += self._start("tool_use", _tool_use(ToolCall(c.id, c.name or "", ""), {}))
            if c.arguments:
                out.append(self.event("content_block_delta", index=self._index,
                                      delta={"type": "input_json_delta", "partial_json": c.arguments}))  # fmt: skip
        return out

    def _start(self, kind: str, block: dict[str, Any]) -> list[ServerSentEvent]:
        out = self._stop_block()
        self._open, self._index = kind, self._index + 1
        return [*out, self.event("content_block_start", index=self._index, content_block=block)]

    def _stop_block(self) -> list[ServerSentEvent]:
        if self._open is None:
            return []
        out = []
        if self._open == "thinking":  # Anthropic's: the signature closes a thinking block
            out.append(self.event("content_block_delta", index=self._index,
                                  delta={"type": "signature_delta", "signature": self.signature}))  # fmt: skip
        self._open = None
        return [*out, self.event("content_block_stop", index=self._index)]

    def _thinking(self, text: str) -> dict[str, Any]:
        return {"type": "thinking", "thinking": text, "signature": self.signature}

    def _tail_tokens(self) -> int:
        return _TOKENS_PER_CHAR * max((len(s) for s in self._stops), default=0) + 1

    def _stop(self, reason: str, calls: list[ToolCall], token_ids: list[int]) -> tuple[str, str | None]:
        """(stop_reason, stop_sequence) of the engine's finish reason. The engine cuts a stop string from
        the text, not from the tokens: the last tokens, decoded, hold the one that matched."""
        if reason == "length":
            return "max_tokens", None
        if reason != "stop":
            return reason, None
        if calls:
            return "tool_use", None
        if self._stops and token_ids:
            tail = self._codec.decode(token_ids[-self._tail_tokens() :])
            found = [(tail.find(s), s) for s in self._stops if s in tail]
            if found:
                return "stop_sequence", min(found)[1]
        return "end_turn", None

    def message(self, ticket: Ticket, content: list[dict[str, Any]], reason: str | None,
                sequence: str | None) -> dict[str, Any]:  # fmt: skip
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": content,
                "stop_reason": reason, "stop_sequence": sequence, "usage": self.usage(ticket)}  # fmt: skip

    @staticmethod
    def usage(ticket: Ticket) -> dict[str, int]:
        prompt = len(ticket.prompt_token_ids)
        cached = min(ticket.cached_tokens, prompt)
        return {"input_tokens": prompt - cached, "cache_creation_input_tokens": 0,
                "cache_read_input_tokens": cached, "output_tokens": ticket.completion_tokens}  # fmt: skip

    @staticmethod
    def event(kind: str, **data: Any) -> ServerSentEvent:
        payload = {"type": kind, **data}
        return sse.event(json.dumps(payload, separators=(",", ":"), ensure_ascii=False), kind)


def _tool_use(call: ToolCall, given: dict[str, Any]) -> dict[str, Any]:
    """A tool_use block; its id is the call's (Anthropic spells them toolu_...)."""
    return {"type": "tool_use", "id": "toolu_" + call.id.removeprefix("call_"), "name": call.name, "input": given}


def json_input(arguments: str) -> dict[str, Any]:
    """A call's arguments (JSON text) as the tool_use block's `input` object; {} when they are not one."""
    try:
        value = json_limits.loads(arguments, "input")
    except Exception:  # not JSON, or too deep: the model's text, not the client's
        return {}
    return value if isinstance(value, dict) else {}
