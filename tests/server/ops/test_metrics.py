"""/metrics tells the truth: every series is there with its type, one request moves each series by
exactly what it did, timeouts, client aborts and 429s are counted and timed too, step time is split by
phase, and the cumulative engine counters are real counters."""

from __future__ import annotations

import asyncio
import json
import logging

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine.api import Deadline, EngineStats
from engine.api.sampling_params import SamplingParams
from server.config.lanes import Lane
from server.ops.memory import DeviceMemory, memory_probe
from server.ops.metrics import (
    REASONS,
    STATUSES,
    ModelInfo,
    ServerMetrics,
    Snapshot,
    VersionMetrics,
    VersionSnapshot,
)
from server.serving.accounting import request_status
from server.serving.ticket import Collector, ServerError, Ticket

from ..helpers import Background, ControlledEngine, make_settings, park_filler, run_server, wait_until

PROMPT = "def fibonacci(n):"

# vLLM's request and engine series (vLLM v1's names and types; docs/SERVER.md's metric table).
VLLM_FAMILIES = {
    "vllm:time_to_first_token_seconds": "histogram",
    "vllm:e2e_request_latency_seconds": "histogram",
    "vllm:inter_token_latency_seconds": "histogram",
    "vllm:time_per_output_token_seconds": "histogram",
    "vllm:request_time_per_output_token_seconds": "histogram",
    "vllm:request_queue_time_seconds": "histogram",
    "vllm:request_prefill_time_seconds": "histogram",
    "vllm:request_decode_time_seconds": "histogram",
    "vllm:request_inference_time_seconds": "histogram",
    "vllm:request_prompt_tokens": "histogram",
    "vllm:request_generation_tokens": "histogram",
    "vllm:request_params_max_tokens": "histogram",
    "vllm:request_params_n": "histogram",
    "vllm:iteration_tokens_total": "histogram",
    "vllm:prompt_tokens": "counter",
    "vllm:generation_tokens": "counter",
    "vllm:request_success": "counter",
    "vllm:num_preemptions": "counter",
    "vllm:prefix_cache_queries": "counter",
    "vllm:prefix_cache_hits": "counter",
}
# vLLM's series and the tokenmill_* one filled by the same observations (counts and sums agree).
VLLM_TWINS = {
    "vllm:time_to_first_token_seconds": "tokenmill_time_to_first_token_seconds",
    "vllm:e2e_request_latency_seconds": "tokenmill_e2e_request_latency_seconds",
    "vllm:inter_token_latency_seconds": "tokenmill_inter_token_latency_seconds",
    "vllm:time_per_output_token_seconds": "tokenmill_inter_token_latency_seconds",
    "vllm:request_queue_time_seconds": "tokenmill_request_queue_time_seconds",
    "vllm:request_prefill_time_seconds": "tokenmill_request_prefill_time_seconds",
    "vllm:request_decode_time_seconds": "tokenmill_request_decode_time_seconds",
    "vllm:request_prompt_tokens": "tokenmill_request_prompt_tokens",
    "vllm:request_generation_tokens": "tokenmill_request_generation_tokens",
    "vllm:iteration_tokens_total": "tokenmill_iteration_tokens",
}
VLLM_COUNTER_TWINS = {
    "vllm:prompt_tokens_total": "tokenmill_prompt_tokens_total",
    "vllm:generation_tokens_total": "tokenmill_generation_tokens_total",
    "vllm:num_preemptions_total": "tokenmill_num_preemptions_total",
    "vllm:prefix_cache_queries_total": "tokenmill_prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total": "tokenmill_prefix_cache_hits_total",
}

