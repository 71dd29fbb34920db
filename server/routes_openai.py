"""OpenAI-compatible API: /v1/models, /v1/completions, /v1/chat/completions, streaming and not.
Extensions accepted on both: top_k, min_p, repetition_penalty, ignore_eos, min_tokens, stop_token_ids,
priority, timeout_s, first_token_timeout_s, cache (the same fields as /generate). Structured outputs
(response_format, structured_outputs, guided_*) on both: server/structured.py; tools on chat:
server/tools.py. `model` may pin a
version (`name@version`); every body and chunk carries the version in `system_fingerprint`.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from sse_starlette import ServerSentEvent

from engine.api import SamplingParams, TokenLogprob
from engine.tokenization import message_texts
from server import sse
from server.deployment import Lease
from server.errors import ApiError
from server.gateway import GenerationRequest, RequestHandle
from server.protocol import ChatRequest, CompletionRequest, OpenAIFields, parse_body
from server.runtime import Runtime
from server.serving import MODEL_VERSION_HEADER, ReplayHandle, cache_scope, picked, start
from server.stream_guard import StreamGuard
from server.structured import GrammarRequest, requested_grammar, with_grammar
from server.ticket import Finished, Ticket, Tokens
from server.tokens import PromptCodec, check_prompt_bytes
from server.tool_parser import ToolParser
from server.tools import finish_reason, message_with_calls, plan_tools

COMPLETION_DEFAULT_MAX_TOKENS = 16

router = APIRouter(prefix="/v1")


@router.get("/models")
async def models(request: Request) -> dict[str, Any]:
    rt: Runtime = request.app.state.runtime
    return {"object": "list", "data": rt.models.cards(rt.created)}


@router.post("/completions")
async def completions(request: Request) -> Response:
    rt: Runtime = request.app.state.runtime
    rt.check_accepting()
    body = await parse_body(request, CompletionRequest)
    body.check_unsupported()
    if body.echo:
        raise ApiError(400, "invalid_request", "echo is not supported", param="echo")
    if body.suffix:
        raise ApiError(400, "invalid_request", "suffix is not supported", param="suffix")
    asked = requested_grammar(body)
    with picked(rt, body.model) as (slot, lease):
        dep = lease.deployment
        max_tokens = next((m for m in (body.max_tokens, body.max_completion_tokens) if m is not None),
                          COMPLETION_DEFAULT_MAX_TOKENS)
        ids = await _completion_prompt(dep.codec, dep.max_model_len, body.prompt, max_tokens)
        spec = await dep.grammars.compile(asked) if asked is not None else None
        params = with_grammar(body.sampling_params(max_tokens, body.logprobs), spec)
        shape = _CompletionShape(lease, slot.name, f"cmpl-{uuid.uuid4().hex}")
        handle = _start(rt, request, body, ids, params, shape, lease)
    return await _respond(rt, request, body, handle, shape)


@router.post("/chat/completions")
async def chat_completions(request: Request) -> Response:
    rt: Runtime = request.app.state.runtime
    rt.check_accepting()
    body = await parse_body(request, ChatRequest)
    body.check_unsupported()
    output = requested_grammar(body)
    with picked(rt, body.model) as (slot, lease):
        dep = lease.deployment
        tools = plan_tools(body, body.messages, body.template_messages(), dep.tool_template, dep.tool_parser,
                           dep.grammars.compiler is not None)  # fmt: skip
        grammar = _one_grammar(output, tools.grammar)
        messages = tools.messages
        asked = next((m for m in (body.max_completion_tokens, body.max_tokens) if m is not None), None)
        check_prompt_bytes(dep.codec, message_texts(messages), max(asked or 1, 1), dep.max_model_len, "messages")
        try:
            ids = await dep.codec.chat(messages, tools.template_tools)
        except ApiError:
            raise
        except Exception as exc:
            raise ApiError(400, "invalid_request", f"chat template failed: {exc}", param="messages") from None
        # Without a limit, a chat reply may fill the context (OpenAI's behaviour): the model's, or the KV
        # cache's when that is smaller (dep.max_model_len is the smaller of the two).
        max_tokens = asked if asked is not None else max(1, dep.max_model_len - len(ids))
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        spec = await dep.grammars.compile(grammar) if grammar is not None else None
        params = with_grammar(body.sampling_params(max_tokens, logprobs), spec)
        shape = _ChatShape(lease, slot.name, f"chatcmpl-{uuid.uuid4().hex}", tools.new_parser())
        handle = _start(rt, request, body, ids, params, shape, lease)
    return await _respond(rt, request, body, handle, shape)


def _one_grammar(output: GrammarRequest | None, calls: GrammarRequest | None) -> GrammarRequest | None:
    """The structured output or the tool calls' grammar: one request cannot have both."""
    if output is not None and calls is not None:
        raise ApiError(400, "invalid_request", f"{output.param} cannot be combined with tools unless tool_choice "
                       "is none", param=output.param)  # fmt: skip
    return output or calls


