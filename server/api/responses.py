"""POST /v1/responses: OpenAI's Responses API, not stored. `input` is a string or a list of items:
messages, `function_call` (an earlier call of the model), `function_call_output` (its result) and
`reasoning` (earlier reasoning, given to the assistant turn after it as its `reasoning`);
`instructions` becomes a leading system message. The answer is an assistant message with one
`output_text` part and/or `function_call` items, as JSON or as the API's typed stream events
(response.created ... response.completed). Function tools come in the Responses shape (`{"type":
"function", "name", "description", "parameters", "strict"}`) with `tool_choice` and
`parallel_tool_calls`, and go through the chat path's machinery (server/prompt/tools.py plan_tools, the
tool-call grammar, server/prompt/tool_parser.py). Nothing is kept after the response:
`previous_response_id` and `background` get 400, `store` is answered false. Structured `text.format`
is not taken here (400 naming the field). With --reasoning-parser the reasoning is a `reasoning` output
item before the message (`content`: one `reasoning_text` part, `summary` empty), streamed as vLLM does
(`response.reasoning_text.delta` / `.done`), counted in `output_tokens_details.reasoning_tokens`;
`reasoning.effort` and `chat_template_kwargs` reach the chat template (effort "none" turns thinking off).
"""

from __future__ import annotations

import json
import re
import time
import uuid
from collections.abc import AsyncGenerator, Callable, Sequence
from typing import Annotated, Any

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import ConfigDict, Field
from sse_starlette import ServerSentEvent

from server.api.choices import start_choices
from server.api.protocol import Bool, Int, SamplingFields
from server.api.respond import Call, ChoiceEvents, generation, respond
from server.api.tool_prompt import tool_chat_prompt
from server.http import sse
from server.http.errors import ApiError
from server.http.numbers import MAX_INT
from server.ops.feedback import RecordKey
from server.prompt.chat import TEXT_PART_TYPES, ChatMessage, ContentPart, with_reasoning_effort
from server.prompt.output_reader import OutputDelta, OutputReader
from server.prompt.reasoning import ReasoningPlan, plan_reasoning
from server.prompt.structured import behind_reasoning, with_grammar
from server.prompt.tool_parser import ToolCall, ToolParser
from server.prompt.tools import ToolFields, ToolPlan
from server.serving.dispatch import cache_scope, picked, request_owner, request_tenant
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
    max_output_tokens: Annotated[int, Field(ge=1, le=MAX_INT)] | None = None
    stream: Bool = False
    store: Bool | None = None  # answered false: nothing is stored
    previous_response_id: str | None = None
    background: Bool | None = None
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: Bool | None = None
    text: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None
    user: str | None = None
    top_logprobs: Int | None = None
    reasoning: dict[str, Any] | None = None  # {"effort": ..., "summary": ...}: the effort reaches the template
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's: template variables (enable_thinking, ...)

    def template_kwargs(self) -> dict[str, Any]:
        effort = (self.reasoning or {}).get("effort")
        if effort is not None and not isinstance(effort, str):
            raise ApiError(400, "invalid_request", "reasoning.effort must be a string", param="reasoning.effort")
        return with_reasoning_effort(self.chat_template_kwargs, effort)

    def check(self) -> None:
        for name in ("previous_response_id", "background"):
            if getattr(self, name):
                raise ApiError(400, "invalid_request", f"{name} is not supported: responses are not stored",
                               param=name)  # fmt: skip
        fmt = (self.text or {}).get("format")
        if fmt is not None and not (isinstance(fmt, dict) and isinstance(fmt.get("type", "text"), str)):
            raise ApiError(400, "invalid_request", "text.format must be an object with a string `type` "
                           '(e.g. {"type": "text"})', param="text.format")  # fmt: skip
        kind = (fmt or {}).get("type", "text")
        if kind != "text":
            raise ApiError(400, "invalid_request", f"text.format {kind!r} is not supported on /v1/responses",
                           param="text.format")  # fmt: skip

    def messages(self) -> list[ChatMessage]:
        """`instructions` and `input` as chat messages (consecutive function calls: one assistant turn
        with those tool_calls). Raises ApiError 400 naming the item."""
        out = [ChatMessage(role="system", content=self.instructions)] if self.instructions else []
        if isinstance(self.input, str):
            return [*out, ChatMessage(role="user", content=self.input)]
        thought: str | None = None  # a reasoning item's text, for the assistant turn after it
        for i, item in enumerate(self.input):
            kind, field = item.get("type", "message"), f"input.{i}"
            if kind == "reasoning":
                thought = (thought or "") + _reasoning_text(item, field)
                continue
            if kind == "function_call":
                call = _history_call(item, field)
                if out and out[-1].role == "assistant" and out[-1].tool_calls and not out[-1].content:
                    out[-1].tool_calls.append(call)
                else:
                    out.append(ChatMessage(role="assistant", content=None, tool_calls=[call]))
            elif kind == "function_call_output":
                out.append(_tool_output(item, field))
            else:
                out.append(_message(item, field))
            if out[-1].role == "assistant" and thought is not None:
                out[-1].reasoning, thought = thought, None
        return out

    def tool_fields(self) -> ToolFields:
        """The tool fields in the chat shape plan_tools reads (tools nested under `function`, a named
        tool_choice as {"type": "function", "function": {"name": ...}})."""
        tools = [_chat_tool(t, f"tools.{i}") for i, t in enumerate(self.tools or [])]
        choice = self.tool_choice
        if isinstance(choice, dict) and "function" not in choice:
            choice = {"type": choice.get("type"), "function": {"name": choice.get("name")}}
        return ToolFields(tools=tools, tool_choice=choice, parallel_tool_calls=self.parallel_tool_calls)


