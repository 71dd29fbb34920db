"""Structured outputs over HTTP: the openai SDK's `.parse()` with a pydantic model and every request
field that asks for a grammar (response_format, structured_outputs, guided_*) against the real
SmolLM2 (its tokenizer and template); 400s naming the field for grammars that do not compile, in time
or at all; the response cache keyed by the grammar; 32 mixed requests through the server in one engine
batch (tiny seeded model); LangChain's `with_structured_output`."""

from __future__ import annotations

import json
import re
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import jsonschema
import pytest
from pydantic import BaseModel, Field

from engine.structured import GrammarSpec
from server.prompt.structured import StructuredFields, requested_grammar

from ..fake_engine import FakeEngine
from ..helpers import ControlledEngine, make_settings, run_server, wait_until

NAME = "smollm2"
CITY_SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 40}, "population": {"type": "integer", "minimum": 0, "maximum": 100000000}},
    "required": ["city", "population"],
    "additionalProperties": False,
}


class Person(BaseModel):
    name: str = Field(max_length=40)
    age: int = Field(ge=0, le=150)


def _chat(smollm2_server, content: str, max_tokens: int = 80, **extra: Any) -> httpx.Response:
    body = {"model": NAME, "messages": [{"role": "user", "content": content}], "temperature": 0,
            "max_tokens": max_tokens, **extra}  # fmt: skip
    return httpx.post(f"{smollm2_server.url}/v1/chat/completions", json=body, timeout=120)


def test_parse_with_a_pydantic_model_validates(smollm2_client):
    done = smollm2_client.chat.completions.parse(
        model=NAME, messages=[{"role": "user", "content": "Invent a person with a name and an age."}],
        response_format=Person, temperature=0, max_tokens=80,
    )
    choice = done.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, Person)
    assert Person.model_validate_json(choice.message.content) == choice.message.parsed


def test_sampled_outputs_validate_too(smollm2_client):
    for seed in range(3):
        done = smollm2_client.chat.completions.parse(
            model=NAME, messages=[{"role": "user", "content": "Describe a city."}],
            response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": CITY_SCHEMA,
                                                                    "strict": True}},  # fmt: skip
            temperature=1.0, seed=seed, max_tokens=100,
        )
        assert done.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(done.choices[0].message.content), CITY_SCHEMA)


def _valid_json(schema: dict[str, Any]):
    def check(text: str) -> None:
        jsonschema.validate(json.loads(text), schema)

    return check


def _fullmatch(pattern: str):
    def check(text: str) -> None:
        assert re.fullmatch(pattern, text), text

    return check


def _one_of(options: list[str]):
    def check(text: str) -> None:
        assert text in options, text

    return check


def _json_object(text: str) -> None:
    assert isinstance(json.loads(text), dict), text


EBNF = 'root ::= "The answer is " ("yes" | "no") "."'
CASES = [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "c", "schema": CITY_SCHEMA}}},
     _valid_json(CITY_SCHEMA)),
    ({"response_format": {"type": "json_object"}}, _json_object),
    ({"structured_outputs": {"json": CITY_SCHEMA}}, _valid_json(CITY_SCHEMA)),
    ({"structured_outputs": {"regex": r"[0-9]{3}-[0-9]{4}"}}, _fullmatch(r"[0-9]{3}-[0-9]{4}")),
    ({"structured_outputs": {"choice": ["Paris", "London", "Rome"]}}, _one_of(["Paris", "London", "Rome"])),
    ({"structured_outputs": {"grammar": EBNF}}, _fullmatch(r"The answer is (yes|no)\.")),
    ({"structured_outputs": {"json_object": True}}, _json_object),
    ({"guided_json": CITY_SCHEMA}, _valid_json(CITY_SCHEMA)),
    ({"guided_json": json.dumps(CITY_SCHEMA)}, _valid_json(CITY_SCHEMA)),
    ({"guided_regex": r"(cat|dog)s? [a-z]{2,8}"}, _fullmatch(r"(cat|dog)s? [a-z]{2,8}")),
    ({"guided_choice": ["positive", "negative"]}, _one_of(["positive", "negative"])),
    ({"guided_grammar": EBNF}, _fullmatch(r"The answer is (yes|no)\.")),
]  # fmt: skip


@pytest.mark.parametrize("fields, check", CASES, ids=[next(iter(c[0])) + str(i) for i, c in enumerate(CASES)])
def test_every_field_constrains_the_chat_output(smollm2_server, fields, check):
    r = _chat(smollm2_server, "What is the capital of France? Answer briefly.", **fields)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop"
    check(choice["message"]["content"])


