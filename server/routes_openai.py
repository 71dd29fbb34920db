"""OpenAI-compatible API: /v1/models (and /v1/models/{id}), /v1/completions, /v1/chat/completions,
streaming and not. Extensions accepted on both: top_k, min_p, repetition_penalty, ignore_eos,
min_tokens, stop_token_ids, priority, timeout_s, first_token_timeout_s, cache (the same fields as
/generate). `model` may pin a version (`name@version`); every body and chunk carries the version in
`system_fingerprint`. Several choices (a list of prompts, `n`) are several engine requests
(server/choices.py); `echo` returns the prompt, with its token log-probabilities when `logprobs` is set.
Structured outputs (response_format, structured_outputs, guided_*) on both: server/structured.py; tools
on chat: server/tools.py (each choice parses its own calls).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from sse_starlette import ServerSentEvent

from engine.api import SamplingParams, TokenLogprob
from engine.tokenization import message_texts
from server import sse
from server.chat import template_messages
from server.choices import ChoiceStreams, Handle, collect_choices, sample_params, start_choices
from server.deployment import Lease
from server.errors import ApiError
from server.gateway import Completed, GenerationRequest
from server.protocol import ChatRequest, CompletionRequest, OpenAIFields, parse_body
from server.runtime import Runtime
from server.serving import MODEL_VERSION_HEADER, cache_scope, picked
from server.structured import GrammarRequest, requested_grammar, with_grammar
from server.ticket import Finished, Ticket, Tokens
from server.tokens import PromptCodec, check_prompt_bytes
from server.tool_parser import ToolParser
from server.tools import finish_reason, message_with_calls, plan_tools

COMPLETION_DEFAULT_MAX_TOKENS = 16
MAX_CHOICES = 1024  # prompts x n in one request

router = APIRouter(prefix="/v1")


@router.get("/models")
async def models(request: Request) -> dict[str, Any]:
    rt: Runtime = request.app.state.runtime
    return {"object": "list", "data": rt.models.cards(rt.created)}


@router.get("/models/{model_id:path}")
async def model_card(request: Request, model_id: str) -> dict[str, Any]:
    """One model's card (the SDK's models.retrieve); a name, an alias or name@version. 404 otherwise."""
    rt: Runtime = request.app.state.runtime
    slot, _ = rt.models.resolve(model_id)
    return next(card for card in rt.models.cards(rt.created) if card["id"] == slot.name)


@router.post("/completions")
async def completions(request: Request) -> Response:
    rt: Runtime = request.app.state.runtime
    rt.check_accepting()
    body = await parse_body(request, CompletionRequest)
    body.check_unsupported()
    if body.suffix:
        raise ApiError(400, "invalid_request", "suffix is not supported (no model served here does fill-in-the-"
                       "middle)", param="suffix")  # fmt: skip
    max_tokens = next((m for m in (body.max_tokens, body.max_completion_tokens) if m is not None),
                      COMPLETION_DEFAULT_MAX_TOKENS)  # fmt: skip
    if max_tokens == 0 and not body.echo:
        raise ApiError(400, "invalid_request", "max_tokens must be >= 1 (0 only with echo)", param="max_tokens")
    asked = requested_grammar(body)
    with picked(rt, body.model) as (slot, lease):
        dep = lease.deployment
        prompts = await _completion_prompts(dep.codec, dep.max_model_len, body.prompt, max_tokens,
                                            body.add_special_tokens)  # fmt: skip
        cut = [(_truncated(ids, body.truncate_prompt_tokens), ids, text) for ids, text in prompts]
        prompts = [(kept, text if kept is ids else None) for kept, ids, text in cut]  # echo what ran
        extra: dict[str, Any] = {"logit_bias": body.bias()}
        if body.echo and (body.logprobs is not None or max_tokens == 0):  # max_tokens 0: the engine runs the prompt
            extra["prompt_logprobs"] = body.logprobs or 0
        spec = await dep.grammars.compile(asked) if asked is not None else None
        params = with_grammar(body.sampling_params(max_tokens, body.logprobs, **extra), spec)
        shape = _CompletionShape(lease, slot.name, f"cmpl-{uuid.uuid4().hex}", body.choices_per_prompt,
                                 prompts if body.echo else None)  # fmt: skip
        handles = await _start(rt, request, body, [ids for ids, _ in prompts], params, shape, lease)
    return await _respond(rt, request, body, handles, shape)


@router.post("/chat/completions")
async def chat_completions(request: Request) -> Response:
    rt: Runtime = request.app.state.runtime
    rt.check_accepting()
    body = await parse_body(request, ChatRequest)
    body.check_unsupported()
    body.check_chat_fields()
    output = requested_grammar(body)
    with picked(rt, body.model) as (slot, lease):
        dep = lease.deployment
        tools = plan_tools(body, body.messages, template_messages(body.messages, dep.codec.content_format),
                           dep.tool_template, dep.tool_parser, dep.grammars.compiler is not None)  # fmt: skip
        grammar = _one_grammar(output, tools.grammar)
        messages = tools.messages
        asked = next((m for m in (body.max_completion_tokens, body.max_tokens) if m is not None), None)
        check_prompt_bytes(dep.codec, message_texts(messages), max(asked or 1, 1), dep.max_model_len, "messages")
        try:
            ids = await dep.codec.chat(messages, body.render_options(), tools.template_tools)
        except ApiError:
            raise
        except Exception as exc:
            raise ApiError(400, "invalid_request", f"chat template failed: {exc}", param="messages") from None
        ids = _truncated(ids, body.truncate_prompt_tokens)
        # Without a limit, a chat reply may fill the context (OpenAI's behaviour): the model's, or the KV
        # cache's when that is smaller (dep.max_model_len is the smaller of the two).
        max_tokens = asked if asked is not None else max(1, dep.max_model_len - len(ids))
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        spec = await dep.grammars.compile(grammar) if grammar is not None else None
        params = with_grammar(body.sampling_params(max_tokens, logprobs, logit_bias=body.bias()), spec)
        shape = _ChatShape(lease, slot.name, f"chatcmpl-{uuid.uuid4().hex}", body.choices_per_prompt,
                           tools.new_parser)  # fmt: skip
        handles = await _start(rt, request, body, [ids], params, shape, lease)
    return await _respond(rt, request, body, handles, shape)


def _one_grammar(output: GrammarRequest | None, calls: GrammarRequest | None) -> GrammarRequest | None:
    """The structured output or the tool calls' grammar: one request cannot have both."""
    if output is not None and calls is not None:
        raise ApiError(400, "invalid_request", f"{output.param} cannot be combined with tools unless tool_choice "
                       "is none", param=output.param)  # fmt: skip
    return output or calls


