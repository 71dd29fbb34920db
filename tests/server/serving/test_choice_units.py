"""The choices of one request (a list of prompts, `n`) are one admission unit, through the real HTTP stack:
100 prompts and 2 prompts x n=64 succeed on an idle server (each choice used to be its own request, so
the 64-request interactive lane answered 429 forever); the unit counts once against the lane's request
bound and with its tokens in all against the token bound; a busy lane refuses it whole (429) and a unit
the lane can never hold gets 400 naming the bound; a request's n cannot take every seat: another
client's short request still starts within a step or two; and choices its queue deadline ended before
they started are marked in the answer beside the ones that ran."""

from __future__ import annotations

import json
import statistics
import threading

import httpx
import pytest

from server.serving.gateway import seat_share

from ..helpers import Background, ControlledEngine, make_settings, park_filler, run_server, wait_until
from .test_priority_e2e import ttft

MODEL = "tiny-llama"


def completions(url: str, timeout: float = 60, **body) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", json={"model": MODEL, "ignore_eos": True, **body}, timeout=timeout)


@pytest.fixture(scope="module")
def srv(real_engine):
    """Default lane bounds (interactive: 64 requests), the real engine's 64 seats."""
    with run_server(make_settings(max_num_seqs=64), real_engine) as s:
        yield s


def test_a_hundred_prompts_on_an_idle_server_all_succeed(srv):
    prompts = [f"prompt number {i}:" for i in range(100)]
    r = completions(srv.url, prompt=prompts, max_tokens=4, temperature=0.0)
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert [c["index"] for c in choices] == list(range(100))
    assert all(c["finish_reason"] == "length" for c in choices)
    assert r.json()["usage"]["completion_tokens"] == 400
    # each choice is the single request of its prompt (greedy)
    single = completions(srv.url, prompt=prompts[57], max_tokens=4, temperature=0.0).json()["choices"][0]["text"]
    assert choices[57]["text"] == single
    srv.wait_idle()
    assert srv.runtime.primary.leases == 0


def test_the_documented_1024_choices_succeed_and_1025_are_refused(srv):
    r = completions(srv.url, prompt=[[5 + i % 100, 7] for i in range(1024)], max_tokens=1, timeout=120)
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 1024
    r = completions(srv.url, prompt=[[5, 7]] * 1025, max_tokens=1)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    srv.wait_idle()


def test_two_prompts_times_n_64_succeed(srv):
    r = completions(srv.url, prompt=["def f(x):", "class A:"], n=64, max_tokens=3, temperature=1.0, seed=9)
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert [c["index"] for c in choices] == list(range(128))
    assert r.json()["usage"]["completion_tokens"] == 128 * 3
    assert len({c["text"] for c in choices[:64]}) > 1  # distinct samples of prompt 0
    srv.wait_idle()
    assert srv.runtime.primary.leases == 0


def test_a_unit_counts_once_and_a_busy_lane_refuses_it_whole(real_engine):
    """Interactive lane of 2 requests: a held single request plus a 40-prompt unit fill it (depth 2, the
    unit's tokens all counted); a further unit is refused whole with 429; everything completes and
    nothing is left admitted or leased."""
    engine = ControlledEngine(real_engine)
    settings = make_settings(interactive_max_queued_requests=2, short_request_tokens=4096)
    try:
        with run_server(settings, engine) as s, Background() as bg:
            park_filler(s, engine, bg, {"prompt": "filler", "max_tokens": 8, "ignore_eos": True, "priority": "batch",
                                        "stream": False})  # fmt: skip
            worker = s.runtime.primary.worker
            lane = s.runtime.primary.admission
            one = bg.post("one", f"{s.url}/generate", {"prompt": "one", "max_tokens": 2, "priority": "interactive"})
            wait_until(lambda: s.health()["waiting"]["interactive"] == 1, what="one request queued")
            body = {"model": MODEL, "prompt": [f"p{i}" for i in range(40)], "max_tokens": 4, "ignore_eos": True}
            unit = bg.post("unit", f"{s.url}/v1/completions", body)
            wait_until(lambda: s.health()["waiting"]["interactive"] == 2, what="the unit queued")
            (depth, tokens), = [v for k, v in worker.lane_load().items() if k.label == "interactive"]
            assert depth == 2 and len(lane) == 41  # one request + one unit of 40 engine requests
            assert tokens > 40 * 4
            r = completions(s.url, prompt=[f"q{i}" for i in range(3)], max_tokens=2)
            assert r.status_code == 429 and r.json()["error"]["type"] == "overloaded"
            assert int(r.headers["Retry-After"]) >= 1
            engine.gate.set()
            assert one.result(60).status_code == 200
            done = unit.result(60)
            assert done.status_code == 200 and len(done.json()["choices"]) == 40
            s.wait_idle()
            assert s.runtime.primary.leases == 0 and len(lane) == 0
    finally:
        engine.gate.set()


