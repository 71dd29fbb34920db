"""Result records: one JSON file per measurement, the figures the benchmarks page shows.

A record is what one run of one command measured, written small enough to read: its area (which table
of docs/BENCHMARKS.md it belongs to), the date and commit it was measured at, the machine (a key of
machines.json beside the records), the command that reproduces it, and its rows (the table's cells,
numbers or short text). Loading checks every field, so a record that would render a wrong table is an
error that names the file, not a silent gap on the page.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

DATE = re.compile(r"\d{4}-\d{2}-\d{2}")
COMMIT = re.compile(r"[0-9a-f]{7,40}")
MACHINES_FILE = "machines.json"


@dataclass(frozen=True)
class Record:
    """One measurement: where it goes, when and on what it ran, how to run it again, what it gave."""

    area: str  # a key of bench.report.areas.AREAS: the table the rows go to
    date: str  # YYYY-MM-DD, the day it was measured
    commit: str  # the commit measured (short hash)
    machine: str  # a key of machines.json
    command: tuple[str, ...]  # the command lines that reproduce it, in order
    rows: tuple[dict, ...]  # the table's cells: keys as the area's columns name them
    note: str = ""  # one or two sentences printed under the table (a caveat, the run's context)
    source: str = ""  # where the figures were first written down (a log heading, an output folder)
    path: Path | None = field(default=None, compare=False)  # the file it was read from

    def to_json(self) -> str:
        out = {k: v for k, v in asdict(self).items() if k != "path" and v != ""}
        out["command"], out["rows"] = list(self.command), list(self.rows)
        return json.dumps(out, indent=2, ensure_ascii=False) + "\n"


def parse_record(data: dict, where: str) -> Record:
    """A Record from a JSON object; ValueError naming `where` and the field when one is wrong."""
    def need(key: str, kind: type) -> object:
        if not isinstance(data.get(key), kind):
            raise ValueError(f"{where}: field {key!r} must be a {kind.__name__}")
        return data[key]

    unknown = set(data) - {"area", "date", "commit", "machine", "command", "rows", "note", "source"}
    if unknown:
        raise ValueError(f"{where}: unknown fields {sorted(unknown)}")
    command = data.get("command")
    commands = (command,) if isinstance(command, str) else tuple(command or ())
    if not commands or not all(isinstance(c, str) and c for c in commands):
        raise ValueError(f"{where}: field 'command' must be a command line or a list of them")
    rows = need("rows", list)
    if not rows or not all(isinstance(r, dict) for r in rows):
        raise ValueError(f"{where}: field 'rows' must be a non-empty list of objects")
    date, commit = need("date", str), need("commit", str)
    if not DATE.fullmatch(date):
        raise ValueError(f"{where}: date {date!r} is not YYYY-MM-DD")
    if not COMMIT.fullmatch(commit):
        raise ValueError(f"{where}: commit {commit!r} is not a hex hash")
    return Record(area=need("area", str), date=date, commit=commit, machine=need("machine", str),
                  command=commands, rows=tuple(rows), note=data.get("note", ""), source=data.get("source", ""))


def load_machines(folder: Path) -> dict[str, dict[str, str]]:
    """machine key -> {"short": a few words for a sentence, "cpu": the CPU, cores and instruction sets}."""
    machines = json.loads((folder / MACHINES_FILE).read_text())
    if not isinstance(machines, dict) or not all(
            isinstance(v, dict) and isinstance(v.get("short"), str) and isinstance(v.get("cpu"), str)
            for v in machines.values()):  # fmt: skip
        raise ValueError(f"{folder / MACHINES_FILE}: must map machine keys to {{'short': ..., 'cpu': ...}}")
    return machines


def load_records(folder: Path) -> list[Record]:
    """Every record under `folder` (any depth, machines.json excepted), sorted by path; each one's
    machine must be in machines.json."""
    machines = load_machines(folder)
    records = []
    for path in sorted(folder.rglob("*.json")):
        if path.name == MACHINES_FILE:
            continue
        rec = parse_record(json.loads(path.read_text()), str(path))
        if rec.machine not in machines:
            raise ValueError(f"{path}: machine {rec.machine!r} is not in {MACHINES_FILE}")
        records.append(replace(rec, path=path))
    return records


def record_path(folder: Path, rec: Record) -> Path:
    """Where a new record is written: <area>/<date>-<machine>.json under the data folder."""
    return folder / rec.area / f"{rec.date}-{rec.machine}.json"
