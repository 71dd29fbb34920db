"""The HTTP half of make docker-smoke (deploy/docker/smoke.sh): what an operator would try against a
running container, in the README's words. Standard library only: it runs on the host, outside any venv.

    python3 deploy/docker/smoke_http.py health   URL [--timeout S] [--path P]  # /health (or P) answers 200
    python3 deploy/docker/smoke_http.py generate URL                 # /generate streams tokens, then done
    python3 deploy/docker/smoke_http.py chat     URL                 # the README's question: "Paris"
    python3 deploy/docker/smoke_http.py stream   URL --max-tokens N  # one stream, its events as they come

Each prints what it saw and exits 1 (with the reason) when the answer is not the expected one.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.error
import urllib.request

CHAT_QUESTION = "What is the capital of France?"
MODEL = "smollm2-135m-instruct"


def post(url: str, body: dict, timeout: float = 120):
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"content-type": "application/json"})
    return urllib.request.urlopen(req, timeout=timeout)


def sse_events(resp):
    """(event, data) pairs of a text/event-stream response, as they arrive."""
    event, data = None, []
    for raw in resp:
        line = raw.decode().rstrip("\r\n")
        if not line:
            if event or data:
                yield event or "message", "\n".join(data)
            event, data = None, []
        elif line.startswith("event:"):
            event = line[6:].strip()
        elif line.startswith("data:"):
            data.append(line[5:].lstrip())


def fail(message: str) -> int:
    print(f"FAIL: {message}", flush=True)
    return 1


def health(base: str, timeout: float, path: str = "/health") -> int:
    deadline, last = time.monotonic() + timeout, "no answer yet"
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(base + path, timeout=5) as resp:
                print(f"{path}: {resp.status} {resp.read().decode()[:200]}")
                return 0
        except (urllib.error.URLError, OSError) as exc:  # starting: refused, reset, or 503
            last = str(exc)
        time.sleep(1)
    return fail(f"{path} did not answer 200 within {timeout:.0f} s (last: {last})")


def generate(base: str) -> int:
    body = {"prompt": "The capital of France is", "max_tokens": 12, "temperature": 0}
    with post(base + "/generate", body) as resp:
        if not resp.headers.get("content-type", "").startswith("text/event-stream"):
            return fail(f"/generate answered {resp.headers.get('content-type')}, not an event stream")
        events = list(sse_events(resp))
    names = [name for name, _ in events]
    text = "".join(json.loads(data)["text"] for name, data in events if name == "token")
    print(f"/generate: {names.count('token')} token events, then {names[-1:]}; text {text!r}")
    if names.count("token") < 1 or names[-1] != "done":
        return fail(f"/generate events were {names}")
    return 0 if "Paris" in text else fail(f"/generate text {text!r} has no 'Paris'")


def chat(base: str) -> int:
    body = {"model": MODEL, "messages": [{"role": "user", "content": CHAT_QUESTION}], "temperature": 0}
    with post(base + "/v1/chat/completions", body) as resp:
        answer = json.load(resp)["choices"][0]["message"]["content"]
    print(f"chat: {CHAT_QUESTION!r} -> {answer!r}")
    return 0 if "Paris" in answer else fail(f"the answer {answer!r} has no 'Paris'")


def stream(base: str, max_tokens: int) -> int:
    """A long generation, its events printed as they come (the smoke stops the container meanwhile)."""
    body = {"prompt": "Write a long story about a lighthouse keeper.", "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True}  # fmt: skip
    tokens, last = 0, None
    with post(base + "/generate", body, timeout=300) as resp:
        for name, data in sse_events(resp):
            tokens += name == "token"
            last = name, data
            if tokens == 1 and name == "token":
                print("first token", flush=True)
    print(f"stream: {tokens} tokens, last event {last[0] if last else None}: {last[1][:200] if last else ''}")
    if last is None or last[0] != "done":
        return fail("the stream did not end with a done event")
    return 0 if tokens == max_tokens else fail(f"{tokens} tokens, wanted {max_tokens}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("check", choices=["health", "generate", "chat", "stream"])
    ap.add_argument("url", help="e.g. http://127.0.0.1:8000")
    ap.add_argument("--timeout", type=float, default=300)
    ap.add_argument("--path", default="/health", help="health: the path that must answer 200")
    ap.add_argument("--max-tokens", type=int, default=96)
    a = ap.parse_args(argv)
    base = a.url.rstrip("/")
    if a.check == "health":
        return health(base, a.timeout, a.path)
    if a.check == "generate":
        return generate(base)
    if a.check == "chat":
        return chat(base)
    return stream(base, a.max_tokens)


if __name__ == "__main__":
    sys.exit(main())
