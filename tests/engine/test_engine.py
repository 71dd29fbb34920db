"""Engine behaviour beyond greedy parity: sampling, stops, aborts, faults, validation."""

from __future__ import annotations

import pytest

from engine import FinishReason, SamplingParams

from .helpers import assert_idle, greedy, make_engine


@pytest.fixture(scope="module")
def tiny(build_model):
    return build_model("tiny-llama")


@pytest.fixture()
def engine(tiny):
    return make_engine(tiny)


def _prompt(n: int, start: int = 50) -> list[int]:
    return [start + (i * 37) % 900 for i in range(n)]


def test_seeded_sampling_is_independent_of_the_batch(engine):
    p = SamplingParams(max_tokens=24, temperature=0.9, top_p=0.95, top_k=50, seed=1234, ignore_eos=True)
    alone = engine.generate([_prompt(20)], p)[0].token_ids
    others = [SamplingParams(max_tokens=30, temperature=1.0, ignore_eos=True)] * 5 + [greedy(10)] * 3
    batch = engine.generate([_prompt(20)] + [_prompt(5 + i, 80 + i) for i in range(8)], [p] + others)
    assert batch[0].token_ids == alone
    again = engine.generate([_prompt(20)], SamplingParams(**{**vars(p), "seed": 99}))[0].token_ids
    assert again != alone  # the seed matters
    assert_idle(engine)


def test_priority_preempted_requests_finish_with_their_unpreempted_tokens(tiny):
    """Greedy and seeded batch requests are preempted (one seat) by an interactive one mid-output and
    resumed by recompute: same tokens as when they run alone."""
    seeded = SamplingParams(max_tokens=20, temperature=0.8, top_k=40, seed=7, ignore_eos=True)
    plain = greedy(20, ignore_eos=True)
    alone = make_engine(tiny)
    want = {name: alone.generate([_prompt(30, start)], p)[0].token_ids
            for name, start, p in (("seeded", 60, seeded), ("greedy", 90, plain))}  # fmt: skip
    engine = make_engine(tiny, max_num_seqs=1)
    got: dict[str, list[int]] = {"seeded": [], "greedy": []}
    for name, start, p in (("seeded", 60, seeded), ("greedy", 90, plain)):
        engine.add_request(name, prompt_token_ids=_prompt(30, start), params=p, priority=2)
        for _ in range(6):  # part of its output, then the interactive request takes the seat
            for out in engine.step():
                got[out.request_id].extend(out.new_token_ids)
        engine.add_request(f"vip-{name}", prompt_token_ids=_prompt(8, 300), params=greedy(5), priority=0)
        while engine.has_unfinished():
            for out in engine.step():
                got.setdefault(out.request_id, []).extend(out.new_token_ids)
    assert engine.stats().preemptions == 2
    assert got["seeded"] == want["seeded"] and got["greedy"] == want["greedy"]
    assert_idle(engine)


def test_top_k_one_and_min_p_one_equal_greedy(engine):
    want = engine.generate([_prompt(30)], greedy(16, ignore_eos=True))[0].token_ids
    for p in (SamplingParams(max_tokens=16, temperature=1.0, top_k=1, ignore_eos=True),
              SamplingParams(max_tokens=16, temperature=1.0, min_p=1.0, ignore_eos=True),
              SamplingParams(max_tokens=16, temperature=1.0, top_p=1e-6, ignore_eos=True)):
        assert engine.generate([_prompt(30)], p)[0].token_ids == want


