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


def test_prompt_grounded_workloads_are_fixed_distinct_and_grounded():
    from bench.lib.spec_prompts import CHAT_WORKLOADS, TOWNS, rag, summarise

    assert set(CHAT_WORKLOADS) == {"code-edit", "summarise", "rag"}
    for name, message in CHAT_WORKLOADS.items():
        texts = [message(i) for i in range(20)]
        assert texts == [message(i) for i in range(20)], name  # a function of i alone
        assert len(set(texts)) == 20, name
    # the RAG question asks about a town of its own passage; the summary has a report to quote
    for i in range(20):
        passage, question = rag(i).split("Passage:\n")[1].split("\n\nQuestion: ")
        (town,) = [t for t in TOWNS if t in question]
        assert f"{town} was founded" in passage, (i, question)
        assert summarise(i).count(".") >= 9


def test_bench_spec_runs_every_chat_workload(build_model, tmp_path, capsys):
    path = build_model("tiny-llama")
    for workload in ("summarise", "rag"):  # code-edit: bench/determinism.py's test runs it
        out = tmp_path / f"{workload}.json"
        rc = main(["spec", "--model", str(path), "--dtype", "float32", "--workload", workload, "--prompts", "2",
                   "--max-tokens", "8", "--rounds", "1", "--concurrency", "1", "--json", str(out)])  # fmt: skip
        assert rc == 0
        report = json.loads(out.read_text())
        assert report["workload"] == workload
        assert report["results"][0]["identical_outputs"] == "2/2"
        assert report["results"][0]["on"]["output_tokens"] > 0


def test_bench_spec_fresh_rounds_and_warm_traffic_for_suffix_decoding(build_model, tmp_path):
    """--fresh-rounds gives each round its own prompts (both arms the same ones), --warm-prompts runs other
    prompts first; the speedup is the median of the rounds' own ratios."""
    path = build_model("tiny-llama")
    out = tmp_path / "suffix.json"
    rc = main(["spec", "--model", str(path), "--dtype", "float32", "--workload", "code-edit", "--prompts", "2",
               "--max-tokens", "8", "--rounds", "3", "--fresh-rounds", "--warm-prompts", "2", "--method", "suffix",
               "--k", "6", "--concurrency", "1", "--json", str(out)])  # fmt: skip
    assert rc == 0
    report = json.loads(out.read_text())
    row = report["results"][0]
    assert report["warm_prompts"] == 2 and len(row["round_speedups"]) == 3
    assert abs(row["speedup"] - sorted(row["round_speedups"])[1]) < 0.01
    assert row["identical_outputs"] == "2/2"
