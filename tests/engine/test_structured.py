"""Structured outputs in the engine: the compiler's cache, the masks in the batched sampler, grammar
termination, preemption and NaN rows, and 32 mixed requests (JSON schema, regex, choice, none) in one
batch on the tiny seeded model: every constrained output matches, the unconstrained ones are the same
tokens as in a run without the constrained ones."""

from __future__ import annotations

import json
import re
import threading
import time

import jsonschema
import pytest
import torch

from engine.api import FinishReason, InvalidParam, SamplingParams
from engine.structured import (
    GrammarDeadEnd,
    GrammarError,
    GrammarSpec,
    GrammarTimeout,
    GrammarTooLarge,
    masks,
)
from engine.structured.masks import allowed_tokens, apply_bitmask, new_bitmask, pack_bitmask

from .helpers import make_engine

SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 999},
        "tag": {"type": "string", "maxLength": 6},
        "ok": {"type": "boolean"},
    },
    "required": ["id", "tag", "ok"],
    "additionalProperties": False,
}
REGEX = r"[a-z]{2,5}-[0-9]{1,3}"
CHOICES = ["red", "green", "blue", "not sure"]
PROMPTS = [f"item {i}: the {['name', 'value', 'kind', 'size'][i % 4]} of the {['list', 'dict', 'file'][i % 3]}"
           for i in range(32)]


@pytest.fixture(scope="module")
def engine(build_model):
    return make_engine(build_model("tiny-llama"))


def _spec(kind: str) -> GrammarSpec | None:
    return {"schema": GrammarSpec.json_schema(SCHEMA), "regex": GrammarSpec("regex", REGEX),
            "choice": GrammarSpec.choice(CHOICES), "none": None}[kind]  # fmt: skip


def _params(i: int, kind: str) -> SamplingParams:
    # Half greedy, half sampled with a seed of their own (the draw must not depend on the batch).
    sampling = {"temperature": 0.0} if i % 2 == 0 else {"temperature": 0.9, "top_p": 0.95, "seed": 1000 + i}
    return SamplingParams(max_tokens=96 if kind != "none" else 24, structured=_spec(kind), **sampling)


def _matches(kind: str, text: str) -> bool:
    if kind == "schema":
        jsonschema.validate(json.loads(text), SCHEMA)
        return True
    if kind == "regex":
        return re.fullmatch(REGEX, text) is not None
    return text in CHOICES


def _run(engine, jobs: list[tuple[str, str, SamplingParams]]) -> tuple[dict[str, list], int]:
    """Add every job, then step to the end; returns {id: [token ids, text, finish reason]} and the most
    requests running in one step."""
    for rid, prompt, params in jobs:
        engine.add_request(rid, prompt=prompt, params=params)
    results = {rid: [[], "", None] for rid, _, _ in jobs}
    most = 0
    while engine.has_unfinished():
        for out in engine.step():
            r = results[out.request_id]
            r[0] += out.new_token_ids
            r[1] += out.text_delta
            r[2] = out.finish_reason if out.finished else r[2]
        most = max(most, engine.stats().running)
    return results, most


def test_32_mixed_requests_in_one_batch(engine):
    kinds = ["schema", "regex", "choice", "none"] * 8
    jobs = [(f"{kind}-{i}", PROMPTS[i], _params(i, kind)) for i, kind in enumerate(kinds)]
    mixed, most = _run(engine, jobs)
    assert most == 32  # all in one batch
    for (rid, _, _), kind in zip(jobs, kinds, strict=True):
        tokens, text, reason = mixed[rid]
        if kind != "none":
            assert reason is FinishReason.STOP, (rid, text)  # the grammar ended it, not max_tokens
            assert _matches(kind, text), (rid, text)
    alone, _ = _run(engine, [j for j, kind in zip(jobs, kinds, strict=True) if kind == "none"])
    for rid, (tokens, _, _) in alone.items():
        assert mixed[rid][0] == tokens, rid  # unconstrained rows sample as if the others were not there
    assert engine.grammar_compiler.stats().entries >= 3


