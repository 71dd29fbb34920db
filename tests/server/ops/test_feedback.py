"""Feedback: a rating is stored with the version, lane and cost record of the request it rates, survives
a restart, is counted by version, exported per version; bad input is a 4xx naming the field. Only the
API key and `user` that made a request can rate it; each choice of a response is rated on its own."""

from __future__ import annotations

import asyncio
import sqlite3
from typing import Any

import httpx
import pytest

from server.ops.feedback import AlreadyRated, FeedbackStore, RecordKey, RequestRecord, RequestRecords

from ..fake_versions import VersionedFakeEngine, fake_loader
from ..helpers import make_settings, metric, run_server

ADMIN = {"Authorization": "Bearer adm"}


def record(request_id: str, version: str = "v1", owner: str = "", choice: int = 0) -> RequestRecord:
    return RequestRecord(request_id, "m", version, "interactive", "ok", "length", 4, 8, 0, 0.01, 0.02, 0.1, 1, 0,
                         False, 1.0, owner=owner, choice=choice)  # fmt: skip


def key(request_id: str, owner: str = "", choice: int = 0) -> RecordKey:
    return RecordKey(owner, request_id, choice)


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
    assert [records.get(key(f"r{i}")) is not None for i in range(5)] == [False, False, True, True, True]
    clock.now = 10.5
    assert records.get(key("r4")) is None  # older than the window
    records.put(record("r9"))
    assert len(records) == 1  # the expired ones went when a new one came
    records.put(record("r9", version="v2"))
    assert records.get(key("r9")).version == "v2" and len(records) == 1  # a reused id: the newest request


def test_records_are_found_only_by_their_owner_and_choice():
    records = RequestRecords(max_records=10, ttl_s=10, clock=Clock())
    records.put(record("r", owner="a"))
    records.put(record("r", owner="b", version="v2"))  # b reusing a's id replaces nothing of a's
    records.put(record("r", owner="a", choice=1, version="v3"))
    assert records.get(key("r", "a")).version == "v1" and records.get(key("r", "b")).version == "v2"
    assert records.get(key("r", "a", 1)).version == "v3" and records.get(key("r", "b", 1)) is None
    assert records.get(key("r")) is None and records.get(key("r", "c")) is None


def test_store_keeps_one_rating_per_request_across_reopening(tmp_path):
    path = str(tmp_path / "sub" / "feedback.sqlite3")

    async def scenario() -> None:
        store = FeedbackStore.open(path)
        row = await store.add(record("a"), 1, "good")
        assert row["id"] == 1 and row["version"] == "v1" and row["response_cached"] is False
        await store.add(record("b", version="v2"), -1, None)
        with pytest.raises(AlreadyRated):
            await store.add(record("a"), 5, None)
        await store.add(record("a", owner="o2"), 2, None)  # another owner's request of the same id
        await store.add(record("a", choice=1), 3, None)  # another choice of the same response
        store.close()
        store = FeedbackStore.open(path)  # a restart
        assert await store.rated(key("a")) and not await store.rated(key("c"))
        assert await store.rated(key("a", "o2")) and not await store.rated(key("a", "o3"))
        assert await store.rated(key("a", choice=1)) and not await store.rated(key("a", choice=2))
        rows = await store.export(None, None, 10)
        assert [(r["request_id"], r["owner"], r["choice"]) for r in rows[:2]] == [("a", "", 1), ("a", "o2", 0)]
        assert [r["request_id"] for r in await store.export(None, None, 10)] == ["a", "a", "b", "a"]
        only = [r for r in await store.export("m", "v1", 10) if r["owner"] == "" and r["choice"] == 0]
        assert len(only) == 1 and only[0]["rating"] == 1 and only[0]["comment"] == "good"
        assert only[0]["prompt_tokens"] == 4 and only[0]["e2e_s"] == 0.1 and only[0]["kv_blocks_peak"] == 1
        store.close()

    asyncio.run(scenario())


# The table as version 0 (before owners and choices) created it.
_V0_TABLE = """
CREATE TABLE feedback (
    id INTEGER PRIMARY KEY AUTOINCREMENT, rating INTEGER NOT NULL, comment TEXT, rated_at REAL NOT NULL,
    request_id TEXT NOT NULL UNIQUE, model TEXT NOT NULL, version TEXT NOT NULL, lane TEXT NOT NULL,
    status TEXT NOT NULL, finish_reason TEXT, prompt_tokens INTEGER NOT NULL, completion_tokens INTEGER NOT NULL,
    cached_tokens INTEGER NOT NULL, queue_s REAL, ttft_s REAL, e2e_s REAL, kv_blocks_peak INTEGER NOT NULL,
    preemptions INTEGER NOT NULL, response_cached INTEGER NOT NULL, ended_at REAL NOT NULL
);
CREATE INDEX feedback_by_version ON feedback (model, version);
INSERT INTO feedback VALUES (7, 4, 'old', 1.0, 'gen-old', 'm', 'v0', 'batch', 'ok', 'stop', 3, 2, 0, 0.1, 0.2,
                             0.3, 1, 0, 0, 1.0);
"""


