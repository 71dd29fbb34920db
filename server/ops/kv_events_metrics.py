"""Prometheus series of the KV-cache events publisher, read from its typed stats at scrape time."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from engine.kv.events import KVEventsStats


class KVEventsCollector(Collector):
    """Batches and events published and dropped, the sender's queue, replay requests (process-wide:
    one publisher serves every model version)."""

    def __init__(self, stats: Callable[[], KVEventsStats]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        st = self._stats()
        c, g = CounterMetricFamily, GaugeMetricFamily
        yield c("tokenmill_kv_events_published_batches", "KV-cache event batches (one per engine step) sent "
                "on the ZMQ socket.", value=st.batches_published)  # fmt: skip
        yield c("tokenmill_kv_events_published", "KV-cache events sent on the ZMQ socket.",
                value=st.events_published)
        yield c("tokenmill_kv_events_dropped_batches", "KV-cache event batches dropped because the sender's "
                "queue was full (the engine never waits; it re-announces its cache next step).",
                value=st.batches_dropped)  # fmt: skip
        yield c("tokenmill_kv_events_dropped", "KV-cache events dropped with those batches.",
                value=st.events_dropped)
        yield g("tokenmill_kv_events_queue_batches", "KV-cache event batches waiting for the sender thread.",
                value=st.queue_size)
        yield c("tokenmill_kv_events_replay_requests", "Replay requests answered on the replay socket.",
                value=st.replay_requests)
