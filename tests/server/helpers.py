"""Server test helpers: an engine wrapper tests can slow down or hold, a real uvicorn server (with the
connection guard, as `tokenmill serve` runs it) on a loopback port in a thread of this process,
polling with a deadline."""

from __future__ import annotations

import contextlib
import resource
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from server.app import create_app
from server.config.settings import ServerSettings
from server.http.connections import ConnectionGuard
from server.http.guarded_server import GuardedServer, guarded_config

HOST = "127.0.0.1"
TEST_MAX_MODEL_LEN = 1024


def metric(text: str, name: str, **labels: str) -> float:
    """Sum of the samples called `name` in a /metrics answer whose labels include `labels` (every series
    also carries `model` and `version`, which a test on one version need not name)."""
    from prometheus_client.parser import text_string_to_metric_families

    want = set(labels.items())
    return sum(s.value for fam in text_string_to_metric_families(text) for s in fam.samples
               if s.name == name and want <= set(s.labels.items()))  # fmt: skip


def wait_until(predicate: Callable[[], Any], timeout: float = 20.0, interval: float = 0.02, what: str = "") -> Any:
    """Poll `predicate` until it returns something truthy; fail the test after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout}s waiting for {what or predicate}")
        time.sleep(interval)


def holders(obj: Any, depth: int = 4, width: int = 6) -> str:
    """Who keeps `obj` alive, as a tree of referrer types `depth` levels up (frames by function and line,
    dicts by their owner when one is found): what a failed "freed by reference count" check prints."""
    import gc
    import sys
    import types

    seen = {id(sys._getframe())}

    def name(ref: Any) -> str:
        if isinstance(ref, types.FrameType):
            return f"frame {ref.f_code.co_name} ({ref.f_code.co_filename}:{ref.f_lineno})"
        if isinstance(ref, dict):
            return f"dict keys={list(ref)[:8]}"
        if isinstance(ref, (list, tuple, set)):
            return f"{type(ref).__name__} of {len(ref)}"
        return type(ref).__qualname__

    def walk(target: Any, level: int, out: list[str]) -> None:
        if level == depth:
            return
        found = gc.get_referrers(target)
        seen.add(id(found))
        refs = [r for r in found if id(r) not in seen]
        seen.add(id(refs))
        for ref in refs[:width]:
            seen.add(id(ref))
            out.append("  " * level + name(ref))
            walk(ref, level + 1, out)
        if len(refs) > width:
            out.append("  " * level + f"... {len(refs) - width} more")

    lines: list[str] = []
    seen.add(id(lines))
    walk(obj, 0, lines)
    return "\n".join(lines) or "no referrers (held by C code)"


class ControlledEngine:
    """Wraps an engine: an optional delay per step, and a gate a test closes to hold the worker
    before its next step. Everything else is the wrapped engine's."""

    def __init__(self, inner: Any, step_delay_s: float = 0.0) -> None:
        self._inner = inner
        self.step_delay_s = step_delay_s
        self.gate = threading.Event()
        self.gate.set()
        self.waiting_at_gate = threading.Event()
        self._close_after: int | None = None  # steps until the gate closes by itself

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def close_gate_after(self, steps: int) -> None:
        self._close_after = steps

    def step(self):
        if not self.gate.is_set():
            self.waiting_at_gate.set()
            self.gate.wait(timeout=60)
            self.waiting_at_gate.clear()
        if self.step_delay_s:
            time.sleep(self.step_delay_s)
        outputs = self._inner.step()
        if self._close_after is not None:
            self._close_after -= 1
            if self._close_after <= 0:
                self._close_after = None
                self.gate.clear()
        return outputs


def park_filler(srv: RunningServer, engine: ControlledEngine, bg: Background, body: dict[str, Any]):
    """Send `body` (more than one output token) to an idle server, let its first step run, then hold the
    worker before the next one: the filler has started, and whatever is sent afterwards stays admitted
    but unscheduled (counted in its lane) until `engine.gate.set()`. Returns the filler's future."""
    engine.close_gate_after(1)
    filler = bg.post("filler", f"{srv.url}/generate", body)
    wait_until(engine.waiting_at_gate.is_set, what="worker held at the gate")
    return filler


