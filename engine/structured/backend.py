"""The grammar backend's interface, torch-free: a `GrammarCompiler` turns a `GrammarSpec` into a
`CompiledGrammar` (thread-safe, cached by the spec's digest), and each constrained request gets its
own `GrammarMatcher` from it, which fills its row of the step's token bitmask and advances with the
sampled token. The bitmask is the layout xgrammar and llguidance share: int32 [rows, ceil(vocab / 32)],
bit j of word w set when token 32 * w + j is allowed.

`CachingCompiler` does the caching (bounded in entries and bytes) and the locking once; a backend
subclasses it and implements `_compile`. The xgrammar backend is engine/structured/xgrammar_backend.py;
its compiles run in worker processes (engine/structured/compile_workers.py) when asked to, so a
compile past its budget is stopped, not abandoned.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

from engine.structured.spec import GrammarError, GrammarSpec, GrammarTimeout


class GrammarMatcher(Protocol):
    """One request's position in its grammar. Used by one thread (the engine's) at a time."""

    def fill_bitmask(self, bitmask: Any, row: int) -> None:
        """Write the tokens allowed next into `bitmask[row]` (an int32 CPU tensor, see the module doc)."""
        ...

    def allows_nothing(self) -> bool:
        """The last fill_bitmask allowed no token at all (the grammar is at a dead end)."""
        ...

    def accept(self, token_id: int) -> bool:
        """Advance past `token_id`; False (state unchanged) when the grammar does not allow it."""
        ...

    def is_terminated(self) -> bool:
        """The grammar has ended (it accepted a stop token): nothing more may be generated."""
        ...

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepts (speculative decoding walks the drafts, then comes back)."""
        ...


class CompiledGrammar(Protocol):
    """A compiled spec: immutable, shared by every request with that spec, safe across threads."""

    @property
    def owner(self) -> object:
        """The compiler that made it (a grammar is only valid for that compiler's tokenizer)."""
        ...

    @property
    def memory_bytes(self) -> int:
        """What it holds in memory (the cache's byte bound counts this)."""
        ...

    def matcher(self) -> GrammarMatcher: ...


@dataclass
class CompilerStats:
    """Cumulative counts of one compiler, and what its cache holds now."""

    hits: int = 0  # compile() answered from the cache (or joined a compile in progress)
    misses: int = 0  # compile() had to compile
    failures: int = 0  # specs that did not compile (timeouts included)
    entries: int = 0  # grammars cached now
    bytes: int = 0  # their memory_bytes, summed
    timeouts: int = 0  # compiles stopped at their budget
    evictions: int = 0  # grammars dropped by the entry or byte bound


class GrammarCompiler(Protocol):
    """What the engine hands the server (like its tokenizer): compiles specs for this model's vocabulary."""

    @property
    def backend(self) -> str:
        """The library's name ("xgrammar")."""
        ...

    @property
    def budgeted(self) -> bool:
        """True: compile(timeout_s=...) stops a compile at its budget (it runs in a worker process that is
        killed) and raises GrammarTimeout. False: a compile runs to its end; the caller bounds its wait."""
        ...

    def submit(self, spec: GrammarSpec, timeout_s: float | None = None) -> Future:
        """compile() as a concurrent.futures.Future (never blocks): for the server's event loop."""
        ...

    def cached(self, spec: GrammarSpec) -> bool:
        """Whether `spec` is compiled and in the cache now (a hint: it may be evicted the next moment)."""
        ...

    def compile(self, spec: GrammarSpec, timeout_s: float | None = None) -> CompiledGrammar:
        """The compiled grammar of `spec`, from the cache when it was compiled before. Thread-safe; blocks
        while compiling (call it off the event loop and off the engine thread). `timeout_s`: the compile's
        budget (see `budgeted`; time spent waiting for a free worker is not counted). Raises GrammarError
        (GrammarTimeout past the budget)."""
        ...

    def stats(self) -> CompilerStats: ...


