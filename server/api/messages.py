"""POST /v1/messages and POST /v1/messages/count_tokens: Anthropic's Messages API, as its SDK sends it.

`system` (a string or text blocks) and `messages` (user and assistant turns whose content is a string or
`text` / `tool_use` / `tool_result` blocks) become chat messages: a tool_use block is an assistant turn's
tool call, a tool_result block a `tool` turn answering it, so they reach the prompt as chat's tool turns
do. `tools` ({name, description, input_schema}) and `tool_choice` (auto, any, tool, none;
`disable_parallel_tool_use`) go through the chat path's machinery (server/prompt/tools.py plan_tools,
the tool-call grammar, server/prompt/tool_parser.py); `max_tokens` is required, `stop_sequences` are
stop strings, `metadata.user_id` is the request's `user`. The answer (server/api/messages_shapes.py)
goes through the one response path (server/api/respond.py); errors take Anthropic's shape
(server/http/errors.py), and `x-api-key` is a key as a bearer token is (server/http/auth.py).
With --reasoning-parser the model's reasoning comes back as a `thinking` block before the text
(`thinking_delta` events, then a `signature_delta`, as Anthropic streams it; the signature is an opaque
id, as vLLM makes one); `thinking: {"type": "disabled"}` turns thinking off in the chat template
(`enable_thinking` false, as vLLM maps it), `enabled` / `adaptive` leave it on (`budget_tokens` is not
enforced); `chat_template_kwargs` (vLLM's) reach the template. An assistant turn's `thinking` blocks go to
the template as that turn's reasoning; `redacted_thinking` blocks are dropped.
"""

from __future__ import annotations

import json
from typing import Annotated, Any

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field, Strict

from engine.api import SamplingParams
from server.api.choices import start_choices
from server.api.messages_shapes import MessageShape
from server.api.protocol import Bool, SamplingFields
from server.api.respond import Call, generation, respond
from server.api.tokenize import deployment
from server.api.tool_prompt import tool_chat_prompt
from server.http.errors import ApiError
from server.http.numbers import MAX_INT
from server.ops.feedback import RecordKey
from server.prompt.chat import ChatMessage, with_reasoning_effort
from server.prompt.reasoning import plan_reasoning
from server.prompt.structured import behind_reasoning, with_grammar
from server.prompt.tools import ToolFields
from server.serving.dispatch import cache_scope, picked, request_owner, request_tenant
from server.serving.gateway import GenerationRequest

router = APIRouter(prefix="/v1")

MAX_USER_ID_CHARS = 256  # metadata.user_id, as `user` elsewhere
_TOOL_CHOICES = {"auto": "auto", "any": "required", "none": "none"}  # Anthropic's -> chat's
# plan_tools names chat's tool fields; an Anthropic tool is flat, with `input_schema` for `parameters`
_TOOL_FIELDS = ((".function.name", ".name"), (".function.parameters", ".input_schema"),
                (".function.description", ".description"), (".function", ""))  # fmt: skip


