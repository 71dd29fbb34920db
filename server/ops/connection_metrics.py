"""Prometheus series of the connection layer, read from the `ConnectionGuard` at scrape time."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from server.http.connections import ConnectionGuard

# Why the server closed a connection (label `reason` of tokenmill_http_connections_closed_total).
CLOSE_REASONS = ("keep_alive_timeout", "header_timeout", "body_timeout", "slow_client", "evicted", "refused",
                 "bad_framing", "shutdown")  # fmt: skip


class ConnectionCollector(Collector):
    """Open connections, connections the server closed by reason, and failed accept() calls."""

    def __init__(self, guard: ConnectionGuard) -> None:
        self._guard = guard

    def collect(self) -> Iterator[Metric]:
        g = self._guard
        yield GaugeMetricFamily("tokenmill_http_connections", "Open client connections (counted against "
                                "max_connections).", value=g.open_connections)  # fmt: skip
        closed = CounterMetricFamily("tokenmill_http_connections_closed", "Connections the server closed, by "
                                     "reason (timeouts, slow clients, the cap, bad framing, shutdown).",
                                     labels=["reason"])  # fmt: skip
        for reason in (*CLOSE_REASONS, *sorted(set(g.closed) - set(CLOSE_REASONS))):
            closed.add_metric([reason], g.closed.get(reason, 0))
        yield closed
        yield CounterMetricFamily("tokenmill_http_accept_errors", "accept() calls that failed (open-files "
                                  "limit reached); logged once per interval.", value=g.accept_errors)  # fmt: skip
