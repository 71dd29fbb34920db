"""LFM2, the hybrid of gated short convolutions and attention (engine/models/lfm2.py), over the state
cache (engine/state/): greedy tokens equal transformers' in float32 under batching, chunked prefill cut
anywhere (the conv window carries across chunks), KV-shortage and seat preemption (the state rebuilt by
recompute), aborts (slots freed, reused with stale contents), the state pool bounding admission, no prefix
reuse without state checkpoints (with them: test_lfm2_checkpoints.py), and the options a hybrid cannot
serve refused at start-up."""

from __future__ import annotations

import logging

import pytest
import torch

from engine.api import PreemptionCause
from engine.config.lora import LoraConfig
from engine.config.speculative import SpeculativeConfig
from engine.models.lfm2 import lfm2_ff_dim
from engine.state.conv_cache import ConvStateSpec, split_budget
from engine.state.pool import StatePool

from .factories import fake_step, make_request, make_scheduler
from .helpers import assert_idle, greedy, hf_reference, make_case, make_engine, mismatches, run_all

PRESET = "tiny-lfm2"
SHARED_PREFIX = 64


@pytest.fixture(scope="module")
def lfm2(build_model):
    path = build_model(PRESET)
    case = make_case(2048, n=32, seed=1, shared_prefix=SHARED_PREFIX)
    return path, case, hf_reference(path, case)


def assert_slots_free(engine) -> None:
    """Every state slot back in the pool, every KV block freed, bookkeeping consistent."""
    assert_idle(engine)
    assert engine.state_pool.num_used == 0 and engine.state_pool.num_free == engine.state_pool.num_slots


def test_kv_for_attention_layers_only_and_state_for_conv_layers(lfm2):
    path, _, _ = lfm2
    engine = make_engine(path, max_num_seqs=12)
    # 6 layers: conv, conv, attention, conv, attention, conv
    assert len(engine.runner.kv_caches) == 2
    assert tuple(engine.runner.conv_state.shape) == (4, 12, 128, 2)  # conv layers, slots, hidden, L_cache - 1
    assert engine.state_pool.num_slots == 12 and engine.scheduler.config.max_num_seqs == 12
    assert engine.runner.model.model.fused_decode is None  # the C++ decode loop declines it
    assert engine.runner.graphs is None


def test_batched_greedy_matches_transformers(lfm2):
    path, case, ref = lfm2
    engine = make_engine(path)
    assert mismatches(run_all(engine, case), ref.token_ids) == []
    assert_slots_free(engine)


def test_reference_backend_keeps_parity(lfm2):
    path, case, ref = lfm2
    engine = make_engine(path, attention_backend="torch")
    assert mismatches(run_all(engine, case), ref.token_ids) == []
    assert_slots_free(engine)


@pytest.mark.parametrize("budget", [7, 32])
def test_chunked_prefill_cut_anywhere_keeps_parity(lfm2, budget):
    """Steps of 7 tokens cut prompts at every residue of the 3-tap window, mixed with other rows' decodes."""
    path, case, ref = lfm2
    engine = make_engine(path, max_num_batched_tokens=budget)
    cuts, mixed = set(), []
    orig = engine.scheduler.schedule

    def spy():
        out = orig()
        chunks = [s for s in out.scheduled if s.num_tokens > 1 and s.start > 0]  # a chunk after a cut
        cuts.update(s.start % 3 for s in chunks)
        if chunks and any(s.num_tokens == 1 for s in out.scheduled):
            mixed.append(out)
        return out

    engine.scheduler.schedule = spy
    assert mismatches(run_all(engine, case), ref.token_ids) == []
    assert cuts, "no prompt chunk continued after a cut"
    if budget == 7:  # cuts at every position of the window
        assert cuts == {0, 1, 2}
    assert mixed, "no step mixed a continued prompt chunk with decodes"
    assert_slots_free(engine)


def test_kv_preemption_keeps_parity(lfm2):
    path, case, ref = lfm2
    engine = make_engine(path, num_kv_blocks=28, block_size=16)
    assert mismatches(run_all(engine, case), ref.token_ids) == []
    assert engine.stats().preemptions > 0
    assert_slots_free(engine)


