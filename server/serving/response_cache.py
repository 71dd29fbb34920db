"""The response cache: finished generations of deterministic requests, keyed by everything that decides
their output. A hit is what the engine produced for that key; with `--deterministic` (batch-invariant
mode) that is exactly what it would produce again, without it a bf16 regeneration in another batch
shape may differ (docs/OPERATIONS.md, "Response cache").

- Key: model, version, scope (API key and `user`, hashed), prompt token ids and the whole
  `SamplingParams` (every sampling field, max_tokens, seed, stop, logprobs).
- Only deterministic requests: temperature 0, or a fixed seed. `cache: false` skips it per request.
- Only normal finishes (stop, length) are stored: never timeouts, aborts or errors.
- LRU bounded in bytes (an estimate of what an entry holds, counted the same way for every entry), and a
  TTL. A version change (promote, rollback, unload) drops that model's entries.

Plain Python on the event loop; the route side (replaying a hit as a generation) is server/serving/dispatch.py.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from engine.api import SamplingParams, TokenLogprob
from server.ops.metrics import CacheStats
from server.serving.ticket import Event, Finished, Ticket, Tokens

_ENTRY_OVERHEAD = 256  # bytes counted per entry besides its tokens and text (key, bookkeeping)
_STEP_OVERHEAD = 64
_TOKEN_BYTES = 8
_LOGPROB_BYTES = 32  # one TokenLogprob; each top-N alternative adds _TOP_BYTES
_TOP_BYTES = 16


@dataclass(frozen=True)
class CacheKey:
    """What decides a deterministic request's output."""

    model: str
    version: str
    scope: str  # "" when shared; else a hash of the API key and/or the `user` field
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams  # frozen and hashable: every sampling field, max_tokens and seed included


@dataclass(frozen=True)
class CachedStep:
    """One engine step of the original run, replayed as one event."""

    token_ids: tuple[int, ...]
    text: str
    logprobs: tuple[TokenLogprob, ...] | None


@dataclass(frozen=True)
class CachedResponse:
    """A finished generation, as its client received it."""

    steps: tuple[CachedStep, ...]
    finish_reason: str  # stop or length
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int  # prefix-cache tokens of the original run
    size: int  # estimated bytes; what the byte bound counts


def is_deterministic(params: SamplingParams) -> bool:
    return params.temperature == 0.0 or params.seed is not None


class ResponseCache:
    """LRU in bytes + TTL. `max_bytes` 0 turns it off (nothing is cacheable)."""

    def __init__(self, max_bytes: int, ttl_s: float, clock: Callable[[], float] = time.monotonic,
                 on_evict: Callable[[CacheKey], None] = lambda key: None) -> None:  # fmt: skip
        self.max_bytes = max_bytes
        self.ttl_s = ttl_s
        self.clock = clock
        self._on_evict = on_evict  # an entry dropped by the LRU bound (metrics)
        self._entries: OrderedDict[CacheKey, tuple[CachedResponse, float]] = OrderedDict()  # oldest use first
        self.bytes = 0

    @property
    def enabled(self) -> bool:
        return self.max_bytes > 0

    def __len__(self) -> int:
        return len(self._entries)

    def key(self, model: str, version: str, scope: str, prompt: list[int], params: SamplingParams,
            wanted: bool = True) -> CacheKey | None:  # fmt: skip
        """The key of a request, or None when it must not be cached (off, `cache: false`, not deterministic)."""
        if not (self.enabled and wanted and is_deterministic(params)) or params.prompt_logprobs is not None:
            return None  # prompt log-probabilities are not stored: such requests always run
        return CacheKey(model, version, scope, tuple(prompt), params)

    def get(self, key: CacheKey) -> CachedResponse | None:
        found = self._entries.get(key)
        if found is None:
            return None
        entry, expires = found
        if self.clock() >= expires:
            self._remove(key)
            return None
        self._entries.move_to_end(key)
        return entry

    def put(self, key: CacheKey, entry: CachedResponse) -> bool:
        """Store `entry`, evicting the least recently used as needed; False when it is larger than the
        whole cache (not stored)."""
        size = entry.size + _TOKEN_BYTES * len(key.prompt_token_ids)
        if size > self.max_bytes:
            return False
        if key in self._entries:
            self._remove(key)
        if self.bytes + size > self.max_bytes:
            self._drop_expired()
        while self.bytes + size > self.max_bytes:
            oldest = next(iter(self._entries))
            self._remove(oldest)
            self._on_evict(oldest)
        entry = CachedResponse(entry.steps, entry.finish_reason, entry.prompt_tokens, entry.completion_tokens,
                               entry.cached_tokens, size)  # fmt: skip
        self._entries[key] = (entry, self.clock() + self.ttl_s)
        self.bytes += size
        return True

    def drop(self, model: str, version: str | None = None) -> int:
        """Forget the entries of `model` (of one `version` only, when given); returns how many."""
        keys = [k for k in self._entries if k.model == model and (version is None or k.version == version)]
        for key in keys:
            self._remove(key)
        return len(keys)

    def stats(self) -> list[CacheStats]:
        totals: dict[tuple[str, str], list[int]] = {}
        for key, (entry, _) in self._entries.items():
            count = totals.setdefault((key.model, key.version), [0, 0])
            count[0] += 1
            count[1] += entry.size
        return [CacheStats(m, v, n, b) for (m, v), (n, b) in totals.items()]

    def _drop_expired(self) -> None:
        now = self.clock()
        for key in [k for k, (_, expires) in self._entries.items() if now >= expires]:
            self._remove(key)

    def _remove(self, key: CacheKey) -> None:
        entry, _ = self._entries.pop(key)
        self.bytes -= entry.size


class Recorder:
    """Collects a cacheable request's events as its route reads them; stores the result when it finishes
    normally."""

    def __init__(self, cache: ResponseCache, key: CacheKey) -> None:
        self._cache = cache
        self._key = key
        self._steps: list[CachedStep] = []

    def observe(self, event: Event, ticket: Ticket) -> None:
        if isinstance(event, Tokens):
            out = event.output
            logprobs = tuple(out.logprobs) if out.logprobs is not None else None
            self._steps.append(CachedStep(tuple(out.new_token_ids), out.text_delta, logprobs))
        elif isinstance(event, Finished) and event.error is None and event.reason in ("stop", "length"):
            steps = tuple(self._steps)
            entry = CachedResponse(steps, event.reason, len(ticket.prompt_token_ids), ticket.completion_tokens,
                                   ticket.cached_tokens, _estimate(steps))  # fmt: skip
            self._cache.put(self._key, entry)


def _estimate(steps: tuple[CachedStep, ...]) -> int:
    size = _ENTRY_OVERHEAD
    for step in steps:
        size += _STEP_OVERHEAD + _TOKEN_BYTES * len(step.token_ids) + len(step.text.encode())
        for lp in step.logprobs or ():
            size += _LOGPROB_BYTES + _TOP_BYTES * len(lp.top)
    return size
