"""A grammar compile worker process (engine/structured/compile_workers.py starts it):

    python -m engine.structured.compile_server READ_FD WRITE_FD NICE

It reads one setup message ({"tokenizer_info": xgrammar TokenizerInfo JSON, "max_bytes": int}), answers
b"ready", then serves jobs ({"kind", "source"}) one at a time: a header {"ok", "error", "too_large",
"bytes", "rss"} and, when ok, the compiled grammar's `serialize_json()`. It keeps nothing between jobs
(xgrammar's own cache is off) and exits quietly (0) when the parent closes its pipes, at any point: a
server that stops while a worker is still starting is not an error.
"""

from __future__ import annotations

import json
import os
import sys
from multiprocessing.connection import Connection


def main(argv: list[str]) -> int:
    try:
        return _serve(argv)
    except (EOFError, BrokenPipeError, ConnectionResetError):  # the parent went away
        return 0


def _serve(argv: list[str]) -> int:
    read_fd, write_fd, nice = (int(a) for a in argv)
    if nice:
        os.nice(nice)
    recv, send = Connection(read_fd, writable=False), Connection(write_fd, readable=False)
    setup = json.loads(recv.recv_bytes())
    import xgrammar as xgr

    from engine.structured.xgrammar_backend import build_grammar, error_message

    info = xgr.TokenizerInfo.deserialize_json(setup["tokenizer_info"])
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    max_bytes = int(setup["max_bytes"])
    send.send_bytes(b"ready")
    while True:
        job = json.loads(recv.recv_bytes())  # EOFError when the parent closed its pipe
        header, payload = _compile(compiler, job, max_bytes, build_grammar, error_message)
        header["rss"] = _rss_bytes()
        send.send_bytes(json.dumps(header).encode())
        if payload is not None:
            send.send_bytes(payload)


def _compile(compiler, job: dict, max_bytes: int, build, message) -> tuple[dict, bytes | None]:
    try:
        compiled = build(compiler, job["kind"], job["source"])
    except Exception as exc:  # xgrammar raises RuntimeError (C++), ValueError, pydantic errors
        return {"ok": False, "error": message(exc)}, None
    size = int(compiled.memory_size_bytes)
    if size > max_bytes:
        return {"ok": False, "too_large": True, "error": f"compiles to {size / 2**20:.1f} MiB, more than the "
                f"grammar cache holds ({max_bytes / 2**20:.1f} MiB)"}, None  # fmt: skip
    return {"ok": True, "bytes": size}, compiled.serialize_json().encode()


def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
