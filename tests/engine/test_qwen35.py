"""Qwen3.5, the hybrid of Gated DeltaNet and gated attention layers (engine/models/qwen35.py), over the state
cache (engine/state/: conv windows and DeltaNet recurrent matrices in one slot per sequence): greedy tokens
equal transformers' in float32 under batching, chunked prefill cut anywhere (the conv window and the
recurrent state carry across chunks, and across the scan's 64-token chunks), KV-shortage and seat
preemption (the state rebuilt by recompute), aborts (slots freed, reused with stale contents), the state
pool bounding admission and sized with both tensors, prefix caching off, and the options a hybrid cannot
serve refused at start-up. The delta rule itself against transformers' chunked and recurrent functions."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

from engine.api import PreemptionCause
from engine.config.lora import LoraConfig
from engine.config.speculative import SpeculativeConfig
from engine.models.delta_rule import decode_step, prefill_scan, prepare
from engine.models.qwen35 import qwen35_layer_types
from engine.state.conv_cache import ConvStateSpec, HybridSlot, split_budget
from engine.state.delta_cache import DeltaStateSpec

from .helpers import Reference, assert_idle, greedy, hf_reference, make_case, make_engine, mismatches, run_all

PRESET = "tiny-qwen35"
SHARED_PREFIX = 64
# tiny-qwen35's state: 4 DeltaNet layers; conv channels 2 x (2 x 16) + 4 x 24 = 160, 3 columns; 4 heads of 16 x 24
CONV_SLOT = 4 * 160 * 3 * 4
DELTA_SLOT = 4 * 4 * 16 * 24 * 4


def single_thread_reference(path, case) -> Reference:
    """transformers' reference on one thread: its tiny per-token convs run ten times slower on two threads
    of a busy machine (the tokens are the same)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return hf_reference(path, case)
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def qwen35(build_model):
    path = build_model(PRESET)
    case = make_case(2048, n=32, seed=1, shared_prefix=SHARED_PREFIX)
    return path, case, single_thread_reference(path, case)


def assert_slots_free(engine) -> None:
    """Every state slot back in the pool, every KV block freed, bookkeeping consistent."""
    assert_idle(engine)
    assert engine.state_pool.num_used == 0 and engine.state_pool.num_free == engine.state_pool.num_slots


def test_kv_for_attention_layers_only_and_state_for_deltanet_layers(qwen35):
    path, _, _ = qwen35
    engine = make_engine(path, max_num_seqs=12)
    # 6 layers: linear, linear, full, linear, linear, full
    assert len(engine.runner.kv_caches) == 2
    assert tuple(engine.runner.conv_state.shape) == (4, 12, 160, 3)  # DeltaNet layers, slots, channels, taps - 1
    delta = engine.runner.delta_state
    assert tuple(delta.shape) == (4, 12, 4, 16, 24) and delta.dtype == torch.float32  # layers, slots, Hv, K, V
    assert engine.state_pool.num_slots == 12 and engine.scheduler.config.max_num_seqs == 12
    assert engine.state_cache_bytes == 12 * (CONV_SLOT + DELTA_SLOT)
    assert engine.runner.model.model.fused_decode is None  # the C++ decode loop declines it
    assert engine.runner.graphs is None


def test_batched_greedy_matches_transformers(qwen35):
    path, case, ref = qwen35
    engine = make_engine(path)
    assert mismatches(run_all(engine, case), ref.token_ids) == []
    assert_slots_free(engine)


def test_reference_backend_keeps_parity(qwen35):
    path, case, ref = qwen35
    engine = make_engine(path, attention_backend="torch")
    assert mismatches(run_all(engine, case), ref.token_ids) == []
    assert_slots_free(engine)


