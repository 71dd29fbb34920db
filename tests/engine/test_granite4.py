"""Granite 4, the hybrid of Mamba2 and attention layers (engine/models/granite_hybrid.py, mamba2.py, ssd.py),
over the state cache (engine/state/: conv windows and SSM matrices in one slot): greedy tokens equal
transformers' (its Mamba2 torch fallback: no CUDA kernels here) in float32 under batching, chunked prefill
cut anywhere (the conv window and the scan state carry across chunks), KV and seat preemption (the state
rebuilt by recompute), aborts (slots freed and reused with stale contents), the state budget, prefix
caching off without state checkpoints (with them: test_recurrent_checkpoints.py), the options a hybrid
cannot serve refused; and the scan itself against transformers'."""

from __future__ import annotations

import logging

import pytest
import torch

from engine.api import PreemptionCause
from engine.config.lora import LoraConfig
from engine.config.speculative import SpeculativeConfig
from engine.models import ssd
from engine.models.granite_hybrid import granite4_layer_types
from engine.state.conv_cache import ConvStateSpec, HybridSlot, split_budget
from engine.state.ssm_cache import SsmStateSpec

from .helpers import assert_idle, greedy, hf_reference, make_case, make_engine, mismatches, run_all

PRESET, DENSE = "tiny-granite4", "tiny-granite4-dense"


def reference(path, case):
    """transformers' greedy tokens on one thread: its Mamba2 fallback runs many tiny ops (a depthwise conv
    over 5 columns, a [P, N] matrix per head), which two threads on a busy machine run 50x slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return hf_reference(path, case)
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def granite4(build_model):
    path = build_model(PRESET)
    case = make_case(2048, n=24, seed=1, shared_prefix=64)
    return path, case, reference(path, case)


@pytest.fixture(scope="module")
def dense(build_model):
    path = build_model(DENSE)
    case = make_case(2048, n=12, seed=2)
    return path, case, reference(path, case)


def assert_slots_free(engine) -> None:
    assert_idle(engine)
    assert engine.state_pool.num_used == 0 and engine.state_pool.num_free == engine.state_pool.num_slots


# ---- the scan against transformers' torch fallback ---------------------------------------------------------


def _scan_inputs(length: int, heads: int = 8, head_dim: int = 4, groups: int = 2, size: int = 6, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(length, heads, head_dim, generator=g)
    dt = torch.randn(length, heads, generator=g)
    a = -torch.exp(torch.rand(heads, generator=g) * 2)
    b, c = torch.randn(length, groups, size, generator=g), torch.randn(length, groups, size, generator=g)
    d, dt_bias = torch.randn(heads, generator=g), torch.randn(heads, generator=g)
    return x, dt, a, b, c, d, dt_bias


@pytest.mark.parametrize("length", [1, 5, 16, 37])
def test_chunk_scan_is_transformers_bit_for_bit(length):
    from transformers.models.granitemoehybrid.modeling_granitemoehybrid import mamba2_chunk_scan

    x, dt, a, b, c, d, dt_bias = _scan_inputs(length)
    init = torch.randn(8, 4, 6)
    want, want_state = mamba2_chunk_scan(x[None], dt[None], a, b[None], c[None], 16, D=d, dt_bias=dt_bias,
                                         initial_states=init[None], dt_softplus=True, return_final_states=True)  # fmt: skip
    got, state = ssd.chunk_scan(x, dt, a, b, c, d, dt_bias, 16, init)
    assert torch.equal(got, want[0]) and torch.equal(state, want_state[0])


def test_step_is_transformers_bit_for_bit():
    from transformers.models.granitemoehybrid.modeling_granitemoehybrid import mamba2_selective_state_update

    x, dt, a, b, c, d, dt_bias = _scan_inputs(3)  # 3 sequences, one token each
    state = torch.randn(3, 8, 4, 6)
    want_state = state.clone()
    want = mamba2_selective_state_update(want_state, x, dt[:, :, None].expand(-1, -1, 4),
                                         a[:, None, None].expand(-1, 4, 6), b, c, d[:, None].expand(-1, 4),
                                         dt_bias=dt_bias[:, None].expand(-1, 4), dt_softplus=True)  # fmt: skip
    got = ssd.step(state, x, dt, a, b, c, d, dt_bias)
    assert torch.equal(got, want) and torch.equal(state, want_state)


@pytest.mark.parametrize("cuts", [[1], [7, 8], [15, 16, 17], [3, 29, 30]])
def test_scan_cut_anywhere_gives_the_same_outputs_and_state(cuts):
    """A sequence scanned whole, or in pieces cut anywhere (each from the previous piece's state; one-token
    pieces by the step), gives the same outputs and final state up to float rounding."""
    x, dt, a, b, c, d, dt_bias = _scan_inputs(40, seed=3)
    whole, whole_state = ssd.chunk_scan(x, dt, a, b, c, d, dt_bias, 16, None)
    state, outs, start = None, [], 0
    for end in [*cuts, 40]:
        if end - start == 1 and state is not None:
            s = state[None].clone()
            outs.append(ssd.step(s, x[start:end], dt[start:end], a, b[start:end], c[start:end], d, dt_bias))
            state = s[0]
        else:
            y, state = ssd.chunk_scan(x[start:end], dt[start:end], a, b[start:end], c[start:end], d, dt_bias, 16,
                                      state)  # fmt: skip
            outs.append(y)
        start = end
    assert state is not None
    torch.testing.assert_close(torch.cat(outs), whole, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state, whole_state, rtol=1e-5, atol=1e-5)
    assert not torch.equal(whole_state, torch.zeros_like(whole_state))


# ---- the engine against transformers ---------------------------------------------------------------------


def test_kv_for_attention_layers_only_and_state_for_mamba_layers(granite4):
    path, _, _ = granite4
    engine = make_engine(path, max_num_seqs=12)
    # 6 layers: mamba, mamba, attention, mamba, attention, mamba
    assert len(engine.runner.kv_caches) == 2
    # conv: mamba layers, slots, I + 2 G N = 256 + 2 * 2 * 16, d_conv - 1; ssm: heads 8, head_dim 32, d_state 16
    assert tuple(engine.runner.conv_state.shape) == (4, 12, 320, 3)
    assert tuple(engine.runner.ssm_state.shape) == (4, 12, 8, 32, 16)
    assert engine.runner.ssm_state.dtype == torch.float32
    assert engine.state_pool.num_slots == 12 and engine.scheduler.config.max_num_seqs == 12
    assert engine.runner.model.model.fused_decode is None and engine.runner.graphs is None


def test_batched_greedy_matches_transformers(granite4):
    path, case, ref = granite4
    engine = make_engine(path)
    assert mismatches(run_all(engine, case), ref.token_ids) == []
    assert_slots_free(engine)


def test_reference_backend_keeps_parity(granite4):
    path, case, ref = granite4
    engine = make_engine(path, attention_backend="torch")
    assert mismatches(run_all(engine, case), ref.token_ids) == []
    assert_slots_free(engine)


@pytest.mark.parametrize("budget", [7, 32])
def test_chunked_prefill_cut_anywhere_keeps_parity(granite4, budget):
    """Steps of 7 tokens cut prompts at every residue of the scan's 32-token blocks and the conv's 3-column
    window, mixed with other rows' decodes."""
    path, case, ref = granite4
    engine = make_engine(path, max_num_batched_tokens=budget)
    cuts, mixed = set(), []
    orig = engine.scheduler.schedule

    def spy():
        out = orig()
        chunks = [s for s in out.scheduled if s.num_tokens > 1 and s.start > 0]  # a chunk after a cut
        cuts.update(s.start % 32 for s in chunks)
        if chunks and any(s.num_tokens == 1 for s in out.scheduled):
            mixed.append(out)
        return out

    engine.scheduler.schedule = spy
    assert mismatches(run_all(engine, case), ref.token_ids) == []
    assert cuts, "no prompt chunk continued after a cut"
    if budget == 7:  # cuts at every position of a scan block (7 is coprime to 32)
        assert cuts == set(range(32))
    assert mixed, "no step mixed a continued prompt chunk with decodes"
    assert_slots_free(engine)