class RunningServer:
    """A uvicorn server in a thread; `url` is its base URL, `app` the FastAPI app."""

    def __init__(self, app, sock: socket.socket, settings: ServerSettings) -> None:
        self.app = app
        self.port = sock.getsockname()[1]
        self.url = f"http://{HOST}:{self.port}"
        # The connection guard as `tokenmill serve` runs it; the cap from the settings (or this process's limit).
        self.guard = ConnectionGuard(settings.connection_limits(resource.getrlimit(resource.RLIMIT_NOFILE)[0]))
        config = guarded_config(app, self.guard, settings.keep_alive_timeout_s, log_level="warning")
        self.server = GuardedServer(config, app, self.guard)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)

    @property
    def runtime(self):
        return self.app.state.runtime

    def health(self) -> dict[str, Any]:
        return httpx.get(f"{self.url}/health", timeout=10).json()

    def wait_idle(self, timeout: float = 20.0) -> dict[str, Any]:
        """Wait until nothing is queued or running and no KV block is held; returns /health."""

        def idle() -> dict[str, Any] | None:
            h = self.health()
            quiet = h["in_flight"] == 0 and h["running"] == 0 and h["kv_blocks_used"] == 0
            return h if quiet and self.runtime.open_responses == 0 else None

        return wait_until(idle, timeout, what="server idle")


@contextlib.contextmanager
def run_server(settings: ServerSettings, engine: Any, wait_ready: bool = True,
               loader: Any = None, startup_s: float = 30.0) -> Iterator[RunningServer]:  # fmt: skip
    """Start `create_app(settings, engine, loader)` on a free loopback port; stop it (and its workers) on
    exit. `engine` None: the settings' models are loaded. `startup_s`: the wait for uvicorn's start-up
    (a 262k-token vocabulary takes longer on a busy machine)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((HOST, 0))
    srv = RunningServer(create_app(settings, engine=engine, loader=loader), sock, settings)
    srv.thread.start()
    try:
        wait_until(lambda: srv.server.started or not srv.thread.is_alive(), startup_s, what="uvicorn startup")
        if not srv.server.started:
            pytest.fail("server did not start")
        if wait_ready:
            wait_until(lambda: _ready(srv.url), 60, what="/health 200")
        yield srv
    finally:
        srv.server.should_exit = True
        srv.thread.join(30)
        sock.close()
        release = getattr(engine, "release_thread", None)
        if release is not None:
            release()  # a fake engine may be reused by the next server's worker


def _ready(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def make_settings(**overrides: Any) -> ServerSettings:
    """Test settings: small bounds, fast pings; `overrides` win."""
    base: dict[str, Any] = {"max_num_seqs": 16, "max_model_len": TEST_MAX_MODEL_LEN, "sse_ping_s": 2.0}
    return ServerSettings(**{**base, **overrides})


def build_real_engine(path: str, **config: Any):
    from engine import Engine, EngineConfig

    cfg = {"dtype": "float32", "device": "cpu", "kv_cache_memory": 32 << 20, "max_num_seqs": 64,
           "max_model_len": TEST_MAX_MODEL_LEN, "show_progress": False, **config}
    return Engine(EngineConfig(model=path, **cfg))


class Background:
    """Requests sent from a thread pool, so a test can go on while they wait."""

    def __init__(self, max_workers: int = 32) -> None:
        from concurrent.futures import ThreadPoolExecutor

        self._pool = ThreadPoolExecutor(max_workers=max_workers)

    def post(self, tag: str, url: str, body: dict[str, Any], timeout: float = 60.0):
        return self._pool.submit(httpx.post, url, json=body, timeout=timeout)

    def submit(self, fn: Callable[..., Any], *args: Any):
        """Run fn(*args) in the pool; its future."""
        return self._pool.submit(fn, *args)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> Background:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