def test_abort_mid_generation_frees_everything(engine):
    for i in range(6):
        engine.add_request(f"r{i}", prompt_token_ids=_prompt(40 + i), params=greedy(50, ignore_eos=True))
    outs = [o for _ in range(3) for o in engine.step()]
    assert outs and all(o.kv_blocks >= -(-40 // engine.block_size) for o in outs)  # 40+ prompt tokens held
    assert engine.stats().kv_blocks_used > 0 and engine.stats().running > 0
    for i in range(6):
        assert engine.abort(f"r{i}")
    assert not engine.abort("r0")  # already gone
    assert engine.step() == []
    assert_idle(engine)


def test_abort_waiting_request(tiny):
    engine = make_engine(tiny, max_num_seqs=1)
    engine.add_request("a", prompt_token_ids=_prompt(10), params=greedy(5))
    engine.add_request("b", prompt_token_ids=_prompt(10), params=greedy(5))
    engine.step()
    assert engine.stats().waiting == 1
    assert engine.abort("b")
    assert engine.stats().waiting == 0
    engine.step()
    assert engine.abort("a")
    outs = engine.generate([_prompt(3)], greedy(2, ignore_eos=True))  # engine keeps working
    assert len(outs[0].token_ids) == 2
    assert_idle(engine)


def test_stop_string_is_cut_and_not_emitted(engine):
    full = engine.generate([_prompt(12)], greedy(40, ignore_eos=True))[0]
    text = full.text
    assert len(text) > 12
    stop = text[6:9]
    first = text.find(stop)
    res = engine.generate([_prompt(12)], greedy(40, ignore_eos=True, stop=[stop]))[0]
    assert res.finish_reason == FinishReason.STOP
    assert res.text == text[:first]
    assert stop not in res.text


def test_stop_token_ids_finish_and_are_reported(engine):
    full = engine.generate([_prompt(12)], greedy(20, ignore_eos=True))[0].token_ids
    stop_tok = full[5]
    res = engine.generate([_prompt(12)], greedy(20, ignore_eos=True, stop_token_ids=[stop_tok]))[0]
    assert res.finish_reason == FinishReason.STOP
    assert res.token_ids == full[: full.index(stop_tok) + 1]


def test_length_finish_and_context_limit(tiny):
    engine = make_engine(tiny, max_model_len=64)
    res = engine.generate([_prompt(60)], greedy(4, ignore_eos=True))[0]
    assert res.finish_reason == FinishReason.LENGTH and len(res.token_ids) == 4
    with pytest.raises(ValueError, match="max_model_len"):
        engine.add_request("x", prompt_token_ids=_prompt(60), params=greedy(5))
    assert_idle(engine)


def test_streamed_deltas_concatenate_to_the_full_decode(engine):
    # Random sampling over a byte-level vocabulary produces partial UTF-8 sequences mid-stream.
    params = [SamplingParams(max_tokens=48, temperature=1.5, seed=s, ignore_eos=True) for s in range(12)]
    for i, p in enumerate(params):
        engine.add_request(f"s{i}", prompt_token_ids=_prompt(8 + i), params=p)
    text, ids = {}, {}
    while engine.has_unfinished():
        for out in engine.step():
            text[out.request_id] = text.get(out.request_id, "") + out.text_delta
            ids.setdefault(out.request_id, []).extend(out.new_token_ids)
    for rid in text:
        assert text[rid] == engine.tokenizer.decode(ids[rid], skip_special_tokens=True)


def test_failed_step_fails_only_its_requests(engine):
    engine.add_request("doomed", prompt_token_ids=_prompt(10), params=greedy(5))
    real = engine.runner.execute
    calls = {"n": 0}

    def boom(sched):
        calls["n"] += 1
        raise RuntimeError("injected fault")

    engine.runner.execute = boom
    outs = engine.step()
    engine.runner.execute = real
    assert calls["n"] == 1
    assert [(o.request_id, o.finish_reason, o.finished) for o in outs] == [("doomed", FinishReason.ERROR, True)]
    assert "injected fault" in outs[0].error
    assert_idle(engine)
    assert len(engine.generate([_prompt(10)], greedy(5, ignore_eos=True))[0].token_ids) == 5


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(prompt_token_ids=[]), "prompt_token_ids"),
        (dict(prompt_token_ids=[10**9]), "prompt_token_ids"),
        (dict(prompt=""), "prompt"),
        (dict(prompt="hi", prompt_token_ids=[1]), "prompt"),
        (dict(prompt_token_ids=[5] * 3000), "max_model_len"),
    ],
)
def test_add_request_rejects_bad_input_naming_the_field(engine, kwargs, field):
    with pytest.raises(ValueError, match=field):
        engine.add_request("bad", **kwargs)
    assert_idle(engine)


def test_duplicate_request_id_rejected(engine):
    engine.add_request("dup", prompt_token_ids=[5, 6], params=greedy(2))
    with pytest.raises(ValueError, match="request_id"):
        engine.add_request("dup", prompt_token_ids=[5, 6], params=greedy(2))
    engine.abort("dup")
    assert_idle(engine)


def test_chat_template_and_text_prompt(engine):
    ids = engine.apply_chat_template([{"role": "user", "content": "Hello 你好 🚀"}])
    assert ids and all(isinstance(t, int) for t in ids)
    res = engine.generate(["Hello 你好 🚀"], greedy(3, ignore_eos=True))[0]
    assert res.prompt_token_ids == engine.encode("Hello 你好 🚀") and len(res.token_ids) == 3


def test_bfloat16_engine_runs(tiny):
    engine = make_engine(tiny, dtype="bfloat16")
    res = engine.generate([_prompt(30), _prompt(7)], greedy(8, ignore_eos=True))
    assert [len(r.token_ids) for r in res] == [8, 8]
    assert engine.dtype_name == "bfloat16"
    assert_idle(engine)


def test_nonfinite_logits_fail_only_that_request(engine):
    """A NaN logits row (a broken model output for one sequence) fails that request with a clear
    error; the rest of the batch gets its tokens, and nothing is leaked."""
    want = engine.generate([_prompt(12, 90)], greedy(6, ignore_eos=True))[0].token_ids
    real = engine.sampler.sample

    def poison(logits, reqs):
        logits = logits.clone()
        for i, r in enumerate(reqs):
            if r.request_id == "poisoned":
                logits[i] = float("nan")
        return real(logits, reqs)

    engine.sampler.sample = poison
    try:
        engine.add_request("poisoned", prompt_token_ids=_prompt(10), params=greedy(6, ignore_eos=True))
        engine.add_request("healthy", prompt_token_ids=_prompt(12, 90), params=greedy(6, ignore_eos=True))
        outs: dict[str, list] = {}
        while engine.has_unfinished():
            for out in engine.step():
                outs.setdefault(out.request_id, []).append(out)
    finally:
        engine.sampler.sample = real
    bad = outs["poisoned"]
    assert len(bad) == 1 and bad[0].finish_reason is FinishReason.ERROR and bad[0].new_token_ids == []
    assert "non-finite logits" in bad[0].error
    assert [t for o in outs["healthy"] for t in o.new_token_ids] == want
    assert_idle(engine)
