"""Clients that stop reading their stream, on real loopback sockets: each is dropped within
write_timeout_s of its bytes no longer draining (or once its backlog passes its bound), its request
is aborted in the engine (KV freed), it is counted as `slow_client`, memory stays bounded and comes
back, and a normal client streams on unaffected.

A stalled reader is a raw socket with a 4 KiB receive buffer that sends its request and never reads.
The server's SO_SNDBUF is set to 16 KiB so the kernel does not absorb a whole output (loopback
autotuning would take megabytes): its writes stall after ~100 KiB, i.e. ~100 tokens with 20 logprobs.
"""

from __future__ import annotations

import gc
import json
import logging
import re
import socket
import struct
import threading
import time

import httpx
from httpx_sse import connect_sse

from engine.api import RequestOutput

from ..fake_engine import FakeEngine
from ..helpers import HOST, ControlledEngine, make_settings, run_server, wait_until
from ..ops.test_metrics import Scrape

STALLED = 20
WRITE_TIMEOUT_S = 1.5
MAX_TOKENS = 1000  # at STEP_DELAY_S a step, these need >= 20 s: a dropped stream ends far earlier
STEP_DELAY_S = 0.02
STALL_BODY = {"prompt": "def main():", "max_tokens": MAX_TOKENS, "ignore_eos": True, "logprobs": 20}
TCP_CLOSE = 7  # tcpi_state of a socket the peer reset

# The RSS test: the fake engine (no torch: its activations would swamp what the server holds) makes
# ~1000 tokens/s per stream, and nothing stops a stalled stream's queue but stream_max_pending_tokens.
# Per stalled stream the server then holds at most 256 queued events (~0.7 KB each here) plus the
# 64 KiB transport buffer: ~0.25 MB, 5 MB for 20. Measured: +1.5 MB after two warm-up waves (the
# very first wave of a fresh process: +10 MB while the heap grows its pools; once, late in a full
# suite run on a busy machine, +17 MB: the heap the earlier tests left is fragmented). The same 20
# streams without the bound: +38 MB within 5 s, and growing as long as their clients stay.
PENDING_BOUND = 256
RSS_BOUND_MB = 24
RSS_SECOND_WAVE_MB = 4  # a second wave reuses the first one's freed memory


def slow_settings(**overrides):
    base = dict(write_timeout_s=WRITE_TIMEOUT_S, socket_send_buffer_bytes=16384, max_num_seqs=32,
                stream_max_pending_tokens=100000)  # fmt: skip
    return make_settings(**{**base, **overrides})


