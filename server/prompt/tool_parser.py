"""Tool calls read back from the model's text, streaming or not, and the OpenAI shapes they go out in.

`ToolParser` is the interface (one per request, fed the text deltas in order); `HermesToolParser` reads
the Hermes format of engine/structured/spec.py, `<tool_call>{"name": ..., "arguments": ...}</tool_call>`.
Feeding the whole text at once or in any pieces yields the same content and the same calls, so a
streamed response reassembles into the non-streamed one. What streams: content up to the last
non-space character (a possible `<tool_call>` start and trailing whitespace are held back), the first
call's id, type and name once its name is complete, then its arguments text as it arrives; a later call
only once it is complete, so a repeat of an earlier call (same name, same arguments) is dropped unseen:
one call per distinct call. A `<tool_response>` wrapper that the model echoes from a tool result around
its answer (a leading `<tool_response>`, a trailing `</tool_response>`) is cut from the content.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Protocol

from engine.structured.spec import TOOL_CALL_CLOSE, TOOL_CALL_OPEN

# How server/prompt/tools.py wraps a tool result for a template that has no tool turn.
TOOL_RESPONSE_OPEN, TOOL_RESPONSE_CLOSE = "<tool_response>", "</tool_response>"

# The start of a call up to its arguments: {"name": "<name>", "arguments": (then the arguments' first
# character: the match must not end inside whitespace that a later piece continues).
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:\s*(?=\S)')


@dataclass(frozen=True)
class ToolCall:
    """One complete call, as the response's message carries it."""

    id: str
    name: str
    arguments: str  # JSON text of the arguments object, as the model wrote it

    def openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class CallDelta:
    """What one feed added to call `index`: its id and name the first time, then arguments text."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass
class ParsedDelta:
    """What one feed released: content text and call pieces (in order)."""

    content: str = ""
    calls: list[CallDelta] = field(default_factory=list)

    def add_call(self, piece: CallDelta) -> None:
        same = next((c for c in self.calls if c.index == piece.index), None)
        if same is None:
            self.calls.append(piece)
            return
        same.id, same.name = same.id or piece.id, same.name or piece.name
        same.arguments += piece.arguments

    def openai(self) -> dict[str, Any]:
        """The chat chunk's `delta` (without `role`)."""
        delta: dict[str, Any] = {}
        if self.content:
            delta["content"] = self.content
        if self.calls:
            delta["tool_calls"] = [_call_delta(c) for c in self.calls]
        return delta


def _call_delta(c: CallDelta) -> dict[str, Any]:
    fn: dict[str, Any] = {"arguments": c.arguments}
    out: dict[str, Any] = {"index": c.index}
    if c.id is not None:
        out.update(id=c.id, type="function")
        fn = {"name": c.name, **fn}
    out["function"] = fn
    return out


class ToolParser(Protocol):
    """Reads one response's text. `calls` holds the calls completed so far."""

    calls: list[ToolCall]

    def feed(self, text: str) -> ParsedDelta: ...

    def finish(self) -> ParsedDelta:
        """The end of the text: whatever was held back (an unclosed call is closed when it parses; one
        cut before its name is complete is dropped, markup and all)."""
        ...


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class _OpenCall:
    index: int
    id: str | None = None  # set when the head (name) was streamed
    name: str | None = None
    args_start: int = 0  # where the arguments begin in the call's text
    emitted: int = 0  # arguments characters streamed so far


