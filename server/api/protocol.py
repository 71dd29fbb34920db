"""Request bodies. Types are strict (no "5" for 5, no 1 for true); ranges are the engine's, checked
once by `SamplingParams`. `/generate` rejects unknown fields; the OpenAI bodies ignore them, as
OpenAI-compatible servers do (load tools send extras).
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal, TypeVar

from fastapi import Request
from pydantic import BaseModel, ConfigDict, Field, Strict, ValidationError

from engine.api import InvalidParam, SamplingParams
from server.config.lanes import Lane
from server.http.errors import ApiError, validation_to_api_error
from server.http.json_limits import check_depth
from server.http.numbers import MAX_INT, MIN_INT, cut
from server.prompt.chat import ChatMessage, render_options, with_reasoning_effort
from server.prompt.structured import StructuredFields
from server.prompt.tools import ToolFields

# Integers are 64-bit (the seed's range, wider than any other field's): a larger one is refused here,
# naming its field, before any check that would echo it (server/http/numbers.py).
Int = Annotated[int, Strict(), Field(ge=MIN_INT, le=MAX_INT)]
Bool = Annotated[bool, Strict()]
Num = Annotated[float, Strict(), Field(allow_inf_nan=False)]
Seconds = Annotated[float, Strict(), Field(gt=0, le=86400, allow_inf_nan=False)]
TokenId = Annotated[int, Strict(), Field(ge=0, le=MAX_INT)]
PriorityName = Literal["interactive", "standard", "batch"]

Body = TypeVar("Body", bound=BaseModel)
MAX_N = 64  # most samples per prompt (n)
_TOKEN_KEY = re.compile(r"\s*[+-]?[0-9]+\s*")  # a logit_bias key: what int() reads, ASCII digits only
MAX_TOKEN_KEY_CHARS = 32  # a logit_bias key's length, checked before int() reads it (a token id has <= 20 digits)

_SAMPLING_FIELDS = (
    "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
    "frequency_penalty", "stop", "stop_token_ids", "seed", "ignore_eos", "min_tokens", "speculative",
)  # fmt: skip


async def parse_body(request: Request, model: type[Body]) -> Body:
    """The JSON body as `model`, whatever the Content-Type. Raises ApiError 400/422 naming the field
    (400 `body` when it nests deeper than server/http/json_limits.py allows)."""
    raw = await request.body()
    check_depth(raw, "body")
    try:
        return model.model_validate_json(raw)
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
    speculative: Bool | None = None  # false: this request never speculates (when --speculative-config is on)
    priority: PriorityName | Int | None = None
    timeout_s: Seconds | None = None
    first_token_timeout_s: Seconds | None = None
    cache: Bool = True  # false: never answered from (or stored in) the response cache

    def sampling_params(self, max_tokens: int, logprobs: int | None, **extra: Any) -> SamplingParams:
        """The engine's params (`extra`: more SamplingParams fields); an invalid value raises ApiError 400
        naming the field and its limit."""
        given = {name: getattr(self, name) for name in _SAMPLING_FIELDS if getattr(self, name) is not None}
        try:
            return SamplingParams(max_tokens=max_tokens, logprobs=logprobs, **given, **extra)
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
    logit_bias: dict[str, Num] | None = None  # token id (as a string, OpenAI's form) -> bias in [-100, 100]
    truncate_prompt_tokens: Annotated[int, Strict(), Field(ge=1)] | None = None  # vLLM's: keep the last N
    # vLLM's extras that would change the answer and that we do not have: 400 rather than ignored
    use_beam_search: Any = None
    length_penalty: Any = None
    include_stop_str_in_output: Any = None
    allowed_token_ids: Any = None
    bad_words: Any = None
    logits_processors: Any = None
    prompt_logprobs: Any = None

    def check_unsupported(self) -> None:
        refused = {"use_beam_search": bool(self.use_beam_search), "length_penalty": self.length_penalty not in (None, 1, 1.0),
                   "include_stop_str_in_output": bool(self.include_stop_str_in_output),
                   "allowed_token_ids": self.allowed_token_ids is not None, "bad_words": bool(self.bad_words),
                   "logits_processors": bool(self.logits_processors),
                   "prompt_logprobs": self.prompt_logprobs is not None}  # fmt: skip
        for name, bad in refused.items():
            if bad:
                hint = " (use echo with logprobs)" if name == "prompt_logprobs" else ""
                raise ApiError(400, "invalid_request", f"{name} is not supported{hint}", param=name)
        self._check_counts()
        self._check_json_texts()

    def _check_json_texts(self) -> None:
        """Schemas given as JSON text are parsed later (server/prompt/structured.py): bound their depth
        here, as the body's was. Raises ApiError 400 naming the field."""
        inner = (self.response_format or {}).get("json_schema")
        texts = {"guided_json": self.guided_json, "structured_outputs.json": (self.structured_outputs or {}).get("json"),
                 "response_format.json_schema.schema": inner.get("schema") if isinstance(inner, dict) else None}
        for field, text in texts.items():
            if isinstance(text, str):
                check_depth(text, field)

    def _check_counts(self) -> None:
        if self.n is not None and not 1 <= self.n <= MAX_N:
            raise ApiError(400, "invalid_request", f"n must be in [1, {MAX_N}], got {self.n}", param="n")
        if self.best_of not in (None, 1, self.choices_per_prompt):
            raise ApiError(400, "invalid_request", "best_of is not supported (only best_of equal to n, which "
                           "returns every sample)", param="best_of")  # fmt: skip

    @property
    def choices_per_prompt(self) -> int:
        return self.n or 1

    def bias(self) -> dict[int, float]:
        """logit_bias with integer keys ("5", " 5" and "05" are token 5). Raises ApiError 400 (param
        logit_bias) for a key that is not a token id, and for two keys naming the same token."""
        out: dict[int, float] = {}
        given: dict[int, str] = {}
        for key, value in (self.logit_bias or {}).items():
            if len(key) > MAX_TOKEN_KEY_CHARS or not _TOKEN_KEY.fullmatch(key):
                raise ApiError(400, "invalid_request", f"logit_bias keys are token ids (at most "
                               f"{MAX_TOKEN_KEY_CHARS} characters), got {cut(key)}", param="logit_bias")  # fmt: skip
            token = int(key)
            if token in given:
                raise ApiError(400, "invalid_request", f"logit_bias names token {token} twice ({given[token]!r} "
                               f"and {key!r})", param="logit_bias")  # fmt: skip
            given[token], out[token] = key, value
        return out

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
    # vLLM's (CompletionRequest, default true): text prompts tokenized with the tokenizer's special tokens
    # (the BOS Gemma and Llama expect); false: the text alone. Chat requests keep false (the template's own)
    add_special_tokens: Bool = True