# Every family the server exposes and its type (what promtool and dashboards rely on).
FAMILIES = {
    "tokenmill_requests": "counter",
    "tokenmill_request_rejections": "counter",
    "tokenmill_request_success": "counter",
    "tokenmill_prompt_tokens": "counter",
    "tokenmill_generation_tokens": "counter",
    "tokenmill_num_preemptions": "counter",
    "tokenmill_preemptions": "counter",
    "tokenmill_prefix_cache_queries": "counter",
    "tokenmill_prefix_cache_hits": "counter",
    "tokenmill_engine_steps": "counter",
    "tokenmill_engine_thread_switches": "counter",
    "tokenmill_engine_threads": "gauge",
    "tokenmill_time_to_first_token_seconds": "histogram",
    "tokenmill_inter_token_latency_seconds": "histogram",
    "tokenmill_e2e_request_latency_seconds": "histogram",
    "tokenmill_request_queue_time_seconds": "histogram",
    "tokenmill_request_prefill_time_seconds": "histogram",
    "tokenmill_request_decode_time_seconds": "histogram",
    "tokenmill_request_prompt_tokens": "histogram",
    "tokenmill_request_generation_tokens": "histogram",
    "tokenmill_engine_step_duration_seconds": "histogram",
    "tokenmill_iteration_tokens": "histogram",
    "tokenmill_queue_depth": "gauge",
    "tokenmill_queue_tokens": "gauge",
    "tokenmill_num_requests_running": "gauge",
    "tokenmill_num_requests_waiting": "gauge",
    "tokenmill_kv_blocks_used": "gauge",
    "tokenmill_kv_blocks_capacity": "gauge",
    "tokenmill_kv_cache_usage_ratio": "gauge",
    "tokenmill_kv_cache_usage_perc": "gauge",
    "tokenmill_device_memory_used_bytes": "gauge",
    "tokenmill_device_memory_total_bytes": "gauge",
    "tokenmill_seconds_since_last_step": "gauge",
    "tokenmill_worker_alive": "gauge",
    "tokenmill_model_info": "gauge",
    "tokenmill_model_version": "gauge",
    "tokenmill_canary_weight": "gauge",
    "tokenmill_response_cache_hits": "counter",
    "tokenmill_response_cache_misses": "counter",
    "tokenmill_response_cache_evictions": "counter",
    "tokenmill_response_cache_entries": "gauge",
    "tokenmill_response_cache_bytes": "gauge",
    "tokenmill_feedback_ratings": "counter",
    "tokenmill_model_version_events": "counter",
    "process_resident_memory_bytes": "gauge",
    "tokenmill_http_connections": "gauge",
    "tokenmill_http_connections_closed": "counter",
    "tokenmill_http_accept_errors": "counter",
    "tokenmill_http_errors": "counter",
    "tokenmill_requests_waiting": "gauge",
    "tokenmill_tenant_requests": "counter",
    "tokenmill_tenant_prompt_tokens": "counter",
    "tokenmill_tenant_generation_tokens": "counter",
    "tokenmill_tenant_rejections": "counter",
    "tokenmill_tenant_queue_time_seconds": "histogram",
    "tokenmill_cache_config_info": "gauge",
    "vllm:num_requests_waiting": "gauge",
    "vllm:num_requests_running": "gauge",
    "vllm:kv_cache_usage_perc": "gauge",
    "vllm:gpu_cache_usage_perc": "gauge",
    "vllm:cache_config_info": "gauge",
    "vllm:lora_requests_info": "gauge",
    "vllm:spec_decode_num_drafts": "counter",
    "vllm:spec_decode_num_draft_tokens": "counter",
    "vllm:spec_decode_num_accepted_tokens": "counter",
    "vllm:spec_decode_num_accepted_tokens_per_pos": "counter",
    **VLLM_FAMILIES,
}
# Process-wide series: the only ones without `model` and `version` labels.
# connections are the server's, and tenants span every model (their one label: the tenant's name)
PROCESS_WIDE = ("process_", "python_", "tokenmill_device_memory_", "tokenmill_http_", "tokenmill_tenant_")
ROUTER = "vllm:"  # the model-server protocol's series: `model_name` instead (tests/server/ops/test_router_metrics.py)


class Scrape:
    """One /metrics answer: sample values by (name, sorted labels), family types by name."""

    def __init__(self, url: str) -> None:
        r = httpx.get(f"{url}/metrics", timeout=10)
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
        self.text = r.text
        self.types: dict[str, str] = {}
        self.samples: dict[tuple[str, tuple], float] = {}
        for fam in text_string_to_metric_families(r.text):
            self.types[fam.name] = fam.type
            for s in fam.samples:
                self.samples[(s.name, tuple(sorted(s.labels.items())))] = s.value

    def get(self, name: str, **labels: str) -> float:
        """The one series of `name` whose labels include `labels`."""
        want = set(labels.items())
        found = [v for (n, lab), v in self.samples.items() if n == name and want <= set(lab)]
        assert len(found) == 1, (name, labels, found)
        return found[0]

    def sum(self, name: str, **labels: str) -> float:
        """Sum over every series of `name` whose labels include `labels`."""
        want = set(labels.items())
        return sum(v for (n, lab), v in self.samples.items() if n == name and want <= set(lab))


