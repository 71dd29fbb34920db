"""The admission lanes: what they are (`Lane`, the engine priority each maps to), how much one may hold
(`LaneBounds`) and its default deadlines (`LaneDeadlines`). Settings name them per lane
(`interactive_max_queued_requests`, ...); server/serving/admission.py counts what waits in them.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Lane(enum.IntEnum):
    """A lane's value is the engine priority it maps to: lower runs first."""

    INTERACTIVE = 0
    STANDARD = 1
    BATCH = 2

    @property
    def label(self) -> str:
        return self.name.lower()

    @classmethod
    def parse(cls, value: str | int) -> Lane:
        """A lane from its name ("interactive") or its number (0); ValueError otherwise."""
        if isinstance(value, bool):
            raise ValueError(f"priority must be one of {cls.names()} or 0-2, got {value!r}")
        if isinstance(value, int):
            if value in (0, 1, 2):
                return cls(value)
        elif isinstance(value, str) and value.lower() in cls.names():
            return cls[value.upper()]
        raise ValueError(f"priority must be one of {cls.names()} or 0-2, got {value!r}")

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(lane.label for lane in cls)


@dataclass(frozen=True)
class LaneBounds:
    """How much one lane may hold: size it as expected requests/s x the queue wait you accept."""

    max_requests: int
    max_tokens: int

    def __post_init__(self) -> None:
        for name in ("max_requests", "max_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")


@dataclass(frozen=True)
class LaneDeadlines:
    """Per-lane defaults, in seconds; None means no limit."""

    queue_s: float | None  # longest wait in the lane before the request is refused (503)
    first_token_s: float | None  # from arrival to the first token; else aborted, finish_reason timeout
    total_s: float | None  # from arrival to the last token; else aborted, finish_reason timeout