def _truncated(ids: list[int], keep: int | None) -> list[int]:
    """vLLM's truncate_prompt_tokens: the last `keep` prompt tokens."""
    return ids if keep is None or len(ids) <= keep else ids[-keep:]


async def _completion_prompts(codec: PromptCodec, max_model_len: int, prompt: str | list[Any], max_tokens: int,
                              add_special_tokens: bool = False) -> list[tuple[list[int], str | None]]:  # fmt: skip
    """Each prompt's token ids and text (None when given as ids): one string, a list of strings, one
    list of token ids, or a list of them."""
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        items: list[Any] = [prompt]
    else:
        items = list(prompt)
    if not items:
        raise ApiError(400, "invalid_request", "prompt must not be empty", param="prompt")
    if len(items) > MAX_CHOICES:
        raise ApiError(400, "invalid_request", f"at most {MAX_CHOICES} prompts per request", param="prompt")
    texts = [p for p in items if isinstance(p, str)]
    check_prompt_bytes(codec, texts, max(max_tokens, 1), max_model_len, "prompt")
    out: list[tuple[list[int], str | None]] = []
    for p in items:
        out.append((await codec.encode(p, add_special_tokens), p) if isinstance(p, str) else (list(p), None))
    return out


async def _start(rt: Runtime, request: Request, body: OpenAIFields, prompts: list[list[int]],
                 params: SamplingParams, shape: _Shape, lease: Lease) -> list[Handle]:  # fmt: skip
    """Admit every choice: `body.n` samples of each prompt (choice index = prompt x n + sample)."""
    n = body.choices_per_prompt
    if len(prompts) * n > MAX_CHOICES:
        raise ApiError(400, "invalid_request", f"prompts x n must be at most {MAX_CHOICES}", param="n")
    scope = cache_scope(rt, request, body.user)

    def choice(p: int, j: int) -> GenerationRequest:
        index = p * n + j
        rid = shape.id if len(prompts) * n == 1 else f"{shape.id}-{index}"
        return GenerationRequest(rid, prompts[p], sample_params(params, j), body.lane(), body.timeout_s,
                                 body.first_token_timeout_s, body.cache, scope)  # fmt: skip

    handles = await start_choices(rt, request, lease, [[choice(p, j) for j in range(n)] for p in range(len(prompts))])
    shape.cached = all(h.cached for h in handles)
    return handles


async def _respond(rt: Runtime, request: Request, body: OpenAIFields, handles: list[Handle],
                   shape: _Shape) -> Response:  # fmt: skip
    want_logprobs = handles[0].ticket.params.logprobs is not None
    headers = {MODEL_VERSION_HEADER: handles[0].version}
    try:
        if not body.stream:
            done = await collect_choices(handles, request)
            return JSONResponse(shape.full(done, want_logprobs), headers=headers)
        if len(handles) == 1:  # several choices were held until admitted (server/choices.py)
            await handles[0].wait_started(rt.settings.sse_ping_s, request)
    except BaseException:
        for h in handles:
            h.close()
        raise
    streams = ChoiceStreams(request, handles, rt.settings.stream_max_pending_tokens)
    stream = _stream(streams, shape, [h.ticket for h in handles], want_logprobs, body.include_usage)
    return streams.response(stream, rt.settings.sse_ping_s, headers=headers)


