"""LoRA adapters over HTTP: --lora-modules at start-up, `model: <adapter>` on the generation routes,
/v1/models with `parent`, vLLM's load/unload endpoints behind the admin key (4xx naming the problem),
load and unload under traffic with no failed request, and an unload that lets a request in flight finish."""

from __future__ import annotations

import argparse

import httpx
import pytest

from server.config.flags import add_flags, parse_settings
from server.config.vllm_flags import flag_problems
from tests.engine.lora_helpers import SPECS, AdapterSpec, make_adapter, peft_greedy

from ..helpers import Background, build_real_engine, make_settings, metric, run_server, wait_until

ADMIN = {"Authorization": "Bearer adm"}
PROMPT = [11, 250, 37, 900, 42, 7, 1300]
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def adapters(tiny_model_path, tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-http")
    return {name: make_adapter(tiny_model_path, root / name, spec) for name, spec in SPECS.items()}


@pytest.fixture(scope="module")
def refs(tiny_model_path, adapters):
    out = {None: peft_greedy(tiny_model_path, None, [PROMPT], MAX_TOKENS)[0]}
    out.update({n: peft_greedy(tiny_model_path, a, [PROMPT], MAX_TOKENS)[0] for n, a in adapters.items()})
    return out


@pytest.fixture(scope="module")
def lora_srv(tiny_model_path, adapters, tmp_path_factory):
    from engine.config.lora import LoraConfig

    settings = make_settings(enable_lora=True, admin_api_keys="adm", max_loras=2, served_model_name="tiny",
                             response_cache_bytes=1 << 20,
                             feedback_db=str(tmp_path_factory.mktemp("lora-fb") / "fb.sqlite3"))  # fmt: skip
    engine = build_real_engine(tiny_model_path, lora=LoraConfig(max_loras=2, modules=(("all", str(adapters["all"])),)))
    with run_server(settings, engine) as s:
        yield s


def gen(srv, model, max_tokens=MAX_TOKENS, **kw):
    body = {"prompt_token_ids": PROMPT, "max_tokens": max_tokens, "temperature": 0, "stream": False, **kw}
    if model is not None:
        body["model"] = model
    return httpx.post(f"{srv.url}/generate", json=body, timeout=60)


def load(srv, name, path, headers=ADMIN):
    return httpx.post(f"{srv.url}/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)},
                      headers=headers, timeout=60)  # fmt: skip


def unload(srv, name, headers=ADMIN):
    return httpx.post(f"{srv.url}/v1/unload_lora_adapter", json={"lora_name": name}, headers=headers, timeout=60)


def test_startup_adapter_is_listed_and_served(lora_srv, refs):
    cards = {c["id"]: c for c in httpx.get(f"{lora_srv.url}/v1/models").json()["data"]}
    assert cards["all"]["parent"] == "tiny" and cards["all"]["lora_rank"] == 8
    assert httpx.get(f"{lora_srv.url}/v1/models/all").json()["parent"] == "tiny"
    assert gen(lora_srv, "all").json()["token_ids"] == refs["all"]
    assert gen(lora_srv, None).json()["token_ids"] == refs[None]
    r = httpx.post(f"{lora_srv.url}/v1/completions", json={"model": "all", "prompt": PROMPT, "max_tokens": MAX_TOKENS,
                                                           "temperature": 0}, timeout=60)  # fmt: skip
    assert r.status_code == 200 and r.json()["model"] == "all"
    metrics = httpx.get(f"{lora_srv.url}/metrics").text
    assert 'tokenmill_lora_requests_total{lora="all",model="tiny"' in metrics
    assert 'vllm:lora_requests_info{max_lora="2"' in metrics


def test_response_cache_is_keyed_by_adapter(lora_srv, refs):
    body = {"seed": 5}  # same body on the base model and the adapter (distinct from other tests' bodies)
    first = gen(lora_srv, None, **body).json()
    assert first["usage"].get("cached") is not True
    assert gen(lora_srv, None, **body).json()["usage"].get("cached") is True  # the cache is on
    on_adapter = gen(lora_srv, "all", **body).json()
    assert on_adapter["usage"].get("cached") is not True and on_adapter["token_ids"] == refs["all"]


def test_feedback_records_the_adapter(lora_srv):
    """A rating of a request on adapter X is stored, exported and counted with X; the base model's with none."""
    ids = {}
    for model in ("all", None):
        body = {"prompt": PROMPT, "max_tokens": 3, "temperature": 0, **({"model": model} if model else {})}
        r = httpx.post(f"{lora_srv.url}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200
        ids[model] = r.json()["id"]
    rows = {}
    for model, rating in (("all", 4), (None, -1)):
        r = httpx.post(f"{lora_srv.url}/v1/feedback", json={"request_id": ids[model], "rating": rating}, timeout=10)
        assert r.status_code == 201, r.text
        rows[model] = r.json()
    assert rows["all"]["lora"] == "all" and rows["all"]["model"] == "tiny" and rows["all"]["completion_tokens"] == 3
    assert rows[None]["lora"] is None
    export = httpx.get(f"{lora_srv.url}/admin/feedback", params={"lora": "all"}, headers=ADMIN, timeout=10).json()
    assert [row["request_id"] for row in export["data"]] == [ids["all"]]
    metrics = httpx.get(f"{lora_srv.url}/metrics").text
    assert metric(metrics, "tokenmill_lora_feedback_ratings_total", lora="all", rating="4") == 1
    assert metric(metrics, "tokenmill_lora_feedback_ratings_total", rating="-1") == 0  # the base model's rating
    assert metric(metrics, "tokenmill_feedback_ratings_total", rating="-1") == 1


def test_unknown_adapter_is_404_naming_model(lora_srv):
    r = gen(lora_srv, "nobody")
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"


def test_endpoints_need_the_admin_key(lora_srv, adapters):
    assert load(lora_srv, "x", adapters["attn"], headers={}).status_code == 401
    assert unload(lora_srv, "all", headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert "x" not in {c["id"] for c in httpx.get(f"{lora_srv.url}/v1/models").json()["data"]}


def test_bad_adapters_are_4xx_naming_the_problem(lora_srv, tiny_model_path, tmp_path):
    r = load(lora_srv, "m", tmp_path / "nope")
    assert r.status_code == 404 and r.json()["error"]["param"] == "lora_path" and "not a folder" in r.json()["error"]["message"]
    high = make_adapter(tiny_model_path, tmp_path / "high", AdapterSpec(32, 32, ("q_proj",)))
    r = load(lora_srv, "h", high)
    assert r.status_code == 400 and "max_lora_rank" in r.json()["error"]["message"]
    r = load(lora_srv, "tiny", high)  # the model's own name
    assert r.status_code == 409 and r.json()["error"]["param"] == "lora_name"
    assert unload(lora_srv, "nobody").status_code == 404
    names = {c["id"] for c in httpx.get(f"{lora_srv.url}/v1/models").json()["data"]}
    assert names == {"tiny", "all"}  # nothing half-loaded


def test_load_and_unload_under_traffic_fail_nothing(lora_srv, adapters, refs):
    bg = Background()
    futures = [bg.post(str(i), f"{lora_srv.url}/generate",
                       {"prompt_token_ids": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": False,
                        **({"model": "all"} if i % 2 else {})}) for i in range(24)]  # fmt: skip
    r = load(lora_srv, "attn", adapters["attn"])
    assert r.status_code == 200 and r.json()["parent"] == "tiny", r.text
    assert gen(lora_srv, "attn").json()["token_ids"] == refs["attn"]
    assert unload(lora_srv, "attn").status_code == 200
    for i, f in enumerate(futures):
        res = f.result()
        assert res.status_code == 200, res.text
        assert res.json()["token_ids"] == refs["all" if i % 2 else None]
    assert gen(lora_srv, "attn").status_code == 404


def test_unload_lets_a_request_in_flight_finish(lora_srv, adapters, tiny_model_path):
    assert load(lora_srv, "mlp", adapters["mlp"]).status_code == 200
    want = peft_greedy(tiny_model_path, adapters["mlp"], [PROMPT], 40)[0]
    bg = Background()
    long = bg.post("long", f"{lora_srv.url}/generate", {"prompt_token_ids": PROMPT, "max_tokens": 40, "temperature": 0,
                                                        "stream": False, "model": "mlp"})  # fmt: skip
    wait_until(lambda: lora_srv.runtime.models.primary.worker.stats.running > 0, what="the request running")
    assert unload(lora_srv, "mlp").status_code == 200
    res = long.result()
    assert res.status_code == 200 and res.json()["token_ids"] == want
    assert gen(lora_srv, "mlp").status_code == 404


def test_vllm_lora_flags_parse():
    s = parse_settings(["--lora-modules", "a=/p", '{"name": "b", "path": "/q", "base_model_name": "m"}',
                        "--max-loras", "2", "--max-lora-rank", "32"])  # fmt: skip
    assert s.lora_modules == [("a", "/p"), ("b", "/q")]
    cfg = s.lora_config()
    assert cfg is not None and cfg.max_loras == 2 and cfg.max_lora_rank == 32 and cfg.modules == (("a", "/p"), ("b", "/q"))
    assert parse_settings([]).lora_config() is None
    parser = argparse.ArgumentParser()
    add_flags(parser)
    assert flag_problems(parser, ["--enable-lora", "--lora-modules", "a=/p", "b=/q", "--max-loras", "2"]) is None
    with pytest.raises(ValueError, match="lora_modules"):
        parse_settings(["--lora-modules", "noequals"])