def open_stalled(port: int, body: dict) -> socket.socket:
    """A client that sends its request and never reads a byte of the answer."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect((HOST, port))
    data = json.dumps(body).encode()
    sock.sendall(b"POST /generate HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(data), data))  # fmt: skip
    return sock


def tcp_state(sock: socket.socket) -> int:
    return struct.unpack("B", sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 8)[:1])[0]


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        return int(f.read().split("VmRSS:")[1].split()[0]) / 1024


def live_outputs() -> int:
    gc.collect()
    return sum(1 for o in gc.get_objects() if type(o) is RequestOutput)


class NormalReader(threading.Thread):
    """A client that reads its stream as it comes; records the longest gap between events."""

    def __init__(self, url: str, max_tokens: int, logprobs: int | None = None) -> None:
        super().__init__(daemon=True)
        self.url, self.max_tokens, self.logprobs = url, max_tokens, logprobs
        self.tokens, self.done, self.max_gap = 0, None, 0.0

    def run(self) -> None:
        body = {"prompt": "def main():", "max_tokens": self.max_tokens, "ignore_eos": True, "logprobs": self.logprobs}
        with httpx.Client(timeout=60) as client, connect_sse(client, "POST", f"{self.url}/generate", json=body) as src:
            last = time.monotonic()
            for event in src.iter_sse():
                now = time.monotonic()
                self.max_gap, last = max(self.max_gap, now - last), now
                if event.event == "token":
                    self.tokens += 1
                elif event.event == "done":
                    self.done = json.loads(event.data)


def slow_client_count(url: str) -> float:
    return Scrape(url).sum("tokenmill_requests_total", reason="slow_client")


def stalled_wave(srv, count: int, body: dict = STALL_BODY) -> tuple[list[socket.socket], float]:
    """Open `count` stalled readers; wait until all are counted as slow clients. Returns the sockets
    and the peak RSS (MB) seen meanwhile."""
    before = slow_client_count(srv.url)
    socks = [open_stalled(srv.port, body) for _ in range(count)]
    peak = rss_mb()

    def all_dropped() -> bool:
        nonlocal peak
        peak = max(peak, rss_mb())
        return slow_client_count(srv.url) - before >= count

    wait_until(all_dropped, 60, 0.1, "every stalled reader dropped")
    return socks, peak


def test_stalled_readers_are_dropped_aborted_and_counted(real_engine, caplog):
    caplog.set_level(logging.INFO, logger="tokenmill.connections")
    caplog.set_level(logging.INFO, logger="tokenmill.requests")
    with run_server(slow_settings(), ControlledEngine(real_engine, STEP_DELAY_S)) as srv:
        socks, _ = stalled_wave(srv, 1)  # warm the paths, so the object count below is a baseline
        srv.wait_idle()
        socks[0].close()
        base_outputs = live_outputs()
        normal = NormalReader(srv.url, 300)
        normal.start()
        socks, _ = stalled_wave(srv, STALLED)

        # Each was dropped by the write timeout, within it (plus one sweep tick) of its last progress.
        stalls = [float(m) for m in re.findall(r"accepted no bytes for ([\d.]+)s", caplog.text)]
        assert len(stalls) >= STALLED
        assert all(WRITE_TIMEOUT_S <= s <= WRITE_TIMEOUT_S + 2 * srv.guard.limits.tick_s for s in stalls), stalls
        # ... aborted in the engine long before their 1000 tokens, and their KV blocks freed.
        lines = [json.loads(r.message) for r in caplog.records if r.name == "tokenmill.requests"]
        dropped = [line for line in lines if line["reason"] == "slow_client"][-STALLED:]
        assert len(dropped) == STALLED and all(d["status"] == "cancelled" for d in dropped)
        assert all(d["completion_tokens"] < MAX_TOKENS / 2 for d in dropped), [d["completion_tokens"] for d in dropped]
        normal.join(60)
        health = srv.wait_idle()
        assert health["kv_blocks_used"] == 0
        # ... and their connections reset (the server discarded what they never read).
        wait_until(lambda: all(tcp_state(s) == TCP_CLOSE for s in socks), 10, what="stalled sockets reset")
        scrape = Scrape(srv.url)
        assert scrape.get("tokenmill_http_connections_closed_total", reason="slow_client") >= STALLED

        # The normal client streamed its whole output meanwhile, never waiting a second for an event.
        assert normal.tokens == 300 and normal.done["finish_reason"] == "length", normal.done
        assert normal.max_gap < 1.0, normal.max_gap

        # Nothing of theirs is left: the queued outputs went with their streams.
        for s in socks:
            s.close()
        assert live_outputs() <= base_outputs


def test_reader_past_its_backlog_bound_is_dropped(real_engine, caplog):
    caplog.set_level(logging.INFO, logger="tokenmill.requests")
    # A long write timeout: only the backlog bound can drop these.
    settings = slow_settings(write_timeout_s=60, stream_max_pending_tokens=32)
    with run_server(settings, ControlledEngine(real_engine, STEP_DELAY_S)) as srv:
        start = time.monotonic()
        socks = [open_stalled(srv.port, STALL_BODY) for _ in range(4)]
        wait_until(lambda: slow_client_count(srv.url) >= 4, 30, 0.1, "backlog drops")
        assert time.monotonic() - start < 30
        health = srv.wait_idle()
        assert health["kv_blocks_used"] == 0
        lines = [json.loads(r.message) for r in caplog.records if r.name == "tokenmill.requests"]
        assert sum(1 for line in lines if line["reason"] == "slow_client") == 4
        assert all(line["completion_tokens"] < MAX_TOKENS for line in lines if line["reason"] == "slow_client")
        wait_until(lambda: all(tcp_state(s) == TCP_CLOSE for s in socks), 10, what="stalled sockets reset")
        for s in socks:
            s.close()


def test_memory_of_stalled_streams_is_bounded_and_comes_back():
    """RSS while 20 streams stall on a fast (fake) engine, and after: see PENDING_BOUND."""
    engine = FakeEngine(max_model_len=200_000, max_num_seqs=32, num_blocks=1_000_000, step_delay_s=0.001)
    settings = slow_settings(write_timeout_s=60, stream_max_pending_tokens=PENDING_BOUND)
    body = {"prompt": "abc", "max_tokens": 20_000, "ignore_eos": True, "logprobs": 2}  # 20 fit the lane
    with run_server(settings, engine) as srv:
        for _ in range(2):  # the first waves grow the heap's pools; what follows must reuse them
            socks, _ = stalled_wave(srv, STALLED, body)
            srv.wait_idle()
            for s in socks:
                s.close()
        base_rss, base_outputs = rss_mb(), live_outputs()
        socks, peak = stalled_wave(srv, STALLED, body)
        health = srv.wait_idle()
        assert health["kv_blocks_used"] == 0
        assert peak - base_rss < RSS_BOUND_MB, (peak, base_rss)
        for s in socks:
            s.close()
        assert live_outputs() <= base_outputs
        after = rss_mb()
        socks, _ = stalled_wave(srv, STALLED, body)
        srv.wait_idle()
        for s in socks:
            s.close()
        assert rss_mb() - after < RSS_SECOND_WAVE_MB, (rss_mb(), after)
