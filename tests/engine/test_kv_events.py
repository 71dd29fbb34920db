"""KV-cache events end to end: a tiny seeded model's engine publishes its prefix-cache changes on ZMQ;
a SUB socket decodes every batch with vLLM's own Struct layout and rebuilds the cached-hash set, which
must equal the block manager's. Eviction, reset, a version swap, replay and a full queue."""

from __future__ import annotations

import threading

import msgspec
import pytest
import zmq

from engine import Engine, EngineConfig, SamplingParams
from engine.config.kv_events import KVEventsConfig
from engine.kv import events as ours
from engine.kv.block_manager import BlockManager
from engine.kv.events_zmq import ZmqEventPublisher, encode_batch
from engine.request import Request

from . import kv_subscriber as vllm
from .factories import make_request
from .kv_subscriber import DECODER, AllBlocksCleared, BlockRemoved, BlockStored, Subscriber, replay

BLOCK = 4


@pytest.fixture(scope="module")
def tiny(build_model):
    return build_model("tiny-llama")


@pytest.fixture()
def publisher():
    config = KVEventsConfig(enable_kv_cache_events=True, endpoint="tcp://127.0.0.1:*",
                            replay_endpoint="tcp://127.0.0.1:*", topic="kv@w0")  # fmt: skip
    pub = ZmqEventPublisher(config)
    yield pub
    pub.close()


@pytest.fixture()
def sub(publisher):
    s = Subscriber(publisher.endpoint, topic="kv@")
    s.sync(publisher)
    yield s
    s.close()


def make_engine(path, sink, num_kv_blocks: int = 512) -> Engine:
    config = EngineConfig(model=str(path), dtype="float32", device="cpu", block_size=BLOCK,
                          num_kv_blocks=num_kv_blocks, show_progress=False)  # fmt: skip
    return Engine(config, kv_event_sink=sink)


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def prompts_with_shared_prefixes() -> list[list[int]]:
    """Three system prompts (21, 13 and 9 tokens: whole blocks and a partial one), four users each."""
    systems = [[10 + (i * 7) % 500 for i in range(21)], [600 + i for i in range(13)], [300 + 3 * i for i in range(9)]]
    return [sys + [700 + 11 * u + j for j in range(3 + u)] for sys in systems for u in range(4)]


EVENTS = [ours.BlockStored([1, 2**64 - 1], 7, list(range(8)), 4), ours.BlockStored([3], None, [9] * 4, 4),
          ours.BlockRemoved([1, 3]), ours.AllBlocksCleared()]  # fmt: skip


def test_the_encoding_is_byte_for_byte_vllm_s():
    """Our msgpack equals msgspec's encoding of vLLM's own Structs for the same batch, in both layouts."""
    maps = [vllm.BlockStored([1, 2**64 - 1], 7, list(range(8)), 4, None, "GPU", None),
            vllm.BlockStored([3], None, [9] * 4, 4, None, "GPU", None), vllm.BlockRemoved([1, 3], "GPU"),
            vllm.AllBlocksCleared()]  # fmt: skip
    ts = 1712345678.25
    assert encode_batch(ts, EVENTS) == msgspec.msgpack.encode(vllm.KVEventBatch(ts, maps, 0))
    arrays = [vllm.ArrayBlockStored([1, 2**64 - 1], 7, list(range(8)), 4, None, "GPU", None),
              vllm.ArrayBlockStored([3], None, [9] * 4, 4, None, "GPU", None),
              vllm.ArrayBlockRemoved([1, 3], "GPU"), vllm.ArrayAllBlocksCleared()]  # fmt: skip
    assert encode_batch(ts, EVENTS, encoding="array") == msgspec.msgpack.encode(vllm.ArrayKVEventBatch(ts, arrays, 0))
    assert msgspec.msgpack.decode(encode_batch(ts, EVENTS[3:]))[1] == [{"type": "AllBlocksCleared"}]


def test_the_array_encoding_is_published_when_asked():
    config = KVEventsConfig(enable_kv_cache_events=True, endpoint="tcp://127.0.0.1:*", encoding="array")
    pub = ZmqEventPublisher(config)
    ctx = zmq.Context()
    try:
        sock = ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        sock.connect(pub.endpoint)
        decoder = msgspec.msgpack.Decoder(type=vllm.ArrayKVEventBatch)
        got: list = []
        for _ in range(200):  # until the subscription is live and one batch of EVENTS arrived
            pub.publish(EVENTS)
            if sock.poll(50):
                got = decoder.decode(sock.recv_multipart()[2]).events
                break
        assert [type(e).__name__ for e in got] == ["ArrayBlockStored"] * 2 + ["ArrayBlockRemoved", "ArrayAllBlocksCleared"]
        assert got[0].block_hashes == [1, 2**64 - 1] and got[0].token_ids == list(range(8))
    finally:
        ctx.destroy(linger=0)
        pub.close()


