"""bench lora: every adapter count runs --rounds times, the median round is reported against the base
model's at the same concurrency (the medians' ratio, and the median of each pass's own ratio)."""

from __future__ import annotations

import json

from bench.cli import main


def test_lora_bench_rounds_and_ratios(build_model, tmp_path):
    out = tmp_path / "lora.json"
    args = ["lora", "--model", str(build_model("tiny-llama")), "--dtype", "float32", "--adapters", "0", "2",
            "--concurrency", "2", "--rounds", "3", "--rank", "4", "--input-len", "6", "--output-len", "3",
            "--json", str(out)]  # fmt: skip
    assert main(args) == 0
    report = json.loads(out.read_text())
    assert report["rounds"] == 3 and report["rank"] == 4
    rows = {r["adapters"]: r for r in report["results"]}
    assert set(rows) == {0, 2}
    for r in rows.values():
        assert len(r["rounds_tok_s"]) == 3 and r["concurrency"] == 2
        assert sorted(r["rounds_tok_s"])[1] == round(r["output_tok_s"], 1)  # the median round
    assert rows[0]["vs_base"] == 1.0
    assert abs(rows[2]["vs_base"] - rows[2]["output_tok_s"] / rows[0]["output_tok_s"]) < 1e-12
    # and each round against the base's round of the same pass, the median of those
    assert rows[0]["vs_base_paired"] == 1.0
    pairs = sorted(a / b for a, b in zip(rows[2]["rounds_tok_s"], rows[0]["rounds_tok_s"], strict=True))
    assert abs(rows[2]["vs_base_paired"] - pairs[1]) < 1e-3 * pairs[1]
