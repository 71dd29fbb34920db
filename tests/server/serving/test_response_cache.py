"""The response cache: a hit replays exactly what the engine produced (tokens, text, log-probabilities,
step by step) with `cached: true`; it is used only for deterministic requests, never across versions,
users or API keys, not with `cache: false`, not after its TTL; it holds its byte bound (LRU)."""

from __future__ import annotations

import json
import logging
from dataclasses import replace
from typing import Any

import httpx
import pytest
from httpx_sse import connect_sse

from engine.api import SamplingParams
from server.serving.response_cache import CachedResponse, CachedStep, CacheKey, ResponseCache

from ..fake_versions import VersionedFakeEngine, fake_loader
from ..helpers import make_settings, metric, run_server, wait_until

PROMPT = "def fibonacci(n):"
GREEDY = {"max_tokens": 8, "temperature": 0.0, "ignore_eos": True}


# -- units ----------------------------------------------------------------------------------------------
class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def entry(tokens: int) -> CachedResponse:
    steps = tuple(CachedStep((7,), "x", None) for _ in range(tokens))
    return CachedResponse(steps, "length", 3, tokens, 0, 256 + tokens * (64 + 8 + 1))


def key(cache: ResponseCache, prompt: list[int], **params: Any) -> CacheKey:
    found = cache.key("m", "v1", "", prompt, SamplingParams(**{"temperature": 0.0, **params}))
    assert found is not None
    return found


def test_only_deterministic_wanted_requests_have_a_key_and_every_field_counts():
    cache = ResponseCache(1 << 20, 60)
    base = SamplingParams(temperature=0.0, max_tokens=8)
    assert cache.key("m", "v1", "", [1, 2], SamplingParams(temperature=0.7)) is None  # sampled, no seed
    assert cache.key("m", "v1", "", [1, 2], SamplingParams(temperature=0.7, seed=3)) is not None
    assert cache.key("m", "v1", "", [1, 2], base, wanted=False) is None  # cache: false
    assert ResponseCache(0, 60).key("m", "v1", "", [1, 2], base) is None  # off
    one = cache.key("m", "v1", "", [1, 2], base)
    variants = [cache.key("m", "v2", "", [1, 2], base), cache.key("m", "v1", "user", [1, 2], base),
                cache.key("n", "v1", "", [1, 2], base), cache.key("m", "v1", "", [1, 3], base)]  # fmt: skip
    for field, value in (("max_tokens", 9), ("top_p", 0.5), ("top_k", 5), ("min_p", 0.1), ("seed", 1),
                         ("repetition_penalty", 1.1), ("presence_penalty", 0.5), ("frequency_penalty", 0.5),
                         ("stop", ("x",)), ("stop_token_ids", (4,)), ("ignore_eos", True), ("min_tokens", 2),
                         ("logprobs", 0)):  # fmt: skip
        variants.append(cache.key("m", "v1", "", [1, 2], replace(base, **{field: value})))
    assert one == cache.key("m", "v1", "", [1, 2], SamplingParams(temperature=0.0, max_tokens=8))
    assert all(v is not None and v != one for v in variants) and len(set(variants)) == len(variants)


def test_lru_keeps_its_byte_bound():
    evicted: list[CacheKey] = []
    cache = ResponseCache(3000, 60, on_evict=evicted.append)
    keys = [key(cache, [i]) for i in range(20)]
    for k in keys[:3]:  # 994 bytes each (entry + prompt): three fit in 3000
        assert cache.put(k, entry(10))
    cache.get(keys[0])  # recently used: the LRU keeps it
    assert cache.put(keys[3], entry(10)) and evicted == [keys[1]]
    assert cache.get(keys[0]) is not None and cache.get(keys[1]) is None
    for k in keys[4:12]:
        assert cache.put(k, entry(10))
        assert cache.bytes <= cache.max_bytes and len(cache) == 3
    assert evicted[:3] == [keys[1], keys[2], keys[3]] and len(evicted) == 9
    assert cache.bytes == sum(e.size for e, _ in cache._entries.values()) == 3 * 994
    assert not cache.put(keys[19], entry(100))  # larger than the whole cache: not stored, nothing evicted
    assert len(evicted) == 9 and cache.get(keys[19]) is None
    assert cache.drop("m", "v2") == 0 and cache.drop("m", "v1") == 3 and cache.bytes == 0 and len(cache) == 0


