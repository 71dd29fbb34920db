"""A KV-events consumer for tests: a ZMQ SUB socket that decodes every batch with msgspec Structs
declared the way vLLM declares them, and rebuilds the publisher's set of cached block hashes from the
events."""

from __future__ import annotations

import time
from typing import Any

import msgspec
import zmq

from engine.kv.events_zmq import END_SEQ


# -- vLLM's event classes, as a consumer declares them (vllm/distributed/kv_events.py). The batch is
# array_like; the events are tagged Structs encoded as maps ({"type": ..., fields}), the layout
# vllm-router 0.1.17 decodes. Fields of the releases between `lora_name` (vllm#27577) and `extra_keys`.
class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


DECODER = msgspec.msgpack.Decoder(type=KVEventBatch)


# -- the same classes with array_like events (vLLM's earlier layout; `"encoding": "array"`) --------------
class ArrayEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class ArrayBlockStored(ArrayEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None


class ArrayBlockRemoved(ArrayEvent, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None


class ArrayAllBlocksCleared(ArrayEvent, tag="AllBlocksCleared"):
    pass


class ArrayKVEventBatch(EventBatch):
    events: list[ArrayBlockStored | ArrayBlockRemoved | ArrayAllBlocksCleared]


class CacheView:
    """The set of hashes a worker's events say are cached, rebuilt event by event. `strict`: every
    parent was stored before and every removed hash is held (a consumer that saw the whole stream)."""

    def __init__(self, strict: bool = True) -> None:
        self.strict = strict
        self.state: set[int] = set()
        self.parents_seen: set[int] = set()  # every hash ever stored
        self.events: list[Any] = []

    def apply(self, batch: KVEventBatch) -> None:
        for ev in batch.events:
            self.events.append(ev)
            if isinstance(ev, BlockStored):
                assert len(ev.token_ids) == ev.block_size * len(ev.block_hashes)
                assert not self.strict or ev.parent_block_hash is None or ev.parent_block_hash in self.parents_seen
                assert not self.state & set(ev.block_hashes), "a hash stored twice"
                self.state.update(ev.block_hashes)
                self.parents_seen.update(ev.block_hashes)
            elif isinstance(ev, BlockRemoved):
                assert not self.strict or set(ev.block_hashes) <= self.state, "removed an unknown hash"
                self.state.difference_update(ev.block_hashes)
            else:
                self.state.clear()

    def of_type(self, kind: type) -> list[Any]:
        return [e for e in self.events if isinstance(e, kind)]


class Subscriber(CacheView):
    """A SUB socket on `endpoint` (connected, or bound with `bind`) feeding the view."""

    def __init__(self, endpoint: str, topic: str = "", bind: bool = False, strict: bool = True) -> None:
        super().__init__(strict)
        self._ctx = zmq.Context()
        self.sock = self._ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt_string(zmq.SUBSCRIBE, topic)
        (self.sock.bind if bind else self.sock.connect)(endpoint)
        self.batches: dict[int, bytes] = {}  # seq -> payload
        self.last_seq = -1
        self.topics: set[bytes] = set()

    def sync(self, publisher, timeout: float = 10.0) -> None:
        """Wait until the subscription is live (ZMQ drops what a PUB sends before a SUB has joined):
        publish empty batches until one arrives."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            publisher.publish([])
            if self.sock.poll(50):
                self.receive_until(lambda: True, timeout=1.0)
                return
        raise AssertionError("the subscription never went live")

    def receive_until(self, done, timeout: float = 10.0) -> None:
        """Receive and apply batches until done() holds after one (or raise after `timeout`)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.sock.poll(50):
                continue
            self._receive_one()
            if done():
                return
        raise AssertionError(f"timed out at seq {self.last_seq}")

    def drain(self, publisher, timeout: float = 10.0) -> None:
        """Receive everything the publisher has sent (it must have been synced): until its queue is
        empty, every sent sequence number has arrived, and nothing more comes for 100 ms."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            st = publisher.stats()
            if self.sock.poll(100):
                self._receive_one()
            elif st.queue_size == 0 and self.last_seq >= st.batches_published - 1:
                return
        raise AssertionError(f"drain timed out at seq {self.last_seq}")

    def _receive_one(self) -> None:
        topic, seq_bytes, payload = self.sock.recv_multipart()
        self.topics.add(topic)
        seq = int.from_bytes(seq_bytes, "big")
        assert self.last_seq == -1 or seq == self.last_seq + 1, f"gap: {self.last_seq} -> {seq}"
        self.last_seq = seq
        self.batches[seq] = payload
        self.apply(DECODER.decode(payload))

    def close(self) -> None:
        self._ctx.destroy(linger=0)


def replay(endpoint: str, start_seq: int, timeout_ms: int = 5000) -> list[tuple[int, bytes]]:
    """Ask the replay socket for every buffered batch from `start_seq`: [(seq, payload), ...]. A DEALER
    (one request, many replies), framing as a REQ would: an empty delimiter first."""
    ctx = zmq.Context()
    try:
        req = ctx.socket(zmq.DEALER)
        req.setsockopt(zmq.LINGER, 0)
        req.connect(endpoint)
        req.send_multipart((b"", start_seq.to_bytes(8, "big")))
        out: list[tuple[int, bytes]] = []
        while True:
            assert req.poll(timeout_ms), "no replay answer"
            empty, seq_bytes, payload = req.recv_multipart()
            assert empty == b""
            if seq_bytes == END_SEQ:
                return out
            out.append((int.from_bytes(seq_bytes, "big"), payload))
    finally:
        ctx.destroy(linger=0)
