"""KV-cache events on the wire, as vLLM's `ZmqEventPublisher` sends them (imports zmq and msgpack only).

Messages: a ZMQ PUB multipart `[topic, seq, payload]`, `seq` an 8-byte big-endian counter from 0 (one
per batch = one engine step), `payload` msgpack of vLLM's `EventBatch`, positional (msgspec
`array_like`), its events tagged msgspec Structs:

    EventBatch       [ts: float, events: [...], data_parallel_rank: int]
    encoding "map" (vLLM's current layout; vllm-router 0.1.17 decodes it):
    BlockStored      {"type": "BlockStored", "block_hashes", "parent_block_hash", "token_ids",
                      "block_size", "lora_id", "medium", "lora_name"}
    BlockRemoved     {"type": "BlockRemoved", "block_hashes", "medium"}
    AllBlocksCleared {"type": "AllBlocksCleared"}
    encoding "array" (vLLM releases whose events were array_like too; positional decoders):
    BlockStored      ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size,
                      lora_id, medium, lora_name]
    BlockRemoved     ["BlockRemoved", block_hashes, medium]
    AllBlocksCleared ["AllBlocksCleared"]

Replay (optional): a ROUTER socket; a client (REQ or DEALER) sends the first sequence number it wants
as 8 bytes big-endian and gets `[seq, payload]` for each buffered batch from there, then `[-1 (8 bytes,
signed), b""]`.

The engine's thread only enqueues (`publish` never waits: a full queue drops the batch and counts it);
encoding, sending and replay run on one sender thread that owns both sockets.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence

import msgpack
import zmq

from engine.config.kv_events import KVEventsConfig
from engine.kv.events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent, KVEventsStats

log = logging.getLogger("tokenmill.kv_events")

END_SEQ = (-1).to_bytes(8, "big", signed=True)  # replay's end marker
_POLL_S = 0.05  # the sender thread's longest wait for a batch (it also answers replay requests between)
_CLOSE_GRACE_S = 1.0  # close(): time left to send what is queued


def encode_event(event: KVCacheEvent, encoding: str = "map") -> dict | list:
    """One event as msgspec lays out vLLM's Struct: a map tagged by "type" (fields in declaration order,
    defaults omitted), or with `encoding="array"` a positional array whose first item is the tag."""
    if isinstance(event, BlockStored):
        fields = {"block_hashes": event.block_hashes, "parent_block_hash": event.parent_block_hash,
                  "token_ids": event.token_ids, "block_size": event.block_size, "lora_id": event.lora_id,
                  "medium": event.medium, "lora_name": event.lora_name}  # fmt: skip
    elif isinstance(event, BlockRemoved):
        fields = {"block_hashes": event.block_hashes, "medium": event.medium}
    elif isinstance(event, AllBlocksCleared):
        fields = {}
    else:
        raise TypeError(f"not a KV-cache event: {event!r}")
    tag = type(event).__name__
    return [tag, *fields.values()] if encoding == "array" else {"type": tag, **fields}


def encode_batch(ts: float, events: Sequence[KVCacheEvent], data_parallel_rank: int = 0,
                 encoding: str = "map") -> bytes:  # fmt: skip
    """vLLM's EventBatch(ts, events, data_parallel_rank) as msgpack bytes."""
    return msgpack.packb([ts, [encode_event(e, encoding) for e in events], data_parallel_rank], use_bin_type=True)


