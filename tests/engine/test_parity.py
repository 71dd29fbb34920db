"""Greedy output of our engine equals transformers' token for token (float32), in every regime:
plain batching, preemption, prefix caching, chunked prefill, and several block sizes; sliding-window
models included (windows shorter than most prompts, so prefix hits and preemption recompute cross them),
LongRoPE (tests/engine/test_longrope.py: prompts on both sides of its switch, sequences crossing it), and the
mixture-of-experts models (engine/models/moe.py)."""

from __future__ import annotations

import pytest

from engine import EngineConfig
from engine.api import PreemptionCause

from .helpers import (
    FAMILY_PRESETS,
    LONGROPE_PRESETS,
    MOE_PRESETS,
    TINY_PRESETS,
    WINDOW_PRESETS,
    assert_idle,
    greedy,
    hf_reference,
    make_case,
    make_engine,
    mismatches,
    run_all,
)

SHARED_PREFIX = 64


@pytest.fixture(scope="module", params=TINY_PRESETS + FAMILY_PRESETS + WINDOW_PRESETS + LONGROPE_PRESETS + MOE_PRESETS)
def preset(request, build_model):
    path = build_model(request.param)
    cfg = EngineConfig(model=str(path))
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(str(path)).vocab_size
    case = make_case(vocab, n=48, seed=1, shared_prefix=SHARED_PREFIX)
    return request.param, path, case, hf_reference(path, case), cfg


def test_batched_greedy_matches_transformers(preset):
    _, path, case, ref, _ = preset
    engine = make_engine(path)
    got = run_all(engine, case)
    assert mismatches(got, ref.token_ids) == []
    assert_idle(engine)


def test_reference_backend_keeps_parity(preset):
    # "auto" on the CPU is the C++ kernel backend; the plain-PyTorch reference (the fallback, and
    # the CUDA path without Triton) must stay exact too.
    _, path, case, ref, _ = preset
    engine = make_engine(path, attention_backend="torch")
    assert engine.runner.backend.name == "torch"
    assert mismatches(run_all(engine, case), ref.token_ids) == []
    assert_idle(engine)


def test_preemption_keeps_parity(preset):
    name, path, case, ref, _ = preset
    # 28 blocks x 16 tokens: enough for the longest request (300 + 64), far too few for 48.
    engine = make_engine(path, num_kv_blocks=28, block_size=16)
    if name == "tiny-mistral-swa":
        # it frees the blocks that left its window, so a request needs a chunk and the window at a
        # time: 24 blocks and chunks of 128 tokens bring the shortage back
        engine = make_engine(path, num_kv_blocks=24, block_size=16, max_num_batched_tokens=128)
    got = run_all(engine, case)
    assert engine.stats().preemptions > 0
    assert mismatches(got, ref.token_ids) == []
    assert_idle(engine)


def test_priority_preemption_keeps_parity(preset):
    """Batch-priority requests fill every seat; interactive ones arrive later and take seats (slot
    preemption, not KV shortage: the cache is plentiful); every request still matches transformers."""
    _, path, case, ref, _ = preset
    engine = make_engine(path, max_num_seqs=6, enable_prefix_caching=False)
    results: dict[str, list[int]] = {}

    def step() -> None:
        for out in engine.step():
            results.setdefault(out.request_id, []).extend(out.new_token_ids)

    late = set(range(0, len(case.prompts), 3))
    for i in sorted(set(range(len(case.prompts))) - late):
        engine.add_request(f"r{i}", prompt_token_ids=case.prompts[i], params=greedy(case.max_tokens[i]), priority=2)
    for _ in range(3):
        step()
    for i in sorted(late):
        engine.add_request(f"r{i}", prompt_token_ids=case.prompts[i], params=greedy(case.max_tokens[i]), priority=0)
    while engine.has_unfinished():
        step()
    by_cause = engine.stats().preemptions_by
    assert by_cause.get((2, PreemptionCause.SLOTS), 0) > 0 and by_cause.get((2, PreemptionCause.KV), 0) == 0
    assert [i for i in range(len(case.prompts)) if results[f"r{i}"] != ref.token_ids[i]] == []
    assert_idle(engine)


def test_prefix_caching_keeps_parity(preset):
    _, path, case, ref, _ = preset
    engine = make_engine(path, enable_prefix_caching=True)
    # The first prompt with the shared prefix runs alone, so the others find its blocks.
    first = next(i for i in range(0, len(case.prompts), 2) if len(case.prompts[i]) > SHARED_PREFIX)
    results = {}
    engine.add_request("first", prompt_token_ids=case.prompts[first], params=greedy(case.max_tokens[first]))
    while engine.has_unfinished():
        for out in engine.step():
            results.setdefault(out.request_id, []).extend(out.new_token_ids)
    rest = [i for i in range(len(case.prompts)) if i != first]
    for i in rest:
        engine.add_request(f"r{i}", prompt_token_ids=case.prompts[i], params=greedy(case.max_tokens[i]))
    while engine.has_unfinished():
        for out in engine.step():
            results.setdefault(out.request_id, []).extend(out.new_token_ids)
    assert results["first"] == ref.token_ids[first]
    assert [i for i in rest if results[f"r{i}"] != ref.token_ids[i]] == []
    assert engine.stats().prefix_cache_hits >= SHARED_PREFIX // 16 * 16
    assert_idle(engine)


def test_chunked_prefill_keeps_parity(preset):
    _, path, case, ref, _ = preset
    engine = make_engine(path, max_num_batched_tokens=32)
    chunked = []
    orig = engine.scheduler.schedule

    def spy():
        out = orig()
        chunked.extend(s for s in out.scheduled if s.num_tokens > 1 and not s.sample)
        return out

    engine.scheduler.schedule = spy
    got = run_all(engine, case)
    assert chunked, "no prompt was split across steps"
    assert mismatches(got, ref.token_ids) == []
    assert_idle(engine)


@pytest.mark.parametrize("block_size", [1, 16, 32])
def test_block_sizes_keep_parity(preset, block_size):
    _, path, case, ref, _ = preset
    engine = make_engine(path, block_size=block_size, num_kv_blocks=40000 // block_size)
    got = run_all(engine, case)
    assert mismatches(got, ref.token_ids) == []
    assert_idle(engine)


def test_logprobs_match_transformers(preset):
    _, path, case, ref, _ = preset
    engine = make_engine(path)
    res = engine.generate(case.prompts[:12], [greedy(m, logprobs=3) for m in case.max_tokens[:12]])
    for r, want in zip(res, ref.logprobs[:12], strict=True):
        got = [lp.logprob for lp in r.logprobs]
        assert len(got) == len(want)
        assert max(abs(a - b) for a, b in zip(got, want, strict=True)) < 1e-4
        for lp in r.logprobs:  # top-N is sorted and contains the greedy choice first
            assert len(lp.top) == 3 and lp.top[0][0] == lp.token_id
    assert_idle(engine)