def test_constrained_output_survives_preemption(build_model):
    """Preempted requests recompute their KV and keep their tokens and matcher: the same output as
    without preemption, still matching."""
    path = build_model("tiny-llama")
    jobs = [(f"p{i}", PROMPTS[i], SamplingParams(max_tokens=40, temperature=0.0, structured=_spec(kind)))
            for i, kind in enumerate(["schema", "regex", "schema", "choice", "schema", "regex"])]  # fmt: skip
    roomy, _ = _run(make_engine(path), jobs)
    tight = make_engine(path, num_kv_blocks=14, block_size=4)
    squeezed, _ = _run(tight, jobs)
    assert tight.stats().preemptions > 0
    for rid, (tokens, _, reason) in roomy.items():
        assert squeezed[rid][0] == tokens, rid
        assert reason is FinishReason.STOP


def test_the_grammar_ends_the_request_even_with_ignore_eos(engine):
    params = SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True, structured=GrammarSpec.choice(["yes", "no"]))
    [result] = engine.generate(["Is it?"], params)
    assert result.text in ("yes", "no") and result.finish_reason is FinishReason.STOP
    assert result.token_ids[-1] in engine.eos_token_ids  # the stop token the grammar ended on
    assert len(result.token_ids) < 50


def test_a_nan_row_fails_only_its_constrained_request(engine):
    real = engine.sampler.sample

    def poison(logits, reqs):
        rows = [i for i, r in enumerate(reqs) if r.request_id == "poison"]
        if rows:
            logits = logits.clone()
            logits[rows] = float("nan")
        return real(logits, reqs)

    engine.sampler.sample = poison
    try:
        jobs = [("poison", PROMPTS[0], _params(0, "schema")), ("healthy", PROMPTS[1], _params(2, "regex"))]
        results, _ = _run(engine, jobs)
    finally:
        engine.sampler.sample = real
    assert results["poison"][2] is FinishReason.ERROR and results["poison"][0] == []
    assert results["healthy"][2] is FinishReason.STOP and _matches("regex", results["healthy"][1])


def test_logprobs_are_the_models_not_the_masks(engine):
    free = engine.generate(["the value"], SamplingParams(max_tokens=1, temperature=0.0, logprobs=3))[0]
    forced = engine.generate(["the value"], SamplingParams(max_tokens=1, temperature=0.0, logprobs=3,
                                                           structured=GrammarSpec("regex", "zz")))[0]  # fmt: skip
    assert forced.text.startswith("z")
    assert forced.logprobs[0].top == free.logprobs[0].top  # the top alternatives of the raw distribution


def test_the_engine_compiles_what_it_is_given_and_refuses_what_does_not_compile(engine):
    spec = GrammarSpec("regex", "[0-9]{4}")
    assert spec.compiled is None
    [result] = engine.generate(["year"], SamplingParams(max_tokens=10, temperature=0.0, structured=spec))
    assert re.fullmatch("[0-9]{4}", result.text)
    with pytest.raises(InvalidParam) as err:
        engine.add_request("bad", prompt="x", params=SamplingParams(structured=GrammarSpec("regex", "[0-")))
    assert err.value.field == "structured" and "does not compile" in err.value.message
    assert not engine.has_unfinished()


def test_an_engine_without_a_grammar_backend_refuses_structured_requests(build_model):
    off = make_engine(build_model("tiny-llama"), grammar_backend="none")
    assert off.grammar_compiler is None
    with pytest.raises(InvalidParam, match="no grammar backend"):
        off.add_request("r", prompt="x", params=SamplingParams(structured=GrammarSpec("regex", "a")))


