"""Text Generation Inference's API, so Hugging Face's `InferenceClient.text_generation` (and other TGI
clients) work: `POST /` with `{"inputs", "parameters", "stream"}` answers `[{"generated_text", "details"?}]`
or a stream; `POST /generate_stream` always streams; `POST /generate` with TGI's body (`inputs`, no
`prompt`: server/api/generate.py) answers TGI's one object `{"generated_text", "details"?}`, never a
stream; `GET /info` describes the server as TGI's router does. Stream events are TGI's: `data: {"index", "token":
{"id", "text", "logprob", "special"}, "generated_text", "details"}`, the last one carrying the whole text
and the details. Errors are TGI's `{"error", "error_type"}` on `/` and `/generate_stream`
(server/http/errors.py); on `/generate` they keep the native shape.

Sampling as TGI decides it: greedy unless `do_sample` or a sampling parameter (temperature != 1,
top_k, top_p < 1) is given.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncGenerator
from typing import Annotated, Any

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field
from sse_starlette import ServerSentEvent

from engine.api import SamplingParams, TokenLogprob
from server.api.choices import start_choices
from server.api.protocol import Bool, Int, Num
from server.api.respond import Call, ChoiceEvents, generation, respond
from server.api.tokenize import deployment
from server.http import sse
from server.http.errors import ApiError
from server.http.numbers import MAX_INT
from server.ops.feedback import RecordKey
from server.prompt.codec import PromptCodec, check_prompt_bytes
from server.serving.dispatch import cache_scope, picked, request_owner, request_tenant
from server.serving.gateway import GenerationRequest
from server.serving.handle import Completed, Handle
from server.serving.ticket import Finished, Tokens

router = APIRouter()

DEFAULT_MAX_NEW_TOKENS = 100  # TGI's


class TGIParameters(BaseModel):
    """TGI's `parameters`; unknown ones are ignored, those that would change the answer and that we do
    not have get 400."""

    model_config = ConfigDict(extra="ignore")

    max_new_tokens: Annotated[int, Field(ge=1, le=MAX_INT)] | None = None
    do_sample: Bool | None = None
    temperature: Num | None = None
    top_k: Int | None = None
    top_p: Num | None = None
    repetition_penalty: Num | None = None
    frequency_penalty: Num | None = None
    seed: Int | None = None
    stop: list[str] | None = None
    top_n_tokens: Int | None = None
    details: Bool = False
    decoder_input_details: Bool = False
    return_full_text: Bool | None = False
    truncate: Annotated[int, Field(ge=1, le=MAX_INT)] | None = None
    typical_p: Num | None = None
    watermark: Bool | None = False
    best_of: Int | None = None
    grammar: Any = None
    adapter_id: str | None = None

    def check(self) -> None:
        refused = {"typical_p": self.typical_p not in (None, 1.0), "watermark": bool(self.watermark),
                   "best_of": self.best_of not in (None, 1), "grammar": self.grammar is not None,
                   "adapter_id": self.adapter_id is not None}  # fmt: skip
        for name, bad in refused.items():
            if bad:
                raise ApiError(400, "invalid_request", f"parameters.{name} is not supported", param=f"parameters.{name}")

    def sampling_params(self) -> SamplingParams:
        sample = bool(self.do_sample) or self.temperature not in (None, 1.0) or bool(self.top_k) \
            or self.top_p not in (None, 1.0)  # fmt: skip
        given: dict[str, Any] = {"max_tokens": self.max_new_tokens or DEFAULT_MAX_NEW_TOKENS,
                                 "temperature": (self.temperature or 1.0) if sample else 0.0}  # fmt: skip
        for name in ("top_k", "top_p", "repetition_penalty", "frequency_penalty", "seed"):
            if getattr(self, name) is not None:
                given[name] = getattr(self, name)
        if self.stop:
            given["stop"] = self.stop
        given["logprobs"] = self.top_n_tokens or 0  # every TGI token carries its logprob
        if self.decoder_input_details:
            given["prompt_logprobs"] = self.top_n_tokens or 0
        try:
            return SamplingParams(**given)
        except ValueError as exc:
            field = getattr(exc, "field", None)
            raise ApiError(400, "invalid_request", str(getattr(exc, "message", exc)),
                           param=f"parameters.{field}" if field else "parameters") from None


class TGIRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    inputs: Annotated[str, Field(min_length=1)]
    parameters: TGIParameters = Field(default_factory=TGIParameters)
    stream: Bool = False


# The preamble (server/api/respond.py generation): runtime, readiness check, parsed body.
TGICall = Annotated[Call[TGIRequest], generation(TGIRequest)]


@router.get("/info")
async def info(request: Request) -> dict[str, Any]:
    """TGI's `Info` for the default model (TGI serves one): what we know, and TGI's names for it."""
    rt = request.app.state.runtime
    dep = await deployment(rt, None)
    s = rt.settings
    longest_input = max(dep.max_model_len - 1, 0)  # room for one new token
    return {
        "model_id": dep.spec.name, "model_sha": None, "model_pipeline_tag": "text-generation",
        "model_dtype": f"torch.{dep.engine_desc['dtype']}", "model_device_type": dep.engine_desc["device"],
        # running seats and the standard lane's queue: past them a request gets 429, as past TGI's bound
        "max_concurrent_requests": dep.max_num_seqs + s.standard_max_queued_requests,
        "max_best_of": 1, "max_stop_sequences": None,  # best_of > 1 is refused; stop strings are not counted
        "max_input_tokens": longest_input, "max_input_length": longest_input,  # TGI 2+ and 1.x names
        "max_total_tokens": dep.max_model_len,
        "max_batch_total_tokens": s.max_num_batched_tokens, "max_batch_size": dep.max_num_seqs,
        "max_client_batch_size": 1,  # one `inputs` per request
        "router": "tokenmill", "version": rt.metrics.server_version, "sha": None, "docker_label": None,
    }  # fmt: skip


@router.post("/")
async def tgi_compat(request: Request, call: TGICall) -> Response:
    return await _generate(request, call, stream=None)


@router.post("/generate_stream")
async def tgi_generate_stream(request: Request, call: TGICall) -> Response:
    return await _generate(request, call, stream=True)


async def tgi_generate(request: Request, call: Call[TGIRequest]) -> Response:
    """TGI's `POST /generate`: one JSON object, whatever `stream` says (TGI streams on /generate_stream)."""
    return await _generate(request, call, stream=False, as_list=False)


