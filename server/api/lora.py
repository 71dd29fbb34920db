"""vLLM's runtime LoRA endpoints. With admin keys set they need one (server/http/auth.py LORA_PATHS);
otherwise the API key, like any /v1 route.

    POST /v1/load_lora_adapter    {"lora_name": ..., "lora_path": ...}   every loaded version of the default model
    POST /v1/unload_lora_adapter  {"lora_name": ...}

A load reads and validates the adapter on each version's worker thread, between two steps; a refusal
(missing files, wrong shapes, rank above --max-lora-rank, another base model, unknown target modules)
is a 4xx naming the problem, and a version that had loaded it already unloads it again: all or none.
An unload takes the name away at once (new requests naming it get 404); requests already handed to the
engine finish on the adapter, whose weights go after them (let-finish, never 409). A version the admin
API loads later gets the same adapters before it serves (server/serving/adapters.py).
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field

from engine.api import LoraError, LoraInfo
from server.api.protocol import parse_body
from server.http.errors import ApiError
from server.serving.adapters import on_worker
from server.serving.deployment import Deployment
from server.serving.runtime import Runtime

router = APIRouter(prefix="/v1")

Name = Annotated[str, Field(min_length=1, max_length=256)]


class LoadLoraBody(BaseModel):
    model_config = ConfigDict(extra="ignore")  # vLLM clients may send more (load_inplace, ...)

    lora_name: Name
    lora_path: Annotated[str, Field(min_length=1, max_length=4096)]


class UnloadLoraBody(BaseModel):
    model_config = ConfigDict(extra="ignore")

    lora_name: Name


@router.post("/load_lora_adapter")
async def load_lora_adapter(request: Request) -> dict[str, Any]:
    rt: Runtime = request.app.state.runtime
    body = await parse_body(request, LoadLoraBody)
    async with rt.adapters.lock:  # one change at a time, and none while a new version is matched
        slot = rt.models.default
        deps = _lora_versions(slot.versions.values())
        if rt.models.is_model_name(body.lora_name) or rt.models.adapter_slot(body.lora_name) is not None:
            raise ApiError(409, "lora_exists", f"the name {body.lora_name!r} is already served", param="lora_name")
        loaded: list[Deployment] = []
        try:
            for dep in deps:
                info = await _on_worker(dep, lambda engine: engine.load_lora(body.lora_name, body.lora_path))
                dep.adapters[info.name] = info
                loaded.append(dep)
        except BaseException:
            for dep in loaded:  # all or none
                dep.adapters.pop(body.lora_name, None)
                await _on_worker(dep, lambda engine: engine.unload_lora(body.lora_name))
            raise
    return {"object": "lora_adapter", "id": body.lora_name, "parent": slot.name, "rank": info.rank,
            "targets": list(info.targets), "loaded_on": [d.spec.ref for d in loaded]}  # fmt: skip


@router.post("/unload_lora_adapter")
async def unload_lora_adapter(request: Request) -> dict[str, Any]:
    rt: Runtime = request.app.state.runtime
    body = await parse_body(request, UnloadLoraBody)
    async with rt.adapters.lock:
        holders = [dep for _, dep in rt.models.deployments() if body.lora_name in dep.adapters]
        if not holders:
            _lora_versions([dep for _, dep in rt.models.deployments()])  # 400 when LoRA is off
            raise ApiError(404, "lora_not_found", f"no adapter named {body.lora_name!r} is loaded", param="lora_name")
        for dep in holders:
            dep.adapters.pop(body.lora_name, None)  # new requests: 404 from now on
            await _on_worker(dep, lambda engine: engine.unload_lora(body.lora_name))
    return {"object": "lora_adapter", "id": body.lora_name, "deleted": True}


def _lora_versions(deps) -> list[Deployment]:
    found = [dep for dep in deps if dep.lora_enabled and dep.worker.alive]
    if not found:
        raise ApiError(400, "invalid_request", "LoRA adapters are off on this server (start it with --enable-lora)",
                       param="lora_name")  # fmt: skip
    return found


async def _on_worker(dep: Deployment, fn) -> LoraInfo:
    try:
        return await on_worker(dep, fn)
    except LoraError as exc:
        raise ApiError(exc.status, exc.kind, exc.message, param=exc.field) from None