@pytest.mark.parametrize("budget", [7, 100])
def test_chunked_prefill_cut_anywhere_keeps_parity(qwen35, budget):
    """Steps of 7 tokens cut prompts at every residue of the 4-tap window (and of the scan's 64-token
    chunks), mixed with other rows' decodes; 100-token steps cut the scan off its 64 alignment."""
    path, case, ref = qwen35
    engine = make_engine(path, max_num_batched_tokens=budget)
    cuts, mixed = set(), []
    orig = engine.scheduler.schedule

    def spy():
        out = orig()
        chunks = [s for s in out.scheduled if s.num_tokens > 1 and s.start > 0]  # a chunk after a cut
        cuts.update(s.start % 4 for s in chunks)
        if chunks and any(s.num_tokens == 1 for s in out.scheduled):
            mixed.append(out)
        return out

    engine.scheduler.schedule = spy
    assert mismatches(run_all(engine, case), ref.token_ids) == []
    assert cuts, "no prompt chunk continued after a cut"
    if budget == 7:  # cuts at every position of the window
        assert cuts == {0, 1, 2, 3}
    assert mixed, "no step mixed a continued prompt chunk with decodes"
    assert_slots_free(engine)


def test_kv_preemption_keeps_parity(qwen35):
    path, case, ref = qwen35
    engine = make_engine(path, num_kv_blocks=28, block_size=16)
    assert mismatches(run_all(engine, case), ref.token_ids) == []
    assert engine.stats().preemptions > 0
    assert_slots_free(engine)


def test_seat_preemption_keeps_parity(qwen35):
    """Batch-priority requests fill every seat (= every state slot); interactive ones take them: the
    victims' slots are freed and their conv windows and recurrent matrices rebuilt by recompute."""
    path, case, ref = qwen35
    engine = make_engine(path, max_num_seqs=4)
    results: dict[str, list[int]] = {}

    def step() -> None:
        for out in engine.step():
            results.setdefault(out.request_id, []).extend(out.new_token_ids)
        assert engine.state_pool.num_used == len(engine.scheduler.running) <= 4
        engine.check_integrity()

    late = set(range(0, len(case.prompts), 3))
    for i in sorted(set(range(len(case.prompts))) - late):
        engine.add_request(f"r{i}", prompt_token_ids=case.prompts[i], params=greedy(case.max_tokens[i]), priority=2)
    for _ in range(3):
        step()
    for i in sorted(late):
        engine.add_request(f"r{i}", prompt_token_ids=case.prompts[i], params=greedy(case.max_tokens[i]), priority=0)
    while engine.has_unfinished():
        step()
    assert engine.stats().preemptions_by.get((2, PreemptionCause.SLOTS), 0) > 0
    assert [i for i in range(len(case.prompts)) if results[f"r{i}"] != ref.token_ids[i]] == []
    assert_slots_free(engine)


def test_abort_frees_slots_and_reused_slots_start_clean(qwen35):
    """Aborts mid-prompt and mid-decode give their slots back at once; the requests that reuse those
    slots (stale windows and matrices left in them) still match transformers."""
    path, case, ref = qwen35
    engine = make_engine(path, max_num_seqs=6, max_num_batched_tokens=48)
    for i in range(12):
        engine.add_request(f"a{i}", prompt_token_ids=case.prompts[i], params=greedy(64))
    for _ in range(4):
        engine.step()
    running = list(engine.scheduler.running)
    assert engine.state_pool.num_used == len(running) > 0
    assert any(r.num_computed_tokens < r.num_prompt_tokens for r in running)  # mid-prompt (prompt 1: 300 tokens)
    assert any(r.num_output_tokens > 0 for r in running)  # decoding (prompt 0: 1 token)
    assert engine.runner.delta_state.abs().sum() > 0  # the slots hold state that the next holders must not read
    for r in running:
        assert engine.abort(r.request_id)
        assert r.state_slot is None
    engine.check_integrity()
    for rid in list(engine.scheduler.requests):
        engine.abort(rid)
    assert_slots_free(engine)
    picked = list(range(12, 24))
    got = engine.generate([case.prompts[i] for i in picked], [greedy(case.max_tokens[i]) for i in picked])
    assert [r.token_ids for r in got] == [ref.token_ids[i] for i in picked]
    assert_slots_free(engine)


