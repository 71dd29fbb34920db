"""Many models in one server, loaded on demand, end to end over HTTP on three tiny seeded models in both
layouts of a models folder (llama.cpp's flat `llama.gguf` and `qwen2/`, tokenmill's `qwen3/v1/`) and a
corrupt one (`broken/`), with `--models-max 2`:

- requests to all three at once all answer, each model exactly as it answers served alone (an offline
  engine on the same file), and none fails; never more than two models hold an engine; the least
  recently used one unloads (seen in /v1/models, the pool's count and the version events metric);
- the idle unload empties the server and the memory comes back (RSS, tolerance below);
- an unknown model is a 404 naming the field and listing the models; the corrupt folder is a 503 naming
  why it did not load, for that model only: the others keep serving.
"""

from __future__ import annotations

import gc
import shutil
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from engine.api import SamplingParams

from ..helpers import build_real_engine, make_settings, metric, run_server, wait_until

PROMPTS = ["The capital of France is", "Hello"]
GREEDY = {"max_tokens": 4, "temperature": 0.0, "ignore_eos": True}
KV_BYTES = 48 << 20  # each loaded model's KV cache: large beside a tiny model's weights, so its RSS shows
# RSS after every model unloaded may exceed RSS before the first load by this much (allocator caches,
# the tokenizers and compiled kernels a load leaves behind); one loaded model's KV alone is 48 MiB. An
# unload must give back at least 3/4 of that KV.
RSS_TOLERANCE = 40 << 20
IDLE_S = 5.0


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from engine.testing.make_gguf import write_gguf
    from engine.testing.make_model import ensure_model

    root = tmp_path_factory.mktemp("models")
    write_gguf(ensure_model("tiny-llama"), root / "llama.gguf")  # flat: NAME.gguf
    shutil.copytree(ensure_model("tiny-qwen2"), root / "qwen2")  # flat: NAME/ a model folder
    shutil.copytree(ensure_model("tiny-qwen3"), root / "qwen3" / "v1")  # versions: NAME/VERSION/
    (root / "broken").mkdir()
    (root / "broken" / "config.json").write_text('{"model_type": "llama", "hidden_size": ')  # cut short
    return root


@pytest.fixture(scope="module")
def refs(models_dir: Path) -> dict[str, dict[str, str]]:
    """Each model's greedy text per prompt, served alone (an offline engine on the same file)."""
    paths = {"llama": models_dir / "llama.gguf", "qwen2": models_dir / "qwen2", "qwen3": models_dir / "qwen3" / "v1"}
    out = {}
    for name, path in paths.items():
        engine = build_real_engine(str(path))
        out[name] = {p: r.text for p, r in zip(PROMPTS, engine.generate(PROMPTS, SamplingParams(**GREEDY)), strict=True)}
        del engine
    gc.collect()
    assert len({tuple(texts.values()) for texts in out.values()}) == 3  # the models are told apart by output
    return out


def cards(url: str) -> dict[str, dict[str, Any]]:
    return {c["id"]: c for c in httpx.get(f"{url}/v1/models", timeout=10).json()["data"]}


def holding(url: str) -> set[str]:
    """The models holding an engine now (loading or loaded)."""
    return {name for name, c in cards(url).items() if c["status"]["value"] != "unloaded"}


def complete(url: str, model: str, prompt: str) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", json={"model": model, "prompt": prompt, **GREEDY}, timeout=120)


