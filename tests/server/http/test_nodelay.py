"""Accepted connections have TCP_NODELAY (server/http/guarded_protocol.py): without it a JSON answer's
body, written after its headers, waited for the client's delayed ACK: ~40 ms on every keep-alive
request on loopback (asyncio sets the option only on sockets made with proto IPPROTO_TCP; uvicorn's
have proto 0)."""

from __future__ import annotations

import socket
import statistics
import time

import httpx

from ..helpers import make_settings, run_server


def test_accepted_connections_have_nodelay_and_answers_do_not_wait_for_an_ack(real_engine):
    with run_server(make_settings(), real_engine) as srv, httpx.Client(timeout=10) as client:
        latencies = []
        for _ in range(15):
            start = time.perf_counter()
            assert client.get(f"{srv.url}/version").status_code == 200
            latencies.append(time.perf_counter() - start)
        socks = [c.transport.get_extra_info("socket") for c in list(srv.guard._live)]
        assert socks and all(s.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) for s in socks)
        assert statistics.median(latencies) < 0.03, latencies  # 44 ms each before, on an idle loopback
