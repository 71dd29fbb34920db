"""POST /v1/messages and /v1/messages/count_tokens (Anthropic's Messages API), driven by the official
`anthropic` SDK against a real server (tiny model, behind an API key the SDK sends as `x-api-key`):
text streamed and not, against the offline engine; stop sequences; tools forced by tool_choice, streamed
with the SDK's stream helper; a tool round trip; count_tokens; Anthropic's errors; a full lane's 429; a
client leaving mid-stream."""

from __future__ import annotations

import asyncio
import functools
import json
import threading
from types import SimpleNamespace

import anthropic
import httpx
import pytest

from engine import SamplingParams
from engine.api import RequestOutput
from server.api.messages_shapes import MessageShape
from server.prompt.tools import ToolPlan
from server.serving.ticket import Finished, ServerError, Tokens

from ..helpers import ControlledEngine, make_settings, metric, run_server, wait_until

MODEL = "tiny-llama"
KEY = "sk-test"
SYSTEM = "You are terse."
MESSAGES = [{"role": "user", "content": "Say hello."}]
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"],
           "additionalProperties": False}  # fmt: skip
TOOLS = [{"name": "get_weather", "description": "Weather in a city", "input_schema": WEATHER}]
ONE_CALL = {"type": "any", "disable_parallel_tool_use": True}


@pytest.fixture(scope="module")
def engine(real_engine):
    eng = ControlledEngine(real_engine)
    yield eng
    eng.gate.set()


@pytest.fixture(scope="module")
def srv(engine):
    with run_server(make_settings(api_key=KEY, batch_max_queued_requests=1), engine) as s:
        yield s


