"""`python -m bench report`: docs/BENCHMARKS.md's tables (and README's headline sentence) from the
committed result records under docs/benchmarks/data/.

    python -m bench report                 # rewrite the generated blocks of the page and README
    python -m bench report --check         # exit 1 if they differ from what the records give
    python -m bench report --add-compare /tmp/cmp --machine zen3 --commit 822679b \\
        --command 'OUT=/tmp/cmp bench/peers/compare.sh ...' [--label vllm-cpu="vLLM-cpu 0.32.0"]

--add-compare writes a bench/peers/compare.sh output folder as a new `peers` record
(docs/benchmarks/data/peers/<date>-<machine>.json), then regenerates the pages, where it becomes that
machine's rows. The tables show, per area and machine, the newest record; older ones stay as history.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from bench.report.compare import read_compare_dir
from bench.report.page import fill, missing
from bench.report.records import load_machines, load_records, record_path

REPO_ROOT = Path(__file__).resolve().parents[2]
DATA = REPO_ROOT / "docs" / "benchmarks" / "data"
PAGES = (REPO_ROOT / "docs" / "BENCHMARKS.md", REPO_ROOT / "README.md")


def render(data: Path, pages: tuple[Path, ...]) -> dict[Path, str]:
    """Each page's text with its blocks regenerated from the records in `data`."""
    records, machines = load_records(data), load_machines(data)
    texts = {page: page.read_text() for page in pages}
    lost = missing(list(texts.values()), records)
    if lost:
        raise ValueError(f"records no page shows (add a block for each): {', '.join(lost)}")
    return {page: fill(text, records, machines) for page, text in texts.items()}


def add_compare(args: argparse.Namespace) -> Path:
    """Write the compare.sh folder's record; returns its path (an existing one is not overwritten)."""
    machines = load_machines(args.data)
    if args.machine not in machines:
        raise ValueError(f"machine {args.machine!r} is not in {args.data / 'machines.json'}: add it there first")
    labels = dict(label.split("=", 1) for label in args.label)
    rec = read_compare_dir(args.add_compare, args.machine, args.commit, args.command, args.note, labels)
    path = record_path(args.data, rec)
    if path.exists():
        raise ValueError(f"{path} exists: one record per area, machine and day")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(rec.to_json())
    return path


def run(args: argparse.Namespace) -> int:
    try:
        if args.add_compare:
            print(f"wrote {add_compare(args)}")
        rendered = render(args.data, tuple(args.page))
    except ValueError as exc:
        print(f"bench report: {exc}", file=sys.stderr)
        return 2
    stale = [page for page, text in rendered.items() if page.read_text() != text]
    if args.check:
        for page in stale:
            print(f"{page}: its tables differ from the records (run `python -m bench report`)", file=sys.stderr)
        return 1 if stale else 0
    for page in stale:
        page.write_text(rendered[page])
        print(f"wrote {page}")
    return 0


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("report", help="docs/BENCHMARKS.md's tables from the committed result records",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", type=Path, default=DATA, help="the records' folder (default: %(default)s)")
    p.add_argument("--page", type=Path, action="append", default=None,
                   help="a page with generated blocks (repeatable; default: docs/BENCHMARKS.md and README.md)")
    p.add_argument("--check", action="store_true", help="change nothing; exit 1 if a page is stale")
    p.add_argument("--add-compare", type=Path, default=None, metavar="DIR", help="a compare.sh output folder")
    p.add_argument("--machine", help="with --add-compare: the machine's key in machines.json")
    p.add_argument("--commit", help="with --add-compare: the commit tokenmill ran at")
    p.add_argument("--command", help="with --add-compare: the command line that produced the folder")
    p.add_argument("--note", default="", help="with --add-compare: a sentence for under the table")
    p.add_argument("--label", action="append", default=[], metavar="SYSTEM=NAME",
                   help="with --add-compare: a system's name on the page, e.g. vllm-cpu='vLLM-cpu 0.32.0'")
    p.set_defaults(func=_checked_run)


def _checked_run(args: argparse.Namespace) -> int:
    args.page = args.page or list(PAGES)
    if args.add_compare and not (args.machine and args.commit and args.command):
        raise SystemExit("bench report: --add-compare needs --machine, --commit and --command")
    if any("=" not in label for label in args.label):
        raise SystemExit("bench report: --label is SYSTEM=NAME")
    return run(args)
