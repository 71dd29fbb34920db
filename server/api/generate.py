"""POST /generate: the native API. Streams SSE (`token`... then `done`, or `error`) or answers JSON.
Every answer names the model version that produced it (`model_version`, header X-Model-Version).
A TGI body (`inputs` and no `prompt` or `prompt_token_ids`) goes to TGI's handler (server/api/tgi.py);
`inputs` beside a native prompt is a 422 naming `inputs`."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncGenerator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import ValidationError
from sse_starlette import ServerSentEvent

from engine.api import RequestOutput, TokenLogprob
from server.api.choices import start_choices
from server.api.protocol import GenerateRequest, parse_body
from server.api.respond import Call, ChoiceEvents, respond
from server.api.tgi import TGIRequest, tgi_generate
from server.http import sse
from server.http.errors import ApiError, validation_to_api_error
from server.http.json_limits import check_depth
from server.ops.feedback import RecordKey
from server.prompt.codec import PromptCodec, check_prompt_bytes
from server.serving.dispatch import cache_scope, picked, request_owner, request_tenant
from server.serving.gateway import GenerationRequest
from server.serving.handle import Completed, Handle
from server.serving.runtime import Runtime
from server.serving.ticket import Finished, Ticket, Tokens

DEFAULT_MAX_TOKENS = 16
_NATIVE_PROMPTS = frozenset({"prompt", "prompt_token_ids"})

router = APIRouter()


@router.post("/generate")
async def generate(request: Request) -> Response:
    rt: Runtime = request.app.state.runtime
    rt.readiness.check_accepting()
    body = await _native_or_tgi(request)
    if isinstance(body, TGIRequest):
        return await tgi_generate(request, Call(rt, body))
    async with picked(rt, body.model) as (_, lease):
        dep = lease.deployment
        max_tokens = body.max_tokens if body.max_tokens is not None else DEFAULT_MAX_TOKENS
        ids = await _prompt_ids(dep.codec, dep.max_model_len, body, max_tokens)
        params = body.sampling_params(max_tokens, body.logprobs)
        request_id = body.request_id or f"gen-{uuid.uuid4().hex}"
        req = GenerationRequest(request_id, ids, params, body.lane(), body.timeout_s, body.first_token_timeout_s,
                                body.cache, cache_scope(rt, request, body.user),
                                record=RecordKey(request_owner(rt, request, body.user), request_id),
                                tenant=request_tenant(rt, request, body.user))  # fmt: skip
        handles = await start_choices(rt, request, lease, [[req]])
    return await respond(rt, request, handles, NativeShape(body.logprobs is not None), body.stream)


async def _native_or_tgi(request: Request) -> GenerateRequest | TGIRequest:
    """The body as ours, or as TGI's when it is TGI's: `inputs` without a native prompt field."""
    raw = await request.body()
    check_depth(raw, "body")
    try:
        return GenerateRequest.model_validate_json(raw)
    except ValidationError as exc:
        errors = exc.errors()
    if not any(e.get("type") == "extra_forbidden" and tuple(e.get("loc", ())) == ("inputs",) for e in errors):
        raise validation_to_api_error(request.url.path, errors)
    if _NATIVE_PROMPTS.isdisjoint(json.loads(raw)):  # an extra field was found: the body is a JSON object
        return await parse_body(request, TGIRequest)
    raise ApiError(422, "invalid_request", "inputs is TGI's prompt field and this body has a native one: send "
                   "prompt (or prompt_token_ids) with our fields, or inputs and parameters (TGI's body)",
                   param="inputs")  # fmt: skip


async def _prompt_ids(codec: PromptCodec, max_model_len: int, body: GenerateRequest, max_tokens: int) -> list[int]:
    if (body.prompt is None) == (body.prompt_token_ids is None):
        raise ApiError(400, "invalid_request", "give exactly one of prompt or prompt_token_ids", param="prompt")
    if body.prompt is not None:
        check_prompt_bytes(codec, [body.prompt], max(max_tokens, 1), max_model_len, "prompt")
        return await codec.encode(body.prompt)
    return list(body.prompt_token_ids or [])


class NativeShape:
    """/generate's answer: `token` events (one per token, a step's text on its last token) then `done`
    (or `error`), or one JSON body."""

    def __init__(self, want_logprobs: bool) -> None:
        self.want_logprobs = want_logprobs

    def body(self, handles: list[Handle], done: list[Completed]) -> dict[str, Any]:
        return _result(done[0], handles[0], self.want_logprobs)

    async def stream(self, handles: list[Handle], events: ChoiceEvents) -> AsyncGenerator[ServerSentEvent, None]:
        handle, index = handles[0], 0
        async for _, event in events:
            if isinstance(event, Tokens):
                for data in _token_events(handle.request_id, index, event.output, self.want_logprobs):
                    yield sse.event(_json(data), "token")
                index += len(event.output.new_token_ids)
            elif isinstance(event, Finished):
                if event.error is not None:
                    error = {"error": {"type": event.error.kind, "message": event.error.message}}
                    yield sse.event(_json(error), "error")
                else:
                    yield sse.event(_json(_done(handle, event)), "done")


def _token_events(request_id: str, index: int, out: RequestOutput, want_logprobs: bool) -> list[dict[str, Any]]:
    """One event per new token; the step's text goes with its last token."""
    if not out.new_token_ids:
        return [{"id": request_id, "index": index, "token_id": None, "text": out.text_delta}]
    events = []
    last = len(out.new_token_ids) - 1
    for i, token_id in enumerate(out.new_token_ids):
        data: dict[str, Any] = {
            "id": request_id, "index": index + i, "token_id": token_id, "text": out.text_delta if i == last else "",
        }  # fmt: skip
        if want_logprobs and out.logprobs and i < len(out.logprobs):
            data["logprobs"] = _logprob(out.logprobs[i])
        events.append(data)
    return events


def _logprob(lp: TokenLogprob) -> dict[str, Any]:
    return {"logprob": lp.logprob, "top": [{"token_id": t, "logprob": v} for t, v in lp.top]}


def usage(ticket: Ticket, cached: bool = False) -> dict[str, Any]:
    """Token counts; `cached: true` only when the response cache answered."""
    counts: dict[str, Any] = {
        "prompt_tokens": len(ticket.prompt_token_ids),
        "completion_tokens": ticket.completion_tokens,
        "cached_tokens": ticket.cached_tokens,
    }
    if cached:
        counts["cached"] = True
    return counts


def _done(handle: Handle, finished: Finished) -> dict[str, Any]:
    ticket = handle.ticket
    return {"id": ticket.request_id, "finish_reason": finished.reason, "usage": usage(ticket, handle.cached),
            "timing": ticket.timing(), "model_version": handle.version}


def _result(done: Completed, handle: Handle, want_logprobs: bool) -> dict[str, Any]:
    body = {
        "id": done.ticket.request_id,
        "text": done.text,
        "token_ids": done.token_ids,
        "finish_reason": done.finished.reason,
        "usage": usage(done.ticket, handle.cached),
        "timing": done.ticket.timing(),
        "model_version": handle.version,
    }
    if want_logprobs:
        body["logprobs"] = [{"token_id": lp.token_id, **_logprob(lp)} for lp in done.logprobs]
    return body


def _json(data: Any) -> str:
    return json.dumps(data, separators=(",", ":"), ensure_ascii=False)
