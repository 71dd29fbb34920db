"""POST /v1/responses: OpenAI's Responses API, not stored. `input` is a string or a list of messages
(`instructions` becomes a leading system message); the answer is one assistant message with one
`output_text` part, as JSON or as the API's typed stream events (response.created ... response.completed).
Nothing is kept after the response: `previous_response_id` and `background` get 400, `store` is
answered false. Tools and structured `text.format` are not taken here (400 naming the field).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncGenerator
from typing import Annotated, Any

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import ConfigDict, Field
from sse_starlette import ServerSentEvent

from engine.tokenization import message_texts
from server.api.choices import start_choices
from server.api.protocol import Bool, Int, SamplingFields
from server.api.respond import Call, ChoiceEvents, generation, respond
from server.http import sse
from server.http.errors import ApiError
from server.ops.feedback import RecordKey
from server.prompt.chat import TEXT_PART_TYPES, ChatMessage, ContentPart, chat_prompt, template_messages
from server.prompt.codec import check_prompt_bytes
from server.serving.dispatch import cache_scope, picked, request_owner
from server.serving.gateway import GenerationRequest
from server.serving.handle import Completed, Handle
from server.serving.ticket import Finished, Ticket, Tokens

router = APIRouter(prefix="/v1")

_ROLES = ("user", "assistant", "system", "developer")


class ResponsesRequest(SamplingFields):
    """Body of POST /v1/responses (the fields that change the answer; others are ignored)."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    input: Annotated[str, Field(min_length=1)] | Annotated[list[dict[str, Any]], Field(min_length=1)]
    instructions: str | None = None
    max_output_tokens: Annotated[int, Field(ge=1)] | None = None
    stream: Bool = False
    store: Bool | None = None  # answered false: nothing is stored
    previous_response_id: str | None = None
    background: Bool | None = None
    tools: list[Any] | None = None
    text: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None
    user: str | None = None
    top_logprobs: Int | None = None

    def check(self) -> None:
        for name in ("previous_response_id", "background"):
            if getattr(self, name):
                raise ApiError(400, "invalid_request", f"{name} is not supported: responses are not stored",
                               param=name)  # fmt: skip
        if self.tools:
            raise ApiError(400, "invalid_request", "tools are not supported on /v1/responses (use chat "
                           "completions)", param="tools")  # fmt: skip
        fmt = (self.text or {}).get("format")
        if fmt is not None and not (isinstance(fmt, dict) and isinstance(fmt.get("type", "text"), str)):
            raise ApiError(400, "invalid_request", "text.format must be an object with a string `type` "
                           '(e.g. {"type": "text"})', param="text.format")  # fmt: skip
        kind = (fmt or {}).get("type", "text")
        if kind != "text":
            raise ApiError(400, "invalid_request", f"text.format {kind!r} is not supported on /v1/responses",
                           param="text.format")  # fmt: skip

    def messages(self) -> list[ChatMessage]:
        """`instructions` and `input` as chat messages. Raises ApiError 400 naming the item."""
        out = [ChatMessage(role="system", content=self.instructions)] if self.instructions else []
        if isinstance(self.input, str):
            return [*out, ChatMessage(role="user", content=self.input)]
        for i, item in enumerate(self.input):
            out.append(_message(item, f"input.{i}"))
        return out


def _message(item: dict[str, Any], field: str) -> ChatMessage:
    if item.get("type", "message") != "message":
        raise ApiError(400, "invalid_request", f"input item type {item.get('type')!r} is not supported (messages "
                       "only)", param=f"{field}.type")  # fmt: skip
    role = item.get("role")
    if role not in _ROLES:
        raise ApiError(400, "invalid_request", f"role must be one of {', '.join(_ROLES)}", param=f"{field}.role")
    content = item.get("content")
    if isinstance(content, str):
        return ChatMessage(role=role, content=content)
    if not isinstance(content, list):
        raise ApiError(400, "invalid_request", "content must be a string or a list of parts",
                       param=f"{field}.content")  # fmt: skip
    parts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in TEXT_PART_TYPES:
            kind = part.get("type") if isinstance(part, dict) else part
            raise ApiError(400, "invalid_request", f"content part type {kind!r} is not supported (text only)",
                           param=f"{field}.content.{j}.type")  # fmt: skip
        parts.append(ContentPart(type="text", text=part.get("text")))
    return ChatMessage(role=role, content=parts)


# The preamble (server/api/respond.py generation): runtime, readiness check, parsed body.
ResponsesCall = Annotated[Call[ResponsesRequest], generation(ResponsesRequest)]