def test_events_rebuild_the_prefix_cache_exactly(tiny, publisher, sub):
    engine = make_engine(tiny, publisher)
    prompts = prompts_with_shared_prefixes()
    engine.generate(prompts[::2], greedy(5))  # half, together
    for p in prompts[1::2]:  # the rest one by one: they hit the prefixes cached above
        engine.generate([p], greedy(3))
    sub.drain(publisher)
    assert engine.stats().prefix_cache_hits > 0
    cached = engine.block_manager.cached_hashes()
    assert len(cached) > 12
    assert sub.state == cached
    assert sub.topics == {b"kv@w0"}
    stored = sub.of_type(BlockStored)
    assert all(e.block_size == BLOCK and e.medium == "GPU" and e.lora_name is None for e in stored)
    assert isinstance(sub.events[0], AllBlocksCleared)  # the engine's start: forget this worker's past
    assert not sub.of_type(BlockRemoved)  # 512 blocks: nothing evicted
    engine.check_integrity()


def test_a_chain_s_tokens_and_parents_match_the_prompt(tiny, publisher, sub):
    engine = make_engine(tiny, publisher)
    prompt = [5 + i for i in range(4 * BLOCK + 2)]
    engine.generate([prompt], greedy(1))
    sub.drain(publisher)
    stored = sub.of_type(BlockStored)
    tokens = [t for e in stored for t in e.token_ids]
    assert tokens == prompt[: 4 * BLOCK]  # the full prompt blocks, in order (the partial tail is not)
    assert stored[0].parent_block_hash is None
    chain = [h for e in stored for h in e.block_hashes]
    for e in stored[1:]:  # each event continues the chain the one before ended
        assert e.parent_block_hash == chain[chain.index(e.block_hashes[0]) - 1]


def test_eviction_publishes_block_removed(tiny, publisher, sub):
    engine = make_engine(tiny, publisher, num_kv_blocks=12)  # 48 tokens: distinct prompts push others out
    for i in range(6):
        engine.generate([[100 * i + j for j in range(4 * BLOCK + 1)]], greedy(2))
    sub.drain(publisher)
    removed = [h for e in sub.of_type(BlockRemoved) for h in e.block_hashes]
    assert removed, "no eviction was published"
    assert set(removed) <= sub.parents_seen  # only hashes that were stored before
    assert sub.state == engine.block_manager.cached_hashes()
    engine.check_integrity()


def test_reset_publishes_all_blocks_cleared(tiny, publisher, sub):
    engine = make_engine(tiny, publisher)
    engine.generate([[7 + i for i in range(3 * BLOCK)]], greedy(2))
    sub.drain(publisher)
    assert sub.state
    assert engine.reset_prefix_cache()
    sub.drain(publisher)
    assert isinstance(sub.events[-1], AllBlocksCleared)
    assert sub.state == set() == engine.block_manager.cached_hashes()


def test_version_swap_clears_then_retires_the_old_engine(tiny, build_model, publisher, sub):
    sub.strict = False  # the old engine retires blocks the new one's clear already dropped
    old = make_engine(tiny, publisher)
    old.generate([[9 + i for i in range(3 * BLOCK)]], greedy(2))
    sub.drain(publisher)
    old_hashes = old.block_manager.cached_hashes()
    assert sub.state == old_hashes
    new = make_engine(build_model("tiny-llama-b"), publisher)  # the new version starts: AllBlocksCleared
    sub.drain(publisher)
    assert isinstance(sub.events[-1], AllBlocksCleared) and sub.state == set()
    old.generate([[400 + i for i in range(2 * BLOCK + 1)]], greedy(1))  # still draining
    new.generate([[9 + i for i in range(3 * BLOCK)]], greedy(2))  # same tokens, its own hashes
    old.retire_kv_events()  # the old version unloads
    sub.drain(publisher)
    assert not old_hashes & new.block_manager.cached_hashes()  # engines never share a hash
    assert sub.state == new.block_manager.cached_hashes()


def test_replay_returns_the_buffered_batches_from_a_sequence_number(tiny, publisher, sub):
    engine = make_engine(tiny, publisher)
    for i in range(3):
        engine.generate([[50 * i + j for j in range(2 * BLOCK + 1)]], greedy(2))
    sub.drain(publisher)
    start = sub.last_seq - 3
    got = replay(publisher.replay_endpoint, start)
    assert [seq for seq, _ in got] == list(range(start, sub.last_seq + 1))
    assert all(payload == sub.batches[seq] for seq, payload in got)
    assert all(DECODER.decode(payload).data_parallel_rank == 0 for _, payload in got)
    assert publisher.stats().replay_requests == 1


