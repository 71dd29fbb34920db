"""`python -m bench spec` end to end on a tiny model: both arms run, float32 outputs agree, the report
has the figures docs/BENCHMARKS.md quotes."""

from __future__ import annotations

import json

from bench.cli import main


def test_bench_spec_reports_both_arms(build_model, tmp_path, capsys):
    path = build_model("tiny-llama")
    out = tmp_path / "spec.json"
    rc = main(["spec", "--model", str(path), "--dtype", "float32", "--workload", "random", "--prompts", "3",
               "--max-tokens", "24", "--rounds", "1", "--concurrency", "1", "2", "--json", str(out)])  # fmt: skip
    assert rc == 0
    report = json.loads(out.read_text())
    assert [r["concurrency"] for r in report["results"]] == [1, 2]
    for row in report["results"]:
        assert row["identical_outputs"] == "3/3"  # float32: speculation does not change greedy output
        for arm in ("off", "on"):
            assert row[arm]["output_tokens"] == 3 * 24 and row[arm]["tpot_ms"] > 0
        assert row["off"]["draft_tokens"] == 0
    assert "c1:" in capsys.readouterr().out
