"""xgrammar (https://github.com/mlc-ai/xgrammar) behind the GrammarCompiler interface.

JSON is compiled without free whitespace (separators ", " and ": "): a small model left free to add
whitespace can emit newlines until max_tokens. Objects are closed where the schema does not say
otherwise (xgrammar's strict mode), which every output still validates against. Tool calls are xgrammar
structural tags in the Hermes format of engine/structured/spec.py.

xgrammar 0.2.9 lets raw control characters into JSON strings with a maxLength (its length-bounded
string rule excludes only quote, backslash, CR and LF), which no strict JSON parser accepts. So JSON
grammars also forbid every token holding a byte below 0x20 (their JSON needs none), and tool-call
grammars every such token but newlines (the format's own separators).
"""

from __future__ import annotations

import json
import re
from typing import Any

import torch
import xgrammar as xgr

from engine.structured.backend import CachingCompiler
from engine.structured.masks import pack_bitmask
from engine.structured.spec import (
    TOOL_CALL_HEAD_PREFIX,
    TOOL_CALL_HEAD_SUFFIX,
    TOOL_CALL_OPEN,
    TOOL_CALL_SEPARATOR,
    TOOL_CALL_TAIL,
    GrammarError,
    GrammarSpec,
)

_LOG_PREFIX = re.compile(r"^\[[\d:]+\] \S+?:\d+: ")  # "[11:37:21] /project/cpp/x.cc:94: " on C++ errors
_CONTROL_BYTES = frozenset(range(0x20))
_MAX_WHITESPACE_IN_TOOL_ARGS = 1  # whitespace characters allowed between JSON tokens of tool arguments


class XGrammarMatcher:
    """GrammarMatcher over xgrammar's matcher. Stops on the model's EOS tokens (the compiler's)."""

    def __init__(self, compiled: xgr.CompiledGrammar, also: torch.Tensor | None) -> None:
        self._matcher = xgr.GrammarMatcher(compiled)
        # A bitmask row ANDed with the grammar's (tokens the grammar must never get), as numpy int32.
        self._also = also.numpy() if also is not None else None

    def fill_bitmask(self, bitmask: Any, row: int) -> None:
        self._matcher.fill_next_token_bitmask(bitmask, row)
        if self._also is not None:  # numpy: one thread (torch's pool can wait ms for a busy core)
            words = bitmask.numpy()[row]
            words &= self._also

    def accept(self, token_id: int) -> bool:
        return bool(self._matcher.accept_token(token_id))

    def is_terminated(self) -> bool:
        return bool(self._matcher.is_terminated())


class XGrammar:
    """A compiled grammar of one XGrammarCompiler."""

    def __init__(self, owner: XGrammarCompiler, compiled: xgr.CompiledGrammar, also: torch.Tensor | None) -> None:
        self._owner = owner
        self.compiled = compiled
        self.also = also  # int32 [ceil(vocab / 32)] ANDed with every step's mask; None: the grammar's alone

    @property
    def owner(self) -> object:
        return self._owner

    def matcher(self) -> XGrammarMatcher:
        return XGrammarMatcher(self.compiled, self.also)


