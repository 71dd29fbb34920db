"""Request smuggling shapes on a real loopback socket: each gets exactly one 400 and a closed
connection, never a second response; plain pipelining still works. HeadScanner and framing_problem
unit tests at the end."""

from __future__ import annotations

import socket

import pytest

from server.http.framing import HeadScanner, framing_problem

from ..helpers import HOST, make_settings, run_server

SMUGGLED = b"GET /health HTTP/1.1\r\nHost: t\r\n\r\n"

# name -> raw bytes sent in one write. Each carries a complete second request a parser might answer.
SHAPES = {
    # CL.TE: h11 reads the chunked body ("0\r\n\r\n") and would answer SMUGGLED as a second request.
    "cl_te": b"POST /generate HTTP/1.1\r\nHost: t\r\nContent-Length: %d\r\nTransfer-Encoding: chunked\r\n\r\n"
             b"0\r\n\r\n" + SMUGGLED,
    # TE.CL: a front proxy reading Content-Length would see SMUGGLED inside the chunk as the next request.
    "te_cl": b"POST /generate HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\nContent-Length: 4\r\n\r\n"
             b"%x\r\n" % len(SMUGGLED) + SMUGGLED + b"\r\n0\r\n\r\n",
    "te_http10": b"POST /generate HTTP/1.0\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n" + SMUGGLED,
    "obs_fold_te": b"POST /generate HTTP/1.1\r\nHost: t\r\nTransfer-Encoding:\r\n chunked\r\n\r\n0\r\n\r\n" + SMUGGLED,
    "bare_lf": b"POST /generate HTTP/1.1\nHost: t\nContent-Length: 2\n\n{}" + SMUGGLED,
    "conflicting_cl": b"POST /generate HTTP/1.1\r\nHost: t\r\nContent-Length: 2\r\nContent-Length: 40\r\n\r\n{}"
                      + SMUGGLED,
    "te_not_chunked": b"POST /generate HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: identity\r\n\r\n" + SMUGGLED,
}
SHAPES["cl_te"] = SHAPES["cl_te"] % 5


@pytest.fixture(scope="module")
def srv(real_engine):
    with run_server(make_settings(), real_engine) as s:
        yield s


def exchange(port: int, data: bytes, timeout: float = 10.0) -> tuple[bytes, bool]:
    """Send `data`, read until the server closes. Returns (everything read, closed by the server)."""
    with socket.create_connection((HOST, port), timeout=timeout) as sock:
        sock.sendall(data)
        got = b""
        try:
            while True:
                chunk = sock.recv(65536)
                if not chunk:
                    return got, True
                got += chunk
        except ConnectionResetError:
            return got, True
        except TimeoutError:
            return got, False


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_ambiguous_framing_gets_one_400_and_a_closed_connection(srv, shape):
    got, closed = exchange(srv.port, SHAPES[shape])
    assert closed, f"{shape}: the connection stayed open: {got[:200]!r}"
    assert got.count(b"HTTP/1.1 ") == 1, f"{shape}: {got!r}"
    assert got.startswith(b"HTTP/1.1 400 "), got[:200]
    assert b"200 OK" not in got


def test_both_smuggling_shapes_name_the_problem(srv):
    for shape in ("cl_te", "te_cl"):
        got, _ = exchange(srv.port, SHAPES[shape])
        assert b"Content-Length and Transfer-Encoding" in got, got


def test_plain_pipelining_still_answers_each_request(srv):
    got, _ = exchange(srv.port, SMUGGLED + SMUGGLED + b"GET /health HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n")
    assert got.count(b"HTTP/1.1 200 OK") == 3, got


def test_a_bad_pipelined_head_is_refused_after_the_good_one(srv):
    got, closed = exchange(srv.port, SMUGGLED + b"GET /health HTTP/1.1\nHost: t\n\n" + SMUGGLED)
    assert closed and got.count(b"HTTP/1.1 ") == 2, got
    assert got.startswith(b"HTTP/1.1 200 ") and b"HTTP/1.1 400 " in got


# -- units -------------------------------------------------------------------------------------------
def test_framing_problem():
    assert framing_problem("1.1", [(b"content-length", b"3")]) is None
    assert framing_problem("1.1", [(b"transfer-encoding", b"chunked")]) is None
    assert "both" in framing_problem("1.1", [(b"transfer-encoding", b"chunked"), (b"content-length", b"3")])
    assert "HTTP/1.0" in framing_problem("1.0", [(b"transfer-encoding", b"chunked")])


@pytest.mark.parametrize("step", [1, 2, 3, 7, 1000])
def test_head_scanner_sees_problems_across_reads(step):
    def scan(data: bytes) -> str | None:
        scanner = HeadScanner()
        for i in range(0, len(data), step):
            problem = scanner.feed(data[i : i + step])
            if problem:
                return problem
        return None

    good = b"POST / HTTP/1.1\r\nHost: t\r\nContent-Length: 3\r\n\r\nab\n"  # a body may hold anything
    assert scan(good) is None
    assert "bare LF" in scan(b"POST / HTTP/1.1\r\nHost: t\nX: y\r\n\r\n")
    assert "folding" in scan(b"POST / HTTP/1.1\r\nX: a\r\n\tb\r\n\r\n")
    assert "folding" in scan(b"POST / HTTP/1.1\r\nX: a\r\n b\r\n\r\n")