def test_compiles_are_cached_and_a_spec_compiles_once_under_concurrency(engine):
    compiler = engine.grammar_compiler
    spec = GrammarSpec.json_schema({"type": "object", "properties": {"n": {"type": "integer"}}, "title": "once"})
    before = compiler.stats()
    got: list[object] = []
    threads = [threading.Thread(target=lambda: got.append(compiler.compile(spec))) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    after = compiler.stats()
    assert after.misses - before.misses == 1 and after.hits - before.hits == 7
    assert all(g is got[0] for g in got) and got[0].owner is compiler
    equal = GrammarSpec.json_schema({"type": "object", "properties": {"n": {"type": "integer"}}, "title": "once"})
    assert compiler.compile(equal) is got[0]  # same kind and source: the same entry


def test_a_failed_compile_raises_and_is_not_cached(engine):
    compiler = engine.grammar_compiler
    for spec in (GrammarSpec("regex", "(unclosed"), GrammarSpec("grammar", "root ::= undefined_rule"),
                 GrammarSpec.json_schema({"type": "objec"})):  # fmt: skip
        before = compiler.stats()
        with pytest.raises(GrammarError) as err:
            compiler.compile(spec)
        assert not str(err.value).startswith("[")  # the C++ log prefix is stripped
        with pytest.raises(GrammarError):
            compiler.compile(spec)
        after = compiler.stats()
        assert after.failures - before.failures == 2 and after.entries == before.entries


def test_specs_hash_by_kind_and_source_only():
    a = GrammarSpec("regex", "a+")
    b = a.with_compiled(object())
    assert a == b and hash(a) == hash(b) and a.key == b.key
    assert SamplingParams(structured=a) == SamplingParams(structured=b)
    assert hash(SamplingParams(structured=a)) == hash(SamplingParams(structured=b))
    assert GrammarSpec("regex", "a+") != GrammarSpec("grammar", "a+")
    with pytest.raises(GrammarError):
        GrammarSpec("yaml", "")
    with pytest.raises(InvalidParam, match="min_tokens"):
        SamplingParams(min_tokens=2, structured=a)


@pytest.mark.parametrize("kernel", [True, False], ids=["xgrammar-kernel", "torch-fallback"])
def test_masks_touch_only_their_rows(kernel, monkeypatch):
    if not kernel:
        monkeypatch.setattr(masks, "_kernel", None)
    torch.manual_seed(0)
    logits = torch.randn(4, 70)
    before = logits.clone()
    bitmask = new_bitmask(4, 70)
    bitmask[0] = 0  # rows 0 and 2 are not named: their bitmask rows are ignored
    bitmask[1] = 0
    bitmask[1, 0] = 0b101  # tokens 0 and 2
    bitmask[3, 2] = 0  # tokens 64..69 forbidden
    apply_bitmask(logits, bitmask, [1, 3])
    assert torch.equal(logits[0], before[0]) and torch.equal(logits[2], before[2])  # bit for bit
    assert torch.isfinite(logits[1]).nonzero().flatten().tolist() == [0, 2]
    assert torch.isinf(logits[3, 64:]).all() and torch.equal(logits[3, :64], before[3, :64])
    assert allowed_tokens(bitmask[[1, 3]], 70).sum(dim=1).tolist() == [2, 64]
    assert torch.equal(allowed_tokens(pack_bitmask(allowed_tokens(bitmask, 70)[3])[None], 70)[0],
                       allowed_tokens(bitmask, 70)[3])  # fmt: skip


def test_the_sparse_path_masks_as_the_dense_one(monkeypatch):
    """Rows allowing few tokens take the numpy path on the CPU; every path gives the same logits."""
    torch.manual_seed(1)
    vocab = 4096 + 5  # a partial last word
    logits = torch.randn(4, vocab)
    bitmask = new_bitmask(4, vocab)
    bitmask[0] = 0
    bitmask[0, 3] = -(2**31) | 0b11  # tokens 96, 97 and 127 (the sign bit)
    bitmask[0, 128] = 0b10001  # tokens 4096 and 4100 (the last)
    bitmask[1, 7] = 0  # dense: 32 tokens forbidden
    bitmask[2] = 0  # not named: ignored
    bitmask[3] = 0  # allows nothing at all
    used = []
    monkeypatch.setattr(masks, "_apply_sparse", lambda *a, _f=masks._apply_sparse: used.append(a[2]) or _f(*a))
    got = logits.clone()
    apply_bitmask(got, bitmask, [0, 1, 3])
    assert used == [[0, 3]]
    assert torch.isfinite(got[0]).nonzero().flatten().tolist() == [96, 97, 127, 4096, 4100]
    assert torch.isinf(got[3]).all() and torch.equal(got[2], logits[2])
    monkeypatch.setattr(masks, "SPARSE_WORDS_SHARE", -1.0)
    for kernel in (masks._kernel, None):
        monkeypatch.setattr(masks, "_kernel", kernel)
        want = logits.clone()
        apply_bitmask(want, bitmask, [0, 1, 3])
        assert torch.equal(got, want)
    assert len(used) == 1


# -- bounds: bytes, budgets that kill, grammars that allow nothing (issue 21) -------------------------------
def _enum(tag: str, n: int) -> GrammarSpec:
    return GrammarSpec.json_schema({"enum": [f"{tag}-{i}-{i * 7 % 1000}" for i in range(n)]})


def _compiler(engine, **kw):
    from engine.structured.xgrammar_backend import XGrammarCompiler

    return XGrammarCompiler(engine.tokenizer, engine.vocab_size, engine.eos_token_ids, **kw)


def test_the_cache_holds_at_most_its_bytes_and_a_grammar_over_them_is_refused(engine):
    compiler = _compiler(engine, max_bytes=2 << 20)
    sizes = [compiler.compile(_enum(f"c{i}", 500)).memory_bytes for i in range(40)]
    st = compiler.stats()
    assert sum(sizes) > 4 * compiler.max_bytes  # 40 grammars would hold far more than the bound
    assert 0 < st.bytes <= compiler.max_bytes and st.entries < 40 and st.evictions == 40 - st.entries, st
    assert compiler.cached(_enum("c39", 500)) and not compiler.cached(_enum("c0", 500))  # LRU: the oldest went
    with pytest.raises(GrammarTooLarge, match="more than the grammar cache holds"):
        compiler.compile(_enum("huge", 20000))
    assert compiler.stats().bytes <= compiler.max_bytes
    compiler.close()


@pytest.mark.parametrize("spec", [GrammarSpec("regex", r"[^\s\S]"), GrammarSpec.json_schema({"enum": []})])
def test_a_grammar_no_token_can_start_is_refused_when_it_compiles(engine, spec):
    try:
        engine.grammar_compiler.compile(spec)
    except GrammarDeadEnd as exc:
        assert "allows no output" in str(exc)
    except GrammarError:  # xgrammar may refuse it outright: refused either way, never a NaN step
        pass
    else:
        pytest.fail(f"{spec} compiled")
    with pytest.raises(InvalidParam) as err:
        engine.add_request("dead", prompt="x", params=SamplingParams(max_tokens=4, structured=spec))
    assert err.value.field == "structured"


def test_a_grammar_that_reaches_a_dead_end_ends_its_request_naming_its_field(engine):
    # A raw control character in a JSON string: xgrammar allows it, the control mask forbids it.
    spec = GrammarSpec.json_schema({"type": "string", "pattern": "\u0001+"}).with_compiled(None, "guided_json")
    free = SamplingParams(max_tokens=6, temperature=0.0)
    engine.add_request("dead-end", prompt="hello", params=SamplingParams(max_tokens=20, temperature=0.0,
                                                                         structured=spec))  # fmt: skip
    engine.add_request("free", prompt="hello", params=free)
    outs = {}
    while engine.has_unfinished():
        for out in engine.step():
            outs.setdefault(out.request_id, []).append(out)
    dead = outs["dead-end"][-1]
    assert dead.finish_reason is FinishReason.ERROR and dead.error_param == "guided_json", dead
    assert "allows no next token" in dead.error and "non-finite" not in dead.error
    assert [t for o in outs["dead-end"] for t in o.new_token_ids]  # it got as far as the opening quote
    assert outs["free"][-1].finish_reason is FinishReason.LENGTH and outs["free"][-1].error_param is None


@pytest.fixture(scope="module")
def pooled(engine):
    compiler = _compiler(engine, processes=True, max_bytes=64 << 20)
    yield compiler
    compiler.close()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] not in "ZX"
    except FileNotFoundError:
        return False