def test_prefix_caching_is_off_without_checkpoints(qwen35, caplog):
    """A recurrent state cannot be cut at a prefix: without state checkpoints (num_state_checkpoints=0) no
    attention KV is reused without it (0 hits), and the shared-prefix prompts still match transformers (with
    them: test_recurrent_checkpoints.py)."""
    path, case, ref = qwen35
    with caplog.at_level(logging.INFO, logger="tokenmill.engine"):
        engine = make_engine(path, enable_prefix_caching=True, num_state_checkpoints=0)
    assert not engine.block_manager.enable_prefix_caching
    assert "prefix caching off" in caplog.text and "Gated DeltaNet layers" in caplog.text
    shared = [i for i in range(0, len(case.prompts), 2) if len(case.prompts[i]) > SHARED_PREFIX][:6]
    for i in shared:  # one after another: each could have reused the previous one's blocks
        got = engine.generate([case.prompts[i]], [greedy(case.max_tokens[i])])
        assert got[0].token_ids == ref.token_ids[i] and got[0].cached_tokens == 0
    assert engine.stats().prefix_cache_hits == 0
    assert_slots_free(engine)


def test_logprobs_match_transformers(qwen35):
    path, case, ref = qwen35
    engine = make_engine(path)
    res = engine.generate(case.prompts[:8], [greedy(m, logprobs=2) for m in case.max_tokens[:8]])
    for r, want in zip(res, ref.logprobs[:8], strict=True):
        got = [lp.logprob for lp in r.logprobs]
        # 5e-4, not LFM2's 1e-4: the recurrent matrices carry every token's float32 rounding (batched
        # products beside transformers' one-row ones) to the end of a 64-token answer
        assert len(got) == len(want) and max(abs(a - b) for a, b in zip(got, want, strict=True)) < 5e-4


def test_budget_split_counts_both_state_tensors(qwen35):
    """kv_cache_memory split: a slot costs its conv windows and its float32 recurrent matrices; the slots
    first (at most half the budget), the attention layers' KV blocks the rest; max_num_seqs drops to the
    slots it holds."""
    path, case, ref = qwen35
    spec = HybridSlot(ConvStateSpec(4, 160, 3, torch.float32), (DeltaStateSpec(4, 4, 16, 24),))
    assert spec.bytes_per_slot == CONV_SLOT + DELTA_SLOT == 7680 + 24576
    kv_block = 2 * 2 * 16 * 2 * 32 * 4  # K and V, 2 attention layers, 16 tokens, 2 heads x 32, float32
    budget = 32 * kv_block  # half of it holds 8 slots (< 16 seats asked for)
    slots, rest = split_budget(spec, budget, max_num_seqs=16)
    assert (slots, rest) == (8, budget - 8 * spec.bytes_per_slot)
    engine = make_engine(path, num_kv_blocks=None, kv_cache_memory=budget, block_size=16, max_num_seqs=16)
    assert engine.state_pool.num_slots == 8 and engine.scheduler.config.max_num_seqs == 8
    assert engine.block_manager.num_blocks == rest // kv_block == 16  # only the attention layers' KV
    assert engine.state_cache_bytes == 8 * spec.bytes_per_slot
    picked = [i for i in range(len(case.prompts)) if len(case.prompts[i]) <= 100][:6]
    got = engine.generate([case.prompts[i] for i in picked], [greedy(case.max_tokens[i]) for i in picked])
    assert [r.token_ids for r in got] == [ref.token_ids[i] for i in picked]
    assert_slots_free(engine)


def test_options_a_hybrid_cannot_serve_are_refused(qwen35):
    path, _, _ = qwen35
    with pytest.raises(ValueError, match="speculative decoding is not supported for hybrid"):
        make_engine(path, speculative=SpeculativeConfig())
    with pytest.raises(ValueError, match="LoRA adapters are not supported for hybrid"):
        make_engine(path, lora=LoraConfig())
    with pytest.raises(ValueError, match="quantization 'gguf' is not supported for hybrid"):
        make_engine(path, quantization="gguf")


