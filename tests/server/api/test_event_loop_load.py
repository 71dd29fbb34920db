"""Heavy answers do not hold the event loop, through the real HTTP stack (tiny model): echo with prompt
log-probabilities (n=8, a ~2,000-token prompt, logprobs 20: 8 x 2,000 x 21 token texts and ~8 MB of
JSON) is laid out and serialized off the loop, token texts come from a table built once per tokenizer,
so /health, probed from a thread all along, answers within 100 ms at p99. Before: one decode per
entry and per alternative on the loop, and /health waited seconds."""

from __future__ import annotations

import json
import statistics
import threading
import time

import httpx
import pytest

from ..helpers import make_settings, run_server

MODEL = "tiny-llama"
CONTEXT = 2048
PROBE_EVERY_S = 0.01


@pytest.fixture(scope="module")
def srv(engine_with):
    engine = engine_with(max_model_len=CONTEXT, kv_cache_memory=64 << 20)
    with run_server(make_settings(max_model_len=CONTEXT), engine) as s:
        yield s


class Prober:
    """GET /health in a loop on its own thread (one keep-alive connection); latencies in seconds."""

    def __init__(self, url: str) -> None:
        self.latencies: list[float] = []
        self.failures = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(url,), daemon=True)

    def _run(self, url: str) -> None:
        with httpx.Client(timeout=10) as client:
            while not self._stop.is_set():
                start = time.perf_counter()
                try:
                    ok = client.get(f"{url}/health").status_code == 200
                except httpx.HTTPError:
                    ok = False
                self.latencies.append(time.perf_counter() - start)
                self.failures += not ok
                time.sleep(PROBE_EVERY_S)

    def __enter__(self) -> Prober:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(15)

    def p99(self) -> float:
        return statistics.quantiles(self.latencies, n=100)[98]


def long_prompt(srv) -> list[int]:
    ids = srv.runtime.primary.codec.encode_sync("def fibonacci(n):\n    return n if n < 2 else fib(n - 1)\n" * 200)
    return ids[: CONTEXT - 20]


def test_health_stays_fast_during_echo_with_prompt_logprobs(srv):
    prompt = long_prompt(srv)
    assert len(prompt) > 1900
    body = {"model": MODEL, "prompt": prompt, "n": 8, "echo": True, "logprobs": 20, "max_tokens": 2,
            "temperature": 1.0, "seed": 1, "ignore_eos": True}  # fmt: skip
    raw: dict[str, bytes] = {}

    def load() -> None:
        # Only the bytes here: parsing ~8 MB in this process would hold the GIL the probe shares.
        with httpx.Client(timeout=60) as client:
            raw["json"] = client.post(f"{srv.url}/v1/completions", json=body).content
            with client.stream("POST", f"{srv.url}/v1/completions", json={**body, "stream": True}) as r:
                raw["sse"] = r.read()

    loader = threading.Thread(target=load, daemon=True)
    with Prober(srv.url) as probe:
        time.sleep(0.3)
        idle = list(probe.latencies)
        loader.start()
        loader.join(60)
    assert not loader.is_alive() and "sse" in raw
    during = probe.latencies[len(idle):]
    print(f"/health idle median {statistics.median(idle) * 1000:.1f} ms; under load p99 {probe.p99() * 1000:.1f} ms, "
          f"max {max(during) * 1000:.1f} ms over {len(during)} probes")  # fmt: skip
    assert probe.failures == 0 and len(during) >= 20
    assert statistics.quantiles(during, n=100)[98] < 0.1, sorted(during)[-5:]
    # The answers are whole and right: every choice echoes the prompt's 2,000 entries with top-20 each.
    answer = json.loads(raw["json"])
    assert len(answer["choices"]) == 8
    for choice in answer["choices"]:
        lp = choice["logprobs"]
        assert len(lp["tokens"]) == len(prompt) + 2 and lp["token_logprobs"][0] is None
        tops = lp["top_logprobs"][1:]  # up to 20 texts each (two ids may decode to one text: one key)
        assert all(1 <= len(top) <= 20 for top in tops) and sum(map(len, tops)) > 10 * len(tops)
    codec = srv.runtime.primary.codec
    assert lp["tokens"][: len(prompt)] == [codec.decode([t]) for t in prompt]
    chunks = [json.loads(line[5:]) for line in raw["sse"].decode().splitlines()
              if line.startswith("data:") and line != "data: [DONE]"]  # fmt: skip
    echoed = [c for c in chunks if c["choices"] and c["choices"][0]["logprobs"]
              and len(c["choices"][0]["logprobs"]["tokens"]) >= len(prompt)]  # fmt: skip
    assert sorted(c["choices"][0]["index"] for c in echoed) == list(range(8))
    assert echoed[0]["choices"][0]["logprobs"]["tokens"][: len(prompt)] == lp["tokens"][: len(prompt)]


def test_pieces_serialize_exactly_as_one_dumps():
    from server.api.respond import json_text, render_json

    body = {"id": "x", "choices": [{"index": i, "text": "é\"\n", "logprobs": {
        "tokens": [str(j) for j in range(700)], "top_logprobs": [{"a": 1.5, "b": None}] * 600, "empty": [],
        "nested": [[1, [2, {"k": [3] * 300}]]]}} for i in range(3)], "usage": {"total": 1}, "list": [1, 2]}  # fmt: skip
    want = json.dumps(body, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    assert render_json(lambda: body) == want.encode()
    nans = {"a": [float("nan")] * 300}
    assert json_text(nans, allow_nan=True) == json.dumps(nans, ensure_ascii=False, separators=(",", ":"))
    with pytest.raises(ValueError):
        render_json(lambda: nans)


def test_the_token_text_table_is_every_single_decode(srv):
    codec = srv.runtime.primary.codec
    table = codec.token_texts()
    assert len(table) == len(codec.tokenizer)
    assert table == [codec.tokenizer.decode([i]) for i in range(len(table))]
    assert codec.token_text(len(table) + 5) == codec.tokenizer.decode([len(table) + 5])  # past the table
