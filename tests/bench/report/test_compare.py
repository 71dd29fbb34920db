"""A compare.sh output folder becomes a `peers` record, and `bench report --add-compare` puts it on the
page as that machine's rows (the newest record of the machine)."""

from __future__ import annotations

import json
import shutil

import pytest

from bench.cli import main
from bench.report.command import DATA, PAGES
from bench.report.compare import read_compare_dir


def result(tok_s: float, done: int, n: int, date: str = "20261207-093000") -> dict:
    """The fields of a `vllm bench serve --save-result` JSON that the record keeps (and one it does not)."""
    return {"date": date, "output_throughput": tok_s, "median_ttft_ms": 228.4, "p99_ttft_ms": 363.0,
            "median_tpot_ms": 15.84, "p99_tpot_ms": 18.92, "completed": done, "num_prompts": n, "duration": 18.4}


@pytest.fixture
def compare_dir(tmp_path):
    out = tmp_path / "cmp"
    out.mkdir()
    for system, scale in (("tokenmill", 3.0), ("vllm-cpu", 1.0), ("llama.cpp", 2.0)):
        for c, n in ((1, 8), (16, 64), (32, 128)):
            (out / f"{system}-c{c}.json").write_text(json.dumps(result(scale * c, n - (system == "llama.cpp"), n)))
    (out / "tokenmill.log").write_text("not a result\n")
    return out


def test_a_folder_becomes_one_row_per_system_tokenmill_first(compare_dir):
    rec = read_compare_dir(compare_dir, "zen3", "822679b", "compare.sh m g", labels={"vllm-cpu": "vLLM-cpu 0.32.0"})
    assert (rec.area, rec.date, rec.machine, rec.commit, rec.command) == (
        "peers", "2026-12-07", "zen3", "822679b", ("compare.sh m g",))
    assert [r["system"] for r in rec.rows] == ["tokenmill", "vLLM-cpu 0.32.0", "llama.cpp server"]
    assert list(rec.rows[0]["points"]) == ["1", "16", "32"]
    assert rec.rows[0]["points"]["16"] == {"tok_s": 48.0, "ttft_p50_ms": 228, "ttft_p99_ms": 363, "tpot_p50_ms": 15.8,
                                           "tpot_p99_ms": 18.9, "done": "64/64"}
    assert rec.rows[2]["points"]["32"]["done"] == "127/128"


def test_a_folder_without_tokenmill_is_refused(compare_dir):
    for path in compare_dir.glob("tokenmill-*.json"):
        path.unlink()
    with pytest.raises(ValueError, match="no tokenmill-c<N>.json"):
        read_compare_dir(compare_dir, "zen3", "822679b", "x")


def test_add_compare_writes_the_record_and_the_machines_rows(compare_dir, tmp_path):
    data, pages = tmp_path / "data", [tmp_path / p.name for p in PAGES]
    shutil.copytree(DATA, data)
    for src, dst in zip(PAGES, pages, strict=True):
        shutil.copy(src, dst)
    args = ["report", "--data", str(data), *(a for p in pages for a in ("--page", str(p)))]
    add = ["--add-compare", str(compare_dir), "--machine", "xeon-amx", "--commit", "fedcba9", "--command", "compare.sh m g"]
    assert main([*args, *add]) == 0
    written = json.loads((data / "peers" / "2026-12-07-xeon-amx.json").read_text())
    assert written["commit"] == "fedcba9" and written["rows"][0]["points"]["1"]["tok_s"] == 3.0
    page = pages[0].read_text()
    block = page[page.index("<!-- bench report peers xeon-amx -->"):]
    block = block[: block.index("<!-- /bench report -->")]
    assert ("| tokenmill | 3.0 | 15.8 | 48.0 | 228 | 96.0 | 228 / 363 | 15.8 | 8/8, 64/64, 128/128 | 2026-12-07 | fedcba9 "
            "| xeon-amx | A |") in block
    assert "c1 1.50x (llama.cpp server)" in block and "| 79.4 |" not in block  # the newer run replaced the older
    assert "fedcba9" in pages[1].read_text()  # README's headline follows the newest run too
    assert main([*args, *add]) == 2  # one record per area, machine and day: not overwritten
    assert main([*args, "--check"]) == 0
