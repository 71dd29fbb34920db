"""Tenant quotas and key resolution (server/serving/tenants.py) and their configuration
(server/config/tenants.py), without a server."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from server.cli import settings_error
from server.config.tenants import DEFAULT_TENANT, TenantConfig
from server.serving.tenants import Refusal, Tenants, TenantUnit

from ..helpers import make_settings


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def tenant(name: str, *keys: str, **quotas) -> TenantConfig:
    return TenantConfig.model_validate({"name": name, "keys": list(keys), **quotas})


def test_keys_resolve_to_their_tenant_and_anything_else_to_the_default():
    t = Tenants([tenant("acme", "k-acme-1", "k-acme-2"), tenant("beta", "k-beta")])
    assert t.resolve("k-acme-2") == "acme"
    assert t.resolve("k-beta") == "beta"
    assert t.resolve("k-acme") == DEFAULT_TENANT  # a prefix is not the key
    assert t.resolve("") == DEFAULT_TENANT
    assert set(t.names) == {"acme", "beta", DEFAULT_TENANT}


def test_a_key_and_a_user_reach_the_tenant_configured_with_both():
    app_key = "k-app"
    t = Tenants([tenant("app", app_key), TenantConfig.model_validate({"name": "alice", "keys": [app_key], "users": ["alice"]}),
                 TenantConfig.model_validate({"name": "bob", "keys": [app_key, "k-bob"], "users": ["bob", "robert"]})])
    assert t.resolve(app_key, "alice") == "alice"
    assert t.resolve(app_key, "robert") == "bob" and t.resolve("k-bob", "bob") == "bob"
    assert t.resolve(app_key, "carol") == "app"  # another user of the key: the key's own tenant
    assert t.resolve(app_key) == "app"
    assert t.resolve("k-bob", "carol") == DEFAULT_TENANT  # k-bob reaches bob only with bob's users
    assert t.resolve("k-other", "alice") == DEFAULT_TENANT  # a user alone reaches nothing
    settings = make_settings(tenants=[{"name": "app", "keys": [app_key]},
                                      {"name": "alice", "keys": [app_key], "users": ["alice"]}])  # fmt: skip
    assert [x.name for x in settings.tenants] == ["app", "alice"]  # a key with and without users: allowed


def test_requests_per_minute_refuses_with_a_retry_after_from_the_refill_rate():
    clock = Clock()
    t = Tenants([tenant("a", "ka", requests_per_minute=2)], clock)
    assert isinstance(t.admit("a", 10, 1), TenantUnit)
    assert isinstance(t.admit("a", 10, 1), TenantUnit)
    refused = t.admit("a", 10, 1)
    assert isinstance(refused, Refusal)
    assert refused.reason == "requests_per_minute" and refused.retry_after_s == 30  # one request per 30 s
    assert "'a'" in refused.message and "requests_per_minute" in refused.message
    clock.now += 30
    assert isinstance(t.admit("a", 10, 1), TenantUnit)  # refilled at its rate


def test_tokens_per_minute_charges_prompts_at_admission_and_output_at_the_end():
    clock = Clock()
    t = Tenants([tenant("a", "ka", tokens_per_minute=600)], clock)  # 10 tokens a second
    unit = t.admit("a", 500, 1)
    assert isinstance(unit, TenantUnit)
    unit.member_done(300)  # 800 charged: the bucket is 200 below zero, the admitted request was not stopped
    refused = t.admit("a", 50, 1)
    assert isinstance(refused, Refusal) and refused.reason == "tokens_per_minute"
    assert refused.retry_after_s == 25  # (50 - (-200)) / 10
    clock.now += 25
    assert isinstance(t.admit("a", 50, 1), TenantUnit)


def test_a_prompt_larger_than_the_bucket_needs_a_full_bucket_not_the_impossible():
    clock = Clock()
    t = Tenants([tenant("a", "ka", tokens_per_minute=60)], clock)
    assert isinstance(t.admit("a", 1000, 1), TenantUnit)  # full bucket: admitted, deep below zero
    assert t.admit("a", 1000, 1).retry_after_s == 60  # capped at the bucket's minute


def test_max_concurrent_counts_requests_until_their_last_choice_ends():
    t = Tenants([tenant("a", "ka", max_concurrent=1)])
    unit = t.admit("a", 5, 2)  # one request, two choices
    assert isinstance(unit, TenantUnit)
    refused = t.admit("a", 5, 1)
    assert isinstance(refused, Refusal) and refused.reason == "max_concurrent"
    unit.member_done(3)
    assert isinstance(t.admit("a", 5, 1), Refusal)  # one choice still running
    unit.member_done(3)
    unit.member_done(3)  # a stray extra settle changes nothing
    assert t.in_flight("a") == 0
    assert isinstance(t.admit("a", 5, 1), TenantUnit)


def test_refund_undoes_an_admission_refused_downstream():
    t = Tenants([tenant("a", "ka", requests_per_minute=1, max_concurrent=1, tokens_per_minute=100)])
    unit = t.admit("a", 100, 1)
    assert isinstance(unit, TenantUnit)
    t.refund(unit, 100)  # its lane was full
    assert t.in_flight("a") == 0
    assert isinstance(t.admit("a", 100, 1), TenantUnit)


def test_the_default_tenant_has_no_quota_unless_configured():
    t = Tenants([tenant("a", "ka")])
    for _ in range(100):
        assert isinstance(t.admit(DEFAULT_TENANT, 10_000, 1), TenantUnit)
    limited = Tenants([TenantConfig.model_validate({"name": "default", "requests_per_minute": 1})])
    assert isinstance(limited.admit(DEFAULT_TENANT, 1, 1), TenantUnit)
    assert isinstance(limited.admit(DEFAULT_TENANT, 1, 1), Refusal)


SECRET = "sk-very-secret-tenant-key"


@pytest.mark.parametrize(
    ("tenants", "message"),
    [
        ([{"name": "a", "keys": [SECRET]}, {"name": "a", "keys": ["k2"]}], "configured twice"),
        ([{"name": "a", "keys": [SECRET]}, {"name": "b", "keys": [SECRET]}], "share a key"),
        ([{"name": "default", "keys": [SECRET]}], "has no keys"),
        ([{"name": "a"}], "'a' has no keys"),
        ([{"name": "a b", "keys": [SECRET]}], "tenant name"),
        ([{"name": "a", "keys": [SECRET + " x"]}], "whitespace"),
        ([{"name": "a", "keys": [SECRET], "weight": 0}], "greater than 0"),
        ([{"name": "a", "keys": [SECRET], "tokens_per_minute": 0}], "greater than or equal to 1"),
        ([{"name": "a", "keys": [SECRET], "users": ["u"]}, {"name": "b", "keys": [SECRET], "users": ["u", "v"]}],
         "share a key and user 'u'"),
        ([{"name": "a", "keys": [SECRET], "users": [""]}], "tenant users must be 1-256 characters"),
        ([{"name": "default", "users": ["u"]}], "has no keys"),
    ],
)
def test_bad_tenant_settings_name_the_problem_and_never_the_key(tenants, message):
    with pytest.raises(ValidationError) as info:
        make_settings(tenants=tenants)
    text = settings_error(info.value)
    assert message in text
    assert SECRET not in text


def test_a_tenant_key_that_is_also_an_admin_key_is_refused():
    with pytest.raises(ValidationError) as info:
        make_settings(tenants=[{"name": "a", "keys": [SECRET]}], admin_api_keys=[SECRET])
    assert "also an admin key" in settings_error(info.value) and SECRET not in settings_error(info.value)


def test_tenant_keys_open_the_api_only_beside_api_keys():
    open_server = make_settings(tenants=[{"name": "a", "keys": ["ka"]}])
    assert open_server.accepted_api_keys() == ()  # no api_key: requests without a key are the default tenant's
    assert open_server.keyed()
    closed = make_settings(api_key="main", tenants=[{"name": "a", "keys": ["ka"]}])
    assert set(closed.accepted_api_keys()) == {"main", "ka"}
    assert closed.engine_config("x").tenant_weights == (("a", 1.0),)


def test_tenants_from_a_flag_as_json():
    from server.config.flags import parse_settings

    s = parse_settings(["--tenants", '[{"name": "a", "keys": ["ka"], "weight": 3}]'])
    assert s.tenants[0].name == "a" and s.tenants[0].weight == 3.0
    with pytest.raises(ValidationError) as info:
        parse_settings(["--tenants", "a=ka"])
    assert "JSON list" in settings_error(info.value)
