"""Structured outputs on the OpenAI routes: the request fields that ask for one, read into a
`GrammarSpec`, and its compilation off the event loop and off the engine thread.

Fields (one of them per request; two -> 400 naming the second):
  response_format  {"type": "json_object"} | {"type": "json_schema", "json_schema": {"schema": ...}}
  structured_outputs  vLLM's {"json" | "regex" | "choice" | "grammar" | "json_object": ...}
  guided_json, guided_regex, guided_choice, guided_grammar  vLLM's older names

`GrammarService` compiles through the grammar compiler of the engine that answers (each model version
has its own: server/serving/deployment.py), off the event loop, within `structured_compile_timeout_s`
(in the engine's compile worker processes, which kill a compile past it). A source over
`structured_max_grammar_bytes`, a spec that does not compile, compiles too large, allows no output or
does not compile in time is a 400 naming the field; routes ask for the compile only after every other
check of the request passed (server/api/openai.py). Nothing here imports the backend: the compiler
object comes from the engine, like its tokenizer.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from pydantic import BaseModel

from engine.api import InvalidParam, SamplingParams
from engine.structured.backend import GrammarCompiler
from engine.structured.compile_workers import CompileQueueFull
from engine.structured.spec import GrammarDeadEnd, GrammarError, GrammarSpec, GrammarTimeout, GrammarTooLarge
from server.http import json_limits
from server.http.errors import ApiError
from server.prompt.reasoning import ReasoningPlan

# structured_outputs keys that tune vLLM's backends; accepted and ignored (our JSON's whitespace is bounded).
_IGNORED_OPTIONS = {"disable_fallback", "disable_any_whitespace", "disable_additional_properties",
                    "whitespace_pattern", "backend"}  # fmt: skip
_CONSTRAINT_KEYS = ("json", "regex", "choice", "grammar", "json_object")


class StructuredFields(BaseModel):
    """The structured-output fields of /v1/chat/completions and /v1/completions."""

    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None  # ignored: the engine has one backend
    guided_whitespace_pattern: str | None = None  # ignored: JSON is compiled with bounded whitespace


@dataclass(frozen=True)
class GrammarRequest:
    """A grammar a request asked for, and the field that asked (named by a 400)."""

    spec: GrammarSpec
    param: str


def requested_grammar(body: StructuredFields) -> GrammarRequest | None:
    """The one grammar `body` asks for, or None. Raises ApiError 400 naming the field at fault."""
    found = [g for g in (_response_format(body.response_format), _structured_outputs(body.structured_outputs),
                         *_guided(body)) if g is not None]  # fmt: skip
    if len(found) > 1:
        raise ApiError(400, "invalid_request", f"{found[1].param} cannot be combined with {found[0].param}: "
                       "ask for one structured output", param=found[1].param)  # fmt: skip
    return found[0] if found else None


def _response_format(rf: dict[str, Any] | None) -> GrammarRequest | None:
    if rf is None:
        return None
    kind = rf.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return GrammarRequest(GrammarSpec("json_object", ""), "response_format")
    if kind == "json_schema":
        inner = rf.get("json_schema")
        if not isinstance(inner, dict):
            raise _bad("response_format.json_schema", "must be an object with the schema under `schema`")
        if inner.get("schema") is None:  # OpenAI: the schema is optional; without one, any JSON object
            return GrammarRequest(GrammarSpec("json_object", ""), "response_format.json_schema")
        param = "response_format.json_schema.schema"
        return GrammarRequest(GrammarSpec.json_schema(_schema(inner["schema"], param)), param)
    raise _bad("response_format.type", f"must be text, json_object or json_schema, got {kind!r}")


def _structured_outputs(so: dict[str, Any] | None) -> GrammarRequest | None:
    if so is None:
        return None
    for key in so:
        if key not in _CONSTRAINT_KEYS and key not in _IGNORED_OPTIONS:
            raise _bad(f"structured_outputs.{key}", f"is not supported (use one of {', '.join(_CONSTRAINT_KEYS)})")
    given = [k for k in _CONSTRAINT_KEYS if so.get(k) not in (None, False)]
    if len(given) != 1:
        raise _bad("structured_outputs", f"give exactly one of {', '.join(_CONSTRAINT_KEYS)}, got {len(given)}")
    key = given[0]
    return _constraint(key, so[key], f"structured_outputs.{key}")


def _guided(body: StructuredFields) -> list[GrammarRequest | None]:
    pairs = (("json", body.guided_json), ("regex", body.guided_regex), ("choice", body.guided_choice),
             ("grammar", body.guided_grammar))  # fmt: skip
    return [_constraint(key, value, f"guided_{key}") for key, value in pairs if value is not None]


def _constraint(key: str, value: Any, param: str) -> GrammarRequest:
    if key == "json":
        return GrammarRequest(GrammarSpec.json_schema(_schema(value, param)), param)
    if key == "json_object":
        if value is not True:
            raise _bad(param, "must be true")
        return GrammarRequest(GrammarSpec("json_object", ""), param)
    if key == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) for c in value):
            raise _bad(param, "must be a non-empty list of strings")
        return GrammarRequest(GrammarSpec.choice(value), param)
    if not isinstance(value, str) or not value:
        raise _bad(param, "must be a non-empty string")
    return GrammarRequest(GrammarSpec(key, value), param)


def _schema(value: Any, param: str) -> dict[str, Any]:
    """A JSON schema given as an object or as JSON text."""
    if isinstance(value, str):
        try:
            value = json_limits.loads(value, param)
        except ValueError as exc:
            raise _bad(param, f"is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise _bad(param, "must be a JSON schema object")
    return value


def _bad(param: str, message: str) -> ApiError:
    return ApiError(400, "invalid_request", f"{param} {message}", param=param)


def behind_reasoning(plan: ReasoningPlan | None,
                     asked: GrammarRequest | None) -> tuple[ReasoningPlan | None, GrammarRequest | None]:  # fmt: skip
    """A request's reasoning plan and grammar under a reasoning parser: a grammar (structured output or
    tool calls) applies to the text after the reasoning, so when the output starts in reasoning the
    grammar is wrapped to let the reasoning run up to its end marker first (GrammarSpec.after_reasoning).
    With `include_reasoning` false the grammar holds from the first token, as vLLM does, and the output
    is then read as content."""
    if plan is None or asked is None or not plan.thinking:
        return plan, asked
    if not plan.include:
        return replace(plan, thinking=False), asked
    wrapped = GrammarSpec.after_reasoning(asked.spec, plan.fmt.end, plan.fmt.also_ends)  # qwen3: no <tool_call> inside
    return plan, GrammarRequest(wrapped, asked.param)


def with_grammar(params: SamplingParams, spec: GrammarSpec | None) -> SamplingParams:
    """params constrained by `spec` (compiled). Raises ApiError 400 for a combination the engine refuses."""
    if spec is None:
        return params
    try:
        return replace(params, structured=spec)
    except InvalidParam as exc:
        raise ApiError(400, "invalid_request", exc.message, param=exc.field) from None


# tokenmill_grammar_rejections_total's reasons (server/ops/metrics.py)
REJECTION_REASONS = ("source_too_large", "compiled_too_large", "invalid", "allows_nothing", "timeout", "queue_full",
                     "no_backend")  # fmt: skip


@dataclass(frozen=True)
class GrammarObserver:
    """Where the service reports (the version's metrics): compile time by outcome (ok, error, timeout;
    answers from the cache are not observed) and rejections by reason (REJECTION_REASONS)."""

    compiled: Callable[[str, float], None] = lambda outcome, seconds: None
    rejected: Callable[[str], None] = lambda reason: None


class GrammarService:
    """Compiles one model version's grammars through its engine's compiler, never on the event loop or
    the engine thread. A source over `max_source_bytes` is refused before anything compiles. With a
    `budgeted` compiler (worker processes) a compile past `timeout_s` is killed; otherwise it goes on in
    the compiler's thread after its 400, and lands in the cache, so a retry may find it."""

    def __init__(self, compiler: GrammarCompiler | None, timeout_s: float, max_source_bytes: int = 65536,
                 observer: GrammarObserver | None = None) -> None:  # fmt: skip
        self.compiler = compiler
        self.timeout_s = timeout_s
        self.max_source_bytes = max_source_bytes
        self.observer = observer or GrammarObserver()

    def check(self, asked: GrammarRequest) -> None:
        """The bounds that need no compile: a backend, the source's size. Raises ApiError 400 naming the field."""
        if self.compiler is None:
            self.observer.rejected("no_backend")
            raise _bad(asked.param, "cannot be served: structured outputs are off for this model (no grammar backend)")
        size = len(asked.spec.source.encode())
        if size > self.max_source_bytes:
            self.observer.rejected("source_too_large")
            raise _bad(asked.param, f"is {size} bytes as a grammar, more than structured_max_grammar_bytes "
                       f"({self.max_source_bytes})")  # fmt: skip

    async def compile(self, asked: GrammarRequest) -> GrammarSpec:
        """asked.spec with its compiled grammar. Raises ApiError 400 naming asked.param (429 when the
        compile queue is full)."""
        self.check(asked)
        compiler = self.compiler
        assert compiler is not None  # check() refused it otherwise
        hit = compiler.cached(asked.spec)
        started = time.monotonic()
        work = asyncio.wrap_future(compiler.submit(asked.spec, self.timeout_s))
        try:
            # A budgeted compiler stops the compile itself (worker start-up and queue wait not counted).
            compiled = await (work if compiler.budgeted else asyncio.wait_for(work, self.timeout_s))
        except (asyncio.TimeoutError, GrammarTimeout):
            self._observe(hit, "timeout", started, "timeout")
            raise _bad(asked.param, f"did not compile within {self.timeout_s:g}s "
                       "(structured_compile_timeout_s)") from None  # fmt: skip
        except CompileQueueFull as exc:
            self.observer.rejected("queue_full")
            raise ApiError(429, "overloaded", str(exc), headers={"Retry-After": "1"}) from None
        except GrammarError as exc:
            reason = ("compiled_too_large" if isinstance(exc, GrammarTooLarge)
                      else "allows_nothing" if isinstance(exc, GrammarDeadEnd) else "invalid")  # fmt: skip
            self._observe(hit, "error", started, reason)
            raise _bad(asked.param, f"does not compile: {exc}") from None
        self._observe(hit, "ok", started)
        return asked.spec.with_compiled(compiled, asked.param)

    def _observe(self, hit: bool, outcome: str, started: float, reason: str | None = None) -> None:
        if not hit:
            self.observer.compiled(outcome, time.monotonic() - started)
        if reason is not None:
            self.observer.rejected(reason)

    def cache_size(self) -> tuple[int, int] | None:
        """(grammars, bytes) in the compiler's cache; None without a backend."""
        if self.compiler is None:
            return None
        st = self.compiler.stats()
        return st.entries, st.bytes

    def close(self) -> None:
        """Nothing to release: the compiler (and its worker processes) belong to the engine."""
