"""Every error answer (status >= 400) counted and logged, whatever produced it: a route's ApiError, a
schema error, an unknown path, the API-key and body-size middlewares. Outermost ASGI middleware: it
watches the status a response starts with and reads which ApiError it was from the request's scope
(server/http/errors.py error_response records it), then counts it in `tokenmill_http_errors_total{endpoint,
status, reason}` and writes one JSON line to the request log: method, endpoint, status, reason, param.
Never the prompt or the message (a template's error can quote message text). A request admitted and
refused later (429 from its lane, a failure the worker reported) already has its request-log line:
it is counted here, not logged twice.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from server.http.errors import ERROR_SCOPE_KEY

request_log = logging.getLogger("tokenmill.requests")

UNMATCHED = "unmatched"  # endpoint label of a path no route serves (bounded cardinality)


class ErrorLogMiddleware:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status: list[int] = []

        async def watch(message: Message) -> None:
            if message["type"] == "http.response.start":
                status.append(int(message["status"]))
            await send(message)

        try:
            await self.app(scope, receive, watch)
        finally:
            if status and status[0] >= 400:
                record(scope, status[0])


def record(scope: Scope, status: int) -> None:
    """Count and log one error answer."""
    err = scope.get(ERROR_SCOPE_KEY)
    reason = getattr(err, "type", None) or f"http_{status}"
    route = scope.get("route")
    endpoint = getattr(route, "path", None) or UNMATCHED
    runtime = getattr(getattr(scope.get("app"), "state", None), "runtime", None)
    if runtime is not None:
        runtime.metrics.http_errors.labels(endpoint, str(status), reason).inc()
    if getattr(err, "accounted", False):
        return
    line: dict[str, Any] = {"event": "http_error", "method": scope.get("method"), "endpoint": endpoint,
                            "status": status, "reason": reason, "param": getattr(err, "param", None)}  # fmt: skip
    request_log.info(json.dumps(line))