_CHAT_TOOL_PARAM = re.compile(r"^tools\.(\d+)\.function(?=\.|$)")


def responses_error(exc: ApiError, body: ResponsesRequest) -> ApiError:
    """plan_tools names fields in the chat shape (`tools.0.function.name`, a tool_choice with
    `function`); a Responses body is flat, so name its own fields: `tools.0.name`, `tool_choice.name`."""
    param, message = exc.param, exc.message
    match = _CHAT_TOOL_PARAM.match(param or "")
    if param is not None and match is not None:
        i = int(match.group(1))
        listed = body.tools or []
        if i < len(listed) and not (isinstance(listed[i], dict) and isinstance(listed[i].get("function"), dict)):
            flat = param[: match.start()] + f"tools.{i}" + param[match.end():]
            param, message = flat, message.replace(param, flat, 1)
    elif param == "tool_choice" and not (isinstance(body.tool_choice, dict) and "function" in body.tool_choice):
        message = message.replace('{"type": "function", "function": {"name": ...}}', '{"type": "function", "name": ...}')
    return ApiError(exc.status, exc.type, message, param=param, headers=exc.headers, extra=exc.extra)


def _chat_tool(tool: Any, field: str) -> Any:
    if not isinstance(tool, dict) or tool.get("type") != "function":
        kind = tool.get("type") if isinstance(tool, dict) else tool
        raise ApiError(400, "invalid_request", f"tool type {kind!r} is not supported (function tools only)",
                       param=f"{field}.type")  # fmt: skip
    if isinstance(tool.get("function"), dict):  # the chat shape, taken too
        return tool
    fn = {k: tool[k] for k in ("name", "description", "parameters") if tool.get(k) is not None}
    return {"type": "function", "function": fn}


def _history_call(item: dict[str, Any], field: str) -> dict[str, Any]:
    """A `function_call` item: `call_id`, `name` and `arguments` (JSON text) are required, as the API
    documents them; the call_id is what its `function_call_output` answers."""
    call_id, name, args = (_required_text(item, key, field) for key in ("call_id", "name", "arguments"))
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}


def _reasoning_text(item: dict[str, Any], field: str) -> str:
    """An earlier reasoning item's text (its reasoning_text parts, else its summary's), which goes to the
    assistant turn after it (templates that replay thinking read it)."""
    parts = item.get("content") or item.get("summary") or []
    if not isinstance(parts, list) or not all(isinstance(p, dict) and isinstance(p.get("text"), str) for p in parts):
        raise ApiError(400, "invalid_request", "a reasoning item's content and summary are lists of parts with "
                       "`text`", param=f"{field}.content")  # fmt: skip
    return "".join(p["text"] for p in parts)


def _tool_output(item: dict[str, Any], field: str) -> ChatMessage:
    call_id = _required_text(item, "call_id", field)
    output = item.get("output")
    if isinstance(output, list):  # output parts: their text
        output = "".join(p.get("text", "") for p in output if isinstance(p, dict))
    if not isinstance(output, str):
        raise ApiError(400, "invalid_request", "output must be a string", param=f"{field}.output")
    return ChatMessage(role="tool", content=output, tool_call_id=call_id)