class CachingCompiler:
    """A thread-safe LRU cache of compiled grammars in front of `_compile`, bounded in entries and in
    bytes (each grammar's `memory_bytes`). Two threads asking for the same uncompiled spec compile it
    once (the second waits for the first). Failures are not cached."""

    backend = "none"
    budgeted = False

    def __init__(self, max_entries: int = 512, max_bytes: int = 256 << 20, threads: int = 2) -> None:
        for name, value in (("max_entries", max_entries), ("max_bytes", max_bytes)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._cache: OrderedDict[str, Future] = OrderedDict()  # spec key -> done or in-progress compile
        self._sizes: dict[str, int] = {}  # spec key -> memory_bytes, for the done ones
        self._bytes = 0
        self._stats = CompilerStats()
        # Where compiles run (or, for a backend with worker processes, wait for their worker).
        self._threads = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="tokenmill-grammar")

    def submit(self, spec: GrammarSpec, timeout_s: float | None = None) -> Future:
        """A future of `spec`'s compiled grammar: the cached one, the compile in progress, or a new compile
        on this compiler's threads. Never blocks."""
        key = spec.key
        with self._lock:
            pending = self._cache.get(key)
            if pending is not None:
                self._cache.move_to_end(key)
                self._stats.hits += 1
                return pending
            pending = self._cache[key] = Future()
            self._stats.misses += 1
        try:
            self._threads.submit(self._fill, key, pending, spec, timeout_s)
        except RuntimeError as exc:  # shut down
            self._fail(key, pending, GrammarError(f"the grammar compiler is closed ({exc})"))
        return pending

    def compile(self, spec: GrammarSpec, timeout_s: float | None = None) -> CompiledGrammar:
        return self.submit(spec, timeout_s).result()

    def cached(self, spec: GrammarSpec) -> bool:
        """Whether `spec` is compiled and in the cache now."""
        with self._lock:
            done = self._cache.get(spec.key)
            return done is not None and done.done()

    def _fill(self, key: str, pending: Future, spec: GrammarSpec, timeout_s: float | None) -> None:
        try:
            compiled = self._compile(spec, timeout_s)
        except Exception as exc:
            self._fail(key, pending, exc if isinstance(exc, GrammarError) else GrammarError(f"{type(exc).__name__}: {exc}"))
            return
        with self._lock:
            if self._cache.get(key) is pending:
                size = max(int(compiled.memory_bytes), 0)
                self._sizes[key] = size
                self._bytes += size
                self._evict()
        pending.set_result(compiled)

    def _fail(self, key: str, pending: Future, error: GrammarError) -> None:
        with self._lock:
            self._stats.failures += 1
            self._stats.timeouts += isinstance(error, GrammarTimeout)
            if self._cache.get(key) is pending:
                del self._cache[key]
        pending.set_exception(error)

    def _evict(self) -> None:
        """Drop the least recently used done grammars until both bounds hold (compiles in progress stay;
        a grammar alone over the byte bound is not kept). Holds the lock."""
        for key in list(self._cache):
            if len(self._cache) <= self.max_entries and self._bytes <= self.max_bytes:
                return
            if key in self._sizes:
                del self._cache[key]
                self._bytes -= self._sizes.pop(key)
                self._stats.evictions += 1

    def close(self) -> None:
        """Stop taking compiles (queued ones fail; running ones finish)."""
        self._threads.shutdown(wait=False, cancel_futures=True)

    def stats(self) -> CompilerStats:
        with self._lock:
            st = self._stats
            return CompilerStats(st.hits, st.misses, st.failures, len(self._cache), self._bytes, st.timeouts,
                                 st.evictions)  # fmt: skip

    def _compile(self, spec: GrammarSpec, timeout_s: float | None) -> CompiledGrammar:
        """Compile `spec` (no caching here) within `timeout_s` when the backend is `budgeted`. Raises
        GrammarError (other exceptions are wrapped in one)."""
        raise NotImplementedError