class XGrammarCompiler(CachingCompiler):
    """Compiles specs for one tokenizer. `vocab_size`: the model's logits width (the tokenizer's
    vocabulary may be smaller: the padding ids are never allowed). `stop_token_ids`: the ids that end a
    generation (the model's EOS); a grammar ends when one is sampled where the grammar may end."""

    backend = "xgrammar"

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: frozenset[int] | list[int],
                 max_entries: int = 512, threads: int = 2) -> None:  # fmt: skip
        super().__init__(max_entries)
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                  stop_token_ids=sorted(stop_token_ids))  # fmt: skip
        # Our cache is in front (CachingCompiler): xgrammar's own would hold a second copy.
        self._compiler = xgr.GrammarCompiler(info, max_threads=threads, cache_enabled=False)
        self.vocab_size = vocab_size
        # Ids past the tokenizer's vocabulary (padding rows) are left to the grammar (which forbids them).
        controls = [set(b) & _CONTROL_BYTES for b in info.decoded_vocab[:vocab_size]]
        controls += [set()] * (vocab_size - len(controls))
        self._no_controls = pack_bitmask(torch.tensor([not c for c in controls]))
        self._newlines_only = pack_bitmask(torch.tensor([c <= {10} for c in controls]))

    def _compile(self, spec: GrammarSpec) -> XGrammar:
        also = {"json_schema": self._no_controls, "json_object": self._no_controls,
                "tool_calls": self._newlines_only}.get(spec.kind)  # fmt: skip
        try:
            return XGrammar(self, self._build(spec), also)
        except GrammarError:
            raise
        except Exception as exc:  # xgrammar raises RuntimeError (C++), ValueError, pydantic errors
            raise GrammarError(_message(exc)) from None

    def _build(self, spec: GrammarSpec) -> xgr.CompiledGrammar:
        c, source = self._compiler, spec.source
        if spec.kind == "json_schema":
            return c.compile_json_schema(source, any_whitespace=False, strict_mode=True)
        if spec.kind == "json_object":
            return c.compile_json_schema('{"type": "object"}', any_whitespace=False, strict_mode=False)
        if spec.kind == "regex":
            return c.compile_regex(source)
        if spec.kind == "choice":
            return c.compile_grammar(choice_ebnf(json.loads(source)))
        if spec.kind == "grammar":
            return c.compile_grammar(source)
        return c.compile_structural_tag(tool_call_tag(json.loads(source)))


def choice_ebnf(options: list[str]) -> str:
    """root ::= "a" | "b" ...: exactly one of `options`, as raw text."""
    if not options:
        raise GrammarError("choice needs at least one option")
    return "root ::= " + " | ".join(_ebnf_literal(o) for o in options)


def _ebnf_literal(text: str) -> str:
    if not text:
        return '""'
    escaped = "".join(_ebnf_char(ch) for ch in text)
    return f'"{escaped}"'


def _ebnf_char(ch: str) -> str:
    if ch in '"\\':
        return "\\" + ch
    if ord(ch) < 0x20 or ord(ch) == 0x7F:
        return f"\\u{ord(ch):04x}"
    return ch


def tool_call_tag(spec: dict[str, Any]) -> dict[str, Any]:
    """The xgrammar structural tag of a tool_calls spec (GrammarSpec.tool_calls)."""
    tags = [_call_format(t["name"], t["parameters"]) for t in spec["tools"]]
    single = not spec["parallel"]
    if spec["mode"] == "named":
        fmt: dict[str, Any] = tags[0]
    elif spec["mode"] == "required":
        fmt = {"type": "tags_with_separator", "tags": tags, "separator": TOOL_CALL_SEPARATOR,
               "at_least_one": True, "stop_after_first": single}  # fmt: skip
    else:
        fmt = {"type": "triggered_tags", "triggers": [TOOL_CALL_OPEN], "tags": tags, "stop_after_first": single}
    return {"type": "structural_tag", "format": fmt}


def _call_format(name: str, parameters: dict[str, Any]) -> dict[str, Any]:
    begin = TOOL_CALL_OPEN + TOOL_CALL_HEAD_PREFIX + json.dumps(name, ensure_ascii=False) + TOOL_CALL_HEAD_SUFFIX
    content = {"type": "json_schema", "json_schema": parameters, "max_whitespace_cnt": _MAX_WHITESPACE_IN_TOOL_ARGS}
    return {"type": "tag", "begin": begin, "content": content, "end": TOOL_CALL_TAIL}


def _message(exc: Exception) -> str:
    text = str(exc).strip().splitlines()
    first = _LOG_PREFIX.sub("", text[0]) if text else type(exc).__name__
    return first or type(exc).__name__