async def _generate(request: Request, call: Call[TGIRequest], stream: bool | None, as_list: bool = True) -> Response:
    rt, body = call.runtime, call.body
    p = body.parameters
    p.check()
    params = p.sampling_params()
    async with picked(rt, None) as (_, lease):
        dep = lease.deployment
        check_prompt_bytes(dep.codec, [body.inputs], params.max_tokens, dep.max_model_len, "inputs",
                           max_tokens_field="parameters.max_new_tokens")  # fmt: skip
        ids = await dep.codec.encode(body.inputs)
        if p.truncate is not None:
            ids = ids[-p.truncate :]  # TGI's truncate: keep the last N prompt tokens
        rid = f"tgi-{uuid.uuid4().hex}"
        req = GenerationRequest(rid, ids, params, scope=cache_scope(rt, request, None),
                                max_tokens_field="parameters.max_new_tokens",
                                record=RecordKey(request_owner(rt, request, None), rid),
                                tenant=request_tenant(rt, request))  # fmt: skip
        handles = await start_choices(rt, request, lease, [[req]])
    shape = TGIShape(dep.codec, body, ids, as_list)
    return await respond(rt, request, handles, shape, body.stream if stream is None else stream)


def _event(data: dict[str, Any]) -> ServerSentEvent:
    return sse.event(json.dumps(data, separators=(",", ":"), ensure_ascii=False))


def _error_type(kind: str) -> str:
    return {"invalid_request": "validation", "queue_timeout": "overloaded"}.get(kind, "generation")


