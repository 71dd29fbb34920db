"""The admin API: off without admin keys, its keys separate from the API's, every bad request a 4xx
naming what is wrong, loads in the background, one at a time, resolved in models_dir."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import httpx
import pytest
from fastapi import FastAPI

from server.http.auth import AdminKeyMiddleware, ApiKeyMiddleware

from ..fake_versions import VersionedFakeEngine, fake_loader, salted_token
from ..helpers import make_settings, run_server, wait_until

ADMIN = {"Authorization": "Bearer adm"}


def versions_url(srv, suffix: str = "") -> str:
    return f"{srv.url}/admin/models/fake-model/versions{suffix}"


@pytest.mark.parametrize("header", ["Bearer", "Bearer ", "bearer   ", "Bearer\t"])
def test_a_bearer_without_a_token_is_401_everywhere(header):
    """`Authorization: Bearer` with no token opens nothing, even behind a key list holding an empty key
    (settings refuse one at start-up; the middlewares do not rely on it)."""
    app = FastAPI()
    app.get("/admin/models")(lambda: {"admin": True})
    app.get("/v1/models")(lambda: {"api": True})
    guarded = AdminKeyMiddleware(ApiKeyMiddleware(app, keys=("",)), keys=("",))

    async def statuses() -> list[int]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=guarded), base_url="http://t") as c:
            return [(await c.get(path, headers={"Authorization": header})).status_code
                    for path in ("/admin/models", "/v1/models")]  # fmt: skip

    assert asyncio.run(statuses()) == [401, 401]


def test_admin_api_is_off_without_admin_keys():
    with run_server(make_settings(api_key="user"), VersionedFakeEngine(), loader=fake_loader()) as srv:
        for method, path in (("GET", "/admin/models"), ("POST", "/admin/models/fake-model/versions"),
                             ("GET", "/admin/feedback")):  # fmt: skip
            r = httpx.request(method, f"{srv.url}{path}", headers={"Authorization": "Bearer user"}, json={})
            assert r.status_code == 404 and "admin API is off" in r.json()["error"]["message"]


def test_admin_keys_and_api_keys_open_only_their_own_paths():
    settings = make_settings(api_key="user", admin_api_keys="adm,adm2")
    with run_server(settings, VersionedFakeEngine(), loader=fake_loader()) as srv:
        models = f"{srv.url}/admin/models"
        assert httpx.get(models).status_code == 401
        assert httpx.get(models, headers={"Authorization": "Bearer user"}).status_code == 401
        for key in ("adm", "adm2"):
            assert httpx.get(models, headers={"Authorization": f"Bearer {key}"}).status_code == 200
        r = httpx.post(f"{srv.url}/generate", json={"prompt": "hi", "stream": False}, headers=ADMIN)
        assert r.status_code == 401
        r = httpx.post(f"{srv.url}/generate", json={"prompt": "hi", "stream": False},
                       headers={"Authorization": "Bearer user"})  # fmt: skip
        assert r.status_code == 200 and r.headers["x-model-version"] == "0"


@pytest.mark.parametrize(
    ("suffix", "body", "status", "param", "words"),
    [
        ("", {"version": "v2"}, 400, "path", "no models_dir"),
        ("", {"version": "a@b", "path": "/"}, 400, "version", "version must be"),
        ("", {"version": "v2", "path": "/no/such/folder"}, 400, "path", "does not exist"),
        ("", {"version": "v2", "path": "/", "kv_cache_memory": "lots"}, 400, "kv_cache_memory", "expected bytes"),
        ("", {"version": "v2", "path": "/", "kv_cache_memory": 0}, 400, "kv_cache_memory", "positive number"),
        ("", {"version": "v2", "path": "/", "colour": "red"}, 422, "colour", "Extra inputs"),
        ("", {"version": "v2", "path": "/", "probe": {"max_tokens": 0}}, 422, "probe.max_tokens", "greater than or equal to 1"),
        ("", {"version": "0", "path": "/"}, 409, "version", "already loaded"),
        ("/0/canary", {"weight": 101}, 422, "weight", "less than or equal to 100"),
        ("/0/canary", {"weight": "5"}, 422, "weight", "valid integer"),
        ("/0/canary", {}, 422, "weight", "Field required"),
        ("/0/canary", {"weight": 5}, 409, None, "the promoted version"),
        ("/v9/canary", {"weight": 5}, 404, None, "not loaded"),
        ("/0/promote", None, 409, None, "already promoted"),
        ("/v9/promote", None, 404, None, "not loaded"),
        ("/0/promote", {"keep_previous_s": -1}, 422, "keep_previous_s", "greater than or equal to 0"),
    ],
)
def test_bad_admin_requests_are_4xx_naming_the_field(suffix, body, status, param, words):
    with run_server(make_settings(admin_api_keys="adm"), VersionedFakeEngine(), loader=fake_loader()) as srv:
        r = httpx.post(versions_url(srv, suffix), json=body, headers=ADMIN, timeout=30)
        assert r.status_code == status, r.text
        error = r.json()["error"]
        assert words in error["message"] and error.get("param") == param, error


def test_unknown_models_rollback_and_removal_errors():
    with run_server(make_settings(admin_api_keys="adm"), VersionedFakeEngine(), loader=fake_loader()) as srv:
        r = httpx.post(f"{srv.url}/admin/models/nope/versions", json={"version": "v1", "path": "/"}, headers=ADMIN)
        assert r.status_code == 404 and "not configured" in r.json()["error"]["message"]
        r = httpx.post(f"{srv.url}/admin/models/fake-model/rollback", headers=ADMIN)
        assert r.status_code == 409 and "nothing to roll back to" in r.json()["error"]["message"]
        assert httpx.delete(versions_url(srv, "/0"), headers=ADMIN).status_code == 409
        assert httpx.delete(versions_url(srv, "/v9"), headers=ADMIN).status_code == 404
        r = httpx.post(versions_url(srv), content=b"{not json", headers=ADMIN)
        assert r.status_code == 400 and "malformed JSON" in r.json()["error"]["message"]


def generate(srv, prompt: str, **body: Any) -> httpx.Response:
    return httpx.post(f"{srv.url}/generate", json={"prompt": prompt, "stream": False, "max_tokens": 3, **body},
                      timeout=30)  # fmt: skip


def expected(srv, prompt: str, salt: int, n: int = 3) -> list[int]:
    ids = srv.runtime.codec.encode_sync(prompt)
    return [salted_token(ids, i, salt) for i in range(n)]


def test_background_load_in_models_dir_one_at_a_time_then_promote(tmp_path):
    for version in ("salt-3", "salt-5"):
        (tmp_path / "fake-model" / version).mkdir(parents=True)
    gate = threading.Event()
    built: list[Any] = []
    plain = fake_loader(built)
    threads: list[threading.Thread] = []

    def slow_loader(spec, kv_bytes):
        threads.append(threading.current_thread())
        gate.wait(30)
        return plain(spec, kv_bytes)

    settings = make_settings(admin_api_keys="adm", models_dir=str(tmp_path), model_version="salt-0")
    try:
        with run_server(settings, VersionedFakeEngine(0), loader=slow_loader) as srv:
            r = httpx.post(versions_url(srv), json={"version": "salt-3", "wait": False}, headers=ADMIN)
            assert r.status_code == 202 and r.headers["location"] == "/admin/models/fake-model/versions/salt-3"
            assert httpx.get(versions_url(srv, "/salt-3"), headers=ADMIN).json()["state"] == "loading"
            cards = httpx.get(f"{srv.url}/v1/models").json()["data"][0]["versions"]
            assert {v["version"]: v["state"] for v in cards} == {"salt-0": "ready", "salt-3": "loading"}
            r = httpx.post(versions_url(srv), json={"version": "salt-5"}, headers=ADMIN)
            assert r.status_code == 409 and "load one version at a time" in r.json()["error"]["message"]
            for action, body in (("promote", None), ("canary", {"weight": 5})):
                r = httpx.post(versions_url(srv, f"/salt-3/{action}"), json=body, headers=ADMIN)
                assert r.status_code == 409 and "is loading" in r.json()["error"]["message"], action
            assert httpx.delete(versions_url(srv, "/salt-3"), headers=ADMIN).status_code == 409
            assert generate(srv, "abc").json()["token_ids"] == expected(srv, "abc", 0)  # serving goes on
            gate.set()
            wait_until(lambda: httpx.get(versions_url(srv, "/salt-3"), headers=ADMIN).json()["state"] == "ready",
                       what="background load done")  # fmt: skip
            row = httpx.get(versions_url(srv, "/salt-3"), headers=ADMIN).json()
            assert row["path"] == str(tmp_path / "fake-model" / "salt-3") and row["role"] == "candidate"
            assert generate(srv, "abc", model="fake-model@salt-3").json()["token_ids"] == expected(srv, "abc", 3)
            r = httpx.post(versions_url(srv, "/salt-3/promote"), headers=ADMIN)
            assert r.status_code == 200 and r.json()["promoted"] == "salt-3"
            r = generate(srv, "abc")
            assert r.headers["x-model-version"] == "salt-3" and r.json()["token_ids"] == expected(srv, "abc", 3)
            wait_until(lambda: "salt-0" not in srv.runtime.models.slot("fake-model").versions, what="old unloaded")
            assert httpx.post(versions_url(srv), json={"version": "salt-5"}, headers=ADMIN).status_code == 201
            assert httpx.delete(versions_url(srv, "/salt-5"), headers=ADMIN).status_code == 204
            wait_until(lambda: "salt-5" not in srv.runtime.models.slot("fake-model").versions, what="removed")
            assert len(built) == 2  # one engine per load, none built twice
            # Each on a thread of its own that has ended (server/serving/fresh_thread.py: OpenMP teams).
            for t in threads:
                t.join(5)
            assert len(set(threads)) == 2 and not any(t.is_alive() for t in threads)
    finally:
        gate.set()


class MoeFakeEngine(VersionedFakeEngine):
    """A fake engine whose model routes tokens to experts: the counts a real MoE engine reports."""

    def expert_counts(self) -> list[list[int]] | None:
        return [[3, 0, 5, 2], [1, 9, 0, 0]]


def test_experts_endpoint_reports_a_moe_versions_counts_and_the_stop_logs_them(caplog):
    caplog.set_level("INFO", logger="tokenmill")
    with run_server(make_settings(admin_api_keys="adm"), MoeFakeEngine(), loader=fake_loader()) as srv:
        r = httpx.get(versions_url(srv, "/0/experts"), headers=ADMIN)
        assert r.status_code == 200
        assert r.json()["layers"] == [{"layer": 0, "tokens": [3, 0, 5, 2]}, {"layer": 1, "tokens": [1, 9, 0, 0]}]
        assert httpx.get(versions_url(srv, "/0/experts")).status_code == 401  # admin keys only
        r = httpx.get(versions_url(srv, "/7/experts"), headers=ADMIN)
        assert r.status_code == 404 and "fake-model@7 is not loaded" in r.json()["error"]["message"]
    assert "per sparse layer: [[3, 0, 5, 2], [1, 9, 0, 0]]" in caplog.text


def test_experts_endpoint_on_a_dense_model_is_404():
    with run_server(make_settings(admin_api_keys="adm"), VersionedFakeEngine(), loader=fake_loader()) as srv:
        r = httpx.get(versions_url(srv, "/0/experts"), headers=ADMIN)
        assert r.status_code == 404 and "not a mixture-of-experts model" in r.json()["error"]["message"]
