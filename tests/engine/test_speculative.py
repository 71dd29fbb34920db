"""Speculative decoding (engine/spec/drafts.py, engine/sample/verify.py): greedy output is token for token
that of non-speculative greedy (float32) under concurrency, preemption, prefix-cache hits and chunked
prefill; rejected drafts leave the KV bookkeeping exact after every step; sampled output keeps the
target distribution and reproduces itself with a seed.

Most engine tests use an oracle proposer (the reference continuation, with every third draft token
corrupted): a random tiny model almost never repeats itself, so the n-gram proposer alone would
exercise only rejections. One test runs the real n-gram proposer on prompts that repeat."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from engine import SamplingParams
from engine.request import Request
from engine.sample.verify import accepted_prefix, verify_sampled
from engine.spec.drafts import SpeculativeConfig, draft_length, ngram_propose, update_acceptance

from .helpers import Case, make_case, make_engine, mismatches, spec_engine

SPEC = {"num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 1, "disable_by_batch_size": 64}


# ---- plain parts ------------------------------------------------------------------------------------
def test_ngram_proposes_what_followed_the_latest_match():
    toks = [1, 2, 3, 4, 5, 9, 2, 3, 4, 7, 8, 1, 2, 3]
    # "1 2 3" (n=3) last occurred at 0, followed by 4 5 9
    assert ngram_propose(toks, 3, 4, 2) == [4, 5, 9]
    assert ngram_propose(toks, 2, 3, 2) == [4, 5]
    # "2 3" alone (n_max=2): its latest earlier occurrence is at 6, followed by 4 7 8
    assert ngram_propose(toks, 3, 2, 2) == [4, 7, 8]
    assert ngram_propose([5, 6, 7, 8], 4, 4, 1) == []  # no earlier occurrence
    assert ngram_propose([1, 2, 1], 4, 4, 1) == [2, 1]  # only what exists after the match


def test_config_validates_and_reads_vllm_keys():
    cfg = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 5,
                                       "prompt_lookup_min": 2})  # fmt: skip
    assert (cfg.num_speculative_tokens, cfg.prompt_lookup_max, cfg.prompt_lookup_min) == (3, 5, 2)
    with pytest.raises(ValueError, match="method"):
        SpeculativeConfig(method="eagle")
    with pytest.raises(ValueError, match="unknown keys"):
        SpeculativeConfig.from_dict({"num_speculative_tokenz": 3})
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        SpeculativeConfig(prompt_lookup_min=5, prompt_lookup_max=2)
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        SpeculativeConfig(num_speculative_tokens=0)


def test_draft_length_shrinks_with_low_acceptance_and_recovers():
    req = Request("r", [1, 2], SamplingParams(), 0, 0.0, frozenset())
    assert draft_length(req, 4) == 4
    for _ in range(3):
        update_acceptance(req, 4, 0)
    assert draft_length(req, 4) == 1
    for _ in range(4):
        update_acceptance(req, 1, 1)
    assert draft_length(req, 4) == 4


def test_greedy_verification_takes_the_agreeing_prefix_and_one_more():
    assert accepted_prefix([5, 6, 7], [5, 6, 9, 1]) == [5, 6, 9]  # correction at the first disagreement
    assert accepted_prefix([5, 6], [5, 6, 8]) == [5, 6, 8]  # all accepted: the bonus token
    assert accepted_prefix([5, 6], [4, 6, 8]) == [4]
    assert accepted_prefix([5, 6], [5, None, 8]) is None  # a needed row was not finite


def test_rejection_sampling_keeps_the_target_distribution():
    """Synthetic logits (vocab 6, 2 drafts): the first emitted token ~ p0; after an accepted d0 the next
    ~ p1; top-k and logit_bias shape p as the sampler does. 4 standard errors over 6,000 draws."""
    torch.manual_seed(0)
    logits = torch.randn(3, 6) * 1.5
    params = SamplingParams(temperature=0.8, top_k=4, logit_bias={2: 1.0}, seed=7)
    req = Request("r", [1], params, 0, 0.0, frozenset())
    from engine.sample.sampler import Sampler
    from engine.sample.verify import target_probs

    p = target_probs(logits, [req] * 3)
    p = p / p.sum(dim=-1, keepdim=True)
    drafts = [int(p[0].argmax()), int(p[1].argsort()[-2])]  # a likely and a less likely draft
    sampler, n = Sampler(0), 6000
    first, second = Counter(), Counter()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny tensors: a thread pool on a loaded machine costs 10x
    try:
        for _ in range(n):
            out = verify_sampled(sampler, logits, req, drafts)
            first[out[0]] += 1
            if out[0] == drafts[0]:
                second[out[1]] += 1
    finally:
        torch.set_num_threads(threads)
    _assert_matches(first, n, p[0].tolist())
    _assert_matches(second, sum(second.values()), p[1].tolist())
    assert first[int(p[0].argsort()[0])] == 0  # a token top-k removed is never drawn


def _assert_matches(counts: Counter, n: int, probs: list[float]) -> None:
    for tok, want in enumerate(probs):
        got = counts[tok] / n
        se = math.sqrt(max(want * (1 - want), 1e-12) / n)
        assert abs(got - want) <= 4 * se + 1e-9, (tok, got, want)


# ---- the engine --------------------------------------------------------------------------------------
class OracleProposer:
    """Drafts the reference continuation of each request, with every third draft token wrong."""

    def __init__(self, refs: dict[str, list[int]], vocab: int) -> None:
        self.refs, self.vocab, self.calls = refs, vocab, 0

    def propose(self, req: Request, k: int) -> list[int]:
        ref = self.refs.get(req.request_id, [])
        drafts = list(ref[req.num_output_tokens : req.num_output_tokens + k])
        self.calls += 1
        if drafts and self.calls % 3 == 0:
            i = self.calls % len(drafts)
            drafts[i] = (drafts[i] + 1) % self.vocab
        return drafts


@pytest.fixture(scope="module")
def tiny(build_model):
    from transformers import AutoConfig

    path = build_model("tiny-llama")
    vocab = AutoConfig.from_pretrained(str(path)).vocab_size
    case = make_case(vocab, n=16, seed=3, shared_prefix=64)
    case = Case(case.prompts, [max(m, 24) for m in case.max_tokens])
    ref = _run(make_engine(path), case)
    return path, vocab, case, ref


def _run(engine, case: Case, params=None, check=False) -> list[list[int]]:
    """Submit every prompt, step to the end (checking the KV bookkeeping after every step when asked)."""
    got: dict[str, list[int]] = {}
    for i, (prompt, m) in enumerate(zip(case.prompts, case.max_tokens, strict=True)):
        p = params[i] if params else SamplingParams(max_tokens=m, temperature=0.0)
        engine.add_request(f"r{i}", prompt_token_ids=prompt, params=p)
        got[f"r{i}"] = []
    while engine.has_unfinished():
        for out in engine.step():
            got[out.request_id].extend(out.new_token_ids)
            assert out.finish_reason is None or out.finish_reason.value in ("stop", "length"), out.error
        if check:
            engine.check_integrity()
    assert engine.stats().kv_blocks_used == 0
    engine.check_integrity()
    return [got[f"r{i}"] for i in range(len(case.prompts))]


def _oracle_engine(path, vocab, ref, **kw):
    engine = spec_engine(path, speculative=SPEC, **kw)
    engine.scheduler.proposer = OracleProposer({f"r{i}": r for i, r in enumerate(ref)}, vocab)
    return engine


@pytest.mark.parametrize("regime", ["plain", "preemption", "chunked_prefill", "no_prefix_cache"])
def test_greedy_parity_with_speculation(tiny, regime):
    path, vocab, case, ref = tiny
    kw = {"plain": {}, "preemption": dict(num_kv_blocks=30, block_size=16),
          "chunked_prefill": dict(max_num_batched_tokens=40), "no_prefix_cache": dict(enable_prefix_caching=False),
          }[regime]  # fmt: skip
    engine = _oracle_engine(path, vocab, ref, **kw)
    got = _run(engine, case, check=True)
    assert mismatches(got, ref) == []
    st = engine.stats()
    assert st.spec_drafts > 0 and 0 < st.spec_accepted_tokens < st.spec_draft_tokens
    assert st.spec_accepted_per_pos[0] >= st.spec_accepted_per_pos[-1] > 0
    assert st.generation_tokens == sum(len(r) for r in ref)
    if regime == "preemption":
        assert st.preemptions > 0
    if regime != "no_prefix_cache":
        assert st.prefix_cache_hits > 0


def test_greedy_parity_under_priority_preemption(tiny):
    """Batch-priority requests fill the seats, interactive ones arrive later and take them (slot
    preemption while rows speculate); every request still matches non-speculative greedy."""
    path, vocab, case, ref = tiny
    engine = _oracle_engine(path, vocab, ref, max_num_seqs=4)
    got: dict[str, list[int]] = {f"r{i}": [] for i in range(len(case.prompts))}

    def add(i: int, priority: int) -> None:
        p = SamplingParams(max_tokens=case.max_tokens[i], temperature=0.0)
        engine.add_request(f"r{i}", prompt_token_ids=case.prompts[i], params=p, priority=priority)

    def step() -> None:
        for out in engine.step():
            got[out.request_id].extend(out.new_token_ids)
        engine.check_integrity()

    late = set(range(0, len(case.prompts), 2))
    for i in sorted(set(range(len(case.prompts))) - late):
        add(i, 2)
    for _ in range(6):
        step()
    for i in sorted(late):
        add(i, 0)
    while engine.has_unfinished():
        step()
    assert [got[f"r{i}"] for i in range(len(case.prompts))] == ref
    st = engine.stats()
    assert st.preemptions > 0 and st.spec_accepted_tokens > 0


def test_rollback_frees_the_rejected_tail(tiny):
    """A request whose drafts are all wrong across a block boundary holds exactly the blocks of its
    computed tokens after each step, and nothing rejected is registered in the prefix cache."""
    path, vocab, case, ref = tiny
    engine = spec_engine(path, speculative=SPEC, block_size=4)

    class Wrong:
        def propose(self, req, k):
            return [(t + 7) % vocab for t in ref[0][req.num_output_tokens : req.num_output_tokens + k]]

    engine.scheduler.proposer = Wrong()
    engine.add_request("r0", prompt_token_ids=case.prompts[0], params=SamplingParams(max_tokens=12, temperature=0.0))
    out: list[int] = []
    while engine.has_unfinished():
        for o in engine.step():
            out.extend(o.new_token_ids)
        req = engine.scheduler.requests.get("r0")
        if req is not None:
            assert len(req.block_ids) == -(-req.num_computed_tokens // 4)
            cached = {b.block_hash for b in engine.block_manager.blocks if b.block_hash is not None}
            assert len(cached) <= req.num_computed_tokens // 4
        engine.check_integrity()
    assert out == ref[0][:12]
    st = engine.stats()
    assert st.spec_drafts > 0 and st.spec_accepted_tokens == 0


def test_ngram_proposer_parity_and_acceptance(tiny):
    """The real n-gram proposer. A logit_bias confines the output to 3 tokens, so it repeats n-grams of
    itself and of the prompt (made of the same tokens): drafts are proposed, some accepted, some not,
    and the output is unchanged (logit_bias applies at every draft position)."""
    path, vocab, case, ref = tiny
    alphabet = [11, 12, 13]
    bias = {t: 100.0 for t in alphabet}
    g = torch.Generator().manual_seed(5)
    prompts = [[alphabet[int(i)] for i in torch.randint(0, 3, (40,), generator=g)] for _ in range(6)]
    c = Case(prompts, [40] * 6)
    params = [SamplingParams(max_tokens=40, temperature=0.0, logit_bias=bias) for _ in range(6)]
    want = _run(make_engine(path), c, params)
    engine = spec_engine(path, speculative=SPEC)
    assert _run(engine, c, params, check=True) == want
    st = engine.stats()
    assert st.spec_drafts > 0 and 0 < st.spec_accepted_tokens < st.spec_draft_tokens
    assert st.steps < make_engine_steps(path, c, params)


def make_engine_steps(path, c, params) -> int:
    engine = make_engine(path)
    _run(engine, c, params)
    return engine.stats().steps


def test_opt_out_and_large_batches_do_not_speculate(tiny):
    path, vocab, case, ref = tiny
    engine = _oracle_engine(path, vocab, ref)
    params = [SamplingParams(max_tokens=m, temperature=0.0, speculative=False) for m in case.max_tokens]
    assert _run(engine, case, params) == ref
    assert engine.stats().spec_drafts == 0
    engine = spec_engine(path, speculative={**SPEC, "disable_by_batch_size": 2})
    oracle = OracleProposer({f"r{i}": r for i, r in enumerate(ref)}, vocab)
    running_at_proposal = []

    class Watch:
        def propose(self, req, k):
            running_at_proposal.append(len(engine.scheduler.running))
            return oracle.propose(req, k)

    engine.scheduler.proposer = Watch()
    many = Case(case.prompts[:8], [4 * (i + 1) for i in range(8)])  # they finish one by one
    assert _run(engine, many) == [r[: 4 * (i + 1)] for i, r in enumerate(ref[:8])]
    assert running_at_proposal and max(running_at_proposal) <= 2
    assert engine.stats().spec_drafts > 0


ALPHABET = {11: 100.0, 12: 100.0, 13: 100.0}  # a logit_bias that confines the output to 3 tokens


def _alphabet_prompts(n: int, length: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    toks = sorted(ALPHABET)
    return [[toks[int(i)] for i in torch.randint(0, 3, (length,), generator=g)] for _ in range(n)]


def test_seeded_sampling_with_speculation_reproduces_itself(tiny):
    """Sampled rows speculate with the n-gram proposer (a 3-token output repeats itself) and a seed
    gives the same tokens twice; the output differs from another seed's."""
    path, vocab, case, ref = tiny
    c = Case(_alphabet_prompts(6, 30, seed=1), [30] * 6)
    runs = []
    for seed in (100, 100, 200):
        params = [SamplingParams(max_tokens=30, temperature=1.0, seed=seed + i, logit_bias=ALPHABET) for i in range(6)]
        engine = spec_engine(path, speculative=SPEC)
        runs.append(_run(engine, c, params, check=True))
        st = engine.stats()
        assert 0 < st.spec_accepted_tokens < st.spec_draft_tokens
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]