async def _completion_prompt(codec: PromptCodec, max_model_len: int, prompt: str | list[Any],
                             max_tokens: int) -> list[int]:  # fmt: skip
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        if len(prompt) != 1:
            raise ApiError(400, "invalid_request", "only one prompt per request is supported", param="prompt")
        prompt = prompt[0]
    if isinstance(prompt, str):
        check_prompt_bytes(codec, [prompt], max(max_tokens, 1), max_model_len, "prompt")
        return await codec.encode(prompt)
    return list(prompt)


def _start(rt: Runtime, request: Request, body: OpenAIFields, ids: list[int], params: SamplingParams,
           shape: _Shape, lease: Lease) -> RequestHandle | ReplayHandle:
    req = GenerationRequest(shape.id, ids, params, body.lane(), body.timeout_s, body.first_token_timeout_s,
                            body.cache, cache_scope(rt, request, body.user))  # fmt: skip
    handle = start(rt, lease, req)
    shape.cached = handle.cached
    return handle


async def _respond(rt: Runtime, request: Request, body: OpenAIFields, handle: RequestHandle | ReplayHandle,
                   shape: _Shape) -> Response:
    want_logprobs = handle.ticket.params.logprobs is not None
    headers = {MODEL_VERSION_HEADER: handle.version}
    try:
        if not body.stream:
            done = await handle.collect(request)
            full = shape.full(done.ticket, done.finished, done.text, done.logprobs, want_logprobs)
            return JSONResponse(full, headers=headers)
        await handle.wait_started(rt.settings.sse_ping_s, request)
    except BaseException:
        handle.close()
        raise
    guard = StreamGuard.for_request(request, handle, rt.settings.stream_max_pending_tokens)
    stream = _stream(guard, shape, want_logprobs, body.include_usage)
    return guard.response(stream, rt.settings.sse_ping_s, headers=headers)


async def _stream(guard: StreamGuard, shape: _Shape, want_logprobs: bool,
                  include_usage: bool) -> AsyncIterator[ServerSentEvent]:
    extra = {"usage": None} if include_usage else {}
    handle = guard.handle
    try:
        first = shape.first_chunk()
        if first is not None:
            yield _event({**shape.chunk([first]), **extra})
        async for event in guard.events():
            if isinstance(event, Tokens):
                out = event.output
                lps = out.logprobs if want_logprobs else None
                choice = shape.delta(out.text_delta, lps, None)
                if choice is not None:
                    yield _event({**shape.chunk([choice]), **extra})
            elif isinstance(event, Finished) and event.error is not None:
                yield _event({"error": {"message": event.error.message, "type": event.error.kind, "param": None,
                                        "code": event.error.status}})
            elif isinstance(event, Finished):
                yield _event({**shape.chunk([shape.finish_delta(event.reason)]), **extra})
                if include_usage:
                    yield _event({**shape.chunk([]), "usage": shape.usage(handle.ticket)})
        yield sse.event("[DONE]")
    finally:
        guard.close()


def _event(data: dict[str, Any]) -> ServerSentEvent:
    return sse.event(json.dumps(data, separators=(",", ":"), ensure_ascii=False))


