from engine.kv.block_manager import BlockManager

from .factories import make_request


def test_allocate_and_free_keep_counts():
    bm = BlockManager(8, 4)
    r = make_request("a", 10)
    assert bm.allocate(r, 10)
    assert len(r.block_ids) == 3 and bm.num_free_blocks == 5
    bm.check_integrity([r])
    bm.free(r)
    assert bm.num_free_blocks == 8 and r.block_ids == []
    bm.check_integrity([])


def test_allocate_refuses_without_change_when_full():
    bm = BlockManager(2, 4)
    r = make_request("a", 12)
    assert not bm.allocate(r, 12)
    assert r.block_ids == [] and bm.num_free_blocks == 2


def test_prefix_cache_hit_shares_blocks_and_compares_tokens():
    bm = BlockManager(16, 4)
    a = make_request("a", 10)
    bm.allocate(a, 10)
    a.num_computed_tokens = 10
    bm.register_computed_blocks(a)  # 2 full blocks registered; the partial third is not
    b = make_request("b", 10)  # same tokens
    hits = bm.find_cached_prefix(b)
    assert hits == a.block_ids[:2]
    bm.acquire_cached_prefix(b, hits)
    assert b.num_computed_tokens == 8
    assert bm.blocks[hits[0]].ref_count == 2
    bm.check_integrity([a, b])
    c = make_request("c", 10, tokens=[1] * 10)  # different tokens: no hit
    assert bm.find_cached_prefix(c) == []


def test_last_token_is_never_served_from_cache():
    bm = BlockManager(16, 4)
    a = make_request("a", 8)
    bm.allocate(a, 8)
    a.num_computed_tokens = 8
    bm.register_computed_blocks(a)
    b = make_request("b", 8)  # identical 8-token prompt: only the first block may be reused
    assert len(bm.find_cached_prefix(b)) == 1


def test_freed_cached_blocks_are_reused_then_evicted_lru():
    bm = BlockManager(4, 4)
    a = make_request("a", 8)
    bm.allocate(a, 8)
    a.num_computed_tokens = 8
    bm.register_computed_blocks(a)
    bm.free(a)
    assert bm.num_free_blocks == 4
    b = make_request("b", 9)  # same first 8 tokens
    assert len(bm.find_cached_prefix(b)) == 2  # still cached while free
    # Fill the cache with other tokens: the cached blocks are evicted (tail block first).
    c = make_request("c", 12, tokens=[3] * 12)
    assert bm.allocate(c, 12)
    assert len(bm.find_cached_prefix(b)) == 1  # head block survived, tail evicted
    bm.check_integrity([c])


def test_hash_collision_is_caught_by_token_comparison(monkeypatch):
    import engine.kv.block_manager as mod

    monkeypatch.setattr(mod, "chain_hash", lambda parent, tokens: 42)  # every block collides
    bm = BlockManager(8, 4)
    a = make_request("a", 5, tokens=[1, 2, 3, 4, 5])
    bm.allocate(a, 5)
    a.num_computed_tokens = 5
    bm.register_computed_blocks(a)
    b = make_request("b", 5, tokens=[9, 9, 9, 9, 9])
    assert bm.find_cached_prefix(b) == []


def test_integrity_check_detects_corruption():
    bm = BlockManager(4, 4)
    r = make_request("a", 4)
    bm.allocate(r, 4)
    bm.blocks[r.block_ids[0]].ref_count = 2
    try:
        bm.check_integrity([r])
    except RuntimeError as e:
        assert "ref_count" in str(e)
    else:
        raise AssertionError("corruption not detected")