def test_worker_processes_compile_what_the_thread_compiles(engine, pooled):
    for spec in (_spec("schema"), _spec("regex"), _spec("choice")):
        grammar = pooled.compile(spec, timeout_s=60)
        assert grammar.owner is pooled and grammar.memory_bytes > 0
        out = engine.generate(["item 3"], SamplingParams(max_tokens=96, temperature=0.0,
                                                         structured=spec.with_compiled(grammar)))[0]  # fmt: skip
        kind = {"json_schema": "schema", "regex": "regex", "choice": "choice"}[spec.kind]
        assert _matches(kind, out.text), out.text
    with pytest.raises(GrammarError, match="not closed"):
        pooled.compile(GrammarSpec("regex", "(("), timeout_s=60)
    with pytest.raises(GrammarDeadEnd):
        pooled.compile(GrammarSpec("regex", r"[^\s\S]"), timeout_s=60)


def test_a_compile_past_its_budget_is_killed_and_the_small_lane_goes_on(pooled):
    pooled.compile(GrammarSpec.choice(["warm"]), timeout_s=60)  # both children up (started with the pool)
    wait_s = 0.0
    while None in pooled.pool.pids().values() and wait_s < 60:
        time.sleep(0.1)
        wait_s += 0.1
    large = pooled.pool.pids()["large"]
    huge = _enum("slow", 40000)  # ~7 s to compile on one core, ~500 KB of source
    result: dict = {}
    thread = threading.Thread(target=lambda: result.update(t0=time.monotonic()) or _catch(result, pooled, huge))
    thread.start()
    time.sleep(0.3)
    t0 = time.monotonic()
    pooled.compile(GrammarSpec.choice(["yes", "no", "maybe"]), timeout_s=5)  # the small lane: not behind it
    small_s = time.monotonic() - t0
    thread.join(30)
    assert isinstance(result.get("error"), GrammarTimeout), result
    assert result["elapsed"] < 3.0  # stopped at its 1 s budget, not when the compile would have ended
    assert small_s < 1.0, small_s
    assert not _alive(large)  # the child that held the compile is gone
    assert pooled.pool.large.killed >= 1 and pooled.pool.pids()["large"] != large
    assert not pooled.cached(huge)
    assert pooled.compile(GrammarSpec.choice(["after"]), timeout_s=60).memory_bytes > 0


