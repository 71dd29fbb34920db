"""Markdown tables from records: one block per area (optionally one machine), the newest record of
each machine, every row with its date, commit, machine and a letter naming the command under the table.
"""

from __future__ import annotations

import string
from collections.abc import Sequence

from bench.report.areas import AREAS, Column
from bench.report.records import Record


def cell(row: dict, column: Column) -> str:
    """The text of one cell: each path's value (numbers with the column's decimals), joined by its sep."""
    parts = []
    for path in column.paths:
        value: object = row
        for key in path:
            value = value.get(key) if isinstance(value, dict) else None
        if value is None:
            parts.append("-")
        elif isinstance(value, float | int) and not isinstance(value, bool) and column.digits is not None:
            parts.append(f"{value:.{column.digits}f}")
        else:
            parts.append(str(value))
    return column.sep.join(parts).replace("|", "\\|")


def newest(records: Sequence[Record], area: str, machine: str | None = None) -> list[Record]:
    """The newest record of `area` for each machine (or only `machine`), machines in key order. Older
    records stay in the data as history; the page shows what is current."""
    best: dict[str, Record] = {}
    for rec in records:
        if rec.area != area or machine not in (None, rec.machine):
            continue
        held = best.get(rec.machine)
        if held is None or (rec.date, str(rec.path)) > (held.date, str(held.path)):
            best[rec.machine] = rec
    return [best[m] for m in sorted(best)]


def render_block(area: str, records: Sequence[Record], machine: str | None = None) -> str:
    """The table of `area` (one machine's, when given), its derived ratios, then each record's command,
    note and source. ValueError when no record fills it: an empty table is a mistake, not a result."""
    if area not in AREAS:
        raise ValueError(f"unknown area {area!r} (known: {', '.join(AREAS)})")
    chosen = newest(records, area, machine)
    if not chosen:
        raise ValueError(f"no record for area {area!r}" + (f" on machine {machine!r}" if machine else ""))
    columns = AREAS[area].columns
    lines = ["| " + " | ".join([c.header for c in columns] + ["date", "commit", "machine", "cmd"]) + " |",
             "|" + " --- |" * (len(columns) + 4)]
    for letter, rec in zip(string.ascii_uppercase, chosen, strict=False):
        for row in rec.rows:
            cells = [cell(row, c) for c in columns] + [rec.date, rec.commit, rec.machine, letter]
            lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    lines += filter(None, (derived_line(area, rec) for rec in chosen))
    for letter, rec in zip(string.ascii_uppercase, chosen, strict=False):
        lines.append(f"- {letter}: " + "; ".join(f"`{c}`" for c in rec.command))
        if rec.note or rec.source:
            lines.append("  " + " ".join(filter(None, [rec.note, f"(From {rec.source}.)" if rec.source else ""])))
    return "\n".join(lines)


def derived_line(area: str, rec: Record) -> str:
    """A sentence of ratios computed from the record's own rows (so it cannot disagree with them)."""
    if area in ("peers", "int8", "gguf", "moe"):
        return _best_peer_line(rec)
    if area == "lora-served":
        return _lora_line(rec)
    return ""


def _best_peer_line(rec: Record) -> str:
    ours = [r for r in rec.rows if str(r.get("system", "")).startswith("tokenmill")]
    others = [r for r in rec.rows if r not in ours]
    if len(ours) != 1 or not others:
        return ""
    parts = []
    for c, point in ours[0].get("points", {}).items():
        peers = [(o["points"][c]["tok_s"], o["system"]) for o in others if o.get("points", {}).get(c, {}).get("tok_s")]
        if point.get("tok_s") and peers:
            best, name = max(peers)
            parts.append(f"c{c} {point['tok_s'] / best:.2f}x ({name})")
    if not parts:
        return ""
    return f"{rec.machine}, tokenmill's output tok/s over the best other system: " + ", ".join(parts) + "."


def _lora_line(rec: Record) -> str:
    by = {(r.get("system"), r.get("c")): r for r in rec.rows}
    parts = []
    for (system, c), row in by.items():
        other = next((r for (s, c2), r in by.items() if c2 == c and s != system), None)
        if str(system).startswith("tokenmill") and other and other.get("lora_tok_s"):
            parts.append(f"c{c} {row['lora_tok_s'] / other['lora_tok_s']:.1f}x")
    return "With 4 adapters, tokenmill's output tok/s over vLLM's: " + ", ".join(parts) + "." if parts else ""