@pytest.fixture(scope="module")
def claude(srv):
    with anthropic.Anthropic(base_url=srv.url, api_key=KEY, max_retries=0, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def greedy(offline_engine):
    def run(messages: list[dict], n: int) -> tuple[list[int], str]:
        ids = offline_engine.apply_chat_template(messages)
        [r] = offline_engine.generate([ids], SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
        return ids, r.text

    return run


def post(srv, path: str, body: dict, **headers: str) -> httpx.Response:
    return httpx.post(f"{srv.url}{path}", json=body, headers={"x-api-key": KEY, **headers}, timeout=60)


def prompt_tokens(usage) -> int:
    return usage.input_tokens + usage.cache_read_input_tokens


def test_message_equals_offline(claude, greedy):
    ids, want = greedy([{"role": "system", "content": SYSTEM}, *MESSAGES], 8)
    r = claude.messages.create(model=MODEL, max_tokens=8, system=SYSTEM, messages=MESSAGES, temperature=0,
                               top_p=1.0, top_k=0, metadata={"user_id": "u1"}, extra_body={"ignore_eos": True})
    assert r.type == "message" and r.role == "assistant" and r.model == MODEL and r.id.startswith("msg_")
    assert [b.type for b in r.content] == ["text"] and r.content[0].text == want
    assert r.stop_reason == "max_tokens" and r.stop_sequence is None
    assert prompt_tokens(r.usage) == len(ids) and r.usage.output_tokens == 8
    blocks = claude.messages.create(model=MODEL, max_tokens=8, system=[{"type": "text", "text": SYSTEM}],
                                    messages=[{"role": "user", "content": [{"type": "text", "text": "Say hello."}]}],
                                    temperature=0, extra_body={"ignore_eos": True})  # fmt: skip
    assert blocks.content[0].text == want


def test_stream_with_the_sdk_helper(claude, srv, greedy):
    ids, want = greedy(MESSAGES, 8)
    kw = dict(model=MODEL, max_tokens=8, messages=MESSAGES, temperature=0, extra_body={"ignore_eos": True})
    with claude.messages.stream(**kw) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == want == final.content[0].text
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 8
    assert prompt_tokens(final.usage) == len(ids)
    kinds = [e.type for e in claude.messages.create(stream=True, **kw)]
    assert kinds[:2] == ["message_start", "content_block_start"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(kinds[2:-3]) == {"content_block_delta"}
    # the wire: `event:` names equal to each data's `type`
    with httpx.stream("POST", f"{srv.url}/v1/messages", json={**kw.pop("extra_body"), **kw, "stream": True},
                      headers={"x-api-key": KEY, "anthropic-version": "2023-06-01"}, timeout=60) as r:  # fmt: skip
        lines = [line for line in r.iter_lines() if line and not line.startswith(":")]
    names = [line.removeprefix("event: ") for line in lines if line.startswith("event: ")]
    data = [json.loads(line.removeprefix("data: ")) for line in lines if line.startswith("data: ")]
    assert names == [d["type"] for d in data] == kinds


def test_stop_sequences(claude, greedy):
    _, text = greedy(MESSAGES, 16)
    stop = next(text[i : i + 2] for i in range(2, len(text) - 2) if text[i : i + 2].strip() and text.find(text[i : i + 2]) == i)
    kw = dict(model=MODEL, max_tokens=16, messages=MESSAGES, temperature=0, stop_sequences=["\x00never", stop],
              extra_body={"ignore_eos": True})  # fmt: skip
    r = claude.messages.create(**kw)
    assert r.content[0].text == text[: text.find(stop)]
    assert r.stop_reason == "stop_sequence" and r.stop_sequence == stop
    with claude.messages.stream(**kw) as stream:
        final = stream.get_final_message()
    assert final.content[0].text == r.content[0].text
    assert final.stop_reason == "stop_sequence" and final.stop_sequence == stop


def test_forced_tool_use(claude):
    """tool_choice any / tool: the grammar forces one call; it comes back as a tool_use block with its
    input object, stop_reason tool_use; streamed, the input's JSON arrives as input_json_delta pieces."""
    kw = dict(model=MODEL, max_tokens=120, messages=[{"role": "user", "content": "Weather in Paris?"}], tools=TOOLS,
              tool_choice=ONE_CALL, temperature=0)  # fmt: skip
    r = claude.messages.create(**kw)
    assert r.stop_reason == "tool_use" and [b.type for b in r.content] == ["tool_use"]
    [call] = r.content
    assert call.name == "get_weather" and call.id.startswith("toolu_") and set(call.input) == {"city"}
    named = claude.messages.create(**{**kw, "tool_choice": {"type": "tool", "name": "get_weather",
                                                            "disable_parallel_tool_use": True}})  # fmt: skip
    assert [b.name for b in named.content] == ["get_weather"] and named.stop_reason == "tool_use"
    with claude.messages.stream(**kw) as stream:
        events = list(stream)
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use" and [b.type for b in final.content] == ["tool_use"]
    assert final.content[0].input == call.input and final.content[0].name == "get_weather"
    pieces = [e.partial_json for e in events if e.type == "input_json"]
    assert pieces and json.loads("".join(pieces)) == call.input
    start = next(e for e in events if e.type == "content_block_start")
    assert start.content_block.type == "tool_use" and start.content_block.input == {}


def test_tool_round_trip(claude, offline_engine):
    """The model's tool_use back in an assistant turn, its tool_result in the next user turn: they reach
    the prompt as chat's tool turns do (a Hermes call, a <tool_response> user turn), and the model answers
    in text; count_tokens counts the same prompt."""
    first = claude.messages.create(model=MODEL, max_tokens=120, tools=TOOLS, tool_choice=ONE_CALL, temperature=0,
                                   messages=[{"role": "user", "content": "Weather in Paris?"}])  # fmt: skip
    [call] = first.content
    history = [{"role": "user", "content": "Weather in Paris?"},
               {"role": "assistant", "content": [{"type": "tool_use", "id": call.id, "name": call.name,
                                                  "input": {"city": "Paris"}}]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                             "content": [{"type": "text", "text": "21 C and sunny"}]}]}]  # fmt: skip
    kw = dict(model=MODEL, messages=history, tools=TOOLS, tool_choice={"type": "none"})
    r = claude.messages.create(max_tokens=4, temperature=0, **kw)
    assert [b.type for b in r.content] == ["text"] and r.stop_reason == "max_tokens"
    text = offline_engine.tokenizer.decode(offline_engine.apply_chat_template(
        [{"role": "user", "content": "Weather in Paris?"},
         {"role": "assistant", "content": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
          '</tool_call>'},
         {"role": "user", "content": "<tool_response>\n21 C and sunny\n</tool_response>"}]))  # fmt: skip
    want = len(offline_engine.tokenizer.encode(text, add_special_tokens=False))
    assert prompt_tokens(r.usage) == want
    assert claude.messages.count_tokens(**kw).input_tokens == want
    auto = claude.messages.count_tokens(model=MODEL, messages=history, tools=TOOLS)
    assert auto.input_tokens > want  # auto: the tools are described in a system turn


def test_count_tokens(claude, offline_engine):
    ids = offline_engine.apply_chat_template([{"role": "system", "content": SYSTEM}, *MESSAGES])
    assert claude.messages.count_tokens(model=MODEL, system=SYSTEM, messages=MESSAGES).input_tokens == len(ids)


@pytest.mark.parametrize("body, where", [
    ({"messages": MESSAGES}, "max_tokens"),
    ({"max_tokens": 0, "messages": MESSAGES}, "max_tokens"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
     "messages.0.content.0.type"),
    ({"max_tokens": 4, "messages": [{"role": "system", "content": "hi"}]}, "messages.0.role"),
    ({"max_tokens": 4, "messages": [{"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "t"}]}]},
     "messages.0.content.0.type"),
    ({"max_tokens": 4, "messages": [{"role": "assistant", "content": [{"type": "tool_use", "name": "f", "input": {}}]}]},
     "messages.0.content.0.id"),
    ({"max_tokens": 4, "messages": MESSAGES, "tools": [{"type": "web_search_20250305", "name": "web_search"}]},
     "tools.0.type"),
    ({"max_tokens": 4, "messages": MESSAGES, "tools": [{"name": "bad name!", "input_schema": {}}]}, "tools.0.name"),
    ({"max_tokens": 4, "messages": MESSAGES, "tool_choice": {"type": "any"}}, "tool_choice"),
    ({"max_tokens": 4, "messages": MESSAGES, "tools": TOOLS, "tool_choice": {"type": "tool", "name": "nope"}},
     "tool_choice"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": "x" * 40_000}]}, "prompt"),
    ({"max_tokens": 10**30, "messages": MESSAGES}, "max_tokens"),
    ({"max_tokens": 4, "messages": MESSAGES, "metadata": {"user_id": "u" * 300}}, "metadata.user_id"),
    ({"max_tokens": 4, "messages": MESSAGES, "metadata": functools.reduce(lambda v, _: [v], range(100), 0)}, "body"),
])  # fmt: skip
def test_invalid_requests_are_400_naming_the_field(srv, body, where):
    r = post(srv, "/v1/messages", {"model": MODEL, **body}, **{"anthropic-version": "2023-06-01"})
    assert r.status_code == 400, r.text
    assert r.json()["type"] == "error" and r.json()["error"]["type"] == "invalid_request_error"
    assert r.json()["error"]["message"].startswith(f"{where}")


def test_sdk_errors(claude, srv):
    with pytest.raises(anthropic.NotFoundError) as e:
        claude.messages.create(model="claude-sonnet-4-5", max_tokens=4, messages=MESSAGES)
    assert e.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.BadRequestError) as bad:
        claude.messages.create(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": [
            {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "x"}}]}])  # fmt: skip
    assert "messages.0.content.0.type" in bad.value.body["error"]["message"]
    with anthropic.Anthropic(base_url=srv.url, api_key="wrong", max_retries=0) as stranger:
        with pytest.raises(anthropic.AuthenticationError):
            stranger.messages.create(model=MODEL, max_tokens=4, messages=MESSAGES)
    # the bearer key is still a key here
    r = httpx.post(f"{srv.url}/v1/messages/count_tokens", json={"model": MODEL, "messages": MESSAGES},
                   headers={"Authorization": f"Bearer {KEY}"}, timeout=30)  # fmt: skip
    assert r.status_code == 200 and r.json()["input_tokens"] > 0


