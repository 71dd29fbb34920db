"""Several `tokenmill serve` replicas on loopback behind vllm-router (the `router` extra:
`pip install -e .[router]`), as processes: what `python -m bench router` measures and what
tests/deploy/test_router.py drives.

`Fleet` starts the replicas, waits for each /health, then starts the router with the given policy and
waits for its /readiness; on exit it kills whatever still runs. Every process writes its output to a
log file in `log_dir` (the first lines of a failure's message name it).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from bench.lib.server import REPO_ROOT, NotReady, free_port, wait_ready

POLICIES = ("round_robin", "cache_aware", "kv_aware")


def router_binary() -> str | None:
    """vllm-router's console script: beside this interpreter (a virtual environment's bin), else on PATH."""
    beside = Path(sys.executable).parent / "vllm-router"
    return str(beside) if beside.exists() else shutil.which("vllm-router")


@dataclass
class Process:
    """One started process: its URL, its log, and how to stop it."""

    name: str
    url: str
    proc: subprocess.Popen
    log_path: Path

    def alive(self) -> bool:
        return self.proc.poll() is None

    def signal(self, sig: int) -> None:
        if self.alive():
            self.proc.send_signal(sig)

    def log_tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def stop(self) -> None:
        if self.alive():
            self.proc.kill()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass


@dataclass
class FleetConfig:
    model: str  # what each replica serves (--model)
    replicas: int = 2
    policy: str = "cache_aware"
    replica_args: Sequence[str] = ()  # more `serve` flags, the same for every replica
    router_args: Sequence[str] = ()  # more vllm-router flags
    health_interval_s: int = 1  # the router's health checks: every second, one failure takes a worker out
    ready_timeout_s: float = 300.0
    log_dir: Path = field(default_factory=lambda: Path("."))
    # per replica index: extra flags (e.g. the KV-events endpoint), and the router's flags for it
    per_replica_args: dict[int, Sequence[str]] = field(default_factory=dict)
    kv_event_endpoints: Sequence[str] = ()  # per replica, its KV-events ZMQ endpoint (kv_aware)


class Fleet:
    """Replicas + router; `with Fleet(cfg) as fleet:` gives `fleet.url` (the router) and `fleet.replicas`."""

    def __init__(self, cfg: FleetConfig) -> None:
        if cfg.policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}, not {cfg.policy!r}")
        self.cfg = cfg
        self.replicas: list[Process] = []
        self.router: Process | None = None

    @property
    def url(self) -> str:
        assert self.router is not None
        return self.router.url

    def __enter__(self) -> Fleet:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> None:
        binary = router_binary()
        if binary is None:
            raise RuntimeError("vllm-router is not installed (pip install -e '.[router]')")
        cfg = self.cfg
        cfg.log_dir.mkdir(parents=True, exist_ok=True)
        env = {k: v for k, v in os.environ.items() if not k.startswith("TOKENMILL_") or k == "TOKENMILL_MODEL_CACHE"}
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))
        for i in range(cfg.replicas):
            port = free_port()
            args = [sys.executable, "-m", "server", "--model", cfg.model, "--host", "127.0.0.1",
                    "--port", str(port), *cfg.replica_args, *cfg.per_replica_args.get(i, ())]  # fmt: skip
            self.replicas.append(_spawn(f"replica-{i}", f"http://127.0.0.1:{port}", args, cfg.log_dir, env))
        for replica in self.replicas:
            _wait_status(replica, "/health", cfg.ready_timeout_s)
        port = free_port()
        args = [binary, "--host", "127.0.0.1", "--port", str(port), "--policy", cfg.policy,
                "--worker-urls", *(r.url for r in self.replicas),
                "--health-check-interval-secs", str(cfg.health_interval_s), "--health-failure-threshold", "1",
                "--health-success-threshold", "1", "--health-check-timeout-secs", "2",
                "--worker-startup-check-interval", "1", "--log-level", "warning",
                # its own metrics exporter: a free port, not the default 29000 another router may hold
                "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()), *cfg.router_args]  # fmt: skip
        for replica, endpoint in zip(self.replicas, cfg.kv_event_endpoints, strict=False):
            args += ["--kv-event-source", f"{replica.url}={endpoint}"]
        self.router = _spawn("router", f"http://127.0.0.1:{port}", args, cfg.log_dir, env)
        _wait_status(self.router, "/readiness", 60)

    def close(self) -> None:
        for p in [self.router, *self.replicas]:
            if p is not None:
                p.stop()

    def healthy_workers(self) -> set[str]:
        """The replicas' URLs the router counts healthy now (its /health names the unhealthy ones)."""
        r = httpx.get(f"{self.url}/health", timeout=5)
        bad = {rep.url for rep in self.replicas if rep.url in r.text} if r.status_code != 200 else set()
        return {rep.url for rep in self.replicas} - bad


def _spawn(name: str, url: str, args: list[str], log_dir: Path, env: dict[str, str]) -> Process:
    log_path = log_dir / f"{name}.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(args, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)  # fmt: skip
    return Process(name, url, proc, log_path)


def _wait_status(p: Process, path: str, timeout_s: float) -> None:
    """`wait_ready` on one of the fleet's processes; a process that never got ready is killed, and the
    error quotes its log's tail (which replica or the router, and why)."""
    try:
        wait_ready(p.proc, p.url, timeout_s, path, interval_s=0.2)
    except NotReady as exc:
        p.signal(signal.SIGKILL)
        raise RuntimeError(f"{p.name} {exc} ({p.log_path}):\n{p.log_tail()}") from None
