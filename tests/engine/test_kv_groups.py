"""KV-cache groups in the block manager (engine/kv/groups.py): which layers form which group, a sliding
group's blocks freed as its window passes while the full group keeps them, allocation in every group or
none, and the prefix-hit rule (a sliding group needs only its last window's blocks; a hit is shortened
when it lost them)."""

from __future__ import annotations

from transformers import AutoConfig, MistralConfig, Qwen2Config

from engine.kv.block_manager import NULL_BLOCK, BlockManager
from engine.kv.groups import GroupedBlockManager, group_block_counts, window_blocks_bound
from engine.models.windows import group_windows, layer_groups

from .factories import make_request

BS, W = 4, 10  # block size; the sliding group's window (a query reads back 9 positions: 3 blocks + 1)


def _bm(full: int = 64, sliding: int = 64, prefix: bool = True) -> GroupedBlockManager:
    return GroupedBlockManager([full, sliding], BS, [None, W], enable_prefix_caching=prefix)


def _compute(bm: GroupedBlockManager, r, n: int) -> None:
    """Allocate and mark n more tokens of r computed, as the scheduler does around a step."""
    assert bm.allocate(r, n)
    r.num_computed_tokens += n
    bm.register_computed_blocks(r)
    bm.release_out_of_window(r)


def test_groups_follow_the_layer_windows():
    gemma3 = AutoConfig.for_model("gemma3_text", num_hidden_layers=6, sliding_window=8,
                                  layer_types=["sliding_attention"] * 5 + ["full_attention"])  # fmt: skip
    assert group_windows(gemma3) == [None, 8] and layer_groups(gemma3) == [1, 1, 1, 1, 1, 0]
    # one group: Llama-like full attention, Mistral's window on every layer
    assert group_windows(MistralConfig(num_hidden_layers=2, sliding_window=None)) == [None]
    assert group_windows(MistralConfig(num_hidden_layers=2, sliding_window=40)) == [40]
    assert layer_groups(MistralConfig(num_hidden_layers=2, sliding_window=40)) == [0, 0]
    qwen = Qwen2Config(num_hidden_layers=3, use_sliding_window=True, sliding_window=40, max_window_layers=1)
    assert group_windows(qwen) == [None, 40] and layer_groups(qwen) == [0, 1, 1]


