"""OpenAI-compatible API: /v1/models (and /v1/models/{id}), /v1/completions, /v1/chat/completions,
streaming and not. Extensions accepted on both: top_k, min_p, repetition_penalty, ignore_eos,
min_tokens, stop_token_ids, priority, timeout_s, first_token_timeout_s, cache (the same fields as
/generate). `model` may pin a version (`name@version`); every body and chunk carries the version in
`system_fingerprint`. Several choices (a list of prompts, `n`) are several engine requests
(server/api/choices.py), answered through server/api/respond.py with the shapes of
server/api/openai_shapes.py; `echo` returns the prompt, with its token log-probabilities when `logprobs` is set.
Structured outputs (response_format, structured_outputs, guided_*) on both: server/prompt/structured.py; tools
on chat: server/prompt/tools.py (each choice parses its own calls); with --reasoning-parser, chat returns
the reasoning apart (server/prompt/reasoning.py) and tools and grammars apply after it.
"""

from __future__ import annotations

import uuid
from typing import Annotated, Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from engine.api import SamplingParams
from engine.text.tokenization import message_texts
from server.api.choices import sample_params, start_choices
from server.api.openai_shapes import ChatShape, CompletionShape
from server.api.protocol import ChatRequest, CompletionRequest, OpenAIFields
from server.api.respond import Call, generation, respond
from server.http.errors import ApiError
from server.ops.feedback import RecordKey
from server.prompt.chat import template_messages
from server.prompt.codec import PromptCodec, check_prompt_bytes
from server.prompt.reasoning import plan_reasoning
from server.prompt.structured import GrammarRequest, behind_reasoning, requested_grammar, with_grammar
from server.prompt.tools import plan_tools
from server.serving.deployment import Lease
from server.serving.dispatch import cache_scope, picked, request_owner, request_tenant
from server.serving.gateway import GenerationRequest, precheck
from server.serving.handle import Handle
from server.serving.runtime import Runtime

COMPLETION_DEFAULT_MAX_TOKENS = 16
MAX_CHOICES = 1024  # prompts x n in one request

# The preamble of each route (server/api/respond.py generation): runtime, readiness check, parsed body.
CompletionCall = Annotated[Call[CompletionRequest], generation(CompletionRequest)]
ChatCall = Annotated[Call[ChatRequest], generation(ChatRequest)]

router = APIRouter(prefix="/v1")


@router.get("/models")
async def models(request: Request) -> dict[str, Any]:
    rt: Runtime = request.app.state.runtime
    return {"object": "list", "data": rt.models.cards(rt.created)}


@router.get("/models/{model_id:path}")
async def model_card(request: Request, model_id: str) -> dict[str, Any]:
    """One model's card (the SDK's models.retrieve); a name, an alias or name@version. 404 otherwise."""
    rt: Runtime = request.app.state.runtime
    slot, _, adapter = rt.models.route(model_id)
    name = adapter or slot.name  # an adapter's card for `adapter` and `adapter@version`
    return next(card for card in rt.models.cards(rt.created) if card["id"] == name)


@router.post("/completions")
async def completions(request: Request, call: CompletionCall) -> Response:
    rt, body = call.runtime, call.body
    body.check_unsupported()
    if body.suffix:
        raise ApiError(400, "invalid_request", "suffix is not supported (no model served here does fill-in-the-"
                       "middle)", param="suffix")  # fmt: skip
    max_tokens = next((m for m in (body.max_tokens, body.max_completion_tokens) if m is not None),
                      COMPLETION_DEFAULT_MAX_TOKENS)  # fmt: skip
    if max_tokens == 0 and not body.echo:
        raise ApiError(400, "invalid_request", "max_tokens must be >= 1 (0 only with echo)", param="max_tokens")
    asked = requested_grammar(body)
    async with picked(rt, body.model) as (slot, lease):
        dep = lease.deployment
        if asked is not None:
            dep.grammars.check(asked)  # its size: before the prompt is even tokenized
        prompts = await _completion_prompts(dep.codec, dep.max_model_len, body.prompt, max_tokens,
                                            body.add_special_tokens)  # fmt: skip
        cut = [(_truncated(ids, body.truncate_prompt_tokens), ids, text) for ids, text in prompts]
        prompts = [(kept, text if kept is ids else None) for kept, ids, text in cut]  # echo what ran
        extra: dict[str, Any] = {"logit_bias": body.bias()}
        if body.echo and (body.logprobs is not None or max_tokens == 0):  # max_tokens 0: the engine runs the prompt
            extra["prompt_logprobs"] = body.logprobs or 0
        params = await _constrained(rt, lease, body, [ids for ids, _ in prompts],
                                    body.sampling_params(max_tokens, body.logprobs, **extra), asked)  # fmt: skip
        shape = CompletionShape(lease, lease.served_name(slot.name), f"cmpl-{uuid.uuid4().hex}", body.choices_per_prompt,
                                params.logprobs is not None, body.include_usage, prompts if body.echo else None)  # fmt: skip
        handles = await _start(rt, request, body, [ids for ids, _ in prompts], params, shape.id, lease)
    return await respond(rt, request, handles, shape, bool(body.stream))