def test_a_unit_its_lane_can_never_hold_is_400_naming_the_bound(real_engine):
    with run_server(make_settings(interactive_max_queued_tokens=100), real_engine) as s:
        r = completions(s.url, prompt=[f"p{i}" for i in range(40)], max_tokens=4)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == "prompt" and "interactive_max_queued_tokens" in err["message"]
        assert "40 choices" in err["message"]
        r = completions(s.url, prompt="one prompt", n=30, max_tokens=4, temperature=1.0)
        assert r.status_code == 400 and r.json()["error"]["param"] == "n"
        # A single request larger than the bound is still taken by an empty lane.
        r = completions(s.url, prompt="one prompt", max_tokens=120)
        assert r.status_code == 200
        s.wait_idle()
        assert s.runtime.primary.leases == 0 and len(s.runtime.primary.admission) == 0


STEP_S = 0.03  # every step takes at least this long: steps, not HTTP noise, set the times
SEATS = 16


class HeldStream:
    """A streamed request read on a thread until stop(): the client then closes it (the server aborts it)."""

    def __init__(self, url: str, body: dict) -> None:
        self.tokens = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._read, args=(url, body), daemon=True)
        self._thread.start()

    def _read(self, url: str, body: dict) -> None:
        with httpx.Client(timeout=60) as client, client.stream("POST", url, json=body) as r:
            for line in r.iter_lines():
                if line.startswith("data:"):
                    self.tokens += 1
                if self._stop.is_set():
                    return

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)


def test_one_requests_n_cannot_take_every_seat(engine_with):
    """n=64 in the interactive lane on 16 seats: its first 16 // 4 choices run at the lane's priority, the
    rest a level lower, so another client's 4-token request takes a seat at once instead of queueing behind
    60 of its choices (before: every seat, and the other request waited for several waves of them)."""
    engine = ControlledEngine(engine_with(max_num_seqs=SEATS), step_delay_s=STEP_S)
    assert seat_share(SEATS) == 4
    with run_server(make_settings(max_num_seqs=SEATS), engine) as s:
        idle = statistics.median(ttft(s.url, f"idle {i}") for i in range(3))
        big = HeldStream(f"{s.url}/v1/completions", {"model": MODEL, "prompt": "many samples", "n": 64,
                                                      "max_tokens": 200, "temperature": 1.0, "ignore_eos": True,
                                                      "stream": True, "priority": "interactive"})  # fmt: skip
        try:
            wait_until(lambda: (h := s.health())["running"] == SEATS and h["engine_waiting"] >= 40, what="n=64 runs")
            busy = [ttft(s.url, f"other client {i}") for i in range(4)]
            assert big.tokens > 0 and s.health()["engine_waiting"] > 0  # the n=64 request still fills the seats
        finally:
            big.stop()
        # As in test_priority_e2e: one step behind its idle time at most, with room for a noisy machine.
        assert statistics.median(busy) <= 3 * idle + STEP_S, (idle, busy)
        assert max(busy) < 1.0, (idle, busy)
        print(f"TTFT idle {idle * 1000:.0f} ms, beside n=64 {[round(b * 1000) for b in busy]} ms")
        s.wait_idle()
        assert s.runtime.primary.leases == 0


