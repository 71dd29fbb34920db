"""xgrammar (https://github.com/mlc-ai/xgrammar) behind the GrammarCompiler interface.

JSON is compiled with bounded whitespace: at most _MAX_WHITESPACE_IN_JSON whitespace characters
between two JSON tokens, so a model may write `{\n  "` (a small one writes `{"` badly: SmolLM2 gave `{`
a logprob of -10.4 and then ran away in the string) yet cannot emit blank space until max_tokens.
Objects are closed where the schema does not say otherwise (xgrammar's strict mode), which every output
still validates against. Tool calls are xgrammar structural tags in the Hermes format of
engine/structured/spec.py.

xgrammar 0.2.9 lets raw control characters into JSON strings with a maxLength (its length-bounded
string rule excludes only quote, backslash, CR and LF), which no strict JSON parser accepts. So JSON
grammars also forbid every token holding a byte below 0x20 other than LF and CR (whitespace between
tokens, which no string rule admits; tabs are refused, as a bounded string would take them), and
tool-call grammars every such token but LF (the format's own separators). An `after_reasoning` grammar
(a thinking model's reasoning, then the inner grammar) is a structural tag: a `tag` of any text ending
at the end marker, up to _MAX_WHITESPACE_AFTER_REASONING spaces or newlines, then the inner grammar as a
structural-tag format; it takes its inner kind's mask, over the reasoning too (no tab there).
"""

from __future__ import annotations

import json
import re
import weakref
from typing import Any

import torch
import xgrammar as xgr

from engine.structured.backend import CachingCompiler
from engine.structured.compile_workers import CompilePool
from engine.structured.masks import new_bitmask, pack_bitmask
from engine.structured.spec import (
    TOOL_CALL_HEAD_PREFIX,
    TOOL_CALL_HEAD_SUFFIX,
    TOOL_CALL_OPEN,
    TOOL_CALL_SEPARATOR,
    TOOL_CALL_TAIL,
    GrammarDeadEnd,
    GrammarError,
    GrammarSpec,
    GrammarTooLarge,
)

_LOG_PREFIX = re.compile(r"^\[[\d:]+\] \S+?:\d+: ")  # "[11:37:21] /project/cpp/x.cc:94: " on C++ errors
_CONTROL_BYTES = frozenset(range(0x20))
_MAX_WHITESPACE_IN_TOOL_ARGS = 1  # whitespace characters allowed between JSON tokens of tool arguments
_MAX_WHITESPACE_IN_JSON = 4  # ... of JSON outputs: `{\n  "` fits, a runaway does not
_MAX_WHITESPACE_AFTER_REASONING = 4  # between the reasoning's end marker and the answer (Qwen3 writes "\n\n")


class XGrammarMatcher:
    """GrammarMatcher over xgrammar's matcher. Stops on the model's EOS tokens (the compiler's)."""

    def __init__(self, compiled: xgr.CompiledGrammar, also: torch.Tensor | None) -> None:
        self._matcher = xgr.GrammarMatcher(compiled)
        # A bitmask row ANDed with the grammar's (tokens the grammar must never get), as numpy int32.
        self._also = also.numpy() if also is not None else None
        self._nothing = False

    def fill_bitmask(self, bitmask: Any, row: int) -> None:
        self._matcher.fill_next_token_bitmask(bitmask, row)
        words = bitmask.numpy()[row]  # numpy: one thread (torch's pool can wait ms for a busy core)
        if self._also is not None:
            words &= self._also
        self._nothing = not words.any()

    def allows_nothing(self) -> bool:
        return self._nothing

    def accept(self, token_id: int) -> bool:
        return bool(self._matcher.accept_token(token_id))

    def is_terminated(self) -> bool:
        return bool(self._matcher.is_terminated())

    def rollback(self, num_tokens: int) -> None:
        self._matcher.rollback(num_tokens)  # xgrammar >= 0.1.2x: unlimited rollback


class XGrammar:
    """A compiled grammar of one XGrammarCompiler."""

    def __init__(self, owner: XGrammarCompiler, compiled: xgr.CompiledGrammar, also: torch.Tensor | None) -> None:
        self._owner = owner
        self.compiled = compiled
        self.also = also  # int32 [ceil(vocab / 32)] ANDed with every step's mask; None: the grammar's alone
        self.memory_bytes = int(compiled.memory_size_bytes)

    @property
    def owner(self) -> object:
        return self._owner

    def matcher(self) -> XGrammarMatcher:
        return XGrammarMatcher(self.compiled, self.also)


