"""Request framing a proxy in front could read differently from us (request smuggling): refused.

h11 already refuses conflicting Content-Length values, a non-numeric Content-Length, several
Transfer-Encoding headers, any coding but `chunked`, and whitespace before a header's colon. What it
lets through, and what is refused here:

- both Content-Length and Transfer-Encoding (CL.TE / TE.CL desync): h11 reads the chunked body and
  answers what follows it as a second request;
- Transfer-Encoding in an HTTP/1.0 request (RFC 9112 6.1: the framing is faulty);
- bare LF line endings and obsolete line folding in the head: h11 accepts and rewrites both, a proxy
  may split or join those header lines differently (`HeadScanner`, on the raw bytes).
"""

from __future__ import annotations

from collections.abc import Iterable


def framing_problem(http_version: str, headers: Iterable[tuple[bytes, bytes]]) -> str | None:
    """Why a parsed request's framing is ambiguous, or None. `headers`: lower-case names (ASGI scope)."""
    names = [name for name, _ in headers]
    has_te = b"transfer-encoding" in names
    if has_te and b"content-length" in names:
        return "a request must not carry both Content-Length and Transfer-Encoding"
    if has_te and http_version == "1.0":
        return "Transfer-Encoding is not allowed in an HTTP/1.0 request"
    return None


class HeadScanner:
    """Checks a request head's raw bytes as they arrive, up to the blank line that ends it. Linear in
    the bytes fed: each call scans only its data plus the last three bytes before it."""

    def __init__(self) -> None:
        self._tail = b""  # last bytes scanned: a CRLF or a fold may straddle two reads
        self._done = False  # the head's end was seen: the rest is body or the next request

    def feed(self, data: bytes) -> str | None:
        """The problem found in this head so far, or None."""
        if self._done or not data:
            return None
        window = self._tail + bytes(data)
        end = window.find(b"\r\n\r\n")
        if end >= 0:
            window = window[: end + 4]
            self._done = True
        if _bare_lf(window, len(self._tail)):
            return "header lines must end with CRLF (bare LF)"
        if b"\r\n " in window or b"\r\n\t" in window:
            return "obsolete header line folding is not accepted"
        self._tail = window[-3:]
        return None


def _bare_lf(window: bytes, start: int) -> bool:
    """An LF at or after `start` (bytes before it were checked already) without a CR before it."""
    i = window.find(b"\n", start)
    while i >= 0:
        if i == 0 or window[i - 1] != 0x0D:
            return True
        i = window.find(b"\n", i + 1)
    return False