def delta(before: Scrape, after: Scrape, name: str, **labels: str) -> float:
    return after.sum(name, **labels) - before.sum(name, **labels)


@pytest.fixture(scope="module")
def srv(real_engine):
    with run_server(make_settings(), real_engine) as s:
        yield s


def generate(url: str, **body) -> httpx.Response:
    return httpx.post(f"{url}/generate", json={"prompt": PROMPT, "stream": False, **body}, timeout=60)


# -- a real server -------------------------------------------------------------------------------------
def test_every_family_is_exposed_with_its_type(srv):
    scrape = Scrape(srv.url)
    assert {name: scrape.types.get(name) for name in FAMILIES} == FAMILIES
    info = next(dict(lab) for (n, lab) in scrape.samples if n == "tokenmill_model_info")
    assert info["model"] == "tiny-llama" and info["dtype"] == "float32" and info["device"] == "cpu"
    assert info["version"] == srv.runtime.primary.version and info["server_version"]
    assert int(info["max_model_len"]) == srv.runtime.max_model_len
    mv = (("model", "tiny-llama"), ("version", info["version"]))
    assert scrape.get("tokenmill_model_version", state="ready", role="promoted") == 1
    # Every series but the process-wide ones names the model and its version.
    for (name, labels) in scrape.samples:
        if name.startswith(ROUTER):
            assert dict(labels)["model_name"] == "tiny-llama", (name, labels)
        elif not name.startswith(PROCESS_WIDE):
            assert set(mv) <= set(labels), (name, labels)
    # Every outcome series exists from the start, so rate() is 0 rather than empty.
    for lane in ("interactive", "standard", "batch"):
        for status in STATUSES:
            for reason in REASONS[status]:
                key = tuple(sorted((*mv, ("lane", lane), ("reason", reason), ("status", status))))
                assert ("tokenmill_requests_total", key) in scrape.samples
    used, total = scrape.get("tokenmill_device_memory_used_bytes", device="cpu"), \
        scrape.get("tokenmill_device_memory_total_bytes", device="cpu")  # fmt: skip
    assert 0 < used < total


def test_one_request_moves_each_series_by_what_it_did(srv):
    srv.wait_idle()
    before = Scrape(srv.url)
    r = generate(srv.url, max_tokens=10, ignore_eos=True, priority="interactive")
    assert r.status_code == 200
    prompt_tokens = r.json()["usage"]["prompt_tokens"]
    srv.wait_idle()
    after = Scrape(srv.url)
    d = lambda name, **labels: delta(before, after, name, **labels)  # noqa: E731
    assert d("tokenmill_requests_total", lane="interactive", status="ok", reason="length") == 1
    assert d("tokenmill_requests_total") == 1
    assert d("tokenmill_request_success_total", finished_reason="length") == 1
    assert d("tokenmill_generation_tokens_total") == 10
    for name in ("tokenmill_time_to_first_token_seconds", "tokenmill_request_queue_time_seconds",
                 "tokenmill_request_prefill_time_seconds", "tokenmill_request_decode_time_seconds"):
        assert d(f"{name}_count", lane="interactive") == 1, name
    assert d("tokenmill_e2e_request_latency_seconds_count", lane="interactive", status="ok") == 1
    assert d("tokenmill_inter_token_latency_seconds_count", lane="interactive") == 9  # 10 tokens, 9 gaps
    assert d("tokenmill_request_prompt_tokens_sum", lane="interactive") == prompt_tokens
    assert d("tokenmill_request_generation_tokens_sum", lane="interactive") == 10
    # One step histogram observation per engine step, split by phase: one prefill, then 9 decodes.
    steps = d("tokenmill_engine_steps_total")
    assert steps == 10 == d("tokenmill_iteration_tokens_count")
    assert d("tokenmill_engine_step_duration_seconds_count") == steps
    assert d("tokenmill_engine_step_duration_seconds_count", phase="prefill") == 1
    assert d("tokenmill_engine_step_duration_seconds_count", phase="decode") == 9
    assert d("tokenmill_iteration_tokens_sum") == d("tokenmill_prompt_tokens_total") + 9
    assert d("tokenmill_prefix_cache_queries_total") >= d("tokenmill_prefix_cache_hits_total") >= 0
    assert after.get("tokenmill_seconds_since_last_step") < 5


