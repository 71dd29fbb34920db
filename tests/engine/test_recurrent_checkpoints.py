"""State checkpoints (engine/state/checkpoint_store.py) with two state tensors a slot: Qwen3.5's conv
windows and Gated DeltaNet matrices, Granite 4's Mamba2 conv windows and float32 SSM matrices. Both are
copied into a checkpoint and back, so turn 2 of a chat resumes from the end of turn 1 (cached tokens
reported) with transformers' greedy tokens; a store that copied only the conv windows would resume from
the wrong matrices (log-probabilities off, then tokens). LFM2's one tensor: test_lfm2_checkpoints.py."""

from __future__ import annotations

import pytest
import torch

from .helpers import Case, greedy, hf_reference, make_engine
from .test_lfm2_checkpoints import BS, assert_released, expected_resume

PRESETS = ["tiny-qwen35", "tiny-granite4-dense"]  # conv + DeltaNet matrices; conv + SSM matrices
FIRST = [150, 37, 201]
ANSWER = [20, 40, 3]
USER2 = [37, 5, 16]
NEXT = 10


@pytest.fixture(scope="module", params=PRESETS)
def chats(build_model, request):
    path = build_model(request.param)
    g = torch.Generator().manual_seed(7)
    first = [torch.randint(10, 2048, (n,), generator=g).tolist() for n in FIRST]
    ref1 = hf_reference(path, Case(first, ANSWER))
    second = [p + a + torch.randint(10, 2048, (u,), generator=g).tolist()
              for p, a, u in zip(first, ref1.token_ids, USER2, strict=True)]
    ref2 = hf_reference(path, Case(second, [NEXT] * len(second)))
    return path, [first, second], [ref1, ref2]


def test_turn_two_resumes_both_state_tensors_from_checkpoints(chats):
    path, turns, refs = chats
    engine = make_engine(path, block_size=BS, max_num_batched_tokens=64)
    assert engine.checkpoints is not None and len(engine.runner.checkpoints.state) == 2  # conv + delta / ssm
    results = []
    for t, prompts in enumerate(turns):
        width = ANSWER if t == 0 else [NEXT] * len(prompts)
        got = engine.generate(prompts, [greedy(m, logprobs=0) for m in width])
        for i, r in enumerate(got):
            assert r.token_ids == refs[t].token_ids[i], f"turn {t + 1}, conversation {i}"
            lps = [lp.logprob for lp in r.logprobs]
            assert max(abs(a - b) for a, b in zip(lps, refs[t].logprobs[i], strict=True)) < 5e-4
        results.append(got)
    want = [expected_resume(len(p), len(a)) for p, a in zip(turns[0], refs[0].token_ids, strict=True)]
    assert [r.cached_tokens for r in results[1]] == want and min(want) > 0
    assert engine.checkpoints.hits == len(FIRST)
    assert_released(engine)
