"""From a parsed request to what answers it, shared by every generation route: pick the model version
(a lease on it, server/serving/registry.py), look the request up in the response cache, and either
replay the stored result (server/serving/replay.py `ReplayHandle`: the same events a generation sends,
from memory) or admit it to that version's engine (`RequestHandle`), recording the result when it may
be cached.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
from collections.abc import AsyncIterator, Collection, Sequence
from typing import TYPE_CHECKING

from fastapi import Request

from server.http.auth import request_key
from server.serving.gateway import GenerationRequest, admit_unit
from server.serving.handle import Handle
from server.serving.replay import ReplayHandle
from server.serving.response_cache import CacheKey, Recorder

if TYPE_CHECKING:
    from server.serving.deployment import Lease
    from server.serving.registry import ModelSlot
    from server.serving.runtime import Runtime


@contextlib.asynccontextmanager
async def picked(rt: Runtime, model: str | None) -> AsyncIterator[tuple[ModelSlot, Lease]]:
    """The slot `model` names and a lease on the version that serves this request, once it is loaded (a
    models folder's model loads on its first request: server/serving/pool.py). The lease is released
    when the block raises; otherwise the handle built in the block owns it. Raises ApiError 404/503."""
    slot, lease = await rt.acquire(model)
    try:
        yield slot, lease
    except BaseException:
        lease.release()
        raise


def cache_scope(rt: Runtime, request: Request, user: str | None) -> str:
    """Whose response-cache entries a request may see: its API key's (unless response_cache_scope is
    global) and its `user`'s; "" when neither applies (shared)."""
    return _principal(request, rt.settings.response_cache_scope == "api_key" and rt.settings.keyed(),
                      user)  # fmt: skip


def request_owner(rt: Runtime, request: Request, user: str | None) -> str:
    """Whose request this is, for feedback (server/ops/feedback.py RecordKey): its API key's (when the
    server has keys) and its `user`'s; "" when neither applies (a server without keys, no `user`)."""
    return _principal(request, rt.settings.keyed(), user)


def request_tenant(rt: Runtime, request: Request, user: str | None = None) -> str:
    """The tenant the request's key (and its `user`) reaches (server/serving/tenants.py); the default
    tenant otherwise."""
    return rt.tenants.resolve(request_key(request.headers), user)


def _principal(request: Request, by_key: bool, user: str | None) -> str:
    """A hash of the request's key (bearer or x-api-key, when `by_key`) and `user`; "" for neither."""
    parts = []
    if by_key:
        parts.append(f"key:{request_key(request.headers)}")
    if user:
        parts.append(f"user:{user}")
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:32] if parts else ""


def on_adapter(lease: Lease, req: GenerationRequest) -> GenerationRequest:
    """The request with the adapter its lease names (params.lora_name), for every route at once."""
    if lease.lora is None or req.params.lora_name == lease.lora.name:
        return req
    return dataclasses.replace(req, params=dataclasses.replace(req.params, lora_name=lease.lora.name))


def start_unit(rt: Runtime, choices: Sequence[tuple[Lease, GenerationRequest]], held: Collection[int] = (),
               param: str = "n") -> list[Handle]:  # fmt: skip
    """Handles for the choices of one request (each with its lease on one version), in order: a replay for
    each the response cache holds exactly, the others admitted together as one unit (gateway.py
    admit_unit; `held` and `param` as there). Takes over the leases, released if it raises. Raises
    ApiError as admit_unit() does."""
    handles: list[Handle | None] = [None] * len(choices)
    pending: list[tuple[int, CacheKey | None]] = []  # (position, cache key) of the choices to admit
    try:
        choices = [(lease, on_adapter(lease, req)) for lease, req in choices]
        for k, (lease, req) in enumerate(choices):
            dep = lease.deployment
            # an adapter's answers are its own: keyed by its name and load (a reload may change the weights)
            version = dep.version if lease.lora is None else f"{dep.version}+lora{lease.lora.lora_id}"
            key = rt.cache.key(dep.name, version, req.scope, req.prompt_token_ids, req.params, req.cache)
            hit = rt.cache.get(key) if key is not None else None
            if hit is not None:
                dep.metrics.cache_hits.inc()
                cached = ReplayHandle(rt, lease, req, hit)
                cached.ticket.choices = len(choices)
                handles[k] = cached
                continue
            if key is not None:
                dep.metrics.cache_misses.inc()
            pending.append((k, key))
        if pending:
            positions = {k: i for i, (k, _) in enumerate(pending)}
            admitted = admit_unit(rt, [choices[k] for k, _ in pending], [positions[k] for k in held if k in positions],
                                  param, len(choices))  # fmt: skip
            for (k, key), handle in zip(pending, admitted, strict=True):
                if key is not None:
                    handle.recorder = Recorder(rt.cache, key)
                handles[k] = handle
    except BaseException:
        for k, (lease, _) in enumerate(choices):
            replay = handles[k]
            if replay is not None:
                replay.close()
            else:
                lease.release()
        raise
    return [h for h in handles if h is not None]
