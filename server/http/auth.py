"""Optional API keys: with any configured, every path but /health*, /metrics and /admin/* needs
`Authorization: Bearer KEY`, or `x-api-key: KEY` (Anthropic's header; its SDK sends that one). The
admin API (/admin/*) has keys of its own (`admin_api_keys`, in either header): without any it is off
(404); API keys do not open it, nor admin keys the rest. The runtime LoRA endpoints
(`LORA_PATHS`, vLLM's) are admin routes when admin keys are set, and ordinary API routes otherwise.
Keys are compared in constant time, all of them every time."""

from __future__ import annotations

import hmac

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from server.http.errors import ApiError, error_response

OPEN_PATHS = ("/health", "/health/live", "/metrics")
ADMIN_PREFIX = "/admin/"
LORA_PATHS = ("/v1/load_lora_adapter", "/v1/unload_lora_adapter")


def request_key(headers: Headers) -> str:
    """The key a request presents: its bearer token, else its `x-api-key` header; "" for neither."""
    scheme, _, token = headers.get("authorization", "").partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        return token.strip()
    return headers.get("x-api-key", "").strip()


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

    def __init__(self, app: ASGIApp, keys: tuple[str, ...], admin_paths: tuple[str, ...] = ()) -> None:
        self.app = app
        self.keys = keys
        self.admin_paths = admin_paths  # guarded by AdminKeyMiddleware instead (LORA_PATHS with admin keys)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if (scope["type"] != "http" or not self.keys or path in OPEN_PATHS or path.startswith(ADMIN_PREFIX)
                or path in self.admin_paths):  # fmt: skip
            await self.app(scope, receive, send)
            return
        if key_matches(request_key(Headers(scope=scope)), self.keys):
            await self.app(scope, receive, send)
            return
        err = ApiError(401, "unauthorized", "missing or invalid API key (Authorization: Bearer KEY, or x-api-key: "
                       "KEY)", headers={"WWW-Authenticate": "Bearer"})  # fmt: skip
        await error_response(scope["path"], err, scope)(scope, receive, send)


class AdminKeyMiddleware:
    """Guards /admin/*: 404 when no admin key is configured (the admin API is off), 401 when the request's
    bearer token is not one of them; before the body is read."""

    def __init__(self, app: ASGIApp, keys: tuple[str, ...]) -> None:
        self.app = app
        self.keys = keys

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "") if scope["type"] == "http" else ""
        if not path.startswith(ADMIN_PREFIX) and not (self.keys and path in LORA_PATHS):
            await self.app(scope, receive, send)
            return
        if not self.keys:
            err = ApiError(404, "not_found", "the admin API is off (set admin_api_keys)")
        else:
            if key_matches(request_key(Headers(scope=scope)), self.keys):
                await self.app(scope, receive, send)
                return
            err = ApiError(401, "unauthorized", "missing or invalid admin key (Authorization: Bearer KEY, or x-api-key: KEY)",
                           headers={"WWW-Authenticate": "Bearer"})
        await error_response(scope["path"], err, scope)(scope, receive, send)
