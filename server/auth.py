"""Optional API keys: with any configured, every path but /health* and /metrics needs
`Authorization: Bearer KEY`. Keys are compared in constant time, all of them every time."""

from __future__ import annotations

import hmac

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from server.errors import ApiError, error_response

OPEN_PATHS = ("/health", "/health/live", "/metrics")


def key_matches(token: str, keys: tuple[str, ...]) -> bool:
    given = token.encode()
    found = False
    for key in keys:
        found |= hmac.compare_digest(given, key.encode())
    return found


class ApiKeyMiddleware:
    """Pure ASGI middleware: 401 before the body is read when the key is missing or wrong."""

    def __init__(self, app: ASGIApp, keys: tuple[str, ...]) -> None:
        self.app = app
        self.keys = keys

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self.keys or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        scheme, _, token = Headers(scope=scope).get("authorization", "").partition(" ")
        if scheme.lower() == "bearer" and key_matches(token.strip(), self.keys):
            await self.app(scope, receive, send)
            return
        err = ApiError(401, "unauthorized", "missing or invalid API key (Authorization: Bearer KEY)",
                       headers={"WWW-Authenticate": "Bearer"})
        await error_response(scope["path"], err)(scope, receive, send)
