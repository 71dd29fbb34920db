"""The grammar backend's interface, torch-free: a `GrammarCompiler` turns a `GrammarSpec` into a
`CompiledGrammar` (thread-safe, cached by the spec's digest), and each constrained request gets its
own `GrammarMatcher` from it, which fills its row of the step's token bitmask and advances with the
sampled token. The bitmask is the layout xgrammar and llguidance share: int32 [rows, ceil(vocab / 32)],
bit j of word w set when token 32 * w + j is allowed.

`CachingCompiler` does the caching and the locking once; a backend subclasses it and implements
`_compile`. The xgrammar backend is engine/structured/xgrammar_backend.py.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Protocol

from engine.structured.spec import GrammarError, GrammarSpec


class GrammarMatcher(Protocol):
    """One request's position in its grammar. Used by one thread (the engine's) at a time."""

    def fill_bitmask(self, bitmask: Any, row: int) -> None:
        """Write the tokens allowed next into `bitmask[row]` (an int32 CPU tensor, see the module doc)."""
        ...

    def accept(self, token_id: int) -> bool:
        """Advance past `token_id`; False (state unchanged) when the grammar does not allow it."""
        ...

    def is_terminated(self) -> bool:
        """The grammar has ended (it accepted a stop token): nothing more may be generated."""
        ...


class CompiledGrammar(Protocol):
    """A compiled spec: immutable, shared by every request with that spec, safe across threads."""

    @property
    def owner(self) -> object:
        """The compiler that made it (a grammar is only valid for that compiler's tokenizer)."""
        ...

    def matcher(self) -> GrammarMatcher: ...


@dataclass
class CompilerStats:
    """Cumulative counts of one compiler."""

    hits: int = 0  # compile() answered from the cache (or joined a compile in progress)
    misses: int = 0  # compile() had to compile
    failures: int = 0  # specs that did not compile
    entries: int = 0  # grammars cached now


class GrammarCompiler(Protocol):
    """What the engine hands the server (like its tokenizer): compiles specs for this model's vocabulary."""

    @property
    def backend(self) -> str:
        """The library's name ("xgrammar")."""
        ...

    def compile(self, spec: GrammarSpec) -> CompiledGrammar:
        """The compiled grammar of `spec`, from the cache when it was compiled before. Thread-safe; blocks
        while compiling (call it off the event loop and off the engine thread). Raises GrammarError."""
        ...

    def stats(self) -> CompilerStats: ...


class CachingCompiler:
    """A thread-safe LRU cache of compiled grammars in front of `_compile`. Two threads asking for the
    same uncompiled spec compile it once (the second waits for the first). Failures are not cached."""

    backend = "none"

    def __init__(self, max_entries: int = 512) -> None:
        if isinstance(max_entries, bool) or not isinstance(max_entries, int) or max_entries < 1:
            raise ValueError(f"max_entries must be a positive integer, got {max_entries!r}")
        self.max_entries = max_entries
        self._lock = threading.Lock()
        self._cache: OrderedDict[str, Future] = OrderedDict()  # spec key -> done or in-progress compile
        self._stats = CompilerStats()

    def compile(self, spec: GrammarSpec) -> CompiledGrammar:
        key = spec.key
        with self._lock:
            pending = self._cache.get(key)
            first = pending is None
            if pending is None:
                pending = self._cache[key] = Future()
                self._stats.misses += 1
            else:
                self._cache.move_to_end(key)
                self._stats.hits += 1
        if not first:
            return pending.result()  # waits for a compile in progress; re-raises its GrammarError
        return self._fill(key, pending, spec)

    def _fill(self, key: str, pending: Future, spec: GrammarSpec) -> CompiledGrammar:
        try:
            compiled = self._compile(spec)
        except Exception as exc:
            error = exc if isinstance(exc, GrammarError) else GrammarError(f"{type(exc).__name__}: {exc}")
            with self._lock:
                self._stats.failures += 1
                if self._cache.get(key) is pending:
                    del self._cache[key]
            pending.set_exception(error)
            raise error from None
        pending.set_result(compiled)
        with self._lock:
            while len(self._cache) > self.max_entries:
                self._cache.popitem(last=False)
        return compiled

    def stats(self) -> CompilerStats:
        with self._lock:
            return CompilerStats(self._stats.hits, self._stats.misses, self._stats.failures, len(self._cache))

    def _compile(self, spec: GrammarSpec) -> CompiledGrammar:
        """Compile `spec` (no caching here). Raises GrammarError (other exceptions are wrapped in one)."""
        raise NotImplementedError