def test_a_version_0_database_is_migrated_in_place(tmp_path):
    path = str(tmp_path / "fb.sqlite3")
    conn = sqlite3.connect(path)
    conn.executescript(_V0_TABLE)
    conn.close()

    async def scenario() -> None:
        store = FeedbackStore.open(path)
        assert await store.rated(key("gen-old"))  # the old rating still answers 409 to its id
        await store.add(record("gen-old", owner="o"), 5, None)  # UNIQUE(request_id) is gone: owners are apart
        await store.add(record("gen-old", choice=1), 1, None)
        rows = await store.export(None, None, 10)
        assert [(r["id"], r["request_id"], r["owner"], r["choice"], r["rating"]) for r in rows] == [
            (9, "gen-old", "", 1, 1), (8, "gen-old", "o", 0, 5), (7, "gen-old", "", 0, 4)]  # fmt: skip
        assert rows[2]["comment"] == "old" and rows[2]["version"] == "v0" and rows[2]["response_cached"] is False
        assert [r["id"] for r in await store.export("m", "v0", 10)] == [7]  # the version index is back
        store.close()
        store = FeedbackStore.open(path)  # opening a migrated database again changes nothing
        assert len(await store.export(None, None, 10)) == 3
        store.close()

    asyncio.run(scenario())
    conn = sqlite3.connect(path)
    assert conn.execute("PRAGMA user_version").fetchone()[0] == 3
    indexes = {row[1] for row in conn.execute("PRAGMA index_list(feedback)")}
    assert "feedback_by_version" in indexes and not conn.execute(
        "SELECT name FROM sqlite_master WHERE name = 'feedback_v0'").fetchall()  # fmt: skip
    conn.close()


# The table as version 1 (owners and choices, before LoRA adapters) created it.
_V1_TABLE = """
CREATE TABLE feedback (
    id INTEGER PRIMARY KEY AUTOINCREMENT, rating INTEGER NOT NULL, comment TEXT, rated_at REAL NOT NULL,
    request_id TEXT NOT NULL, model TEXT NOT NULL, version TEXT NOT NULL, lane TEXT NOT NULL,
    status TEXT NOT NULL, finish_reason TEXT, prompt_tokens INTEGER NOT NULL, completion_tokens INTEGER NOT NULL,
    cached_tokens INTEGER NOT NULL, queue_s REAL, ttft_s REAL, e2e_s REAL, kv_blocks_peak INTEGER NOT NULL,
    preemptions INTEGER NOT NULL, response_cached INTEGER NOT NULL, ended_at REAL NOT NULL,
    owner TEXT NOT NULL DEFAULT '', choice INTEGER NOT NULL DEFAULT 0, UNIQUE (owner, request_id, choice)
);
CREATE INDEX feedback_by_version ON feedback (model, version);
INSERT INTO feedback VALUES (3, 5, NULL, 1.0, 'gen-v1', 'm', 'v1', 'batch', 'ok', 'stop', 3, 2, 0, 0.1, 0.2,
                             0.3, 1, 0, 0, 1.0, 'o', 1);
PRAGMA user_version = 1;
"""


def test_a_version_1_database_gets_the_lora_column(tmp_path):
    path = str(tmp_path / "fb.sqlite3")
    conn = sqlite3.connect(path)
    conn.executescript(_V1_TABLE)
    conn.close()

    async def scenario() -> None:
        store = FeedbackStore.open(path)
        assert await store.rated(key("gen-v1", "o", 1))  # the old row and its unique key are kept
        lora = RequestRecord("gen-a", "m", "v1", "interactive", "ok", "length", 4, 8, 0, 0.01, 0.02, 0.1, 1, 0,
                             False, 1.0, lora="sql")  # fmt: skip
        await store.add(lora, 1, None)
        rows = await store.export(None, None, 10)
        assert [(r["id"], r["request_id"], r["lora"]) for r in rows] == [(4, "gen-a", "sql"), (3, "gen-v1", None)]
        assert [r["request_id"] for r in await store.export(None, None, 10, lora="sql")] == ["gen-a"]
        store.close()

    asyncio.run(scenario())
    conn = sqlite3.connect(path)
    assert conn.execute("PRAGMA user_version").fetchone()[0] == 3
    conn.close()


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


def _post(srv, path: str, body: dict[str, Any], api_key: str) -> httpx.Response:
    return httpx.post(f"{srv.url}{path}", json=body, headers={"Authorization": f"Bearer {api_key}"}, timeout=30)


