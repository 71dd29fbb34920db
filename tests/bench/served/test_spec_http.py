"""bench spec-http: the speculation workloads' chat prompts against a real `python -m server` process
(tiny-llama, with and without n-gram speculation): every request answered, tokens counted from the
server's usage, greedy answers the same with speculation on. No timing assertions."""

from __future__ import annotations

import argparse
import json

from bench.lib.server import free_port, server_process
from bench.served.spec_http import run

SPEC = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}'


def test_same_answers_with_and_without_speculation_counted_from_usage(build_model, tmp_path):
    model = build_model("tiny-llama")
    reports = {}
    for arm, extra in (("off", []), ("on", ["--speculative-config", SPEC])):
        with server_process(model, free_port(), 4, "float32", extra, tmp_path / f"{arm}.log", ready_timeout_s=120) as url:
            out = tmp_path / f"{arm}.json"
            args = argparse.Namespace(base_url=url, workload="code-edit", prompts=3, concurrency=[1, 2],
                                      max_tokens=12, label=arm, json=out, warm_prompts=2)  # fmt: skip
            assert run(args) == 0
        reports[arm] = json.loads(out.read_text())["rows"]
    for rows in reports.values():
        assert [r["concurrency"] for r in rows] == [1, 2]
        for r in rows:
            assert len(r["answers"]) == 3 and 0 < r["output_tokens"] <= 3 * 12 and r["output_tok_s"] > 0
    assert reports["on"][0]["answers"] == reports["off"][0]["answers"]