def test_dense_rope_variant_matches_transformers(dense):
    """The dense Granite 4 (shared MLP only, RoPE on its attention layers), whole and in chunks of 5."""
    path, case, ref = dense
    assert mismatches(run_all(make_engine(path), case), ref.token_ids) == []
    engine = make_engine(path, max_num_batched_tokens=5)
    assert mismatches(run_all(engine, case), ref.token_ids) == []
    assert_slots_free(engine)


def test_kv_preemption_keeps_parity(granite4):
    path, case, ref = granite4
    engine = make_engine(path, num_kv_blocks=28, block_size=16)
    assert mismatches(run_all(engine, case), ref.token_ids) == []
    assert engine.stats().preemptions > 0
    assert_slots_free(engine)


def test_seat_preemption_keeps_parity(granite4):
    """Batch-priority requests fill every seat (= every state slot); interactive ones take them: the
    victims' slots are freed and their conv and SSM states rebuilt by recompute."""
    path, case, ref = granite4
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


def test_abort_frees_slots_and_reused_slots_start_clean(granite4):
    """Aborts mid-prompt and mid-decode give their slots back at once; the requests that reuse those
    slots (stale windows and SSM matrices left in them) still match transformers."""
    path, case, ref = granite4
    engine = make_engine(path, max_num_seqs=6, max_num_batched_tokens=48)
    for i in range(12):
        engine.add_request(f"a{i}", prompt_token_ids=case.prompts[i], params=greedy(64))
    for _ in range(4):
        engine.step()
    running = list(engine.scheduler.running)
    assert engine.state_pool.num_used == len(running) > 0
    assert any(r.num_computed_tokens < r.num_prompt_tokens for r in running)  # mid-prompt
    assert any(r.num_output_tokens > 0 for r in running)  # decoding
    assert engine.runner.ssm_state.abs().sum() > 0  # the slots hold state now
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


