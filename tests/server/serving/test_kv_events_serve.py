"""`--kv-events-config` as vLLM spells it: parsed and checked naming the field, off by default; with it,
the served engine publishes its prefix cache on ZMQ (history readable from the replay socket), /metrics
counts published and dropped batches, and a version's worker retires its blocks when it ends."""

from __future__ import annotations

import json
from collections.abc import Sequence

import httpx
import pytest
import zmq
from pydantic import ValidationError

from engine.kv.events import BlockRemoved, KVCacheEvent, KVEventsStats
from server.cli import build_parsers, main
from server.config.flags import parse_settings
from server.config.vllm_flags import flag_problems

from ...engine.kv_subscriber import DECODER, CacheView, Subscriber, replay
from ..fake_engine import FakeEngine
from ..helpers import make_settings, run_server, wait_until
from ..ops.test_metrics import Scrape
from .test_shutdown import free_port


def test_flag_parses_vllm_json_and_names_bad_fields(monkeypatch):
    assert parse_settings([]).kv_events().publishes is False  # off by default
    js = '{"enable_kv_cache_events": true, "endpoint": "tcp://*:6000", "replay_endpoint": "tcp://*:6001", "topic": "kv"}'
    cfg = parse_settings(["--kv-events-config", js]).kv_events()
    assert (cfg.publisher, cfg.endpoint, cfg.replay_endpoint, cfg.topic, cfg.publishes) == (
        "zmq", "tcp://*:6000", "tcp://*:6001", "kv", True)
    assert parse_settings(["--kv-events-config", '{"enable_kv_cache_events": true, "publisher": "null"}']
                          ).kv_events().publishes is False  # fmt: skip
    monkeypatch.setenv("TOKENMILL_KV_EVENTS_CONFIG", '{"enable_kv_cache_events": true, "hwm": 10}')
    assert parse_settings([]).kv_events().hwm == 10
    assert flag_problems(build_parsers()[1], ["--kv-events-config", js]) is None
    for bad, word in (("{not json", "kv_events_config is not valid JSON"),
                      ('{"enable_kv_cache_event": true}', "unknown field 'enable_kv_cache_event'"),
                      ('{"publisher": "kafka"}', "kv_events_config.publisher"),
                      ('{"buffer_steps": 0}', "kv_events_config.buffer_steps"),
                      ('{"enable_kv_cache_events": "yes"}', "kv_events_config.enable_kv_cache_events"),
                      ('{"encoding": "cbor"}', "kv_events_config.encoding"),
                      ("[1]", "must be a JSON object")):  # fmt: skip
        with pytest.raises(ValidationError, match=word):
            parse_settings(["--kv-events-config", bad])


def test_serve_refuses_an_endpoint_it_cannot_bind_before_loading(capsys):
    ctx = zmq.Context()
    try:
        taken = ctx.socket(zmq.PUB)
        taken.bind("tcp://127.0.0.1:*")
        port = taken.getsockopt_string(zmq.LAST_ENDPOINT).rsplit(":", 1)[1]
        config = json.dumps({"enable_kv_cache_events": True, "endpoint": f"tcp://*:{port}"})
        assert main(["serve", "/no/such/model", "--kv-events-config", config]) == 2
        err = capsys.readouterr().err
        assert f"tcp://*:{port}" in err and "cannot open" in err
    finally:
        ctx.destroy(linger=0)


def test_served_engine_publishes_its_prefix_cache(tiny_model_path):
    """The real engine loaded by the server: the replay socket's history, decoded from seq 0, rebuilds
    exactly the block manager's cached hashes; /metrics counts the batches. The PUB socket connects
    (vLLM's rule for an address without a wildcard) to a SUB the consumer bound."""
    pub_port, replay_port = free_port(), free_port()
    sub = Subscriber(f"tcp://127.0.0.1:{pub_port}", bind=True)  # the publisher connects to it (no wildcard)
    config = {"enable_kv_cache_events": True, "endpoint": f"tcp://127.0.0.1:{pub_port}",
              "replay_endpoint": f"tcp://127.0.0.1:{replay_port}"}  # fmt: skip
    settings = make_settings(model=tiny_model_path, warmup=False, block_size=4, kv_events_config=json.dumps(config))
    try:
        with run_server(settings, None) as srv:
            system = "You are a terse assistant who answers in one word. " * 3
            for q in ("Why?", "How?", "When?"):
                r = httpx.post(f"{srv.url}/v1/completions", json={"prompt": system + q, "max_tokens": 3}, timeout=60)
                assert r.status_code == 200
            srv.wait_idle()
            wait_until(lambda: Scrape(srv.url).get("tokenmill_kv_events_queue_batches") == 0, what="queue sent")
            engine = srv.runtime.worker._engine  # idle: reading its block manager is safe
            cached = engine.block_manager.cached_hashes()
            assert cached and engine.stats().prefix_cache_hits > 0
            history = replay(f"tcp://127.0.0.1:{replay_port}", 0)
            assert [seq for seq, _ in history] == list(range(len(history)))  # everything since start
            rebuilt = CacheView()
            for _, payload in history:
                rebuilt.apply(DECODER.decode(payload))
            assert rebuilt.state == cached
            scrape = Scrape(srv.url)
            assert scrape.get("tokenmill_kv_events_published_batches_total") == len(history)
            assert scrape.get("tokenmill_kv_events_dropped_total") == 0
    finally:
        sub.close()


def test_metrics_have_no_kv_event_series_when_events_are_off():
    with run_server(make_settings(warmup=False), FakeEngine()) as srv:
        assert "tokenmill_kv_events" not in Scrape(srv.url).text


class ListSink:
    """A KVEventSink keeping every batch (the worker thread publishes, the test reads after it ended)."""

    def __init__(self) -> None:
        self.batches: list[list[KVCacheEvent]] = []

    def publish(self, events: Sequence[KVCacheEvent]) -> bool:
        self.batches.append(list(events))
        return True

    def has_room(self) -> bool:
        return True

    def stats(self) -> KVEventsStats:
        return KVEventsStats(batches_published=len(self.batches))

    def close(self) -> None:
        return None


def test_a_stopped_worker_retires_its_engine_s_blocks():
    sink = ListSink()
    engine = FakeEngine(block_size=4, kv_event_sink=sink)
    with run_server(make_settings(warmup=False), engine) as srv:
        r = httpx.post(f"{srv.url}/v1/completions", json={"prompt": "a shared prefix of some length", "max_tokens": 2})
        assert r.status_code == 200
        srv.wait_idle()
        cached = engine.block_manager.cached_hashes()
        assert cached
    last = sink.batches[-1]
    assert last == [BlockRemoved(sorted(cached))]
