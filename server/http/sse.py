"""Server-sent events as tokenmill writes them: fields and events end in a bare "\n".

The event-stream format allows "\r\n" too (sse-starlette's default), but clients that split a stream
on "\n\n" themselves, as `vllm bench serve` does, then see no event boundary at all whenever two events
arrive in one read, and lose the request. Every stream goes through `event()` and `SEP`.
"""

from __future__ import annotations

from sse_starlette import ServerSentEvent

SEP = "\n"  # line separator of every event, ping comments included (EventSourceResponse(sep=SEP))


def event(data: str, name: str | None = None) -> ServerSentEvent:
    """One event: `event: name` (when given) and `data: ...` lines."""
    return ServerSentEvent(data=data, event=name, sep=SEP)