def test_seat_preemption_keeps_parity(lfm2):
    """Batch-priority requests fill every seat (= every state slot); interactive ones take them: the
    victims' slots are freed and their state rebuilt by recompute."""
    path, case, ref = lfm2
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


def test_abort_frees_slots_and_reused_slots_start_clean(lfm2):
    """Aborts mid-prompt and mid-decode give their slots back at once; the requests that reuse those
    slots (stale windows left in them) still match transformers."""
    path, case, ref = lfm2
    engine = make_engine(path, max_num_seqs=6, max_num_batched_tokens=48)
    for i in range(12):
        engine.add_request(f"a{i}", prompt_token_ids=case.prompts[i], params=greedy(64))
    for _ in range(4):
        engine.step()
    running = list(engine.scheduler.running)
    assert engine.state_pool.num_used == len(running) > 0
    assert any(r.num_computed_tokens < r.num_prompt_tokens for r in running)  # mid-prompt (prompt 1: 300 tokens)
    assert any(r.num_output_tokens > 0 for r in running)  # decoding (prompt 0: 1 token)
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


def test_prefix_caching_is_off_for_hybrids_without_checkpoints(lfm2, caplog):
    """A conv state cannot be cut at a prefix: without state checkpoints no attention KV is reused without
    it (0 hits), and the shared-prefix prompts still match transformers."""
    path, case, ref = lfm2
    with caplog.at_level(logging.INFO, logger="tokenmill.engine"):
        engine = make_engine(path, enable_prefix_caching=True, num_state_checkpoints=0)
    assert not engine.block_manager.enable_prefix_caching
    assert "prefix caching off" in caplog.text and "hybrid model" in caplog.text
    first = next(i for i in range(0, len(case.prompts), 2) if len(case.prompts[i]) > SHARED_PREFIX)
    got = engine.generate([case.prompts[first]], [greedy(case.max_tokens[first])])
    assert got[0].token_ids == ref.token_ids[first]
    rest = [i for i in range(0, len(case.prompts), 2) if i != first]
    got = engine.generate([case.prompts[i] for i in rest], [greedy(case.max_tokens[i]) for i in rest])
    assert [r.token_ids for r in got] == [ref.token_ids[i] for i in rest]
    assert all(r.cached_tokens == 0 for r in got)
    assert engine.stats().prefix_cache_hits == 0
    assert_slots_free(engine)


def test_logprobs_match_transformers(lfm2):
    path, case, ref = lfm2
    engine = make_engine(path)
    res = engine.generate(case.prompts[:8], [greedy(m, logprobs=2) for m in case.max_tokens[:8]])
    for r, want in zip(res, ref.logprobs[:8], strict=True):
        got = [lp.logprob for lp in r.logprobs]
        assert len(got) == len(want) and max(abs(a - b) for a, b in zip(got, want, strict=True)) < 1e-4


def test_budget_split_bounds_seats_by_state_slots(lfm2):
    """kv_cache_memory split: the slots first (at most half the budget), the attention layers' KV blocks
    the rest; max_num_seqs drops to the slots it holds."""
    path, case, ref = lfm2
    spec = ConvStateSpec(num_layers=4, channels=128, width=2, dtype=torch.float32)
    assert spec.bytes_per_slot == 4096
    kv_block = 2 * 2 * 16 * 2 * 32 * 4  # K and V, 2 attention layers, 16 tokens, 2 heads x 32, float32
    budget = 20 * kv_block  # half of it holds 40 slots (< 64 seats asked for)
    slots, rest = split_budget(spec, budget, max_num_seqs=64)
    assert (slots, rest) == (40, budget - 40 * 4096)
    engine = make_engine(path, num_kv_blocks=None, kv_cache_memory=budget, block_size=16, max_num_seqs=64,
                         num_state_checkpoints=0)  # the checkpoints' share: test_lfm2_checkpoints.py
    assert engine.state_pool.num_slots == 40 and engine.scheduler.config.max_num_seqs == 40
    assert engine.block_manager.num_blocks == rest // kv_block == 10  # only the attention layers' KV
    assert engine.state_cache_bytes == 40 * 4096
    picked = [i for i in range(len(case.prompts)) if len(case.prompts[i]) <= 100][:6]  # within 10 blocks
    got = engine.generate([case.prompts[i] for i in picked], [greedy(case.max_tokens[i]) for i in picked])
    assert [r.token_ids for r in got] == [ref.token_ids[i] for i in picked]
    assert_slots_free(engine)
    with pytest.raises(ValueError, match="conv state"):
        split_budget(spec, 4096, max_num_seqs=4)


