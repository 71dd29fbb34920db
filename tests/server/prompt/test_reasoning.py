"""Reasoning parsers (server/prompt/reasoning.py) and the reader that puts them before the tool-call parser
(server/prompt/output_reader.py), without a server: every text split at every boundary (one character at a
time, and into two and three pieces at every pair of positions around the markers) reads back as the
whole text does; the answers for each case are written out."""

from __future__ import annotations

import itertools

import pytest

from server.prompt.output_reader import OutputReader
from server.prompt.reasoning import (
    REASONING_FORMATS,
    ReasoningParser,
    ReasoningPlan,
    plan_reasoning,
    prompt_thinking,
    reasoning_tokens,
    split_reasoning,
    thinking_requested,
)
from server.prompt.tool_parser import HermesToolParser

R1, QWEN3 = REASONING_FORMATS["deepseek_r1"], REASONING_FORMATS["qwen3"]

# (text, reasoning, content, where the reasoning ended) for both formats
CASES = [
    ("<think>\nI add 2 and 2.\n</think>\n\nIt is 4.", "\nI add 2 and 2.\n", "It is 4.", 23),
    ("no start marker</think>Answer", "no start marker", "Answer", 15),  # the prompt opened it
    ("  <think>still thinking, cut by max_tokens", "still thinking, cut by max_tokens", "", None),
    ("<think>a </thin b </ c <think> d</think>e</think>", "a </thin b </ c <think> d", "e</think>", 32),
    ("<think></think>", "", "", 7),
    ("<thi", "<thi", "", None),  # an unfinished start marker at the end is text
    ("x</think", "x</think", "", None),  # so is an unfinished end marker
    ("<think>é中文</think>\n 答え", "é中文", "答え", 10),
]


def _pieces(parser: ReasoningParser, chunks: list[str]) -> tuple[str, str]:
    reasoning = content = ""
    for chunk in chunks:
        d = parser.feed(chunk)
        reasoning, content = reasoning + d.reasoning, content + d.content
    d = parser.finish()
    return reasoning + d.reasoning, content + d.content


def _splits(text: str) -> list[list[str]]:
    """Every way to cut `text` once or twice, and one character at a time."""
    cuts = [[text[:i], text[i:]] for i in range(len(text) + 1)]
    cuts += [[text[:i], text[i:j], text[j:]] for i, j in itertools.combinations(range(len(text) + 1), 2)]
    return [*cuts, list(text)]


@pytest.mark.parametrize("fmt", [R1, QWEN3], ids=["deepseek_r1", "qwen3"])
@pytest.mark.parametrize(("text", "reasoning", "content", "ended"), CASES)
def test_any_split_reads_as_the_whole_text(fmt, text, reasoning, content, ended):
    assert split_reasoning(fmt, text) == (reasoning, content, ended)
    for chunks in _splits(text):
        parser = ReasoningParser(fmt)
        assert _pieces(parser, chunks) == (reasoning, content), chunks
        assert parser.ended_at == ended


def test_nothing_is_released_while_a_marker_may_be_starting():
    parser = ReasoningParser(R1)
    assert parser.feed("<thi").reasoning == ""  # may be the start marker
    assert parser.feed("nk>Hmm </th").reasoning == "Hmm "  # the end marker's start is held
    d = parser.feed("ink>\n\n")
    assert (d.reasoning, d.content) == ("", "")  # the space after the end waits for the answer
    assert parser.feed(" {").content == "{"


def test_thinking_off_reads_everything_as_content():
    assert split_reasoning(QWEN3, "<think>x</think>y", thinking=False) == ("", "<think>x</think>y", 0)


def test_qwen3_ends_reasoning_at_a_tool_call_and_deepseek_does_not():
    text = "<think>I should call it<tool_call>\n{}\n</tool_call>"
    assert split_reasoning(QWEN3, text) == ("I should call it", "<tool_call>\n{}\n</tool_call>", 23)
    assert split_reasoning(R1, text)[:2] == ("I should call it<tool_call>\n{}\n</tool_call>", "")


CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


