"""Sliding-window models end to end: which layers have a window (engine/models/windows.py, as
transformers reads each config class), the context no longer capped to the window, KV blocks that left
the window freed for a model whose every layer has it (count asserted, answer unchanged), freed in the
sliding group only for one that mixes full and sliding layers (engine/kv/groups.py; Gemma 3 in
test_kv_groups_gemma3.py), and speculative verify over the window."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, MistralConfig, Qwen2Config

from engine.kv.block_manager import NULL_BLOCK
from engine.models.windows import layer_windows, uniform_window

from .helpers import Case, greedy, hf_reference, make_engine, mismatches

WINDOW = 12  # tiny-mistral-swa's sliding_window (engine/testing/make_model.py)


# ---- which layers --------------------------------------------------------------------------------


def test_layer_windows_follow_each_config_class():
    mistral = MistralConfig(num_hidden_layers=3, sliding_window=40)
    assert layer_windows(mistral) == [40, 40, 40] and uniform_window(mistral) == 40
    assert layer_windows(MistralConfig(num_hidden_layers=2, sliding_window=None)) == [None, None]
    # Qwen2: off unless use_sliding_window; then the layers from max_window_layers on
    assert layer_windows(Qwen2Config(num_hidden_layers=3, sliding_window=40)) == [None] * 3
    qwen = Qwen2Config(num_hidden_layers=3, use_sliding_window=True, sliding_window=40, max_window_layers=1)
    assert layer_windows(qwen) == [None, 40, 40] and uniform_window(qwen) is None
    # layer_types as Gemma 2/3 configs carry it
    gemma_like = AutoConfig.for_model("gemma2", num_hidden_layers=4, sliding_window=8,
                                      layer_types=["sliding_attention", "full_attention"] * 2)
    assert layer_windows(gemma_like) == [8, None, 8, None]
    assert layer_windows(AutoConfig.for_model("llama", num_hidden_layers=2)) == [None, None]


def test_each_layer_gets_its_window_and_the_context_is_not_capped(build_model):
    for preset, want in (("tiny-mistral-swa", [WINDOW] * 3), ("tiny-qwen2-swa", [None, 16])):
        engine = make_engine(build_model(preset))
        layers = engine.runner.model.model.layers
        assert [layer.self_attn.window for layer in layers] == want
        assert engine.max_model_len == AutoConfig.from_pretrained(str(build_model(preset))).max_position_embeddings
        assert engine.scheduler.blocks.sliding_window == (WINDOW if preset == "tiny-mistral-swa" else None)


# ---- blocks that left the window -----------------------------------------------------------------


def _held_blocks(engine, prompt: list[int], max_tokens: int) -> tuple[list[int], list[int]]:
    """Generate one request step by step: its tokens, and the blocks it holds after each step."""
    engine.add_request("r", prompt_token_ids=prompt, params=greedy(max_tokens))
    tokens, held = [], []
    while engine.has_unfinished():
        for out in engine.step():
            tokens.extend(out.new_token_ids)
            if not out.finished:
                held.append(out.kv_blocks)
        engine.check_integrity()
    return tokens, held


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_blocks_outside_the_window_are_freed_and_the_answer_is_unchanged(build_model, prefix_caching):
    path = build_model("tiny-mistral-swa")
    bs = 4
    g = torch.Generator().manual_seed(5)
    prompt = torch.randint(10, 2000, (150,), generator=g).tolist()
    ref = hf_reference(path, Case([prompt], [40]))
    engine = make_engine(path, block_size=bs, max_num_batched_tokens=32, enable_prefix_caching=prefix_caching)
    tokens, held = _held_blocks(engine, prompt, 40)
    assert tokens == ref.token_ids[0]
    # every step after the prompt: the window's blocks and the one being written, never more
    bound = -(-WINDOW // bs) + 1
    assert max(held[-35:]) <= bound, held
    # while the 150-token prompt runs in chunks of 32, at most a chunk and the window are held
    assert max(held) <= -(-(32 + WINDOW) // bs) + 1, held
    assert engine.stats().kv_blocks_used == 0
    # without freeing (sliding_window off in the block manager) the same request holds its whole context
    engine = make_engine(path, block_size=bs, max_num_batched_tokens=32, enable_prefix_caching=prefix_caching)
    engine.scheduler.blocks.sliding_window = None
    tokens_all, held_all = _held_blocks(engine, prompt, 40)
    assert tokens_all == tokens
    assert held_all[-1] == -(-(150 + 38) // bs)  # its last step wrote the 38th generated token's K/V


def test_a_model_mixing_full_and_sliding_layers_frees_only_the_sliding_groups_blocks(build_model):
    """Qwen2 with max_window_layers: two KV-cache groups (engine/kv/groups.py); the full layer's group keeps
    every block (out.kv_blocks counts group 0), the sliding layer's holds its window."""
    path = build_model("tiny-qwen2-swa")
    prompt = list(range(10, 110))
    engine = make_engine(path, block_size=4)
    assert engine.scheduler.blocks.windows == [None, 16]
    sliding: list[int] = []
    engine.add_request("r", prompt_token_ids=prompt, params=greedy(20))
    tokens, held = [], []
    while engine.has_unfinished():
        for out in engine.step():
            tokens.extend(out.new_token_ids)
            if not out.finished:
                held.append(out.kv_blocks)
                sliding.append(engine.scheduler.blocks.held_blocks(engine.scheduler.requests["r"])[1])
        engine.check_integrity()
    assert held[-1] == -(-(100 + 18) // 4)
    assert max(sliding[1:]) <= -(-16 // 4) + 1, sliding
    assert tokens == hf_reference(path, Case([prompt], [20])).token_ids[0]


def test_freed_blocks_leave_placeholders_and_a_prefix_hit_on_them_is_exact(build_model):
    """A long request frees its early blocks (NULL_BLOCK in its table); they stay findable until evicted,
    so a second request with the same prompt hits them, and both match transformers."""
    path = build_model("tiny-mistral-swa")
    g = torch.Generator().manual_seed(9)
    prompt = torch.randint(10, 2000, (90,), generator=g).tolist()
    ref = hf_reference(path, Case([prompt, prompt + [7, 8, 9]], [25, 25]))
    engine = make_engine(path, block_size=4, enable_prefix_caching=True)
    engine.add_request("a", prompt_token_ids=prompt, params=greedy(25))
    got: dict[str, list[int]] = {}
    seen_placeholders = False
    while engine.has_unfinished():
        for out in engine.step():
            got.setdefault(out.request_id, []).extend(out.new_token_ids)
        req = engine.scheduler.requests.get("a")
        if req is not None and req.num_freed_blocks:
            seen_placeholders = True
            assert req.block_ids[: req.num_freed_blocks] == [NULL_BLOCK] * req.num_freed_blocks
    assert seen_placeholders
    engine.add_request("b", prompt_token_ids=prompt + [7, 8, 9], params=greedy(25))
    while engine.has_unfinished():
        for out in engine.step():
            got.setdefault(out.request_id, []).extend(out.new_token_ids)
    assert engine.stats().prefix_cache_hits >= 88  # 22 blocks of the 90-token prompt
    assert [got["a"], got["b"]] == ref.token_ids
    engine.check_integrity()


def test_speculative_verify_over_the_window_keeps_parity(build_model):
    """n-gram drafts that the model accepts: a prompt A + B + A, B being the model's own continuation of
    A. With RoPE and a window the output depends on the last few dozen tokens only (3 layers of 12), so
    after the second A the model says B again and the drafts (B, found after the first A) are taken.
    Verify rows attend as one decode per position over the window; rolled-back drafts never free a
    block still in it."""
    path = build_model("tiny-mistral-swa")
    g = torch.Generator().manual_seed(4)
    heads = [torch.randint(10, 2000, (40,), generator=g).tolist() for _ in range(3)]
    conts = hf_reference(path, Case(heads, [24] * 3)).token_ids
    case = Case([a + b + a for a, b in zip(heads, conts, strict=True)], [30, 30, 30])
    ref = hf_reference(path, case)
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    engine = make_engine(path, block_size=4, speculative=spec)
    engine.scheduler.spec_gate = None  # speculate whenever drafts exist (no timing gate)
    res = engine.generate(case.prompts, [greedy(m) for m in case.max_tokens])
    assert mismatches([r.token_ids for r in res], ref.token_ids) == []
    assert engine.stats().spec_accepted_tokens > 10
    engine.check_integrity()


def test_a_windowed_mistral_gguf_file_keeps_its_window(build_model, tmp_path):
    """make_gguf writes it as `mistral` with mistral.attention.sliding_window (llama's metadata has no
    window); the engine reads it back onto every layer and frees blocks as for the folder
    (tests/engine/test_gguf_parity.py checks its tokens against transformers)."""
    from engine.testing.make_gguf import write_gguf

    path = write_gguf(build_model("tiny-mistral-swa"), tmp_path / "swa.gguf", "F32")
    engine = make_engine(path)
    assert [layer.self_attn.window for layer in engine.runner.model.model.layers] == [WINDOW] * 3
    assert engine.scheduler.blocks.sliding_window == WINDOW


def test_the_cpp_decode_loop_takes_windows_and_declines_soft_capping(build_model):
    engine = make_engine(build_model("tiny-mistral-swa"), fused_decode=True)
    model = engine.runner.model
    assert model.model.fused_decode is not None and model.model.fused_decode.windows == [WINDOW] * 3
    assert model.fused_decode_unsupported() is None
    for layer in model.model.layers:  # as a Gemma 2 subclass sets it from its config
        layer.self_attn.softcap = 50.0
    assert model.fused_decode_unsupported() == "attention-logit soft-capping"
