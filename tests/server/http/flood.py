"""A connection flood against a running server, as issue 45 probed it: idle connections, slowloris
ones (a header byte every 0.5 s) and partial bodies, all opened at once, while a normal client asks
/health and a short /generate every 0.1 s and the server's open files are counted every few ms.

Used by tests/server/http/test_connections.py, and by hand against a real `tokenmill serve`:

    prlimit --nofile=1024:1024 tokenmill serve --model models/tiny-llama --port 8011 &
    python -m tests.server.http.flood --url http://127.0.0.1:8011 --pid $! --idle 1200 --slowloris 300 --partial 100

prints one JSON line: open files before, at most and after the flood, the probes' latencies and statuses.
"""

from __future__ import annotations

import argparse
import json
import os
import selectors
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import httpx

ROOT = Path(__file__).resolve().parents[3]
SLOWLORIS_HEAD = b"POST /generate HTTP/1.1\r\nHost: t\r\n"
PARTIAL_BODY = (b"POST /generate HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                b"Content-Length: 1000\r\n\r\n{\"prompt\": ")  # fmt: skip


def open_files(pid: int) -> int:
    """The process's open files right now."""
    return len(os.listdir(f"/proc/{pid}/fd"))


class FdSampler(threading.Thread):
    """Counts `pid`'s open files every `interval_s`; `peak` is the most seen."""

    def __init__(self, pid: int, interval_s: float = 0.003) -> None:
        super().__init__(daemon=True)
        self.pid, self.interval_s = pid, interval_s
        self.peak = open_files(pid)
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                self.peak = max(self.peak, open_files(self.pid))
            except OSError:
                return  # the process ended
            self.stop.wait(self.interval_s)


class Prober(threading.Thread):
    """A normal client: a fresh connection every `every_s`, alternately /health and a 4-token /generate."""

    def __init__(self, url: str, every_s: float = 0.1) -> None:
        super().__init__(daemon=True)
        self.url, self.every_s = url, every_s
        self.stop = threading.Event()
        self.results: list[tuple[str, int | str, float]] = []  # (what, status or error, seconds)

    def run(self) -> None:
        body = {"prompt": "hi", "max_tokens": 4, "stream": False}
        i = 0
        while not self.stop.is_set():
            what = "generate" if i % 2 else "health"
            start = time.monotonic()
            try:
                if what == "health":
                    status: int | str = httpx.get(f"{self.url}/health", timeout=10).status_code
                else:
                    status = httpx.post(f"{self.url}/generate", json=body, timeout=10).status_code
            except httpx.HTTPError as exc:
                status = type(exc).__name__
            self.results.append((what, status, time.monotonic() - start))
            i += 1
            self.stop.wait(self.every_s)


class ProbeProcess:
    """The Prober in a process of its own: in the flooding process it would share the GIL with the
    attackers' loop, and its latencies would be the client's as much as the server's."""

    def __init__(self, url: str) -> None:
        cmd = [sys.executable, "-m", "tests.server.http.flood", "probe", "--url", url]
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None and self.proc.stdout.readline().strip() == "probing"

    def results(self) -> list[tuple[str, int | str, float]]:
        """Stop it (its stdin closes) and return what it saw."""
        out, _ = self.proc.communicate(timeout=60)
        return [tuple(r) for r in json.loads(out)]  # type: ignore[misc]


def _probe_until_stdin_closes(url: str) -> None:
    prober = Prober(url)
    prober.start()
    print("probing", flush=True)
    sys.stdin.read()
    prober.stop.set()
    prober.join(30)
    print(json.dumps(prober.results))


@dataclass
class Attackers:
    """Connections that open and stall: `closed_at[i]` when the server closed socket i, `first[i]` the
    first bytes it sent; slowloris sockets get one more header byte every 0.5 s (`watch`)."""

    host: str
    port: int
    socks: list[socket.socket] = field(default_factory=list)
    kinds: list[str] = field(default_factory=list)
    started: list[float] = field(default_factory=list)  # when the phase that times out began
    closed_at: dict[int, float] = field(default_factory=dict)
    first: dict[int, bytes] = field(default_factory=dict)

    def open(self, kind: str, count: int) -> None:
        for _ in range(count):
            sock = socket.create_connection((self.host, self.port), timeout=10)
            sock.setblocking(False)
            if kind == "slowloris":
                sock.send(SLOWLORIS_HEAD)
            elif kind == "partial_body":
                sock.send(PARTIAL_BODY)
            self.socks.append(sock)
            self.kinds.append(kind)
            self.started.append(time.monotonic())

    def watch(self, seconds: float) -> None:
        """Read what the server sends and note when it closes each socket, for `seconds` or until all closed."""
        sel = selectors.DefaultSelector()
        for i, sock in enumerate(self.socks):
            sel.register(sock, selectors.EVENT_READ, i)
        end, next_trickle = time.monotonic() + seconds, time.monotonic() + 0.5
        while time.monotonic() < end and len(self.closed_at) < len(self.socks):
            for key, _ in sel.select(timeout=0.05):
                i = key.data
                try:
                    data = key.fileobj.recv(4096)  # type: ignore[union-attr]
                except (ConnectionResetError, BlockingIOError):
                    data = b""
                if data:
                    self.first.setdefault(i, data)
                    continue
                self.closed_at[i] = time.monotonic()
                sel.unregister(key.fileobj)
            if time.monotonic() >= next_trickle:
                next_trickle += 0.5
                for i, sock in enumerate(self.socks):
                    if self.kinds[i] == "slowloris" and i not in self.closed_at:
                        try:
                            sock.send(b"X")
                        except OSError:
                            pass
        sel.close()

    def close(self) -> None:
        for sock in self.socks:
            sock.close()


def flood(url: str, pid: int, idle: int, slowloris: int, partial: int, seconds: float,
          attackers: Attackers | None = None) -> dict:  # fmt: skip
    """Open the flood, keep it up for `seconds` (or until the server closed it all), close what is left,
    and report: open files before and at most, what the normal client saw (`probes`: what, status,
    seconds). `attackers`: kept open and not closed here when given (the caller looks at them)."""
    parts = urlsplit(url)
    before = open_files(pid)
    sampler, prober = FdSampler(pid), ProbeProcess(url)
    mine = attackers is None
    attackers = attackers or Attackers(parts.hostname or "127.0.0.1", parts.port or 80)
    sampler.start()
    try:
        time.sleep(0.3)
        attackers.open("idle", idle)
        attackers.open("slowloris", slowloris)
        attackers.open("partial_body", partial)
        attackers.watch(seconds)
        time.sleep(0.3)
    finally:
        if mine:
            attackers.close()
        probes = prober.results()
        sampler.stop.set()
        sampler.join(5)
    health = [r[2] for r in probes if r[0] == "health"]
    generate = [r[2] for r in probes if r[0] == "generate"]
    return {"open_files_before": before, "open_files_max": sampler.peak, "connections": len(attackers.socks),
            "closed_by_server": len(attackers.closed_at), "health_max_s": round(max(health, default=0), 3),
            "generate_max_s": round(max(generate, default=0), 3), "probes_failed": [r for r in probes if r[1] != 200],
            "probes": probes}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", nargs="?", choices=("flood", "probe"), default="flood",
                        help="probe: only the normal client, until stdin closes (what `flood` runs beside it)")
    parser.add_argument("--url", required=True)
    parser.add_argument("--pid", type=int, help="the server's process (its open files are counted)")
    parser.add_argument("--idle", type=int, default=1200)
    parser.add_argument("--slowloris", type=int, default=300)
    parser.add_argument("--partial", type=int, default=100)
    parser.add_argument("--seconds", type=float, default=15.0, help="how long the flood is held at most")
    args = parser.parse_args()
    if args.mode == "probe":
        _probe_until_stdin_closes(args.url)
        return
    report = flood(args.url, args.pid, args.idle, args.slowloris, args.partial, args.seconds)
    time.sleep(1.0)
    report["open_files_after"] = open_files(args.pid)
    report["probes"] = len(report["probes"])
    print(json.dumps(report))


if __name__ == "__main__":
    main()