class HermesToolParser:
    """`parallel` False: only the first call counts; later text is dropped."""

    def __init__(self, parallel: bool = True) -> None:
        self.parallel = parallel
        self.calls: list[ToolCall] = []
        self._buf = ""  # text not yet released: content held back, or the open call's text
        self._call: _OpenCall | None = None
        self._done = False  # parallel False and one call complete
        self._started = False  # content released (a leading echoed `<tool_response>` is cut before)
        self._echo_cut = False  # a leading `<tool_response>` was cut

    def feed(self, text: str) -> ParsedDelta:
        out = ParsedDelta()
        self._buf += text
        self._advance(out, final=False)
        return out

    def finish(self) -> ParsedDelta:
        out = ParsedDelta()
        self._advance(out, final=True)
        return out

    def _advance(self, out: ParsedDelta, final: bool) -> None:
        while not self._done:
            if self._call is None:
                start = self._buf.find(TOOL_CALL_OPEN)
                if start < 0:
                    self._release_content(out, final)
                    return
                out.content += self._buf[:start].rstrip()
                self._started = True
                self._buf = self._buf[start + len(TOOL_CALL_OPEN):]
                self._call = _OpenCall(index=len(self.calls))
                continue
            end = self._buf.find(TOOL_CALL_CLOSE)
            if end < 0 and not final:
                self._stream_call(out)
                return
            body, self._buf = (self._buf, "") if end < 0 else (self._buf[:end], self._buf[end + len(TOOL_CALL_CLOSE):])
            self._close_call(out, body, closed=end >= 0)
        self._buf = ""

    def _release_content(self, out: ParsedDelta, final: bool) -> None:
        """Content up to the last non-space character before a possible `<tool_call>` start or an
        echoed `</tool_response>` (whole or begun) at the end."""
        if not self._started and not self._cut_echo_head(final):
            return
        if final:
            text = self._buf.rstrip() if self.calls else self._buf
            stripped = text.rstrip()
            if stripped.endswith(TOOL_RESPONSE_CLOSE):
                text = stripped[: -len(TOOL_RESPONSE_CLOSE)].rstrip()
            out.content += text
            self._buf = ""
            return
        kept = self._buf.rstrip()
        before_open = self._buf[: len(self._buf) - _partial_suffix(self._buf, TOOL_CALL_OPEN)].rstrip()
        before_close = kept[: len(kept) - _suffix(kept, TOOL_RESPONSE_CLOSE)].rstrip()
        cut = min(len(before_open), len(before_close))
        out.content += self._buf[:cut]
        self._buf = self._buf[cut:]

    def _cut_echo_head(self, final: bool) -> bool:
        """Cut a leading echoed `<tool_response>` (and the space after it) from the content; False while
        the start may still be one."""
        head = self._buf.lstrip()
        if not self._echo_cut and head.startswith(TOOL_RESPONSE_OPEN):
            self._echo_cut, self._buf = True, head[len(TOOL_RESPONSE_OPEN):]
        elif not self._echo_cut and not final and TOOL_RESPONSE_OPEN.startswith(head):
            return False
        if self._echo_cut:
            self._buf = self._buf.lstrip()
            if not self._buf and not final:
                return False
        self._started = True
        return True

    def _stream_call(self, out: ParsedDelta) -> None:
        call = self._call
        assert call is not None
        if self.calls:  # a later call waits until complete: it may repeat an earlier one
            return
        if call.id is None:
            head = _HEAD.match(self._buf)
            if head is None:
                return
            call.id, call.name, call.args_start = new_call_id(), json.loads(head.group(1)), head.end()
            out.add_call(CallDelta(call.index, call.id, call.name))
        region = self._buf[call.args_start:]
        cut = max(call.emitted, _arguments_end(region, _partial_suffix(region, TOOL_CALL_CLOSE)))
        if cut > call.emitted:
            out.add_call(CallDelta(call.index, arguments=region[call.emitted:cut]))
            call.emitted = cut

    def _close_call(self, out: ParsedDelta, body: str, closed: bool) -> None:
        call, self._call = self._call, None
        assert call is not None
        parsed = _parse_call(body)
        if call.id is None and parsed is None:
            if closed:  # not a call after all: it stays text
                out.content += TOOL_CALL_OPEN + body + TOOL_CALL_CLOSE
            # unclosed at the end of the text: a call cut short (max_tokens) before its name; dropped,
            # as no call and no markup left in content
            return
        if call.id is None:
            assert parsed is not None
            if any(_same_call(c, parsed) for c in self.calls):
                return  # a repeat (same name and arguments) of a call already made
            call.id, call.name = new_call_id(), parsed[0]
            out.add_call(CallDelta(call.index, call.id, call.name))
            head = _HEAD.match(body)  # the arguments as the model wrote them, as a stream sends them
            arguments = parsed[1] if head is None else body[head.end():][: _arguments_end(body[head.end():], 0)]
        else:
            region = body[call.args_start:]
            arguments = region[: _arguments_end(region, 0)]
        streamed = body[call.args_start : call.args_start + call.emitted] if call.emitted else ""
        rest = arguments[len(streamed):] if arguments.startswith(streamed) else ""
        if rest:
            out.add_call(CallDelta(call.index, arguments=rest))
        self.calls.append(ToolCall(call.id, call.name or "", streamed + rest))
        self._done = not self.parallel


def _parse_call(body: str) -> tuple[str, str] | None:
    """(name, arguments JSON text) of a call's text, or None when it is not a call."""
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return obj["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)


def _same_call(call: ToolCall, parsed: tuple[str, str]) -> bool:
    if call.name != parsed[0]:
        return False
    try:
        return json.loads(call.arguments) == json.loads(parsed[1])
    except ValueError:
        return call.arguments == parsed[1]


def _arguments_end(region: str, held: int) -> int:
    """Where the arguments end in `region` (the text after `"arguments":`), its last `held` characters
    possibly the start of `</tool_call>`: before trailing space, the call object's `}` and space."""
    text = region[: len(region) - held].rstrip()
    if text.endswith("}"):
        text = text[:-1].rstrip()
    return len(text)


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of `text` that is a proper start of `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


def _suffix(text: str, marker: str) -> int:
    """Length of the longest end of `text` that is a start of `marker`, the whole marker included."""
    return len(marker) if text.endswith(marker) else _partial_suffix(text, marker)


# Tool-call formats by name (the `tool_call_parser` setting): one parser class per model family's format.
PARSERS: dict[str, type[HermesToolParser]] = {"hermes": HermesToolParser}
