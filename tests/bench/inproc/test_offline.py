"""`python -m bench offline` end to end on tiny-llama: every system runs and the report adds up.
No timing assertions: only that the numbers are there, positive and consistent."""

from __future__ import annotations

import json

import pytest

from bench.cli import build_parser, main
from bench.inproc.offline import SYSTEMS


def _run(model, tmp_path, *extra: str) -> dict:
    out = tmp_path / "report.json"
    rc = main(["offline", *extra, "--model", str(model), "--dtype", "float32", "--threads", "1",
               "--json", str(out)])
    assert rc == 0
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def tiny(build_model):
    return build_model("tiny-llama")


def test_fixed_report_counts_every_token(tiny, tmp_path, capsys):
    report = _run(tiny, tmp_path, "fixed", "-n", "3", "--prompt-len", "5", "--output-len", "4",
                  "--serial-sample", "2", "--repeats", "2")
    systems = {s["name"]: s for s in report["systems"]}
    assert list(systems) == list(SYSTEMS)
    assert report["workload"]["output_tokens"] == 12
    for s in systems.values():
        assert s["requests"] == 3 and s["output_tokens"] == 12
        assert s["wall_s"] > 0 and s["output_tok_s"] > 0 and len(s["runs_wall_s"]) == 2
        assert s["output_tok_s"] == pytest.approx(12 / s["wall_s"])
    assert systems["engine"]["engine_speedup"] == pytest.approx(1.0)
    assert systems["engine"]["round_speedups"] == pytest.approx([1.0, 1.0])
    assert all(x > 0 for s in systems.values() for x in s["round_speedups"])
    assert systems["hf-serial"]["extrapolated"] and systems["hf-serial"]["timed_requests"] == 2
    assert not systems["hf-static"]["extrapolated"] and systems["hf-static"]["timed_requests"] == 3
    agreement = report["greedy_agreement"]
    assert agreement["compared"] == 2 and all(0 <= n <= 4 for n in agreement["common_prefix"])
    assert agreement["identical"] == sum(n == 4 for n in agreement["common_prefix"])
    assert report["machine"]["torch_threads"] == 1 and len(report["load_before"]) == 3
    assert len(report["engine_source_sha256"]) == 16
    printed = capsys.readouterr().out
    assert "command: python -m bench offline fixed" in printed
    assert "extrapolated" in printed and "engine speedup" in printed


def test_mixed_static_batches_count_only_useful_tokens(tiny, tmp_path):
    report = _run(tiny, tmp_path, "mixed", "-n", "5", "--prompt-range", "3", "20", "--output-range", "1", "6",
                  "--static-batch", "2", "--serial-sample", "0", "--seed", "7")
    want = report["workload"]["output_tokens"]
    assert 5 <= want <= 30
    systems = {s["name"]: s for s in report["systems"]}
    assert all(s["output_tokens"] == want for s in systems.values())
    assert not systems["hf-serial"]["extrapolated"] and systems["hf-serial"]["timed_requests"] == 5
    # the same seed gives the same workload in a second run
    again = _run(tiny, tmp_path, "mixed", "-n", "5", "--prompt-range", "3", "20", "--output-range", "1", "6",
                 "--systems", "engine", "--seed", "7")
    assert again["workload"] == report["workload"]
    assert [s["name"] for s in again["systems"]] == ["engine"]


def test_unknown_system_is_rejected(tiny):
    with pytest.raises(SystemExit, match="bogus"):
        main(["offline", "fixed", "--model", str(tiny), "--systems", "engine,bogus"])


def test_cli_has_offline_subcommand():
    args = build_parser().parse_args(["offline", "mixed"])
    assert args.subcommand == "offline" and args.workload == "mixed" and args.serial_sample == 4
    with pytest.raises(SystemExit):
        build_parser().parse_args([])


@pytest.fixture(autouse=True)
def _keep_torch_threads():
    # --threads sets torch's process-wide thread count; give other tests theirs back.
    import torch

    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)
