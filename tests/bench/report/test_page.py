"""The benchmarks page and README's headline are what `bench report` makes of the committed records:
a figure changed in a record and not on the page (or the other way round) fails here."""

from __future__ import annotations

import re
import shutil

from bench.cli import main
from bench.report.command import DATA, PAGES, render
from bench.report.page import missing, shown
from bench.report.records import load_records
from tests.test_layering import ROOT

PAGE, README = PAGES


def test_the_page_and_readme_equal_what_the_records_give():
    rendered = render(DATA, PAGES)
    for page in PAGES:
        assert page.read_text() == rendered[page], f"{page} is stale: run `python -m bench report`"


def test_every_record_is_on_the_page():
    records = load_records(DATA)
    assert len(records) >= 14
    assert missing([PAGE.read_text(), README.read_text()], records) == []


def test_the_page_has_a_table_per_area_and_peers_per_cpu_kind():
    blocks = shown(PAGE.read_text())
    for area in ("int8", "lora-served", "spec-served", "determinism", "priority", "router", "startup"):
        assert (area, None) in blocks
    assert {("peers", "zen3"), ("peers", "xeon-amx")} <= blocks
    assert len(PAGE.read_text().splitlines()) <= 260  # a page to read, not a notebook: the log holds the rest


def test_readme_starts_with_the_two_commands_and_quotes_the_page():
    text = README.read_text()
    first_block = re.search(r"```bash\n(.*?)```", text, re.S)[1]
    assert [line.split()[:2] for line in first_block.splitlines()] == [["make", "run"], ["make", "test"]]
    assert ("headline", None) in shown(text)
    assert text.index("```bash") < text.index("<!-- bench report headline -->")


def test_check_fails_on_a_stale_page_and_report_rewrites_it(tmp_path, capsys):
    page = tmp_path / "BENCHMARKS.md"
    shutil.copy(PAGE, page)
    page.write_text(page.read_text().replace("| 79.4 |", "| 97.4 |", 1))  # a figure edited by hand
    args = ["report", "--data", str(DATA), "--page", str(page)]
    assert main([*args, "--check"]) == 1
    assert main(args) == 0
    assert page.read_text() == PAGE.read_text()
    assert main([*args, "--check"]) == 0


def test_the_log_keeps_every_old_heading():
    """The old notes moved whole: references by heading (engine/, docs/ENGINE.md) still find them."""
    log = (ROOT / "docs" / "benchmarks" / "log.md").read_text()
    for heading in ("Thread placement", "Engine threads under contention", "Batch-invariant mode",
                    "Where things stand: 2026-12-01", "Replicas behind vllm-router, per policy"):
        assert re.search(rf"^#+ {re.escape(heading)}", log, re.M), heading
    assert len(re.findall(r"^#{1,3} ", log, re.M)) == 56  # the 56 headings of the old page
