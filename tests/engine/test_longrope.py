"""LongRoPE (Phi-3 / Phi-4-mini, rope_scaling type longrope): short factors up to
original_max_position_embeddings (the switch), long ones past it, as transformers' Phi-3 generate
chooses them for one sequence: a prompt longer than the switch is turned with the long factors, and a
sequence that grows past it is computed again from its first token (transformers drops its cache
there). tiny-phi3-longrope switches at 32 tokens, serves 512 (the whole parity suite runs on it too:
tests/engine/test_parity.py)."""

from __future__ import annotations

import pytest

from .helpers import assert_idle, case_fix, greedy, hf_reference, make_engine, mismatches, spec_engine

SWITCH = 32
# a prompt at each side of the switch, ones that cross it while generating, ones far past it
LENGTHS = (1, 5, 20, 31, 32, 33, 40, 90, 200)


@pytest.fixture(scope="module")
def longrope(build_model):
    path = build_model("tiny-phi3-longrope")
    case = case_fix([[7 + (i * 13 + n) % 1500 for i in range(n)] for n in LENGTHS], [40] * len(LENGTHS))
    return path, case, hf_reference(path, case)


def test_serves_max_position_embeddings_past_the_switch(longrope):
    path, _, _ = longrope
    engine = make_engine(path)
    assert engine.max_model_len == 512  # not capped to original_max_position_embeddings
    assert engine.runner.model.rope_switch == SWITCH
    assert make_engine(path, max_model_len=400).max_model_len == 400


def test_greedy_below_at_and_past_the_switch_matches_transformers(longrope):
    """Prompts below the switch that cross it while generating (each computed again once: counted),
    prompts of exactly the switch, and prompts past it, in one batch: token-exact."""
    path, case, ref = longrope
    engine = make_engine(path)
    got = [r.token_ids for r in engine.generate(case.prompts, [greedy(m) for m in case.max_tokens])]
    assert mismatches(got, ref.token_ids) == []
    # computed again: a request that has more than SWITCH tokens after a token it goes on from
    crossing = sum(1 for p, t in zip(case.prompts, ref.token_ids, strict=True) if len(p) <= SWITCH < len(p) + len(t) - 1)
    assert crossing >= 4 and engine.stats().rope_recomputes == crossing
    assert engine.stats().preemptions == 0  # the recompute keeps its seat: not a preemption
    assert_idle(engine)


def test_short_factors_only_would_drift(longrope, monkeypatch):
    """The long factors matter in this model: with every token on the short ones (the switch moved
    past the context) the output differs from transformers for prompts past the switch."""
    path, case, ref = longrope
    from engine.models import rope

    monkeypatch.setattr(rope, "longrope_switch", lambda cfg, layer_type=None: None)
    got = [r.token_ids for r in make_engine(path).generate(case.prompts, [greedy(m) for m in case.max_tokens])]
    assert {i for i, n in enumerate(LENGTHS) if n > SWITCH} <= set(mismatches(got, ref.token_ids))


class _Oracle:
    """Drafts transformers' own next tokens, so every draft is accepted, across the switch too."""

    def __init__(self, prompts: list[list[int]], outputs: list[list[int]]) -> None:
        self.outputs = {tuple(p): o for p, o in zip(prompts, outputs, strict=True)}

    def propose(self, req, k: int) -> list[int]:
        return self.outputs[tuple(req.prompt_token_ids)][req.num_output_tokens :][:k]


def test_speculative_rows_stop_at_the_switch(longrope):
    """Drafts verified past the switch would be judged on K/V of the short factors: a row keeps the
    tokens it sampled below the switch (trimmed: counted here), then the sequence is computed again,
    token-exact. Drafts are transformers' own tokens, so rows do reach past the switch."""
    path, case, ref = longrope
    engine = spec_engine(path, speculative={"num_speculative_tokens": 4, "prompt_lookup_max": 4,
                                            "prompt_lookup_min": 1, "disable_by_batch_size": 64})  # fmt: skip
    engine.scheduler.proposer = _Oracle(case.prompts, ref.token_ids)
    trimmed: list[int] = []
    cap = engine.runner._rope_cap

    def counting(tokens, lps, spec):
        before = sum(len(t) for t in tokens.values())
        cap(tokens, lps, spec)
        trimmed.append(before - sum(len(t) for t in tokens.values()))

    engine.runner._rope_cap = counting
    got = [r.token_ids for r in engine.generate(case.prompts, [greedy(m) for m in case.max_tokens])]
    assert mismatches(got, ref.token_ids) == []
    assert sum(trimmed) > 0 and engine.stats().rope_recomputes > 0
    assert engine.stats().spec_accepted_tokens > 100
    assert_idle(engine)


@pytest.mark.parametrize("first_long", [False, True])
def test_prefix_cache_keeps_the_two_sides_of_the_switch_apart(longrope, first_long):
    """A prompt below the switch and one past it share their first 16-token block, but not its K/V
    (short vs long factors): neither finds the other's block; two prompts past it do."""
    path, _, _ = longrope
    base = [11 + (i * 7) % 1500 for i in range(48)]
    short, long, long2 = base[:24], base[:40], base[:44]
    case = case_fix([short, long, long2], [4, 4, 4])  # 24 + 4 stays below the switch
    ref = hf_reference(path, case).token_ids
    engine = make_engine(path, block_size=16, enable_prefix_caching=True)
    order = [1, 0, 2] if first_long else [0, 1, 2]
    got: dict[int, list[int]] = {}
    hits = []
    for i in order:
        before = engine.stats().prefix_cache_hits
        got[i] = engine.generate([case.prompts[i]], [greedy(4)])[0].token_ids
        hits.append(engine.stats().prefix_cache_hits - before)
    assert [got[i] for i in range(3)] == ref
    assert hits[:2] == [0, 0]  # the other side's block is not reused
    assert hits[2] >= 32  # long2 finds long's two blocks
    assert_idle(engine)


def test_full_rotary_longrope_runs_the_cpp_decode_loop(longrope, tmp_path):
    """Phi-3-mini-128k's kind (LongRoPE over whole heads): the C++ decode loop takes its decode steps
    (their cos/sin rows come from the same tables: position alone decides a decode's factors), and the
    output stays equal to transformers."""
    import json
    import shutil

    path, case, _ = longrope
    folder = tmp_path / "full-rotary"
    shutil.copytree(path, folder)
    cfg = json.loads((folder / "config.json").read_text())
    rope = cfg["rope_parameters"]
    rope["partial_rotary_factor"] = cfg["partial_rotary_factor"] = 1.0
    rope["short_factor"] = [1.0 + 0.05 * i for i in range(16)]
    rope["long_factor"] = [1.0 + 1.5 * i for i in range(16)]
    (folder / "config.json").write_text(json.dumps(cfg))
    ref = hf_reference(folder, case)
    engine = make_engine(folder)
    fused = engine.runner.model.model.fused_decode
    assert fused is not None
    taken = []
    run = fused.run

    def counted(x, ctx):
        out = run(x, ctx)
        taken.append(out is not None)
        return out

    fused.run = counted
    got = [r.token_ids for r in engine.generate(case.prompts, [greedy(m) for m in case.max_tokens])]
    assert mismatches(got, ref.token_ids) == []
    assert sum(taken) > 10 and engine.stats().rope_recomputes > 0
    assert_idle(engine)
