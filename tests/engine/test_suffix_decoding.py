"""Suffix decoding (engine/spec/suffix_tree.py): the tree's counts, bounds and eviction; greedy parity with
the suffix proposer; drafts taken from an earlier request's output."""

from __future__ import annotations

import pytest

from engine import SamplingParams
from engine.config.speculative import SpeculativeConfig
from engine.request import Request
from engine.spec.suffix_tree import SuffixProposer, SuffixTree

from .helpers import Case, make_case, make_engine, mismatches, spec_engine
from .test_speculative import _run

SUFFIX = {"method": "suffix", "num_speculative_tokens": 4, "suffix_decoding_max_tree_depth": 16,
          "suffix_decoding_max_cached_requests": 64}  # fmt: skip


def test_tree_proposes_the_most_frequent_continuation():
    tree = SuffixTree(max_depth=8, max_sequences=10)
    tree.add([1, 2, 3, 4, 5])
    tree.add([9, 2, 3, 4, 6])
    tree.add([7, 2, 3, 4, 6, 8])
    assert tree.propose([0, 3, 4], 4, 4.0, 0.1) == [6, 8]  # "3 4" is followed by 6 twice, by 5 once
    assert tree.propose([0, 3, 4], 4, 4.0, 0.6) == [6]  # 8 follows "3 4 6" in 1 of 2: under the share
    assert tree.propose([1, 2], 4, 4.0, 0.1) == [3, 4, 5]  # the longest match ("1 2") wins
    assert tree.propose([2, 3], 4, 0.5, 0.1) == [4]  # spec factor 0.5 x match length 2: one token
    assert tree.propose([42], 4, 4.0, 0.1) == []


def test_a_long_draft_ceiling_still_matches_long_suffixes():
    """k at the tree's depth (vLLM's default for suffix) keeps matches of up to half the depth, so the
    draft follows the longest context (before: room for k drafts left one-token matches only)."""
    tree = SuffixTree(max_depth=8, max_sequences=10)
    tree.add([1, 2, 3, 4, 5, 6, 7])
    tree.add([9, 3, 4, 8, 8, 8, 8])  # "3 4" alone is followed by 5 once and by 8 once
    assert tree.propose([1, 2, 3, 4], 8, 1.0, 0.1) == [5, 6, 7]  # match "1 2 3 4": 4 tokens of room
    assert tree.propose([9, 3, 4], 8, 1.0, 0.1) == [8, 8, 8]  # match "9 3 4": at most 3 (factor 1.0)


def test_suffix_draft_ceiling_defaults_to_the_tree_depth_as_vllm():
    assert SpeculativeConfig.from_dict({"method": "suffix"}).num_speculative_tokens == 24
    assert SpeculativeConfig.from_dict({"method": "suffix", "suffix_decoding_max_tree_depth": 12}).num_speculative_tokens == 12
    assert SpeculativeConfig.from_dict({"method": "suffix", "num_speculative_tokens": 5}).num_speculative_tokens == 5
    assert SpeculativeConfig.from_dict({"method": "ngram"}).num_speculative_tokens == 4


def test_tree_is_bounded_and_evicts_the_oldest():
    tree = SuffixTree(max_depth=4, max_sequences=2)
    tree.add([1, 2, 3])
    tree.add([4, 5, 6])
    tree.add([7, 8, 9])  # [1, 2, 3] goes
    assert len(tree) == 2
    assert tree.propose([1, 2], 3, 4.0, 0.0) == []
    assert tree.propose([7, 8], 3, 4.0, 0.0) == [9]
    small = SuffixTree(max_depth=4, max_sequences=100, max_nodes=20)
    for i in range(10):
        small.add([100 + i, 200 + i, 300 + i, 400 + i])  # 4 + 3 + 2 + 1 = 10 nodes each
        assert small.num_nodes <= 20
    assert len(small) == 2
    depth = SuffixTree(max_depth=3, max_sequences=5)
    depth.add(list(range(10)))
    assert depth.num_nodes == 3 * 8 + 2 + 1  # paths of at most 3 tokens from each of 10 starts


def test_removal_gives_every_node_back():
    tree = SuffixTree(max_depth=5, max_sequences=1)
    tree.add([1, 2, 1, 2, 1, 3])
    tree.add([5, 5])
    assert tree.num_nodes == 2 and tree.root.children.keys() == {5}


def test_config_reads_vllm_suffix_keys():
    cfg = SpeculativeConfig.from_dict({"method": "suffix", "suffix_decoding_max_tree_depth": 32,
                                       "suffix_decoding_max_cached_requests": 0,
                                       "suffix_decoding_max_spec_factor": 2.0, "suffix_decoding_min_token_prob": 0.2})
    assert (cfg.suffix_decoding_max_tree_depth, cfg.suffix_decoding_max_cached_requests) == (32, 0)
    with pytest.raises(ValueError, match="suffix_decoding_min_token_prob"):
        SpeculativeConfig(method="suffix", suffix_decoding_min_token_prob=1.5)
    with pytest.raises(ValueError, match="suffix_decoding_max_tree_depth"):
        SpeculativeConfig(method="suffix", suffix_decoding_max_tree_depth=0)
    proposer = SuffixProposer(cfg)
    req = Request("a", [1, 2, 3], SamplingParams(), 0, 0.0, frozenset())
    req.output_token_ids = [4, 5, 6]
    proposer.finished(req)
    assert len(proposer.tree) == 0  # max_cached_requests 0: nothing is kept


@pytest.fixture(scope="module")
def tiny(build_model):
    from transformers import AutoConfig

    path = build_model("tiny-llama")
    vocab = AutoConfig.from_pretrained(str(path)).vocab_size
    case = make_case(vocab, n=10, seed=11, shared_prefix=32)
    case = Case(case.prompts, [max(m, 20) for m in case.max_tokens])
    return path, vocab, case, _run(make_engine(path), case)


def test_greedy_parity_with_the_suffix_proposer(tiny):
    """Each prompt twice, the second round after the first finished: the second round's drafts come
    from the first round's outputs, its output is unchanged, and most of it was accepted drafts."""
    path, vocab, case, ref = tiny
    engine = spec_engine(path, speculative=SUFFIX, block_size=8, max_num_batched_tokens=48)  # chunked prefill
    assert _run(engine, case, check=True) == ref
    first = engine.stats()
    second = _run(engine, case, check=True)
    assert mismatches(second, ref) == []
    st = engine.stats()
    accepted = st.spec_accepted_tokens - first.spec_accepted_tokens
    generated = st.generation_tokens - first.generation_tokens
    assert accepted > generated // 2, (accepted, generated)
    assert st.steps - first.steps < first.steps
    assert st.prefix_cache_hits > first.prefix_cache_hits  # the second round's prompts were cached


def test_suffix_proposes_from_an_earlier_requests_output(tiny):
    path, vocab, case, ref = tiny
    engine = spec_engine(path, speculative=SUFFIX)
    prompt = case.prompts[2]
    engine.add_request("a", prompt_token_ids=prompt, params=SamplingParams(max_tokens=20, temperature=0.0))
    while engine.has_unfinished():
        engine.step()
    proposer = engine.scheduler.proposer
    assert isinstance(proposer, SuffixProposer) and len(proposer.tree) == 1
    later = Request("b", prompt + ref[2][:3], SamplingParams(), 0, 0.0, frozenset())
    assert proposer.propose(later, 4) == ref[2][3:7]  # request a's output, after the context it matched
    fresh = SuffixProposer(engine.scheduler.config.speculative)
    assert fresh.propose(later, 4) != ref[2][3:7]  # not from the request's own tokens
