"""Structured outputs on the OpenAI routes: the request fields that ask for one, read into a
`GrammarSpec`, and its compilation off the event loop and off the engine thread.

Fields (one of them per request; two -> 400 naming the second):
  response_format  {"type": "json_object"} | {"type": "json_schema", "json_schema": {"schema": ...}}
  structured_outputs  vLLM's {"json" | "regex" | "choice" | "grammar" | "json_object": ...}
  guided_json, guided_regex, guided_choice, guided_grammar  vLLM's older names

`GrammarService` compiles through the grammar compiler of the engine that answers (each model version
has its own: server/serving/deployment.py), on its own threads, within `structured_compile_timeout_s`. A spec
that does not compile, or not in time, is a 400 naming the field. Nothing here imports the backend:
the compiler object comes from the engine, like its tokenizer.
"""

from __future__ import annotations

import asyncio
import json
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any

from pydantic import BaseModel

from engine.api import GrammarCompiler, GrammarError, GrammarSpec, InvalidParam, SamplingParams
from server.http.errors import ApiError

# structured_outputs keys that tune vLLM's backends; accepted and ignored (our JSON has no free whitespace).
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
    guided_whitespace_pattern: str | None = None  # ignored: JSON is compiled without free whitespace


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
            value = json.loads(value)
        except ValueError as exc:
            raise _bad(param, f"is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise _bad(param, "must be a JSON schema object")
    return value


def _bad(param: str, message: str) -> ApiError:
    return ApiError(400, "invalid_request", f"{param} {message}", param=param)


def with_grammar(params: SamplingParams, spec: GrammarSpec | None) -> SamplingParams:
    """params constrained by `spec` (compiled). Raises ApiError 400 for a combination the engine refuses."""
    if spec is None:
        return params
    try:
        return replace(params, structured=spec)
    except InvalidParam as exc:
        raise ApiError(400, "invalid_request", exc.message, param=exc.field) from None


class GrammarService:
    """Compiles one model version's grammars: its engine's compiler, on `threads` threads of its own (a
    slow compile holds neither the event loop, the tokenizer threads nor the engine). A compile that
    times out goes on in its thread and lands in the compiler's cache, so a retry may find it."""

    def __init__(self, compiler: GrammarCompiler | None, timeout_s: float, threads: int = 2) -> None:
        self.compiler = compiler
        self.timeout_s = timeout_s
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="tokenmill-grammar")

    async def compile(self, asked: GrammarRequest) -> GrammarSpec:
        """asked.spec with its compiled grammar. Raises ApiError 400 naming asked.param."""
        if self.compiler is None:
            raise _bad(asked.param, "cannot be served: structured outputs are off for this model (no grammar backend)")
        work = asyncio.get_running_loop().run_in_executor(self._pool, self.compiler.compile, asked.spec)
        try:
            compiled = await asyncio.wait_for(work, self.timeout_s)
        except asyncio.TimeoutError:
            raise _bad(asked.param, f"did not compile within {self.timeout_s:g}s "
                       "(structured_compile_timeout_s)") from None  # fmt: skip
        except GrammarError as exc:
            raise _bad(asked.param, f"does not compile: {exc}") from None
        return asked.spec.with_compiled(compiled)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