class ChatRequest(OpenAIFields, ToolFields):
    """Body of POST /v1/chat/completions."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: Int | None = None
    max_completion_tokens: Int | None = None
    logprobs: Bool | None = False
    top_logprobs: Int | None = None
    add_generation_prompt: Bool = True  # end the prompt with the assistant turn's opening
    continue_final_message: Bool = False  # the last message is left open for the model to continue
    chat_template_kwargs: dict[str, Any] | None = None  # template variables (enable_thinking, ...)
    include_reasoning: Bool = True  # vLLM's: false drops the reasoning (and a grammar holds from the first token)
    reasoning_effort: str | None = None  # passed to the template; "none" turns enable_thinking off (vLLM's rule)
    chat_template: str | None = None  # refused: templates come from the model or --chat-template
    echo: Bool | None = None  # vLLM's chat echo: refused
    functions: Any = None  # the legacy form of tools: refused
    function_call: Any = None
    modalities: list[str] | None = None  # ["text"] only
    audio: Any = None
    documents: Any = None

    def check_chat_fields(self) -> None:
        if self.chat_template is not None:
            raise ApiError(400, "invalid_request", "per-request chat templates are not accepted; start the "
                           "server with --chat-template FILE", param="chat_template")  # fmt: skip
        if self.echo:
            raise ApiError(400, "invalid_request", "echo is not supported on chat completions", param="echo")
        for name in ("functions", "function_call"):
            if getattr(self, name):
                raise ApiError(400, "invalid_request", f"{name} (the legacy form) is not supported: use tools",
                               param=name)  # fmt: skip
        if self.audio or (self.modalities and set(self.modalities) - {"text"}):
            raise ApiError(400, "invalid_request", "only text output is supported", param="modalities")
        if self.documents:
            raise ApiError(400, "invalid_request", "documents are not supported", param="documents")

    def render_options(self) -> dict[str, Any]:
        kwargs = with_reasoning_effort(self.chat_template_kwargs, self.reasoning_effort)
        return render_options(self.add_generation_prompt, self.continue_final_message, kwargs)


class TokenizeRequest(BaseModel):
    """Body of POST /tokenize (vLLM's): a `prompt`, or chat `messages` rendered by the chat template."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: Bool | None = None  # default: true for a prompt, false for messages (vLLM's)
    add_generation_prompt: Bool = True
    continue_final_message: Bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: Bool | None = False

    def render_options(self) -> dict[str, Any]:
        return render_options(self.add_generation_prompt, self.continue_final_message, self.chat_template_kwargs)


class DetokenizeRequest(BaseModel):
    """Body of POST /detokenize (vLLM's)."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    tokens: list[TokenId]
