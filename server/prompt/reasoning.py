"""Reasoning read back from a thinking model's text, streaming or not: `--reasoning-parser NAME`, with
vLLM's names (vLLM 0.32 `vllm/reasoning/`) and its behaviour for them.

Both parsers here read `<think>...</think>`:
- `deepseek_r1`: the output starts in reasoning (newer DeepSeek-R1 templates open `<think>` in the
  prompt, so the model may never write it); a leading `<think>` is dropped; `</think>` ends it; text
  with no `</think>` is all reasoning.
- `qwen3`: the same, and a `<tool_call>` written while reasoning ends the reasoning too (the call is
  content, for the tool parser); thinking can be turned off per request (`enable_thinking: false`).

Per request (`ReasoningPlan`): the output starts in content when thinking is off (the chat template
kwargs `enable_thinking` or `thinking` false) or when the prompt already closed the reasoning (Qwen3's
template writes `<think>\\n\\n</think>\\n\\n` into the prompt when thinking is off); otherwise in reasoning.

`ReasoningParser` is fed the text deltas in order and releases reasoning and content apart; feeding the
whole text at once or in any pieces (a marker split over tokens, bytes or chunks) yields the same two
texts: a possible marker at the end of what was fed is held back until the next piece decides it. The
whitespace between the end marker and the answer (Qwen3 writes `</think>\\n\\n`) is dropped from the
content, so JSON and tool calls after it start clean. `ended_at` is where the reasoning ended in the
output text; `reasoning_tokens` turns it into a token count for usage.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ReasoningFormat:
    """How one model family marks its reasoning."""

    start: str  # opens the reasoning; optional in the output (the prompt may have opened it)
    end: str  # closes it
    also_ends: tuple[str, ...] = ()  # markers that end the reasoning and stay in the content (qwen3's <tool_call>)


# Parsers by vLLM's `--reasoning-parser` names.
REASONING_FORMATS: dict[str, ReasoningFormat] = {
    "deepseek_r1": ReasoningFormat("<think>", "</think>"),
    "qwen3": ReasoningFormat("<think>", "</think>", ("<tool_call>",)),
}
_PROMPT_TAIL_TOKENS = 24  # prompt tokens decoded to see whether the template opened or closed the reasoning


@dataclass
class ReasoningDelta:
    """What one feed released."""

    reasoning: str = ""
    content: str = ""


class ReasoningParser:
    """Splits one output's text into reasoning and content. `thinking` False: it is all content."""

    def __init__(self, fmt: ReasoningFormat, thinking: bool = True) -> None:
        self.fmt = fmt
        self.thinking = thinking
        self.ended_at: int | None = None if thinking else 0  # output text offset where reasoning ended
        self._buf = ""  # text fed but not released: a possible marker's start, or space after the end
        self._fed = 0  # characters fed before _buf
        self._started = False  # reasoning text released (a leading start marker is no longer possible)
        self._content_started = not thinking  # content released (leading whitespace no longer dropped)

    @property
    def in_reasoning(self) -> bool:
        return self.ended_at is None

    def feed(self, text: str) -> ReasoningDelta:
        self._buf += text
        return self._advance(final=False)

    def finish(self) -> ReasoningDelta:
        """The end of the text: whatever was held back (an unfinished marker is text)."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> ReasoningDelta:
        out = ReasoningDelta()
        if self.in_reasoning:
            self._reason(out, final)
        if not self.in_reasoning:
            self._content(out, final)
        return out

    def _reason(self, out: ReasoningDelta, final: bool) -> None:
        if not self._started and not self._drop_start(final):
            return
        ends = [(self._buf.find(m), m) for m in (self.fmt.end, *self.fmt.also_ends)]
        found = [(i, m) for i, m in ends if i >= 0]
        if found:
            i, marker = min(found)
            out.reasoning += self._buf[:i]
            self.ended_at = self._fed + i
            skip = i + len(marker) if marker == self.fmt.end else i  # another marker stays in the content
            self._take(skip)
            return
        held = 0 if final else max(_partial_suffix(self._buf, m) for m in (self.fmt.end, *self.fmt.also_ends))
        out.reasoning += self._take(len(self._buf) - held)

    def _drop_start(self, final: bool) -> bool:
        """Drop a start marker at the very beginning (after whitespace); False while the text so far may
        still be one."""
        head = self._buf.lstrip()
        if head.startswith(self.fmt.start):
            self._take(len(self._buf) - len(head) + len(self.fmt.start))
        elif not final and self.fmt.start.startswith(head):
            return False
        self._started = True
        return True

    def _content(self, out: ReasoningDelta, final: bool) -> None:
        if not self._content_started:
            stripped = self._buf.lstrip()
            self._take(len(self._buf) - len(stripped))
            if not self._buf:
                return
            self._content_started = True
        out.content += self._take(len(self._buf))

    def _take(self, n: int) -> str:
        """The first n characters of the buffer, removed from it."""
        taken, self._buf = self._buf[:n], self._buf[n:]
        self._fed += n
        return taken


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of `text` that is a proper start of `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


def split_reasoning(fmt: ReasoningFormat, text: str, thinking: bool = True) -> tuple[str, str, int | None]:
    """(reasoning, content, ended_at) of a whole output."""
    parser = ReasoningParser(fmt, thinking)
    first, last = parser.feed(text), parser.finish()
    return first.reasoning + last.reasoning, first.content + last.content, parser.ended_at


def reasoning_tokens(ended_at: int | None, token_ids: list[int], decode: Callable[[list[int]], str]) -> int:
    """How many of the output's tokens are reasoning: those whose text begins before `ended_at` (None:
    the reasoning never ended, so all). Binary search over decoded prefixes: log2(len) decodes."""
    if ended_at is None:
        return len(token_ids)
    lo, hi = 0, len(token_ids)  # the fewest tokens whose text reaches ended_at
    while lo < hi:
        mid = (lo + hi) // 2
        if len(decode(token_ids[:mid])) >= ended_at:
            hi = mid
        else:
            lo = mid + 1
    return lo


@dataclass(frozen=True)
class ReasoningPlan:
    """How one request's output is read: the format, whether it starts in reasoning, and whether the
    reasoning is returned (`include_reasoning`, vLLM's field; dropped when false)."""

    fmt: ReasoningFormat
    thinking: bool  # the output starts in reasoning
    include: bool = True

    def new_parser(self) -> ReasoningParser:
        return ReasoningParser(self.fmt, self.thinking)


def thinking_requested(template_kwargs: dict[str, Any] | None) -> bool:
    """False when the chat template kwargs turn thinking off (`enable_thinking`, or DeepSeek's `thinking`)."""
    kwargs = template_kwargs or {}
    return not any(kwargs.get(key) is False for key in ("enable_thinking", "thinking"))


def prompt_thinking(fmt: ReasoningFormat, prompt_tail: str) -> bool | None:
    """What the end of the prompt says: True when it opened the reasoning (a start marker not closed
    since), False when it closed it (ends with the end marker), None when it says nothing."""
    tail = prompt_tail.rstrip()
    if tail.endswith(fmt.end):
        return False
    start, end = tail.rfind(fmt.start), tail.rfind(fmt.end)
    return True if start >= 0 and start > end else None


def plan_reasoning(name: str | None, template_kwargs: dict[str, Any] | None, prompt_ids: list[int],
                   decode: Callable[[list[int]], str], include: bool = True) -> ReasoningPlan | None:  # fmt: skip
    """The request's plan under the server's `--reasoning-parser` (`name`; None: no parsing, None back)."""
    if name is None:
        return None
    fmt = REASONING_FORMATS[name]
    from_prompt = prompt_thinking(fmt, decode(prompt_ids[-_PROMPT_TAIL_TOKENS:]))
    thinking = thinking_requested(template_kwargs) and from_prompt is not False
    return ReasoningPlan(fmt, thinking, include)
