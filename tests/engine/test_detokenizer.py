"""Incremental detokenization never emits a broken character; stop strings are held back and cut."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from engine.text.detokenizer import IncrementalDetokenizer, StopStringFilter

TEXTS = [
    "Hello, world! 你好，世界。今天天气很好 🚀✨👍🏽 👨‍👩‍👧 🇯🇵 end",
    "机器学习和自然语言处理很有意思😀😂",
    "plain ascii text with spaces   and\nnewlines\n",
]


@pytest.fixture(scope="module")
def tokenizer(build_model):
    return AutoTokenizer.from_pretrained(str(build_model("tiny-llama")))


@pytest.mark.parametrize("text", TEXTS)
def test_deltas_concatenate_to_full_decode_without_broken_chars(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) > 5
    detok = IncrementalDetokenizer(tokenizer)
    deltas = [detok.add([t], final=(i == len(ids) - 1)) for i, t in enumerate(ids)]
    assert "".join(deltas) == tokenizer.decode(ids) == text
    assert not any("\ufffd" in d for d in deltas)


def test_multibyte_characters_span_several_tokens(tokenizer):
    # The point of the test: at least one emoji must be split across tokens.
    ids = tokenizer.encode("👨‍👩‍👧🇯🇵", add_special_tokens=False)
    assert any("\ufffd" in tokenizer.decode([t]) for t in ids)


def test_final_flush_emits_an_incomplete_tail(tokenizer):
    ids = tokenizer.encode("ab🚀", add_special_tokens=False)
    partial = ids[:-1]
    detok = IncrementalDetokenizer(tokenizer)
    out = "".join(detok.add([t], final=(i == len(partial) - 1)) for i, t in enumerate(partial))
    assert out == tokenizer.decode(partial)


def test_stop_string_across_deltas_is_cut():
    f = StopStringFilter(("STOP",))
    out = []
    for d in ["abc S", "T", "OP tail"]:
        text, hit = f.feed(d, final=False)
        out.append(text)
        if hit:
            break
    assert "".join(out) == "abc " and hit


def test_held_back_text_is_released_when_no_stop_arrives():
    f = StopStringFilter(("STOP",))
    a, _ = f.feed("abcST", final=False)
    b, hit = f.feed("x", final=True)
    assert a + b == "abcSTx" and not hit


def test_earliest_of_several_stop_strings_wins():
    f = StopStringFilter(("world", "lo"))
    text, hit = f.feed("hello world", final=False)
    assert hit and text == "hel"
