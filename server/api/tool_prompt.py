"""A chat prompt with tools, as the APIs that take tools on chat turns build it (/v1/responses,
/v1/messages): the tool plan (server/prompt/tools.py), its grammar's size checked, the prompt's bytes
bounded, then the chat template; so a request that would be refused tokenizes nothing."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from engine.text.tokenization import message_texts
from server.http.errors import ApiError
from server.prompt.chat import ChatMessage, render_options, template_messages
from server.prompt.codec import check_prompt_bytes
from server.prompt.tools import ToolFields, ToolPlan, plan_tools
from server.serving.deployment import Deployment


async def tool_chat_prompt(dep: Deployment, fields: ToolFields, messages: list[ChatMessage], max_tokens: int,
                           param: str, max_tokens_field: str, rename: Callable[[ApiError], ApiError] = lambda e: e,
                           template_kwargs: dict[str, Any] | None = None) -> tuple[list[int], ToolPlan]:  # fmt: skip
    """(prompt token ids, tool plan) of `messages` with `fields`' tools on version `dep`. `param`: the
    body's field for the messages, named when the template fails or the prompt is too long; `rename`
    turns plan_tools' errors (chat's field names) into the body's; `template_kwargs`: the request's chat
    template variables (enable_thinking, ...). Raises ApiError 400."""
    render = render_options(True, False, template_kwargs)
    try:
        tools = plan_tools(fields, messages, template_messages(messages, dep.codec.content_format),
                           dep.tool_template, dep.tool_parser, dep.grammars.compiler is not None)  # fmt: skip
    except ApiError as exc:
        raise rename(exc) from None
    if tools.grammar is not None:
        dep.grammars.check(tools.grammar)
    check_prompt_bytes(dep.codec, message_texts(tools.messages), max_tokens, dep.max_model_len, param,
                       max_tokens_field=max_tokens_field)  # fmt: skip
    try:
        ids = await dep.codec.chat(tools.messages, render, tools.template_tools)
    except ApiError:
        raise
    except Exception as exc:
        raise ApiError(400, "invalid_request", f"chat template failed: {exc}", param=param) from None
    return ids, tools
