"""Tenants as configured (YAML `tenants:`): who a request is billed to, reached through its API keys.

A tenant has a name (the only thing that ever appears in logs, metrics and errors: never its keys), its
keys (and optionally `users`: then only a request with one of those keys AND one of those `user` values
reaches it, so one application key can carry several tenants, one per end user it names), a weight (its fair share of its lane, engine/sched/fair_share.py) and optional quotas (tokens and
requests per minute, requests in flight: server/serving/tenants.py). A request whose key is no tenant's
(or that has none) belongs to the default tenant, `default`; a `tenants:` entry named `default` (with no
keys) sets that one's weight and quotas.
"""

from __future__ import annotations

import re

from pydantic import BaseModel, ConfigDict, Field, field_validator

DEFAULT_TENANT = "default"
MAX_USER_CHARS = 256  # a request's `user` (and metadata.user_id) is at most this long
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")  # a metrics label value and a log field, as is


class TenantConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(description="the tenant's name in metrics, logs and errors (letters, digits, _ . -)")
    keys: tuple[str, ...] = Field((), description="API keys that reach it (Authorization: Bearer or x-api-key)")
    users: tuple[str, ...] = Field((), description="with keys: the request `user` values (OpenAI `user`, Anthropic "
                                   "metadata.user_id) that, sent with one of its keys, reach it")
    weight: float = Field(1.0, gt=0, description="its share of a lane against the other backlogged tenants")
    tokens_per_minute: int | None = Field(None, ge=1, description="prompt + generated tokens per minute")
    requests_per_minute: int | None = Field(None, ge=1, description="requests per minute")
    max_concurrent: int | None = Field(None, ge=1, description="its requests in flight at once")

    @field_validator("name")
    @classmethod
    def _check_name(cls, value: str) -> str:
        if not _NAME.fullmatch(value):
            raise ValueError("a tenant name is 1-64 letters, digits, '_', '.' or '-', starting with a letter or digit")
        return value

    @field_validator("keys", mode="before")
    @classmethod
    def _split_keys(cls, value: object) -> object:
        if isinstance(value, str):  # "k1,k2": a comma-separated string is a list
            return [k.strip() for k in value.split(",") if k.strip()] or [value]
        return value

    @field_validator("keys")
    @classmethod
    def _check_keys(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        # the messages never quote a key: a settings error is printed and may be logged
        for key in value:
            if not key.strip():
                raise ValueError("tenant keys must not be empty")
            if any(c.isspace() for c in key):
                raise ValueError("tenant keys must not contain whitespace")
        return value

    @field_validator("users")
    @classmethod
    def _check_users(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        for user in value:
            if not user or len(user) > MAX_USER_CHARS:
                raise ValueError(f"tenant users must be 1-{MAX_USER_CHARS} characters")
        return value


def check_tenants(tenants: list[TenantConfig], other_keys: tuple[str, ...]) -> None:
    """Names unique; a key is one tenant's (or, with `users`, a (key, user) pair is one tenant's; the same
    key may also be a tenant's without users: the one its other users reach); keys apart from `other_keys`
    (the admin keys); the default tenant without keys. Raises ValueError naming the tenant, never a key."""
    names: set[str] = set()
    owner: dict[tuple[str, str | None], str] = {}
    for t in tenants:
        if t.name in names:
            raise ValueError(f"tenants: {t.name!r} is configured twice")
        names.add(t.name)
        if t.name == DEFAULT_TENANT and (t.keys or t.users):
            raise ValueError(f"tenants: {DEFAULT_TENANT!r} is the tenant of requests without a tenant key: it has no keys")
        if not t.keys and t.name != DEFAULT_TENANT:
            raise ValueError(f"tenants: {t.name!r} has no keys")
        for key in t.keys:
            if key in other_keys:
                raise ValueError(f"tenants: a key of {t.name!r} is also an admin key")
            pairs: list[tuple[str, str | None]] = [(key, u) for u in t.users] or [(key, None)]
            for pair in pairs:
                if pair in owner:
                    what = "a key" if pair[1] is None else f"a key and user {pair[1]!r}"
                    raise ValueError(f"tenants: {t.name!r} and {owner[pair]!r} share {what}")
                owner[pair] = t.name
