"""Qwen3.5's MoE variant (engine/models/qwen35.py Qwen35MoeForCausalLM): tiny-qwen35's hybrid layers with
experts on every layer (top-2 of 8 renormalised, a shared expert scaled by its sigmoid gate): greedy tokens
equal transformers' in float32 under batching, chunked prefill mixed with decodes, and KV preemption."""

from __future__ import annotations

import pytest

from engine.models.moe import SparseMoeBlock

from .helpers import greedy, make_case, make_engine, mismatches, run_all
from .test_qwen35 import assert_slots_free, single_thread_reference


@pytest.fixture(scope="module")
def qwen35_moe(build_model):
    path = build_model("tiny-qwen35-moe")
    # (seed 2's prompt 4 is a near tie: at its 4th token transformers' top two logits are 0.004 apart, less
    # than its own cached and uncached passes differ there (routing gaps of 2e-5 between the 2nd and 3rd
    # expert); no engine can be held to either side of it)
    case = make_case(2048, n=6, seed=1)
    return path, case, single_thread_reference(path, case)


def test_experts_on_every_layer_and_batched_greedy_matches_transformers(qwen35_moe):
    path, case, ref = qwen35_moe
    engine = make_engine(path)
    layers = engine.runner.model.model.layers
    assert all(isinstance(layer.mlp, SparseMoeBlock) and layer.mlp.shared_expert is not None for layer in layers)
    assert tuple(engine.runner.delta_state.shape[:1]) == (4,) and len(engine.runner.kv_caches) == 2
    assert mismatches(run_all(engine, case), ref.token_ids) == []
    assert_slots_free(engine)


def test_chunked_prefill_and_kv_preemption_keep_parity(qwen35_moe):
    path, case, ref = qwen35_moe
    engine = make_engine(path, max_num_batched_tokens=7, num_kv_blocks=24, block_size=16)
    got = engine.generate(case.prompts, [greedy(m) for m in case.max_tokens])
    assert mismatches([r.token_ids for r in got], ref.token_ids) == []
    assert engine.stats().preemptions > 0
    assert_slots_free(engine)