@router.post("/responses")
async def responses(request: Request, call: ResponsesCall) -> Response:
    rt, body = call.runtime, call.body
    body.check()
    messages = body.messages()
    with picked(rt, body.model) as (slot, lease):
        dep = lease.deployment
        texts = message_texts(template_messages(messages, dep.codec.content_format))
        check_prompt_bytes(dep.codec, texts, body.max_output_tokens or 1, dep.max_model_len, "input",
                           max_tokens_field="max_output_tokens")  # fmt: skip
        ids = await chat_prompt(dep.codec, messages, {"add_generation_prompt": True})
        max_tokens = body.max_output_tokens or max(1, dep.max_model_len - len(ids))
        params = body.sampling_params(max_tokens, None)
        shape = ResponseShape(body, slot.name, dep.version)
        req = GenerationRequest(shape.id, ids, params, body.lane(), body.timeout_s, body.first_token_timeout_s,
                                body.cache, cache_scope(rt, request, body.user), max_tokens_field="max_output_tokens",
                                record=RecordKey(request_owner(rt, request, body.user), shape.id))  # fmt: skip
        handles = await start_choices(rt, request, lease, [[req]])
    return await respond(rt, request, handles, shape, body.stream)


class ResponseShape:
    """The Response object and its stream events, for one request."""

    def __init__(self, body: ResponsesRequest, model: str, version: str) -> None:
        self.asked = body  # the request body
        self.model = model
        self.version = version
        self.id = f"resp_{uuid.uuid4().hex}"
        self.item_id = f"msg_{uuid.uuid4().hex}"
        self.created = int(time.time())
        self._seq = 0

    # -- the two answers (server/api/respond.py Shape) ------------------------------------------------
    def body(self, handles: list[Handle], done: list[Completed]) -> dict[str, Any]:
        return self.response(done[0].ticket, done[0].text, done[0].finished.reason)

    async def stream(self, handles: list[Handle], events: ChoiceEvents) -> AsyncGenerator[ServerSentEvent, None]:
        """The Responses API's typed events: created, in_progress, the item and part opened, text deltas,
        then everything closed and `response.completed` (or `incomplete`); `error` ends it."""
        ticket, text = handles[0].ticket, ""
        yield self.event("response.created", response=self.response(ticket, "", None))
        yield self.event("response.in_progress", response=self.response(ticket, "", None))
        yield self.event("response.output_item.added", output_index=0, item=self.message("", "in_progress"))
        yield self.event("response.content_part.added", **self.where(), part=self.part(""))
        async for _, event in events:
            if isinstance(event, Tokens) and event.output.text_delta:
                text += event.output.text_delta
                yield self.event("response.output_text.delta", **self.where(), delta=event.output.text_delta,
                                 logprobs=[])  # fmt: skip
            elif isinstance(event, Finished) and event.error is not None:
                yield self.event("error", code=event.error.kind, message=event.error.message, param=None)
                return
            elif isinstance(event, Finished):
                yield self.event("response.output_text.done", **self.where(), text=text, logprobs=[])
                yield self.event("response.content_part.done", **self.where(), part=self.part(text))
                yield self.event("response.output_item.done", output_index=0, item=self.message(text, "completed"))
                final = self.response(ticket, text, event.reason)
                yield self.event(f"response.{final['status']}", response=final)

    def response(self, ticket: Ticket, text: str, reason: str | None) -> dict[str, Any]:
        """The Response object: in progress while `reason` is None, else completed (or incomplete when
        it ran out of max_output_tokens)."""
        b = self.asked
        status = "in_progress" if reason is None else ("incomplete" if reason == "length" else "completed")
        output = [] if reason is None else [self.message(text, "completed" if status == "completed" else "incomplete")]
        prompt = len(ticket.prompt_token_ids)
        usage = None if reason is None else {
            "input_tokens": prompt, "input_tokens_details": {"cached_tokens": ticket.cached_tokens},
            "output_tokens": ticket.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt + ticket.completion_tokens,
        }  # fmt: skip
        return {
            "id": self.id, "object": "response", "created_at": self.created, "status": status,
            "error": None, "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": b.instructions, "max_output_tokens": b.max_output_tokens, "model": self.model,
            "output": output, "parallel_tool_calls": False, "previous_response_id": None,
            "temperature": b.temperature if b.temperature is not None else 1.0,
            "top_p": b.top_p if b.top_p is not None else 1.0, "tool_choice": "none", "tools": [],
            "text": {"format": {"type": "text"}}, "truncation": "disabled", "store": False,
            "metadata": b.metadata or {}, "user": b.user, "usage": usage, "system_fingerprint": self.version,
        }  # fmt: skip

    def message(self, text: str, status: str) -> dict[str, Any]:
        content = [self.part(text)] if status != "in_progress" else []
        return {"id": self.item_id, "type": "message", "status": status, "role": "assistant", "content": content}

    @staticmethod
    def part(text: str) -> dict[str, Any]:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}

    def where(self) -> dict[str, Any]:
        return {"item_id": self.item_id, "output_index": 0, "content_index": 0}

    def event(self, kind: str, **data: Any) -> ServerSentEvent:
        payload = {"type": kind, "sequence_number": self._seq, **data}
        self._seq += 1
        return sse.event(json.dumps(payload, separators=(",", ":"), ensure_ascii=False), kind)
