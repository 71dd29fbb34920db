"""The pieces of make docker-smoke that can be checked without a Docker engine: every script passes
shellcheck, CI runs the smoke after `make test` and fails on its failure, and the HTTP checks it makes
against the container (deploy/docker/smoke_http.py) pass a right answer and fail a wrong one, here
against a stub server. The smoke itself (images built and run) runs in CI: `.ci/run`."""

from __future__ import annotations

import importlib.util
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from .conftest import REPO, find_tool, run

SCRIPTS = sorted((REPO / "deploy" / "docker").glob("*.sh")) + [REPO / ".ci" / "run"]


def load_smoke_http():
    spec = importlib.util.spec_from_file_location("smoke_http", REPO / "deploy" / "docker" / "smoke_http.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_scripts_pass_shellcheck():
    shellcheck = find_tool("shellcheck")
    assert len(SCRIPTS) == 5
    run([shellcheck, *map(str, SCRIPTS)])


def test_ci_runs_the_tests_then_the_smoke_and_fails_on_either():
    ci = "\n".join(line for line in (REPO / ".ci" / "run").read_text().splitlines() if not line.startswith("#"))
    assert ci.index("make test") < ci.index("deploy/docker/dockerd.sh") < ci.index("make docker-smoke")
    assert "[ $tests = 0 ] || status=1" in ci and "[ $smoke = 0 ] || status=1" in ci and ci.rstrip().endswith("exit $status")
    assert "SKIPPED: no Docker engine here: ${reason" in ci  # a skip names its reason
    makefile = (REPO / "Makefile").read_text()
    assert "docker-smoke:\n\tdeploy/docker/smoke.sh\n" in makefile


class Stub(BaseHTTPRequestHandler):
    """A tokenmill stand-in: `answer` is what the chat and /generate say."""

    answer = "The capital of France is Paris."

    def log_message(self, *args):
        pass

    def do_GET(self):
        self.reply(200, "application/json", b'{"status": "ok"}')

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        if self.path == "/v1/chat/completions":
            out = {"choices": [{"message": {"role": "assistant", "content": self.answer}}]}
            return self.reply(200, "application/json", json.dumps(out).encode())
        words = self.answer.split(" ")[: body["max_tokens"]]
        events = [f"event: token\r\ndata: {json.dumps({'index': i, 'text': ' ' + w})}\r\n\r\n" for i, w in enumerate(words)]
        events.append('event: done\r\ndata: {"finish_reason": "length"}\r\n\r\n')
        self.reply(200, "text/event-stream; charset=utf-8", "".join(events).encode())

    def reply(self, status, content_type, data):
        self.send_response(status)
        self.send_header("content-type", content_type)
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@pytest.fixture
def stub():
    server = ThreadingHTTPServer(("127.0.0.1", 0), Stub)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    Stub.answer = "The capital of France is Paris."


def test_smoke_checks_pass_the_right_answers(stub, capsys):
    smoke = load_smoke_http()
    assert smoke.main(["health", stub, "--timeout", "5"]) == 0
    assert smoke.main(["health", stub, "--path", "/readiness", "--timeout", "5"]) == 0
    assert "/readiness: 200" in capsys.readouterr().out
    assert smoke.main(["generate", stub]) == 0
    assert smoke.main(["chat", stub]) == 0
    Stub.answer = " ".join(["word"] * 32)
    assert smoke.main(["stream", stub, "--max-tokens", "32"]) == 0
    assert "stream: 32 tokens, last event done" in capsys.readouterr().out


def test_smoke_checks_fail_the_wrong_ones(stub, capsys):
    smoke = load_smoke_http()
    Stub.answer = "The capital of France is Lyon."
    assert smoke.main(["chat", stub]) == 1
    assert smoke.main(["generate", stub]) == 1
    assert smoke.main(["stream", stub, "--max-tokens", "32"]) == 1  # 6 tokens, not 32: cut off
    assert smoke.main(["health", "http://127.0.0.1:9", "--timeout", "1"]) == 1
    assert smoke.main(["health", "http://127.0.0.1:9", "--path", "/readiness", "--timeout", "1"]) == 1
    out = capsys.readouterr().out
    assert "FAIL: /readiness did not answer 200" in out
    assert "FAIL: the answer 'The capital of France is Lyon.' has no 'Paris'" in out
    assert "FAIL: 6 tokens, wanted 32" in out and "FAIL: /health did not answer 200" in out