def _catch(result: dict, compiler, spec) -> None:
    try:
        compiler.compile(spec, timeout_s=1.0)
    except GrammarError as exc:
        result["error"] = exc
    result["elapsed"] = time.monotonic() - result["t0"]


# -- bounded whitespace in JSON (issue 27) -----------------------------------------------------------------
PAIR = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def _accepts(grammar, text: str) -> bool:
    """Whether the grammar takes `text` whole and may end there (xgrammar's matcher, characters not tokens)."""
    import xgrammar as xgr

    m = xgr.GrammarMatcher(grammar.compiled)
    return bool(m.accept_string(text)) and m.is_terminated() is False and m.accept_token(m.stop_token_ids[0])


@pytest.mark.parametrize("spec", [GrammarSpec.json_schema(PAIR), GrammarSpec("json_object", "")])
def test_json_takes_a_few_blanks_and_newlines_but_no_more_than_the_bound(engine, spec):
    grammar = engine.grammar_compiler.compile(spec)
    for text in ('{"a": 1}', '{"a":1}', '{\n  "a": 1\n}', '{\r\n  "a" :  1 }', '{\n   "a": 1}'):
        assert _accepts(grammar, text), repr(text)
    for text in ('{     "a": 1}', '{\n    "a": 1}', '{"a":      1}', '{"a": 1\n\n\n\n\n}'):  # 5 blanks: one past the bound
        assert not _accepts(grammar, text), repr(text)


def test_json_masks_allow_line_break_tokens_and_no_other_control_character(engine):
    """Newlines may be whitespace now; a tab (which xgrammar 0.2.9 lets into a string with a maxLength)
    or any other byte below 0x20 stays out of every JSON output, strings included."""
    import xgrammar as xgr

    grammar = engine.grammar_compiler.compile(GrammarSpec.json_schema(SCHEMA))
    allowed = allowed_tokens(grammar.also.unsqueeze(0), engine.vocab_size)[0]
    info = xgr.TokenizerInfo.from_huggingface(engine.tokenizer, vocab_size=engine.vocab_size)
    controls = [set(b) & set(range(0x20)) for b in info.decoded_vocab]
    newline = [i for i, c in enumerate(controls) if c == {10}]
    others = [i for i, c in enumerate(controls) if c - {10, 13}]
    assert newline and others and 9 in set().union(*controls)  # the vocabulary has both kinds
    assert all(allowed[i] for i in newline) and not any(allowed[i] for i in others)


def test_json_outputs_with_free_whitespace_still_validate(engine):
    """Greedy and sampled, the tiny model's JSON parses and validates, and never holds more blank space
    in a row than the bound allows."""
    params = [SamplingParams(max_tokens=96, temperature=t, seed=7 + i, structured=GrammarSpec.json_schema(SCHEMA))
              for i, t in enumerate([0.0, 1.0, 1.0, 1.3])]  # fmt: skip
    results = engine.generate(PROMPTS[:4], params)
    for r in results:
        jsonschema.validate(json.loads(r.text), SCHEMA)
        assert not re.search(r"\s{5}", r.text), repr(r.text)
        assert not re.search(r"[\x00-\x09\x0b\x0c\x0e-\x1f]", r.text), repr(r.text)
