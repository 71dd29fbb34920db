"""The draft-model proposer (engine/runner/draft_model.py): greedy output with a draft model is token for token
the non-speculative output (float32); a draft that is the target itself is accepted almost always (its
window recompute matches the paged KV), another model of the same tokenizer mostly rejected."""

from __future__ import annotations

import pytest

from engine.config.speculative import SpeculativeConfig
from engine.runner.draft_model import DraftModelProposer

from .helpers import Case, make_case, make_engine, mismatches, spec_engine
from .test_speculative import _run


@pytest.fixture(scope="module")
def tiny(build_model):
    from transformers import AutoConfig

    path = build_model("tiny-llama")
    vocab = AutoConfig.from_pretrained(str(path)).vocab_size
    case = make_case(vocab, n=6, seed=5, shared_prefix=16)
    case = Case(case.prompts, [20] * len(case.prompts))
    return path, case, _run(make_engine(path), case)


def _draft(path) -> dict:
    return {"model": str(path), "num_speculative_tokens": 3}


def test_config_reads_vllms_draft_model_keys(tmp_path):
    cfg = SpeculativeConfig.from_dict({"model": "/m", "num_speculative_tokens": 5})
    assert (cfg.method, cfg.model) == ("draft_model", "/m")
    with pytest.raises(ValueError, match="speculative.model"):
        SpeculativeConfig(method="draft_model")
    with pytest.raises(ValueError, match="speculative.model"):
        SpeculativeConfig(method="ngram", model="/m")


def test_the_target_as_its_own_draft_is_accepted(tiny):
    path, case, ref = tiny
    engine = spec_engine(path, speculative=_draft(path), block_size=8)
    assert isinstance(engine.scheduler.proposer, DraftModelProposer)
    assert mismatches(_run(engine, case, check=True), ref) == []
    st = engine.stats()
    assert st.spec_draft_tokens > 0 and st.spec_accepted_tokens >= 0.9 * st.spec_draft_tokens


def test_greedy_parity_with_another_draft_model(tiny, build_model):
    """A few KV blocks (preemptions) and a small step budget (chunked prefill) besides."""
    path, case, ref = tiny
    engine = spec_engine(path, speculative=_draft(build_model("tiny-llama-b")), num_kv_blocks=48, block_size=8,
                         max_num_batched_tokens=64)  # fmt: skip
    assert mismatches(_run(engine, case, check=True), ref) == []
    st = engine.stats()
    assert st.spec_draft_tokens > 0 and st.spec_accepted_tokens < st.spec_draft_tokens
    assert st.preemptions > 0


def test_a_draft_model_of_another_vocabulary_is_refused(tiny, build_model):
    path, _, _ = tiny
    with pytest.raises(ValueError, match="speculative.model: its vocabulary"):
        make_engine(path, speculative=_draft(build_model("tiny-llama-wide")))
    with pytest.raises(ValueError, match="speculative.model"):
        make_engine(path, speculative=_draft(path / "missing"))


def test_drafts_are_batched_and_match_one_row_at_a_time(tiny, build_model):
    """One step's drafts for several rows come from one forward per draft position (the window prefills
    together, then each further position together), and they are the drafts one row at a time would
    get; groups of max_rows, windows cut to the last `window` tokens, different k per row."""
    from .factories import make_request

    path, case, _ = tiny
    engine = spec_engine(path, speculative=_draft(build_model("tiny-llama-b")))
    proposer = engine.scheduler.proposer
    assert isinstance(proposer, DraftModelProposer)
    proposer.window, proposer.max_rows = 40, 3  # windows: 40 tokens (prompts are longer); groups of 3
    reqs = [make_request(f"q{i}", 0, tokens=p[:60]) for i, p in enumerate(case.prompts)]
    reqs[1].output_token_ids.extend([17, 18])
    ks = [3, 1, 2, 3, 3, 2]
    one_by_one = [proposer.propose(r, k) for r, k in zip(reqs, ks, strict=True)]
    calls = _count_forwards(proposer)
    together = proposer.propose_all(list(zip(reqs, ks, strict=True)))
    assert together == one_by_one
    assert [len(d) for d in together] == ks
    assert calls == [6]  # two groups of 3 rows, each: its windows, then positions 2 and 3


def _count_forwards(proposer) -> list[int]:
    """Count the draft model's forward passes per propose_all call (the list grows one entry a call)."""
    calls: list[int] = []
    model, propose_all = proposer.model, proposer.propose_all

    class Counting:
        def __call__(self, *args):
            calls[-1] += 1
            return model(*args)

        def compute_logits(self, hidden):
            return model.compute_logits(hidden)

    proposer.model = Counting()

    def counted(items):
        calls.append(0)
        return propose_all(items)

    proposer.propose_all = counted
    return calls


def test_the_engine_drafts_every_row_of_a_step_in_one_batch(tiny, build_model):
    """Concurrent rows under a draft model: each step makes one propose_all call, at most k forwards,
    with several rows in it; the output is still non-speculative greedy."""
    path, case, ref = tiny
    engine = spec_engine(path, speculative=_draft(build_model("tiny-llama-b")))
    proposer = engine.scheduler.proposer
    rows: list[int] = []
    propose_all = proposer.propose_all

    def watched(items):
        rows.append(len(items))
        return propose_all(items)

    proposer.propose_all = watched
    calls = _count_forwards(proposer)
    assert mismatches(_run(engine, case, check=True), ref) == []
    assert calls and max(calls) <= 3 and max(rows) >= 4
    assert engine.stats().spec_draft_tokens > 0
