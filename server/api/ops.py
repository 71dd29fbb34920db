"""Operational endpoints: /health (readiness), /health/live (liveness), /metrics (Prometheus), and vLLM's
/ping (readiness's status code) and /version."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from server.api.health import liveness, readiness
from server.ops.metrics import CONTENT_TYPE

router = APIRouter()


@router.get("/health")
async def health(request: Request) -> JSONResponse:
    rt = getattr(request.app.state, "runtime", None)
    if rt is None:
        return JSONResponse({"status": "starting"}, status_code=503)
    code, body = readiness(rt)
    return JSONResponse(body, status_code=code)


@router.get("/health/live")
async def live(request: Request) -> JSONResponse:
    rt = getattr(request.app.state, "runtime", None)
    if rt is None:
        return JSONResponse({"status": "starting"}, status_code=200)
    code, body = liveness(rt)
    return JSONResponse(body, status_code=code)


@router.api_route("/ping", methods=["GET", "POST"])
async def ping(request: Request) -> JSONResponse:
    """vLLM's (SageMaker's) health check: 200 when ready, else readiness's code."""
    rt = getattr(request.app.state, "runtime", None)
    if rt is None:
        return JSONResponse({"status": "starting"}, status_code=503)
    code, body = readiness(rt)
    return JSONResponse({"status": body["status"]}, status_code=code)


@router.get("/version")
async def version(request: Request) -> dict[str, str]:
    return {"version": request.app.state.runtime.metrics.server_version}


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    return Response(request.app.state.runtime.metrics.render(), media_type=CONTENT_TYPE)
