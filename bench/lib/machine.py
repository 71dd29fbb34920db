"""What the benchmark machine is, and how busy other processes keep it (Linux /proc; None elsewhere).

On a small shared machine another process's work can slow a run many times over, so every timed run
records how many cores other processes kept busy meanwhile, and runs can wait for a quiet machine.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class CpuSample:
    """Cumulative CPU time counters at one instant, in clock ticks."""

    busy: int  # all CPUs, every process: user + nice + system + irq + softirq + steal
    total: int  # all CPUs, busy + idle + iowait
    own: int  # this process, all its threads: utime + stime


def cpu_sample() -> CpuSample | None:
    """Current counters, or None where /proc is not available."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:9]]
        with open("/proc/self/stat") as f:
            # fields after the ")" that closes the command name; utime and stime are the 12th and 13th
            rest = f.read().rsplit(")", 1)[1].split()
    except (OSError, ValueError, IndexError):
        return None
    user, nice, system, idle, iowait, irq, softirq, steal = fields
    busy = user + nice + system + irq + softirq + steal
    return CpuSample(busy, busy + idle + iowait, int(rest[11]) + int(rest[12]))


def other_cores(before: CpuSample | None, after: CpuSample | None) -> float | None:
    """Average number of cores that other processes kept busy between two samples."""
    if before is None or after is None or after.total <= before.total:
        return None
    others = (after.busy - before.busy) - (after.own - before.own)
    return max(0.0, others / (after.total - before.total) * (os.cpu_count() or 1))


def wait_quiet(max_wait_s: float, threshold_cores: float = 0.25, window_s: float = 1.0) -> float | None:
    """Block until other processes use fewer than `threshold_cores` over a `window_s` window, or until
    `max_wait_s` has passed. Returns the last window's reading (None without /proc)."""
    deadline = time.monotonic() + max_wait_s
    while True:
        before = cpu_sample()
        time.sleep(window_s)
        busy = other_cores(before, cpu_sample())
        if busy is None or busy < threshold_cores or time.monotonic() >= deadline:
            return busy


def cpu_model() -> str:
    """lscpu's "Model name", else /proc/cpuinfo's, else "unknown"."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        out = ""
    for line in out.splitlines():
        if line.startswith("Model name:"):
            return line.split(":", 1)[1].strip()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def machine_info(torch_threads: int, torch_version: str) -> dict:
    """JSON-ready description of the machine and the software under test."""
    return {
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch_threads,
        "torch": torch_version,
        "python": sys.version.split()[0],
    }
