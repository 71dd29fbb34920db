"""When speculation pays, measured (engine/spec/drafts.py): plain Python, no clock of its own.

Speculation trades a longer step (each speculating row computes 1 + k tokens) for more tokens per
step. At a small batch a step is bound by reading the weights and the extra rows are nearly free; at a
large one it is bound by compute and the rejected drafts are waste. Where the turn comes depends on
the model, the device and the acceptance rate, so it is measured, not set: `SpecGate` keeps, per batch
size bucket (powers of two), an exponential average of the step time per emitted token with drafts and
without, fed with the engine's pure-decode steps, and lets a step speculate when its bucket's average
with drafts is the lower. A bucket with no measurement yet tries speculation first, then a step
without; afterwards every `probe_every`-th decision at a bucket takes the other arm, so a change in
acceptance or load is seen.
"""

from __future__ import annotations

from dataclasses import dataclass, field

EWMA_WEIGHT = 0.2  # weight of the newest step in a bucket's average
PROBE_EVERY = 16  # every this many decisions at a bucket, the arm that lost is measured again


def bucket_of(batch: int) -> int:
    """The power of two at or above batch (1, 2, 4, 8, ...)."""
    return 1 << max(0, (batch - 1).bit_length())


@dataclass
class _Bucket:
    spec: float | None = None  # seconds per emitted token, steps with drafts
    plain: float | None = None  # ... steps without
    decisions: int = 0


@dataclass
class SpecGate:
    """Per-step speculation decision from measured step times (see the module docstring)."""

    weight: float = EWMA_WEIGHT
    probe_every: int = PROBE_EVERY
    _buckets: dict[int, _Bucket] = field(default_factory=dict)

    def should_speculate(self, batch: int) -> bool:
        """Whether a step with `batch` decoding requests should carry drafts (one call per step)."""
        b = self._buckets.setdefault(bucket_of(batch), _Bucket())
        b.decisions += 1
        if b.spec is None:
            return True
        if b.plain is None:
            return False
        better = b.spec <= b.plain
        return not better if b.decisions % self.probe_every == 0 else better

    def record(self, batch: int, speculated: bool, elapsed_s: float, emitted_tokens: int) -> None:
        """One pure-decode step: `batch` rows, with drafts or not, took elapsed_s for emitted_tokens."""
        if emitted_tokens <= 0 or elapsed_s <= 0:
            return
        b = self._buckets.setdefault(bucket_of(batch), _Bucket())
        per_token = elapsed_s / emitted_tokens
        old = b.spec if speculated else b.plain
        new = per_token if old is None else (1 - self.weight) * old + self.weight * per_token
        if speculated:
            b.spec = new
        else:
            b.plain = new

    def estimates(self, batch: int) -> tuple[float | None, float | None]:
        """(seconds per token with drafts, without) at batch's bucket; None where not measured."""
        b = self._buckets.get(bucket_of(batch), _Bucket())
        return b.spec, b.plain