def test_vllm_series_agree_with_ours_after_traffic(srv):
    srv.wait_idle()
    before = Scrape(srv.url)
    bodies = [{"max_tokens": 6, "ignore_eos": True}, {"max_tokens": 3, "ignore_eos": True, "priority": "batch"},
              {"max_tokens": 40, "stop": ["\n"]}]  # fmt: skip
    for body in bodies:
        assert generate(srv.url, **body).status_code == 200
    r = httpx.post(f"{srv.url}/v1/completions", json={"model": "tiny-llama", "prompt": PROMPT, "n": 2,
                                                      "max_tokens": 5, "ignore_eos": True}, timeout=60)  # fmt: skip
    assert r.status_code == 200 and len(r.json()["choices"]) == 2
    srv.wait_idle()
    after = Scrape(srv.url)
    assert {name: after.types.get(name) for name in VLLM_FAMILIES} == VLLM_FAMILIES
    vllm = {"model_name": "tiny-llama", "engine": "0"}
    for name, ours in VLLM_TWINS.items():  # same observations: same count and sum, any lane and status
        for part in ("_count", "_sum"):
            assert after.get(f"{name}{part}", **vllm) == pytest.approx(after.sum(f"{ours}{part}"), abs=1e-9), name
        assert after.get(f"{name}_bucket", le="+Inf", **vllm) == after.get(f"{name}_count", **vllm)
    assert delta(before, after, "vllm:time_to_first_token_seconds_count") == 5  # 3 + 2 choices
    assert delta(before, after, "vllm:inter_token_latency_seconds_count") >= 5 + 2 + 8
    for name, ours in VLLM_COUNTER_TWINS.items():
        assert after.get(name, **vllm) == after.get(ours), name
    assert delta(before, after, "vllm:generation_tokens_total") >= 6 + 3 + 10
    for reason in ("stop", "length"):
        assert after.get("vllm:request_success_total", finished_reason=reason, **vllm) == \
            after.get("tokenmill_request_success_total", finished_reason=reason)  # fmt: skip
    # Started and ended: inference time is prefill + decode, request by request.
    assert after.get("vllm:request_inference_time_seconds_count", **vllm) == \
        after.get("vllm:request_prefill_time_seconds_count", **vllm)  # fmt: skip
    assert after.get("vllm:request_inference_time_seconds_sum", **vllm) == pytest.approx(
        after.sum("tokenmill_request_prefill_time_seconds_sum") + after.sum("tokenmill_request_decode_time_seconds_sum"),
        abs=1e-3)  # fmt: skip
    # Per request, the mean gap: the 4 choices that ran to max_tokens at least (a stop may end the other early).
    assert delta(before, after, "vllm:request_time_per_output_token_seconds_count") >= 4
    assert after.get("vllm:request_time_per_output_token_seconds_count", **vllm) <= \
        after.get("vllm:request_decode_time_seconds_count", **vllm)  # fmt: skip
    # One observation per client request (the n=2 request once), of what it asked.
    assert delta(before, after, "vllm:request_params_max_tokens_count") == 4
    assert delta(before, after, "vllm:request_params_max_tokens_sum") == 6 + 3 + 40 + 5
    assert delta(before, after, "vllm:request_params_n_sum") == 1 + 1 + 1 + 2
    # vLLM's buckets: the TTFT list starts at 1 ms, token counts go 1, 2, 5, 10, ...
    les = {dict(lab)["le"] for (n, lab) in after.samples if n == "vllm:time_to_first_token_seconds_bucket"}
    assert {"0.001", "0.005", "2560.0", "+Inf"} <= les
    les = {dict(lab)["le"] for (n, lab) in after.samples if n == "vllm:request_prompt_tokens_bucket"}
    assert {"1.0", "2.0", "5.0", "10.0", "20.0", "50.0"} <= les and "4.0" not in les


