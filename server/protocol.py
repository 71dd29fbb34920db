"""Request bodies. Types are strict (no "5" for 5, no 1 for true); ranges are the engine's, checked
once by `SamplingParams`. `/generate` rejects unknown fields; the OpenAI bodies ignore them, as
OpenAI-compatible servers do (load tools send extras).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, TypeVar

from fastapi import Request
from pydantic import BaseModel, ConfigDict, Field, Strict, ValidationError

from engine.api import InvalidParam, SamplingParams
from server.admission import Lane
from server.errors import ApiError, validation_to_api_error
from server.structured import StructuredFields
from server.tools import ToolFields

Int = Annotated[int, Strict()]
Bool = Annotated[bool, Strict()]
Num = Annotated[float, Strict(), Field(allow_inf_nan=False)]
Seconds = Annotated[float, Strict(), Field(gt=0, le=86400, allow_inf_nan=False)]
TokenId = Annotated[int, Strict(), Field(ge=0)]
PriorityName = Literal["interactive", "standard", "batch"]

Body = TypeVar("Body", bound=BaseModel)

_SAMPLING_FIELDS = (
    "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
    "frequency_penalty", "stop", "stop_token_ids", "seed", "ignore_eos", "min_tokens",
)  # fmt: skip


async def parse_body(request: Request, model: type[Body]) -> Body:
    """The JSON body as `model`, whatever the Content-Type. Raises ApiError 400/422 naming the field."""
    try:
        return model.model_validate_json(await request.body())
    except ValidationError as exc:
        raise validation_to_api_error(request.url.path, exc.errors()) from None


class SamplingFields(BaseModel):
    """Sampling knobs shared by every generation body; None leaves the engine's default."""

    temperature: Num | None = None
    top_p: Num | None = None
    top_k: Int | None = None
    min_p: Num | None = None
    repetition_penalty: Num | None = None
    presence_penalty: Num | None = None
    frequency_penalty: Num | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = None
    seed: Int | None = None
    ignore_eos: Bool | None = None
    min_tokens: Int | None = None
    priority: PriorityName | Int | None = None
    timeout_s: Seconds | None = None
    first_token_timeout_s: Seconds | None = None
    cache: Bool = True  # false: never answered from (or stored in) the response cache

    def sampling_params(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        """The engine's params; an invalid value raises ApiError 400 naming the field and its limit."""
        given = {name: getattr(self, name) for name in _SAMPLING_FIELDS if getattr(self, name) is not None}
        try:
            return SamplingParams(max_tokens=max_tokens, logprobs=logprobs, **given)
        except InvalidParam as exc:
            raise ApiError(400, "invalid_request", exc.message, param=exc.field) from None

    def lane(self) -> Lane | None:
        if self.priority is None:
            return None
        try:
            return Lane.parse(self.priority)
        except ValueError as exc:
            raise ApiError(400, "invalid_request", str(exc), param="priority") from None


class GenerateRequest(SamplingFields):
    """Body of POST /generate."""

    model_config = ConfigDict(extra="forbid")

    prompt: str | None = None
    prompt_token_ids: list[TokenId] | None = None
    max_tokens: Int | None = None
    logprobs: Int | None = None  # None: none; 0: chosen token; N: chosen + top-N
    stream: Bool = True
    request_id: Annotated[str, Field(min_length=1, max_length=128, pattern=r"^[\w.:\-]+$")] | None = None
    model: str | None = None  # a model name, or name@version to pin one; default: the first model
    user: Annotated[str, Field(max_length=256)] | None = None  # keeps response-cache entries private to it


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: Bool | None = None


class OpenAIFields(SamplingFields, StructuredFields):
    """What /v1/completions and /v1/chat/completions share, OpenAI names first."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    n: Int | None = None
    best_of: Int | None = None
    stream: Bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    logit_bias: dict[str, Any] | None = None

    def check_unsupported(self) -> None:
        if self.n not in (None, 1):
            raise ApiError(400, "invalid_request", "only n=1 is supported", param="n")
        if self.best_of not in (None, 1):
            raise ApiError(400, "invalid_request", "only best_of=1 is supported", param="best_of")
        if self.logit_bias:
            raise ApiError(400, "invalid_request", "logit_bias is not supported", param="logit_bias")

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(OpenAIFields):
    """Body of POST /v1/completions."""

    prompt: str | list[str] | list[TokenId] | list[list[TokenId]]
    max_tokens: Int | None = None
    max_completion_tokens: Int | None = None  # some clients send the chat name here too
    logprobs: Int | None = None
    echo: Bool | None = False
    suffix: str | None = None


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[Any] | None = None  # an assistant turn's calls (server/tools.py renders them)
    tool_call_id: str | None = None  # a tool turn's answer to that call


class ChatRequest(OpenAIFields, ToolFields):
    """Body of POST /v1/chat/completions."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: Int | None = None
    max_completion_tokens: Int | None = None
    logprobs: Bool | None = False
    top_logprobs: Int | None = None

    def template_messages(self) -> list[dict[str, Any]]:
        """Messages as the chat template takes them; only text content parts are supported. Text parts
        are joined into one string: most chat templates (SmolLM2's, most GGUF files') only take string
        content, and one string renders the same in those that also take parts."""
        out = []
        for i, m in enumerate(self.messages):
            if isinstance(m.content, list):
                for part in m.content:
                    if part.type != "text":
                        raise ApiError(400, "invalid_request",
                                       f"content part type {part.type!r} is not supported (text only)",
                                       param=f"messages.{i}.content")
                content: Any = "".join(p.text or "" for p in m.content)
            else:
                content = m.content
            out.append({"role": m.role, "content": content})
        return out
