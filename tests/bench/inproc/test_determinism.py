"""`python -m bench determinism` end to end on a tiny model: both arms run at each concurrency, the report
has the figures docs/BENCHMARKS.md quotes, and the mode's outputs match across concurrencies."""

from __future__ import annotations

import json

from bench.cli import main


def test_bench_determinism_reports_both_arms(build_model, tmp_path, capsys):
    path = build_model("tiny-llama")
    out = tmp_path / "determinism.json"
    rc = main(["determinism", "--model", str(path), "--dtype", "float32", "--prompts", "3", "--max-tokens", "8",
               "--rounds", "1", "--concurrency", "1", "3", "--json", str(out)])  # fmt: skip
    assert rc == 0
    report = json.loads(out.read_text())
    assert [r["concurrency"] for r in report["results"]] == [1, 3]
    for row in report["results"]:
        for arm in ("off", "on"):
            assert row[arm]["output_tokens"] > 0 and row[arm]["output_tok_s"] > 0
        assert row["on"]["same_as_first"] == "3/3"  # the mode: the same tokens at every concurrency
        assert isinstance(row["cost"], float)
    assert "c3:" in capsys.readouterr().out
