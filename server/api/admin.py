"""The admin API (its own keys, server/http/auth.py AdminKeyMiddleware; off without them): model versions
and their rollout, and the feedback export. docs/OPERATIONS.md has the runbooks.

    GET    /admin/models                                        every name, its versions and their states
    POST   /admin/models/{name}/versions                        load a version beside the running one
    GET    /admin/models/{name}/versions/{version}              one version
    GET    /admin/models/{name}/versions/{version}/experts      tokens routed to each expert (MoE models)
    DELETE /admin/models/{name}/versions/{version}              retire a version that is not promoted
    POST   /admin/models/{name}/versions/{version}/promote      new requests go to it; the old one drains
    POST   /admin/models/{name}/versions/{version}/canary       {"weight": 0-100}
    POST   /admin/models/{name}/rollback                        canary off, or back to the previous version
    GET    /admin/feedback?model=&version=&limit=               ratings with their cost records
"""

from __future__ import annotations

import asyncio
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, Strict

from server.api.protocol import Bool, parse_body
from server.config.units import parse_size
from server.http.errors import ApiError
from server.serving.deployment import Probe
from server.serving.registry import ModelSlot, version_row
from server.serving.rollout import LoadFailed
from server.serving.runtime import Runtime
from server.serving.worker import WorkerUnavailable

router = APIRouter(prefix="/admin")

NonNegativeSeconds = Annotated[float, Strict(), Field(ge=0, le=86400 * 7, allow_inf_nan=False)]


class ProbeBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    prompt: Annotated[str, Field(min_length=1)] | None = None  # default: settings.probe_prompt
    max_tokens: Annotated[int, Strict(), Field(ge=1, le=256)] | None = None  # default: settings.probe_max_tokens
    expect: Annotated[str, Field(min_length=1)] | None = None  # the output must contain this text


class LoadBody(BaseModel):
    """Body of POST /admin/models/{name}/versions."""

    model_config = ConfigDict(extra="forbid")

    version: str
    path: Annotated[str, Field(min_length=1)] | None = None  # default: models_dir/name/version
    kv_cache_memory: int | str | None = None  # bytes or "512MiB"; default: the server's
    probe: ProbeBody | None = None
    wait: Bool = True  # false: answer 202 at once and load in the background


class PromoteBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    keep_previous_s: NonNegativeSeconds | None = None  # default: settings.keep_previous_s


class CanaryBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    weight: Annotated[int, Strict(), Field(ge=0, le=100)]


def _rt(request: Request) -> Runtime:
    return request.app.state.runtime


def _slot_body(slot: ModelSlot) -> dict[str, Any]:
    return {"name": slot.name, "aliases": sorted(slot.aliases), "promoted": slot.promoted,
            "previous": slot.previous, "canary": slot.canary, "weight": slot.weight if slot.canary else 0,
            "versions": slot.describe()}  # fmt: skip


@router.get("/models")
async def list_models(request: Request) -> dict[str, Any]:
    return {"data": [_slot_body(slot) for slot in _rt(request).models.slots.values()]}


@router.post("/models/{name:path}/versions")
async def load(name: str, request: Request) -> Response:
    rt = _rt(request)
    body = await parse_body(request, LoadBody)
    try:
        kv = parse_size(body.kv_cache_memory)
        if kv is not None and (isinstance(kv, bool) or kv <= 0):
            raise ValueError(f"must be a positive number of bytes, got {body.kv_cache_memory!r}")
    except ValueError as exc:
        raise ApiError(400, "invalid_request", f"kv_cache_memory: {exc}", param="kv_cache_memory") from None
    given = body.probe or ProbeBody()
    probe = Probe(given.prompt or rt.settings.probe_prompt, given.max_tokens or rt.settings.probe_max_tokens,
                  given.expect)  # fmt: skip
    task = rt.rollout.start_load(name, body.version, body.path, kv, probe)
    location = {"Location": f"/admin/models/{name}/versions/{body.version}"}
    if not body.wait:
        return JSONResponse({"id": f"{name}@{body.version}", "state": "loading"}, status_code=202, headers=location)
    try:
        dep = await asyncio.shield(task)  # a client that hangs up does not cancel the load
    except LoadFailed as exc:
        raise ApiError(422, exc.kind, exc.message, param="path" if exc.kind == "load_failed" else "probe") from None
    return JSONResponse(version_row(rt.models.slot(name), dep), status_code=201, headers=location)


EXPERTS_TIMEOUT_S = 30.0  # a worker that does not answer between two steps in this long is stuck


@router.get("/models/{name:path}/versions/{version}/experts")
async def experts(name: str, version: str, request: Request) -> dict[str, Any]:
    """A mixture-of-experts version's tokens routed to each expert since it loaded, per sparse layer
    (debugging: which experts are hot or never used; kept out of /metrics, whose labels it would explode)."""
    dep = _rt(request).models.slot(name).versions.get(version)
    if dep is None:
        raise ApiError(404, "not_found", f"{name}@{version} is not loaded")
    try:
        counts = await asyncio.wait_for(asyncio.wrap_future(dep.worker.call(lambda e: e.expert_counts())),
                                        EXPERTS_TIMEOUT_S)
    except WorkerUnavailable:
        raise ApiError(503, "unavailable", f"{name}@{version} is not running") from None
    if counts is None:
        raise ApiError(404, "not_found", f"{name}@{version} is not a mixture-of-experts model")
    return {"id": dep.spec.ref, "version": version, "layers": [{"layer": i, "tokens": c} for i, c in enumerate(counts)]}


@router.get("/models/{name:path}/versions/{version}")
async def show(name: str, version: str, request: Request) -> dict[str, Any]:
    slot = _rt(request).models.slot(name)
    for row in slot.describe():
        if row["version"] == version:
            return row
    raise ApiError(404, "not_found", f"{name}@{version} is not loaded")


@router.delete("/models/{name:path}/versions/{version}")
async def remove(name: str, version: str, request: Request) -> Response:
    _rt(request).rollout.remove(name, version)
    return Response(status_code=204)


@router.post("/models/{name:path}/versions/{version}/promote")
async def promote(name: str, version: str, request: Request) -> dict[str, Any]:
    rt = _rt(request)
    body = await _optional_body(request, PromoteBody)
    return _slot_body(rt.rollout.promote(name, version, body.keep_previous_s))


@router.post("/models/{name:path}/versions/{version}/canary")
async def canary(name: str, version: str, request: Request) -> dict[str, Any]:
    rt = _rt(request)
    body = await parse_body(request, CanaryBody)
    return _slot_body(rt.rollout.set_canary(name, version, body.weight))


@router.post("/models/{name:path}/rollback")
async def rollback(name: str, request: Request) -> dict[str, Any]:
    return _slot_body(_rt(request).rollout.rollback(name))


@router.get("/feedback")
async def export_feedback(
    request: Request,
    model: str | None = None,
    version: str | None = None,
    limit: Annotated[int, Query(ge=1, le=100000)] = 1000,
    lora: str | None = None,
) -> dict[str, Any]:
    rt = _rt(request)
    if rt.feedback is None:
        raise ApiError(404, "not_found", "feedback is off (set feedback_db)")
    return {"data": await rt.feedback.export(model, version, limit, lora)}


async def _optional_body(request: Request, model: type[PromoteBody]) -> PromoteBody:
    if not (await request.body()).strip():
        return model()
    return await parse_body(request, model)