def test_completions_and_streams_are_constrained_too(smollm2_server):
    body = {"model": NAME, "prompt": "A phone number:", "max_tokens": 20, "temperature": 0,
            "structured_outputs": {"regex": r"\+33 [0-9]{9}"}}  # fmt: skip
    r = httpx.post(f"{smollm2_server.url}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    assert re.fullmatch(r"\+33 [0-9]{9}", r.json()["choices"][0]["text"])
    text = ""
    stream_body = {"model": NAME, "messages": [{"role": "user", "content": "A city?"}], "temperature": 0,
                   "max_tokens": 80, "stream": True, "guided_json": CITY_SCHEMA}  # fmt: skip
    with httpx.stream("POST", f"{smollm2_server.url}/v1/chat/completions", json=stream_body, timeout=120) as s:
        for line in s.iter_lines():
            if line.startswith("data: {"):
                choice = json.loads(line[6:])["choices"][0]
                text += choice["delta"].get("content") or ""
    jsonschema.validate(json.loads(text), CITY_SCHEMA)


BAD_GRAMMARS = [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objec"}}}},
     "response_format.json_schema.schema"),
    ({"structured_outputs": {"regex": "[a-"}}, "structured_outputs.regex"),
    ({"structured_outputs": {"grammar": "root ::= missing_rule"}}, "structured_outputs.grammar"),
    ({"guided_regex": "(unclosed"}, "guided_regex"),
    ({"guided_grammar": "root ::= "}, "guided_grammar"),
    ({"guided_json": {"type": "string", "minLength": 5, "maxLength": 2}}, "guided_json"),
]  # fmt: skip


@pytest.mark.parametrize("fields, param", BAD_GRAMMARS, ids=[p for _, p in BAD_GRAMMARS])
def test_a_grammar_that_does_not_compile_is_a_400_naming_the_field(smollm2_server, fields, param):
    r = _chat(smollm2_server, "hi", **fields)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and "does not compile" in error["message"], error


BAD_SHAPES = [
    ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"structured_outputs": {"regexp": "a"}}, "structured_outputs.regexp"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_json": "[1, 2]"}, "guided_json"),
    ({"response_format": {"type": "yaml"}}, "response_format.type"),
    ({"response_format": {"type": "json_schema", "json_schema": "nope"}}, "response_format.json_schema"),
    ({"response_format": {"type": "json_object"}, "tools": [{"type": "function", "function": {"name": "f"}}],
      "tool_choice": "required"}, "response_format"),
]  # fmt: skip


@pytest.mark.parametrize("fields, param", BAD_SHAPES, ids=[f"{p}-{i}" for i, (_, p) in enumerate(BAD_SHAPES)])
def test_malformed_structured_fields_are_400s_naming_the_field(smollm2_server, fields, param):
    r = _chat(smollm2_server, "hi", **fields)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()


def test_text_response_format_and_ignored_options_change_nothing(smollm2_server):
    plain = _chat(smollm2_server, "Say hi.", max_tokens=8)
    for extra in ({"response_format": {"type": "text"}}, {"guided_decoding_backend": "xgrammar"}):
        r = _chat(smollm2_server, "Say hi.", max_tokens=8, **extra)
        assert r.status_code == 200 and r.json()["choices"][0]["message"] == plain.json()["choices"][0]["message"]
    so = StructuredFields(structured_outputs={"regex": "a+", "disable_any_whitespace": True})
    found = requested_grammar(so)
    assert found is not None and found.spec == GrammarSpec("regex", "a+")


# -- the tiny seeded model: timeouts, no backend, the response cache, one batch of 32 -------------------------
class SlowCompiler:
    """The real compiler, `delay_s` slower, and not budgeted (the service bounds its wait)."""

    budgeted = False

    def __init__(self, inner: Any, delay_s: float) -> None:
        self.inner, self.delay_s = inner, delay_s
        self.backend = inner.backend
        self._pool = ThreadPoolExecutor(2)

    def compile(self, spec, timeout_s=None):
        time.sleep(self.delay_s)
        return self.inner.compile(spec)

    def submit(self, spec, timeout_s=None):
        return self._pool.submit(self.compile, spec, timeout_s)

    def cached(self, spec):
        return False

    def stats(self):
        return self.inner.stats()


