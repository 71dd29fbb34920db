"""How many CPU threads the engine's steps use, chosen from measured step times, not fixed at start-up.

Why: the engine's OpenMP team (torch's intra-op threads and the C++ kernels') synchronises at a
barrier ~300 times a decode step. With one thread per core that pays on a quiet machine (the step is
bound by memory bandwidth, which a second core nearly doubles), but when another process takes one of
the cores (a client, a sidecar, another tenant's job) each barrier waits for the descheduled thread's
next time slice: measured on a 2-vCPU Xeon beside a one-core Python loop, SmolLM2-135M served 18
output tok/s with two threads against 159 with one (docs/benchmarks/log.md, "Engine threads under
contention"). Which count is faster is a property of the moment, so the governor measures it.

How: decode-only steps are timed per token at the current count (`high`, the configured threads, to
start), by batch size (a step's per-token time falls as its batch grows, so only steps of the same
size compare). Every `probe_every_s` the next `probe_steps` decode steps run at the other count (`low`:
one thread, or `high` again when the governor sits at one); each probe step is divided by the current
count's median at its batch size, and the probe wins when the median of those ratios is below
1 - `margin`. Probe steps of a size the current count has no recent time for are not counted; a probe
with fewer than two counted steps decides nothing. A probe that confirms the current count doubles the
wait before the next one (up to `max_probe_every_s`), a switch resets it. A probe step slower than twice
the current median ends the probe at once, so probing two threads on a crowded machine costs one slow
step, not four; that step still holds every running request (a tenth of a second to a second), so at
one thread the waits are longer (`low_probe_every_s` doubling to `max_low_probe_every_s`): a taken core
usually stays taken, and probing `low` from `high` costs little (a few steps at most ~2x). Prefill steps
are not compared: their per-token time depends on the chunk's length and position, not only on threads.

Plain Python, no torch: `apply(n)` (engine/core/thread_count.py: the calling thread's OpenMP and MKL counts,
nothing process-wide; called on the thread that runs the steps) does the switching, so the tests drive
it with made-up timings. The first `observe` applies the current count too: the stepping thread is not
the one that built the engine, and may keep a count from an earlier engine (a version swap).
"""

from __future__ import annotations

import logging
import statistics
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger("tokenmill.engine")


@dataclass(frozen=True)
class GovernorConfig:
    high: int  # the configured thread count (one per core, or --engine-threads)
    low: int = 1
    probe_every_s: float = 1.0  # first wait before probing the other count
    max_probe_every_s: float = 32.0  # the wait doubles up to this while probes confirm the current count
    low_probe_every_s: float = 8.0  # the same two while at `low` (its probes at `high` are the costly ones)
    max_low_probe_every_s: float = 64.0
    probe_steps: int = 4  # decode steps timed at the other count per probe
    baseline_steps: int = 6  # recent decode steps at the current count that a probe is compared with
    margin: float = 0.10  # the other count must be this much faster per token to switch
    abort_ratio: float = 2.0  # a probe step this many times the current median ends the probe


class ThreadGovernor:
    """Owns the engine's thread count while steps run; `observe` is called after every step."""

    def __init__(self, config: GovernorConfig, apply: Callable[[int], None],
                 clock: Callable[[], float] = time.monotonic) -> None:  # fmt: skip
        if not 1 <= config.low < config.high:
            raise ValueError(f"thread governor needs 1 <= low < high, got low={config.low} high={config.high}")
        self.config = config
        self._apply = apply
        self._clock = clock
        self.threads = config.high  # the count the steps run at now (probes included)
        self._chosen = config.high  # the count that won the last comparison
        # (decode tokens, seconds per token) of recent steps at _chosen, and at the other count during a probe
        self._baseline: deque[tuple[int, float]] = deque(maxlen=config.baseline_steps)
        self._probe: list[tuple[int, float]] = []
        self._wait_s = config.probe_every_s
        self._next_probe = clock() + self._wait_s
        self._synced = False  # whether the stepping thread runs at self.threads yet (first observe)
        self.probes = 0  # probes started (for stats and tests)
        self.switches = 0  # times the chosen count changed

    @property
    def chosen(self) -> int:
        return self._chosen

    @property
    def probing(self) -> bool:
        return self.threads != self._chosen

    def observe(self, decode_tokens: int, prefill_tokens: int, elapsed_s: float) -> None:
        """One finished step: its decode and prefill token counts and its wall time."""
        if not self._synced:  # the first step ran at whatever the thread had; it is not compared
            self._apply(self.threads)
            self._synced = True
            return
        if prefill_tokens or decode_tokens <= 0:
            return  # only decode-only steps compare thread counts fairly
        sample = (decode_tokens, elapsed_s / decode_tokens)
        if self.probing:
            self._probe.append(sample)
            slow = sample[1] > self.config.abort_ratio * statistics.median(t for _, t in self._baseline)
            if slow or len(self._probe) >= self.config.probe_steps:
                self._settle(aborted=slow)
            return
        self._baseline.append(sample)
        if len(self._baseline) == self._baseline.maxlen and self._clock() >= self._next_probe:
            self.probes += 1
            self._probe = []
            self._set(self._other())

    def _other(self) -> int:
        return self.config.low if self._chosen == self.config.high else self.config.high

    def _ratios(self) -> list[float]:
        """Each probe step's per-token time over the current count's median at the same batch size."""
        by_size: dict[int, list[float]] = {}
        for n, t in self._baseline:
            by_size.setdefault(n, []).append(t)
        return [t / statistics.median(by_size[n]) for n, t in self._probe if n in by_size]

    def _settle(self, aborted: bool) -> None:
        """End a probe: keep the faster count (the probe's count only when it wins by the margin)."""
        ratios = [] if aborted else self._ratios()
        ratio = statistics.median(ratios) if len(ratios) >= 2 else None
        if ratio is not None and ratio < 1 - self.config.margin:
            log.info("engine threads: %d -> %d (%.0f%% of the per-token time)", self._chosen, self.threads,
                     100 * ratio)  # fmt: skip
            self._chosen = self.threads
            self.switches += 1
            self._baseline.clear()
            self._baseline.extend(self._probe)
            self._wait_s = self._first_wait()
        else:
            self._set(self._chosen)
            if ratio is not None or aborted:  # a probe that decided nothing does not lengthen the wait
                self._wait_s = min(self._wait_s * 2, self._max_wait())
        self._probe = []
        self._next_probe = self._clock() + self._wait_s

    def _first_wait(self) -> float:
        c = self.config
        return c.probe_every_s if self._chosen == c.high else c.low_probe_every_s

    def _max_wait(self) -> float:
        c = self.config
        return c.max_probe_every_s if self._chosen == c.high else c.max_low_probe_every_s

    def _set(self, threads: int) -> None:
        if threads != self.threads:
            self._apply(threads)
            self.threads = threads