class _Shape:
    """How one endpoint lays out its responses."""

    object_full = ""
    object_chunk = ""

    def __init__(self, lease: Lease, model: str, request_id: str) -> None:
        self.codec = lease.deployment.codec
        self.model = model
        self.fingerprint = lease.deployment.version  # system_fingerprint: the version that answers
        self.id = request_id
        self.created = int(time.time())
        self.cached = False  # answered from the response cache
        self._offset = 0  # text offset of the next token (completions logprobs)

    def usage(self, ticket: Ticket) -> dict[str, Any]:
        prompt = len(ticket.prompt_token_ids)
        usage: dict[str, Any] = {"prompt_tokens": prompt, "completion_tokens": ticket.completion_tokens,
                                 "total_tokens": prompt + ticket.completion_tokens,
                                 "prompt_tokens_details": {"cached_tokens": ticket.cached_tokens}}  # fmt: skip
        if self.cached:
            usage["cached"] = True
        return usage

    def chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.id, "object": self.object_chunk, "created": self.created, "model": self.model,
                "system_fingerprint": self.fingerprint, "choices": choices}

    def full(self, ticket: Ticket, finished: Finished, text: str, lps: list[TokenLogprob], want: bool) -> dict:
        choice = self.full_choice(text, lps if want else None, finished.reason)
        return {"id": self.id, "object": self.object_full, "created": self.created, "model": self.model,
                "system_fingerprint": self.fingerprint, "choices": [choice], "usage": self.usage(ticket)}

    def first_chunk(self) -> dict[str, Any] | None:
        return None

    def delta(self, text: str, lps: list[TokenLogprob] | None, reason: str | None) -> dict[str, Any] | None:
        """A stream choice for one step's text; None: nothing to send for it yet."""
        raise NotImplementedError

    def finish_delta(self, reason: str) -> dict[str, Any]:
        """The stream's last choice: its finish_reason (and what was held back)."""
        choice = self.delta("", None, reason)
        assert choice is not None
        return choice

    def full_choice(self, text: str, lps: list[TokenLogprob] | None, reason: str) -> dict[str, Any]:
        raise NotImplementedError

    def _token(self, token_id: int) -> str:
        return self.codec.token_text(token_id)


class _CompletionShape(_Shape):
    object_full = "text_completion"
    object_chunk = "text_completion"

    def delta(self, text: str, lps: list[TokenLogprob] | None, reason: str | None) -> dict[str, Any]:
        return {"index": 0, "text": text, "logprobs": self._logprobs(lps), "finish_reason": reason}

    def full_choice(self, text: str, lps: list[TokenLogprob] | None, reason: str) -> dict[str, Any]:
        return {"index": 0, "text": text, "logprobs": self._logprobs(lps), "finish_reason": reason}

    def _logprobs(self, lps: list[TokenLogprob] | None) -> dict[str, Any] | None:
        if lps is None:
            return None
        tokens = [self._token(lp.token_id) for lp in lps]
        offsets = []
        for tok in tokens:
            offsets.append(self._offset)
            self._offset += len(tok)
        return {
            "tokens": tokens,
            "token_logprobs": [lp.logprob for lp in lps],
            "top_logprobs": [{self._token(t): v for t, v in lp.top} for lp in lps],
            "text_offset": offsets,
        }


class _ChatShape(_Shape):
    object_full = "chat.completion"
    object_chunk = "chat.completion.chunk"

    def __init__(self, lease: Lease, model: str, request_id: str, tools: ToolParser | None = None) -> None:
        super().__init__(lease, model, request_id)
        self.tools = tools  # reads tool calls out of the text (server/tool_parser.py); None: plain text

    def first_chunk(self) -> dict[str, Any] | None:
        return {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}

    def delta(self, text: str, lps: list[TokenLogprob] | None, reason: str | None) -> dict[str, Any] | None:
        if self.tools is None:
            delta = {"content": text} if reason is None else {}
        else:  # content and tool-call pieces as the parser releases them
            delta = (self.tools.feed(text) if reason is None else self.tools.finish()).openai()
            if reason is not None:
                reason = finish_reason(reason, self.tools.calls)
            elif not delta and lps is None:
                return None
        return {"index": 0, "delta": delta, "logprobs": self._logprobs(lps), "finish_reason": reason}

    def full_choice(self, text: str, lps: list[TokenLogprob] | None, reason: str) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if self.tools is not None:
            content = self.tools.feed(text).content + self.tools.finish().content
            message, reason = message_with_calls(content, self.tools.calls), finish_reason(reason, self.tools.calls)
        return {"index": 0, "message": message, "logprobs": self._logprobs(lps), "finish_reason": reason}

    def _logprobs(self, lps: list[TokenLogprob] | None) -> dict[str, Any] | None:
        if lps is None:
            return None
        return {"content": [
            {**self._entry(lp.token_id, lp.logprob), "top_logprobs": [self._entry(t, v) for t, v in lp.top]}
            for lp in lps
        ]}  # fmt: skip

    def _entry(self, token_id: int, logprob: float) -> dict[str, Any]:
        text = self._token(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}
