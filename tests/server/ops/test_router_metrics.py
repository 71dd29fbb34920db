"""What routers and autoscalers built for vLLM read (the Gateway API Inference Extension's model-server
protocol, llm-d, KEDA recipes): `vllm:num_requests_waiting` counts every request admitted and not
running, lanes included; running, KV usage, cache config and LoRA info carry `model_name`. And every
error answer is counted by reason and logged as one JSON line without prompt text."""

from __future__ import annotations

import json
import logging

import httpx

from ..helpers import Background, ControlledEngine, make_settings, park_filler, run_server, wait_until
from .test_metrics import Scrape

PROMPT = "def fibonacci(n):"
SECRET = "a-secret-prompt-text"


def test_vllm_waiting_gauge_counts_requests_held_in_the_lanes(real_engine):
    held = ControlledEngine(real_engine)
    settings = make_settings(warmup=False, max_num_seqs=1)
    body = {"prompt": PROMPT, "max_tokens": 4, "ignore_eos": True, "stream": False}
    try:
        with run_server(settings, held) as srv, Background() as bg:
            filler = park_filler(srv, held, bg, {**body, "max_tokens": 8, "request_id": "filler"})
            queued = [bg.post(f"q{i}", f"{srv.url}/generate", body) for i in range(4)]
            wait_until(lambda: sum(srv.health()["waiting"].values()) == 4, what="four requests in the lanes")
            scrape = Scrape(srv.url)
            name = {"model_name": "tiny-llama"}
            assert scrape.get("vllm:num_requests_waiting", **name) == 4
            assert scrape.get("tokenmill_requests_waiting") == 4
            assert scrape.get("tokenmill_num_requests_waiting") == 0  # ours: preempted ones only
            assert scrape.get("vllm:num_requests_running", **name) == 1
            stats = srv.runtime.primary.worker.stats
            assert scrape.get("vllm:kv_cache_usage_perc", **name) == stats.kv_cache_usage > 0
            assert scrape.get("vllm:cache_config_info", block_size=str(stats.block_size),
                              num_gpu_blocks=str(stats.kv_blocks_total), **name) == 1  # fmt: skip
            assert scrape.get("vllm:lora_requests_info", max_lora="0", running_lora_adapters="", **name) > 0
            held.gate.set()
            assert filler.result(timeout=30).status_code == 200
            assert [f.result(timeout=30).status_code for f in queued] == [200] * 4
            srv.wait_idle()
            assert Scrape(srv.url).get("vllm:num_requests_waiting", **name) == 0
    finally:
        held.gate.set()


def test_error_answers_are_counted_by_reason_and_logged_without_prompt_text(real_engine, caplog):
    caplog.set_level(logging.INFO, logger="tokenmill.requests")
    engine = ControlledEngine(real_engine)
    settings = make_settings(interactive_max_queued_requests=1, short_request_tokens=4096)
    with run_server(settings, engine) as srv, Background() as bg:
        before = Scrape(srv.url)
        bad = httpx.post(f"{srv.url}/v1/completions", json={"prompt": SECRET, "temperature": -1})
        assert bad.status_code == 400
        schema = httpx.post(f"{srv.url}/v1/chat/completions", json={"messages": [{"role": "user", "content": 5}]})
        assert schema.status_code == 400
        missing = httpx.post(f"{srv.url}/v1/completions", json={"prompt": SECRET, "model": "gpt-4"})
        assert missing.status_code == 404
        assert httpx.get(f"{srv.url}/no/such/path").status_code == 404
        tgi = httpx.post(f"{srv.url}/", json={"inputs": SECRET, "parameters": {"watermark": True}})
        assert tgi.status_code == 400
        # A prompt list is one admission unit: a lane already holding a request refuses it whole (429).
        park_filler(srv, engine, bg, {"prompt": "filler", "max_tokens": 4, "ignore_eos": True, "priority": "batch"})
        queued = bg.post("queued", f"{srv.url}/generate", {"prompt": "queued", "max_tokens": 1})
        wait_until(lambda: srv.health()["waiting"]["interactive"] == 1, what="the lane holds one request")
        listed = httpx.post(f"{srv.url}/v1/completions", json={"prompt": [SECRET] * 30, "max_tokens": 2})
        assert listed.status_code == 429
        engine.gate.set()
        assert queued.result(60).status_code == 200
        srv.wait_idle()
        after = Scrape(srv.url)

    def d(**labels: str) -> float:
        return after.sum("tokenmill_http_errors_total", **labels) - before.sum("tokenmill_http_errors_total", **labels)

    assert d(endpoint="/v1/completions", status="400", reason="invalid_request") == 1
    assert d(endpoint="/v1/chat/completions", status="400", reason="invalid_request") == 1
    assert d(endpoint="/v1/completions", status="404", reason="model_not_found") == 1
    assert d(endpoint="unmatched", status="404", reason="not_found") == 1
    assert d(endpoint="/", status="400", reason="invalid_request") == 1
    assert d(endpoint="/v1/completions", status="429", reason="overloaded") == 1
    lines = [json.loads(r.getMessage()) for r in caplog.records if r.name == "tokenmill.requests"]
    errors = [line for line in lines if line["event"] == "http_error"]
    assert [(e["status"], e["reason"], e["param"]) for e in errors] == [
        (400, "invalid_request", "temperature"), (400, "invalid_request", "messages.0.content"),
        (404, "model_not_found", "model"), (404, "not_found", None), (400, "invalid_request", "parameters.watermark"),
    ]  # the 429 is logged once, by its lane's rejection line  # fmt: skip
    assert [line["status"] for line in lines if line["event"] == "request"].count("rejected") >= 1
    assert all(SECRET not in r.getMessage() for r in caplog.records)
