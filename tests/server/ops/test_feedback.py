"""Feedback: a rating is stored with the version, lane and cost record of the request it rates, survives
a restart, is counted by version, exported per version; bad input is a 4xx naming the field."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest

from server.ops.feedback import AlreadyRated, FeedbackStore, RequestRecord, RequestRecords

from ..fake_versions import VersionedFakeEngine, fake_loader
from ..helpers import make_settings, metric, run_server

ADMIN = {"Authorization": "Bearer adm"}


def record(request_id: str, version: str = "v1") -> RequestRecord:
    return RequestRecord(request_id, "m", version, "interactive", "ok", "length", 4, 8, 0, 0.01, 0.02, 0.1, 1, 0,
                         False, 1.0)  # fmt: skip


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_request_records_are_bounded_in_count_and_age():
    clock = Clock()
    records = RequestRecords(max_records=3, ttl_s=10, clock=clock)
    for i in range(5):
        records.put(record(f"r{i}"))
    assert [records.get(f"r{i}") is not None for i in range(5)] == [False, False, True, True, True]
    clock.now = 10.5
    assert records.get("r4") is None  # older than the window
    records.put(record("r9"))
    assert len(records) == 1  # the expired ones went when a new one came
    records.put(record("r9", version="v2"))
    assert records.get("r9").version == "v2" and len(records) == 1  # a reused id: the newest request


def test_store_keeps_one_rating_per_request_across_reopening(tmp_path):
    path = str(tmp_path / "sub" / "feedback.sqlite3")

    async def scenario() -> None:
        store = FeedbackStore.open(path)
        row = await store.add(record("a"), 1, "good")
        assert row["id"] == 1 and row["version"] == "v1" and row["response_cached"] is False
        await store.add(record("b", version="v2"), -1, None)
        with pytest.raises(AlreadyRated):
            await store.add(record("a"), 5, None)
        store.close()
        store = FeedbackStore.open(path)  # a restart
        assert await store.rated("a") and not await store.rated("c")
        assert [r["request_id"] for r in await store.export(None, None, 10)] == ["b", "a"]
        only = await store.export("m", "v1", 10)
        assert len(only) == 1 and only[0]["rating"] == 1 and only[0]["comment"] == "good"
        assert only[0]["prompt_tokens"] == 4 and only[0]["e2e_s"] == 0.1 and only[0]["kv_blocks_peak"] == 1
        store.close()

    asyncio.run(scenario())


def generate(srv, prompt: str = "abc", **body: Any) -> dict[str, Any]:
    r = httpx.post(f"{srv.url}/generate", json={"prompt": prompt, "stream": False, "max_tokens": 5, **body}, timeout=30)
    assert r.status_code == 200
    return r.json()


def rate(srv, request_id: str, rating: Any = 1, **body: Any) -> httpx.Response:
    return httpx.post(f"{srv.url}/v1/feedback", json={"request_id": request_id, "rating": rating, **body}, timeout=10)


def export(srv, **query: str) -> list[dict[str, Any]]:
    r = httpx.get(f"{srv.url}/admin/feedback", params=query, headers=ADMIN, timeout=10)
    assert r.status_code == 200
    return r.json()["data"]


def test_feedback_is_off_without_a_database():
    with run_server(make_settings(), VersionedFakeEngine()) as srv:
        r = rate(srv, generate(srv)["id"])
        assert r.status_code == 404 and "feedback is off" in r.json()["error"]["message"]


def test_ratings_carry_version_and_cost_and_survive_a_restart(tmp_path):
    salted = tmp_path / "salt-3"
    salted.mkdir()
    settings = make_settings(feedback_db=str(tmp_path / "fb.sqlite3"), admin_api_keys="adm", model_version="v1",
                             response_cache_bytes="1MiB")  # fmt: skip
    with run_server(settings, VersionedFakeEngine(), loader=fake_loader()) as srv:
        done = generate(srv, priority="batch")
        r = rate(srv, done["id"], 5, comment="spot on")
        assert r.status_code == 201, r.text
        row = r.json()
        assert (row["model"], row["version"], row["lane"], row["rating"], row["comment"]) == \
            ("fake-model", "v1", "batch", 5, "spot on")  # fmt: skip
        assert row["prompt_tokens"] == done["usage"]["prompt_tokens"] and row["completion_tokens"] == 5
        for name in ("queue_s", "ttft_s", "e2e_s"):
            assert row[name] == done["timing"][name], name
        assert row["kv_blocks_peak"] >= 1 and row["finish_reason"] == "length" and row["status"] == "ok"
        assert rate(srv, done["id"], 1).status_code == 409
        # A second version, rated through the OpenAI route and from the response cache.
        load = {"version": "v3", "path": str(salted)}
        assert httpx.post(f"{srv.url}/admin/models/fake-model/versions", json=load, headers=ADMIN).status_code == 201
        assert httpx.post(f"{srv.url}/admin/models/fake-model/versions/v3/promote", headers=ADMIN).status_code == 200
        body = {"prompt": "xyz", "max_tokens": 3, "temperature": 0.0}
        first = httpx.post(f"{srv.url}/v1/completions", json=body, timeout=30).json()
        cached = httpx.post(f"{srv.url}/v1/completions", json=body, timeout=30).json()
        assert cached["usage"]["cached"] is True
        assert rate(srv, first["id"], -1).json()["version"] == "v3"
        row = rate(srv, cached["id"], 1).json()
        assert row["version"] == "v3" and row["response_cached"] is True and row["completion_tokens"] == 3
        assert [r["rating"] for r in export(srv, version="v3")] == [1, -1]
        assert [r["version"] for r in export(srv)] == ["v3", "v3", "v1"]
        text = httpx.get(f"{srv.url}/metrics", timeout=10).text
        assert metric(text, "tokenmill_feedback_ratings_total", version="v1", rating="5") == 1
        assert metric(text, "tokenmill_feedback_ratings_total", version="v3") == 2
    with run_server(settings, VersionedFakeEngine(), loader=fake_loader()) as srv:  # a restart
        rows = export(srv)
        assert [(r["version"], r["rating"], r["comment"]) for r in rows] == [("v3", 1, None), ("v3", -1, None),
                                                                             ("v1", 5, "spot on")]  # fmt: skip
        assert rate(srv, done["id"], 2).status_code == 409  # the database remembers, though the record went
        assert rate(srv, "gen-from-before-and-unrated").status_code == 404


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"rating": 0}, "rating"),
        ({"rating": 6}, "rating"),
        ({"rating": -2}, "rating"),
        ({"rating": True}, "rating"),
        ({"rating": "1"}, "rating"),
        ({"rating": 1.0}, "rating"),
        ({"rating": None}, "rating"),
        ({"comment": "x" * 4001}, "comment"),
        ({"comment": 5}, "comment"),
        ({"request_id": ""}, "request_id"),
        ({"request_id": "nope"}, "request_id"),
        ({"stars": 3}, "stars"),
    ],
)
def test_bad_feedback_is_a_4xx_naming_the_field(tmp_path, body, param):
    with run_server(make_settings(feedback_db=str(tmp_path / "fb.sqlite3")), VersionedFakeEngine()) as srv:
        done = generate(srv)
        r = httpx.post(f"{srv.url}/v1/feedback", json={"request_id": done["id"], "rating": 1, **body}, timeout=10)
        assert r.status_code in (400, 404) and r.json()["error"]["param"] == param, r.text
        assert r.status_code == (404 if body.get("request_id") == "nope" else 400)
        assert rate(srv, done["id"]).status_code == 201  # nothing was stored by the bad one
        r = httpx.post(f"{srv.url}/v1/feedback", content=b"{", timeout=10)
        assert r.status_code == 400