def test_engine_counters_never_go_down_and_match_the_engine(srv, real_engine):
    srv.wait_idle()
    first = Scrape(srv.url)
    stats = real_engine.stats()
    assert first.get("tokenmill_generation_tokens_total") == stats.generation_tokens
    assert first.get("tokenmill_prompt_tokens_total") == stats.prompt_tokens
    assert first.get("tokenmill_engine_steps_total") == stats.steps
    assert first.get("tokenmill_engine_thread_switches_total") == stats.cpu_thread_switches
    assert first.get("tokenmill_engine_threads") == stats.cpu_threads
    assert first.get("tokenmill_num_preemptions_total") == stats.preemptions
    # The same prompt twice: the second finds its full blocks in the prefix cache.
    long_prompt = PROMPT * 12
    for _ in range(2):
        assert generate(srv.url, prompt=long_prompt, max_tokens=2).status_code == 200
    srv.wait_idle()
    second = Scrape(srv.url)
    assert delta(first, second, "tokenmill_prefix_cache_hits_total") > 0
    for name in ("tokenmill_generation_tokens_total", "tokenmill_prompt_tokens_total", "tokenmill_engine_steps_total",
                 "tokenmill_prefix_cache_queries_total", "tokenmill_prefix_cache_hits_total",
                 "tokenmill_num_preemptions_total"):
        assert second.get(name) >= first.get(name), name


def test_timeouts_and_client_aborts_are_counted_and_timed(engine_with):
    slow = ControlledEngine(engine_with(max_num_batched_tokens=16), step_delay_s=0.02)
    with run_server(make_settings(), slow) as srv:
        before = Scrape(srv.url)
        long = {"max_tokens": 900, "ignore_eos": True}
        assert generate(srv.url, **long, timeout_s=0.3).json()["finish_reason"] == "timeout"
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{srv.url}/generate", json={"prompt": PROMPT, "stream": False, **long}, timeout=0.4)
        srv.wait_idle(timeout=10)
        slow.step_delay_s = 0.1  # a 100-token prompt starts at once and is prefilled in 7 steps of 16 tokens
        prompt = {"prompt": None, "prompt_token_ids": [5 + i for i in range(100)]}
        r = generate(srv.url, **prompt, max_tokens=4, first_token_timeout_s=0.25)
        assert r.json()["finish_reason"] == "timeout"
        srv.wait_idle(timeout=10)
        after = Scrape(srv.url)
    d = lambda name, **labels: delta(before, after, name, **labels)  # noqa: E731
    assert d("tokenmill_requests_total", lane="standard", status="timeout", reason="total") == 1
    assert d("tokenmill_requests_total", lane="standard", status="cancelled", reason="client") == 1
    assert d("tokenmill_requests_total", lane="interactive", status="timeout", reason="first_token") == 1
    assert d("tokenmill_e2e_request_latency_seconds_count", lane="standard", status="timeout") == 1
    assert d("tokenmill_e2e_request_latency_seconds_sum", lane="standard", status="timeout") >= 0.3
    assert d("tokenmill_e2e_request_latency_seconds_count", lane="standard", status="cancelled") == 1
    assert d("tokenmill_e2e_request_latency_seconds_count", lane="interactive", status="timeout") == 1
    assert d("tokenmill_request_generation_tokens_count", lane="standard") == 2  # partial outputs too
    assert d("tokenmill_request_success_total") == 0