def test_state_slots_bound_admission(lfm2):
    """Ample KV, 3 seats = 3 slots: never more than 3 sequences hold a slot, every slot is used, each
    running request holds exactly one."""
    path, case, ref = lfm2
    engine = make_engine(path, max_num_seqs=3)
    assert engine.state_pool.num_slots == 3
    for i in range(8):
        engine.add_request(f"s{i}", prompt_token_ids=case.prompts[i][:20], params=greedy(4))
    peak = 0
    while engine.has_unfinished():
        engine.step()
        peak = max(peak, engine.state_pool.num_used)
        assert engine.state_pool.num_used == len(engine.scheduler.running) <= 3
        assert all(r.state_slot is not None for r in engine.scheduler.running)
        engine.check_integrity()
    assert peak == 3
    assert_slots_free(engine)


def test_scheduler_admits_only_with_a_free_slot():
    """The scheduler alone: 8 seats but 2 state slots, so 2 run; a finished request's slot goes to the
    next; a more important request takes a slot from a less important one (a seat preemption)."""
    sched = make_scheduler(max_num_seqs=8)
    sched.state = pool = StatePool(2)
    reqs = [make_request(f"r{i}", 6, max_tokens=3, priority=1) for i in range(4)]
    for r in reqs:
        sched.add(r)
    fake_step(sched)
    assert [r.request_id for r in sched.running] == ["r0", "r1"] and pool.num_free == 0
    assert {r.state_slot for r in reqs[:2]} == {0, 1} and reqs[2].state_slot is None
    while reqs[0].status.value != "finished":
        fake_step(sched, finish=True)
    assert reqs[0].state_slot is None and reqs[2].state_slot is None  # freed at once; r2 waits for a step
    pool.check_integrity(sched.requests.values())
    fake_step(sched)
    assert reqs[2].state_slot is not None and reqs[2] in sched.running
    urgent = make_request("urgent", 4, priority=0)
    sched.add(urgent)
    fake_step(sched)
    assert urgent.state_slot is not None and urgent in sched.running
    assert sched.preemptions_by[(1, PreemptionCause.SLOTS)] == 1
    assert len(sched.running) == 2 and pool.num_free == 0
    pool.check_integrity(sched.requests.values())


def test_options_a_hybrid_cannot_serve_are_refused(lfm2):
    path, _, _ = lfm2
    with pytest.raises(ValueError, match="speculative decoding is not supported for hybrid"):
        make_engine(path, speculative=SpeculativeConfig())
    with pytest.raises(ValueError, match="LoRA adapters are not supported for hybrid"):
        make_engine(path, lora=LoraConfig())


@pytest.mark.parametrize("intermediate, auto, mult, step", [(300, True, 1.0, 64), (12288, True, 1.0, 256),
                                                            (4608, True, 0.75, 256), (1000, False, 1.0, 256),
                                                            (6656, True, 1.5, 128)])  # fmt: skip
def test_ff_dim_rule_matches_transformers(intermediate, auto, mult, step):
    from transformers import Lfm2Config
    from transformers.models.lfm2.modeling_lfm2 import Lfm2MLP

    cfg = Lfm2Config(hidden_size=16, intermediate_size=intermediate, block_auto_adjust_ff_dim=auto,
                     block_ffn_dim_multiplier=mult, block_multiple_of=step, num_hidden_layers=1)  # fmt: skip
    with torch.device("meta"):
        want = Lfm2MLP(cfg).w1.out_features
    assert lfm2_ff_dim(cfg) == want
