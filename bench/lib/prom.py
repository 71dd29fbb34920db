"""Reading a server's /metrics in the benchmarks: one scrape as text, and summed samples of a series."""

from __future__ import annotations

import httpx


def scrape(base_url: str) -> str:
    return httpx.get(f"{base_url}/metrics", timeout=30).text


def metric_sum(text: str, name: str, **labels: str) -> float:
    """Sum of the samples of `name` (with these labels) in a Prometheus text scrape."""
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name) or line.startswith("#"):
            continue
        head, _, value = line.rpartition(" ")
        series, _, rest = head.partition("{")
        if series != name or any(f'{k}="{v}"' not in rest for k, v in labels.items()):
            continue
        total += float(value)
    return total