@pytest.mark.parametrize("layers, interval", [(6, 3), (8, 4), (5, 1), (7, 2)])
def test_layer_pattern_matches_transformers(layers, interval):
    from transformers import Qwen3_5TextConfig

    want = Qwen3_5TextConfig(num_hidden_layers=layers, full_attention_interval=interval).layer_types
    assert qwen35_layer_types(SimpleNamespace(num_hidden_layers=layers, full_attention_interval=interval)) == want
    assert qwen35_layer_types(SimpleNamespace(num_hidden_layers=layers, layer_types=want)) == want
    assert want.count("full_attention") == layers // interval


def _delta_inputs(n: int, seed: int):
    """Token-major q, k [n, 2, 16], v [n, 4, 24], g, beta [n, 4] as a DeltaNet layer hands them over."""
    g = torch.Generator().manual_seed(seed)
    q, k = torch.randn(n, 2, 16, generator=g), torch.randn(n, 2, 16, generator=g)
    v = torch.randn(n, 4, 24, generator=g)
    decay = -torch.rand(n, 4, generator=g) * 0.5
    beta = torch.rand(n, 4, generator=g)
    return q, k, v, decay, beta


@pytest.mark.parametrize("n, cuts", [(150, [1, 63, 64, 65, 130]), (64, [7, 14]), (9, [1, 2, 3])])
def test_delta_rule_matches_transformers_and_chunks_cut_anywhere(n, cuts):
    """The scan equals transformers' torch_chunk_gated_delta_rule from a nonzero state; the same tokens
    cut into pieces (across the 64-token scan chunks, one-token pieces through the decode step) give the
    same outputs and final state."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule

    q, k, v, g, beta = _delta_inputs(n, seed=n)
    init = torch.randn(4, 16, 24, generator=torch.Generator().manual_seed(7)) * 0.3
    want, want_state = torch_chunk_gated_delta_rule(q[None], k[None], v[None], g=g[None], beta=beta[None],
                                                    initial_state=init[None], output_final_state=True,
                                                    use_qk_l2norm_in_kernel=True)  # fmt: skip
    pq, pk, pv, pg, pb = prepare(q, k, v, g, beta)
    out, state = prefill_scan(pq, pk, pv, pg, pb, init)
    torch.testing.assert_close(out, want[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state, want_state[0], rtol=1e-5, atol=1e-5)
    outs, s = [], init
    for lo, hi in zip([0, *cuts], [*cuts, n], strict=True):
        rows = slice(lo, hi)
        if hi - lo == 1:
            o, s1 = decode_step(pq[rows], pk[rows], pv[rows], pg[rows], pb[rows], s[None])
            s = s1[0]
        else:
            o, s = prefill_scan(pq[rows], pk[rows], pv[rows], pg[rows], pb[rows], s)
        outs.append(o)
    torch.testing.assert_close(torch.cat(outs), want[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(s, want_state[0], rtol=1e-5, atol=1e-5)


def test_decode_step_matches_transformers_recurrent_rule():
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_recurrent_gated_delta_rule

    q, k, v, g, beta = _delta_inputs(3, seed=3)  # 3 sequences, one token each
    init = torch.randn(3, 4, 16, 24, generator=torch.Generator().manual_seed(8))
    want, want_state = torch_recurrent_gated_delta_rule(q[:, None], k[:, None], v[:, None], g=g[:, None],
                                                        beta=beta[:, None], initial_state=init,
                                                        output_final_state=True, use_qk_l2norm_in_kernel=True)  # fmt: skip
    out, state = decode_step(*prepare(q, k, v, g, beta), init)
    torch.testing.assert_close(out, want[:, 0], rtol=0, atol=0)
    torch.testing.assert_close(state, want_state, rtol=0, atol=0)
