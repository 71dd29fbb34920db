"""`--log-level debug` on the real process never writes prompt or output text (sse-starlette logs each
streamed chunk at debug); with `--log-prompts` it may."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
from httpx_sse import connect_sse

from ..helpers import wait_until
from ..serving.test_shutdown import ROOT, _status, free_port

MARKER = "zebra-quokka-marker"


def run_and_log(tiny_model_path: str, tmp_path: Path, *flags: str) -> tuple[str, str]:
    """Start the server with `flags`, stream one request, stop it. Returns (log text, output text)."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOKENMILL_") or k == "TOKENMILL_MODEL_CACHE"}
    log_path = tmp_path / f"server-{port}.log"
    cmd = [sys.executable, "-m", "server", "--model", tiny_model_path, "--port", str(port), "--device", "cpu",
           "--kv-cache-memory", "64MiB", "--log-level", "debug", *flags]  # fmt: skip
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_until(lambda: _status(f"{url}/health") == 200 or proc.poll() is not None, 120, 0.1, "server ready")
        assert proc.poll() is None, log_path.read_text()
        body = {"prompt": f"# {MARKER}\ndef main():", "max_tokens": 40, "ignore_eos": True}
        text = ""
        with httpx.Client(timeout=60) as client, connect_sse(client, "POST", f"{url}/generate", json=body) as src:
            for event in src.iter_sse():
                if event.event == "token":
                    text += json.loads(event.data)["text"]
        chat = {"messages": [{"role": "user", "content": MARKER}], "max_tokens": 8, "stream": True}
        httpx.post(f"{url}/v1/chat/completions", json=chat, timeout=60).raise_for_status()
    finally:
        proc.terminate()
        proc.wait(30)
    return log_path.read_text(), text


def test_debug_logs_hold_no_prompt_or_output_text(tiny_model_path, tmp_path):
    log, output = run_and_log(tiny_model_path, tmp_path)
    assert " DEBUG " in log  # debug logging is on
    assert MARKER not in log
    assert '"token_id"' not in log and "chat.completion.chunk" not in log  # no streamed chunk
    assert len(output) > 20 and output not in log


def test_log_prompts_lets_the_chunks_through(tiny_model_path, tmp_path):
    log, _ = run_and_log(tiny_model_path, tmp_path, "--log-prompts")
    assert '"token_id"' in log  # the same test above would see a leak