def test_entries_expire_after_their_ttl():
    clock = Clock()
    cache = ResponseCache(1 << 20, ttl_s=30, clock=clock)
    k = key(cache, [1])
    cache.put(k, entry(2))
    clock.now = 29.9
    assert cache.get(k) is not None
    clock.now = 30.0
    assert cache.get(k) is None and cache.bytes == 0


# -- a real server --------------------------------------------------------------------------------------
def sse(url: str, body: dict[str, Any], headers: dict[str, str] | None = None) -> list[tuple[str, dict]]:
    with httpx.Client(timeout=60, headers=headers) as client, connect_sse(client, "POST", url, json=body) as src:
        assert src.response.status_code == 200
        return [(e.event, json.loads(e.data) if e.data != "[DONE]" else {}) for e in src.iter_sse()]


@pytest.fixture
def srv(real_engine):
    with run_server(make_settings(response_cache_bytes="1MiB", response_cache_ttl_s=60), real_engine) as s:
        yield s


def generated(srv) -> int:
    return srv.runtime.worker.stats.generation_tokens


def test_a_hit_replays_the_generation_exactly(srv):
    body = {"prompt": PROMPT, "stream": False, "logprobs": 2, **GREEDY}
    first = httpx.post(f"{srv.url}/generate", json=body, timeout=60).json()
    tokens_before = generated(srv)
    again = httpx.post(f"{srv.url}/generate", json=body, timeout=60).json()
    assert generated(srv) == tokens_before  # the engine did not run
    assert again["usage"].pop("cached") is True and "cached" not in first["usage"]
    for field in ("text", "token_ids", "logprobs", "finish_reason", "usage", "model_version"):
        assert again[field] == first[field], field
    assert again["id"] != first["id"] and again["timing"]["e2e_s"] < first["timing"]["e2e_s"]
    # Streamed, a hit sends the same events as the generation did: one per token, then done.
    streamed = sse(f"{srv.url}/generate", {**body, "stream": True, "prompt": PROMPT + " "})
    replayed = sse(f"{srv.url}/generate", {**body, "stream": True, "prompt": PROMPT + " "})
    assert [e for e in replayed if e[0] == "token"] == [
        (k, {**d, "id": replayed[0][1]["id"]}) for k, d in streamed if k == "token"
    ]  # fmt: skip
    assert replayed[-1][1]["usage"]["cached"] is True and "cached" not in streamed[-1][1]["usage"]
    # The OpenAI routes share the cache; chat and completions keep their own shapes.
    chat = {"model": "tiny-llama", "messages": [{"role": "user", "content": "Hi!"}], **GREEDY}
    a = httpx.post(f"{srv.url}/v1/chat/completions", json=chat, timeout=60).json()
    b = httpx.post(f"{srv.url}/v1/chat/completions", json=chat, timeout=60).json()
    assert b["choices"] == a["choices"] and b["usage"]["cached"] is True and "cached" not in a["usage"]
    assert b["system_fingerprint"] == a["system_fingerprint"] == srv.runtime.primary.version
    chunks = sse(f"{srv.url}/v1/chat/completions", {**chat, "stream": True, "stream_options": {"include_usage": True}})
    text = "".join(c["choices"][0]["delta"].get("content", "") for _, c in chunks if c.get("choices"))
    assert text == a["choices"][0]["message"]["content"] and chunks[-2][1]["usage"]["cached"] is True
    text = httpx.get(f"{srv.url}/metrics", timeout=10).text
    assert metric(text, "tokenmill_response_cache_hits_total") == 4
    assert metric(text, "tokenmill_response_cache_misses_total") == 3
    assert metric(text, "tokenmill_requests_total", status="ok") == 7  # hits are requests served too
    assert metric(text, "tokenmill_response_cache_entries") == 3
    assert 0 < metric(text, "tokenmill_response_cache_bytes") == srv.runtime.cache.bytes


