"""`bench priority` against a real `python -m server` process (tiny-llama, 2 seats): the phase runner
sends closed-loop batch streams and Poisson interactive arrivals; the report counts lanes, the
server's queue waits and preemptions from /metrics. No timing assertions."""

from __future__ import annotations

import asyncio

import pytest

from bench.lib.client import LoadConfig, LoadRequest
from bench.lib.server import free_port, server_process
from bench.served.priority import _verdict, format_report, metric_sum, phase_report, run_phase, scrape


@pytest.fixture(scope="module")
def server(build_model, tmp_path_factory):
    model = build_model("tiny-llama")
    log = tmp_path_factory.mktemp("priority") / "server.log"
    with server_process(model, free_port(), 2, "auto", [], log, ready_timeout_s=120) as url:
        yield url


def test_metric_sum_reads_labelled_samples():
    text = ('# TYPE tokenmill_preemptions_total counter\n'
            'tokenmill_preemptions_total{cause="slots",lane="batch"} 3.0\n'
            'tokenmill_preemptions_total{cause="kv",lane="batch"} 1.0\n'
            'tokenmill_preemptions_total{cause="slots",lane="standard"} 2.0\n'
            'tokenmill_preemptions_totalx{cause="slots"} 9.0\n')  # fmt: skip
    assert metric_sum(text, "tokenmill_preemptions_total") == 6.0
    assert metric_sum(text, "tokenmill_preemptions_total", cause="slots") == 5.0


def test_a_mixed_phase_reports_lanes_queue_waits_and_preemptions(server):
    batch = [LoadRequest(tuple(range(20 + i, 36 + i)), 40, "batch") for i in range(8)]
    inter = [LoadRequest(tuple(range(300 + i, 308 + i)), 3, "interactive") for i in range(8)]
    cfg = LoadConfig(server, concurrency=None, request_rate=1.0, timeout_s=120)
    before = scrape(server)
    records, duration = asyncio.run(run_phase(cfg, batch, inter, streams=4, rate=4.0, duration_s=2.0, seed=0))
    report = phase_report(records, duration, before, scrape(server))
    assert report["ok"] == report["requests"] and report["not_ok"] == []
    lanes = report["lanes"]
    assert set(lanes) == {"batch", "interactive"} and lanes["interactive"]["ok"] >= 1
    assert lanes["batch"]["queue_s"] is not None and lanes["interactive"]["ttft_s"] is not None
    # Four batch streams on two seats: interactive arrivals take seats from batch requests.
    assert report["preemptions"]["slots"] >= 1 and report["preemptions_per_1k_tokens"] > 0
    assert report["output_tokens"] == sum(r.num_output_tokens for r in records)
    verdict = _verdict(0.01, {"mixed": report, "one_lane": report})
    assert verdict["throughput_ratio"] == 1.0 and verdict["throughput_target_met"]
    assert "interactive" in format_report({**verdict, "idle_ttft_s": 0.01, "phases": {"mixed": report}})


def test_long_prompt_reports_both_first_tokens(server, tmp_path):
    import json

    from bench.cli import main

    out = tmp_path / "long.json"
    assert main(["long-prompt", "--base-url", server, "--prompt-tokens", "300", "--delay", "0.05", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["long_status"] == 200 and res["long_prompt_tokens"] >= 300
    assert res["idle_ttft_s"] > 0 and res["ttft_behind_long_s"] > 0 and res["long_s"] > 0
