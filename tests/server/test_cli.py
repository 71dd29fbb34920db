"""`tokenmill serve MODEL` as vLLM users start it: the positional model, vLLM's flags whose meaning we
have (human-readable lengths, vLLM's dtype names), and every other flag named in one line with exit
code 2 before anything loads. One real process serves the tiny model given positionally."""

from __future__ import annotations

import os
import subprocess
import sys

import httpx
import pytest

from server.cli import build_parsers, main, serve_settings

from .helpers import wait_until
from .serving.test_shutdown import ROOT, _status, free_port


def settings(*argv: str):
    _, serve_parser = build_parsers()
    return serve_settings(serve_parser.parse_args(list(argv)))


def test_positional_model_and_vllm_flags(tmp_path):
    template = tmp_path / "t.jinja"
    template.write_text("{{ messages }}")
    s = settings("/models/x", "--served-model-name", "x1", "--max-model-len", "4k", "--gpu-memory-utilization", "0.5",
                 "--max-num-seqs", "8", "--no-enable-prefix-caching", "--chat-template", str(template),
                 "--api-key", "k", "--dtype", "half", "--tokenizer", str(tmp_path))  # fmt: skip
    assert (s.model, s.served_model_name, s.max_model_len, s.gpu_memory_utilization) == ("/models/x", "x1", 4000, 0.5)
    assert (s.max_num_seqs, s.enable_prefix_caching, s.chat_template, s.api_key) == (8, False, str(template), "k")
    assert s.dtype == "float16" and s.tokenizer == str(tmp_path)
    assert settings("--model", "/m", "--max-model-len", "2K").max_model_len == 2048
    assert settings("/m", "--model", "/m").model == "/m"
    with pytest.raises(ValueError, match="given twice"):
        settings("/a", "--model", "/b")
    with pytest.raises(ValueError, match="chat_template"):
        settings("/m", "--chat-template", str(tmp_path / "missing.jinja"))


def test_unsupported_flags_are_named_with_exit_2(capsys):
    code = main(["serve", "--tensor-parallel-size", "2", "/models/x", "--trust-remote-code", "--frobnicate=3",
                 "--seed", "-1"])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2
    assert "vLLM flags without a tokenmill equivalent: --tensor-parallel-size, --trust-remote-code" in err
    assert "unknown flags: --frobnicate" in err and "--seed" not in err
    assert main(["/models/x", "-tp", "2"]) == 2  # `serve` is the default subcommand
    assert "-tp" in capsys.readouterr().err


def test_a_real_process_refuses_an_empty_admin_key(tiny_model_path):
    """`python -m server --admin-api-keys ""` exits 2 before loading anything, naming the setting."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOKENMILL_") or k == "TOKENMILL_MODEL_CACHE"}
    for argv, extra_env in ((["--admin-api-keys", ""], {}), ([], {"TOKENMILL_ADMIN_API_KEYS": ""})):
        cmd = [sys.executable, "-m", "server", "serve", tiny_model_path, "--port", str(free_port()), *argv]
        done = subprocess.run(cmd, cwd=ROOT, env={**env, **extra_env}, capture_output=True, text=True, timeout=120)
        assert done.returncode == 2, done.stdout + done.stderr
        assert "admin_api_keys" in done.stderr and "must not be empty" in done.stderr, done.stderr


def test_a_real_process_serves_the_positional_model(tiny_model_path):
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOKENMILL_") or k == "TOKENMILL_MODEL_CACHE"}
    cmd = [sys.executable, "-m", "server", "serve", tiny_model_path, "--served-model-name", "tiny", "--port",
           str(port), "--max-model-len", "512", "--max-num-seqs", "4", "--kv-cache-memory", "32MiB",
           "--log-level", "warning"]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: _status(f"{url}/health") == 200 or proc.poll() is not None, 120, 0.1, "server ready")
        assert proc.poll() is None, proc.stdout.read()
        card = httpx.get(f"{url}/v1/models/tiny", timeout=10).json()
        assert card["id"] == "tiny" and card["max_model_len"] == 512
    finally:
        proc.terminate()
        proc.wait(30)
