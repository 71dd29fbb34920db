"""Loading on demand (server/serving/pool.py) on fake engines, where a test holds a load or a request at
will: concurrent first requests share one load and requests to a loaded model do not wait for it;
`models_max` never unloads a model with a request in flight (the load waits `models_load_wait_s`, then
503 + Retry-After); a model that would not fit in memory is a 503 naming what it needs, before any load;
a name still carries versions (admin load + promote), and the promoted one is what loads again.
The end-to-end run on real models is test_models_dir_e2e.py."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import httpx

from ..fake_versions import VersionedFakeEngine
from ..helpers import Background, make_settings, run_server, wait_until

NAMES = ("a", "b", "c")
BODY = {"prompt": "Hi", "max_tokens": 3, "temperature": 0.0, "ignore_eos": True}


class GatedLoader:
    """Builds a fake engine per model (salted by name: each answers its own way); a test can hold a
    model's load until it opens that model's gate. Counts the loads per name."""

    def __init__(self) -> None:
        self.gates = {name: threading.Event() for name in NAMES}
        for gate in self.gates.values():
            gate.set()
        self.loads = {name: 0 for name in NAMES}
        self.engines: dict[str, VersionedFakeEngine] = {}

    def __call__(self, spec: Any, kv_bytes: int | None) -> VersionedFakeEngine:
        self.loads[spec.name] += 1
        assert self.gates[spec.name].wait(60)
        engine = VersionedFakeEngine(NAMES.index(spec.name) + 1 + (10 if spec.version == "v2" else 0))
        self.engines[spec.name] = engine
        return engine


def models_dir(tmp_path: Path) -> str:
    tmp_path.mkdir(exist_ok=True)
    for name in NAMES:
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text("{}")
    return str(tmp_path)


def states(url: str) -> dict[str, str]:
    return {c["id"]: c["status"]["value"] for c in httpx.get(f"{url}/v1/models", timeout=10).json()["data"]}


def send(url: str, model: str) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", json={"model": model, **BODY}, timeout=60)


def test_first_requests_share_one_load_and_loaded_models_do_not_wait(tmp_path):
    loader = GatedLoader()
    settings = make_settings(models_dir=models_dir(tmp_path), models_max=0, kv_cache_memory=1 << 20)
    with Background() as bg, run_server(settings, None, loader=loader) as srv:
        assert states(srv.url) == {"a": "unloaded", "b": "unloaded", "c": "unloaded"}
        alone = send(srv.url, "a")
        assert alone.status_code == 200 and loader.loads["a"] == 1
        loader.gates["b"].clear()
        pending = [bg.post(f"b{i}", f"{srv.url}/v1/completions", {"model": "b", **BODY}) for i in range(5)]
        wait_until(lambda: states(srv.url)["b"] == "loading", what="b loading")
        started = time.monotonic()
        during = send(srv.url, "a")  # a is loaded: it does not wait for b's load
        assert during.status_code == 200 and time.monotonic() - started < 5
        assert during.json()["choices"][0]["text"] == alone.json()["choices"][0]["text"]
        assert all(not f.done() for f in pending)  # the first requests to b wait for its load
        loader.gates["b"].set()
        answers = [f.result(60) for f in pending]
        assert [r.status_code for r in answers] == [200] * 5
        assert loader.loads == {"a": 1, "b": 1, "c": 0}  # five first requests, one load
        assert answers[0].json()["choices"][0]["text"] != alone.json()["choices"][0]["text"]  # b's own answer
        assert states(srv.url) == {"a": "loaded", "b": "loaded", "c": "unloaded"}


def test_models_max_never_unloads_a_busy_model(tmp_path):
    loader = GatedLoader()
    settings = make_settings(models_dir=models_dir(tmp_path), models_max=1, models_load_wait_s=0.5,
                             kv_cache_memory=1 << 20)  # fmt: skip
    with Background() as bg, run_server(settings, None, loader=loader) as srv:
        assert send(srv.url, "a").status_code == 200
        loader.engines["a"].step_gate.clear()  # a's next request stays in flight
        held = bg.post("held", f"{srv.url}/v1/completions", {"model": "a", **BODY})
        wait_until(lambda: srv.runtime.models.slots["a"].versions[srv.runtime.models.slots["a"].promoted].busy(),
                   what="a busy")  # fmt: skip
        refused = send(srv.url, "b")
        err = refused.json()["error"]
        assert refused.status_code == 503 and refused.headers["Retry-After"] == "1", refused.text
        assert err["type"] == "overloaded" and err["param"] == "model" and "models_max" in err["message"]
        assert loader.loads["b"] == 0 and states(srv.url)["a"] == "loaded"
        loader.engines["a"].step_gate.set()
        assert held.result(30).status_code == 200  # the busy model's request was never cut
        # a is idle now: it is the least recently used, and unloads for b
        assert send(srv.url, "b").status_code == 200
        assert states(srv.url) == {"a": "unloaded", "b": "loaded", "c": "unloaded"}
        assert srv.runtime.pool.unloads == {"lru": 1}


def test_a_model_that_does_not_fit_is_a_503_before_any_load(tmp_path):
    loader = GatedLoader()
    settings = make_settings(models_dir=models_dir(tmp_path), kv_cache_memory="64TiB")
    with run_server(settings, None, loader=loader) as srv:
        r = send(srv.url, "c")
        err = r.json()["error"]
        assert r.status_code == 503 and err["type"] == "insufficient_memory" and err["param"] == "model", r.text
        assert "c@" in err["message"] and err["needed_bytes"] > err["available_bytes"]
        assert int(r.headers["Retry-After"]) >= 1
        assert loader.loads["c"] == 0 and states(srv.url)["c"] == "unloaded"
        missing = send(srv.url, "d")
        assert missing.status_code == 404 and "['a', 'b', 'c']" in missing.json()["error"]["message"]


def test_a_promoted_version_is_what_loads_again(tmp_path):
    loader = GatedLoader()
    (tmp_path / "a-v2").mkdir()
    settings = make_settings(models_dir=models_dir(tmp_path / "dir"), models_max=1, kv_cache_memory=1 << 20,
                             admin_api_keys="adm")  # fmt: skip
    admin = {"Authorization": "Bearer adm"}
    with run_server(settings, None, loader=loader) as srv:
        first = send(srv.url, "a")
        assert first.status_code == 200
        r = httpx.post(f"{srv.url}/admin/models/a/versions", json={"version": "v2", "path": str(tmp_path / "a-v2")},
                       headers=admin, timeout=60)  # fmt: skip
        assert r.status_code == 201, r.text
        r = httpx.post(f"{srv.url}/admin/models/a/versions/v2/promote", headers=admin, timeout=60)
        assert r.status_code == 200, r.text
        v2 = send(srv.url, "a")
        assert v2.headers["X-Model-Version"] == "v2" and v2.json()["choices"][0]["text"] != first.json()["choices"][0]["text"]
        wait_until(lambda: list(srv.runtime.models.slots["a"].versions) == ["v2"], what="v1 retired")
        assert send(srv.url, "b").status_code == 200  # models_max 1: a unloads
        assert states(srv.url)["a"] == "unloaded"
        # An admin load beside the unloaded promoted version: requests still load (and get) the promoted one.
        r = httpx.post(f"{srv.url}/admin/models/a/versions", json={"version": "v3", "path": str(tmp_path / "a-v2")},
                       headers=admin, timeout=60)  # fmt: skip
        assert r.status_code == 201, r.text
        again = send(srv.url, "a")  # loads a again: its promoted version, v2
        assert again.status_code == 200 and again.headers["X-Model-Version"] == "v2"
        assert again.json()["choices"][0]["text"] == v2.json()["choices"][0]["text"]
        # Promote while the promoted version is unloaded: the candidate simply takes over.
        assert send(srv.url, "b").status_code == 200  # a (v2 and v3) unloads
        r = httpx.post(f"{srv.url}/admin/models/a/versions", json={"version": "v4", "path": str(tmp_path / "a-v2")},
                       headers=admin, timeout=60)  # fmt: skip
        assert r.status_code == 201 and "v2" not in srv.runtime.models.slots["a"].versions, r.text
        r = httpx.post(f"{srv.url}/admin/models/a/versions/v4/promote", headers=admin, timeout=60)
        assert r.status_code == 200, r.text
        v4 = send(srv.url, "a")
        assert v4.status_code == 200 and v4.headers["X-Model-Version"] == "v4"
