"""The load client's stream parsers on canned bytes: SSE framing split anywhere, /generate events,
OpenAI completion chunks; and the request bodies and prompt helpers."""

from __future__ import annotations

import json
import math

import pytest

from bench.lib.client import LoadConfig, LoadRequest, request_body, warmup_request
from bench.lib.load_requests import assign_lanes, jsonl_requests, parse_priority_mix
from bench.lib.streams import SseDecoder, SseEvent, parse_generate_event, parse_openai_event

GENERATE_STREAM = (
    b'event: token\r\ndata: {"id":"r1","index":0,"token_id":5,"text":"a"}\r\n\r\n'
    b": ping\r\n\r\n"
    b'event: token\r\ndata: {"id":"r1","index":1,"token_id":7,"text":"\xc3\xa9"}\r\n\r\n'
    b'event: done\r\ndata: {"id":"r1","finish_reason":"length","usage":{"prompt_tokens":3,'
    b'"completion_tokens":2,"cached_tokens":1},"timing":{}}\r\n\r\n'
)

OPENAI_STREAM = (
    b'data: {"id":"c","choices":[{"index":0,"text":"he","logprobs":null,"finish_reason":null}]}\n\n'
    b'data: {"id":"c","choices":[{"index":0,"text":"","logprobs":null,"finish_reason":null}]}\n\n'
    b'data: {"id":"c","choices":[{"index":0,"text":"","logprobs":null,"finish_reason":"length"}]}\n\n'
    b'data: {"id":"c","choices":[],"usage":{"prompt_tokens":4,"completion_tokens":3,"total_tokens":7,'
    b'"prompt_tokens_details":{"cached_tokens":2}}}\n\n'
    b"data: [DONE]\n\n"
)


def decode_in_pieces(data: bytes, size: int) -> list[SseEvent]:
    dec = SseDecoder()
    events = []
    for i in range(0, len(data), size):
        events.extend(dec.feed(data[i : i + size]))
    return events


@pytest.mark.parametrize("size", [1, 2, 3, 7, 1000])
def test_sse_decoder_is_independent_of_chunking(size):
    events = decode_in_pieces(GENERATE_STREAM, size)
    assert [e.event for e in events] == ["token", "token", "done"]  # the ping comment is skipped
    assert json.loads(events[1].data)["text"] == "é"  # a 2-byte character split across pieces survives
    assert decode_in_pieces(OPENAI_STREAM, size) == decode_in_pieces(OPENAI_STREAM, 10_000)


def test_sse_decoder_fields():
    events = SseDecoder().feed(b"data: a\ndata:b\nid: 3\nretry: 5\n\nevent: x\ndata\n\n\n\ndata: tail")
    assert events == [SseEvent("message", "a\nb"), SseEvent("x", "")]  # "tail" has no blank line yet


def test_generate_events_count_tokens_and_read_usage():
    updates = [parse_generate_event(e) for e in SseDecoder().feed(GENERATE_STREAM)]
    assert [u.tokens for u in updates] == [1, 1, 0]
    done = updates[-1]
    assert done.finished and done.finish_reason == "length" and done.output_tokens == 2 and done.prompt_tokens == 3
    assert done.cached_tokens == 1
    err = parse_generate_event(SseEvent("error", '{"error":{"type":"shutdown","message":"draining"}}'))
    assert err.finished and err.error == "shutdown: draining"
    text_only = parse_generate_event(SseEvent("token", '{"id":"r","index":2,"token_id":null,"text":"x"}'))
    assert text_only.tokens == 0


