"""--reasoning-parser over every API that has a field for reasoning, driven by the official clients: chat
(`reasoning` in the message and in stream deltas, usage's reasoning_tokens), /v1/responses (a reasoning
item, its reasoning_text events) and /v1/messages (a thinking block, thinking_delta and signature_delta).

The model is the fake engine's byte-level one (one token per byte, so each marker reaches the parser split
at every byte boundary in a stream) scripted to write what the user message asks for after `SCRIPT:`, under
a fixture chat template in Qwen3's manner: `enable_thinking: false` writes an empty, closed think block into
the prompt, and an assistant turn's `reasoning_content` is replayed. A last test runs the real tiny model
with a JSON schema: the grammar lets the reasoning run free and holds only after it."""

from __future__ import annotations

import json

import anthropic
import httpx
import openai
import pytest

from engine.sched.outputs import ModelRunnerOutput, SchedulerOutput

from ..fake_engine import EOS_ID, OFFSET, FakeEngine, FakeTokenizer
from ..helpers import ControlledEngine, make_settings, run_server

THOUGHT = "I should add 2 and 2. Not <tool_ yet: <thi, </thin and </ are no end."  # pieces of markers
SCRIPT = f"<think>\n{THOUGHT}\n</think>\n\nIt is 4."
ENDED = len(f"<think>\n{THOUGHT}\n")  # bytes (tokens) before the end marker: the reasoning tokens
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]  # fmt: skip


class ThinkingTokenizer(FakeTokenizer):
    """The fake tokenizer under a Qwen3-like template (the fixture template of these tests)."""

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, tokenize: bool = True,
                            enable_thinking: bool = True, **kwargs):  # fmt: skip
        text = ""
        for m in messages:
            thought = m.get("reasoning_content")
            replay = f"<think>{thought}</think>" if m["role"] == "assistant" and thought else ""
            text += f"<|im_start|>{m['role']}\n{replay}{m.get('content') or ''}<|im_end|>\n"
        if add_generation_prompt:
            text += "<|im_start|>assistant\n" + ("" if enable_thinking else "<think>\n\n</think>\n\n")
        return self.encode(text) if tokenize else text


class ScriptedRunner:
    """Writes, one byte per step, the text after the prompt's last `SCRIPT:` (to its turn's end), then EOS."""

    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        sampled = {}
        for s in sched.scheduled:
            if s.sample:
                script = _script(s.request.prompt_token_ids)
                n = s.request.num_output_tokens
                sampled[s.request.request_id] = script[n] + OFFSET if n < len(script) else EOS_ID
        return ModelRunnerOutput(sampled, {})


def _script(prompt: list[int]) -> bytes:
    """The bytes after `SCRIPT:` in the prompt's last turn that has one (turns end at special tokens);
    "ok" for a prompt without one (the server's warm-up)."""
    turns, turn = [], bytearray()
    for token in prompt:
        if token < OFFSET:
            turns.append(bytes(turn))
            turn = bytearray()
        else:
            turn.append(token - OFFSET)
    turns.append(bytes(turn))
    return next((t for t in reversed(turns) if b"SCRIPT:" in t), b"SCRIPT:ok").split(b"SCRIPT:", 1)[1]


def scripted_engine() -> FakeEngine:
    engine = FakeEngine(max_model_len=4096)
    engine.tokenizer = ThinkingTokenizer()
    engine.runner = ScriptedRunner()
    return engine


@pytest.fixture(scope="module", params=["deepseek_r1", "qwen3"])
def srv(request):
    with run_server(make_settings(reasoning_parser=request.param, max_model_len=4096), scripted_engine()) as s:
        s.parser = request.param
        yield s


@pytest.fixture(scope="module")
def client(srv):
    with openai.OpenAI(base_url=f"{srv.url}/v1", api_key="x", max_retries=0, timeout=30) as c:
        yield c


@pytest.fixture(scope="module")
def claude(srv):
    with anthropic.Anthropic(base_url=srv.url, api_key="x", max_retries=0, timeout=30) as c:
        yield c


def ask(script: str) -> list[dict]:
    return [{"role": "user", "content": f"SCRIPT:{script}"}]


def chat_stream(client, **kw) -> tuple[str, str, list, dict]:
    """(reasoning, content, tool-call deltas, usage) of a streamed chat answer, the deltas checked."""
    reasoning = content = ""
    calls, usage = [], None
    for chunk in client.chat.completions.create(model="fake-model", stream=True,
                                                stream_options={"include_usage": True}, **kw):  # fmt: skip
        if chunk.usage is not None:
            usage = chunk.usage.model_dump()
        for choice in chunk.choices:
            delta = choice.delta.model_dump()
            piece = delta.get("reasoning") or ""
            assert "<think>" not in piece and "</think>" not in piece
            reasoning, content = reasoning + piece, content + (delta.get("content") or "")
            calls += delta.get("tool_calls") or []
    return reasoning, content, calls, usage or {}


