"""bench structured: its summary on made-up rounds, and one short run against a real `python -m server`
process (tiny-llama: a random model, so the JSON schema is what shapes its output). No timing assertions."""

from __future__ import annotations

import argparse
import json

from bench.lib.server import free_port, server_process
from bench.served.structured import format_report, long_schema, run, summarize


def _args(**over) -> argparse.Namespace:
    base = dict(concurrency=2, requests=2, output_len=8, rounds=1, ttft_requests=1, timeout=120.0, json=None)
    return argparse.Namespace(**{**base, **over})


def test_summary_takes_medians_and_the_cost_of_the_constrained_arm():
    rounds = {"plain": [{"tokens_per_s": t, "min_tokens": 8} for t in (100.0, 90.0, 110.0)],
              "json": [{"tokens_per_s": t, "min_tokens": 8} for t in (95.0, 80.0, 85.0)]}  # fmt: skip
    ttft = {"plain": [0.1, 0.3, 0.2], "cached": [0.25, 0.2, 0.3], "cold": [0.5, 0.4, 0.6]}
    r = summarize({"model": "m", "rounds": rounds, "ttft_s": ttft}, _args(output_len=8))
    assert r["median_tokens_per_s"] == {"plain": 100.0, "json": 85.0}
    assert r["throughput_cost"] == 0.15 and not r["throughput_target_met"]
    assert r["paired_cost_median"] == round(1 - 80 / 90, 4)  # the pairs cost 5%, 11.1% and 22.7%
    assert r["every_request_full_length"]
    assert r["ttft_added_by_compile_s"] == 0.25 and r["ttft_added_by_masks_s"] == 0.05
    assert "15.0% (MISSED" in format_report(r)
    rounds["json"][0]["min_tokens"] = 7  # a request that ended early: the arms are not comparable
    assert not summarize({"model": "m", "rounds": rounds, "ttft_s": ttft}, _args())["every_request_full_length"]


def test_a_tagged_schema_is_new_to_the_compile_cache():
    assert long_schema("a") != long_schema("b") and long_schema() == long_schema()
    assert long_schema()["minItems"] == 16


def test_one_short_run_against_a_real_server(build_model, tmp_path):
    model = build_model("tiny-llama")
    with server_process(model, free_port(), 4, "auto", [], tmp_path / "server.log", ready_timeout_s=120) as url:
        out = tmp_path / "structured.json"
        assert run(_args(base_url=url, json=out)) == 0
    report = json.loads(out.read_text())
    assert report["every_request_full_length"]
    assert [r["output_tokens"] for r in report["rounds"]["json"]] == [16]
    assert set(report["median_ttft_s"]) == {"plain", "cached", "cold"}
    assert all(v > 0 for v in report["median_ttft_s"].values())