def test_three_models_two_loaded_lru_idle_unload_and_errors(models_dir: Path, refs: dict[str, dict[str, str]]):
    settings = make_settings(models_dir=str(models_dir), models_max=2, models_idle_unload_s=IDLE_S,
                             kv_cache_memory=KV_BYTES, dtype="float32")  # fmt: skip
    gc.collect()
    rss_before = rss()
    with run_server(settings, None) as srv:
        listed = cards(srv.url)
        assert sorted(listed) == ["broken", "llama", "qwen2", "qwen3"]
        assert all(c["status"] == {"value": "unloaded"} and c["state"] == "unloaded" for c in listed.values())
        assert listed["qwen3"]["version"] == "v1" and srv.health()["status"] == "ok"  # ready with nothing loaded

        # Every model at once, three rounds; a watcher checks that never more than two hold an engine.
        seen: list[set[str]] = []
        stop = threading.Event()

        def watch() -> None:
            while not stop.is_set():
                seen.append(holding(srv.url))
                time.sleep(0.02)

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        results: list[tuple[str, str, httpx.Response]] = []
        lock = threading.Lock()

        def send(model: str, prompt: str) -> None:
            r = complete(srv.url, "llama.gguf" if model == "llama" and prompt == PROMPTS[1] else model, prompt)
            with lock:
                results.append((model, prompt, r))

        try:
            for _ in range(3):
                threads = [threading.Thread(target=send, args=(m, p)) for m in refs for p in PROMPTS]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join(300)
        finally:
            stop.set()
            watcher.join(10)
        assert len(results) == 3 * len(refs) * len(PROMPTS)
        failed = [(m, p, r.status_code, r.text) for m, p, r in results if r.status_code != 200]
        assert not failed, failed
        for model, prompt, r in results:
            assert r.json()["choices"][0]["text"] == refs[model][prompt], (model, prompt)
        assert seen and max(len(s) for s in seen) <= 2, max(seen, key=len)
        assert set().union(*seen) == set(refs)  # each was loaded at some point
        pool = srv.runtime.pool
        assert pool.unloads.get("lru", 0) >= 1, pool.unloads
        text = httpx.get(f"{srv.url}/metrics", timeout=10).text
        assert metric(text, "tokenmill_model_version_events_total", event="unloaded") >= 1
        assert metric(text, "tokenmill_model_version_events_total", event="loaded") >= 3
        assert metric(text, "tokenmill_requests_total", status="error") == 0
        for name in refs:  # each model's own series (its `model_name` on vLLM's)
            assert metric(text, "vllm:request_success_total", model_name=name) >= 1, name

        # Idle unload: nothing used for IDLE_S, so every model unloads, and the memory comes back.
        wait_until(lambda: not holding(srv.url), IDLE_S + 20, what="idle unload of every model")
        wait_until(lambda: not pool.busy(), 20, what="unloads done")  # the engines gone, not just unlisted
        idle_unloads = pool.unloads.get("idle", 0)
        assert idle_unloads >= 1, pool.unloads
        assert complete(srv.url, "llama", PROMPTS[0]).status_code == 200
        assert holding(srv.url) == {"llama"}
        rss_loaded = rss()
        wait_until(lambda: pool.unloads["idle"] == idle_unloads + 1, IDLE_S + 20, what="idle unload")
        assert not holding(srv.url)
        gc.collect()
        time.sleep(0.2)
        rss_unloaded = rss()
        print(f"RSS before {rss_before >> 20} MiB, one loaded {rss_loaded >> 20} MiB, unloaded {rss_unloaded >> 20} MiB")
        assert rss_loaded - rss_unloaded >= KV_BYTES * 3 // 4, (rss_loaded, rss_unloaded)  # its KV cache came back
        assert rss_unloaded - rss_before <= RSS_TOLERANCE, (rss_before, rss_unloaded)

        # Unknown model: 404 naming the field and listing what is served.
        r = complete(srv.url, "nope", "Hello")
        err = r.json()["error"]
        assert r.status_code == 404 and err["param"] == "model" and "'nope'" in err["message"]
        assert "['broken', 'llama', 'qwen2', 'qwen3']" in err["message"]

        # A corrupt model: a clear error for it alone, remembered; the others keep serving.
        r = complete(srv.url, "broken", "Hello")
        err = r.json()["error"]
        assert r.status_code == 503 and err["type"] == "model_load_failed" and err["param"] == "model", r.text
        assert "'broken' failed to load" in err["message"] and "load_failed" in err["message"], err
        assert int(r.headers["Retry-After"]) >= 1
        again = complete(srv.url, "broken", "Hello")  # answered from memory, no second load
        assert again.status_code == 503 and "next try" in again.json()["error"]["message"]
        assert cards(srv.url)["broken"]["status"]["failed"] is True
        r = complete(srv.url, "qwen3", PROMPTS[0])
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == refs["qwen3"][PROMPTS[0]]
        assert cards(srv.url)["qwen3"]["status"] == {"value": "loaded"} and srv.health()["status"] == "ok"