async def _stream(streams: ChoiceStreams, shape: _Shape, tickets: list[Ticket], want_logprobs: bool,
                  include_usage: bool) -> AsyncIterator[ServerSentEvent]:  # fmt: skip
    extra = {"usage": None} if include_usage else {}
    finished = 0
    try:
        for index in range(len(tickets)):
            first = shape.first_chunk(index)
            if first is not None:
                yield _event({**shape.chunk([first]), **extra})
        async for index, event in streams.events():
            if isinstance(event, Tokens):
                out = event.output
                lps = out.logprobs if want_logprobs else None
                choice = shape.delta(index, out.text_delta, lps, None, out.prompt_logprobs)
                if choice is not None:
                    yield _event({**shape.chunk([choice]), **extra})
            elif isinstance(event, Finished) and event.error is not None:
                yield _event({"error": {"message": event.error.message, "type": event.error.kind, "param": None,
                                        "code": event.error.status}})
                break
            elif isinstance(event, Finished):
                finished += 1
                yield _event({**shape.chunk([shape.finish_delta(index, event.reason)]), **extra})
        if include_usage and finished == len(tickets):
            yield _event({**shape.chunk([]), "usage": shape.usage(tickets)})
        yield sse.event("[DONE]")
    finally:
        streams.close()


def _event(data: dict[str, Any]) -> ServerSentEvent:
    return sse.event(json.dumps(data, separators=(",", ":"), ensure_ascii=False))


class _Shape:
    """How one endpoint lays out its responses; choice `index` = prompt index x n + sample."""

    object_full = ""
    object_chunk = ""

    def __init__(self, lease: Lease, model: str, request_id: str, n: int) -> None:
        self.codec = lease.deployment.codec
        self.model = model
        self.fingerprint = lease.deployment.version  # system_fingerprint: the version that answers
        self.id = request_id
        self.n = n  # samples per prompt
        self.created = int(time.time())
        self.cached = False  # every choice was answered from the response cache

    def usage(self, tickets: list[Ticket]) -> dict[str, Any]:
        """Each prompt counts once (OpenAI's rule for n), with its first sample's cached tokens."""
        firsts = tickets[:: self.n]
        prompt = sum(len(t.prompt_token_ids) for t in firsts)
        completion = sum(t.completion_tokens for t in tickets)
        usage: dict[str, Any] = {"prompt_tokens": prompt, "completion_tokens": completion,
                                 "total_tokens": prompt + completion,
                                 "prompt_tokens_details": {"cached_tokens": sum(t.cached_tokens for t in firsts)}}  # fmt: skip
        if self.cached:
            usage["cached"] = True
        return usage

    def chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.id, "object": self.object_chunk, "created": self.created, "model": self.model,
                "system_fingerprint": self.fingerprint, "choices": choices}

    def full(self, done: list[Completed], want: bool) -> dict[str, Any]:
        choices = [self.full_choice(i, d, want) for i, d in enumerate(done)]
        return {"id": self.id, "object": self.object_full, "created": self.created, "model": self.model,
                "system_fingerprint": self.fingerprint, "choices": choices,
                "usage": self.usage([d.ticket for d in done])}  # fmt: skip

    def first_chunk(self, index: int) -> dict[str, Any] | None:
        return None

    def delta(self, index: int, text: str, lps: list[TokenLogprob] | None, reason: str | None,
              prompt_lps: list[TokenLogprob | None] | None) -> dict[str, Any] | None:  # fmt: skip
        """A stream choice for one step's text; None: nothing to send for it yet."""
        raise NotImplementedError

    def finish_delta(self, index: int, reason: str) -> dict[str, Any]:
        """The stream's last choice: its finish_reason (and what was held back)."""
        choice = self.delta(index, "", None, reason, None)
        assert choice is not None
        return choice

    def full_choice(self, index: int, done: Completed, want: bool) -> dict[str, Any]:
        raise NotImplementedError

    def _token(self, token_id: int) -> str:
        return self.codec.token_text(token_id)