def test_full_lane_is_429_with_retry_after(claude, srv, engine):
    """The worker held after a first step: one batch request fills the batch lane (bound 1), the next one
    is refused at once, 429 rate_limit_error with Retry-After; once the worker goes on, both others end."""
    engine.close_gate_after(1)
    body = dict(model=MODEL, max_tokens=4, messages=MESSAGES, extra_body={"ignore_eos": True})
    results: dict[str, object] = {}

    def send(tag: str, **extra: object) -> None:
        results[tag] = claude.messages.create(**{**body, **extra})

    filler = threading.Thread(target=send, args=("filler",))
    filler.start()
    wait_until(engine.waiting_at_gate.is_set, what="worker held at the gate")
    queued = threading.Thread(target=send, args=("queued",), kwargs={"extra_body": {"ignore_eos": True,
                                                                                   "priority": "batch"}})
    queued.start()
    wait_until(lambda: srv.health()["waiting"]["batch"] == 1, what="the batch lane full")
    try:
        with pytest.raises(anthropic.RateLimitError) as e:
            claude.messages.create(**{**body, "extra_body": {"priority": "batch"}})
        assert int(e.value.response.headers["retry-after"]) >= 1
        assert e.value.body["error"]["type"] == "rate_limit_error"
    finally:
        engine.gate.set()
    filler.join(60)
    queued.join(60)
    assert results["filler"].usage.output_tokens == 4 and results["queued"].usage.output_tokens == 4


