"""Prompt log-probabilities (SamplingParams.prompt_logprobs) equal transformers' log-softmax of the
same prompt within 1e-4 (float32), whatever the chunking: logits in LOGITS_CHUNK rows, prompts split
across steps by the token budget, a recompute after preemption, a prefix the cache already holds.
max_tokens 0 runs the prompt and samples nothing."""

from __future__ import annotations

import pytest
import torch

from engine import SamplingParams
from engine.api import FinishReason, InvalidParam
from engine.sample import prompt_logprobs as plp

from .helpers import assert_idle, make_engine

TOL = 1e-4
TOP = 3


@pytest.fixture(scope="module")
def path(build_model):
    return build_model("tiny-llama")


@pytest.fixture(scope="module")
def prompts(path):
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(str(path)).vocab_size
    g = torch.Generator().manual_seed(7)
    return [torch.randint(10, vocab, (n,), generator=g).tolist() for n in (1, 2, 37, 300, 611)]


@pytest.fixture(scope="module")
def reference(path, prompts):
    """Per prompt: transformers' log-softmax over the vocabulary at every position, float32."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.no_grad():
        return [torch.log_softmax(model(torch.tensor([p])).logits[0].float(), -1) for p in prompts]


def check(result, prompt, ref) -> None:
    lps = result.prompt_logprobs
    assert lps is not None and len(lps) == len(prompt) and lps[0] is None
    for i, lp in enumerate(lps[1:], start=1):
        row = ref[i - 1]  # position i-1 predicts token i
        assert lp.token_id == prompt[i]
        assert abs(lp.logprob - float(row[prompt[i]])) < TOL, (i, lp.logprob, float(row[prompt[i]]))
        want_ids = row.topk(TOP).indices.tolist()
        assert [t for t, _ in lp.top] == want_ids
        assert all(abs(v - float(row[t])) < TOL for t, v in lp.top)


def params(max_tokens=1, top=TOP, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, prompt_logprobs=top, **kw)


def test_prompt_logprobs_match_transformers_in_chunks(path, prompts, reference, monkeypatch):
    monkeypatch.setattr(plp, "LOGITS_CHUNK", 64)  # 611 tokens: 10 chunks of logits
    engine = make_engine(path, max_num_batched_tokens=128)  # and 5 steps of prompt
    results = engine.generate(prompts, [params() for _ in prompts])
    for result, prompt, ref in zip(results, prompts, reference, strict=True):
        check(result, prompt, ref)
        assert len(result.token_ids) == 1
    assert_idle(engine)


def test_max_tokens_0_runs_the_prompt_only(path, prompts, reference):
    engine = make_engine(path)
    results = engine.generate(prompts, [params(max_tokens=0) for _ in prompts])
    for result, prompt, ref in zip(results, prompts, reference, strict=True):
        check(result, prompt, ref)
        assert result.token_ids == [] and result.finish_reason is FinishReason.LENGTH
    assert engine.stats().generation_tokens == 0
    assert_idle(engine)


def test_cached_prefix_is_recomputed_for_prompt_logprobs(path, prompts, reference):
    engine = make_engine(path, block_size=16)
    engine.generate([prompts[4]], SamplingParams(max_tokens=1, temperature=0.0))  # fills the prefix cache
    hits = engine.stats().prefix_cache_hits
    [result] = engine.generate([prompts[4]], params(max_tokens=0, top=0))
    check_top0 = [lp for lp in result.prompt_logprobs[1:] if lp.top]
    assert check_top0 == [] and len(result.prompt_logprobs) == len(prompts[4])
    assert engine.stats().prefix_cache_hits == hits  # nothing came from the cache
    ref = reference[4]
    assert max(abs(lp.logprob - float(ref[i][prompts[4][i + 1]])) for i, lp in enumerate(result.prompt_logprobs[1:])) < TOL


def test_preemption_does_not_redo_or_lose_prompt_logprobs(path, prompts, reference):
    # 40 blocks x 16 tokens: the 611- and 300-token prompts (with 64 new tokens each) cannot both hold
    # their blocks, so one is preempted and recomputed.
    engine = make_engine(path, num_kv_blocks=46, block_size=16, max_num_batched_tokens=64)
    long = [prompts[3], prompts[4], prompts[2]]
    results = engine.generate(long, [params(max_tokens=64, ignore_eos=True) for _ in long])
    assert engine.stats().preemptions > 0
    for result, i in zip(results, (3, 4, 2), strict=True):
        check(result, prompts[i], reference[i])
    assert_idle(engine)


def test_validation():
    with pytest.raises(InvalidParam) as e:
        SamplingParams(max_tokens=0)
    assert e.value.field == "max_tokens"
    with pytest.raises(InvalidParam) as e:
        SamplingParams(prompt_logprobs=21)
    assert e.value.field == "prompt_logprobs"
    assert SamplingParams(max_tokens=0, prompt_logprobs=0).max_tokens == 0
