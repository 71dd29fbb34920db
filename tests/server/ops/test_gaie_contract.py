"""The Gateway API Inference Extension's model-server protocol (its proposal 003, as the llm-d router's
EPP reads it), item by item, against a real server with LoRA adapters:

- inference API: OpenAI Completions and Chat, the `model` field routing (a LoRA adapter named there is
  served by it);
- metrics, each a gauge with `model_name`: TotalQueuedRequests `vllm:num_requests_waiting`,
  TotalRunningRequests `vllm:num_requests_running`, KVCacheUtilization `vllm:kv_cache_usage_perc` (and
  `vllm:gpu_cache_usage_perc`, the older name production-stack and AIBrix read), with their values;
- optional BlockSize and NumGPUBlocks: `vllm:cache_config_info` labels `block_size`, `num_gpu_blocks`;
- LoRA: `vllm:lora_requests_info`, a gauge whose value is the last update's time and whose labels are
  `max_lora`, `running_lora_adapters` (adapters with requests running, comma-separated) and
  `waiting_lora_adapters` (adapters with requests waiting, a lane's included);
- prefix cache reuse (SHOULD): a repeated prompt is read from the cache; health: GET /health 200.
"""

from __future__ import annotations

import time

import httpx
import pytest

from tests.engine.lora_helpers import SPECS, make_adapter

from ..helpers import (
    Background,
    ControlledEngine,
    build_real_engine,
    make_settings,
    park_filler,
    run_server,
    wait_until,
)
from .test_metrics import Scrape

NAME = "tiny"
GAUGES = {  # the protocol's metrics: name -> labels each series carries (exactly)
    "vllm:num_requests_waiting": {"model_name"},
    "vllm:num_requests_running": {"model_name"},
    "vllm:kv_cache_usage_perc": {"model_name"},
    "vllm:gpu_cache_usage_perc": {"model_name"},
    "vllm:cache_config_info": {"model_name", "block_size", "num_gpu_blocks"},
    "vllm:lora_requests_info": {"model_name", "max_lora", "running_lora_adapters", "waiting_lora_adapters"},
}


@pytest.fixture(scope="module")
def held(tiny_model_path, tmp_path_factory):
    from engine.config.lora import LoraConfig

    root = tmp_path_factory.mktemp("gaie-lora")
    modules = tuple((name, str(make_adapter(tiny_model_path, root / name, SPECS[name]))) for name in ("all", "mlp"))
    engine = ControlledEngine(build_real_engine(tiny_model_path, max_num_seqs=1,
                                                lora=LoraConfig(max_loras=2, modules=modules)))  # fmt: skip
    yield engine
    engine.gate.set()


@pytest.fixture(scope="module")
def srv(held):
    settings = make_settings(enable_lora=True, max_loras=2, served_model_name=NAME, warmup=False, max_num_seqs=1)
    with run_server(settings, held) as s:
        yield s


def series(scrape: Scrape, name: str) -> list[dict[str, str]]:
    return [dict(labels) for (n, labels) in scrape.samples if n == name]


def test_the_inference_api_serves_completions_and_chat_by_model(srv):
    for model in (NAME, "all", "mlp"):
        c = httpx.post(f"{srv.url}/v1/completions", json={"model": model, "prompt": "Hi", "max_tokens": 2}, timeout=60)
        chat = httpx.post(f"{srv.url}/v1/chat/completions", json={"model": model, "max_tokens": 2,
                          "messages": [{"role": "user", "content": "Hi"}]}, timeout=60)  # fmt: skip
        assert c.status_code == chat.status_code == 200 and c.json()["model"] == chat.json()["model"] == model
    assert httpx.post(f"{srv.url}/v1/completions", json={"model": "nope", "prompt": "Hi"}).status_code == 404
    assert httpx.get(f"{srv.url}/health").status_code == 200


def test_every_metric_is_a_gauge_with_its_labels_and_values(srv, held):
    body = {"prompt_token_ids": [11, 250, 37, 900], "max_tokens": 6, "ignore_eos": True, "stream": False}
    try:
        with Background() as bg:
            t0 = time.time()
            filler = park_filler(srv, held, bg, {**body, "model": "all", "request_id": "gaie-filler"})
            queued = bg.post("queued", f"{srv.url}/generate", {**body, "model": "mlp"})
            wait_until(lambda: sum(srv.health()["waiting"].values()) == 1, what="one request in a lane")
            scrape = Scrape(srv.url)
            for name, labels in GAUGES.items():
                assert scrape.types[name] == "gauge", name
                assert [set(s) for s in series(scrape, name)] == [labels], name
            m = {"model_name": NAME}
            assert scrape.get("vllm:num_requests_waiting", **m) == 1
            assert scrape.get("vllm:num_requests_running", **m) == 1
            stats = srv.runtime.primary.worker.stats
            usage = scrape.get("vllm:kv_cache_usage_perc", **m)
            assert 0 < usage <= 1 and usage == pytest.approx(stats.kv_blocks_used / stats.kv_blocks_total)
            assert scrape.get("vllm:gpu_cache_usage_perc", **m) == usage
            [config] = series(scrape, "vllm:cache_config_info")
            assert (config["block_size"], config["num_gpu_blocks"]) == (str(stats.block_size), str(stats.kv_blocks_total))
            assert scrape.get("vllm:cache_config_info", **m) == 1
            [lora] = series(scrape, "vllm:lora_requests_info")
            assert (lora["max_lora"], lora["running_lora_adapters"], lora["waiting_lora_adapters"]) == ("2", "all", "mlp")
            stamp = scrape.get("vllm:lora_requests_info", **m)
            assert t0 <= stamp <= time.time()  # the time of the update: the EPP keeps the latest
            held.gate.set()
            assert filler.result(timeout=60).status_code == queued.result(timeout=60).status_code == 200
        srv.wait_idle()
        after = Scrape(srv.url)
        [lora] = series(after, "vllm:lora_requests_info")
        assert (lora["running_lora_adapters"], lora["waiting_lora_adapters"]) == ("", "")
        assert after.get("vllm:lora_requests_info", **m) >= stamp
        assert after.get("vllm:num_requests_waiting", **m) == after.get("vllm:num_requests_running", **m) == 0
    finally:
        held.gate.set()


def test_a_repeated_prompt_reuses_the_prefix_cache(srv):
    body = {"model": NAME, "messages": [{"role": "user", "content": "The same long question, word for word, " * 4}],
            "max_tokens": 2}  # fmt: skip
    first = httpx.post(f"{srv.url}/v1/chat/completions", json={**body, "cache": False}, timeout=60).json()
    again = httpx.post(f"{srv.url}/v1/chat/completions", json={**body, "cache": False}, timeout=60).json()
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= 16