def test_prefix_caching_is_off_without_checkpoints(granite4, caplog):
    """Without state checkpoints (num_state_checkpoints=0) no attention KV is reused without the Mamba2 state
    that goes with it (0 hits); with them, turn 2 resumes (tests/engine/test_recurrent_checkpoints.py)."""
    path, case, ref = granite4
    with caplog.at_level(logging.INFO, logger="tokenmill.engine"):
        engine = make_engine(path, enable_prefix_caching=True, num_state_checkpoints=0)
    assert not engine.block_manager.enable_prefix_caching
    assert "prefix caching off" in caplog.text and "4 Mamba2 layers" in caplog.text
    shared = list(range(0, 12, 2))  # prompts with the shared 64-token prefix
    got = engine.generate([case.prompts[i] for i in shared], [greedy(case.max_tokens[i]) for i in shared])
    assert [r.token_ids for r in got] == [ref.token_ids[i] for i in shared]
    assert all(r.cached_tokens == 0 for r in got) and engine.stats().prefix_cache_hits == 0
    assert_slots_free(engine)


def test_logprobs_match_transformers(granite4):
    path, case, ref = granite4
    engine = make_engine(path)
    res = engine.generate(case.prompts[:8], [greedy(m, logprobs=2) for m in case.max_tokens[:8]])
    for r, want in zip(res, ref.logprobs[:8], strict=True):
        got = [lp.logprob for lp in r.logprobs]
        assert len(got) == len(want) and max(abs(a - b) for a, b in zip(got, want, strict=True)) < 1e-4


def test_budget_split_counts_conv_and_ssm_state(granite4):
    """A slot holds both states; kv_cache_memory is split: slots first (at most half), KV the rest."""
    path, case, ref = granite4
    spec = HybridSlot(ConvStateSpec(4, 320, 3, torch.float32), (SsmStateSpec(4, 8, 32, 16),))
    assert spec.bytes_per_slot == 4 * 320 * 3 * 4 + 4 * 8 * 32 * 16 * 4 == 80896
    kv_block = 2 * 2 * 16 * 2 * 32 * 4  # K and V, 2 attention layers, 16 tokens, 2 heads x 32, float32
    budget = 6 * 80896 + 10 * kv_block + 100  # half of it holds 4 slots (< 16 seats asked for)
    slots, rest = split_budget(spec, budget, max_num_seqs=16)
    assert slots == 4 and rest == budget - 4 * 80896
    engine = make_engine(path, num_kv_blocks=None, kv_cache_memory=budget, block_size=16, max_num_seqs=16)
    assert engine.state_pool.num_slots == 4 and engine.scheduler.config.max_num_seqs == 4
    assert engine.state_cache_bytes == 4 * 80896
    assert engine.block_manager.num_blocks == rest // kv_block
    picked = [i for i in range(len(case.prompts)) if len(case.prompts[i]) <= 100][:5]
    got = engine.generate([case.prompts[i] for i in picked], [greedy(case.max_tokens[i]) for i in picked])
    assert [r.token_ids for r in got] == [ref.token_ids[i] for i in picked]
    assert_slots_free(engine)


def test_options_a_hybrid_cannot_serve_are_refused(granite4):
    path, _, _ = granite4
    with pytest.raises(ValueError, match="speculative decoding is not supported for hybrid"):
        make_engine(path, speculative=SpeculativeConfig())
    with pytest.raises(ValueError, match="LoRA adapters are not supported for hybrid"):
        make_engine(path, lora=LoraConfig())


def test_config_checks_name_the_field():
    from transformers import GraniteMoeHybridConfig

    from engine.models.granite_hybrid import GraniteMoeHybridForCausalLM

    cfg = GraniteMoeHybridConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, mamba_n_heads=4,
                                 layer_types=["mamba", "attention"], num_local_experts=0)  # fmt: skip
    assert granite4_layer_types(cfg) == ["mamba", "attention"]
    for key, value, field in [("time_step_limit", (0.0, 1.0), "time_step_limit"),
                              ("position_embedding_type", "alibi", "position_embedding_type"),
                              ("layer_types", ["mamba", "mamba"], "layer_types")]:  # fmt: skip
        bad = GraniteMoeHybridConfig(**{**cfg.to_dict(), key: value})
        with torch.device("meta"), pytest.raises(ValueError, match=field):
            GraniteMoeHybridForCausalLM(bad, 64)