def test_openai_chunks_count_steps_and_read_usage():
    updates = [parse_openai_event(e) for e in SseDecoder().feed(OPENAI_STREAM)]
    assert [u.tokens for u in updates] == [1, 1, 0, 0, 0]  # an empty-text step is still a token event
    assert updates[2].finish_reason == "length"
    assert updates[3].output_tokens == 3 and updates[3].prompt_tokens == 4 and updates[3].cached_tokens == 2
    assert updates[4].finished and not any(u.finished for u in updates[:4])
    err = parse_openai_event(SseEvent("message", '{"error":{"message":"boom","type":"server_error"}}'))
    assert err.finished and err.error == "server_error: boom"
    role = parse_openai_event(SseEvent("message", '{"choices":[{"index":0,"delta":{"role":"assistant"}}]}'))
    assert role.tokens == 0
    chat = parse_openai_event(SseEvent("message", '{"choices":[{"index":0,"delta":{"content":"hi"}}]}'))
    assert chat.tokens == 1


def test_request_bodies():
    req = LoadRequest((1, 2, 3), 16, "batch")
    gen = request_body(req, LoadConfig("http://h", "generate", concurrency=2))
    assert gen == {"prompt_token_ids": [1, 2, 3], "max_tokens": 16, "stream": True, "temperature": 0.0,
                   "ignore_eos": True, "priority": "batch"}
    oai = request_body(LoadRequest("hi", 8), LoadConfig("http://h", "completions", concurrency=1, model_name="m"))
    assert oai["prompt"] == "hi" and oai["model"] == "m" and oai["stream_options"] == {"include_usage": True}
    assert "priority" not in oai
    with pytest.raises(ValueError):
        LoadConfig("http://h", "generate")  # neither a concurrency nor a rate
    assert LoadConfig("http://h", request_rate=2.0).concurrency is None
    with pytest.raises(ValueError):
        LoadConfig("http://h", "nope", concurrency=1)
    assert math.isinf(LoadConfig("http://h", concurrency=1).request_rate)


def test_priority_mix_and_jsonl(tmp_path):
    assert parse_priority_mix("interactive=3,batch") == {"interactive": 3.0, "batch": 1.0}
    assert parse_priority_mix(None) is None
    with pytest.raises(ValueError):
        parse_priority_mix("urgent=1")
    reqs = [LoadRequest((1,), 4)] * 400
    lanes = [r.lane for r in assign_lanes(reqs, {"interactive": 3.0, "batch": 1.0}, seed=0)]
    assert lanes == [r.lane for r in assign_lanes(reqs, {"interactive": 3.0, "batch": 1.0}, seed=0)]
    assert set(lanes) == {"interactive", "batch"} and 250 < lanes.count("interactive") < 350
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "hello", "max_tokens": 5}\n\n{"prompt_token_ids": [4, 5]}\n')
    got = jsonl_requests(f, num=3, output_len=9)
    assert got == [LoadRequest("hello", 5), LoadRequest((4, 5), 9), LoadRequest("hello", 5)]


def test_warmup_prompt_shares_no_prefix_with_the_first_timed_prompt():
    w = warmup_request(LoadRequest((1, 2, 3), 128, "batch"))
    assert w.prompt[0] != 1 and sorted(w.prompt) == [1, 2, 3] and w.max_tokens == 4 and w.lane == "batch"
    assert warmup_request(LoadRequest((5, 6, 5), 2)).prompt[0] != 5
    assert not warmup_request(LoadRequest("hello", 8)).prompt.startswith("hello")


@pytest.mark.parametrize("endpoint", ["generate", "completions"])
@pytest.mark.parametrize("kind,status", [("queue_timeout", "timeout"), ("engine_error", "error")])
def test_a_streamed_server_deadline_counts_as_a_timeout(endpoint, kind, status):
    import asyncio

    import httpx

    from bench.lib.client import send_one

    err = json.dumps({"error": {"type": kind, "message": "waited 30.1s in the interactive lane"}})
    body = f"event: error\ndata: {err}\n\n" if endpoint == "generate" else f"data: {err}\n\ndata: [DONE]\n\n"

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=body.encode(), headers={"content-type": "text/event-stream"})

    async def go():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler), base_url="http://test") as client:
            return await send_one(client, LoadRequest(prompt=(1, 2, 3), max_tokens=4), LoadConfig(
                base_url="http://test", endpoint=endpoint, concurrency=1))

    rec = asyncio.run(go())
    assert rec.status == status and kind in rec.error
