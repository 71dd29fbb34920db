"""POST /generate answers byte for byte as the route wrote them before every route shared one response
path (server/api/respond.py): SSE events and JSON bodies for the same requests, on a fresh tiny model,
compared with tests/server/api/golden/generate.json, which the pre-refactor code wrote
(`TOKENMILL_WRITE_GOLDEN=1 pytest tests/server/api/test_generate_golden.py` writes it again). Only what
differs from run to run is masked: the timing figures and the model version (a fingerprint of the
folder's files, checked against the header instead) and the log-probability values (their last bits
follow the CPU's kernels and thread count; checked to be finite and <= 0 instead). The engine runs on
one thread so the tokens do not depend on how many cores the machine has."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import httpx
import pytest

from ..helpers import make_settings, run_server

GOLDEN = Path(__file__).parent / "golden" / "generate.json"
PROMPT = "def fibonacci(n):"
REQUESTS = [
    {"prompt": PROMPT, "max_tokens": 8, "ignore_eos": True, "temperature": 0, "request_id": "golden-1"},
    {"prompt": PROMPT, "max_tokens": 6, "ignore_eos": True, "temperature": 0, "logprobs": 2,
     "request_id": "golden-2"},
    {"prompt": "Hello there", "max_tokens": 5, "ignore_eos": True, "temperature": 0, "stream": False,
     "request_id": "golden-3"},
    {"prompt": "Hello there", "max_tokens": 5, "ignore_eos": True, "temperature": 0, "stream": False,
     "logprobs": 1, "request_id": "golden-4"},
    {"prompt_token_ids": [5, 6, 7, 8], "max_tokens": 4, "ignore_eos": True, "temperature": 0,
     "request_id": "golden-5"},
    {"prompt": "x", "max_tokens": 5000, "request_id": "golden-6"},  # 400: over the context
    {"prompt": PROMPT, "max_tokens": 12, "temperature": 0, "stop": ["\n"], "stream": False, "logprobs": 0,
     "request_id": "golden-7"},
]  # fmt: skip

_TIMING = re.compile(r'"timing":\{[^}]*\}')
_VERSION = re.compile(r'"model_version":"[^"]*"')
_LOGPROB = re.compile(r'"logprob":(-?[0-9.e+-]+|-?Infinity|NaN)')


def _masked(text: str) -> str:
    for value in _LOGPROB.findall(text):
        assert float(value) <= 0.0, value
    return _LOGPROB.sub('"logprob":"LP"', _VERSION.sub('"model_version":"V"', _TIMING.sub('"timing":{}', text)))


@pytest.fixture(scope="module")
def answers(engine_with):
    out = []
    with run_server(make_settings(short_request_tokens=64), engine_with(cpu_threads=1)) as srv:
        version = srv.runtime.primary.version
        with httpx.Client(timeout=60) as client:
            for body in REQUESTS:
                r = client.post(f"{srv.url}/generate", json=body)
                if r.status_code == 200:
                    assert r.headers["x-model-version"] == version
                    assert f'"model_version":"{version}"' in r.text
                out.append({"request": body, "status": r.status_code,
                            "content_type": r.headers["content-type"], "body": _masked(r.text)})  # fmt: skip
    return out


def test_generate_answers_are_byte_identical_to_the_golden_file(answers):
    if os.environ.get("TOKENMILL_WRITE_GOLDEN") == "1":
        GOLDEN.parent.mkdir(exist_ok=True)
        GOLDEN.write_text(json.dumps(answers, indent=1, ensure_ascii=False) + "\n")
    golden = json.loads(GOLDEN.read_text())
    assert [a["request"] for a in golden] == REQUESTS, "the golden file is for other requests"
    for got, want in zip(answers, golden, strict=True):
        assert (got["status"], got["content_type"]) == (want["status"], want["content_type"]), got["request"]
        assert got["body"] == want["body"], got["request"]


def test_golden_streams_hold_events():
    """The golden file itself is what a client reads: token events then done, JSON bodies."""
    golden = json.loads(GOLDEN.read_text())
    first = golden[0]["body"]
    assert first.count("event: token\n") == 8 and first.rstrip().split("\n")[-2] == "event: done"
    assert json.loads(golden[2]["body"])["usage"]["completion_tokens"] == 5
    assert golden[5]["status"] == 400