@router.post("/chat/completions")
async def chat_completions(request: Request, call: ChatCall) -> Response:
    rt, body = call.runtime, call.body
    body.check_unsupported()
    body.check_chat_fields()
    output = requested_grammar(body)
    async with picked(rt, body.model) as (slot, lease):
        dep = lease.deployment
        tools = plan_tools(body, body.messages, template_messages(body.messages, dep.codec.content_format),
                           dep.tool_template, dep.tool_parser, dep.grammars.compiler is not None)  # fmt: skip
        grammar = _one_grammar(output, tools.grammar)
        if grammar is not None:
            dep.grammars.check(grammar)
        messages = tools.messages
        asked = next((m for m in (body.max_completion_tokens, body.max_tokens) if m is not None), None)
        field = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        check_prompt_bytes(dep.codec, message_texts(messages), max(asked or 1, 1), dep.max_model_len, "messages",
                           max_tokens_field=field)  # fmt: skip
        try:
            ids = await dep.codec.chat(messages, body.render_options(), tools.template_tools)
        except ApiError:
            raise
        except Exception as exc:
            raise ApiError(400, "invalid_request", f"chat template failed: {exc}", param="messages") from None
        ids = _truncated(ids, body.truncate_prompt_tokens)
        reasoning, grammar = behind_reasoning(plan_reasoning(dep.reasoning_parser, body.render_options(), ids,
                                                             dep.codec.decode, body.include_reasoning), grammar)  # fmt: skip
        # Without a limit, a chat reply may fill the context (OpenAI's behaviour): the model's, or the KV
        # cache's when that is smaller (dep.max_model_len is the smaller of the two).
        max_tokens = asked if asked is not None else max(1, dep.max_model_len - len(ids))
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        params = await _constrained(rt, lease, body, [ids], body.sampling_params(max_tokens, logprobs,
                                    logit_bias=body.bias()), grammar, field)  # fmt: skip
        shape = ChatShape(lease, lease.served_name(slot.name), f"chatcmpl-{uuid.uuid4().hex}", body.choices_per_prompt,
                          params.logprobs is not None, body.include_usage, tools.new_parser, reasoning)  # fmt: skip
        handles = await _start(rt, request, body, [ids], params, shape.id, lease, field)
    return await respond(rt, request, handles, shape, bool(body.stream))


async def _constrained(rt: Runtime, lease: Lease, body: OpenAIFields, prompts: list[list[int]],
                       params: SamplingParams, asked: GrammarRequest | None,
                       field: str = "max_tokens") -> SamplingParams:  # fmt: skip
    """params with the grammar `asked` compiled, once the request passed every check that needs no
    compile (the combination of fields, each prompt's fit in the context, room in the lane), so a request
    that would be refused compiles nothing."""
    if asked is None:
        return params
    with_grammar(params, asked.spec)  # refuses combinations (min_tokens) before compiling
    _check_choices(len(prompts), body.choices_per_prompt)
    reqs = [GenerationRequest("precheck", ids, params, body.lane(), max_tokens_field=field) for ids in prompts]
    precheck(rt, lease, reqs, body.choices_per_prompt, "n" if len(prompts) == 1 else "prompt")
    return with_grammar(params, await lease.deployment.grammars.compile(asked))


def _check_choices(prompts: int, n: int) -> None:
    if prompts * n > MAX_CHOICES:
        raise ApiError(400, "invalid_request", f"prompts x n must be at most {MAX_CHOICES}", param="n")


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
                 params: SamplingParams, response_id: str, lease: Lease,
                 max_tokens_field: str = "max_tokens") -> list[Handle]:  # fmt: skip
    """Admit every choice: `body.n` samples of each prompt (choice index = prompt x n + sample), each
    recorded for feedback under (response_id, its index). `max_tokens_field`: the body's name for it."""
    n = body.choices_per_prompt
    _check_choices(len(prompts), n)
    scope, owner = cache_scope(rt, request, body.user), request_owner(rt, request, body.user)
    tenant = request_tenant(rt, request, body.user)

    def choice(p: int, j: int) -> GenerationRequest:
        index = p * n + j
        rid = response_id if len(prompts) * n == 1 else f"{response_id}-{index}"  # the engine's id
        return GenerationRequest(rid, prompts[p], sample_params(params, j), body.lane(), body.timeout_s,
                                 body.first_token_timeout_s, body.cache, scope, max_tokens_field=max_tokens_field,
                                 record=RecordKey(owner, response_id, index),  # rated as (response id, choice)
                                 tenant=tenant)

    return await start_choices(rt, request, lease, [[choice(p, j) for j in range(n)] for p in range(len(prompts))])