def binds(endpoint: str) -> bool:
    """vLLM's rule: a wildcard or local-transport address is bound, any other is connected to."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class ZmqEventPublisher:
    """A `KVEventSink` (engine/kv/events.py) that publishes on ZMQ PUB, with a replay buffer."""

    def __init__(self, config: KVEventsConfig, *, data_parallel_rank: int = 0,
                 clock: Callable[[], float] = time.time, start: bool = True) -> None:  # fmt: skip
        """Binds (or connects) the sockets now, so a taken port fails here. `start=False` leaves the
        sender thread for `start()` (tests fill the queue first)."""
        self.config = config
        self._rank = data_parallel_rank
        self._clock = clock
        self._queue: queue.Queue[tuple[float, Sequence[KVCacheEvent]] | None] = queue.Queue(config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)  # (seq, payload) for replay
        self._topic = config.topic.encode()
        self._ctx = zmq.Context()  # its own context: closing it never touches another component's sockets
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, config.hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._replay: zmq.Socket | None = None
        try:
            (self._pub.bind if binds(config.endpoint) else self._pub.connect)(config.endpoint)
            if config.replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.bind(config.replay_endpoint)
        except zmq.ZMQError as exc:
            self._ctx.destroy(linger=0)
            raise ValueError(f"kv_events_config: cannot open {exc.strerror}: endpoint {config.endpoint!r}, "
                             f"replay_endpoint {config.replay_endpoint!r}") from None  # fmt: skip
        # counters: the sender thread writes the sent ones; engines' threads (one per model version) the
        # dropped ones, under the lock (taken on the drop path only)
        self._drop_lock = threading.Lock()
        self._dropped_batches = self._dropped_events = 0
        self._sent_batches = self._sent_events = self._replays = 0
        self._running = True
        self._thread = threading.Thread(target=self._run, name="tokenmill-kv-events", daemon=True)
        if start:
            self._thread.start()

    # ---- addresses (the real ports when the config asked for any free one: "tcp://*:*") ------------
    @property
    def endpoint(self) -> str:
        return self._pub.getsockopt_string(zmq.LAST_ENDPOINT) if binds(self.config.endpoint) else self.config.endpoint

    @property
    def replay_endpoint(self) -> str | None:
        return None if self._replay is None else self._replay.getsockopt_string(zmq.LAST_ENDPOINT)

    # ---- the engine's side -----------------------------------------------------------------------
    def publish(self, events: Sequence[KVCacheEvent]) -> bool:
        """Queue one step's events (engine thread). False, counted, when the queue is full or closed."""
        if self._running:
            try:
                self._queue.put_nowait((self._clock(), events))
                return True
            except queue.Full:
                pass
        with self._drop_lock:
            self._dropped_batches += 1
            self._dropped_events += len(events)
        return False

    def has_room(self) -> bool:
        return self._running and not self._queue.full()

    def stats(self) -> KVEventsStats:
        return KVEventsStats(batches_published=self._sent_batches, events_published=self._sent_events,
                             batches_dropped=self._dropped_batches, events_dropped=self._dropped_events,
                             queue_size=self._queue.qsize(), replay_requests=self._replays)  # fmt: skip

    def start(self) -> None:
        if not self._thread.is_alive():
            self._thread.start()

    def close(self) -> None:
        """Send what is queued (up to a second), stop the thread, close the sockets."""
        self._running = False
        if self._thread.is_alive():
            deadline = time.monotonic() + _CLOSE_GRACE_S
            while not self._queue.empty() and time.monotonic() < deadline:
                time.sleep(0.01)
            try:
                self._queue.put_nowait(None)
            except queue.Full:  # the thread is stuck past the grace period; it is a daemon
                pass
            self._thread.join(_CLOSE_GRACE_S)
        if not self._thread.is_alive():
            self._ctx.destroy(linger=0)

    # ---- the sender thread -----------------------------------------------------------------------
    def _run(self) -> None:
        seq = 0
        while True:
            if self._replay is not None and self._replay.poll(0):
                self._serve_replay()
            try:
                item = self._queue.get(timeout=_POLL_S)
            except queue.Empty:
                if not self._running:
                    return
                continue
            if item is None:
                return
            ts, events = item
            payload = encode_batch(ts, events, self._rank, self.config.encoding)
            try:
                self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload), flags=zmq.NOBLOCK)
            except zmq.Again:  # a connected PUB with no peer yet; the batch stays replayable
                pass
            self._buffer.append((seq, payload))
            seq += 1
            self._sent_batches += 1
            self._sent_events += len(events)

    def _serve_replay(self) -> None:
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:  # [identity, b"", start seq]: anything else is ignored
            log.warning("kv events: malformed replay request (%d frames)", len(frames))
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        self._replays += 1  # counted before the answer: a client that reads the stats after its END sees it
        for seq, payload in list(self._buffer):
            if seq >= first:
                self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", END_SEQ, b""))


def open_publisher(config: KVEventsConfig) -> ZmqEventPublisher | None:
    """The publisher the config asks for, started; None when events are off (nothing is recorded)."""
    return ZmqEventPublisher(config) if config.publishes else None
