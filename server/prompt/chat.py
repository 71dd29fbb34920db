"""Chat messages as the OpenAI API defines them, made ready for a model's chat template.

- Text content parts are passed as parts to a template that renders them, and joined into one string
  for a template that takes only strings (most real ones: SmolLM2's, most GGUF files'). Which kind a
  template is, is probed once per tokenizer copy (server/prompt/codec.py `probe_content_format`): one user message rendered
  with a text part and with the same text as a string; equal output means the template renders parts.
  Other part types (images, audio, files) are refused (400 naming the part).
- `content: null` is allowed for assistant turns (tool-call history) and becomes "" (a template that
  concatenates strings would fail on None); `tool_calls` stay on the message, their `arguments` JSON
  decoded to an object as templates expect (`| tojson` would otherwise quote a string twice).
- `tool` messages keep `tool_call_id`; `name` is passed on when given.
- An assistant turn's `reasoning` (or `reasoning_content`, its older name) goes to the template under
  both names, as vLLM passes it (templates that replay earlier thinking read `reasoning_content`).

Render options: `add_generation_prompt`, `continue_final_message`, `chat_template_kwargs` (template
variables) and the server's `--chat-template` become the keyword arguments of `apply_chat_template`.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field

from server.http import json_limits
from server.http.errors import ApiError
from server.prompt.codec import PARTS, PromptCodec

TEXT_PART_TYPES = ("text", "input_text", "output_text")  # chat's, and the Responses API's
# Arguments of apply_chat_template a request may not set through chat_template_kwargs.
RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "tokenize", "return_dict", "return_tensors", "chat_template", "tools",
    "documents", "add_generation_prompt", "continue_final_message", "tokenizer_kwargs", "padding",
    "truncation", "max_length", "return_assistant_tokens_mask",
})  # fmt: skip


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: str
    text: str | None = None
    refusal: str | None = None  # type "refusal" (an assistant turn's)


class ChatMessage(BaseModel):
    """One message as the OpenAI API defines it (`template_messages` turns it into the template's dict)."""

    model_config = ConfigDict(extra="ignore")
    role: Annotated[str, Field(min_length=1)]
    content: str | list[ContentPart] | None = None  # None: an assistant turn that only calls tools
    name: str | None = None
    tool_calls: list[Any] | None = None  # an assistant turn's calls (server/prompt/tools.py renders them)
    tool_call_id: str | None = None  # a tool turn's answer to that call
    reasoning: str | None = None  # an assistant turn's reasoning (vLLM's field; `reasoning_content` too)
    reasoning_content: str | None = None


def template_messages(messages: list[ChatMessage], content_format: str) -> list[dict[str, Any]]:
    """The messages as dicts for `apply_chat_template`. Raises ApiError 400 naming the field."""
    return [_message(m, i, content_format) for i, m in enumerate(messages)]


def _message(m: ChatMessage, i: int, content_format: str) -> dict[str, Any]:
    field = f"messages.{i}"
    if m.content is None and m.role != "assistant":
        raise ApiError(400, "invalid_request", f"{field}.content is required for role {m.role!r} (only assistant "
                       "messages may have null content)", param=f"{field}.content")  # fmt: skip
    out: dict[str, Any] = {"role": m.role, "content": _content(m.content, field, content_format)}
    if m.name is not None:
        out["name"] = m.name
    if m.tool_calls:
        if m.role != "assistant":
            raise ApiError(400, "invalid_request", f"{field}.tool_calls: only assistant messages carry tool calls",
                           param=f"{field}.tool_calls")  # fmt: skip
        out["tool_calls"] = [_tool_call(c, f"{field}.tool_calls.{j}") for j, c in enumerate(m.tool_calls)]
    thought = m.reasoning if m.reasoning is not None else m.reasoning_content
    if thought is not None and m.role == "assistant":  # for templates that replay it (Qwen3's reads reasoning_content)
        out["reasoning"] = out["reasoning_content"] = thought
    if m.role == "tool":
        if not m.tool_call_id:
            raise ApiError(400, "invalid_request", f"{field}.tool_call_id is required for role 'tool'",
                           param=f"{field}.tool_call_id")  # fmt: skip
        out["tool_call_id"] = m.tool_call_id
    return out


def _content(content: Any, field: str, content_format: str) -> Any:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    texts = []
    for j, part in enumerate(content):
        if part.type not in TEXT_PART_TYPES and part.type != "refusal":
            raise ApiError(400, "invalid_request", f"content part type {part.type!r} is not supported (text only)",
                           param=f"{field}.content.{j}.type")  # fmt: skip
        text = part.refusal if part.type == "refusal" else part.text
        if not isinstance(text, str):
            raise ApiError(400, "invalid_request", f"a {part.type!r} content part needs its text",
                           param=f"{field}.content.{j}.text")  # fmt: skip
        texts.append(text)
    if content_format == PARTS:
        return [{"type": "text", "text": t} for t in texts]
    return "".join(texts)


def _tool_call(call: dict[str, Any], field: str) -> dict[str, Any]:
    function = call.get("function")
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise ApiError(400, "invalid_request", f"{field}.function.name is required", param=f"{field}.function")
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            decoded = json_limits.loads(arguments, f"{field}.function.arguments")
        except ValueError:
            decoded = None
        if isinstance(decoded, dict):
            arguments = decoded
    return {**call, "type": call.get("type", "function"), "function": {**function, "arguments": arguments}}


async def chat_prompt(codec: PromptCodec, messages: list[ChatMessage], render: dict[str, Any]) -> list[int]:
    """Prompt token ids of `messages` through the codec's chat template. Raises ApiError 400 naming the
    field when a message is invalid or the template fails on them."""
    try:
        return await codec.chat(template_messages(messages, codec.content_format), render)
    except ApiError:
        raise
    except Exception as exc:
        raise ApiError(400, "invalid_request", f"chat template failed: {exc}", param="messages") from None


def render_options(add_generation_prompt: bool, continue_final_message: bool,
                   template_kwargs: dict[str, Any] | None) -> dict[str, Any]:  # fmt: skip
    """The request's keyword arguments for apply_chat_template. Raises ApiError 400 naming the field."""
    if add_generation_prompt and continue_final_message:
        raise ApiError(400, "invalid_request", "continue_final_message continues the last message: set "
                       "add_generation_prompt to false with it", param="continue_final_message")  # fmt: skip
    reserved = sorted(RESERVED_TEMPLATE_KWARGS & set(template_kwargs or {}))
    if reserved:
        raise ApiError(400, "invalid_request", f"chat_template_kwargs may not set {', '.join(reserved)} (use the "
                       "request fields)", param=f"chat_template_kwargs.{reserved[0]}")  # fmt: skip
    options: dict[str, Any] = {**(template_kwargs or {}), "add_generation_prompt": add_generation_prompt}
    if continue_final_message:
        options["continue_final_message"] = True
    return options


def with_reasoning_effort(template_kwargs: dict[str, Any] | None, effort: str | None) -> dict[str, Any]:
    """The template kwargs with a request's reasoning effort, as vLLM passes it: the template sees
    `reasoning_effort`, and `enable_thinking` follows it (false for "none") unless the kwargs set it."""
    kwargs = dict(template_kwargs or {})
    if effort is not None:
        kwargs.setdefault("reasoning_effort", effort)
        kwargs.setdefault("enable_thinking", effort != "none")
    return kwargs