QUEUE_S = 0.5  # the interactive lane's queue deadline in the tests below


def openai_stream(url: str, body: dict) -> list[dict]:
    """The data objects of a streamed /v1/completions answer, [DONE] left out."""
    with httpx.Client(timeout=60) as c, c.stream("POST", f"{url}/v1/completions", json=body) as r:
        assert r.status_code == 200, r.read()
        lines = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def test_choices_cut_by_their_queue_deadline_are_marked_and_the_others_kept(engine_with):
    """One seat, a queue deadline of 0.5 s, four prompts whose first runs over 1 s: the other three end in
    the queue without starting. The answer keeps what ran (before: a 503 for the whole request, the first
    choice's work thrown away) and marks the others: empty, finish_reason `timeout`, the `error` they would
    have been alone; usage counts only the prompt that ran. Streamed, each marked choice ends with its own
    chunk while the first goes on. Only when no choice started is the request the 503 one choice gets."""
    engine = ControlledEngine(engine_with(max_num_seqs=1), step_delay_s=0.05)  # 20 tokens take over 1 s
    settings = make_settings(max_num_seqs=1, interactive_queue_timeout_s=QUEUE_S, warmup=False)
    prompts = [[5, 6, 7], [8, 9, 10, 11], [12, 13], [14]]
    body = {"model": MODEL, "prompt": prompts, "max_tokens": 20, "ignore_eos": True, "priority": "interactive"}
    with run_server(settings, engine) as s:
        r = completions(s.url, **body)
        assert r.status_code == 200, r.text
        first, *cut = r.json()["choices"]
        assert first["finish_reason"] == "length" and first["text"] and "error" not in first, first
        for choice in cut:
            assert choice["finish_reason"] == "timeout" and choice["text"] == "", choice
            assert choice["error"]["type"] == "queue_timeout" and choice["error"]["code"] == 503, choice
        assert r.json()["usage"]["prompt_tokens"] == 3 and r.json()["usage"]["completion_tokens"] == 20

        chunks = openai_stream(s.url, {**body, "stream": True, "stream_options": {"include_usage": True}})
        ends = {c["index"]: c for chunk in chunks for c in chunk["choices"] if c["finish_reason"] is not None}
        assert ends[0]["finish_reason"] == "length" and "error" not in ends[0]
        assert all(ends[i]["finish_reason"] == "timeout" and ends[i]["error"]["type"] == "queue_timeout"
                   for i in (1, 2, 3)), ends  # fmt: skip
        order = [c["index"] for chunk in chunks for c in chunk["choices"] if c["finish_reason"] is not None]
        assert order[-1] == 0  # the marked ones ended first; the stream went on with choice 0
        assert "".join(c["text"] for chunk in chunks for c in chunk["choices"] if c["index"] == 0)
        assert chunks[-1]["usage"]["prompt_tokens"] == 3 and chunks[-1]["usage"]["completion_tokens"] == 20

        with Background() as bg:  # a blocker holds the seat past the deadline: no choice of the next starts
            blocker = bg.post("blocker", f"{s.url}/generate", {"prompt": "x", "max_tokens": 400, "ignore_eos": True,
                                                               "stream": False, "priority": "interactive",
                                                               "timeout_s": 2 * QUEUE_S + 0.5})  # fmt: skip
            wait_until(lambda: s.health()["running"] == 1, what="blocker running")
            r = completions(s.url, **{**body, "prompt": prompts[:2]})
            assert r.status_code == 503 and r.json()["error"]["type"] == "queue_timeout", r.text
            assert blocker.result(timeout=60).json()["finish_reason"] == "timeout"
        s.wait_idle()