def test_only_the_key_and_user_that_made_a_request_can_rate_it(tmp_path):
    """Key B cannot rate key A's request: the same 404 as an id never seen, with no record in the body;
    nor can A under another `user`. A's own rating then succeeds."""
    settings = make_settings(feedback_db=str(tmp_path / "fb.sqlite3"), api_keys="ka,kb")
    with run_server(settings, VersionedFakeEngine()) as srv:
        done = _post(srv, "/generate", {"prompt": "abc", "stream": False, "max_tokens": 3}, "ka").json()
        chat = _post(srv, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
                                                   "user": "alice"}, "ka").json()  # fmt: skip
        unknown = _post(srv, "/v1/feedback", {"request_id": "gen-never-seen", "rating": 1}, "kb").json()
        for rid, user in ((done["id"], None), (chat["id"], "alice")):
            for api_key, as_user in (("kb", user), ("ka", "mallory" if user else "alice"), ("kb", "alice")):
                r = _post(srv, "/v1/feedback", {"request_id": rid, "rating": 1, "user": as_user}, api_key)
                assert r.status_code == 404 and r.json()["error"]["param"] == "request_id", r.text
                text = r.text
                assert "fake-model" not in text and "prompt_tokens" not in text and "lane" not in text
                assert r.json()["error"]["message"] == unknown["error"]["message"].replace("gen-never-seen", rid)
        r = _post(srv, "/v1/feedback", {"request_id": done["id"], "rating": 5}, "ka")
        assert r.status_code == 201 and r.json()["prompt_tokens"] == done["usage"]["prompt_tokens"], r.text
        r = _post(srv, "/v1/feedback", {"request_id": chat["id"], "rating": -1, "user": "alice"}, "ka")
        assert r.status_code == 201 and r.json()["request_id"] == chat["id"], r.text
        # B probing an id A rated learns nothing either (404, not 409); A's second rating is the 409.
        assert _post(srv, "/v1/feedback", {"request_id": done["id"], "rating": 1}, "kb").status_code == 404
        assert _post(srv, "/v1/feedback", {"request_id": done["id"], "rating": 1}, "ka").status_code == 409
        # B's /generate reusing A's client-chosen id does not displace A's record.
        body = {"prompt": "xyz", "stream": False, "max_tokens": 2, "request_id": "mine-1"}
        assert _post(srv, "/generate", body, "ka").status_code == 200
        assert _post(srv, "/generate", body, "kb").status_code == 200
        assert _post(srv, "/v1/feedback", {"request_id": "mine-1", "rating": 2}, "ka").status_code == 201
        assert _post(srv, "/v1/feedback", {"request_id": "mine-1", "rating": 3}, "kb").status_code == 201


def test_each_choice_of_n_and_of_a_prompt_list_is_rated_by_its_index(tmp_path):
    settings = make_settings(feedback_db=str(tmp_path / "fb.sqlite3"), admin_api_keys="adm")
    with run_server(settings, VersionedFakeEngine()) as srv:
        two = httpx.post(f"{srv.url}/v1/completions", json={"prompt": "abc", "n": 2, "max_tokens": 3,
                                                            "temperature": 1.0, "seed": 1}, timeout=30).json()  # fmt: skip
        listed = httpx.post(f"{srv.url}/v1/completions", json={"prompt": ["a", "bcdef", "gh"], "max_tokens": 2},
                            timeout=30).json()  # fmt: skip
        chat = httpx.post(f"{srv.url}/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                                  "n": 2, "max_tokens": 2}, timeout=30).json()  # fmt: skip
        for done, count in ((two, 2), (listed, 3), (chat, 2)):
            assert [c["index"] for c in done["choices"]] == list(range(count))
            for choice in range(count):
                r = rate(srv, done["id"], 1 + choice, choice=choice)
                assert r.status_code == 201, r.text
                assert (r.json()["request_id"], r.json()["choice"], r.json()["rating"]) == (done["id"], choice,
                                                                                           1 + choice)  # fmt: skip
            r = rate(srv, done["id"], 1, choice=count)
            assert r.status_code == 404 and r.json()["error"]["param"] == "choice", r.text
            assert rate(srv, done["id"], 1, choice=1).status_code == 409  # per choice
        prompts = [rate(srv, listed["id"], 1, choice=i) for i in range(3)]
        assert all(p.status_code == 409 for p in prompts)
        rows = [r for r in export(srv) if r["request_id"] == listed["id"]]
        # the prompt list's choices are its prompts: their own prompt lengths
        assert sorted((r["choice"], r["prompt_tokens"]) for r in rows) == [(0, 1), (1, 5), (2, 2)]
        r = rate(srv, two["id"], 1, choice=-1)
        assert r.status_code == 400 and r.json()["error"]["param"] == "choice"
        r = rate(srv, two["id"], 1, choice="1")
        assert r.status_code == 400 and r.json()["error"]["param"] == "choice"
