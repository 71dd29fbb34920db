"""Tables from records: cells, the newest record per machine, ratios computed from the rows."""

from __future__ import annotations

import pytest

from bench.report.areas import col
from bench.report.records import parse_record
from bench.report.tables import cell, newest, render_block


def rec(machine="zen3", date="2026-12-07", rows=None, area="peers", command="c.sh"):
    rows = rows or [
        {"system": "tokenmill", "points": {"1": {"tok_s": 60.04}, "32": {"tok_s": 500.0, "ttft_p50_ms": 900}}},
        {"system": "vLLM-cpu", "points": {"1": {"tok_s": 30.0}, "32": {"tok_s": 400.0}}},
        {"system": "llama.cpp server", "points": {"1": {"tok_s": 40.0}, "32": {"tok_s": 250.0}}}]
    return parse_record({"area": area, "date": date, "commit": "abc1234", "machine": machine, "command": command,
                         "rows": rows}, "t.json")


def test_cells_format_numbers_join_paths_and_mark_what_is_missing():
    row = {"a": {"b": 3.14159}, "c": 7, "s": "x|y"}
    assert cell(row, col("h", "a.b", digits=2)) == "3.14"
    assert cell(row, col("h", "a.b", "c", digits=0)) == "3 / 7"
    assert cell(row, col("h", "a.x", "c")) == "- / 7"
    assert cell(row, col("h", "s")) == "x\\|y"  # a pipe would split the markdown cell


def test_newest_keeps_the_latest_record_of_each_machine():
    old, new, other = rec(date="2026-12-01"), rec(date="2026-12-07"), rec(machine="xeon-amx", date="2026-11-30")
    assert newest([new, old, other], "peers") == [other, new]  # machines in key order
    assert newest([new, old, other], "peers", "zen3") == [new]
    assert newest([new], "int8") == []


def test_a_block_has_every_row_with_date_commit_machine_and_its_command():
    text = render_block("peers", [rec(command="OUT=/tmp/x bench/peers/compare.sh m g")], "zen3")
    lines = text.splitlines()
    assert lines[0].startswith("| system | c1 tok/s |") and lines[0].endswith("| date | commit | machine | cmd |")
    assert lines[2] == "| tokenmill | 60.0 | - | - | - | 500.0 | 900 / - | - | -, -, - | 2026-12-07 | abc1234 | zen3 | A |"
    assert "- A: `OUT=/tmp/x bench/peers/compare.sh m g`" in lines
    # computed from the rows: 60.04 / 40 (llama.cpp, the best at c1), 500 / 400 (vLLM at c32)
    assert "zen3, tokenmill's output tok/s over the best other system: c1 1.50x (llama.cpp server), " \
           "c32 1.25x (vLLM-cpu)." in lines


def test_lora_ratio_is_tokenmill_over_the_other_system_at_each_c():
    rows = [{"system": "tokenmill", "c": 1, "lora_tok_s": 61.0}, {"system": "vLLM-cpu", "c": 1, "lora_tok_s": 10.1},
            {"system": "tokenmill", "c": 32, "lora_tok_s": 591.4}, {"system": "vLLM-cpu", "c": 32, "lora_tok_s": 47.9}]
    text = render_block("lora-served", [rec(area="lora-served", rows=rows)])
    assert "With 4 adapters, tokenmill's output tok/s over vLLM's: c1 6.0x, c32 12.3x." in text


def test_an_unknown_area_or_an_empty_block_is_an_error():
    with pytest.raises(ValueError, match="unknown area 'nope'"):
        render_block("nope", [rec()])
    with pytest.raises(ValueError, match="no record for area 'peers' on machine 'zen4'"):
        render_block("peers", [rec()], "zen4")