def test_requests_that_must_not_share_an_answer_miss(srv, monkeypatch):
    def run(**body: Any) -> dict[str, Any]:
        r = httpx.post(f"{srv.url}/generate", json={"prompt": PROMPT, "stream": False, **GREEDY, **body}, timeout=60)
        assert r.status_code == 200
        return r.json()

    def hit(**body: Any) -> bool:
        return run(**body)["usage"].get("cached", False)

    assert not hit(cache=False) and not hit(cache=False)  # neither read nor written
    assert not hit(temperature=0.8) and not hit(temperature=0.8)  # sampled without a seed: never stored
    assert not hit(temperature=0.8, seed=5) and hit(temperature=0.8, seed=5)  # a fixed seed is deterministic
    assert not hit(temperature=0.8, seed=6)
    assert not hit(user="alice") and not hit(user="bob") and hit(user="alice") and not hit()
    assert not hit(max_tokens=7) and hit(max_tokens=7) and not hit(max_tokens=7, cache=False)
    clock = srv.runtime.cache.clock
    monkeypatch.setattr(srv.runtime.cache, "clock", lambda: clock() + 61)  # past the TTL
    assert not hit(max_tokens=7) and hit(max_tokens=7)


def test_entries_are_private_to_their_api_key(real_engine):
    settings = make_settings(api_keys="k1,k2", response_cache_bytes="1MiB")
    with run_server(settings, real_engine) as srv:
        def cached(key: str, **extra: Any) -> bool:
            r = httpx.post(f"{srv.url}/generate", json={"prompt": PROMPT, "stream": False, **GREEDY},
                           headers={"Authorization": f"Bearer {key}"}, timeout=60)  # fmt: skip
            return r.json()["usage"].get("cached", False)

        assert not cached("k1") and not cached("k2") and cached("k1") and cached("k2")
    shared = make_settings(api_keys="k1,k2", response_cache_bytes="1MiB", response_cache_scope="global")
    with run_server(shared, real_engine) as srv:
        assert not cached("k1") and cached("k2")


def test_a_version_change_empties_the_cache_and_the_byte_bound_holds(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="tokenmill.requests")
    settings = make_settings(admin_api_keys="adm", response_cache_bytes=4000, model_version="v0")
    salted = tmp_path / "salt-3"  # the fake loader's engine for this path answers differently
    salted.mkdir()
    admin = {"Authorization": "Bearer adm"}
    with run_server(settings, VersionedFakeEngine(0), loader=fake_loader()) as srv:
        def run(prompt: str = "abc") -> dict[str, Any]:
            r = httpx.post(f"{srv.url}/generate", json={"prompt": prompt, "stream": False, "max_tokens": 4, "temperature": 0.0},
                           timeout=30)  # fmt: skip
            return {**r.json(), "version": r.headers["x-model-version"]}

        first = run()
        assert run()["usage"]["cached"] is True
        r = httpx.post(f"{srv.url}/admin/models/fake-model/versions", json={"version": "v3", "path": str(salted), "wait": True},
                       headers=admin, timeout=30)  # fmt: skip
        assert r.status_code == 201
        assert run()["usage"]["cached"] is True  # loading a candidate changes nothing
        assert httpx.post(f"{srv.url}/admin/models/fake-model/versions/v3/promote", headers=admin).status_code == 200
        assert len(srv.runtime.cache) == 0
        after = run()
        assert after["version"] == "v3" and "cached" not in after["usage"]
        assert after["token_ids"] != first["token_ids"]
        lines = [json.loads(rec.getMessage()) for rec in caplog.records if rec.name == "tokenmill.requests"]
        assert [(line["model"], line["version"], line["response_cached"]) for line in lines] == [
            ("fake-model", "v0", False), ("fake-model", "v0", True), ("fake-model", "v0", True),
            ("fake-model", "v3", False)]  # fmt: skip
        for i in range(40):  # distinct prompts: the LRU evicts to stay within 4000 bytes
            run(f"prompt {i}")
            assert srv.runtime.cache.bytes <= 4000
        text = httpx.get(f"{srv.url}/metrics", timeout=10).text
        assert metric(text, "tokenmill_response_cache_evictions_total", version="v3") > 0
        assert 0 < metric(text, "tokenmill_response_cache_bytes") <= 4000
        wait_until(lambda: "v0" not in srv.runtime.models.slot("fake-model").versions, what="v0 unloaded")