def test_a_compile_past_the_timeout_is_a_400_and_the_server_goes_on(real_engine):
    engine = ControlledEngine(real_engine)
    engine.grammar_compiler = SlowCompiler(real_engine.grammar_compiler, 1.0)
    with run_server(make_settings(structured_compile_timeout_s=0.2), engine) as s:
        body = {"prompt": "x", "max_tokens": 4, "guided_regex": "[a-z]{1,3}"}
        started = time.monotonic()
        r = httpx.post(f"{s.url}/v1/completions", json=body, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == "guided_regex", r.text
        assert "did not compile within 0.2s" in r.json()["error"]["message"]
        assert time.monotonic() - started < 0.9  # answered at the timeout, not when the compile ended
        r = httpx.post(f"{s.url}/v1/completions", json={"prompt": "x", "max_tokens": 4}, timeout=30)
        assert r.status_code == 200, r.text
        s.wait_idle()


def test_without_a_grammar_backend_structured_requests_are_400s():
    with run_server(make_settings(), FakeEngine()) as s:
        r = httpx.post(f"{s.url}/v1/completions", json={"prompt": "x", "guided_choice": ["a", "b"]}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == "guided_choice", r.text
        assert "no grammar backend" in r.json()["error"]["message"]


def test_the_response_cache_keys_by_the_grammar(real_engine):
    with run_server(make_settings(response_cache_bytes=1 << 20), real_engine) as s:
        def ask(regex: str) -> dict[str, Any]:
            body = {"prompt": "item", "max_tokens": 8, "temperature": 0, "guided_regex": regex}
            r = httpx.post(f"{s.url}/v1/completions", json=body, timeout=30)
            assert r.status_code == 200, r.text
            return r.json()

        first = ask("[a-c]{4}")
        other = ask("[x-z]{4}")
        again = ask("[a-c]{4}")
        assert re.fullmatch("[a-c]{4}", first["choices"][0]["text"]) and not first["usage"].get("cached")
        assert re.fullmatch("[x-z]{4}", other["choices"][0]["text"]) and not other["usage"].get("cached")
        assert again["usage"].get("cached") is True and again["choices"][0]["text"] == first["choices"][0]["text"]


class CountingEngine(ControlledEngine):
    """Records the most requests the engine ran in one step."""

    most_running = 0

    def step(self):
        outputs = super().step()
        self.most_running = max(self.most_running, self._inner.stats().running)
        return outputs


def _mixed_body(i: int, kind: str) -> dict[str, Any]:
    body: dict[str, Any] = {"prompt": f"row {i} of the table", "max_tokens": 64 if kind != "none" else 12,
                            "logprobs": 0}  # fmt: skip
    body.update({"temperature": 0} if i % 2 == 0 else {"temperature": 0.9, "seed": 500 + i})
    extra = {"schema": {"guided_json": CITY_SCHEMA}, "regex": {"guided_regex": r"[a-z]{2,6}-[0-9]{1,3}"},
             "choice": {"guided_choice": ["alpha", "beta", "gamma"]}, "none": {}}[kind]  # fmt: skip
    return {**body, **extra}


def _send_batch(s, engine: CountingEngine, bodies: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Send every body while the worker is held, then let it go: they start in one engine step."""
    engine.gate.clear()
    with ThreadPoolExecutor(len(bodies)) as pool:
        futures = [pool.submit(httpx.post, f"{s.url}/v1/completions", json=b, timeout=120) for b in bodies]
        wait_until(lambda: s.runtime.open_responses == len(bodies) and engine.waiting_at_gate.is_set(),
                   what="every request admitted")  # fmt: skip
        engine.gate.set()
        answers = [f.result() for f in futures]
    assert all(a.status_code == 200 for a in answers), [a.text for a in answers if a.status_code != 200]
    return [a.json()["choices"][0] for a in answers]


def test_32_mixed_requests_through_the_server_in_one_batch(real_engine):
    engine = CountingEngine(real_engine)
    kinds = ["schema", "regex", "choice", "none"] * 8
    bodies = [_mixed_body(i, kind) for i, kind in enumerate(kinds)]
    with run_server(make_settings(max_num_seqs=64, interactive_max_queued_requests=64), engine) as s:
        # One warm request (also parks nothing): the worker is idle before the batch.
        assert httpx.post(f"{s.url}/v1/completions", json={"prompt": "x", "max_tokens": 1}, timeout=30).status_code == 200
        engine.most_running = 0
        mixed = _send_batch(s, engine, bodies)
        assert engine.most_running == 32
        free = [b for b, kind in zip(bodies, kinds, strict=True) if kind == "none"]
        alone = _send_batch(s, engine, free)
    checks = {"schema": _valid_json(CITY_SCHEMA), "regex": _fullmatch(r"[a-z]{2,6}-[0-9]{1,3}"),
              "choice": _one_of(["alpha", "beta", "gamma"])}  # fmt: skip
    for choice, kind in zip(mixed, kinds, strict=True):
        if kind != "none":
            assert choice["finish_reason"] == "stop", choice
            checks[kind](choice["text"])
    unconstrained = [c for c, kind in zip(mixed, kinds, strict=True) if kind == "none"]
    for got, want in zip(unconstrained, alone, strict=True):
        assert got["logprobs"]["tokens"] == want["logprobs"]["tokens"] and got["text"] == want["text"]


def test_langchain_with_structured_output(smollm2_server):
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(model=NAME, base_url=f"{smollm2_server.url}/v1", api_key="none", temperature=0, max_tokens=80,
                     max_retries=0)  # fmt: skip
    person = llm.with_structured_output(Person).invoke("Invent a person with a name and an age.")
    assert isinstance(person, Person)
    raw = llm.with_structured_output(CITY_SCHEMA | {"title": "City"}, method="json_schema").invoke("A city?")
    jsonschema.validate(raw, CITY_SCHEMA)
