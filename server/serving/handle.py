"""What a route holds for one answer, whoever produces it: a request in a version's engine
(server/serving/gateway.py `RequestHandle`) or a response-cache replay (server/serving/replay.py
`ReplayHandle`). Both give the same events (Tokens ... then one Finished) and the same whole result
(`Completed`); server/api/respond.py turns either into the JSON answer or the SSE stream.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Protocol

from fastapi import Request

from engine.api import TokenLogprob
from server.serving.ticket import Finished, ServerError, Ticket, Tokens


@dataclass
class Completed:
    """Everything a non-streamed request produced."""

    ticket: Ticket
    finished: Finished
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] | None = None  # when params.prompt_logprobs was set


class Handle(Protocol):
    """One admitted (or replayed) request, as a route uses it. close() it exactly once its response is
    done: a request still in the engine is aborted, and the route's lease on its version released."""

    ticket: Ticket  # usage and timing, final once Finished came
    version: str  # the model version that answers
    cached: bool  # a response-cache replay: nothing ran in an engine

    @property
    def request_id(self) -> str: ...

    async def wait_started(self, hold_s: float, request: Request | None = None) -> bool:
        """True once it left its lane's queue; False while it still waits after `hold_s`. Raises ApiError
        when it failed before any output (queue timeout, invalid, shutdown) or the client left."""
        ...

    def events(self) -> AsyncIterator[Tokens | Finished]:
        """Tokens events, then one Finished."""
        ...

    async def collect(self, request: Request) -> Completed:
        """The whole output; closes the handle. Raises ApiError when it failed or the client left."""
        ...

    def release(self) -> None:
        """Hand a choice admitted held (server/api/choices.py) to the engine; a replay has nothing to do."""
        ...

    def close(self, error: ServerError | None = None) -> None:
        """`error`: why a request still running is aborted (None: the client went away)."""
        ...

    async def aclose(self) -> None:
        """close() for Starlette background tasks."""
        ...
