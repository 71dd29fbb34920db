"""Servers as processes for the benchmarks: `python -m server` on a loopback port, and the one loop that
waits for a process's readiness URL (/health for tokenmill, /readiness for vllm-router).

Every benchmark that starts a server (sweep, swap, contention, priority's tests, startup, the fleet's
replicas and router) goes through `wait_ready`, so "ready" means the same thing everywhere: the URL
answered 200 while the process was still alive.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path

import httpx

REPO_ROOT = Path(__file__).resolve().parents[2]


class NotReady(RuntimeError):
    """The process exited, or its URL did not answer 200 in time; the message says which."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(proc: subprocess.Popen, url: str, timeout_s: float, path: str = "/health",
               interval_s: float = 0.5) -> float:  # fmt: skip
    """Poll `url + path` until it answers 200; returns the seconds waited. Raises NotReady when `proc`
    exits first or `timeout_s` passes (the caller decides whether to kill it and what log to quote).
    `interval_s` is the timing resolution: start-up measurements poll faster than a launcher needs."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if proc.poll() is not None:
            raise NotReady(f"exited with {proc.returncode} before {path} was 200")
        try:
            if httpx.get(f"{url}{path}", timeout=5).status_code == 200:
                return time.monotonic() - t0
        except httpx.HTTPError:
            pass
        time.sleep(interval_s)
    raise NotReady(f"{path} not 200 after {timeout_s:.0f} s")


def checkout_env(env_changes: Mapping[str, str | None] | None = None) -> dict[str, str]:
    """This process's environment with this checkout first on PYTHONPATH (the server measured is the
    code beside the bench, installed or not), then `env_changes` applied (None: removed)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))}
    for key, value in (env_changes or {}).items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    return env


@contextmanager
def server_command(args: Sequence[str], port: int, log_path: Path, ready_timeout_s: float = 600.0,
                   env_changes: Mapping[str, str | None] | None = None) -> Iterator[tuple[str, int]]:  # fmt: skip
    """`python -m server ARGS` on 127.0.0.1:port (this checkout first on PYTHONPATH, output to
    log_path); yields (URL, pid) once /health is 200; SIGTERM on exit, a kill after 60 s.
    `env_changes`: variables set for the server (None: removed from its environment)."""
    cmd = [sys.executable, "-m", "server", "--host", "127.0.0.1", "--port", str(port), *args]
    url = f"http://127.0.0.1:{port}"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=checkout_env(env_changes), stdout=log,
                                stderr=subprocess.STDOUT)  # fmt: skip
        try:
            try:
                wait_ready(proc, url, ready_timeout_s)
            except NotReady as exc:
                raise RuntimeError(f"server {exc} ({log_path})") from None
            yield url, proc.pid
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@contextmanager
def server_process(model: Path, port: int, max_num_seqs: int, dtype: str, extra: Sequence[str],
                   log_path: Path, ready_timeout_s: float = 600.0) -> Iterator[str]:
    """Start `python -m server` on 127.0.0.1:port and yield its URL once /health is 200; SIGTERM on exit."""
    cmd = ["--model", str(model), "--max-num-seqs", str(max_num_seqs), "--dtype", dtype, *extra]
    with server_command(cmd, port, log_path, ready_timeout_s) as (url, _pid):
        yield url
