"""vLLM's tokenizer endpoints: POST /tokenize (a prompt, or chat messages through the chat template),
POST /detokenize, GET /tokenizer_info. They run on the version a request's `model` names (the promoted
one unless pinned) and never reach the engine."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from server.api.protocol import DetokenizeRequest, TokenizeRequest, parse_body
from server.http.errors import ApiError
from server.prompt.chat import chat_prompt
from server.serving.deployment import Deployment
from server.serving.runtime import Runtime

router = APIRouter()

_TOKEN_FIELDS = ("bos_token", "eos_token", "pad_token", "unk_token")


async def deployment(rt: Runtime, model: str | None) -> Deployment:
    """The version `model` names, without routing a request to it (no lease, no canary share); a models
    folder's model loads first."""
    slot, pinned, _ = await rt.loaded(model)
    dep = slot.versions.get(pinned or slot.promoted)
    if dep is None:
        raise ApiError(404, "model_not_found", f"model {model} is not served (see /v1/models)", param="model")
    return dep


@router.post("/tokenize")
async def tokenize(request: Request) -> dict[str, Any]:
    rt: Runtime = request.app.state.runtime
    body = await parse_body(request, TokenizeRequest)
    dep = await deployment(rt, body.model)
    if (body.prompt is None) == (body.messages is None):
        raise ApiError(400, "invalid_request", "give exactly one of prompt or messages", param="prompt")
    if body.prompt is not None:
        specials = True if body.add_special_tokens is None else body.add_special_tokens
        ids = await dep.codec.encode(body.prompt, add_special_tokens=specials)
    else:
        if body.add_special_tokens:
            raise ApiError(400, "invalid_request", "add_special_tokens does not apply to messages (the chat "
                           "template places its own)", param="add_special_tokens")  # fmt: skip
        ids = await chat_prompt(dep.codec, body.messages or [], body.render_options())
    strs = dep.codec.tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None
    return {"count": len(ids), "max_model_len": dep.max_model_len, "tokens": ids, "token_strs": strs}


@router.post("/detokenize")
async def detokenize(request: Request) -> dict[str, Any]:
    rt: Runtime = request.app.state.runtime
    body = await parse_body(request, DetokenizeRequest)
    dep = await deployment(rt, body.model)
    vocab = len(dep.codec.tokenizer)
    bad = next((t for t in body.tokens if t >= vocab), None)
    if bad is not None:
        raise ApiError(400, "invalid_request", f"tokens: {bad} is not a token id in [0, {vocab})", param="tokens")
    return {"prompt": dep.codec.decode(body.tokens)}


@router.get("/tokenizer_info")
async def tokenizer_info(request: Request, model: str | None = None) -> dict[str, Any]:
    """What a client needs to tokenize as the server does (lm-eval's remote tokenizer reads it)."""
    rt: Runtime = request.app.state.runtime
    dep = await deployment(rt, model)
    tok = dep.codec.tokenizer
    info: dict[str, Any] = {"tokenizer_class": type(tok).__name__, "model_max_length": dep.max_model_len,
                            "vocab_size": len(tok), "chat_template": dep.codec.chat_template,
                            "add_bos_token": bool(getattr(tok, "add_bos_token", False))}  # fmt: skip
    for name in _TOKEN_FIELDS:
        info[name] = getattr(tok, name, None)
    return info