def test_chat_returns_the_reasoning_apart(client):
    r = client.chat.completions.create(model="fake-model", messages=ask(SCRIPT))
    message = r.choices[0].message
    assert message.model_extra["reasoning"] == f"\n{THOUGHT}\n" and message.content == "It is 4."
    assert r.usage.completion_tokens == len(SCRIPT) + 1 and r.usage.completion_tokens_details.reasoning_tokens == ENDED
    reasoning, content, _, usage = chat_stream(client, messages=ask(SCRIPT))
    assert (reasoning, content) == (f"\n{THOUGHT}\n", "It is 4.")
    assert usage["completion_tokens_details"]["reasoning_tokens"] == ENDED


def test_a_reasoning_cut_short_is_all_reasoning(client):
    r = client.chat.completions.create(model="fake-model", messages=ask(SCRIPT), max_tokens=12)
    assert r.choices[0].message.model_extra["reasoning"] == f"\n{THOUGHT}"[:5] and r.choices[0].message.content is None
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens_details.reasoning_tokens == 12


def test_enable_thinking_false_reads_the_output_as_content(client):
    kw = {"messages": ask("<think>x</think>y"), "extra_body": {"chat_template_kwargs": {"enable_thinking": False}}}
    r = client.chat.completions.create(model="fake-model", **kw)
    assert r.choices[0].message.content == "<think>x</think>y" and r.choices[0].message.model_extra["reasoning"] is None
    assert r.usage.completion_tokens_details.reasoning_tokens == 0
    assert chat_stream(client, **kw)[:2] == ("", "<think>x</think>y")
    effort = client.chat.completions.create(model="fake-model", messages=ask("a</think>b"), reasoning_effort="none")
    assert effort.choices[0].message.content == "a</think>b"  # vLLM's rule: effort none turns thinking off


def test_include_reasoning_false_drops_it(client):
    r = client.chat.completions.create(model="fake-model", messages=ask(SCRIPT), extra_body={"include_reasoning": False})
    assert r.choices[0].message.model_extra["reasoning"] is None and r.choices[0].message.content == "It is 4."
    assert r.usage.completion_tokens_details.reasoning_tokens == ENDED


def test_tool_calls_are_parsed_after_the_reasoning_only(client, srv):
    decoy = CALL.replace("Paris", "Rome")
    thought = "Let me look it up." + ("" if srv.parser == "qwen3" else decoy)  # qwen3: a call ends the thinking
    script = f"<think>{thought}</think>\n\n{CALL}"
    kw = {"messages": ask(script), "tools": TOOLS}
    r = client.chat.completions.create(model="fake-model", **kw)
    message = r.choices[0].message
    assert message.model_extra["reasoning"] == thought and message.content is None
    assert [c.function.arguments for c in message.tool_calls] == ['{"city": "Paris"}']
    assert r.choices[0].finish_reason == "tool_calls"
    reasoning, content, calls, _ = chat_stream(client, **kw)
    assert (reasoning, content) == (thought, "")
    assert "".join(c["function"]["arguments"] for c in calls) == '{"city": "Paris"}'


def test_json_after_the_reasoning_is_the_content(client):
    answer = {"city": "Paris", "days": [1, 2]}
    r = client.chat.completions.create(model="fake-model", messages=ask(f"<think>{{not json}}</think>\n{json.dumps(answer)}"))
    assert json.loads(r.choices[0].message.content) == answer


def test_reasoning_in_the_history_reaches_the_template(client):
    turn = {"role": "assistant", "content": "4", "reasoning": "two and two"}
    again = [*ask("ok"), turn, {"role": "user", "content": "SCRIPT:ok"}]
    base = client.chat.completions.create(model="fake-model", messages=[*ask("ok"), {**turn, "reasoning": None},
                                                                        again[-1]])  # fmt: skip
    for field in ("reasoning", "reasoning_content"):
        with_it = [*again[:1], {"role": "assistant", "content": "4", field: "two and two"}, again[-1]]
        r = client.chat.completions.create(model="fake-model", messages=with_it)
        assert r.usage.prompt_tokens == base.usage.prompt_tokens + len("<think>two and two</think>")


def test_responses_have_a_reasoning_item(client):
    r = client.responses.create(model="fake-model", input=f"SCRIPT:{SCRIPT}")
    assert [o.type for o in r.output] == ["reasoning", "message"]
    assert r.output[0].content[0].type == "reasoning_text" and r.output[0].content[0].text == f"\n{THOUGHT}\n"
    assert r.output_text == "It is 4." and r.usage.output_tokens_details.reasoning_tokens == ENDED
    with client.responses.stream(model="fake-model", input=f"SCRIPT:{SCRIPT}") as stream:
        events = list(stream)
        final = stream.get_final_response()
    deltas = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert deltas == f"\n{THOUGHT}\n"
    kinds = [e.type for e in events if e.type.startswith("response.output_item") or "reasoning_text.done" in e.type]
    assert kinds == ["response.output_item.added", "response.reasoning_text.done", "response.output_item.done",
                     "response.output_item.added", "response.output_item.done"]  # fmt: skip
    assert [o.type for o in final.output] == ["reasoning", "message"] and final.output_text == "It is 4."
    assert final.output[0].content[0].text == f"\n{THOUGHT}\n"
    off = client.responses.create(model="fake-model", input="SCRIPT:a</think>b", reasoning={"effort": "none"})
    assert [o.type for o in off.output] == ["message"] and off.output_text == "a</think>b"
    kwargs = client.responses.create(model="fake-model", input="SCRIPT:a</think>b",
                                     extra_body={"chat_template_kwargs": {"enable_thinking": False}})  # fmt: skip
    assert kwargs.output_text == "a</think>b"


