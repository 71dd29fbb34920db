"""What a router in front of several replicas asks a worker, beyond the OpenAI routes: vllm-router (the
vLLM project's router, derived from SGLang's gateway) calls these (docs/DEPLOY.md lists every call).

- GET /get_load: SGLang's load report, `{"load": N, ...}`; the router reads `load` (requests in
  flight here) for `power_of_two` and its /get_loads. GET /load is vLLM's (`{"server_load": N}`).
- GET /get_server_info, GET /get_model_info: SGLang's descriptions of the server and the model; the
  router proxies them to its first worker.
- GET /health_generate: SGLang's "a generation works" check, proxied by the router: readiness here
  (ready means the warm-up generation ran and the worker steps).
- POST /v1/completions/render, POST /v1/chat/completions/render: vLLM's render routes: the prompt as
  the engine would get it (token ids) and the sampling fields, without generating. `cache_aware` asks
  every worker for them on each request (it falls back to /tokenize when they 404).

None of them reaches the engine: they read the runtime's figures and the tokenizer.
"""

from __future__ import annotations

import uuid
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from server.api.health import readiness
from server.api.openai import COMPLETION_DEFAULT_MAX_TOKENS, _completion_prompts
from server.api.protocol import ChatRequest, CompletionRequest, OpenAIFields, parse_body
from server.api.tokenize import deployment
from server.http.errors import ApiError
from server.prompt.chat import template_messages
from server.prompt.tools import plan_tools
from server.serving.runtime import Runtime

router = APIRouter()


def _runtime(request: Request) -> Runtime:
    rt = getattr(request.app.state, "runtime", None)
    if rt is None:
        raise ApiError(503, "starting", "the server is starting", headers={"Retry-After": "1"})
    return rt


@router.get("/get_load")
async def get_load(request: Request) -> dict[str, Any]:
    rt = _runtime(request)
    stats = rt.worker.stats
    return {"load": rt.worker.in_flight(), "num_reqs": stats.running, "num_waiting_reqs": stats.waiting,
            "num_tokens": stats.kv_blocks_used * stats.block_size}  # fmt: skip


@router.get("/load")
async def load(request: Request) -> dict[str, int]:
    return {"server_load": _runtime(request).worker.in_flight()}


@router.get("/get_server_info")
async def get_server_info(request: Request) -> dict[str, Any]:
    rt = _runtime(request)
    dep, s = rt.primary, rt.settings
    return {"model_path": dep.spec.path, "served_model_name": rt.model_name, "version": rt.metrics.server_version,
            "weight_version": dep.version, "context_length": dep.max_model_len, "max_num_seqs": dep.max_num_seqs,
            "max_num_batched_tokens": s.max_num_batched_tokens, "page_size": rt.worker.stats.block_size,
            "dp_size": 1, "tp_size": 1, "enable_prefix_caching": s.enable_prefix_caching, **dep.engine_desc}  # fmt: skip


@router.get("/get_model_info")
async def get_model_info(request: Request) -> dict[str, Any]:
    rt = _runtime(request)
    dep = rt.primary
    return {"model_path": dep.spec.path, "tokenizer_path": dep.spec.path, "served_model_name": rt.model_name,
            "is_generation": True, "weight_version": dep.version, "has_image_understanding": False,
            "has_audio_understanding": False, "preferred_sampling_params": None}  # fmt: skip


@router.get("/health_generate")
async def health_generate(request: Request) -> JSONResponse:
    code, body = readiness(_runtime(request))
    return JSONResponse({"status": body["status"]}, status_code=code)


@router.post("/v1/completions/render")
async def render_completion(request: Request) -> list[dict[str, Any]]:
    """One GenerateRequest per prompt (vLLM returns a list here)."""
    rt = _runtime(request)
    body = await parse_body(request, CompletionRequest)
    dep = await deployment(rt, body.model)
    max_tokens = next((m for m in (body.max_tokens, body.max_completion_tokens) if m is not None),
                      COMPLETION_DEFAULT_MAX_TOKENS)  # fmt: skip
    prompts = await _completion_prompts(dep.codec, dep.max_model_len, body.prompt, max(max_tokens, 1),
                                        body.add_special_tokens)  # fmt: skip
    return [_generate_request(rt, body, ids, max_tokens) for ids, _ in prompts]


@router.post("/v1/chat/completions/render")
async def render_chat(request: Request) -> dict[str, Any]:
    rt = _runtime(request)
    body = await parse_body(request, ChatRequest)
    body.check_chat_fields()
    dep = await deployment(rt, body.model)
    tools = plan_tools(body, body.messages, template_messages(body.messages, dep.codec.content_format),
                       dep.tool_template, dep.tool_parser, dep.grammars.compiler is not None)  # fmt: skip
    try:
        ids = await dep.codec.chat(tools.messages, body.render_options(), tools.template_tools)
    except ApiError:
        raise
    except Exception as exc:
        raise ApiError(400, "invalid_request", f"chat template failed: {exc}", param="messages") from None
    asked = next((m for m in (body.max_completion_tokens, body.max_tokens) if m is not None), None)
    return _generate_request(rt, body, ids, asked if asked is not None else max(1, dep.max_model_len - len(ids)))


def _generate_request(rt: Runtime, body: OpenAIFields, ids: list[int], max_tokens: int) -> dict[str, Any]:
    """vLLM's GenerateRequest (what its /inference/v1/generate takes): token ids and sampling fields."""
    sampling = {"max_tokens": max_tokens, "temperature": body.temperature, "top_p": body.top_p,
                "top_k": body.top_k, "min_p": body.min_p, "seed": body.seed, "stop": body.stop,
                "stop_token_ids": body.stop_token_ids, "ignore_eos": body.ignore_eos}  # fmt: skip
    return {"request_id": f"render-{uuid.uuid4().hex}", "token_ids": ids, "features": None,
            "sampling_params": {k: v for k, v in sampling.items() if v is not None},
            "model": body.model or rt.model_name, "stream": bool(body.stream), "cache_salt": None,
            "priority": body.priority if isinstance(body.priority, int) else 0, "kv_transfer_params": None}  # fmt: skip