def test_client_leaving_mid_stream_aborts_the_request(claude, srv, engine):
    def cancelled() -> float:
        text = httpx.get(f"{srv.url}/metrics", timeout=10).text
        return sum(metric(text, "tokenmill_requests_total", lane=lane, status="cancelled", reason="client")
                   for lane in ("interactive", "standard", "batch"))  # fmt: skip

    before = cancelled()
    engine.step_delay_s = 0.02  # 500 tokens would take 10 s
    try:
        with claude.messages.stream(model=MODEL, max_tokens=500, messages=MESSAGES,
                                    extra_body={"ignore_eos": True}) as stream:  # fmt: skip
            for seen, _ in enumerate(stream.text_stream):
                if seen == 2:
                    break  # leaving the block closes the connection
        wait_until(lambda: cancelled() == before + 1, what="the request cancelled")
        h = srv.wait_idle(timeout=10)
        assert h["kv_blocks_used"] == 0 and h["running"] == 0
    finally:
        engine.step_delay_s = 0.0


def test_a_deadline_ends_the_stream_with_stop_reason_timeout(claude, engine):
    engine.step_delay_s = 0.02  # 500 tokens would take 10 s
    try:
        with claude.messages.stream(model=MODEL, max_tokens=500, messages=MESSAGES,
                                    extra_body={"ignore_eos": True, "timeout_s": 0.5}) as stream:  # fmt: skip
            text = "".join(stream.text_stream)
            final = stream.get_final_message()
    finally:
        engine.step_delay_s = 0.0
    assert final.stop_reason == "timeout" and 0 < final.usage.output_tokens < 500 and final.content[0].text == text


@pytest.mark.parametrize("error, kind", [(ServerError("engine_error", "the step failed", 500), "api_error"),
                                         (ServerError("shutdown", "the server is shutting down", 503),
                                          "overloaded_error")])  # fmt: skip
def test_a_failure_after_the_stream_began_is_an_error_event(error, kind):
    """What the worker reports after the first tokens (an engine error, the drain deadline) ends the
    stream with Anthropic's `error` event, typed by the status it would have had."""
    ticket = SimpleNamespace(prompt_token_ids=[1, 2, 3], cached_tokens=0, completion_tokens=1)
    shape = MessageShape(MODEL, ToolPlan([], None, None, None, True), [], codec=None)  # type: ignore[arg-type]
    output = RequestOutput("r", [7], "Hi", None, False, None, prompt_tokens=3, completion_tokens=1, cached_tokens=0)

    async def events():
        yield 0, Tokens(output)
        yield 0, Finished("error", error)

    async def sent() -> list[tuple[str, dict]]:
        return [(e.event, json.loads(e.data)) async for e in shape.stream([SimpleNamespace(ticket=ticket)], events())]

    got = asyncio.run(sent())
    assert [name for name, _ in got] == ["message_start", "content_block_start", "content_block_delta", "error"]
    assert got[2][1]["delta"] == {"type": "text_delta", "text": "Hi"}
    assert got[-1][1] == {"type": "error", "error": {"type": kind, "message": error.message}}


def test_smollm2_agent_turns(smollm2_server, smollm2_client):
    """Claude Code's loop on the real default model: a forced call streamed with the SDK's helper, its
    blocks sent back as they came with the tool's result, and an answer in text; the history's prompt
    is the chat endpoint's for the same turns."""
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    kw = dict(model="smollm2", max_tokens=60, tools=TOOLS, temperature=0)
    with anthropic.Anthropic(base_url=smollm2_server.url, api_key="unused", max_retries=0, timeout=120) as c:
        with c.messages.stream(messages=ask, tool_choice=ONE_CALL, **kw) as stream:
            first = stream.get_final_message()
        assert first.stop_reason == "tool_use" and [b.type for b in first.content] == ["tool_use"]
        [call] = first.content
        assert call.name == "get_weather" and "Paris" in call.input["city"]
        history = [*ask, {"role": "assistant", "content": [b.model_dump() for b in first.content]},
                   {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                                 "content": "21 C and sunny"}]}]  # fmt: skip
        with c.messages.stream(messages=history, tool_choice={"type": "none"}, **kw) as stream:
            text = "".join(stream.text_stream)
            final = stream.get_final_message()
        assert text and final.content[0].text == text and final.stop_reason in ("end_turn", "max_tokens")
        counted = c.messages.count_tokens(model="smollm2", messages=history, tools=TOOLS).input_tokens
    chat_tools = [{"type": "function", "function": {"name": t["name"], "description": t["description"],
                                                    "parameters": t["input_schema"]}} for t in TOOLS]  # fmt: skip
    arguments = json.dumps(call.input)
    chat = smollm2_client.chat.completions.create(model="smollm2", max_tokens=1, tools=chat_tools, messages=[
        *ask, {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": "21 C and sunny"}])  # fmt: skip
    assert counted == chat.usage.prompt_tokens
