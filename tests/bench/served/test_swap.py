"""bench swap: its request accounting on made-up results, and one short run against a real server
process (tiny-llama as version a, tiny-llama-b as b). No timing assertions."""

from __future__ import annotations

import argparse
import json
import os

from bench.served.swap import Result, RssSampler, process_rss, request_report, run


def test_request_report_counts_failures_versions_and_consistency():
    marks = {"load_start": 10.0, "promoted": 12.0, "unloaded": 13.0}
    results = [
        Result("p", 1.0, 2.0, 200, "a", (1, 2)),
        Result("p", 9.0, 10.5, 200, "a", (1, 2)),  # in flight when the load started: during the swap
        Result("p", 12.5, 12.6, 200, "b", (3, 4)),
        Result("q", 12.7, 12.8, 503, error="draining"),
        Result("p", 14.0, 14.1, 200, "b", (3, 4)),
    ]
    report = request_report(results, marks)
    assert report["sent"] == 5 and report["failed"] == 1 and report["failures"] == ["503 draining"]
    assert report["during_swap"] == 3 and report["failed_during_swap"] == 1
    assert report["by_version"] == {"a": 2, "b": 2} and report["after_promote_on_a"] == 0
    assert report["consistent"]
    results.append(Result("p", 15.0, 15.1, 200, "b", (9, 9)))  # same prompt and version, other tokens
    results.append(Result("p", 12.1, 12.2, 200, "a", (1, 2)))  # routed to a after the promote
    report = request_report(results, marks)
    assert not report["consistent"] and report["after_promote_on_a"] == 1


def test_rss_sampler_peak_is_taken_inside_the_window():
    sampler = RssSampler(os.getpid())
    sampler.samples = [(1.0, 100), (2.0, 300), (3.0, 200), (4.0, 900)]
    assert sampler.peak(1.5, 3.5) == 300 and sampler.peak(5.0, 6.0) is None
    assert process_rss(os.getpid()) > 0 and process_rss(2**31) is None


def test_one_short_run_against_a_real_server(build_model, tmp_path):
    args = argparse.Namespace(
        model_a=str(build_model("tiny-llama")), model_b=str(build_model("tiny-llama-b")), name="bench", clients=2,
        max_tokens=4, max_num_seqs=4, dtype="auto", kv_cache_memory="16MiB", cache_bytes="1MiB", cache_prompts=3,
        warm_s=0.5, tail_s=0.5, out_dir=str(tmp_path),
    )  # fmt: skip
    assert run(args) == 0
    report = json.loads((tmp_path / "swap.json").read_text())
    requests = report["requests"]
    assert requests["failed"] == 0 and requests["consistent"] and requests["after_promote_on_a"] == 0
    assert requests["by_version"].get("a", 0) > 0 and requests["by_version"].get("b", 0) > 0
    assert set(report["swap"]["server_timings_s"]) == {"load_s", "warmup_s", "probe_s"}
    assert report["swap"]["total_s"] >= report["swap"]["load_call_s"] > 0
    memory = report["memory_bytes"]
    assert memory["before"] > 0 and memory["overlap_peak"] >= memory["before"]
    cache = report["cache"]
    assert cache["identical"] and cache["requests"] == 3
    assert cache["server_e2e_p50_s"]["hit"] < cache["server_e2e_p50_s"]["miss"]