def test_sampled_distribution_matches_non_speculative(tiny):
    """2,000 draws of tokens 2-5 of one prompt (temperature 0.9, top_p 0.9, a 3-token logit_bias), the
    n-gram proposer on and off: each token's frequency at each position agrees within 4 standard errors
    of the difference."""
    path, vocab, case, ref = tiny
    n, m = 2000, 5
    c = Case(_alphabet_prompts(1, 17, seed=2) * n, [m] * n)  # 2 blocks of 8 cached: 1 token each to run
    params = [SamplingParams(max_tokens=m, temperature=0.9, top_p=0.9, logit_bias=ALPHABET)] * n
    kw = dict(max_num_seqs=500, block_size=8)
    off = _run(make_engine(path, **kw), c, params)
    engine = spec_engine(path, **kw, speculative={**SPEC, "disable_by_batch_size": 500})
    on = _run(engine, c, params)
    st = engine.stats()
    assert st.spec_accepted_tokens > n // 2 and st.spec_accepted_tokens < st.spec_draft_tokens
    for pos in range(1, m):
        a, b = Counter(r[pos] for r in off), Counter(r[pos] for r in on)
        for tok in set(a) | set(b):
            pa, pb = a[tok] / n, b[tok] / n
            pool = (a[tok] + b[tok]) / (2 * n)
            se = math.sqrt(pool * (1 - pool) * 2 / n)
            assert abs(pa - pb) <= 4 * se + 1e-12, (pos, tok, pa, pb)
