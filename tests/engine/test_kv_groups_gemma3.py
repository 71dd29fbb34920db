"""Gemma 3 (three sliding layers with a 20-token window, one full layer: two KV-cache groups,
engine/kv/groups.py) through the engine with prompts longer than the window: greedy equal to transformers
under batching, chunked prefill, preemption, prefix hits, speculative verify and a long generation, with
the sliding group's blocks freed as the window passes (count asserted) while the full group keeps the
context, and the KV bytes a long prompt holds per token."""

from __future__ import annotations

import torch

from engine.kv.block_manager import NULL_BLOCK
from engine.kv.groups import GroupedBlockManager

from .helpers import Case, greedy, hf_reference, make_engine, mismatches

WINDOW = 20  # tiny-gemma3's sliding_window (engine/testing/make_model.py)


def _prompts(n: int, length: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(10, 2000, (length + 7 * i,), generator=g).tolist() for i in range(n)]


def _idle(engine) -> None:
    engine.check_integrity()
    blocks = engine.scheduler.blocks
    assert blocks.num_used_blocks == 0 and all(m.num_used_blocks == 0 for m in blocks.others)


def test_two_groups_batched_and_chunked_match_transformers(build_model):
    path = build_model("tiny-gemma3")
    case = Case(_prompts(4, 50, 1), [30, 24, 30, 20])
    ref = hf_reference(path, case)
    engine = make_engine(path, block_size=4, max_num_batched_tokens=32)
    blocks = engine.scheduler.blocks
    assert isinstance(blocks, GroupedBlockManager) and blocks.windows == [None, WINDOW]
    assert [layer.self_attn.kv_group for layer in engine.runner.model.model.layers] == [1, 1, 1, 0]
    got = [r.token_ids for r in engine.generate(case.prompts, [greedy(m) for m in case.max_tokens])]
    assert mismatches(got, ref.token_ids) == []
    _idle(engine)


