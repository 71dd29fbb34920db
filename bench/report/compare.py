"""A bench/peers/compare.sh output folder as a `peers` record.

compare.sh leaves one `vllm bench serve` result per system and concurrency, `<system>-c<N>.json`
(system: tokenmill, vllm-cpu, llama.cpp), and each server's log. The record keeps, per system and
concurrency, the figures the page shows: output tok/s, TTFT and TPOT p50/p99, requests done. The
results do not say the peers' versions: the caller names them (`labels`), from the servers' logs.
"""

from __future__ import annotations

import json
import re
from datetime import datetime
from pathlib import Path

from bench.report.records import Record

RESULT = re.compile(r"(?P<system>.+)-c(?P<c>\d+)\.json")
# system in the file names -> its name on the page, when the caller gives no label
SYSTEMS = {"tokenmill": "tokenmill", "vllm-cpu": "vLLM-cpu", "llama.cpp": "llama.cpp server"}


def point(result: dict) -> dict:
    """The figures of one `vllm bench serve` result (its JSON field names)."""
    return {"tok_s": round(result["output_throughput"], 1), "ttft_p50_ms": round(result["median_ttft_ms"]),
            "ttft_p99_ms": round(result["p99_ttft_ms"]), "tpot_p50_ms": round(result["median_tpot_ms"], 1),
            "tpot_p99_ms": round(result["p99_tpot_ms"], 1), "done": f"{result['completed']}/{result['num_prompts']}"}


def read_compare_dir(folder: Path, machine: str, commit: str, command: str, note: str = "",
                     labels: dict[str, str] | None = None) -> Record:  # fmt: skip
    """The record of one compare.sh run: a row per system (tokenmill first), a point per concurrency;
    dated by the newest result. `labels`: system (as in the file names) -> name on the page, e.g.
    {"vllm-cpu": "vLLM-cpu 0.32.0"}. ValueError when the folder holds no tokenmill result."""
    points: dict[str, dict[str, dict]] = {}
    dates = []
    for path in sorted(folder.glob("*.json")):
        m = RESULT.fullmatch(path.name)
        if not m:
            continue
        result = json.loads(path.read_text())
        points.setdefault(m["system"], {})[m["c"]] = point(result)
        dates.append(datetime.strptime(result["date"], "%Y%m%d-%H%M%S"))
    if "tokenmill" not in points:
        raise ValueError(f"{folder}: no tokenmill-c<N>.json (is it a compare.sh output folder?)")
    known = list(SYSTEMS)  # tokenmill, then the peers in compare.sh's order, then any other name
    order = sorted(points, key=lambda s: (known.index(s) if s in known else len(known), s))
    rows = []
    for system in order:
        name = (labels or {}).get(system) or SYSTEMS.get(system, system)
        rows.append({"system": name, "points": dict(sorted(points[system].items(), key=lambda kv: int(kv[0])))})
    return Record(area="peers", date=max(dates).strftime("%Y-%m-%d"), commit=commit, machine=machine,
                  command=(command,), rows=tuple(rows), note=note, source=f"compare.sh output {folder}")

