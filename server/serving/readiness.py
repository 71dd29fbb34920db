"""Whether the server takes requests, and why not: one set of checks for both questions, asked of the
promoted version of every model name (a candidate that fails never changes it).

- `status()` is what /health reports: starting (warm-up not done), ok, draining, or unhealthy (a promoted
  version's worker died, the warm-up failed, or a busy engine has not finished a step for
  `stall_timeout_s`).
- `check_accepting()` is what a generation route asks once per request (server/api/respond.py): the
  same checks but the stall one (a stalled engine still queues work: lane bounds and deadlines protect
  it), answered as a 503 with Retry-After.
"""

from __future__ import annotations

import enum
import time

from server.http.errors import ApiError
from server.serving.registry import ModelRegistry


class Status(str, enum.Enum):
    STARTING = "starting"  # loaded, warm-up not done
    OK = "ok"
    DRAINING = "draining"  # shutting down: finishing in-flight requests, refusing new ones
    UNHEALTHY = "unhealthy"  # worker dead or stalled, or warm-up failed


class Readiness:
    """The server's readiness flags (set by the runtime's lifecycle) and the checks over them."""

    def __init__(self, models: ModelRegistry, stall_timeout_s: float) -> None:
        self._models = models
        self._stall_timeout_s = stall_timeout_s
        self.ready = False  # warm-up of the startup versions done
        self.draining = False
        self.failure: str | None = None  # why the server can never become ready (warm-up failed)

    def status(self) -> tuple[Status, str | None]:
        """Readiness as /health reports it, with the reason when not OK."""
        refusal = self._refusal(stall=True)
        return refusal if refusal is not None else (Status.OK, None)

    def check_accepting(self) -> None:
        """Raise ApiError 503 (Retry-After: 1) unless new requests are taken now."""
        refusal = self._refusal(stall=False)
        if refusal is not None:
            status, reason = refusal
            raise ApiError(503, status.value, reason, headers={"Retry-After": "1"})

    def _refusal(self, stall: bool) -> tuple[Status, str] | None:
        if self.draining:
            return Status.DRAINING, "the server is shutting down"
        promoted = self._models.promoted()
        dead = [dep.spec.ref for dep in promoted if not dep.worker.alive]
        if dead:
            which = f" ({', '.join(dead)})" if len(promoted) > 1 else ""
            return Status.UNHEALTHY, f"the engine worker is not running{which}"
        if self.failure:
            return Status.UNHEALTHY, self.failure
        if stall:
            for dep in promoted:
                stalled_s = time.monotonic() - dep.worker.heartbeat
                if dep.worker.in_flight() and stalled_s > self._stall_timeout_s:
                    return Status.UNHEALTHY, f"the busy engine has not completed a step for {stalled_s:.0f}s"
        if not self.ready:
            return Status.STARTING, "the server is warming up"
        return None
