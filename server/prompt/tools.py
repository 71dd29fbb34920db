"""Tools on /v1/chat/completions: the `tools`, `tool_choice` and `parallel_tool_calls` fields, how the
tools reach the prompt, the grammar that enforces calls, and the history's tool turns.

- The chat template renders `tools` when it can (probed once per model: `probe_template`); otherwise
  (SmolLM2's template, most GGUF files') a system prompt describes them and the Hermes call format
  (merged into the first system message, or one is added).
- tool_choice none: tools are left out of the prompt and nothing is parsed; auto: the model may answer
  or call; required: one call or more; {"type": "function", ...}: exactly that call. With a grammar
  backend every mode but none is enforced by a grammar (engine/structured/spec.py `tool_calls`), so
  arguments always validate against the tool's JSON schema; auto without one only parses.
- History: assistant `tool_calls` go to the template (arguments as objects, as Hugging Face templates
  take them) or, when it ignores them, into the turn's text in the Hermes format; `tool` messages go
  to the template, or become user turns wrapping the result in <tool_response> tags.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Annotated, Any

from pydantic import BaseModel, Strict

from engine.structured.spec import (
    TOOL_CALL_CLOSE,
    TOOL_CALL_HEAD_PREFIX,
    TOOL_CALL_HEAD_SUFFIX,
    TOOL_CALL_OPEN,
    GrammarSpec,
)
from server.http import json_limits
from server.http.errors import ApiError
from server.prompt.structured import GrammarRequest
from server.prompt.tool_parser import PARSERS, ToolCall, ToolParser

_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")
_NO_PARAMETERS = {"type": "object", "properties": {}}
_PROBE = "tokenmill_probe_7f3a"  # a name no template writes by itself


class ToolFields(BaseModel):
    """The tool fields of a chat body (types checked here; meaning in `plan_tools`)."""

    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: Annotated[bool, Strict()] | None = None


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict[str, Any]  # JSON schema of the arguments object

    def openai(self) -> dict[str, Any]:
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": self.parameters}}  # fmt: skip


@dataclass(frozen=True)
class TemplateSupport:
    """What a chat template renders by itself."""

    tools: bool  # the `tools` argument
    tool_calls: bool  # assistant messages' `tool_calls`


def probe_template(tokenizer: Any, chat_template: str | None = None) -> TemplateSupport:
    """Render a probe tool and a probe call: whatever the template drops, we render ourselves.
    `chat_template`: the server's --chat-template (None: the tokenizer's own)."""
    tool = Tool(_PROBE, "", _NO_PARAMETERS).openai()
    call = {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_0", "type": "function", "function": {"name": _PROBE, "arguments": {}}}]}  # fmt: skip
    user = {"role": "user", "content": "hi"}
    extra = {"chat_template": chat_template} if chat_template is not None else {}
    return TemplateSupport(_renders(tokenizer, [user], tools=[tool], **extra), _renders(tokenizer, [user, call], **extra))


def _renders(tokenizer: Any, messages: list[dict[str, Any]], **kwargs: Any) -> bool:
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)
    except Exception:  # a template (or tokenizer) that refuses the argument: it does not render it
        return False
    return isinstance(text, str) and _PROBE in text


@dataclass
class ToolPlan:
    """How one chat request uses tools."""

    messages: list[dict[str, Any]]  # as the chat template takes them
    template_tools: list[dict[str, Any]] | None  # for the template's `tools` argument; None: not passed
    grammar: GrammarRequest | None  # the calls' grammar (tool_choice auto/required/named)
    parser: str | None  # the tool-call parser's name; None: the text is not parsed (no tools, none)
    parallel: bool

    def new_parser(self) -> ToolParser | None:
        return PARSERS[self.parser](self.parallel) if self.parser is not None else None


def plan_tools(body: ToolFields, history: list[Any], messages: list[dict[str, Any]], support: TemplateSupport,
               parser: str, can_enforce: bool) -> ToolPlan:  # fmt: skip
    """`messages`: the body's messages as template dicts (one per `history` entry, the body's
    ChatMessages). `can_enforce`: a grammar backend is there. Raises ApiError 400 naming the field."""
    tools = parse_tools(body.tools)
    mode, named = parse_tool_choice(body.tool_choice, tools)
    parallel = body.parallel_tool_calls is not False
    messages = render_history(history, messages, support)
    if mode == "none":
        return ToolPlan(messages, None, None, None, parallel)
    chosen = [t for t in tools if named is None or t.name == named]
    grammar = None
    if can_enforce or mode != "auto":
        spec = GrammarSpec.tool_calls([(t.name, t.parameters) for t in chosen], mode, parallel)
        grammar = GrammarRequest(spec, "tool_choice" if mode != "auto" else "tools")
    if support.tools:
        return ToolPlan(messages, [t.openai() for t in tools], grammar, parser, parallel)
    return ToolPlan(with_tools_prompt(messages, tools, mode, named), None, grammar, parser, parallel)


def parse_tools(raw: list[Any] | None) -> list[Tool]:
    tools: list[Tool] = []
    for i, item in enumerate(raw or []):
        where = f"tools.{i}"
        if not isinstance(item, dict) or item.get("type", "function") != "function":
            raise _bad(f"{where}.type", "only function tools are supported")
        fn = item.get("function")
        if not isinstance(fn, dict):
            raise _bad(f"{where}.function", "must be an object with a name")
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise _bad(f"{where}.function.name", "must be 1-64 letters, digits, underscores, dots or dashes")
        if any(t.name == name for t in tools):
            raise _bad(f"{where}.function.name", f"{name!r} is given twice")
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise _bad(f"{where}.function.parameters", "must be a JSON schema object")
        description = fn.get("description") or ""
        if not isinstance(description, str):
            raise _bad(f"{where}.function.description", "must be a string")
        tools.append(Tool(name, description, params or dict(_NO_PARAMETERS)))
    return tools


def parse_tool_choice(choice: str | dict[str, Any] | None, tools: list[Tool]) -> tuple[str, str | None]:
    """(mode, tool name when named); mode is none, auto, required or named."""
    if choice is None:
        return ("auto" if tools else "none"), None
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise _bad("tool_choice", f"must be none, auto, required or a function, got {choice!r}")
        if choice != "none" and not tools:
            raise _bad("tool_choice", f"{choice!r} needs `tools`")
        return choice, None
    fn = choice.get("function")
    name = fn.get("name") if isinstance(fn, dict) else None
    if choice.get("type") != "function" or not isinstance(name, str):
        raise _bad("tool_choice", 'must be {"type": "function", "function": {"name": ...}}')
    if not any(t.name == name for t in tools):
        raise _bad("tool_choice", f"names {name!r}, which is not in `tools`")
    return "named", name


def render_history(history: list[Any], messages: list[dict[str, Any]], support: TemplateSupport) -> list[dict[str, Any]]:
    """messages with the tool turns of `history` (ChatMessages) in the form the template takes."""
    out = []
    for m, (src, msg) in enumerate(zip(history, messages, strict=True)):
        calls = getattr(src, "tool_calls", None) or []
        if src.role == "tool":
            msg = _tool_result(src, msg, support)
        elif calls:
            msg = _with_calls(msg, [_history_call(c, f"messages.{m}.tool_calls.{i}") for i, c in enumerate(calls)],
                              support)  # fmt: skip
        out.append(msg)
    return out


def _text(content: Any) -> str:
    """A message's content as one string (a template that takes parts gets a list of text parts)."""
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return content or ""