class MessagesPrompt(BaseModel):
    """What a Messages request's prompt is made of (the body of count_tokens; a message body has more)."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    messages: Annotated[list[Any], Field(min_length=1)]
    system: str | list[Any] | None = None
    tools: list[Any] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None  # {"type": "enabled" | "disabled" | "adaptive", "budget_tokens": N}
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's: template variables (enable_thinking, ...)

    def template_kwargs(self) -> dict[str, Any]:
        """The chat template's variables: `thinking` disabled is enable_thinking false (vLLM's mapping)."""
        kind = (self.thinking or {}).get("type")
        if self.thinking is not None and kind not in ("enabled", "disabled", "adaptive"):
            raise _bad("thinking.type", f"must be enabled, disabled or adaptive, got {str(kind)[:40]!r}")
        return with_reasoning_effort(self.chat_template_kwargs, "none" if kind == "disabled" else None)

    def chat_messages(self) -> list[ChatMessage]:
        """`system` and `messages` as chat messages. Raises ApiError 400 naming the field."""
        out = []
        if self.system:
            out.append(ChatMessage(role="system", content=_texts(self.system, "system")))
        for i, message in enumerate(self.messages):
            out += _turn(message, f"messages.{i}")
        return out

    def tool_fields(self) -> ToolFields:
        """The tool fields in the chat shape plan_tools reads."""
        tools = [_chat_tool(t, f"tools.{i}") for i, t in enumerate(self.tools or [])]
        choice, parallel = _tool_choice(self.tool_choice, bool(tools))
        return ToolFields(tools=tools, tool_choice=choice, parallel_tool_calls=parallel)


class MessagesRequest(MessagesPrompt, SamplingFields):
    """Body of POST /v1/messages (Anthropic's fields, then the sampling extensions every route takes)."""

    max_tokens: Annotated[int, Strict(), Field(ge=1, le=MAX_INT)]
    stop_sequences: list[str] | None = None
    stream: Bool = False
    metadata: dict[str, Any] | None = None

    def params(self) -> SamplingParams:
        """The engine's params; `stop_sequences` are its stop strings. Raises ApiError 400."""
        if self.stop_sequences is not None and self.stop is not None:
            raise ApiError(400, "invalid_request", "stop_sequences: give stop_sequences or stop, not both",
                           param="stop_sequences")  # fmt: skip
        given = self if self.stop_sequences is None else self.model_copy(update={"stop": self.stop_sequences})
        return given.sampling_params(self.max_tokens, None)

    def user(self) -> str | None:
        """metadata.user_id: whose request it is (the response cache's and feedback's `user`)."""
        user = (self.metadata or {}).get("user_id")
        if user is not None and (not isinstance(user, str) or len(user) > MAX_USER_ID_CHARS):
            raise ApiError(400, "invalid_request", f"metadata.user_id must be a string of at most "
                           f"{MAX_USER_ID_CHARS} characters", param="metadata.user_id")  # fmt: skip
        return user


def _bad(param: str, message: str) -> ApiError:
    return ApiError(400, "invalid_request", f"{param}: {message}", param=param)


def _texts(content: Any, field: str) -> str:
    """A string, or a list of text blocks, as one string."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad(field, "must be a string or a list of text blocks")
    return "".join(_text(block, f"{field}.{j}") for j, block in enumerate(content))


def _text(block: Any, field: str) -> str:
    kind = block.get("type") if isinstance(block, dict) else None
    if kind != "text":
        raise _bad(f"{field}.type", f"content block type {kind!r} is not supported here (text)")
    text = block.get("text")
    if not isinstance(text, str):
        raise _bad(f"{field}.text", "a text block needs `text`, a string")
    return text


def _turn(message: Any, field: str) -> list[ChatMessage]:
    """One message as chat messages: an assistant turn (text and its tool calls), or a user turn, whose
    tool_result blocks become `tool` turns in order around its text."""
    role = message.get("role") if isinstance(message, dict) else None
    if role not in ("user", "assistant"):
        raise _bad(f"{field}.role", "must be user or assistant (the system prompt is `system`)")
    content = message.get("content")
    if isinstance(content, str):
        return [ChatMessage(role=role, content=content)]
    if not isinstance(content, list) or not content:
        raise _bad(f"{field}.content", "must be a string or a non-empty list of content blocks")
    if role == "assistant":
        return [_assistant(content, field)]
    out: list[ChatMessage] = []
    text: list[str] = []
    for j, block in enumerate(content):
        where = f"{field}.content.{j}"
        if isinstance(block, dict) and block.get("type") == "tool_result":
            if text:
                out.append(ChatMessage(role="user", content="".join(text)))
                text = []
            out.append(_tool_result(block, where))
        else:
            text.append(_block_text(block, where, "text, tool_result"))
    if text:
        out.append(ChatMessage(role="user", content="".join(text)))
    return out


def _assistant(content: list[Any], field: str) -> ChatMessage:
    text, calls, thought = [], [], []
    for j, block in enumerate(content):
        where = f"{field}.content.{j}"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "tool_use":
            calls.append(_tool_use(block, where))
        elif kind == "thinking":
            if not isinstance(block.get("thinking"), str):
                raise _bad(f"{where}.thinking", "a thinking block needs `thinking`, a string")
            thought.append(block["thinking"])
        elif kind != "redacted_thinking":  # redacted: nothing a template could read
            text.append(_block_text(block, where, "text, tool_use, thinking"))
    return ChatMessage(role="assistant", content="".join(text) if text or not calls else None, tool_calls=calls or None,
                       reasoning="".join(thought) if thought else None)  # fmt: skip


def _block_text(block: Any, field: str, allowed: str) -> str:
    kind = block.get("type") if isinstance(block, dict) else None
    if kind != "text":
        raise _bad(f"{field}.type", f"content block type {kind!r} is not supported in this turn ({allowed})")
    return _text(block, field)


def _tool_use(block: dict[str, Any], field: str) -> dict[str, Any]:
    """A tool_use block as a chat tool call (`id`, `name` and the `input` object are required)."""
    call_id, name, given = block.get("id"), block.get("name"), block.get("input")
    for key, value in (("id", call_id), ("name", name)):
        if not isinstance(value, str) or not value:
            raise _bad(f"{field}.{key}", "a tool_use block needs it, a non-empty string")
    if not isinstance(given, dict):
        raise _bad(f"{field}.input", "a tool_use block's input must be an object")
    arguments = json.dumps(given, ensure_ascii=False)
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def _tool_result(block: dict[str, Any], field: str) -> ChatMessage:
    call_id = block.get("tool_use_id")
    if not isinstance(call_id, str) or not call_id:
        raise _bad(f"{field}.tool_use_id", "a tool_result block needs it, a non-empty string")
    content = block.get("content", "")
    text = _texts(content, f"{field}.content")
    return ChatMessage(role="tool", content=text, tool_call_id=call_id)


def _chat_tool(tool: Any, field: str) -> dict[str, Any]:
    """A client tool ({name, description, input_schema}) in chat's shape; server tools are refused."""
    if not isinstance(tool, dict):
        raise _bad(field, "must be an object")
    if tool.get("type", "custom") not in ("custom", None):
        raise _bad(f"{field}.type", f"tool type {tool.get('type')!r} is not supported (client tools with "
                   "input_schema only)")  # fmt: skip
    if "input_schema" not in tool:
        raise _bad(f"{field}.input_schema", "a tool needs input_schema, a JSON schema object")
    fn = {"name": tool.get("name"), "parameters": tool["input_schema"]}
    if tool.get("description") is not None:
        fn["description"] = tool["description"]
    return {"type": "function", "function": fn}


def _tool_choice(choice: dict[str, Any] | None, has_tools: bool) -> tuple[Any, bool | None]:
    """(chat's tool_choice, parallel_tool_calls) of Anthropic's tool_choice."""
    if choice is None:
        return None, None
    kind = choice.get("type")
    if kind not in ("auto", "any", "tool", "none"):
        raise _bad("tool_choice.type", f"must be auto, any, tool or none, got {str(kind)[:40]!r}")
    if kind in ("any", "tool") and not has_tools:
        raise _bad("tool_choice", f"{kind!r} needs `tools`")
    parallel = choice.get("disable_parallel_tool_use")
    if parallel is not None and not isinstance(parallel, bool):
        raise _bad("tool_choice.disable_parallel_tool_use", "must be a boolean")
    if kind != "tool":
        return _TOOL_CHOICES[kind], None if parallel is None else not parallel
    name = choice.get("name")
    if not isinstance(name, str):
        raise _bad("tool_choice.name", "a tool choice of type tool needs the tool's name")
    return {"type": "function", "function": {"name": name}}, None if parallel is None else not parallel


def anthropic_names(exc: ApiError) -> ApiError:
    """plan_tools' error with the body's own field names (`tools.0.name`, `tools.0.input_schema`)."""
    param = exc.param or ""
    if not param.startswith("tools."):
        return exc
    for chat, own in _TOOL_FIELDS:
        if param.endswith(chat):
            renamed = param[: -len(chat)] + own
            return ApiError(exc.status, exc.type, exc.message.replace(param, renamed, 1), param=renamed)
    return exc


# The preamble (server/api/respond.py generation): runtime, readiness check, parsed body.
MessagesCall = Annotated[Call[MessagesRequest], generation(MessagesRequest)]
CountCall = Annotated[Call[MessagesPrompt], generation(MessagesPrompt)]


@router.post("/messages")
async def messages(request: Request, call: MessagesCall) -> Response:
    rt, body = call.runtime, call.body
    chat, fields, user, kwargs = body.chat_messages(), body.tool_fields(), body.user(), body.template_kwargs()
    async with picked(rt, body.model) as (slot, lease):
        dep = lease.deployment
        ids, tools = await tool_chat_prompt(dep, fields, chat, body.max_tokens, "messages", "max_tokens",
                                            anthropic_names, kwargs)  # fmt: skip
        reasoning, grammar = behind_reasoning(plan_reasoning(dep.reasoning_parser, kwargs, ids, dep.codec.decode),
                                              tools.grammar)  # fmt: skip
        params = body.params()
        if grammar is not None:
            params = with_grammar(params, await dep.grammars.compile(grammar))
        shape = MessageShape(lease.served_name(slot.name), tools, list(params.stop), dep.codec, reasoning)
        req = GenerationRequest(shape.id, ids, params, body.lane(), body.timeout_s, body.first_token_timeout_s,
                                body.cache, cache_scope(rt, request, user), max_tokens_field="max_tokens",
                                record=RecordKey(request_owner(rt, request, user), shape.id),
                                tenant=request_tenant(rt, request, user))  # fmt: skip
        handles = await start_choices(rt, request, lease, [[req]])
    return await respond(rt, request, handles, shape, body.stream)


@router.post("/messages/count_tokens")
async def count_tokens(call: CountCall) -> dict[str, Any]:
    """The prompt's tokens as /v1/messages would run it (system, messages, tools), without running it."""
    body = call.body
    dep = await deployment(call.runtime, body.model)
    ids, _ = await tool_chat_prompt(dep, body.tool_fields(), body.chat_messages(), 1, "messages", "max_tokens",
                                    anthropic_names, body.template_kwargs())  # fmt: skip
    return {"input_tokens": len(ids)}
