"""bench linear-ab: both settings run every round at each concurrency, on the same prompts."""

from __future__ import annotations

import json

from bench.cli import main


def test_linear_ab_runs_both_settings(build_model, tmp_path):
    out = tmp_path / "ab.json"
    args = ["linear-ab", "--model", str(build_model("tiny-llama")), "--dtype", "float32", "--concurrency", "1", "3",
            "--rounds", "2", "--input-len", "5", "--output-len", "3", "--json", str(out)]  # fmt: skip
    assert main(args) == 0
    report = json.loads(out.read_text())
    assert [r["concurrency"] for r in report["results"]] == [1, 3]
    for row in report["results"]:
        for v in ("off", "auto"):
            assert len(row[v]["rounds_tok_s"]) == 2 and row[v]["median_tok_s"] > 0