def _tool_result(src: Any, msg: dict[str, Any], support: TemplateSupport) -> dict[str, Any]:
    content = _text(msg.get("content"))
    if support.tools:
        extra = {k: v for k, v in (("tool_call_id", src.tool_call_id), ("name", src.name)) if v}
        return {**msg, "content": content, **extra}
    return {"role": "user", "content": f"<tool_response>\n{content}\n</tool_response>"}


def _with_calls(msg: dict[str, Any], parsed: list[tuple[str, str, Any]], support: TemplateSupport) -> dict[str, Any]:
    if support.tool_calls:
        return {**msg, "tool_calls": [{"id": cid, "type": "function", "function": {"name": n, "arguments": a}}
                                      for cid, n, a in parsed]}  # fmt: skip
    text = "\n".join(call_text(n, a) for _, n, a in parsed)
    content = _text(msg.get("content"))
    return {**msg, "content": f"{content}\n{text}" if content else text}


def _history_call(call: Any, where: str) -> tuple[str, str, Any]:
    """(id, name, arguments as an object when they parse) of an assistant message's tool call."""
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise _bad(f"{where}.function", "must be an object with a name")
    args = fn.get("arguments", "{}")
    if isinstance(args, str):
        try:
            args = json_limits.loads(args, f"{where}.function.arguments")
        except ValueError:
            pass
    return str(call.get("id") or ""), fn["name"], args


def call_text(name: str, arguments: Any) -> str:
    """One call in the Hermes format the grammar writes."""
    args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    head = TOOL_CALL_HEAD_PREFIX + json.dumps(name, ensure_ascii=False) + TOOL_CALL_HEAD_SUFFIX
    return f"{TOOL_CALL_OPEN}{head}{args}}}\n{TOOL_CALL_CLOSE}"


def with_tools_prompt(messages: list[dict[str, Any]], tools: list[Tool], mode: str,
                      named: str | None) -> list[dict[str, Any]]:  # fmt: skip
    """messages with the tools described in the system turn (for templates that ignore `tools`)."""
    prompt = tools_prompt(tools, mode, named)
    if messages and messages[0].get("role") == "system" and isinstance(messages[0].get("content"), str):
        first = messages[0]
        return [{**first, "content": f"{first['content']}\n\n{prompt}"}, *messages[1:]]
    return [{"role": "system", "content": prompt}, *messages]


def tools_prompt(tools: list[Tool], mode: str, named: str | None) -> str:
    listed = "\n".join(json.dumps(t.openai(), ensure_ascii=False) for t in tools)
    ask = {"auto": "Call a function when it helps answer; otherwise answer directly.",
           "required": "Answer by calling one or more of the functions.",
           "named": f"Answer by calling the function {named}."}[mode]  # fmt: skip
    example = call_text("function-name", {"argument-name": "value"})
    return (f"# Tools\n\nYou can call functions. They are described in JSON Schema within <tools></tools>:\n"
            f"<tools>\n{listed}\n</tools>\n\n{ask} To call a function, write a JSON object with its name and "
            f"arguments within <tool_call></tool_call> tags, one call per tag:\n{example}")  # fmt: skip


def message_with_calls(content: str, calls: list[ToolCall]) -> dict[str, Any]:
    """The non-streamed assistant message: content (None when only calls) and its tool_calls."""
    message: dict[str, Any] = {"role": "assistant", "content": content if content or not calls else None}
    if calls:
        message["tool_calls"] = [c.openai() for c in calls]
    return message


def finish_reason(reason: str, calls: list[ToolCall]) -> str:
    return "tool_calls" if calls and reason == "stop" else reason


def _bad(param: str, message: str) -> ApiError:
    return ApiError(400, "invalid_request", f"{param} {message}", param=param)

