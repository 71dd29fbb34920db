"""The one response path of every generation route (/generate, /v1/completions, /v1/chat/completions,
/v1/responses, TGI's POST / and /generate_stream).

A route parses its body into engine requests and a *shape*: how its API lays out an answer. Everything
else is here, once:

- `generation(Body)`, the preamble as a FastAPI dependency: the app's runtime, the readiness check
  (the only one a request meets: 503 while starting, draining or with a dead worker) and the body
  parsed as `Body` (400/422 naming the field);
- `respond(...)`: the handles (server/serving/handle.py; one per choice, from server/api/choices.py)
  become the JSON answer (every choice collected) or the SSE stream (with one choice, its start is
  awaited up to one ping interval, so a queue timeout until then is still a clean 503), each with the
  version that answers in `X-Model-Version`; every handle is closed if anything fails before the
  response is handed over, and when the stream ends, however it ends. A JSON answer that carries many
  log-probabilities (echo with prompt logprobs: a prompt's tokens x top-N, per choice) is laid out and
  serialized on a thread (`large_body`), in pieces, so the event loop keeps serving meanwhile.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

from fastapi import Depends, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel
from sse_starlette import ServerSentEvent

from server.api.choices import ChoiceStreams, collect_choices
from server.api.protocol import parse_body
from server.serving.handle import Completed, Handle
from server.serving.runtime import Runtime
from server.serving.ticket import Finished, Tokens

MODEL_VERSION_HEADER = "X-Model-Version"

Body = TypeVar("Body", bound=BaseModel)
LARGE_BODY_ENTRIES = 512  # log-probability entries in one answer past which it is built off the loop
RENDER_CHUNK = 256  # list items per json.dumps call in render_json
_RENDER_DEPTH = 5  # levels json_text walks: body (or chunk), choices, a choice, its logprobs, their lists
ChoiceEvents = AsyncIterator[tuple[int, Tokens | Finished]]  # (choice index, event), in arrival order


@dataclass(frozen=True)
class Call(Generic[Body]):
    """What a generation route starts from: the app's runtime and its parsed body."""

    runtime: Runtime
    body: Body


def generation(model: type[Body]) -> Any:
    """The preamble of a generation route, as a dependency: `call: Annotated[Call[X], generation(X)]`."""

    async def preamble(request: Request) -> Call[Body]:
        rt: Runtime = request.app.state.runtime
        rt.readiness.check_accepting()
        return Call(rt, await parse_body(request, model))

    return Depends(preamble)


class Shape(Protocol):
    """How one API lays out its answer to one request (every choice of it)."""

    def body(self, handles: list[Handle], done: list[Completed]) -> Any:
        """The JSON answer, from every choice's whole output (in choice order)."""
        ...

    def stream(self, handles: list[Handle], events: ChoiceEvents) -> AsyncGenerator[ServerSentEvent, None]:
        """The SSE events for `events`; it may stop early (an error event ends a stream)."""
        ...


async def respond(rt: Runtime, request: Request, handles: list[Handle], shape: Shape, stream: bool) -> Response:
    """The response to `handles` (admitted, in choice order) laid out by `shape`. Raises ApiError when
    the request failed before anything was sent."""
    headers = {MODEL_VERSION_HEADER: handles[0].version}
    try:
        if not stream:
            done = await collect_choices(handles, request)
            if large_body(done):
                body = await asyncio.to_thread(render_json, shape.body, handles, done)
                return Response(body, media_type="application/json", headers=headers)
            return JSONResponse(shape.body(handles, done), headers=headers)
        if len(handles) == 1:  # several choices were held until admitted (server/api/choices.py)
            await handles[0].wait_started(rt.settings.sse_ping_s, request)
    except BaseException:
        for h in handles:
            h.close()
        raise
    streams = ChoiceStreams(request, handles, rt.settings.stream_max_pending_tokens)
    content = _closing(streams, shape.stream(handles, streams.events()))
    return streams.response(content, rt.settings.sse_ping_s, headers=headers)


def large_body(done: list[Completed]) -> bool:
    """Whether an answer holds enough log-probability entries (each with its top-N) that laying it out
    would hold the event loop: then it is built off the loop."""
    entries = sum(len(d.logprobs) + len(d.prompt_logprobs or ()) for d in done)
    return entries > LARGE_BODY_ENTRIES


def render_json(build: Callable[..., Any], *args: Any) -> bytes:
    """build(*args) serialized as JSONResponse does (compact, UTF-8, no NaN), in pieces: one json.dumps call
    holds the GIL for all of its input, so a 10 MB answer in one call would stall the event loop's thread
    as long. Objects and short lists are walked (a few levels down), long lists dumped RENDER_CHUNK items
    at a time. For a worker thread."""
    return json_text(build(*args)).encode("utf-8")


def json_text(value: Any, allow_nan: bool = False, depth: int = 0) -> str:
    """json.dumps(value) (compact, not ASCII-escaped), in pieces (render_json): the same text."""
    if isinstance(value, dict) and depth < _RENDER_DEPTH:
        items = (f"{_dumps(key, allow_nan)}:{json_text(item, allow_nan, depth + 1)}" for key, item in value.items())
        return "{" + ",".join(items) + "}"
    if isinstance(value, list) and len(value) > RENDER_CHUNK:
        chunks = (_dumps(value[i : i + RENDER_CHUNK], allow_nan)[1:-1] for i in range(0, len(value), RENDER_CHUNK))
        return "[" + ",".join(chunks) + "]"
    if isinstance(value, list) and depth < _RENDER_DEPTH:
        return "[" + ",".join(json_text(item, allow_nan, depth + 1) for item in value) + "]"
    return _dumps(value, allow_nan)


def _dumps(value: Any, allow_nan: bool) -> str:
    return json.dumps(value, ensure_ascii=False, allow_nan=allow_nan, separators=(",", ":"))


async def _closing(streams: ChoiceStreams,
                   events: AsyncGenerator[ServerSentEvent, None]) -> AsyncIterator[ServerSentEvent]:  # fmt: skip
    """`events`, then every choice closed (aborted if still running), however the stream ends (sent,
    an error event, the client gone)."""
    try:
        async for event in events:
            yield event
    finally:
        streams.close()
        await events.aclose()
