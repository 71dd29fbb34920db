"""The draft-model proposer (engine/draft_model.py): greedy output with a draft model is token for token
the non-speculative output (float32); a draft that is the target itself is accepted almost always (its
window recompute matches the paged KV), another model of the same tokenizer mostly rejected."""

from __future__ import annotations

import pytest

from engine.draft_model import DraftModelProposer
from engine.spec_config import SpeculativeConfig

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
