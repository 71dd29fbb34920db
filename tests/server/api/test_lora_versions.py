"""LoRA adapters and model versions over HTTP (tiny-llama as v1, tiny-llama-b as v2: the same shapes,
other weights): a version the admin API loads gets the adapters the promoted one serves, read again
against its own base weights (a start-up adapter unloaded since stays unloaded), so an adapter's
requests follow the canary share, `adapter@version` pins and a promote exactly as the model's do, each
answer equal to PEFT on the base it names; a version an adapter does not fit (tiny-llama-k: other
sizes) fails its load naming the adapter, and nothing changes for the running version."""

from __future__ import annotations

from collections import Counter

import httpx
import pytest

from tests.engine.lora_helpers import SPECS, make_adapter, peft_greedy

from ..helpers import make_settings, run_server

ADMIN = {"Authorization": "Bearer adm"}
PROMPT = [11, 250, 37, 900, 42, 7, 1300]
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def paths(tiny_model_path):
    from engine.testing.make_model import ensure_model

    return {"v1": tiny_model_path, "v2": str(ensure_model("tiny-llama-b")), "k": str(ensure_model("tiny-llama-k"))}


@pytest.fixture(scope="module")
def adapters(tiny_model_path, tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-versions")
    return {name: make_adapter(tiny_model_path, root / name, SPECS[name]) for name in ("all", "attn")}


@pytest.fixture(scope="module")
def refs(paths, adapters):
    """PEFT's greedy tokens of `attn` (and of no adapter) on each version's base weights."""
    out = {(v, lora): peft_greedy(paths[v], adapters[lora] if lora else None, [PROMPT], MAX_TOKENS)[0]
           for v in ("v1", "v2") for lora in ("attn", None)}  # fmt: skip
    assert out["v1", "attn"] != out["v2", "attn"] and out["v1", "attn"] != out["v1", None]
    return out


def gen(url: str, model: str) -> httpx.Response:
    body = {"prompt_token_ids": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": False, "model": model}
    return httpx.post(f"{url}/generate", json=body, timeout=60)


def answered(url: str, model: str, refs, n: int = 1) -> Counter:
    """Send `n` requests on `model`; each answer must hold PEFT's tokens for the version it names."""
    lora = None if model.split("@")[0] == "tiny" else "attn"
    seen: Counter = Counter()
    for _ in range(n):
        r = gen(url, model)
        assert r.status_code == 200, r.text
        version = r.json()["model_version"]
        assert r.json()["token_ids"] == refs[version, lora], (model, version)
        seen[version] += 1
    return seen


def admin(url: str, path: str, body=None) -> httpx.Response:
    return httpx.post(f"{url}/admin/models/tiny/{path}", json=body, headers=ADMIN, timeout=120)


def load_adapter(url: str, name: str, path) -> httpx.Response:
    return httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)}, headers=ADMIN,
                      timeout=60)  # fmt: skip


def held(srv) -> dict[str, set[str]]:
    return {dep.version: set(dep.adapters) for _, dep in srv.runtime.models.deployments()}


def test_a_new_version_serves_the_same_adapters_through_canary_pins_and_promote(paths, adapters, refs):
    settings = make_settings(models=f"tiny@v1={paths['v1']}", admin_api_keys="adm", kv_cache_memory=16 << 20,
                             enable_lora=True, lora_modules=[("all", str(adapters["all"]))])  # fmt: skip
    with run_server(settings, None) as srv:
        assert load_adapter(srv.url, "attn", adapters["attn"]).status_code == 200
        r = httpx.post(f"{srv.url}/v1/unload_lora_adapter", json={"lora_name": "all"}, headers=ADMIN, timeout=60)
        assert r.status_code == 200  # a start-up adapter, unloaded: v2's engine reads it from the flags again
        r = admin(srv.url, "versions", {"version": "v2", "path": paths["v2"]})
        assert r.status_code == 201, r.text
        assert held(srv) == {"v1": {"attn"}, "v2": {"attn"}}
        assert gen(srv.url, "all").status_code == 404 and gen(srv.url, "all@v2").status_code == 404

        assert admin(srv.url, "versions/v2/canary", {"weight": 50}).status_code == 200
        assert answered(srv.url, "attn", refs, 8) == Counter(v1=4, v2=4)  # the model's exact share
        assert answered(srv.url, "attn@v2", refs, 2) == Counter(v2=2)  # a pin wins, as for the model
        assert answered(srv.url, "attn@v1", refs, 2) == Counter(v1=2)
        assert httpx.get(f"{srv.url}/v1/models/attn@v2", timeout=10).json()["parent"] == "tiny"
        assert answered(srv.url, "tiny", refs, 2) == Counter(v1=1, v2=1)

        assert admin(srv.url, "versions/v2/promote", {"keep_previous_s": 0}).status_code == 200
        assert answered(srv.url, "attn", refs, 3) == Counter(v2=3)
        cards = {c["id"]: c for c in httpx.get(f"{srv.url}/v1/models", timeout=10).json()["data"]}
        assert cards["attn"]["parent"] == "tiny" and "all" not in cards


def test_a_version_an_adapter_does_not_fit_fails_its_load_naming_it(paths, adapters, refs):
    settings = make_settings(models=f"tiny@v1={paths['v1']}", admin_api_keys="adm", kv_cache_memory=16 << 20,
                             enable_lora=True)  # fmt: skip
    with run_server(settings, None) as srv:
        assert load_adapter(srv.url, "attn", adapters["attn"]).status_code == 200
        r = admin(srv.url, "versions", {"version": "k1", "path": paths["k"]})
        assert r.status_code == 422, r.text
        error = r.json()["error"]
        assert error["type"] == "load_failed" and "'attn'" in error["message"] and "another base model" in error["message"]
        rows = httpx.get(f"{srv.url}/admin/models", headers=ADMIN, timeout=10).json()["data"][0]["versions"]
        assert {row["version"]: row["state"] for row in rows} == {"v1": "ready", "k1": "failed"}
        assert held(srv) == {"v1": {"attn"}}
        assert answered(srv.url, "attn", refs, 2) == Counter(v1=2)
        assert gen(srv.url, "attn@k1").status_code == 404
