"""Grammars after a thinking model's reasoning (GrammarSpec.after_reasoning): any text up to the end
marker (a start marker and pieces of the end marker included), a little whitespace, then the inner
grammar, for every inner kind; compiled in this process and in the compile workers alike."""

from __future__ import annotations

import json

import pytest

from engine.structured import GrammarError, GrammarSpec

from .helpers import make_engine
from .test_structured import _accepts

PAIR = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"], "additionalProperties": False}
THOUGHT = "<think>\nLet me see: < / </ </th </think no, a tab\n"  # pieces of the end marker are reasoning
END = "</think>"


@pytest.fixture(scope="module")
def engine(build_model):
    return make_engine(build_model("tiny-llama"))


CASES = [
    (GrammarSpec.json_schema(PAIR), ['{"a": 5}', '{"a":-12}'], ['{"a": "x"}', "hello", '{"a": 5, "b": 1}']),
    (GrammarSpec("json_object", ""), ['{"x": [1, 2]}'], ["[1]", "plain"]),
    (GrammarSpec("regex", "[0-9]{2,3}"), ["42", "123"], ["4", "abc"]),
    (GrammarSpec.choice(["yes", "no"]), ["yes", "no"], ["maybe"]),
    (GrammarSpec("grammar", 'root ::= "A" [0-9]'), ["A7"], ["B7"]),
    (GrammarSpec.tool_calls([("f", PAIR)], "required", False),
     ['<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'], ['{"a": 1}', "text"]),
]


@pytest.mark.parametrize(("inner", "good", "bad"), CASES, ids=[c[0].kind for c in CASES])
def test_the_inner_grammar_holds_only_after_the_reasoning(engine, inner, good, bad):
    grammar = engine.grammar_compiler.compile(GrammarSpec.after_reasoning(inner, END))
    plain = engine.grammar_compiler.compile(inner)
    for answer in good:
        for space in ("", "\n\n", " \n"):
            assert _accepts(grammar, THOUGHT.replace("a tab", "fine") + END + space + answer), (space, answer)
        assert _accepts(grammar, "no start marker" + END + answer)  # the prompt may have opened it
        assert _accepts(plain, answer) and not _accepts(plain, "<think>x" + END + answer)
    for answer in bad:
        assert not _accepts(grammar, "<think>x" + END + answer), answer
    assert not _accepts(grammar, "<think>never closed " + good[0])  # the answer cannot start before the end
    assert not _accepts(grammar, "<think>x" + END + "\n\n\n\n\n" + good[0])  # whitespace is bounded


def test_the_spec_is_keyed_by_its_inner_grammar_and_marker():
    a = GrammarSpec.after_reasoning(GrammarSpec.json_schema(PAIR), END)
    assert a == GrammarSpec.after_reasoning(GrammarSpec.json_schema(PAIR), END)
    assert a != GrammarSpec.after_reasoning(GrammarSpec.json_schema(PAIR), "[/THINK]")
    assert a != GrammarSpec.after_reasoning(GrammarSpec("json_object", ""), END)
    assert json.loads(a.source) == {"end": END, "excludes": [], "kind": "json_schema",
                                    "source": GrammarSpec.json_schema(PAIR).source}  # fmt: skip
    assert a != GrammarSpec.after_reasoning(GrammarSpec.json_schema(PAIR), END, ("<tool_call>",))
    with pytest.raises(GrammarError):
        GrammarSpec.after_reasoning(a, END)
    with pytest.raises(GrammarError):
        GrammarSpec.after_reasoning(GrammarSpec.json_schema(PAIR), "")


def test_excluded_strings_cannot_appear_in_the_reasoning(engine):
    """qwen3's parser ends the reasoning at a <tool_call>: its grammar keeps one out of the reasoning, so
    both agree on where the reasoning ends; the call comes after </think>."""
    calls = GrammarSpec.tool_calls([("f", PAIR)], "required", False)
    grammar = engine.grammar_compiler.compile(GrammarSpec.after_reasoning(calls, END, ("<tool_call>",)))
    call = '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'
    assert _accepts(grammar, "<think>I call f, no <tool_ yet" + END + "\n\n" + call)
    assert not _accepts(grammar, "<think>" + call + END + "\n\n" + call)


def test_the_compile_workers_build_it_as_the_thread_does(engine):
    from engine.structured.xgrammar_backend import XGrammarCompiler

    pooled = XGrammarCompiler(engine.tokenizer, engine.vocab_size, engine.eos_token_ids, processes=True)
    try:
        grammar = pooled.compile(GrammarSpec.after_reasoning(GrammarSpec.json_schema(PAIR), END), timeout_s=60)
        assert _accepts(grammar, "<think>hm" + END + '\n\n{"a": 1}')
        assert not _accepts(grammar, "<think>hm" + END + "no")
    finally:
        pooled.close()
