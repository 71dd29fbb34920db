"""Tenants at run time: which tenant a key reaches, and each tenant's quotas (server/config/tenants.py
configures them). The fair share inside a lane is the engine scheduler's (engine/sched/fair_share.py);
this is what the server refuses before the engine sees a request.

**Quotas.** Tokens per minute and requests per minute are token buckets that hold one minute's worth and
refill continuously. A request (one HTTP request: all its choices) is charged its prompt tokens and one
request when admitted, and each choice's generated tokens when it ends (the settlement), so the bucket may
go below zero while admitted requests run: nothing admitted is ever stopped by its quota; the next request
waits until the bucket is back above what it needs. A request is admitted when the token bucket holds its
prompt tokens (or is full: a prompt larger than the bucket is slow, not impossible) and the request bucket
one request, and the tenant has fewer than `max_concurrent` requests in flight; otherwise it is answered
429 with a Retry-After from the bucket's refill rate, and an error naming the tenant and the quota (never
a key). Admission runs on the event loop, settlements on the engine's worker thread: a lock guards them.
"""

from __future__ import annotations

import hmac
import math
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from server.config.tenants import DEFAULT_TENANT, TenantConfig

MAX_RETRY_AFTER_S = 60  # a bucket holds a minute: it is never further away than that


class TokenBucket:
    """`capacity` units, refilled at `rate` per second, drawn below zero by settlements."""

    def __init__(self, capacity: float, rate: float, now: float) -> None:
        self.capacity = capacity
        self.rate = rate
        self.level = capacity
        self._at = now

    def refill(self, now: float) -> None:
        self.level = min(self.capacity, self.level + max(0.0, now - self._at) * self.rate)
        self._at = now

    def has(self, amount: float) -> bool:
        return self.level >= min(amount, self.capacity)

    def seconds_until(self, amount: float) -> float:
        """How long until has(amount), at the refill rate."""
        return max(0.0, (min(amount, self.capacity) - self.level) / self.rate)


@dataclass(frozen=True)
class Refusal:
    tenant: str
    reason: str  # the quota: tokens_per_minute, requests_per_minute or max_concurrent
    retry_after_s: int
    message: str


class _Tenant:
    def __init__(self, config: TenantConfig, now: float) -> None:
        self.config = config
        tpm, rpm = config.tokens_per_minute, config.requests_per_minute
        self.tokens = TokenBucket(tpm, tpm / 60.0, now) if tpm else None
        self.requests = TokenBucket(rpm, rpm / 60.0, now) if rpm else None
        self.in_flight = 0


class TenantUnit:
    """One admitted HTTP request of a tenant, shared by its choices' tickets: each choice settles its
    generated tokens when it ends; the last one ends the request's place in flight."""

    def __init__(self, tenants: Tenants, tenant: str, members: int) -> None:
        self.tenants = tenants
        self.tenant = tenant
        self._left = members
        self._lock = threading.Lock()

    def member_done(self, generated_tokens: int) -> None:
        with self._lock:
            if self._left <= 0:
                return
            self._left -= 1
            last = self._left == 0
        self.tenants.settle(self.tenant, generated_tokens, last)


class Tenants:
    """The configured tenants' keys and quota state; every other name is the default tenant."""

    def __init__(self, configs: Sequence[TenantConfig], clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        now = clock()
        self._tenants = {c.name: _Tenant(c, now) for c in configs}
        self._tenants.setdefault(DEFAULT_TENANT, _Tenant(TenantConfig.model_validate({"name": DEFAULT_TENANT}), now))
        # (key, user or None, tenant): a (key, user) pair is more specific than its key alone
        self._keys = [(key.encode(), user, c.name) for c in configs for key in c.keys for user in (c.users or (None,))]
        self._lock = threading.Lock()

    @property
    def names(self) -> list[str]:
        return list(self._tenants)

    def resolve(self, key: str, user: str | None = None) -> str:
        """The tenant `key` reaches with the request's `user`: the tenant configured with that key and
        user, else the one with the key and no users, else the default tenant. Compares with every tenant
        key in constant time, so the answer's timing says nothing about which keys exist."""
        given = key.encode()
        by_key, by_user = DEFAULT_TENANT, None
        for candidate, candidate_user, name in self._keys:
            if hmac.compare_digest(given, candidate) and key:
                if candidate_user is None:
                    by_key = name
                elif candidate_user == user:
                    by_user = name
        return by_user or by_key

    def admit(self, tenant: str, prompt_tokens: int, members: int) -> TenantUnit | Refusal:
        """Admit one request of `members` choices and `prompt_tokens` prompt tokens in all (charged now),
        or say which quota refuses it."""
        with self._lock:
            t = self._tenants.get(tenant) or self._tenants[DEFAULT_TENANT]
            now = self._clock()
            cfg = t.config
            if cfg.max_concurrent is not None and t.in_flight >= cfg.max_concurrent:
                return Refusal(tenant, "max_concurrent", 1, f"tenant {tenant!r} has {t.in_flight} requests in flight, "
                               f"its max_concurrent quota; retry when one ends")  # fmt: skip
            for bucket, amount, name in ((t.requests, 1, "requests_per_minute"), (t.tokens, prompt_tokens, "tokens_per_minute")):
                if bucket is None:
                    continue
                bucket.refill(now)
                if not bucket.has(amount):
                    wait = max(1, min(MAX_RETRY_AFTER_S, math.ceil(bucket.seconds_until(amount))))
                    return Refusal(tenant, name, wait, f"tenant {tenant!r} is over its {name} quota "
                                   f"({int(bucket.capacity)}); retry after {wait}s")  # fmt: skip
            if t.requests is not None:
                t.requests.level -= 1
            if t.tokens is not None:
                t.tokens.level -= prompt_tokens
            t.in_flight += 1
        return TenantUnit(self, tenant, members)

    def refund(self, unit: TenantUnit, prompt_tokens: int) -> None:
        """Undo admit(): the request was refused after it (its lane was full, the engine gone)."""
        with self._lock:
            t = self._tenants.get(unit.tenant) or self._tenants[DEFAULT_TENANT]
            if t.requests is not None:
                t.requests.level = min(t.requests.capacity, t.requests.level + 1)
            if t.tokens is not None:
                t.tokens.level = min(t.tokens.capacity, t.tokens.level + prompt_tokens)
            t.in_flight -= 1

    def settle(self, tenant: str, generated_tokens: int, last: bool) -> None:
        """A choice ended having generated `generated_tokens`; `last`: its request's last choice."""
        with self._lock:
            t = self._tenants.get(tenant) or self._tenants[DEFAULT_TENANT]
            if t.tokens is not None:
                t.tokens.refill(self._clock())
                t.tokens.level -= generated_tokens
            if last:
                t.in_flight -= 1

    def in_flight(self, tenant: str) -> int:
        with self._lock:
            t = self._tenants.get(tenant)
            return 0 if t is None else t.in_flight