def test_responses_take_reasoning_items_back(client):
    items = [{"role": "user", "content": "SCRIPT:ok"},
             {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "hm"}]},
             {"role": "assistant", "content": "4"}, {"role": "user", "content": "SCRIPT:ok"}]  # fmt: skip
    with_it = client.responses.create(model="fake-model", input=items)
    without = client.responses.create(model="fake-model", input=[i for i in items if i.get("type") != "reasoning"])
    assert with_it.usage.input_tokens == without.usage.input_tokens + len("<think>hm</think>")


def test_messages_have_a_thinking_block(claude):
    kw = {"model": "fake-model", "max_tokens": 200, "messages": ask(SCRIPT)}
    m = claude.messages.create(**kw)
    assert [b.type for b in m.content] == ["thinking", "text"]
    assert m.content[0].thinking == f"\n{THOUGHT}\n" and m.content[0].signature and m.content[1].text == "It is 4."
    assert m.stop_reason == "end_turn" and m.usage.output_tokens == len(SCRIPT) + 1  # and EOS
    with claude.messages.stream(**kw) as stream:
        events = list(stream)
        final = stream.get_final_message()
    thinking = "".join(e.delta.thinking for e in events if e.type == "content_block_delta" and e.delta.type == "thinking_delta")
    signatures = [e.delta.signature for e in events if e.type == "content_block_delta" and e.delta.type == "signature_delta"]
    assert thinking == f"\n{THOUGHT}\n" and len(signatures) == 1
    assert [b.type for b in final.content] == ["thinking", "text"] and final.content[1].text == "It is 4."
    assert final.content[0].signature == signatures[0]


def test_messages_thinking_disabled_and_history(claude):
    off = claude.messages.create(model="fake-model", max_tokens=50, messages=ask("a</think>b"),
                                 thinking={"type": "disabled"})  # fmt: skip
    assert [b.type for b in off.content] == ["text"] and off.content[0].text == "a</think>b"
    kwargs = claude.messages.create(model="fake-model", max_tokens=50, messages=ask("a</think>b"),
                                    extra_body={"chat_template_kwargs": {"enable_thinking": False}})  # fmt: skip
    assert [b.type for b in kwargs.content] == ["text"] and kwargs.content[0].text == "a</think>b"
    turn = [{"type": "thinking", "thinking": "hm", "signature": "s"}, {"type": "redacted_thinking", "data": "x"},
            {"type": "text", "text": "4"}]  # fmt: skip
    convo = [*ask("ok"), {"role": "assistant", "content": turn}, *ask("ok")]
    with_it = claude.messages.count_tokens(model="fake-model", messages=convo)
    without = claude.messages.count_tokens(model="fake-model", messages=[*ask("ok"), {"role": "assistant",
                                                                         "content": "4"}, *ask("ok")])  # fmt: skip
    assert with_it.input_tokens == without.input_tokens + len("<think>hm</think>")
    with pytest.raises(anthropic.BadRequestError) as err:
        claude.messages.create(model="fake-model", max_tokens=5, messages=ask("x"), thinking={"type": "loud"})
    assert "thinking.type" in str(err.value)


# -- the real tiny model: a JSON schema holds after the reasoning, not over it ---------------------------
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.fixture(scope="module")
def real_srv(real_engine):
    with run_server(make_settings(reasoning_parser="deepseek_r1"), ControlledEngine(real_engine)) as s:
        yield s


def test_a_json_schema_applies_after_the_reasoning(real_srv):
    def chat(**extra) -> dict:
        body = {"model": "tiny-llama", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 12,
                "temperature": 0, "ignore_eos": True, **extra}  # fmt: skip
        r = httpx.post(f"{real_srv.url}/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()

    fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}
    free = chat()["choices"][0]["message"]
    held = chat(response_format=fmt)["choices"][0]["message"]
    # The tiny model never writes </think>: all of it is reasoning, which the grammar let run as without one
    # up to the first token with a control byte (the JSON grammar's mask forbids those, reasoning included).
    assert held["content"] is None and "</think>" not in free["reasoning"]
    controls = [i for i, ch in enumerate(free["reasoning"]) if ord(ch) < 0x20 and ch not in "\r\n"]
    same = controls[0] if controls else len(free["reasoning"])
    assert same > 8 and held["reasoning"][:same] == free["reasoning"][:same]
    assert not any(ord(ch) < 0x20 and ch not in "\r\n" for ch in held["reasoning"])
    # include_reasoning false: the grammar holds from the first token (vLLM's rule), and it is all content.
    strict = chat(response_format=fmt, include_reasoning=False)["choices"][0]["message"]
    assert strict["reasoning"] is None and strict["content"].lstrip().startswith("{")
