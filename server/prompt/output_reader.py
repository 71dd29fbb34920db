"""One output's text read back as the APIs return it: reasoning (server/prompt/reasoning.py) first, then
tool calls (server/prompt/tool_parser.py) in the text after the reasoning only, so a `<tool_call>` the
model writes while thinking is never a call. Every API's shape (chat, Responses, Messages) reads its
choices through one of these, fed the text deltas in order (or the whole text at once): the same pieces
come out either way. Reasoning is counted in tokens for usage (`reasoning_tokens`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from server.prompt.reasoning import ReasoningParser, ReasoningPlan, reasoning_tokens
from server.prompt.tool_parser import CallDelta, ParsedDelta, ToolCall, ToolParser


@dataclass
class OutputDelta:
    """What one feed released, in order: reasoning text, then content text and call pieces."""

    reasoning: str = ""
    content: str = ""
    calls: list[CallDelta] = field(default_factory=list)

    def parsed(self) -> ParsedDelta:
        """The content part (what a tool parser releases)."""
        return ParsedDelta(self.content, self.calls)


class OutputReader:
    """Reads one choice. `plan` None: no reasoning parsing (the text is content); `tools` None: no
    tool-call parsing. Reasoning is dropped (not returned, still counted) when the plan says so."""

    def __init__(self, plan: ReasoningPlan | None, tools: ToolParser | None) -> None:
        self.plan = plan
        self._reasoning: ReasoningParser | None = plan.new_parser() if plan is not None else None
        self._tools = tools
        self.token_ids: list[int] = []  # the output's tokens so far (for reasoning_tokens)
        self.reasoning = ""  # all the reasoning released so far (returned or not)

    @property
    def parses_reasoning(self) -> bool:
        return self.plan is not None

    @property
    def calls(self) -> list[ToolCall]:
        return self._tools.calls if self._tools is not None else []

    def feed(self, text: str, token_ids: list[int] | None = None) -> OutputDelta:
        self.token_ids += token_ids or []
        if self._reasoning is None:
            return self._content(text, final=False)
        split = self._reasoning.feed(text)
        return self._merge(split.reasoning, self._content(split.content, final=False))

    def finish(self) -> OutputDelta:
        """The end of the text: whatever each parser held back."""
        if self._reasoning is None:
            return self._content("", final=True)
        split = self._reasoning.finish()
        out = self._content(split.content, final=False)
        last = self._content("", final=True)
        out.content += last.content
        out.calls += last.calls
        return self._merge(split.reasoning, out)

    def read_all(self, text: str, token_ids: list[int]) -> OutputDelta:
        """A whole output at once (a non-streamed answer)."""
        first, last = self.feed(text, token_ids), self.finish()
        parsed = first.parsed()
        for c in last.calls:
            parsed.add_call(c)
        return OutputDelta(first.reasoning + last.reasoning, first.content + last.content, parsed.calls)

    def reasoning_tokens(self, decode: Callable[[list[int]], str]) -> int:
        """The output's tokens that were reasoning (0 without a reasoning parser)."""
        if self._reasoning is None:
            return 0
        return reasoning_tokens(self._reasoning.ended_at, self.token_ids, decode)

    def _merge(self, reasoning: str, out: OutputDelta) -> OutputDelta:
        self.reasoning += reasoning
        assert self.plan is not None
        out.reasoning = reasoning if self.plan.include else ""
        return out

    def _content(self, text: str, final: bool) -> OutputDelta:
        if self._tools is None:
            return OutputDelta(content=text)
        parsed = self._tools.finish() if final else self._tools.feed(text)
        return OutputDelta(content=parsed.content, calls=parsed.calls)
