"""Speculative decoding with the sampling features that depend on the tokens before each position
(engine/sample/draft_positions.py): penalties, a pending min_tokens, logprobs of the emitted tokens and
structured-output masks. Greedy output with speculation is token for token the non-speculative output
(float32, tiny-llama), drafts from the oracle proposer (the reference continuation with every third
draft corrupted, so positions are both accepted and rejected)."""

from __future__ import annotations

import pytest

from engine import SamplingParams
from engine.structured import GrammarSpec

from .helpers import Case, make_case, make_engine, mismatches, spec_engine
from .test_speculative import SPEC, OracleProposer, _run

REGEX = r"[a-z]{2,5}-[0-9]{1,3}( [a-z]{1,4})*"
SCHEMA = {"type": "object", "properties": {"id": {"type": "integer"}, "tag": {"type": "string", "maxLength": 8}},
          "required": ["id", "tag"], "additionalProperties": False}  # fmt: skip


@pytest.fixture(scope="module")
def setup(build_model):
    from transformers import AutoConfig

    path = build_model("tiny-llama")
    vocab = AutoConfig.from_pretrained(str(path)).vocab_size
    case = make_case(vocab, n=8, seed=7, shared_prefix=16)
    return path, vocab, Case(case.prompts, [32] * len(case.prompts))


def _features(kind: str, eos: int) -> dict:
    return {
        "repetition": dict(repetition_penalty=1.8),
        "presence_frequency": dict(presence_penalty=1.5, frequency_penalty=0.7),
        # EOS made the greedy choice: the ban decides where the output ends (at min_tokens)
        "min_tokens": dict(min_tokens=9, logit_bias={eos: 30.0}),
        "logprobs": dict(logprobs=3),
        "regex": dict(structured=GrammarSpec("regex", REGEX)),
        "json_schema": dict(structured=GrammarSpec.json_schema(SCHEMA)),
    }[kind]


def _oracle_run(path, vocab, case, params, ref):
    engine = spec_engine(path, speculative=SPEC)
    engine.scheduler.proposer = OracleProposer({f"r{i}": r for i, r in enumerate(ref)}, vocab)
    got = _run(engine, case, params, check=True)
    return engine, got


@pytest.mark.parametrize("kind", ["repetition", "presence_frequency", "min_tokens", "logprobs", "regex", "json_schema"])
def test_greedy_parity_with_each_feature(setup, kind):
    path, vocab, case = setup
    base = make_engine(path)
    eos = min(base.eos_token_ids)
    params = [SamplingParams(max_tokens=m, temperature=0.0, **_features(kind, eos)) for m in case.max_tokens]
    ref = _run(base, case, params)
    if kind == "min_tokens":  # the ban held EOS off until min_tokens, then it came
        assert all(len(r) == 10 and r[-1] == eos for r in ref), ref
    engine, got = _oracle_run(path, vocab, case, params, ref)
    assert mismatches(got, ref) == []
    st = engine.stats()
    assert st.spec_drafts > 0 and 0 < st.spec_accepted_tokens < st.spec_draft_tokens


def test_logprobs_of_emitted_tokens_match_non_speculative(setup):
    """One logprob per emitted token, the model's raw distribution at its position, with its top-3."""
    path, vocab, case = setup
    params = [SamplingParams(max_tokens=m, temperature=0.0, logprobs=3) for m in case.max_tokens]
    base = make_engine(path)
    want = base.generate(case.prompts, params)
    ref = [w.token_ids for w in want]
    engine = spec_engine(path, speculative=SPEC)
    engine.scheduler.proposer = OracleProposer({}, vocab)
    got = _collect(engine, case, params, ref, vocab)
    for w, (tokens, lps) in zip(want, got, strict=True):
        assert tokens == w.token_ids
        assert len(lps) == len(tokens)
        for a, b in zip(lps, w.logprobs, strict=True):
            assert a.token_id == b.token_id and abs(a.logprob - b.logprob) < 1e-4
            assert [t for t, _ in a.top] == [t for t, _ in b.top]
    assert engine.stats().spec_accepted_tokens > 0


def _collect(engine, case, params, ref, vocab):
    """Tokens and logprobs per request, with the oracle proposer keyed by this engine's request ids."""
    engine.scheduler.proposer = OracleProposer({f"s{i}": r for i, r in enumerate(ref)}, vocab)
    out = {f"s{i}": ([], []) for i in range(len(case.prompts))}
    for i, (prompt, p) in enumerate(zip(case.prompts, params, strict=True)):
        engine.add_request(f"s{i}", prompt_token_ids=prompt, params=p)
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id][0].extend(o.new_token_ids)
            out[o.request_id][1].extend(o.logprobs or [])
        engine.check_integrity()
    return [out[f"s{i}"] for i in range(len(case.prompts))]


def test_grammar_matcher_is_back_in_place_after_rejected_drafts(setup):
    """Drafts the grammar refuses (all wrong) are rejected; every output still matches the regex and the
    non-speculative output."""
    import re

    path, vocab, case = setup
    params = [SamplingParams(max_tokens=24, temperature=0.0, structured=GrammarSpec("regex", REGEX))] * len(case.prompts)
    base = make_engine(path)
    want = base.generate(case.prompts, params)
    engine = spec_engine(path, speculative=SPEC)

    class Wrong:
        def propose(self, req, k):
            ref = want[int(req.request_id.rsplit("-", 1)[1])].token_ids
            return [(t + 1) % vocab for t in ref[req.num_output_tokens : req.num_output_tokens + k]]

    engine.scheduler.proposer = Wrong()
    got = engine.generate(case.prompts, params)
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    for g in got:
        assert re.fullmatch(REGEX, g.text) or g.finish_reason.value == "length", g.text
    st = engine.stats()
    assert st.spec_drafts > 0 and st.spec_accepted_tokens == 0


def test_sampled_rows_with_penalties_reproduce_themselves(setup):
    path, vocab, case = setup
    params = [SamplingParams(max_tokens=24, temperature=1.0, seed=50 + i, repetition_penalty=1.5, presence_penalty=0.5)
              for i in range(len(case.prompts))]  # fmt: skip
    ref = _run(make_engine(path), case, params)
    runs = [_oracle_run(path, vocab, case, params, ref)[1] for _ in range(2)]
    assert runs[0] == runs[1]


def test_sampled_rows_with_a_grammar_stay_in_it_and_reproduce(setup):
    """Sampled rows (seeded) with a regex speculate against drafts of a non-speculative run: every
    output matches the regex, and the same seeds give the same outputs."""
    import re

    path, vocab, case = setup
    spec = GrammarSpec("regex", REGEX)
    params = [SamplingParams(max_tokens=40, temperature=0.8, seed=70 + i, structured=spec) for i in range(len(case.prompts))]
    ref = _run(make_engine(path), case, params)
    runs = []
    for _ in range(2):
        engine, got = _oracle_run(path, vocab, case, params, ref)
        runs.append(got)
        st = engine.stats()
        assert st.spec_drafts > 0 and 0 < st.spec_accepted_tokens < st.spec_draft_tokens
    assert runs[0] == runs[1]
    base = make_engine(path)
    ended = [out for out in runs[0] if len(out) < 40]  # the grammar ended them (the others are cut)
    assert ended
    for out in ended:
        text = base.tokenizer.decode([t for t in out if t not in base.eos_token_ids])
        assert re.fullmatch(REGEX, text), text
