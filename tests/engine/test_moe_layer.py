"""The MoE layer (engine/models/moe.py) against a dense per-token reference: random routing, experts
that receive no token, every token on one expert; the router's arithmetic against transformers'."""

from __future__ import annotations

import pytest
import torch

from engine.models.moe import (
    SparseMoeBlock,
    dense_reference,
    expert_destination,
    expert_missing,
    expert_slot,
    grouped_experts,
    route,
    stacked_expert,
)

E, H, INTER = 8, 32, 48


def _weights(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(E, 2 * INTER, H, generator=g) * 0.2, torch.randn(E, H, INTER, generator=g) * 0.2


@pytest.mark.parametrize("tokens,top_k", [(1, 1), (1, 2), (7, 2), (33, 3), (64, 8)])
def test_grouped_experts_match_the_per_token_reference(tokens, top_k):
    gate_up, down = _weights(tokens)
    g = torch.Generator().manual_seed(100 + tokens)
    x = torch.randn(tokens, H, generator=g)
    weights, ids = route(torch.randn(tokens, E, generator=g), top_k, normalize=True)
    got = grouped_experts(x, ids, weights, stacked_expert(gate_up, down), E)
    want = dense_reference(x, ids, weights, gate_up, down)
    assert got.shape == (tokens, H) and got.dtype == x.dtype
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_experts_without_tokens_are_skipped_and_cost_nothing():
    gate_up, down = _weights(1)
    x = torch.randn(5, H)
    ids = torch.tensor([[1, 6]] * 5)  # experts 0, 2..5, 7 receive nothing
    weights = torch.full((5, 2), 0.5)
    gate_up[[0, 2, 3, 4, 5, 7]] = float("nan")  # read: the output would be NaN
    got = grouped_experts(x, ids, weights, stacked_expert(gate_up, down), E)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, dense_reference(x, ids, weights, gate_up, down), rtol=1e-5, atol=1e-5)


def test_all_tokens_on_one_expert():
    gate_up, down = _weights(2)
    x = torch.randn(20, H)
    ids = torch.full((20, 1), 3)
    weights = torch.rand(20, 1)
    got = grouped_experts(x, ids, weights, stacked_expert(gate_up, down), E)
    torch.testing.assert_close(got, dense_reference(x, ids, weights, gate_up, down), rtol=1e-5, atol=1e-5)
    # and exactly one expert's product: the token's weight times expert 3 alone
    alone = torch.nn.functional.linear(torch.nn.functional.silu(x @ gate_up[3, :INTER].T) * (x @ gate_up[3, INTER:].T),
                                       down[3]) * weights
    torch.testing.assert_close(got, alone, rtol=1e-5, atol=1e-5)


def test_a_token_does_not_depend_on_its_neighbours_routing():
    """Row t's result is the same alone and in a batch where other tokens pick other experts (float32,
    each product's rows independent; the sum per token in ascending expert order)."""
    gate_up, down = _weights(3)
    g = torch.Generator().manual_seed(7)
    x = torch.randn(16, H, generator=g)
    weights, ids = route(torch.randn(16, E, generator=g), 2, normalize=False)
    batch = grouped_experts(x, ids, weights, stacked_expert(gate_up, down), E)
    for t in (0, 9, 15):
        alone = grouped_experts(x[t : t + 1], ids[t : t + 1], weights[t : t + 1], stacked_expert(gate_up, down), E)
        torch.testing.assert_close(batch[t : t + 1], alone, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("normalize", [False, True])
def test_routing_is_transformers_arithmetic(normalize):
    logits = torch.randn(12, E, dtype=torch.float64).float()
    weights, ids = route(logits, 2, normalize)
    probs = torch.softmax(logits, dim=-1, dtype=torch.float)
    top, idx = torch.topk(probs, 2, dim=-1)
    if normalize:
        top = top / top.sum(dim=-1, keepdim=True)
    assert weights.dtype == torch.float32 and torch.equal(ids, idx) and torch.equal(weights, top)
    if normalize:  # Mixtral's: a softmax over the top-k logits
        torch.testing.assert_close(weights, torch.softmax(logits.gather(1, ids), dim=-1))


def test_router_logits_are_float32_from_bf16_inputs():
    block = SparseMoeBlock(H, INTER, E, 2, True)
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.2)
    block = block.to(torch.bfloat16)
    x = torch.randn(4, H, dtype=torch.bfloat16)
    assert block.gate(x).dtype == torch.float32
    assert block(x).dtype == torch.bfloat16


def test_block_with_shared_expert_matches_its_definition():
    block = SparseMoeBlock(H, INTER, E, 2, False, shared_intermediate=24)
    torch.manual_seed(0)
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.2)
    x = torch.randn(9, H)
    weights, ids = route(block.gate(x), 2, False)
    routed = dense_reference(x, ids, weights, block.experts.gate_up_proj.data, block.experts.down_proj.data)
    shared = torch.sigmoid(x @ block.shared_expert_gate.weight.T) * block.shared_expert(x)
    with torch.no_grad():
        torch.testing.assert_close(block(x), routed + shared, rtol=1e-5, atol=1e-5)


def test_expert_counts_when_asked():
    block = SparseMoeBlock(H, INTER, E, 2, True)
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.2)
    block.count_tokens()
    with torch.no_grad():
        block(torch.randn(10, H))
    assert block.counts is not None and int(block.counts.sum()) == 20


def test_checkpoint_names_find_their_slots():
    s = expert_slot("model.layers.2.mlp.experts.5.up_proj.weight")
    assert (s.param, s.expert, s.shard) == ("model.layers.2.mlp.experts.gate_up_proj", 5, 1)
    s = expert_slot("model.layers.0.mlp.experts.7.w2.weight")
    assert (s.param, s.expert, s.shard) == ("model.layers.0.mlp.experts.down_proj", 7, 0)
    s = expert_slot("model.layers.1.mlp.experts.gate_up_proj")
    assert (s.param, s.expert, s.shard) == ("model.layers.1.mlp.experts.gate_up_proj", None, None)
    s = expert_slot("model.layers.1.mlp.experts.up_proj.weight")  # GGUF's stacked ffn_up_exps
    assert (s.param, s.expert, s.shard, s.tag) == ("model.layers.1.mlp.experts.gate_up_proj", None, 1,
                                                   "model.layers.1.mlp.experts.gate_up_proj#*.1")
    assert expert_missing("p.experts.gate_up_proj", torch.Size([2, 4, 4]), {"p.experts.gate_up_proj#*.1",
                                                                          "p.experts.gate_up_proj#1.0"}) == [
        "p.experts.gate_up_proj#0.0"]
    assert expert_slot("model.layers.0.mlp.shared_expert.gate_proj.weight") is None
    assert expert_slot("model.layers.0.mlp.gate.weight") is None
    param = torch.zeros(E, 2 * INTER, H)
    s = expert_slot("model.layers.0.mlp.experts.3.up_proj.weight")
    expert_destination(param, s).fill_(1.0)
    assert param[3, INTER:].eq(1).all() and param[3, :INTER].eq(0).all() and param.sum() == INTER * H
    expert_destination(param, expert_slot("m.experts.gate_proj.weight")).fill_(2.0)
    assert param[:, :INTER].eq(2).all() and param[3, INTER:].eq(1).all()
