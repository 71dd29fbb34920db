"""Device memory as the server reports it (`tokenmill_device_memory_*`) and checks it before a load
(server/ops/memory_check.py): CUDA memory from the engine's own report, or the process RSS against the
host's memory (or the cgroup limit) on CPU. Torch-free."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class DeviceMemory:
    """Memory of the device the model runs on: CUDA memory, or the process RSS on CPU."""

    device: str  # label value: "cuda:0", or "cpu" for the process RSS against the host (or cgroup) limit
    used_bytes: int
    total_bytes: int
    # CUDA: reserved by this process's allocator but not allocated (freed tensors, e.g. of an unloaded
    # version): counted in used_bytes, yet free for this process's next engine
    reusable_bytes: int = 0


def memory_probe(engine: Any) -> Callable[[], DeviceMemory | None]:
    """How to read device memory at scrape time (from the event loop, while the worker steps). An engine
    may offer `device_memory()` -> a dict with `used_bytes` and `total_bytes` (device-wide, as
    nvidia-smi counts), or None on CPU; otherwise, and on CPU, the process RSS against the host memory
    (or the cgroup limit)."""
    method = getattr(engine, "device_memory", None)
    device = str(getattr(engine, "device_name", "cpu"))

    def probe() -> DeviceMemory | None:
        if callable(method):
            try:
                got = method()
                if got is not None:
                    reusable = max(int(got.get("reserved_bytes", 0)) - int(got.get("allocated_bytes", 0)), 0)
                    return DeviceMemory(device, int(got["used_bytes"]), int(got["total_bytes"]), reusable)
            except Exception:  # a scrape must not fail because of it: fall back to the process
                pass
        return process_memory()

    return probe


def process_memory() -> DeviceMemory | None:
    """This process's RSS, and the memory it may use: the host's, or the cgroup limit when lower."""
    page = os.sysconf("SC_PAGE_SIZE")
    try:
        rss = int(Path("/proc/self/statm").read_text().split()[1]) * page
    except (OSError, ValueError, IndexError):
        return None
    limits = [os.sysconf("SC_PHYS_PAGES") * page]
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = Path(path).read_text().strip()
        except OSError:
            continue
        if text.isdigit() and 0 < int(text) < limits[0]:
            limits.append(int(text))
    return DeviceMemory("cpu", rss, min(limits))