@pytest.mark.parametrize("fmt", [R1, QWEN3], ids=["deepseek_r1", "qwen3"])
def test_tool_calls_are_read_only_after_the_reasoning(fmt):
    decoy = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'
    text = f"<think>Not {decoy.replace('<tool_call>', '<tool_')} yet</think>\n\nSure. {CALL}"
    for chunks in _splits(text)[:: max(1, len(text) // 7)] + [list(text)]:
        reader = OutputReader(ReasoningPlan(fmt, True), HermesToolParser())
        thought = content = ""
        calls = []
        for chunk in chunks:
            d = reader.feed(chunk)
            thought, content, calls = thought + d.reasoning, content + d.content, calls + d.calls
        d = reader.finish()
        thought, content, calls = thought + d.reasoning, content + d.content, calls + d.calls
        assert "Rome" in thought and content == "Sure." and [c.name for c in reader.calls] == ["get_weather"]
        assert reader.calls[0].arguments == '{"city": "Paris"}'
        assert "".join(c.arguments for c in calls) == '{"city": "Paris"}'


def test_a_dropped_reasoning_is_still_counted():
    reader = OutputReader(ReasoningPlan(R1, True, include=False), None)
    piece = reader.read_all("<think>abc</think>def", list(range(21)))  # one token per character
    assert (piece.reasoning, piece.content) == ("", "def") and reader.reasoning == "abc"
    assert reader.reasoning_tokens(lambda ids: "<think>abc</think>def"[: len(ids)]) == 10


def test_reasoning_tokens_are_those_before_the_end_marker():
    text = "<think>ab</think>cd"
    tokens = ["<think>", "a", "b", "</", "think", ">", "c", "d"]

    def decode(ids: list[int]) -> str:
        return "".join(tokens[i] for i in ids)

    ended = split_reasoning(R1, text)[2]
    assert reasoning_tokens(ended, list(range(8)), decode) == 3  # <think>, a, b
    assert reasoning_tokens(None, list(range(8)), decode) == 8
    assert reasoning_tokens(0, list(range(8)), decode) == 0


def test_the_prompt_and_the_template_kwargs_decide_where_the_output_starts():
    assert prompt_thinking(QWEN3, "<|im_start|>assistant\n<think>\n\n</think>\n\n") is False  # thinking off
    assert prompt_thinking(QWEN3, "<|im_start|>assistant\n<think>\n") is True  # the template opened it
    assert prompt_thinking(QWEN3, "<|im_start|>assistant\n") is None
    assert thinking_requested({"enable_thinking": False}) is False and thinking_requested({"thinking": False}) is False
    assert thinking_requested({"enable_thinking": True}) and thinking_requested(None)
    ids = list(range(10))
    closed = plan_reasoning("qwen3", None, ids, lambda _: "assistant\n<think>\n\n</think>\n\n")
    opened = plan_reasoning("deepseek_r1", None, ids, lambda _: "assistant\n<think>\n")
    off = plan_reasoning("qwen3", {"enable_thinking": False}, ids, lambda _: "assistant\n")
    assert closed is not None and not closed.thinking and opened is not None and opened.thinking
    assert off is not None and not off.thinking
    assert plan_reasoning(None, None, ids, lambda _: "") is None


def test_the_flag_takes_vllms_names_and_refuses_others():
    import argparse

    from pydantic import ValidationError

    from server.config.flags import add_flags, parse_settings
    from server.config.vllm_flags import flag_problems

    assert parse_settings(["--reasoning-parser", "qwen3"]).reasoning_parser == "qwen3"
    assert parse_settings([]).reasoning_parser is None
    parser = argparse.ArgumentParser()
    add_flags(parser)
    assert flag_problems(parser, ["--reasoning-parser", "deepseek_r1"]) is None  # no longer a vLLM-only flag
    with pytest.raises(SystemExit):
        parse_settings(["--reasoning-parser", "granite"])  # argparse: not one of the choices
    with pytest.raises(ValidationError):
        from server.config.settings import ServerSettings

        ServerSettings(reasoning_parser="granite")


def test_a_grammar_waits_for_the_reasoning_to_end():
    import json

    from engine.structured.spec import GrammarSpec
    from server.prompt.structured import GrammarRequest, behind_reasoning

    asked = GrammarRequest(GrammarSpec("json_object", ""), "response_format")
    for fmt, excludes in ((R1, []), (QWEN3, ["<tool_call>"])):  # qwen3's parser ends at a call: kept out
        plan, grammar = behind_reasoning(ReasoningPlan(fmt, True), asked)
        assert plan == ReasoningPlan(fmt, True) and grammar is not None and grammar.param == "response_format"
        assert grammar.spec.kind == "after_reasoning"
        assert json.loads(grammar.spec.source) == {"end": "</think>", "excludes": excludes, "kind": "json_object",
                                                   "source": ""}  # fmt: skip
    assert behind_reasoning(ReasoningPlan(R1, False), asked) == (ReasoningPlan(R1, False), asked)  # thinking off
    # include_reasoning false: vLLM's rule, the grammar from the first token, the output read as content
    assert behind_reasoning(ReasoningPlan(R1, True, include=False), asked) == (ReasoningPlan(R1, False, False), asked)
    assert behind_reasoning(None, asked) == (None, asked)
    assert behind_reasoning(ReasoningPlan(R1, True), None) == (ReasoningPlan(R1, True), None)
