"""Readiness and liveness reports.

Readiness (`/health`) is 200 only when the model is loaded, the warm-up generation worked, the worker
thread runs and, when busy, completes steps, and the server is not draining; with several model
versions loaded, that is about the promoted one of each name (a candidate that fails never flips it).
The engine figures are the default model's promoted version's. Liveness (`/health/live`)
only asks whether the worker thread runs: an orchestrator restarts the process when it does not.
"""

from __future__ import annotations

import time
from typing import Any

from server.config.lanes import Lane
from server.serving.readiness import Status
from server.serving.runtime import Runtime


def readiness(rt: Runtime) -> tuple[int, dict[str, Any]]:
    """(HTTP status, body) of GET /health."""
    status, reason = rt.readiness.status()
    now = time.monotonic()
    if rt.models.primary_or_none() is None:  # models load on demand (models_dir) and none is loaded now
        return _nothing_loaded(rt, status, reason, now)
    stats = rt.worker.stats
    load = rt.worker.lane_load()
    last_step = rt.worker.last_step_at
    body: dict[str, Any] = {
        "status": status.value,
        "model": rt.model_name,
        "version": rt.primary.version,
        "models": [{"id": dep.spec.ref, "state": dep.state.value, "role": slot.role(dep.version)}
                   for slot, dep in rt.models.deployments()],
        "uptime_s": round(now - rt.started_at, 3),
        "running": stats.running,
        "waiting": {lane.label: load[lane][0] for lane in Lane},
        "engine_waiting": stats.waiting,
        "in_flight": rt.worker.in_flight(),
        "kv_cache_usage": round(stats.kv_cache_usage, 6),
        "kv_blocks_used": stats.kv_blocks_used,
        "kv_blocks_total": stats.kv_blocks_total,
        "last_step_age_s": None if last_step is None else round(now - last_step, 3),
        "worker_alive": rt.worker.alive,
        **rt.engine_desc,
    }
    if reason:
        body["reason"] = reason
    return (200 if status is Status.OK else 503), body


def _nothing_loaded(rt: Runtime, status: Status, reason: str | None, now: float) -> tuple[int, dict[str, Any]]:
    """/health while no model is loaded: ready (a request loads its model), nothing running."""
    body: dict[str, Any] = {"status": status.value, "model": rt.model_name, "version": None, "models": [],
                            "uptime_s": round(now - rt.started_at, 3), "running": 0,
                            "waiting": {lane.label: 0 for lane in Lane}, "engine_waiting": 0, "in_flight": 0,
                            "worker_alive": True}  # fmt: skip
    if reason:
        body["reason"] = reason
    return (200 if status is Status.OK else 503), body


def liveness(rt: Runtime) -> tuple[int, dict[str, Any]]:
    """(HTTP status, body) of GET /health/live."""
    alive = all(dep.worker.alive for dep in rt.models.promoted())
    return (200 if alive else 503), {"status": "alive" if alive else "dead", "worker_alive": alive}
