"""Model versions end to end, on two tiny seeded models with different greedy outputs (tiny-llama as
v1, tiny-llama-b as v2): a blue-green swap under a steady stream of requests fails none and every answer
carries the version whose tokens it holds; broken versions (corrupt weights, NaN weights, a probe that
fails) are never promoted while traffic and /health go on; a canary gets its share exactly and a
rollback moves all new traffic back at once."""

from __future__ import annotations

import gc
import json
import shutil
import threading
import time
import weakref
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import pytest
from httpx_sse import connect_sse

from engine.api import SamplingParams

from ..helpers import build_real_engine, holders, make_settings, metric, run_server, wait_until

ADMIN = {"Authorization": "Bearer admin-key"}
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Hello", "Once upon a time", "SELECT * FROM"]
MAX_TOKENS = 6
GREEDY = {"max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def paths(tiny_model_path: str) -> dict[str, str]:
    from engine.testing.make_model import ensure_model

    return {"v1": tiny_model_path, "v2": str(ensure_model("tiny-llama-b"))}


@pytest.fixture(scope="module")
def refs(paths: dict[str, str]) -> dict[str, dict[str, tuple[list[int], str]]]:
    """Greedy (token ids, text) of each prompt under each version, from offline engines."""
    out = {}
    for version, path in paths.items():
        engine = build_real_engine(path)
        results = engine.generate(PROMPTS, SamplingParams(**GREEDY))
        out[version] = {p: (r.token_ids, r.text) for p, r in zip(PROMPTS, results, strict=True)}
    assert all(out["v1"][p][0] != out["v2"][p][0] for p in PROMPTS)  # the versions are told apart by output
    return out


def settings(paths: dict[str, str], **overrides: Any):
    return make_settings(models=f"tiny@v1={paths['v1']}", admin_api_keys="admin-key", kv_cache_memory=16 << 20,
                         **overrides)  # fmt: skip


def load(url: str, version: str, path: str, **body: Any) -> httpx.Response:
    return httpx.post(f"{url}/admin/models/tiny/versions", json={"version": version, "path": path, **body},
                      headers=ADMIN, timeout=120)  # fmt: skip


def admin(url: str, action: str, body: dict[str, Any] | None = None) -> httpx.Response:
    return httpx.post(f"{url}/admin/models/tiny/{action}", json=body, headers=ADMIN, timeout=30)


def listing(url: str) -> dict[str, dict[str, Any]]:
    data = httpx.get(f"{url}/admin/models", headers=ADMIN, timeout=10).json()["data"][0]
    return {row["version"]: row for row in data["versions"]}


class Client:
    """One client thread: sends requests in turn through /generate (JSON and SSE) and /v1/completions and
    records what came back, until stopped."""

    def __init__(self, url: str, index: int) -> None:
        self.url = url
        self.index = index
        self.results: list[dict[str, Any]] = []
        self.errors: list[str] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(timeout=60) as http:
            n = self.index
            while not self.stop.is_set():
                prompt, kind = PROMPTS[n % len(PROMPTS)], ("json", "sse", "openai")[n % 3]
                sent = time.monotonic()
                try:
                    result = getattr(self, f"_{kind}")(http, prompt)
                except Exception as exc:  # noqa: BLE001 - any failure is what the test counts
                    self.errors.append(f"{kind}: {type(exc).__name__}: {exc}")
                else:
                    self.results.append({**result, "prompt": prompt, "kind": kind, "sent": sent,
                                         "received": time.monotonic()})  # fmt: skip
                n += 1

    def _json(self, http: httpx.Client, prompt: str) -> dict[str, Any]:
        r = http.post(f"{self.url}/generate", json={"prompt": prompt, "stream": False, **GREEDY})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["model_version"] == r.headers["x-model-version"]
        return {"version": body["model_version"], "tokens": body["token_ids"], "text": body["text"]}

    def _sse(self, http: httpx.Client, prompt: str) -> dict[str, Any]:
        with connect_sse(http, "POST", f"{self.url}/generate", json={"prompt": prompt, **GREEDY}) as src:
            assert src.response.status_code == 200
            header = src.response.headers["x-model-version"]
            events = [(e.event, json.loads(e.data)) for e in src.iter_sse()]
        assert events[-1][0] == "done" and events[-1][1]["model_version"] == header, events[-1]
        tokens = [data["token_id"] for kind, data in events if kind == "token"]
        return {"version": header, "tokens": tokens, "text": "".join(d["text"] for k, d in events if k == "token")}

    def _openai(self, http: httpx.Client, prompt: str) -> dict[str, Any]:
        r = http.post(f"{self.url}/v1/completions", json={"model": "tiny", "prompt": prompt, **GREEDY})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["system_fingerprint"] == r.headers["x-model-version"] and body["model"] == "tiny"
        return {"version": body["system_fingerprint"], "tokens": None, "text": body["choices"][0]["text"]}


def check_outputs(results: list[dict[str, Any]], refs) -> Counter:
    """Every result holds the greedy output of the version it names; returns the count per version."""
    for r in results:
        tokens, text = refs[r["version"]][r["prompt"]]
        assert r["text"] == text, r
        if r["tokens"] is not None:
            assert r["tokens"] == tokens, r
    return Counter(r["version"] for r in results)


def start_clients(url: str, n: int) -> list[Client]:
    clients = [Client(url, i) for i in range(n)]
    for c in clients:
        c.thread.start()
    return clients


def stop_clients(clients: list[Client]) -> list[dict[str, Any]]:
    for c in clients:
        c.stop.set()
    for c in clients:
        c.thread.join(60)
    errors = [e for c in clients for e in c.errors]
    assert errors == []
    return [r for c in clients for r in c.results]


def test_blue_green_swap_under_steady_load_fails_nothing(paths, refs):
    with run_server(settings(paths), None) as srv:
        rt = srv.runtime
        clients = start_clients(srv.url, 4)
        wait_until(lambda: sum(len(c.results) for c in clients) >= 12, what="traffic on v1")
        r = load(srv.url, "v2", paths["v2"])
        assert r.status_code == 201, r.text
        assert r.json()["state"] == "ready" and r.json()["role"] == "candidate"
        assert set(r.json()["timings"]) == {"load_s", "warmup_s", "probe_s"}
        old = rt.models.slot("tiny").versions["v1"]
        old_engine = weakref.ref(old.worker._engine)  # the worker is the engine's only owner
        promote_sent = time.monotonic()
        r = admin(srv.url, "versions/v2/promote")
        promoted_at = time.monotonic()
        assert r.status_code == 200 and r.json()["promoted"] == "v2" and r.json()["previous"] == "v1"
        wait_until(lambda: set(listing(srv.url)) == {"v2"}, what="v1 drained and unloaded")
        wait_until(lambda: sum(1 for c in clients for x in c.results if x["sent"] > promoted_at) >= 12,
                   what="traffic on v2")  # fmt: skip
        results = stop_clients(clients)
        counts = check_outputs(results, refs)
        assert counts["v1"] >= 12 and counts["v2"] >= 12, counts
        assert all(x["version"] == "v2" for x in results if x["sent"] > promoted_at)
        assert all(x["version"] == "v1" for x in results if x["received"] < promote_sent)
        # The old version is gone: worker stopped, engine released; the new one holds no KV once idle.
        assert old.state.value == "unloaded" and not old.worker.thread_running
        del old
        # Freed by reference count, with the collector off: no cycle keeps its memory for a GC. A thread
        # still unwinding a frame that held it (seen once in a full run on 2 loaded cores) may take a moment.
        gc.disable()
        try:
            deadline = time.monotonic() + 10
            while old_engine() is not None and time.monotonic() < deadline:
                time.sleep(0.02)
            engine = old_engine()
            if engine is not None:  # say who holds it
                pytest.fail(f"v1's engine not freed by reference count within 10 s; held by:\n{holders(engine)}")
        finally:
            gc.enable()
        gc.collect()
        h = srv.wait_idle()
        assert h["version"] == "v2" and h["kv_blocks_used"] == 0 and h["status"] == "ok"
        text = httpx.get(f"{srv.url}/metrics", timeout=10).text
        for version in ("v1", "v2"):
            served = metric(text, "tokenmill_requests_total", model="tiny", version=version, status="ok")
            assert served == counts[version], (version, served, counts)
        assert metric(text, "tokenmill_requests_total", status="error") == 0
        assert metric(text, "tokenmill_model_version_events_total", version="v2", event="promoted") == 1
        assert metric(text, "tokenmill_model_version_events_total", version="v1", event="unloaded") == 1
        assert metric(text, "tokenmill_kv_blocks_capacity", version="v1") == 0  # no gauges for an unloaded version
        models = httpx.get(f"{srv.url}/v1/models", timeout=10).json()["data"]
        assert [(m["id"], m["version"], m["state"]) for m in models] == [("tiny", "v2", "ready")]


def broken_copies(src: str, root: Path) -> dict[str, Path]:
    """tiny-llama with truncated weights, and with NaN weights (loads, but generates garbage)."""
    import torch
    from safetensors.torch import load_file, save_file

    truncated, nan = root / "truncated", root / "nan"
    for folder in (truncated, nan):
        shutil.copytree(src, folder)
    weights = truncated / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    tensors = load_file(nan / "model.safetensors")
    tensors["model.norm.weight"] = torch.full_like(tensors["model.norm.weight"], float("nan"))
    save_file(tensors, nan / "model.safetensors", metadata={"format": "pt"})
    return {"truncated": truncated, "nan": nan}


def test_broken_versions_are_never_promoted_and_nothing_else_changes(paths, refs, tmp_path):
    bad = broken_copies(paths["v1"], tmp_path)
    with run_server(settings(paths), None) as srv:
        clients = start_clients(srv.url, 2)
        health: list[int] = []
        stop = threading.Event()

        def poll() -> None:
            while not stop.is_set():
                health.append(httpx.get(f"{srv.url}/health", timeout=10).status_code)
                time.sleep(0.01)

        poller = threading.Thread(target=poll, daemon=True)
        poller.start()
        try:
            r = load(srv.url, "v2", str(bad["truncated"]))
            assert r.status_code == 422 and r.json()["error"]["type"] == "load_failed", r.text
            r = load(srv.url, "v3", str(bad["nan"]))
            assert r.status_code == 422 and r.json()["error"]["type"] == "probe_failed"
            assert "non-finite" in r.json()["error"]["message"]  # the engine refuses to sample from NaN logits
            r = load(srv.url, "v4", paths["v2"], probe={"prompt": "The capital of France is", "expect": "Paris"})
            assert r.status_code == 422 and r.json()["error"]["type"] == "probe_failed"
            assert "does not contain 'Paris'" in r.json()["error"]["message"]
            r = load(srv.url, "v5", paths["v2"], kv_cache_memory="64TiB")
            assert r.status_code == 507 and r.json()["error"]["type"] == "insufficient_memory"
            assert "GiB" in r.json()["error"]["message"] and r.json()["error"]["needed_bytes"] > 64 << 40
            r = load(srv.url, "v1", paths["v2"])
            assert r.status_code == 409 and "already loaded" in r.json()["error"]["message"]
            for version in ("v2", "v3", "v4"):
                r = admin(srv.url, f"versions/{version}/promote")
                assert r.status_code == 409 and "failed" in r.json()["error"]["message"]
            time.sleep(0.2)
        finally:
            stop.set()
            poller.join(10)
        results = stop_clients(clients)
        assert check_outputs(results, refs) == Counter(v1=len(results)) and len(results) > 0
        assert health and set(health) == {200}
        rows = listing(srv.url)
        assert {v: rows[v]["state"] for v in rows} == {"v1": "ready", "v2": "failed", "v3": "failed", "v4": "failed"}
        assert rows["v1"]["role"] == "promoted" and "v5" not in rows
        models = httpx.get(f"{srv.url}/v1/models", timeout=10).json()["data"]
        assert [v["version"] for v in models[0]["versions"]] == ["v1"]
        assert len(srv.runtime.models.slot("tiny").versions) == 1  # the failed engines were let go
        text = httpx.get(f"{srv.url}/metrics", timeout=10).text
        assert metric(text, "tokenmill_model_version_events_total", event="load_failed") == 1
        assert metric(text, "tokenmill_model_version_events_total", event="probe_failed") == 2
        # A failed version can be removed from the listing, or loaded again under its name once fixed.
        assert httpx.delete(f"{srv.url}/admin/models/tiny/versions/v2", headers=ADMIN).status_code == 204
        assert load(srv.url, "v3", paths["v2"]).status_code == 201


def sequential(url: str, n: int, model: str = "tiny") -> list[dict[str, Any]]:
    out = []
    for i in range(n):  # a connection each: keep-alive requests wait out a delayed ACK (~40 ms) here
        prompt = PROMPTS[i % len(PROMPTS)]
        r = httpx.post(f"{url}/generate", json={"prompt": prompt, "stream": False, "model": model, **GREEDY},
                       timeout=60)  # fmt: skip
        assert r.status_code == 200, r.text
        body = r.json()
        out.append({"version": body["model_version"], "prompt": prompt, "tokens": body["token_ids"],
                    "text": body["text"]})  # fmt: skip
    return out


def test_canary_share_follows_the_weight_and_rollback_moves_traffic_back_at_once(paths, refs):
    with run_server(settings(paths), None) as srv:
        assert load(srv.url, "v2", paths["v2"]).status_code == 201
        r = admin(srv.url, "versions/v2/canary", {"weight": 25})
        assert r.status_code == 200 and r.json()["canary"] == "v2" and r.json()["weight"] == 25
        counts = check_outputs(sequential(srv.url, 120), refs)
        assert abs(counts["v2"] / 120 - 0.25) <= 0.03, counts
        assert check_outputs(sequential(srv.url, 6, model="tiny@v1"), refs) == Counter(v1=6)  # a pin wins
        assert check_outputs(sequential(srv.url, 4, model="tiny@v2"), refs) == Counter(v2=4)
        assert httpx.get(f"{srv.url}/metrics", timeout=10).text.count('tokenmill_canary_weight{model="tiny",version="v2"} 25.0') == 1
        started = time.monotonic()
        r = admin(srv.url, "rollback")
        took = time.monotonic() - started
        assert r.status_code == 200 and r.json()["canary"] is None and r.json()["promoted"] == "v1"
        assert took < 1.0
        assert check_outputs(sequential(srv.url, 40), refs) == Counter(v1=40)
        wait_until(lambda: set(listing(srv.url)) == {"v1"}, what="the canary drained and unloaded")
        r = httpx.post(f"{srv.url}/generate", json={"prompt": "Hi", "model": "tiny@v2", "stream": False}, timeout=10)
        assert r.status_code == 404 and r.json()["error"]["param"] == "model"


def test_rollback_after_a_promote_returns_to_the_previous_version_while_it_is_loaded(paths, refs):
    with run_server(settings(paths), None) as srv:
        assert load(srv.url, "v2", paths["v2"]).status_code == 201
        r = admin(srv.url, "versions/v2/promote", {"keep_previous_s": 60})
        assert r.status_code == 200
        assert check_outputs(sequential(srv.url, 5), refs) == Counter(v2=5)
        rows = listing(srv.url)
        assert rows["v1"]["state"] == "draining" and rows["v1"]["role"] == "previous"
        versions = httpx.get(f"{srv.url}/v1/models", timeout=10).json()["data"][0]["versions"]
        assert {v["version"]: v["state"] for v in versions} == {"v1": "draining", "v2": "ready"}
        started = time.monotonic()
        r = admin(srv.url, "rollback")
        assert r.status_code == 200 and r.json()["promoted"] == "v1" and time.monotonic() - started < 1.0
        assert check_outputs(sequential(srv.url, 5), refs) == Counter(v1=5)
        wait_until(lambda: set(listing(srv.url)) == {"v1"}, what="v2 drained and unloaded")
        r = admin(srv.url, "rollback")
        assert r.status_code == 409 and "nothing to roll back to" in r.json()["error"]["message"]
        assert srv.wait_idle()["kv_blocks_used"] == 0
