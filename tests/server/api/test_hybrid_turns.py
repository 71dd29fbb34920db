"""A hybrid model's chat over HTTP (tiny-lfm2, state checkpoints: docs/ENGINE.md "State checkpoints"):
turn 2 resumes from a checkpoint of turn 1, reported as usage.prompt_tokens_details.cached_tokens, and
answers exactly what a server without checkpoints answers (which recomputes the whole conversation)."""

from __future__ import annotations

import httpx

from ..helpers import build_real_engine, make_settings, run_server

NAME = "tiny-lfm2"
QUESTION = ("Here is a long description of a small program that reads lines from a file, splits each line "
            "into words, counts how often every word occurs and prints the ten most common words with their "
            "counts, sorted by count and then alphabetically. ") * 3  # fmt: skip


def chat_two_turns(url: str) -> tuple[dict, dict]:
    def post(messages: list[dict]) -> dict:
        body = {"model": NAME, "messages": messages, "max_tokens": 16, "temperature": 0.0, "cache": False}
        r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()

    first = post([{"role": "user", "content": QUESTION}])
    answer = first["choices"][0]["message"]["content"]
    second = post([{"role": "user", "content": QUESTION}, {"role": "assistant", "content": answer},
                   {"role": "user", "content": "Now do the same for characters."}])  # fmt: skip
    return first, second


def test_turn_two_resumes_from_a_checkpoint_over_http():
    from engine.testing.make_model import ensure_model

    path = str(ensure_model(NAME))
    answers = {}
    for arm, checkpoints in (("on", None), ("off", 0)):
        engine = build_real_engine(path, num_state_checkpoints=checkpoints)
        with run_server(make_settings(served_model_name=NAME), engine) as srv:
            answers[arm] = chat_two_turns(srv.url)
    (first_on, second_on), (first_off, second_off) = answers["on"], answers["off"]
    assert first_on["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    cached = second_on["usage"]["prompt_tokens_details"]["cached_tokens"]
    # at least turn 1's prompt aligned down to a 32-token block (the CPU's block size)
    assert cached >= first_on["usage"]["prompt_tokens"] // 32 * 32 > 0 and cached % 32 == 0
    assert second_off["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert second_on["usage"]["prompt_tokens"] == second_off["usage"]["prompt_tokens"]
    assert first_on["choices"][0]["message"] == first_off["choices"][0]["message"]
    assert second_on["choices"][0]["message"] == second_off["choices"][0]["message"]