def _required_text(item: dict[str, Any], key: str, field: str) -> str:
    """item[key], a string (non-empty but for `arguments`); else 400 naming `field.key`."""
    value = item.get(key)
    if not isinstance(value, str) or (not value and key != "arguments"):
        what = "a string" if key == "arguments" else "a non-empty string"
        raise ApiError(400, "invalid_request", f"a {item.get('type')} item needs `{key}`, {what}",
                       param=f"{field}.{key}")  # fmt: skip
    return value


def _message(item: dict[str, Any], field: str) -> ChatMessage:
    if item.get("type", "message") != "message":
        raise ApiError(400, "invalid_request", f"input item type {item.get('type')!r} is not supported (messages, "
                       "function_call, function_call_output and reasoning)", param=f"{field}.type")  # fmt: skip
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
    async with picked(rt, body.model) as (slot, lease):
        dep = lease.deployment
        kwargs = body.template_kwargs()
        ids, tools = await tool_chat_prompt(dep, body.tool_fields(), messages, body.max_output_tokens or 1, "input",
                                            "max_output_tokens", lambda exc: responses_error(exc, body), kwargs)  # fmt: skip
        reasoning, grammar = behind_reasoning(plan_reasoning(dep.reasoning_parser, kwargs, ids, dep.codec.decode),
                                              tools.grammar)  # fmt: skip
        max_tokens = body.max_output_tokens or max(1, dep.max_model_len - len(ids))
        params = body.sampling_params(max_tokens, None)
        if grammar is not None:
            params = with_grammar(params, await dep.grammars.compile(grammar))
        shape = ResponseShape(body, lease.served_name(slot.name), dep.version, tools, reasoning, dep.codec.decode)
        req = GenerationRequest(shape.id, ids, params, body.lane(), body.timeout_s, body.first_token_timeout_s,
                                body.cache, cache_scope(rt, request, body.user), max_tokens_field="max_output_tokens",
                                record=RecordKey(request_owner(rt, request, body.user), shape.id),
                                tenant=request_tenant(rt, request, body.user))  # fmt: skip
        handles = await start_choices(rt, request, lease, [[req]])
    return await respond(rt, request, handles, shape, body.stream)


