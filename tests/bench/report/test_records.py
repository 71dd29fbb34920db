"""Result records: the committed ones load and say what they were transcribed from; a wrong field is
an error naming the file and the field."""

from __future__ import annotations

import json
import re

import pytest

from bench.report.command import DATA
from bench.report.records import load_records, parse_record
from tests.test_layering import ROOT

GOOD = {"area": "peers", "date": "2026-12-07", "commit": "822679b", "machine": "zen3", "command": "x.sh",
        "rows": [{"system": "tokenmill"}]}


def _log_section(heading: str) -> str:
    """The log's text under `heading`, to the next heading of the same or a higher level."""
    log = (ROOT / "docs" / "benchmarks" / "log.md").read_text()
    m = re.search(rf"^(#+) {re.escape(heading)}\n", log, re.M)
    assert m, f"no heading {heading!r} in the log"
    rest = log[m.end():]
    end = re.search(rf"^#{{1,{len(m[1])}}} ", rest, re.M)
    return rest[: end.start() if end else len(rest)]


def _figures(value: object) -> list[str]:
    if isinstance(value, dict):
        return [f for v in value.values() for f in _figures(v)]
    if isinstance(value, list):
        return [f for v in value for f in _figures(v)]
    return re.findall(r"\d+(?:\.\d+)?", str(value))


def test_every_figure_transcribed_from_the_log_is_in_the_section_it_names():
    """Honesty of the transcription: each number of a record whose source is a log heading appears in
    that section (a typo, or a figure from another section or another day, fails)."""
    checked = 0
    for rec in load_records(DATA):
        m = re.fullmatch(r'docs/benchmarks/log\.md, "(.+)"', rec.source)
        if not m:
            continue
        section = _log_section(m[1])
        for row in rec.rows:
            for figure in _figures(row):
                # 3.8 in JSON is "3.80" in the log: trailing zeros after a decimal point are the same figure
                zeros = "0*" if "." in figure else ""
                assert re.search(rf"(?<![\d.]){re.escape(figure)}{zeros}(?!\d)", section), (rec.path, figure)
                checked += 1
        assert rec.date in m[1] + _parent_heading(m[1]), (rec.path, "dated as the log dates it")
    assert checked > 150


def _parent_heading(heading: str) -> str:
    """The ## heading at or above `heading` (a ### section's date is in its ## heading)."""
    log = (ROOT / "docs" / "benchmarks" / "log.md").read_text()
    upto = log[: log.index(f"# {heading}\n") + len(heading) + 2]
    return re.findall(r"^## .*$", upto, re.M)[-1]


@pytest.mark.parametrize("change, message", [
    ({"date": "7 Dec"}, "date '7 Dec' is not YYYY-MM-DD"),
    ({"commit": "main"}, "commit 'main' is not a hex hash"),
    ({"command": []}, "field 'command'"),
    ({"rows": []}, "field 'rows' must be a non-empty list"),
    ({"speed": 1}, "unknown fields ['speed']"),
    ({"area": 3}, "field 'area' must be a str"),
])
def test_a_wrong_field_is_named(change, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        parse_record({**GOOD, **change}, "x.json")


def test_a_record_on_an_unknown_machine_is_refused(tmp_path):
    (tmp_path / "machines.json").write_text(json.dumps({"zen3": {"short": "z", "cpu": "Zen 3"}}))
    (tmp_path / "a.json").write_text(json.dumps({**GOOD, "machine": "zen9"}))
    with pytest.raises(ValueError, match=r"a\.json: machine 'zen9' is not in machines\.json"):
        load_records(tmp_path)


def test_a_record_survives_writing_and_reading():
    rec = parse_record(GOOD, "x.json")
    assert parse_record(json.loads(rec.to_json()), "y.json") == rec
