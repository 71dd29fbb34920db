"""Optional API keys: with any configured, every path but /health*, /metrics and /admin/* needs
`Authorization: Bearer KEY`. The admin API (/admin/*) has keys of its own (`admin_api_keys`): without
any it is off (404); API keys do not open it, nor admin keys the rest. Keys are compared in constant
time, all of them every time."""

from __future__ import annotations

import hmac

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from server.http.errors import ApiError, error_response

OPEN_PATHS = ("/health", "/health/live", "/metrics")
ADMIN_PREFIX = "/admin/"


def key_matches(token: str, keys: tuple[str, ...]) -> bool:
    """Whether `token` is one of `keys`; an empty token never is (`Authorization: Bearer` alone)."""
    if not token:
        return False
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
        path = scope.get("path", "")
        if scope["type"] != "http" or not self.keys or path in OPEN_PATHS or path.startswith(ADMIN_PREFIX):
            await self.app(scope, receive, send)
            return
        scheme, _, token = Headers(scope=scope).get("authorization", "").partition(" ")
        if scheme.lower() == "bearer" and key_matches(token.strip(), self.keys):
            await self.app(scope, receive, send)
            return
        err = ApiError(401, "unauthorized", "missing or invalid API key (Authorization: Bearer KEY)",
                       headers={"WWW-Authenticate": "Bearer"})
        await error_response(scope["path"], err, scope)(scope, receive, send)


class AdminKeyMiddleware:
    """Guards /admin/*: 404 when no admin key is configured (the admin API is off), 401 when the request's
    bearer token is not one of them; before the body is read."""

    def __init__(self, app: ASGIApp, keys: tuple[str, ...]) -> None:
        self.app = app
        self.keys = keys

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope.get("path", "").startswith(ADMIN_PREFIX):
            await self.app(scope, receive, send)
            return
        if not self.keys:
            err = ApiError(404, "not_found", "the admin API is off (set admin_api_keys)")
        else:
            scheme, _, token = Headers(scope=scope).get("authorization", "").partition(" ")
            if scheme.lower() == "bearer" and key_matches(token.strip(), self.keys):
                await self.app(scope, receive, send)
                return
            err = ApiError(401, "unauthorized", "missing or invalid admin key (Authorization: Bearer KEY)",
                           headers={"WWW-Authenticate": "Bearer"})
        await error_response(scope["path"], err, scope)(scope, receive, send)