def test_429s_by_bound_and_queue_timeouts_observe_their_wait(real_engine, caplog):
    caplog.set_level(logging.INFO, logger="tokenmill.requests")
    held = ControlledEngine(real_engine)
    settings = make_settings(interactive_max_queued_requests=2, interactive_max_queued_tokens=40,
                             interactive_queue_timeout_s=0.3, warmup=False)  # fmt: skip
    small = {"prompt": PROMPT, "max_tokens": 4, "ignore_eos": True, "stream": False, "priority": "interactive"}
    try:
        with run_server(settings, held) as srv, Background() as bg:
            before = Scrape(srv.url)
            filler = park_filler(srv, held, bg, {**small, "priority": "batch", "request_id": "filler"})
            queued = [bg.post("q1", f"{srv.url}/generate", small)]
            wait_until(lambda: srv.health()["waiting"]["interactive"] == 1, what="one queued")
            too_big = httpx.post(f"{srv.url}/generate", json={**small, "max_tokens": 60}, timeout=10)
            queued.append(bg.post("q2", f"{srv.url}/generate", small))
            wait_until(lambda: srv.health()["waiting"]["interactive"] == 2, what="two queued")
            too_many = httpx.post(f"{srv.url}/generate", json=small, timeout=10)
            assert too_big.status_code == 429 and too_many.status_code == 429
            asyncio.run(asyncio.sleep(0.4))  # past the queue timeout while the worker is held
            held.gate.set()
            assert [f.result(timeout=30).status_code for f in queued] == [503, 503]
            assert filler.result(timeout=30).status_code == 200
            srv.wait_idle()
            after = Scrape(srv.url)
    finally:
        held.gate.set()
    d = lambda name, **labels: delta(before, after, name, **labels)  # noqa: E731
    assert d("tokenmill_request_rejections_total", lane="interactive", reason="queue_tokens") == 1
    assert d("tokenmill_request_rejections_total", lane="interactive", reason="queue_requests") == 1
    assert d("tokenmill_requests_total", lane="interactive", status="rejected") == 2
    assert d("tokenmill_requests_total", lane="interactive", status="timeout", reason="queue") == 2
    # Requests that never left the lane still count in the queue-time histogram, with their full wait.
    assert d("tokenmill_request_queue_time_seconds_count", lane="interactive") == 2
    assert d("tokenmill_request_queue_time_seconds_sum", lane="interactive") >= 0.6
    assert d("tokenmill_e2e_request_latency_seconds_count", lane="interactive", status="timeout") == 2
    lines = [json.loads(rec.getMessage()) for rec in caplog.records if rec.name == "tokenmill.requests"]
    assert sorted(line["reason"] for line in lines if line["status"] == "rejected") == ["queue_requests",
                                                                                        "queue_tokens"]


# -- units ---------------------------------------------------------------------------------------------
class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _metrics(clock=None, memory: DeviceMemory | None = None) -> tuple[ServerMetrics, VersionMetrics]:
    clock = clock or _Clock()
    info = ModelInfo("m", "float32", "cpu", "v1", 128)
    snap = Snapshot(EngineStats(kv_blocks_total=8), {lane: (0, 0) for lane in Lane}, True, memory)
    metrics = ServerMetrics("0.1.0", lambda: [VersionSnapshot(info, "ready", "promoted", 0, snap,
                                                              version.seconds_since_last_step())], clock=clock)
    version = metrics.version("m", "v1")
    return metrics, version


MV = (("model", "m"), ("version", "v1"))


def _samples(metrics: ServerMetrics) -> dict[tuple[str, tuple], float]:
    """Samples by (name, labels other than model and version)."""
    out = {}
    for fam in text_string_to_metric_families(metrics.render().decode()):
        for s in fam.samples:
            labels = set(s.labels.items())
            if set(MV) <= labels:
                out[(s.name, tuple(sorted(labels - set(MV))))] = s.value
            elif not set(s.labels) & {"model", "version"}:
                out[(s.name, tuple(sorted(labels)))] = s.value
    return out