def test_a_full_queue_drops_counts_and_the_engine_resyncs(tiny):
    config = KVEventsConfig(enable_kv_cache_events=True, endpoint="tcp://127.0.0.1:*", max_queue_size=2)
    pub = ZmqEventPublisher(config, start=False)  # no sender yet: the queue fills and stays full
    try:
        engine = make_engine(tiny, pub)
        prompts = prompts_with_shared_prefixes()
        done = threading.Event()

        def run() -> None:
            for p in prompts[:6]:
                engine.generate([p], greedy(3))
            done.set()

        worker = threading.Thread(target=run, daemon=True)
        worker.start()
        worker.join(120)
        assert done.is_set(), "the engine waited on the full queue"
        st = pub.stats()
        assert st.batches_dropped > 0 and st.events_dropped > 0 and st.queue_size == 2
        pub.start()  # the consumer catches up; what was dropped is gone for good
        sub = Subscriber(pub.endpoint)
        try:
            sub.sync(pub)
            engine.generate([prompts[7]], greedy(2))  # the next step re-announces the whole cache
            sub.drain(pub)
            assert isinstance(sub.of_type(AllBlocksCleared)[-1], AllBlocksCleared)
            assert sub.state == engine.block_manager.cached_hashes()
            assert pub.stats().batches_dropped == st.batches_dropped  # none dropped once it drained
        finally:
            sub.close()
    finally:
        pub.close()


def test_a_publisher_without_a_wildcard_connects_to_a_bound_consumer(tiny):
    """vLLM's rule: `tcp://host:port` is connected to (the consumer binds). What it sends before the
    connection is up is lost (ZMQ), which a consumer recovers from the replay socket; after it, the
    stream is the same."""
    sub = Subscriber("tcp://127.0.0.1:*", bind=True)
    endpoint = sub.sock.getsockopt_string(zmq.LAST_ENDPOINT)
    pub = ZmqEventPublisher(KVEventsConfig(enable_kv_cache_events=True, endpoint=endpoint))
    try:
        assert pub.endpoint == endpoint
        sub.sync(pub)
        engine = make_engine(tiny, pub)
        engine.generate(prompts_with_shared_prefixes()[:3], greedy(2))
        sub.drain(pub)
        assert sub.state == engine.block_manager.cached_hashes() != set()
    finally:
        pub.close()
        sub.close()


# -- the block manager alone (no model): what it records --------------------------------------------------
def _registered(bm: BlockManager, tokens: list[int]) -> Request:
    req = make_request("r" + str(tokens[0]), len(tokens), tokens=tokens)
    bm.acquire_cached_prefix(req, bm.find_cached_prefix(req))
    assert bm.allocate(req, req.num_tokens - req.num_computed_tokens)
    req.num_computed_tokens = req.num_tokens
    bm.register_computed_blocks(req)
    return req


def test_a_snapshot_replays_to_the_cache_with_parents_first():
    bm = BlockManager(16, BLOCK, record_events=True, event_hash_salt=12345)
    a = _registered(bm, list(range(1, 13)))  # 3 blocks
    b = _registered(bm, list(range(1, 9)) + [50, 51, 52, 53, 60])  # shares 2, adds 1 (+ a partial)
    stored = [e for e in bm.take_events() if isinstance(e, ours.BlockStored)]
    assert [len(e.block_hashes) for e in stored] == [3, 1]  # b's run starts after its cached prefix
    assert stored[1].parent_block_hash == stored[0].block_hashes[1]
    view = vllm.CacheView()
    snapshot = bm.snapshot_events()
    view.apply(DECODER.decode(encode_batch(0.0, snapshot)))  # strict: every parent before its child
    assert view.state == bm.cached_hashes() and len(view.state) == 4
    assert bm.take_events() == []  # a snapshot records nothing
    assert not bm.reset_prefix_cache()  # blocks are held: nothing changes
    bm.free(a)
    bm.free(b)
    assert bm.reset_prefix_cache() and bm.cached_hashes() == set()
    assert bm.take_events() == [ours.AllBlocksCleared()]


def test_nothing_is_recorded_without_record_events():
    bm = BlockManager(16, BLOCK)
    _registered(bm, list(range(1, 13)))
    assert bm.take_events() == [] and len(bm.cached_hashes()) == 3


def test_an_adapter_s_blocks_carry_its_id_and_start_their_own_chain():
    """A prompt cached under a LoRA adapter and on the base model: two chains, the adapter's events carry
    its lora_id, and neither names a parent (the adapter's salt is no block a consumer ever saw)."""
    bm = BlockManager(16, 4, record_events=True)
    base = make_request("base", 8, tokens=list(range(1, 9)))
    adapted = make_request("lora", 8, tokens=list(range(1, 9)))
    adapted.lora_id = 7
    for req in (base, adapted):
        assert bm.find_cached_prefix(req) == []  # the base model's blocks do not serve the adapter
        assert bm.allocate(req, 8)
        req.num_computed_tokens = 8
        bm.register_computed_blocks(req)
    stored = [e for e in bm.take_events() if isinstance(e, ours.BlockStored)]
    assert [(e.lora_id, e.parent_block_hash, len(e.block_hashes)) for e in stored] == [(None, None, 2), (7, None, 2)]
    assert not set(stored[0].block_hashes) & set(stored[1].block_hashes)
    snapshot = [e for e in bm.snapshot_events() if isinstance(e, ours.BlockStored)]
    firsts = {e.lora_id: e.parent_block_hash for e in snapshot if e.token_ids == [1, 2, 3, 4]}
    assert firsts == {None: None, 7: None}
    assert {e.lora_id for e in snapshot} == {None, 7}
