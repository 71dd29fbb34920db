"""/v1/responses stream: every output item gets its own output_index, in the order the stream opened
them, and the final Response lists the items in that order (text before a call, text after it)."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

from engine.api import RequestOutput
from server.api.responses import ResponseShape, ResponsesRequest
from server.prompt.tools import ToolPlan
from server.serving.ticket import Finished, Tokens

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def _events(shape: ResponseShape, pieces: list[str]) -> list[dict]:
    ticket = SimpleNamespace(prompt_token_ids=[1, 2, 3], cached_tokens=0, completion_tokens=len(pieces))

    async def source():
        for text in pieces:
            out = RequestOutput("r", [7], text, None, False, None, 3, 1, 0)
            yield 0, Tokens(out)
        yield 0, Finished("stop")

    async def collect():
        return [json.loads(e.data) async for e in shape.stream([SimpleNamespace(ticket=ticket)], source())]

    return asyncio.run(collect())


def _shape() -> ResponseShape:
    body = ResponsesRequest(input="hi", tools=[{"type": "function", "name": "get_weather"}])
    return ResponseShape(body, "m", "v1", ToolPlan([], None, None, "hermes", True))


def _added(events: list[dict]) -> list[tuple[int, str]]:
    return [(e["output_index"], e["item"]["type"]) for e in events if e["type"] == "response.output_item.added"]


def test_text_after_a_call_gets_the_next_output_index():
    events = _events(_shape(), [CALL[:20], CALL[20:], "\nIt is ", "sunny."])
    assert _added(events) == [(0, "function_call"), (1, "message")]
    deltas = [e for e in events if e["type"] == "response.output_text.delta"]
    assert deltas and {e["output_index"] for e in deltas} == {1}
    done = [e for e in events if e["type"] == "response.output_item.done"]
    assert sorted((e["output_index"], e["item"]["type"]) for e in done) == [(0, "function_call"), (1, "message")]
    final = events[-1]["response"]["output"]
    assert [o["type"] for o in final] == ["function_call", "message"]
    assert final[1]["content"][0]["text"].strip() == "It is sunny."


def test_text_before_a_call_keeps_index_zero():
    events = _events(_shape(), ["Let me check. ", CALL])
    assert _added(events) == [(0, "message"), (1, "function_call")]
    args = [e for e in events if e["type"] == "response.function_call_arguments.done"]
    assert [e["output_index"] for e in args] == [1]
    assert [o["type"] for o in events[-1]["response"]["output"]] == ["message", "function_call"]