class _CompletionShape(_Shape):
    object_full = "text_completion"
    object_chunk = "text_completion"

    def __init__(self, lease: Lease, model: str, request_id: str, n: int,
                 echo: list[tuple[list[int], str | None]] | None) -> None:  # fmt: skip
        super().__init__(lease, model, request_id, n)
        self.echo = echo  # each prompt's ids and text, when the prompt is echoed
        self._offsets: dict[int, int] = {}  # choice -> text offset of its next token (logprobs)
        self._echoed: set[int] = set()  # choices whose stream carried the prompt already

    def delta(self, index: int, text: str, lps: list[TokenLogprob] | None, reason: str | None,
              prompt_lps: list[TokenLogprob | None] | None) -> dict[str, Any]:  # fmt: skip
        if self.echo is not None and index not in self._echoed and reason is None:
            self._echoed.add(index)
            prefix, logprobs = self._echo(index, prompt_lps, lps)
        else:
            prefix, logprobs = "", self._logprobs(index, lps)
        return {"index": index, "text": prefix + text, "logprobs": logprobs, "finish_reason": reason}

    def full_choice(self, index: int, done: Completed, want: bool) -> dict[str, Any]:
        lps = done.logprobs if want else None
        if self.echo is not None:
            prefix, logprobs = self._echo(index, done.prompt_logprobs, lps)
        else:
            prefix, logprobs = "", self._logprobs(index, lps)
        return {"index": index, "text": prefix + done.text, "logprobs": logprobs, "finish_reason": done.finished.reason}

    def _echo(self, index: int, prompt_lps: list[TokenLogprob | None] | None,
              lps: list[TokenLogprob] | None) -> tuple[str, dict[str, Any] | None]:  # fmt: skip
        """The prompt's text, and the logprobs of the prompt tokens (the first has none) then of `lps`."""
        assert self.echo is not None
        ids, text = self.echo[index // self.n]
        prompt_text = text if text is not None else self.codec.decode(ids)
        if lps is None:
            return prompt_text, None
        entries = prompt_lps if prompt_lps is not None else [None] * len(ids)
        head = self._logprobs(index, [TokenLogprob(t, float("nan")) if e is None else e
                                      for t, e in zip(ids, entries, strict=False)])  # fmt: skip
        assert head is not None
        for i, e in enumerate(entries[: len(ids)]):
            if e is None:  # no log-probability for it (the first token): null, as OpenAI sends
                head["token_logprobs"][i], head["top_logprobs"][i] = None, None
        tail = self._logprobs(index, lps) or {}
        return prompt_text, {key: head[key] + tail.get(key, []) for key in head}

    def _logprobs(self, index: int, lps: list[TokenLogprob] | None) -> dict[str, Any] | None:
        if lps is None:
            return None
        tokens = [self._token(lp.token_id) for lp in lps]
        offsets = []
        offset = self._offsets.get(index, 0)
        for tok in tokens:
            offsets.append(offset)
            offset += len(tok)
        self._offsets[index] = offset
        return {
            "tokens": tokens,
            "token_logprobs": [lp.logprob for lp in lps],
            "top_logprobs": [{self._token(t): v for t, v in lp.top} for lp in lps],
            "text_offset": offsets,
        }


class _ChatShape(_Shape):
    object_full = "chat.completion"
    object_chunk = "chat.completion.chunk"

    def __init__(self, lease: Lease, model: str, request_id: str, n: int,
                 new_parser: Callable[[], ToolParser | None] | None = None) -> None:  # fmt: skip
        super().__init__(lease, model, request_id, n)
        self._new_parser = new_parser  # a tool-call parser per choice (server/tool_parser.py)
        self._parsers: dict[int, ToolParser | None] = {}  # choice -> its parser; None: plain text

    def _tools(self, index: int) -> ToolParser | None:
        if index not in self._parsers:
            self._parsers[index] = self._new_parser() if self._new_parser is not None else None
        return self._parsers[index]

    def first_chunk(self, index: int) -> dict[str, Any] | None:
        return {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                "finish_reason": None}  # fmt: skip

    def delta(self, index: int, text: str, lps: list[TokenLogprob] | None, reason: str | None,
              prompt_lps: list[TokenLogprob | None] | None) -> dict[str, Any] | None:  # fmt: skip
        tools = self._tools(index)
        if tools is None:
            delta = {"content": text} if reason is None else {}
        else:  # content and tool-call pieces as the parser releases them
            delta = (tools.feed(text) if reason is None else tools.finish()).openai()
            if reason is not None:
                reason = finish_reason(reason, tools.calls)
            elif not delta and lps is None:
                return None
        return {"index": index, "delta": delta, "logprobs": self._logprobs(lps), "finish_reason": reason}

    def full_choice(self, index: int, done: Completed, want: bool) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": done.text}
        reason = done.finished.reason
        tools = self._tools(index)
        if tools is not None:
            content = tools.feed(done.text).content + tools.finish().content
            message, reason = message_with_calls(content, tools.calls), finish_reason(reason, tools.calls)
        return {"index": index, "message": message, "logprobs": self._logprobs(done.logprobs if want else None),
                "finish_reason": reason}  # fmt: skip

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
