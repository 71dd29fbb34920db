"""Grammar compiles in worker processes, so a compile past its budget is stopped (its process is
killed and replaced), not abandoned on a thread that keeps a core and the GIL busy.

Two lanes, each one thread here and one child process (`python -m engine.structured.compile_server`,
started with fork + exec: no fork of this process's torch threads): grammars whose source is at most
`small_bytes` go to the small lane, the others to the large lane, whose child runs niced. So one
client's huge grammars queue behind each other, never in front of another client's trivial one. A
child is started before the job it serves is handed to it: its start-up (an xgrammar import, a few
seconds) never counts against a compile's budget. Each lane queues a bounded number of jobs
(CompileQueueFull beyond: 64 small, 16 large).

Plain Python (no xgrammar, no torch here): a job is (kind, source), its answer the compiled grammar
serialized as JSON (xgrammar's `CompiledGrammar.serialize_json`), which the caller deserializes.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import subprocess
import sys
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from multiprocessing.connection import Connection

from engine.structured.spec import GrammarError, GrammarTimeout, GrammarTooLarge

log = logging.getLogger("tokenmill.engine")

SMALL_GRAMMAR_BYTES = 8192  # a source up to this size takes the small lane
LARGE_LANE_NICE = 10  # the large lane's child runs at this niceness
RECYCLE_RSS_BYTES = 1 << 30  # a child past this RSS after a job is replaced (allocator growth)
_START_TIMEOUT_S = 120.0


class CompileQueueFull(GrammarError):
    """A lane already holds its most queued compiles: try again later (the server answers 429)."""


@dataclass(frozen=True)
class CompileResult:
    """A compiled grammar as its child sent it."""

    payload: str  # CompiledGrammar.serialize_json()
    memory_bytes: int  # CompiledGrammar.memory_size_bytes
    seconds: float  # the compile in the child, serialization included


@dataclass
class _Job:
    kind: str
    source: str
    timeout_s: float | None
    future: Future = field(default_factory=Future)


class _Child:
    """One compile_server process and its two pipes."""

    def __init__(self, setup: bytes, nice: int) -> None:
        to_child_r, to_child_w = os.pipe()
        from_child_r, from_child_w = os.pipe()
        cmd = [sys.executable, "-m", "engine.structured.compile_server", str(to_child_r), str(from_child_w), str(nice)]
        try:
            self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, pass_fds=(to_child_r, from_child_w),
                                         cwd=os.getcwd())  # fmt: skip
        finally:
            os.close(to_child_r)
            os.close(from_child_w)
        self._send = Connection(to_child_w, readable=False)
        self._recv = Connection(from_child_r, writable=False)
        self._send.send_bytes(setup)
        if not self._recv.poll(_START_TIMEOUT_S):
            self.kill()
            raise RuntimeError(f"the grammar compile worker did not start within {_START_TIMEOUT_S:g}s")
        self._recv.recv_bytes()  # b"ready"

    @property
    def pid(self) -> int:
        return self.proc.pid

    def run(self, job: _Job) -> tuple[dict, bytes | None] | None:
        """The child's answer (header, payload), or None when it did not answer within the job's budget."""
        self._send.send_bytes(json.dumps({"kind": job.kind, "source": job.source}).encode())
        if not self._recv.poll(job.timeout_s):
            return None
        header = json.loads(self._recv.recv_bytes())
        payload = self._recv.recv_bytes() if header.get("ok") else None
        return header, payload

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()
        self._send.close()
        self._recv.close()


class _Lane:
    """One queue, one thread, one child at a time."""

    def __init__(self, name: str, setup: bytes, nice: int, max_queued: int) -> None:
        self.name = name
        self._setup, self._nice = setup, nice
        self._jobs: queue.Queue[_Job | None] = queue.Queue(maxsize=max_queued)
        self._child: _Child | None = None
        self.killed = 0  # children killed at a job's budget
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=f"tokenmill-grammar-{name}", daemon=True)
        self._thread.start()

    @property
    def pid(self) -> int | None:
        child = self._child
        return child.pid if child is not None else None

    def submit(self, job: _Job) -> None:
        try:
            self._jobs.put_nowait(job)
        except queue.Full:
            raise CompileQueueFull(f"the {self.name} grammar compile queue is full; try again later") from None

    def close(self, wait: bool = True) -> None:
        """Kill the child now (a compile in progress fails) and end the thread; queued jobs fail."""
        self._closed = True
        try:
            self._jobs.put_nowait(None)
        except queue.Full:
            pass
        child = self._child
        if child is not None:
            child.proc.kill()
        if wait:
            self._thread.join(5.0)

    def _run(self) -> None:
        self._start_child()  # before any job: its start-up is nobody's budget
        while True:
            job = self._jobs.get()
            if job is None:
                break
            if not job.future.set_running_or_notify_cancel():
                continue
            if self._closed:
                job.future.set_exception(GrammarError("the grammar compiler is closed"))
                continue
            try:
                job.future.set_result(self._serve(job))
            except BaseException as exc:  # noqa: BLE001 -- handed to the waiter
                job.future.set_exception(exc)
            if self._child is None and not self._closed:  # killed or died: its successor starts now, after
                self._start_child()  # the waiter got its answer and before the next job is taken
        if self._child is not None:
            self._child.kill()
            self._child = None
        while not self._jobs.empty():  # what was queued behind the close
            job = self._jobs.get_nowait()
            if job is not None and job.future.set_running_or_notify_cancel():
                job.future.set_exception(GrammarError("the grammar compiler is closed"))

    def _ensure_child(self) -> _Child:
        if self._closed:
            raise GrammarError("the grammar compiler is closed")
        if self._child is None or self._child.proc.poll() is not None:
            self._child = _Child(self._setup, self._nice)
        return self._child

    def _serve(self, job: _Job) -> CompileResult:
        child = self._ensure_child()
        started = time.monotonic()
        try:
            answer = child.run(job)
        except (EOFError, OSError) as exc:
            self._drop_child()
            raise GrammarError(f"the grammar compile worker died ({type(exc).__name__})") from None
        if answer is None:  # past its budget: stop it by killing the process, and start the next one
            self.killed += 1
            self._drop_child()
            raise GrammarTimeout(job.timeout_s or 0.0)
        header, payload = answer
        if header.get("rss", 0) > RECYCLE_RSS_BYTES:
            self._drop_child()
        if not header["ok"]:
            kind = GrammarTooLarge if header.get("too_large") else GrammarError
            raise kind(header["error"])
        return CompileResult(payload.decode(), int(header["bytes"]), time.monotonic() - started)

    def _drop_child(self) -> None:
        if self._child is not None:
            self._child.kill()
            self._child = None

    def _start_child(self) -> None:
        try:
            self._ensure_child()
        except Exception:
            if not self._closed:
                log.exception("grammar compile worker (%s lane) failed to start", self.name)


class CompilePool:
    """The two lanes. `setup`: what each child needs to build its compiler (compile_server.py reads it)."""

    def __init__(self, setup: dict, small_bytes: int = SMALL_GRAMMAR_BYTES, small_queued: int = 64,
                 large_queued: int = 16) -> None:  # fmt: skip
        raw = json.dumps(setup).encode()
        self.small_bytes = small_bytes
        self.small = _Lane("small", raw, 0, small_queued)
        self.large = _Lane("large", raw, LARGE_LANE_NICE, large_queued)
        self.max_waiting = small_queued + large_queued + 2  # compiles that can wait on the pool at once

    def compile(self, kind: str, source: str, timeout_s: float | None) -> CompileResult:
        """Compile in a child process within `timeout_s` of its own compile time (None: no budget).
        Blocks. Raises GrammarError (GrammarTimeout: stopped at the budget; CompileQueueFull)."""
        job = _Job(kind, source, timeout_s)
        lane = self.small if len(source.encode()) <= self.small_bytes else self.large
        lane.submit(job)
        return job.future.result()

    def pids(self) -> dict[str, int | None]:
        """Each lane's child process id (None while it has none)."""
        return {"small": self.small.pid, "large": self.large.pid}

    def close(self, wait: bool = True) -> None:
        """Kill both children; `wait`: for the lanes' threads to end too."""
        self.small.close(wait)
        self.large.close(wait)