def test_sliding_group_is_bounded_while_the_full_group_grows():
    bm = _bm(full=128)
    r = make_request("a", 200)
    held = []
    for _ in range(200):
        _compute(bm, r, 1)
        held.append(bm.held_blocks(r))
        bm.check_integrity([r])
    full, sliding = zip(*held, strict=True)
    assert full[-1] == 200 // BS  # every block of the context
    assert max(sliding) <= -(-W // BS) + 1  # the window's blocks and the one being written
    assert sliding[-1] < full[-1]
    t = r.kv_groups[0]
    assert t.block_ids[: t.num_freed_blocks] == [NULL_BLOCK] * t.num_freed_blocks and t.num_freed_blocks > 40
    # a chunk of 32 holds the chunk and the window at most
    r2 = make_request("b", 64)
    _compute(bm, r2, 32)
    _compute(bm, r2, 32)
    assert bm.held_blocks(r2)[1] <= -(-(W - 1) // BS) + 2 and bm.held_blocks(r2)[0] == 16
    bm.free(r)
    bm.free(r2)
    assert bm.num_used_blocks == 0 and bm.others[0].num_used_blocks == 0
    bm.check_integrity([])


def test_allocation_is_all_groups_or_none():
    bm = _bm(full=64, sliding=3)
    r = make_request("a", 40)
    assert not bm.allocate(r, 16)  # 4 blocks: the sliding pool has 3
    assert r.block_ids == [] and r.kv_groups[0].block_ids == [] and bm.num_free_blocks == 64
    assert bm.allocate(r, 12) and bm.held_blocks(r) == [3, 3]
    bm.check_integrity([r])


def test_a_prefix_hit_takes_only_the_window_of_the_sliding_group():
    bm = _bm()
    a = make_request("a", 41)
    _compute(bm, a, 40)  # 10 blocks, sliding blocks 0..6 freed (still cached)
    b = make_request("b", 41)  # same tokens
    hits = bm.find_cached_prefix(b)
    assert hits == a.block_ids[:10]
    assert bm.fits(b, hits, 1)
    bm.acquire_cached_prefix(b, hits)
    assert b.num_computed_tokens == 40
    t = b.kv_groups[0]
    first = (40 - W + 1) // BS  # 7: blocks 7..9 hold positions 28..39, the window of position 40
    assert t.num_freed_blocks == first and t.block_ids[:first] == [NULL_BLOCK] * first
    assert t.block_ids[first:] == a.kv_groups[0].block_ids[first:10] and t.num_hashed_blocks == 10
    assert t.last_block_hash == a.kv_groups[0].last_block_hash
    bm.check_integrity([a, b])
    _compute(bm, b, 1)  # and it goes on from there
    bm.check_integrity([a, b])


def test_a_hit_is_shortened_when_the_sliding_group_lost_its_window():
    bm = _bm(full=64, sliding=12)
    a = make_request("a", 41)
    _compute(bm, a, 40)
    window_ids = a.kv_groups[0].block_ids[7:10]
    bm.free(a)
    # another request takes every free sliding block: the LRU evicts a's blocks, its last ones included
    other = make_request("x", 48, tokens=[7] * 48)
    assert bm.allocate(other, 48)
    assert all(bm.others[0].blocks[i].block_hash is None for i in window_ids)
    bm.free(other)
    b = make_request("b", 41)
    assert bm.find_cached_prefix(b) == []  # every sliding block of a's prefix is gone
    # with the sliding pool keeping the blocks of positions up to 20: a hit of 5 blocks (20 tokens) only
    bm2 = _bm(full=64, sliding=64)
    a2 = make_request("a", 41)
    _compute(bm2, a2, 40)
    sliding = bm2.others[0]
    for i in a2.kv_groups[0].block_ids[7:10]:  # drop the last window's blocks from the sliding cache
        del sliding._cached[sliding.blocks[i].block_hash]
    hits = bm2.find_cached_prefix(make_request("b", 41))
    # n = 7 needs sliding blocks (28 - 9) // 4 = 4..6, still cached
    assert len(hits) == 7 and hits == a2.block_ids[:7]


def test_reset_and_events_describe_the_full_group():
    bm = GroupedBlockManager([16, 16], BS, [None, W], record_events=True)
    a = make_request("a", 20)
    _compute(bm, a, 20)
    stored = [h for e in bm.take_events() for h in getattr(e, "block_hashes", [])]
    assert len(stored) == 5 and set(stored) == bm.cached_hashes()
    assert not bm.reset_prefix_cache()  # a holds blocks
    bm.free(a)
    assert bm.reset_prefix_cache() and not bm.others[0]._cached


def test_block_counts_give_the_sliding_group_its_bound_and_the_rest_to_the_full_group():
    bound = window_blocks_bound(W, BS, max_num_seqs=2, max_num_batched_tokens=16)
    assert bound == 2 * (-(-(W - 1) // BS) + 3) + 4
    # 1 full layer, 3 sliding: a block of the whole model costs 4 units; 100 such blocks in the budget
    counts = group_block_counts([1, 3], [None, W], 100, 400, BS, 2, 16)
    assert counts == [400 - 3 * bound, bound]
    # a fixed block count: the same for the full group, the bound for the sliding one
    assert group_block_counts([1, 3], [None, W], 100, None, BS, 2, 16) == [100, bound]
    # a budget too small for the bound: every group the even share
    assert group_block_counts([1, 3], [None, W], 5, 20, BS, 2, 16) == [5, 5]


def test_one_group_models_keep_the_plain_block_manager(build_model):
    from .helpers import make_engine

    engine = make_engine(build_model("tiny-mistral-swa"))
    assert type(engine.scheduler.blocks) is BlockManager and engine.runner.kv_groups == 1
