"""One short `load` run against a real `python -m server` process on loopback (tiny-llama): counts,
token accounting on both endpoints, and 429s counted when the lanes are tiny. No timing assertions."""

from __future__ import annotations

import asyncio

import pytest

from bench.lib.client import LoadConfig, run_load
from bench.lib.load_requests import assign_lanes, synthetic_requests
from bench.lib.server import free_port, server_process
from bench.lib.stats import summarize


@pytest.fixture(scope="module")
def server(build_model, tmp_path_factory):
    model = build_model("tiny-llama")
    log = tmp_path_factory.mktemp("load") / "server.log"
    # two sequences in the engine and two requests admitted but not yet scheduled in the batch lane: a
    # burst of 6 batch requests must be refused in part; the other lanes keep their (large) default bounds
    extra = ["--batch-max-queued-requests", "2"]
    with server_process(model, free_port(), 2, "auto", extra, log, ready_timeout_s=120) as url:
        yield url, model


@pytest.mark.parametrize("endpoint", ["generate", "completions"])
def test_load_counts_every_request_and_token(server, endpoint):
    url, model = server
    reqs = synthetic_requests(str(model), 6, prompt_len=16, output_len=8, seed=0)
    cfg = LoadConfig(url, endpoint, concurrency=2, model_name="tiny-llama")
    done = []
    records, duration = asyncio.run(run_load(reqs, cfg, on_done=done.append))
    assert len(done) == 6 and duration > 0
    assert [r.status for r in records] == ["ok"] * 6, [r.error for r in records]
    for r in records:
        assert r.num_output_tokens == 8 and r.prompt_tokens == 16
        assert len(r.token_times) >= 1 and r.ttft <= r.e2e
    s = summarize(records, duration)
    assert s["counts"] == {"ok": 6, "rejected": 0, "timeout": 0, "error": 0}
    assert s["output_tokens"] == 48 and s["prompt_tokens"] == 96
    assert s["ttft_s"] and s["tpot_s"] and s["e2e_s"]


def test_load_counts_429s_past_the_lane_bound(server):
    url, model = server
    reqs = assign_lanes(synthetic_requests(str(model), 12, prompt_len=16, output_len=64, seed=1), {"batch": 1.0}, 0)
    records, duration = asyncio.run(run_load(reqs, LoadConfig(url, "generate", concurrency=6)))
    s = summarize(records, duration)
    assert s["requests"] == 12
    assert s["counts"]["rejected"] >= 1 and s["counts"]["ok"] >= 2
    assert s["counts"]["ok"] + s["counts"]["rejected"] == 12, [r.error for r in records if r.status == "error"]
    assert all("429" in r.error and r.lane == "batch" for r in records if r.status == "rejected")
    assert s["output_tokens"] == 64 * s["counts"]["ok"]
