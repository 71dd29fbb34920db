"""What a request's output must look like, as plain data: `GrammarSpec` (torch-free, hashable).

The server builds a spec from the request's fields, compiles it off the engine thread through the
engine's `GrammarCompiler` (engine/structured/backend.py) and sends the compiled grammar along on the
spec. Equality and hash cover `kind` and `source` only, so `SamplingParams` stays hashable and the
response cache keys a request by its grammar, whatever object compiled it.

Tool calls use the Hermes format, one call per tag, calls separated by a newline:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

The grammar (engine) and the parser (server/prompt/tools.py) share the strings below, so they cannot drift.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field, replace
from typing import Any

GRAMMAR_KINDS = ("json_schema", "json_object", "regex", "choice", "grammar", "tool_calls", "after_reasoning")
TOOL_CHOICE_MODES = ("auto", "required", "named")

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
# A call as the grammar writes it: OPEN + HEAD_PREFIX + name + HEAD_SUFFIX + arguments JSON + TAIL.
TOOL_CALL_HEAD_PREFIX = '\n{"name": '
TOOL_CALL_HEAD_SUFFIX = ', "arguments": '
TOOL_CALL_TAIL = "}\n" + TOOL_CALL_CLOSE
TOOL_CALL_SEPARATOR = "\n"  # between calls when tool_choice is required


class GrammarError(ValueError):
    """A spec the backend cannot compile (an invalid JSON schema, regex or grammar); the message says why."""


class GrammarTimeout(GrammarError):
    """A spec that did not compile within its budget (`timeout_s`); the compile was stopped."""

    def __init__(self, timeout_s: float) -> None:
        super().__init__(f"did not compile within {timeout_s:g}s")
        self.timeout_s = timeout_s


class GrammarDeadEnd(GrammarError):
    """A spec that compiles but allows no output: no token can start it."""


class GrammarTooLarge(GrammarError):
    """A spec whose compiled grammar would not fit the compiler's cache byte bound."""


@dataclass(frozen=True)
class GrammarSpec:
    """One request's output constraint.

    kind and source:
      json_schema: source is the schema as compact JSON (property order kept: it is the output's order)
      json_object: any JSON object; source is ""
      regex: source is the pattern (the whole output matches it)
      choice: source is a JSON list of the allowed strings (the output is exactly one of them)
      grammar: source is an EBNF (GBNF) grammar with a `root` rule
      tool_calls: source is JSON {"tools": [{"name", "parameters"}], "mode": auto|required|named,
        "parallel": bool}; see `tool_calls()`
      after_reasoning: source is JSON {"end": marker, "excludes": [...], "kind", "source"}: any text
        without the `excludes` up to the first `end` (a thinking model's reasoning, which the server returns
        apart), then a little whitespace, then the inner grammar; see `after_reasoning()`
    """

    kind: str
    source: str
    # What the engine's GrammarCompiler made of it; set by the compiler's caller, not part of eq/hash.
    compiled: Any = field(default=None, compare=False, hash=False, repr=False)
    # The caller's name of the field that asked for it ("response_format", "guided_regex", ...): an
    # error of this grammar at run time (it allows no next token) names it. Not part of eq/hash.
    param: str = field(default="structured", compare=False, hash=False, repr=False)

    def __post_init__(self) -> None:
        if self.kind not in GRAMMAR_KINDS:
            raise GrammarError(f"grammar kind must be one of {GRAMMAR_KINDS}, got {self.kind!r}")
        if not isinstance(self.source, str):
            raise GrammarError("grammar source must be a string")

    @property
    def key(self) -> str:
        """A stable digest of kind and source: the compile cache's key."""
        return hashlib.sha256(f"{self.kind}\0{self.source}".encode()).hexdigest()

    def with_compiled(self, compiled: Any, param: str | None = None) -> GrammarSpec:
        return replace(self, compiled=compiled, param=param or self.param)

    @staticmethod
    def json_schema(schema: dict[str, Any] | bool) -> GrammarSpec:
        return GrammarSpec("json_schema", _compact(schema))

    @staticmethod
    def choice(options: list[str]) -> GrammarSpec:
        return GrammarSpec("choice", _compact(list(options)))

    @staticmethod
    def tool_calls(tools: list[tuple[str, dict[str, Any]]], mode: str, parallel: bool) -> GrammarSpec:
        """Calls of `tools` ((name, parameters JSON schema) pairs) in the Hermes format. mode auto: free
        text, and any `<tool_call>` the model opens must be a valid call; required: one call or more and
        nothing else; named: exactly one call of the one tool given. parallel False: at most one call."""
        if mode not in TOOL_CHOICE_MODES:
            raise GrammarError(f"tool choice mode must be one of {TOOL_CHOICE_MODES}, got {mode!r}")
        if not tools or (mode == "named" and len(tools) != 1):
            raise GrammarError("tool_calls needs the tools to call (exactly one when named)")
        listed = [{"name": name, "parameters": params} for name, params in tools]
        return GrammarSpec("tool_calls", _compact({"tools": listed, "mode": mode, "parallel": bool(parallel)}))

    @staticmethod
    def after_reasoning(inner: GrammarSpec, end: str, excludes: tuple[str, ...] = ()) -> GrammarSpec:
        """`inner` applied only after the reasoning: free text until the first `end` marker (a start
        marker, if the model writes one, is part of that text), then `inner`. The model must close its
        reasoning before it can answer (vLLM applies a request's grammar once reasoning ends, too).
        `excludes`: strings the reasoning may not contain (those a parser reads as ending it otherwise,
        so that grammar and parser agree on where the reasoning ends)."""
        if inner.kind == "after_reasoning" or not end or not all(excludes):
            raise GrammarError("after_reasoning wraps one plain grammar and needs the end marker")
        return GrammarSpec("after_reasoning", _compact({"end": end, "excludes": list(excludes), "kind": inner.kind,
                                                        "source": inner.source}))  # fmt: skip


def _compact(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)