class TGIShape:
    """TGI's token entries, details and full text for one request."""

    def __init__(self, codec: PromptCodec, body: TGIRequest, prompt_ids: list[int], as_list: bool = True) -> None:
        self.codec = codec
        self.as_list = as_list  # `POST /` answers [result], `POST /generate` the result alone
        self.asked = body  # the request body
        self.prompt_ids = prompt_ids
        tok = codec.tokenizer
        self.specials = set(getattr(tok, "all_special_ids", None) or [])
        eos = getattr(tok, "eos_token_id", None)
        self.eos = {eos} if isinstance(eos, int) else set()

    def token(self, token_id: int, text: str, lp: TokenLogprob | None, special: bool | None = None) -> dict[str, Any]:
        return {"id": token_id, "text": text, "logprob": lp.logprob if lp is not None else None,
                "special": token_id in self.specials if special is None else special}  # fmt: skip

    def top(self, lp: TokenLogprob | None) -> list[dict[str, Any]] | None:
        if lp is None or not lp.top:
            return None
        return [{"id": t, "text": self.codec.token_text(t), "logprob": v, "special": t in self.specials}
                for t, v in lp.top]  # fmt: skip

    def finish_reason(self, reason: str, tokens: list[int]) -> str:
        if reason == "length":
            return "length"
        return "eos_token" if tokens and (tokens[-1] in self.eos or tokens[-1] in self.specials) else "stop_sequence"

    def full_text(self, text: str) -> str:
        return self.asked.inputs + text if self.asked.parameters.return_full_text else text

    # -- the two answers (server/api/respond.py Shape) ------------------------------------------------
    def body(self, handles: list[Handle], done: list[Completed]) -> list[dict[str, Any]] | dict[str, Any]:
        return [self.result(done[0])] if self.as_list else self.result(done[0])

    async def stream(self, handles: list[Handle], events: ChoiceEvents) -> AsyncGenerator[ServerSentEvent, None]:
        """Each token's event is sent when the next event comes, so the last one can carry the details."""
        handle = handles[0]
        held: dict[str, Any] | None = None
        text, index, tokens = "", 0, []
        async for _, event in events:
            if isinstance(event, Tokens):
                out = event.output
                for i, token_id in enumerate(out.new_token_ids):
                    if held is not None:
                        yield _event(held)
                    lp = out.logprobs[i] if out.logprobs and i < len(out.logprobs) else None
                    piece = out.text_delta if i == len(out.new_token_ids) - 1 else ""
                    text += piece
                    tokens.append(token_id)
                    held = {"index": index, "token": self.token(token_id, piece, lp), "generated_text": None,
                            "details": None, "top_tokens": self.top(lp)}  # fmt: skip
                    index += 1
            elif isinstance(event, Finished) and event.error is not None:
                yield _event({"error": event.error.message, "error_type": _error_type(event.error.kind)})
                return
            elif isinstance(event, Finished):
                last = held or {"index": 0, "token": self.token(0, "", None, special=True), "details": None}
                details = {"finish_reason": self.finish_reason(event.reason, tokens),
                           "generated_tokens": handle.ticket.completion_tokens, "seed": handle.ticket.params.seed}  # fmt: skip
                yield _event({**last, "generated_text": self.full_text(text), "details": details})
                return

    def result(self, done: Completed) -> dict[str, Any]:
        out: dict[str, Any] = {"generated_text": self.full_text(done.text)}
        p = self.asked.parameters
        if not p.details:
            return out
        lps = done.logprobs
        details: dict[str, Any] = {
            "finish_reason": self.finish_reason(done.finished.reason, done.token_ids),
            "generated_tokens": len(done.token_ids), "seed": p.seed, "prefill": [],
            "tokens": [self.token(t, self.codec.token_text(t), lps[i] if i < len(lps) else None)
                       for i, t in enumerate(done.token_ids)],
        }  # fmt: skip
        if p.top_n_tokens:
            details["top_tokens"] = [self.top(lp) or [] for lp in lps]
        if p.decoder_input_details:
            entries = done.prompt_logprobs or [None] * len(self.prompt_ids)
            details["prefill"] = [{"id": t, "text": self.codec.token_text(t), "logprob": e.logprob if e else None}
                                  for t, e in zip(self.prompt_ids, entries, strict=False)]  # fmt: skip
        return {**out, "details": details}