class XGrammarCompiler(CachingCompiler):
    """Compiles specs for one tokenizer. `vocab_size`: the model's logits width (the tokenizer's
    vocabulary may be smaller: the padding ids are never allowed). `stop_token_ids`: the ids that end a
    generation (the model's EOS); a grammar ends when one is sampled where the grammar may end.
    `max_bytes`: the cache's byte bound; a grammar that alone compiles to more is refused (GrammarTooLarge).
    `processes`: compile in worker processes (compile_workers.py; compiles are then `budgeted`), else on
    the caller's thread, `threads` wide."""

    backend = "xgrammar"

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: frozenset[int] | list[int],
                 max_entries: int = 512, threads: int = 2, max_bytes: int = 256 << 20,
                 processes: bool = False) -> None:  # fmt: skip
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                  stop_token_ids=sorted(stop_token_ids))  # fmt: skip
        self.pool = CompilePool({"tokenizer_info": info.serialize_json(), "max_bytes": max_bytes}) if processes else None
        if self.pool is not None:  # the workers go with the compiler (an unloaded version's engine)
            weakref.finalize(self, self.pool.close, False)
        # In-process: compiles run on `threads` threads; with processes, each waits on a thread for its worker.
        super().__init__(max_entries, max_bytes, threads if self.pool is None else self.pool.max_waiting)
        self._info = info
        # Our cache is in front (CachingCompiler): xgrammar's own would hold a second copy.
        self._compiler = xgr.GrammarCompiler(info, max_threads=threads, cache_enabled=False)
        self.vocab_size = vocab_size
        # Ids past the tokenizer's vocabulary (padding rows) are left to the grammar (which forbids them).
        controls = [set(b) & _CONTROL_BYTES for b in info.decoded_vocab[:vocab_size]]
        controls += [set()] * (vocab_size - len(controls))
        self._newlines_only = pack_bitmask(torch.tensor([c <= {10} for c in controls]))
        self._line_breaks_only = pack_bitmask(torch.tensor([c <= {10, 13} for c in controls]))

    @property
    def budgeted(self) -> bool:  # type: ignore[override]
        return self.pool is not None

    def close(self) -> None:
        """Stop taking compiles and stop the compile workers (if any)."""
        super().close()
        if self.pool is not None:
            self.pool.close()

    def _compile(self, spec: GrammarSpec, timeout_s: float | None) -> XGrammar:
        kind = json.loads(spec.source)["kind"] if spec.kind == "after_reasoning" else spec.kind
        also = {"json_schema": self._line_breaks_only, "json_object": self._line_breaks_only,
                "tool_calls": self._newlines_only}.get(kind)  # fmt: skip
        if self.pool is not None:
            done = self.pool.compile(spec.kind, spec.source, timeout_s)
            grammar = XGrammar(self, xgr.CompiledGrammar.deserialize_json(done.payload, self._info), also)
        else:
            grammar = XGrammar(self, self._build_here(spec), also)
            if grammar.memory_bytes > self.max_bytes:
                raise GrammarTooLarge(f"compiles to {grammar.memory_bytes / 2**20:.1f} MiB, more than the grammar "
                                      f"cache holds ({self.max_bytes / 2**20:.1f} MiB)")  # fmt: skip
        _check_first_step(grammar, self.vocab_size)
        return grammar

    def _build_here(self, spec: GrammarSpec) -> xgr.CompiledGrammar:
        try:
            return build_grammar(self._compiler, spec.kind, spec.source)
        except GrammarError:
            raise
        except Exception as exc:  # xgrammar raises RuntimeError (C++), ValueError, pydantic errors
            raise GrammarError(error_message(exc)) from None


def _check_first_step(grammar: XGrammar, vocab_size: int) -> None:
    """A grammar no token can start (an empty regex class, a pattern needing characters the control mask
    forbids) is refused here rather than failing its request's first step."""
    matcher = grammar.matcher()
    matcher.fill_bitmask(new_bitmask(1, vocab_size), 0)
    if matcher.allows_nothing():
        raise GrammarDeadEnd("allows no output: no token of this model's vocabulary can start it")


def build_grammar(c: xgr.GrammarCompiler, kind: str, source: str) -> xgr.CompiledGrammar:
    """`source` of `kind` (GrammarSpec) compiled by `c`. Raises what xgrammar raises."""
    if kind == "json_schema":
        return c.compile_json_schema(source, any_whitespace=True, max_whitespace_cnt=_MAX_WHITESPACE_IN_JSON,
                                     strict_mode=True)  # fmt: skip
    if kind == "json_object":
        return c.compile_json_schema('{"type": "object"}', any_whitespace=True,
                                     max_whitespace_cnt=_MAX_WHITESPACE_IN_JSON, strict_mode=False)  # fmt: skip
    if kind == "regex":
        return c.compile_regex(source)
    if kind == "choice":
        return c.compile_grammar(choice_ebnf(json.loads(source)))
    if kind == "grammar":
        return c.compile_grammar(source)
    if kind == "after_reasoning":
        return c.compile_structural_tag(after_reasoning_tag(json.loads(source)))
    return c.compile_structural_tag(tool_call_tag(json.loads(source)))


def after_reasoning_tag(spec: dict[str, Any]) -> dict[str, Any]:
    """The structural tag of an after_reasoning spec (GrammarSpec.after_reasoning): reasoning (any text
    without the excluded strings, up to the end marker), a little whitespace, then the inner grammar."""
    text: dict[str, Any] = {"type": "any_text"}
    if spec["excludes"]:
        text["excludes"] = spec["excludes"]  # strings that would end the reasoning for the parser
    reasoning = {"type": "tag", "begin": "", "content": text, "end": spec["end"]}
    space = {"type": "regex", "pattern": f"[ \\n]{{0,{_MAX_WHITESPACE_AFTER_REASONING}}}"}
    elements = [reasoning, space, _inner_format(spec["kind"], spec["source"])]
    return {"type": "structural_tag", "format": {"type": "sequence", "elements": elements}}


def _inner_format(kind: str, source: str) -> dict[str, Any]:
    """A grammar of `kind` as a structural-tag format (what after_reasoning runs once reasoning ended)."""
    if kind in ("json_schema", "json_object"):
        schema = json.loads(source) if kind == "json_schema" else {"type": "object"}
        return {"type": "json_schema", "json_schema": schema, "max_whitespace_cnt": _MAX_WHITESPACE_IN_JSON}
    if kind == "regex":
        return {"type": "regex", "pattern": source}
    if kind == "choice":
        return {"type": "grammar", "grammar": choice_ebnf(json.loads(source))}
    if kind == "grammar":
        return {"type": "grammar", "grammar": source}
    return tool_call_tag(json.loads(source))["format"]


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


def error_message(exc: Exception) -> str:
    """xgrammar's error as one line, without its C++ log prefix."""
    text = str(exc).strip().splitlines()
    first = _LOG_PREFIX.sub("", text[0]) if text else type(exc).__name__
    return first or type(exc).__name__
