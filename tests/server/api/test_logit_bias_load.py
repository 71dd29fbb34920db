"""A full-vocabulary logit_bias costs no Python work per step, through the real HTTP stack: with n=8 rows
carrying a bias on every one of 49,152 tokens (SmolLM2's vocabulary width, on tiny-llama-wide: tiny
compute, so per-step overhead shows), another client's time per output token stays within 1.2x of its
TPOT beside the same n=8 load without the bias (medians of runs taken alternately, in the same test).
Before, the bias tensors were rebuilt from Python lists for every row of every step: several times the
other client's TPOT."""

from __future__ import annotations

import statistics
import time

import httpx
import pytest
from httpx_sse import connect_sse

from ..helpers import build_real_engine, make_settings, run_server, wait_until
from ..serving.test_choice_units import HeldStream

RUNS = 3  # alternate pairs (plain load, biased load)
TOKENS = 64  # the other client's tokens per run
VOCAB = 49152


def tpot(url: str) -> float:
    """The other client's seconds per output token (first to last token event of a stream)."""
    body = {"prompt": "Write a long story about the sea.", "max_tokens": TOKENS, "ignore_eos": True, "temperature": 0,
            "priority": "interactive"}  # fmt: skip
    times = []
    with httpx.Client(timeout=60) as client, connect_sse(client, "POST", f"{url}/generate", json=body) as src:
        for event in src.iter_sse():
            if event.event == "token":
                times.append(time.perf_counter())
    assert len(times) == TOKENS
    return (times[-1] - times[0]) / (TOKENS - 1)


def beside_load(srv, vocab: int, biased: bool) -> float:
    """The other client's TPOT while an n=8 request streams (each of its rows biased on every token or not)."""
    body = {"model": "tiny-llama-wide", "prompt": "Count slowly:", "n": 8, "max_tokens": 1000, "temperature": 1.0,
            "seed": 3, "ignore_eos": True, "stream": True}  # fmt: skip
    if biased:  # small biases on every token: the draws stay reasonable, the work is the full vocabulary's
        body["logit_bias"] = {str(t): (t % 7 - 3) / 10 for t in range(vocab)}
    load = HeldStream(f"{srv.url}/v1/completions", body)
    try:
        wait_until(lambda: srv.health()["running"] == 8 and load.tokens >= 8, 60, what="the n=8 load runs")
        return tpot(srv.url)
    finally:
        load.stop()
        srv.wait_idle(60)


@pytest.fixture(scope="module")
def wide_engine():
    from engine.testing.make_model import ensure_model

    return build_real_engine(str(ensure_model("tiny-llama-wide")))


def test_another_clients_tpot_under_a_full_vocabulary_bias_on_n8(wide_engine):
    vocab = wide_engine.vocab_size
    assert vocab == VOCAB
    with run_server(make_settings(served_model_name="tiny-llama-wide"), wide_engine) as srv:
        tpot(srv.url)  # warm
        plain, biased = [], []
        for _ in range(RUNS):
            plain.append(beside_load(srv, vocab, biased=False))
            biased.append(beside_load(srv, vocab, biased=True))
    ratio = statistics.median(biased) / statistics.median(plain)
    print(f"TPOT beside n=8: plain {[round(t * 1000) for t in plain]} ms, full-vocabulary bias "
          f"{[round(t * 1000) for t in biased]} ms; ratio of medians {ratio:.2f}")  # fmt: skip
    assert ratio <= 1.2, (plain, biased)
