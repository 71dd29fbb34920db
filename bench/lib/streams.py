"""Server-sent events: an incremental decoder, and what one event of each of our two stream formats
means to a load client (plain Python, no I/O).

  /generate        `event: token` per token, then `event: done` (usage, finish_reason) or `event: error`
  /v1/completions  `data: {chunk}` per engine step, a usage chunk (stream_options.include_usage),
                   then `data: [DONE]`; `{"error": ...}` in place of a chunk on failure
"""

from __future__ import annotations

import json
from dataclasses import dataclass


@dataclass(frozen=True)
class SseEvent:
    event: str  # the `event:` field; "message" when absent
    data: str  # the `data:` lines joined with "\n"


class SseDecoder:
    """Turns a byte stream, fed in arbitrary pieces, into events (the WHATWG event-stream rules for the
    `event` and `data` fields; comments and other fields are skipped)."""

    def __init__(self) -> None:
        self._buf = ""
        self._bytes = b""
        self._event = ""
        self._data: list[str] = []

    def feed(self, chunk: bytes) -> list[SseEvent]:
        """Decode `chunk`; returns the events it completed (a blank line ends an event)."""
        self._bytes += chunk
        try:  # a multi-byte character may be split between chunks
            text, self._bytes = self._bytes.decode("utf-8"), b""
        except UnicodeDecodeError as exc:
            text, self._bytes = self._bytes[: exc.start].decode("utf-8"), self._bytes[exc.start :]
        self._buf += text
        events = []
        while True:
            line, sep = self._next_line()
            if sep is None:
                return events
            event = self._line(line)
            if event is not None:
                events.append(event)

    def _next_line(self) -> tuple[str, str | None]:
        for i, ch in enumerate(self._buf):
            if ch == "\n" or ch == "\r":
                if ch == "\r" and i + 1 == len(self._buf):
                    return "", None  # wait: this "\r" may be the start of "\r\n"
                width = 2 if self._buf[i : i + 2] == "\r\n" else 1
                line, self._buf = self._buf[:i], self._buf[i + width :]
                return line, ch
        return "", None

    def _line(self, line: str) -> SseEvent | None:
        if line == "":
            if not self._data and not self._event:
                return None
            event = SseEvent(self._event or "message", "\n".join(self._data))
            self._event, self._data = "", []
            return event
        if line.startswith(":"):
            return None
        name, _, value = line.partition(":")
        value = value[1:] if value.startswith(" ") else value
        if name == "event":
            self._event = value
        elif name == "data":
            self._data.append(value)
        return None


@dataclass(frozen=True)
class StreamUpdate:
    """What one event says about the request."""

    tokens: int = 0  # token events it carries (0 or 1)
    finished: bool = False  # the stream says the request ended
    finish_reason: str | None = None
    output_tokens: int | None = None  # the server's count (usage), when it gives one
    prompt_tokens: int | None = None
    cached_tokens: int | None = None  # prompt tokens the server's prefix cache served
    error: str | None = None  # the stream reported a failure
    queue_s: float | None = None  # the server's queue wait (arrival to first schedule), /generate only
    preemptions: int | None = None  # times the server's engine preempted the request, /generate only
    queue_steps: int | None = None  # the server's queue wait in engine steps (idle: 1), /generate only


def parse_generate_event(event: SseEvent) -> StreamUpdate:
    """One event of a `/generate` stream."""
    if event.event == "token":
        return StreamUpdate(tokens=1 if json.loads(event.data).get("token_id") is not None else 0)
    if event.event == "done":
        body = json.loads(event.data)
        usage = body.get("usage") or {}
        timing = body.get("timing") or {}
        return StreamUpdate(finished=True, finish_reason=body.get("finish_reason"),
                            output_tokens=usage.get("completion_tokens"), prompt_tokens=usage.get("prompt_tokens"),
                            cached_tokens=usage.get("cached_tokens"), queue_s=timing.get("queue_s"),
                            preemptions=timing.get("preemptions"), queue_steps=timing.get("queue_steps"))
    if event.event == "error":
        err = json.loads(event.data).get("error") or {}
        return StreamUpdate(finished=True, error=f"{err.get('type', 'error')}: {err.get('message', '')}")
    return StreamUpdate()


def parse_openai_event(event: SseEvent) -> StreamUpdate:
    """One event of a `/v1/completions` (or chat) stream. A chunk is one token event when it carries
    text or is a step's delta (no finish_reason); the closing chunk with only a finish_reason is not."""
    if event.data.strip() == "[DONE]":
        return StreamUpdate(finished=True)
    body = json.loads(event.data)
    if body.get("error"):
        err = body["error"]
        return StreamUpdate(finished=True, error=f"{err.get('type', 'error')}: {err.get('message', '')}")
    usage = body.get("usage") or {}
    tokens, reason = 0, None
    for choice in body.get("choices") or []:
        reason = choice.get("finish_reason") or reason
        if "text" in choice:  # completions
            text = choice["text"]
        elif "content" in (choice.get("delta") or {}):  # chat; the first chunk carries only the role
            text = choice["delta"]["content"]
        else:
            continue
        if text or choice.get("finish_reason") is None:
            tokens = 1
    details = usage.get("prompt_tokens_details") or {}
    return StreamUpdate(tokens=tokens, finish_reason=reason, output_tokens=usage.get("completion_tokens"),
                        prompt_tokens=usage.get("prompt_tokens"), cached_tokens=details.get("cached_tokens"))
