"""Error bodies and exception handlers: every failure is JSON naming what went wrong, never a bare 500.

Native routes answer `{"error": {"type", "message", "param"?, ...}}`; `/v1/*` routes answer the
OpenAI shape `{"error": {"message", "type", "param", "code"}}`, but Anthropic's Messages routes
(`/v1/messages*`) answer its shape, `{"type": "error", "error": {"type", "message"}}`, the type by status
(invalid_request_error, not_found_error, rate_limit_error, overloaded_error, ...), the message led by
the field at fault; the TGI routes (`POST /`, `/generate_stream`) TGI's `{"error": "...", "error_type":
"validation"|"overloaded"|...}`, which Hugging Face's client turns into its typed errors. Schema errors
on native routes are 422, malformed JSON is 400; OpenAI routes answer 400 for both, as OpenAI does
(Anthropic's routes too).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping, MutableMapping, Sequence
from typing import Any, cast

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from server.http.numbers import MAX_NUMBER_DIGITS, number_field

log = logging.getLogger("tokenmill.server")

_MAX_LISTED_ERRORS = 5
# Pydantic names the member of a union that failed ("str", "list[int]", "literal['a','b']") in `loc`.
_UNION_TAG = re.compile(r"^(str|int|float|bool|none|[a-z-]+\[.*\])$")


class ApiError(Exception):
    """Raised by routes: becomes a JSON error response with `status`."""

    def __init__(
        self,
        status: int,
        type: str,
        message: str,
        param: str | None = None,
        headers: Mapping[str, str] | None = None,
        extra: Mapping[str, Any] | None = None,
        accounted: bool = False,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.type = type
        self.message = message
        self.param = param
        self.headers = dict(headers or {})
        self.extra = dict(extra or {})
        # the request was already counted and logged as an admitted request (a 429 from its lane, or a
        # failure the worker reported): the error log (server/http/error_log.py) counts it, logs no second line
        self.accounted = accounted


TGI_PATHS = ("/", "/generate_stream")
_TGI_TYPES = {"invalid_request": "validation", "overloaded": "overloaded", "unauthorized": "authorization"}


# Anthropic's error types by status (what its SDK turns into typed exceptions); others are api_error.
ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                   404: "not_found_error", 408: "timeout_error", 413: "request_too_large", 429: "rate_limit_error",
                   503: "overloaded_error", 529: "overloaded_error"}  # fmt: skip


def is_openai_path(path: str) -> bool:
    return path.startswith("/v1/")


def is_anthropic_path(path: str) -> bool:
    return path == "/v1/messages" or path.startswith("/v1/messages/")


def error_body(path: str, status: int, type: str, message: str, param: str | None = None,
               extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    if path in TGI_PATHS:
        return {"error": message, "error_type": _TGI_TYPES.get(type, type)}
    if is_anthropic_path(path):  # no `param` in Anthropic's shape: the message names the field
        named = message if param is None or message.startswith(param) else f"{param}: {message}"
        return {"type": "error", "error": {"type": ANTHROPIC_TYPES.get(status, "api_error"), "message": named}}
    if is_openai_path(path):
        type = "invalid_request_error" if type == "invalid_request" else type
        return {"error": {"message": message, "type": type, "param": param, "code": status, **(extra or {})}}
    body: dict[str, Any] = {"type": type, "message": message}
    if param is not None:
        body["param"] = param
    return {"error": {**body, **(extra or {})}}


ERROR_SCOPE_KEY = "tokenmill.error"  # the ApiError a response answered, for server/http/error_log.py


def error_response(path: str, err: ApiError, scope: MutableMapping[str, Any] | None = None) -> JSONResponse:
    """The error's JSON response; `scope` (the request's ASGI scope) records which error it was."""
    if scope is not None:
        scope[ERROR_SCOPE_KEY] = err
    body = error_body(path, err.status, err.type, err.message, err.param, err.extra)
    return JSONResponse(body, status_code=err.status, headers=err.headers)


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(ApiError, _on_api_error)
    app.add_exception_handler(RequestValidationError, _on_validation_error)
    app.add_exception_handler(StarletteHTTPException, _on_http_exception)
    # Any other exception: InternalErrorMiddleware (Starlette's own 500 handler re-raises after
    # answering, and uvicorn then drops the connection without `Connection: close`).


# Handlers take `Exception` (what Starlette's signature promises) and narrow it: each is registered for
# one exception class only.
async def _on_api_error(request: Request, exc: Exception) -> JSONResponse:
    return error_response(request.url.path, cast(ApiError, exc), request.scope)


async def _on_validation_error(request: Request, exc: Exception) -> JSONResponse:
    errors = cast(RequestValidationError, exc).errors()
    return error_response(request.url.path, validation_to_api_error(request.url.path, errors), request.scope)


def validation_to_api_error(path: str, errors: Sequence[Any]) -> ApiError:
    """Pydantic errors -> one ApiError naming the first bad field and listing a few."""
    invalid = next((e for e in errors if e.get("type") == "json_invalid"), None)
    if invalid is not None:
        detail = invalid.get("ctx", {}).get("error", "")
        raw = invalid.get("input")
        field = number_field(raw, detail) if isinstance(raw, str | bytes) else None
        if field is not None:  # a number longer than the parser reads: name where it is
            return ApiError(400, "invalid_request", f"{field}: a number of more than {MAX_NUMBER_DIGITS} digits",
                            param=field)  # fmt: skip
        return ApiError(400, "invalid_request", f"malformed JSON body: {detail}".rstrip(": "), param="body")
    parts, first_param = [], None
    for e in errors[:_MAX_LISTED_ERRORS]:
        loc = [str(p) for p in e.get("loc", ()) if p != "body" and not _UNION_TAG.match(str(p))]
        param = ".".join(loc) or "body"
        first_param = first_param or param
        parts.append(f"{param}: {e.get('msg', 'invalid')}")
    parts = list(dict.fromkeys(parts))  # union members repeat the same complaint
    if len(errors) > _MAX_LISTED_ERRORS:
        parts.append(f"and {len(errors) - _MAX_LISTED_ERRORS} more")
    status = 400 if is_openai_path(path) else 422
    return ApiError(status, "invalid_request", "; ".join(parts), param=first_param)


async def _on_http_exception(request: Request, exc: Exception) -> JSONResponse:
    exc = cast(StarletteHTTPException, exc)
    kind = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
    err = ApiError(exc.status_code, kind, str(exc.detail), headers=exc.headers)
    return error_response(request.url.path, err, request.scope)


class InternalErrorMiddleware:
    """An exception nothing else handled becomes a 500 JSON error with `Connection: close`, and is logged
    here, not raised on: uvicorn sends the answer and then closes the connection cleanly (a keep-alive
    client sees the close announced, and its next request opens a new connection). Once a response has
    started nothing more can be said on it: the exception goes on and the connection is dropped. Install
    it outside every other middleware but the error log, which then counts the 500."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def watch(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, watch)
        except Exception as exc:
            if started:
                raise
            log.exception("unhandled error on %s", scope.get("path"))
            err = ApiError(500, "internal_error", f"internal error: {type(exc).__name__}",
                           headers={"Connection": "close"})  # fmt: skip
            await error_response(scope.get("path", ""), err, scope)(scope, receive, send)