def test_step_phase_and_seconds_since_last_step():
    clock = _Clock()
    m, v = _metrics(clock)
    clock.now += 7
    assert v.seconds_since_last_step() == 7  # counted from start until the first step
    for prefill, decode in ((30, 0), (0, 4), (20, 3), (0, 2)):
        v.observe_step(EngineStats(last_step_prefill_tokens=prefill, last_step_decode_tokens=decode,
                                   last_step_tokens=prefill + decode, last_step_time_s=0.0002))  # fmt: skip
    assert v.seconds_since_last_step() == 0
    clock.now += 31.5
    s = _samples(m)
    counts = {p: s[("tokenmill_engine_step_duration_seconds_count", (("phase", p),))] for p in ("prefill", "decode", "mixed")}
    assert counts == {"prefill": 1, "decode": 2, "mixed": 1}
    # A 0.2 ms CPU step lands in its own bucket, not in a catch-all first one.
    assert s[("tokenmill_engine_step_duration_seconds_bucket", (("le", "0.0001"), ("phase", "decode")))] == 0
    assert s[("tokenmill_engine_step_duration_seconds_bucket", (("le", "0.00025"), ("phase", "decode")))] == 2
    assert s[("tokenmill_iteration_tokens_sum", ())] == 59
    assert s[("tokenmill_seconds_since_last_step", ())] == 31.5


def test_memory_probe_uses_the_engine_then_falls_back_to_the_process():
    class Gpu:
        device_name = "cuda:0"

        def device_memory(self):  # engine.Engine.device_memory's shape
            return {"used_bytes": 3 << 30, "total_bytes": 80 << 30, "allocated_bytes": 2 << 30, "kv_cache_bytes": 1}

    class Cpu:
        device_name = "cpu"

        def device_memory(self):
            return None

    class Broken(Gpu):
        def device_memory(self):
            raise RuntimeError("driver gone")

    assert memory_probe(Gpu())() == DeviceMemory("cuda:0", 3 << 30, 80 << 30)
    for engine in (Cpu(), Broken(), object()):
        mem = memory_probe(engine)()
        assert mem is not None and mem.device == "cpu" and 0 < mem.used_bytes < mem.total_bytes
    s = _samples(_metrics(memory=DeviceMemory("cuda:0", 3, 4))[0])
    assert s[("tokenmill_device_memory_used_bytes", (("device", "cuda:0"),))] == 3
    assert s[("tokenmill_device_memory_total_bytes", (("device", "cuda:0"),))] == 4


def _ticket(**fields) -> Ticket:
    loop = asyncio.new_event_loop()
    try:
        t = Ticket("r", [1, 2, 3], SamplingParams(max_tokens=4), Lane.STANDARD, Collector(loop))
    finally:
        loop.close()
    t.arrival = 10.0
    for name, value in fields.items():
        setattr(t, name, value)
    return t


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({"finish_reason": "stop"}, ("ok", "stop")),
        ({"finish_reason": "length"}, ("ok", "length")),
        ({"finish_reason": "abort"}, ("cancelled", "client")),
        ({"finish_reason": "abort", "error": ServerError("shutdown", "bye", 503)}, ("cancelled", "shutdown")),
        ({"finish_reason": "timeout", "error": ServerError("queue_timeout", "late", 503)}, ("timeout", "queue")),
        ({"finish_reason": "timeout", "deadline_hit": Deadline.FIRST_TOKEN}, ("timeout", "first_token")),
        ({"finish_reason": "timeout", "deadline_hit": Deadline.TOTAL}, ("timeout", "total")),
        ({"finish_reason": "error", "error": ServerError("engine_error", "boom", 500)}, ("error", "engine_error")),
        ({"finish_reason": "abort", "error": ServerError("worker_died", "dead", 503)}, ("error", "worker_died")),
        ({"finish_reason": "error", "error": ServerError("invalid_request", "bad", 400)},
         ("rejected", "invalid_request")),
    ],
)
def test_request_status_labels(fields, expected):
    status, reason = request_status(_ticket(**fields))
    assert (status, reason) == expected
    assert status in STATUSES and reason in REASONS[status]


def test_vllm_finished_reason_maps_every_outcome():
    from server.ops.metrics import VLLM_REASONS, vllm_finished_reason

    assert vllm_finished_reason("ok", "stop") == "stop" and vllm_finished_reason("ok", "length") == "length"
    assert vllm_finished_reason("timeout", "queue_timeout") == "abort"
    assert vllm_finished_reason("cancelled", "client_disconnected") == "abort"
    # a request the engine ended with a client error (a grammar dead end answered 400) is no KeyError
    assert vllm_finished_reason("invalid_request", "invalid_request") == "error"
    assert all(vllm_finished_reason(s, r) in VLLM_REASONS for s in ("ok", "error", "x") for r in ("stop", "y"))
