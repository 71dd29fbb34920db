"""Generated blocks inside hand-written pages. A block sits between two comments,

    <!-- bench report AREA [MACHINE] -->
    ...generated...
    <!-- /bench report -->

and `fill` rewrites what is between them from the records, leaving the prose around them alone. Besides
the areas of bench/report/areas.py, `machines` is the machines table and `headline` README's sentence
of served figures. A page filled twice is unchanged the second time, which is what the test checks.
"""

from __future__ import annotations

import re
import textwrap
from collections.abc import Sequence

from bench.report.records import Record
from bench.report.tables import newest, render_block

BLOCK = re.compile(r"(<!-- bench report (?P<key>[\w-]+)(?: (?P<machine>[\w-]+))? -->\n)"
                   r"(?P<body>.*?)(<!-- /bench report -->)", re.S)


def fill(text: str, records: Sequence[Record], machines: dict[str, dict[str, str]]) -> str:
    """`text` with every block regenerated; ValueError for an unknown area or an empty block."""
    def one(m: re.Match) -> str:
        key, machine = m["key"], m["machine"]
        if key == "machines":
            body = machines_table(records, machines)
        elif key == "headline":
            body = headline(records, machines)
        else:
            body = render_block(key, records, machine)
        return f"{m[1]}{body}\n{m[5]}"

    return BLOCK.sub(one, text)


def shown(text: str) -> set[tuple[str, str | None]]:
    """The (area, machine or None) blocks a page holds."""
    return {(m["key"], m["machine"]) for m in BLOCK.finditer(text)}


def missing(texts: Sequence[str], records: Sequence[Record]) -> list[str]:
    """Areas (and machines) the data holds that no block shows: figures that would be lost."""
    blocks = set().union(*(shown(t) for t in texts)) if texts else set()
    out = []
    for area, machine in sorted({(r.area, r.machine) for r in records}):
        if (area, None) not in blocks and (area, machine) not in blocks:
            out.append(f"{area} on {machine}")
    return out


def machines_table(records: Sequence[Record], machines: dict[str, dict[str, str]]) -> str:
    """The machines the records name: key, what it is."""
    used = sorted({r.machine for r in records})
    lines = ["| machine | what it is |", "| --- | --- |"]
    lines += [f"| {key} | {machines[key]['cpu']} |" for key in used]
    return "\n".join(lines)


def headline(records: Sequence[Record], machines: dict[str, dict[str, str]]) -> str:
    """README's sentence: output tok/s at c1 and c32 of each system, on each machine of the newest
    side-by-side runs (area `peers`)."""
    parts = []
    for rec in newest(records, "peers"):
        systems = []
        for row in rec.rows:
            points = row.get("points", {})
            c1, c32 = (points.get(c, {}).get("tok_s") for c in ("1", "32"))
            if c1 is not None and c32 is not None:
                systems.append(f"{row['system']} {c1:.1f} and {c32:.1f}")
        parts.append(f"on a {machines[rec.machine]['short']} ({rec.date}, {rec.commit}): " + ", ".join(systems))
    text = ("Served side by side with the same client (`vllm bench serve`, random 128 in / 128 out, SmolLM2-135M "
            "in bf16, each server at its defaults), output tok/s at concurrency 1 and 32, " + "; ".join(parts) +
            " (docs/BENCHMARKS.md).")  # fmt: skip
    return textwrap.fill(text, width=104, break_on_hyphens=False, break_long_words=False)