class ResponseShape:
    """The Response object and its stream events, for one request. With tools, the text goes through
    the tool-call parser: content becomes the message item (only when there is some, or no call), each
    call a `function_call` item after it."""

    def __init__(self, body: ResponsesRequest, model: str, version: str, tools: ToolPlan | None = None,
                 reasoning: ReasoningPlan | None = None, decode: Callable[[list[int]], str] | None = None) -> None:  # fmt: skip
        self.asked = body  # the request body
        self.model = model
        self.version = version
        self.id = f"resp_{uuid.uuid4().hex}"
        self.item_id = f"msg_{uuid.uuid4().hex}"
        self.created = int(time.time())
        self._seq = 0
        self._parser: ToolParser | None = tools.new_parser() if tools is not None else None
        self._reader = OutputReader(reasoning, self._parser)  # reasoning, then content and calls
        self._decode = decode  # token ids -> text (counting reasoning tokens)
        self.reasoning_id = f"rs_{uuid.uuid4().hex}"
        self._thought = ""  # the reasoning streamed so far
        self._thinking = False  # the reasoning item is open in the stream
        self._text = ""  # the message's text streamed so far
        self._open = False  # the message item was added to the stream
        # output_index of each item in the order the stream opened them (the message, the calls)
        self._call_indices: dict[int, int] = {}  # the call's place among the calls -> its output_index
        self._next_index = 0
        self._msg_index = 0  # the message's, set when it opens

    # -- the two answers (server/api/respond.py Shape) ------------------------------------------------
    def body(self, handles: list[Handle], done: list[Completed]) -> dict[str, Any]:
        piece = self._reader.read_all(done[0].text, done[0].token_ids)
        self._thought = piece.reasoning
        return self.response(done[0].ticket, piece.content, done[0].finished.reason, self._reader.calls)

    async def stream(self, handles: list[Handle], events: ChoiceEvents) -> AsyncGenerator[ServerSentEvent, None]:
        """The Responses API's typed events: created, in_progress, the item and part opened, text deltas,
        then everything closed and `response.completed` (or `incomplete`); `error` ends it. A function
        call: its item added (once its name is known), arguments deltas, arguments done, item done."""
        ticket = handles[0].ticket
        yield self.event("response.created", response=self.response(ticket, "", None))
        yield self.event("response.in_progress", response=self.response(ticket, "", None))
        if self._parser is None and not self._reader.parses_reasoning:
            for e in self._open_message():
                yield e
        async for _, event in events:
            if isinstance(event, Tokens):
                pieces = self._reader.feed(event.output.text_delta, event.output.new_token_ids)
                for e in self._stream_delta(pieces):
                    yield e
            elif isinstance(event, Finished) and event.error is not None:
                yield self.event("error", code=event.error.kind, message=event.error.message, param=None)
                return
            elif isinstance(event, Finished):
                for e in self._stream_delta(self._reader.finish()):
                    yield e
                calls = self._reader.calls
                for e in self._close_reasoning():
                    yield e
                for e in self._close_calls(calls):
                    yield e
                if not self._open and not calls:
                    for e in self._open_message():
                        yield e
                if self._open:
                    for e in self._close_message(calls):
                        yield e
                final = self.response(ticket, self._text, event.reason, calls)
                yield self.event(f"response.{final['status']}", response=final)

    def _open_message(self) -> list[ServerSentEvent]:
        self._open = True
        self._msg_index = self._next_index
        self._next_index += 1
        return [self.event("response.output_item.added", output_index=self._msg_index,
                           item=self.message("", "in_progress")),
                self.event("response.content_part.added", **self.where(), part=self.part(""))]  # fmt: skip

    def _close_message(self, calls: list[ToolCall]) -> list[ServerSentEvent]:
        text = self._text
        return [self.event("response.output_text.done", **self.where(), text=text, logprobs=[]),
                self.event("response.content_part.done", **self.where(), part=self.part(text)),
                self.event("response.output_item.done", output_index=self._msg_index,
                           item=self.message(text, "completed"))]  # fmt: skip

    def _stream_delta(self, piece: OutputDelta) -> list[ServerSentEvent]:
        out = self._reasoning_delta(piece.reasoning)
        pieces = piece.parsed()
        if pieces.content or pieces.calls:
            out += self._close_reasoning()
        if pieces.content:
            if not self._open:
                out += self._open_message()
            self._text += pieces.content
            out.append(self.event("response.output_text.delta", **self.where(), delta=pieces.content, logprobs=[]))
        for c in pieces.calls:
            index = self._call_index(c.index)
            if c.id is not None:
                item = self.call_item(ToolCall(c.id, c.name or "", ""), "in_progress", c.index)
                out.append(self.event("response.output_item.added", output_index=index, item=item))
            if c.arguments:
                out.append(self.event("response.function_call_arguments.delta", item_id=_call_item_id(self, c.index),
                                      output_index=index, delta=c.arguments))  # fmt: skip
        return out

    def _reasoning_delta(self, text: str) -> list[ServerSentEvent]:
        """The reasoning item opened (first time) and its text delta."""
        if not text:
            return []
        out = []
        if not self._thinking:
            self._thinking = True
            out += [self.event("response.output_item.added", output_index=self._next_index,
                               item=self.reasoning_item("", "in_progress")),
                    self.event("response.content_part.added", **self.where_reasoning(),
                               part={"type": "reasoning_text", "text": ""})]  # fmt: skip
            self._next_index += 1
        self._thought += text
        return [*out, self.event("response.reasoning_text.delta", **self.where_reasoning(), delta=text)]

    def _close_reasoning(self) -> list[ServerSentEvent]:
        if not self._thinking:
            return []
        self._thinking = False
        item = self.reasoning_item(self._thought, "completed")
        return [self.event("response.reasoning_text.done", **self.where_reasoning(), text=self._thought),
                self.event("response.content_part.done", **self.where_reasoning(), part=item["content"][0]),
                self.event("response.output_item.done", output_index=0, item=item)]  # fmt: skip

    def where_reasoning(self) -> dict[str, Any]:
        return {"item_id": self.reasoning_id, "output_index": 0, "content_index": 0}

    def reasoning_item(self, text: str, status: str) -> dict[str, Any]:
        """The reasoning output item (vLLM's and OpenAI's shape: the text as one reasoning_text part)."""
        content = [{"type": "reasoning_text", "text": text}] if status != "in_progress" else []
        return {"id": self.reasoning_id, "type": "reasoning", "summary": [], "content": content, "status": status}

    def _close_calls(self, calls: list[ToolCall]) -> list[ServerSentEvent]:
        out = []
        for i, call in enumerate(calls):
            index, item = self._call_index(i), self.call_item(call, "completed", i)
            out.append(self.event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                                  name=call.name, arguments=call.arguments))  # fmt: skip
            out.append(self.event("response.output_item.done", output_index=index, item=item))
        return out

    def _call_index(self, call: int) -> int:
        """output_index of call `call` (its place among the calls): the next free one when first seen."""
        if call not in self._call_indices:
            self._call_indices[call] = self._next_index
            self._next_index += 1
        return self._call_indices[call]

    def response(self, ticket: Ticket, text: str, reason: str | None, calls: Sequence[ToolCall] = ()) -> dict[str, Any]:
        """The Response object: in progress while `reason` is None, else completed (or incomplete when
        it ran out of max_output_tokens)."""
        b = self.asked
        status = "in_progress" if reason is None else ("incomplete" if reason == "length" else "completed")
        output = []
        if reason is not None:
            output += [self.call_item(c, "completed", i) for i, c in enumerate(calls)]
        if reason is not None and (text or not calls):  # in stream order: first, or after the calls it followed
            message = self.message(text, "completed" if status == "completed" else "incomplete")
            output.insert(sum(1 for i in self._call_indices.values() if i < self._msg_index), message)
        if reason is not None and self._thought:
            output.insert(0, self.reasoning_item(self._thought, "completed"))
        prompt = len(ticket.prompt_token_ids)
        thought = self._reader.reasoning_tokens(self._decode) if reason is not None and self._decode else 0
        usage = None if reason is None else {
            "input_tokens": prompt, "input_tokens_details": {"cached_tokens": ticket.cached_tokens},
            "output_tokens": ticket.completion_tokens, "output_tokens_details": {"reasoning_tokens": thought},
            "total_tokens": prompt + ticket.completion_tokens,
        }  # fmt: skip
        return {
            "id": self.id, "object": "response", "created_at": self.created, "status": status,
            "error": None, "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": b.instructions, "max_output_tokens": b.max_output_tokens, "model": self.model,
            "output": output, "parallel_tool_calls": b.parallel_tool_calls is not False, "previous_response_id": None,
            "temperature": b.temperature if b.temperature is not None else 1.0,
            "top_p": b.top_p if b.top_p is not None else 1.0, "tool_choice": self._tool_choice(),
            "tools": [_response_tool(t) for t in b.tools or []],
            "text": {"format": {"type": "text"}}, "truncation": "disabled", "store": False,
            "metadata": b.metadata or {}, "user": b.user, "usage": usage, "system_fingerprint": self.version,
        }  # fmt: skip

    def _tool_choice(self) -> Any:
        choice = self.asked.tool_choice
        if choice is None:
            return "auto" if self.asked.tools else "none"
        return choice

    def message(self, text: str, status: str) -> dict[str, Any]:
        content = [self.part(text)] if status != "in_progress" else []
        return {"id": self.item_id, "type": "message", "status": status, "role": "assistant", "content": content}

    def call_item(self, call: ToolCall, status: str, index: int) -> dict[str, Any]:
        """A function_call output item (`index`: the call's place among the calls; its id derives from it)."""
        return {"id": _call_item_id(self, index), "type": "function_call", "status": status, "call_id": call.id,
                "name": call.name, "arguments": call.arguments}  # fmt: skip

    @staticmethod
    def part(text: str) -> dict[str, Any]:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}

    def where(self) -> dict[str, Any]:
        return {"item_id": self.item_id, "output_index": self._msg_index, "content_index": 0}

    def event(self, kind: str, **data: Any) -> ServerSentEvent:
        payload = {"type": kind, "sequence_number": self._seq, **data}
        self._seq += 1
        return sse.event(json.dumps(payload, separators=(",", ":"), ensure_ascii=False), kind)


def _call_item_id(shape: ResponseShape, index: int) -> str:
    return f"fc_{shape.id[5:29]}_{index}"


def _response_tool(tool: Any) -> Any:
    """A tool as the Response echoes it (the Responses shape: flat)."""
    if isinstance(tool, dict) and isinstance(tool.get("function"), dict):
        fn = tool["function"]
        return {"type": "function", "name": fn.get("name"), "description": fn.get("description"),
                "parameters": fn.get("parameters"), "strict": fn.get("strict")}  # fmt: skip
    if isinstance(tool, dict):
        return {"description": None, "parameters": None, "strict": None, **tool}
    return tool