def test_sliding_blocks_are_freed_as_the_window_passes(build_model):
    path = build_model("tiny-gemma3")
    bs, chunk = 4, 32
    prompt = _prompts(1, 150, 5)[0]
    ref = hf_reference(path, Case([prompt], [40]))
    for prefix_caching in (True, False):
        engine = make_engine(path, block_size=bs, max_num_batched_tokens=chunk, enable_prefix_caching=prefix_caching)
        blocks = engine.scheduler.blocks
        engine.add_request("r", prompt_token_ids=prompt, params=greedy(40))
        tokens, held, saw_placeholders = [], [], False
        while engine.has_unfinished():
            for out in engine.step():
                tokens.extend(out.new_token_ids)
            req = engine.scheduler.requests.get("r")
            if req is not None:
                held.append(blocks.held_blocks(req))
                t = req.kv_groups[0]
                saw_placeholders |= t.num_freed_blocks > 0
                assert t.block_ids[: t.num_freed_blocks] == [NULL_BLOCK] * t.num_freed_blocks
            engine.check_integrity()
        assert tokens == ref.token_ids[0]
        full, sliding = zip(*held, strict=True)
        assert saw_placeholders
        # decode steps: the window's blocks and the one being written; prefill chunks: the chunk and the window
        assert max(sliding[-35:]) <= -(-WINDOW // bs) + 1, sliding
        assert max(sliding) <= -(-(chunk + WINDOW) // bs) + 1, sliding
        # the full group keeps the whole context: the last step it was seen after wrote 150 + 38 tokens' K/V
        assert full[-1] == -(-(150 + 38) // bs)
        _idle(engine)


def test_preemption_and_a_long_generation_match_transformers(build_model):
    path = build_model("tiny-gemma3")
    case = Case(_prompts(3, 40, 7), [120, 60, 60])
    ref = hf_reference(path, case)
    # 60 full-group blocks of 4 tokens: three requests of 100-160 tokens do not fit at once
    engine = make_engine(path, block_size=4, num_kv_blocks=60, max_num_batched_tokens=32)
    got = [r.token_ids for r in engine.generate(case.prompts, [greedy(m) for m in case.max_tokens])]
    assert engine.scheduler.num_preemptions > 0
    assert mismatches(got, ref.token_ids) == []
    _idle(engine)


def test_prefix_hits_past_the_window_are_exact(build_model):
    """A second request sharing a 90-token prompt hits 22 blocks: the full group's all, the sliding
    group's last window (its earlier blocks stand as placeholders)."""
    path = build_model("tiny-gemma3")
    prompt = _prompts(1, 90, 9)[0]
    case = Case([prompt, prompt + [7, 8, 9]], [25, 25])
    ref = hf_reference(path, case)
    engine = make_engine(path, block_size=4)
    got = [engine.generate([prompt], [greedy(25)])[0].token_ids]
    engine.add_request("b", prompt_token_ids=prompt + [7, 8, 9], params=greedy(25))
    out_b: list[int] = []
    first_step = True
    while engine.has_unfinished():
        for out in engine.step():
            out_b.extend(out.new_token_ids)
        if first_step:
            req = engine.scheduler.requests["b"]
            assert req.num_cached_tokens == 88
            t = req.kv_groups[0]
            assert req.num_computed_tokens == 93  # the 5 tokens after the hit computed in this step
            assert t.num_freed_blocks == (93 - WINDOW + 1) // 4 and t.num_hashed_blocks == 23
            first_step = False
    assert [*got, out_b] == ref.token_ids
    _idle(engine)


def test_speculative_verify_with_two_groups(build_model):
    path = build_model("tiny-gemma3")
    g = torch.Generator().manual_seed(4)
    heads = [torch.randint(10, 2000, (40,), generator=g).tolist() for _ in range(2)]
    conts = hf_reference(path, Case(heads, [24] * 2)).token_ids
    case = Case([a + b + a for a, b in zip(heads, conts, strict=True)], [30, 30])
    ref = hf_reference(path, case)
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    engine = make_engine(path, block_size=4, speculative=spec)
    engine.scheduler.spec_gate = None  # speculate whenever drafts exist (no timing gate)
    res = engine.generate(case.prompts, [greedy(m) for m in case.max_tokens])
    assert mismatches([r.token_ids for r in res], ref.token_ids) == []
    assert engine.stats().spec_accepted_tokens > 0
    _idle(engine)


def kv_bytes_per_token(engine, prompt: list[int]) -> float:
    """KV bytes a request holds per token once its prompt is computed (every group's live blocks)."""
    import dataclasses

    from engine.models.windows import layer_groups
    from engine.runner import startup

    blocks = engine.scheduler.blocks
    groups = layer_groups(engine.hf_config)
    spec = startup.kv_spec(engine.hf_config, engine.block_size, engine.dtype)
    per_block = [dataclasses.replace(spec, num_layers=groups.count(g)).bytes_per_block
                 for g in range(len(blocks.windows))]  # fmt: skip
    engine.add_request("r", prompt_token_ids=prompt, params=greedy(3))
    held: list[int] = []
    while engine.has_unfinished():
        engine.step()
        req = engine.scheduler.requests.get("r")
        if req is not None and req.num_computed_tokens >= len(prompt) and not held:
            held = blocks.held_blocks(req)
    return sum(n * b for n, b in zip(held, per_block, strict=True)) / len(prompt)


def test_a_long_prompt_holds_the_full_layers_kv_and_a_window_for_the_local_ones(build_model):
    path = build_model("tiny-gemma3")
    prompt = _prompts(1, 600, 11)[0]
    engine = make_engine(path, block_size=4, max_num_batched_tokens=64, enable_prefix_caching=False)
    spec_bytes = 2 * 1 * 32 * 4  # K and V, 1 KV head of 32 float32 values: bytes per token per layer
    with_groups = kv_bytes_per_token(engine, prompt)
    every_layer = 4 * spec_bytes  # what the 4 layers hold per token without freeing
    # the full layer's bytes per token, plus at most the window and a block for the 3 local layers
    assert with_groups <= spec_bytes + 3 * spec_bytes * (WINDOW + 2 * 4) / len(prompt)
    assert with_groups < every_layer / 3


def test_abort_frees_every_group(build_model):
    path = build_model("tiny-gemma3")
    prompts = _prompts(2, 60, 13)
    ref = hf_reference(path, Case([prompts[1]], [20]))
    engine = make_engine(path, block_size=4, max_num_batched_tokens=32)
    blocks = engine.scheduler.blocks
    engine.add_request("a", prompt_token_ids=prompts[0], params=greedy(40))
    engine.add_request("b", prompt_token_ids=prompts[1], params=greedy(20))
    got: list[int] = []
    for _ in range(6):
        got += [t for out in engine.step() if out.request_id == "b" for t in out.new_token_ids]
    a = engine.scheduler.requests["a"]
    held_a = blocks.held_blocks(a)
    assert held_a[0] > 0 and held_a[1] > 0
    used = (blocks.num_used_blocks, blocks.others[0].num_used_blocks)
    assert engine.abort("a")
    assert (blocks.num_used_blocks, blocks.others[0].num_used_blocks) == (used[0] - held_a[0], used[1] - held_a[1])
    engine.check_integrity()
    while engine.has_unfinished():
        got += [t for out in engine.step() if out.request_id == "b" for t in out.new_token_ids]
    assert got == ref.token_ids[0]
    _idle(engine)


def test_a_memory_budget_gives_the_full_group_what_the_sliding_one_does_not_need(build_model):
    """Sized from kv_cache_memory: the sliding group gets its bound, the full group the rest, so it holds
    more tokens than a one-pool cache of the whole model would in the same bytes."""
    from engine.kv.groups import window_blocks_bound

    path = build_model("tiny-gemma3")
    budget = 4 << 20  # bytes: a block of 16 tokens of one layer is 2 * 16 * 32 * 4 = 4 KiB
    engine = make_engine(path, num_kv_blocks=None, kv_cache_memory=budget, block_size=16, max_num_seqs=4,
                         max_num_batched_tokens=64)  # fmt: skip
    layer_block = 2 * 16 * 32 * 4
    equal = budget // (4 * layer_block)  # blocks of a one-pool cache of the 4 layers
    bound = window_blocks_bound(WINDOW, 16, 4, 64)
    assert engine.kv_group_blocks == [(budget - bound * 3 * layer_block) // layer_block, bound]
    assert engine.kv_group_blocks[0] > 3 * equal and engine.kv_cache_bytes <= budget
