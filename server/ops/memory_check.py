"""Will a new version fit beside the ones loaded? Checked before loading (an out-of-memory kill mid-load
would take the running version down with it): the estimate is the weights as they will sit in memory
plus the new version's KV budget, against what the device has free, minus a headroom share.
Torch-free: reads file sizes, config.json and /proc (CPU) or the running engine's device report (CUDA).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import json
from dataclasses import dataclass
from pathlib import Path

from server.ops.memory import DeviceMemory

DEFAULT_KV_BYTES = 1 << 30  # the engine's CPU default KV budget (engine/runner/startup.py), when nothing says more
_WEIGHT_SUFFIXES = (".safetensors", ".gguf", ".bin", ".pt")
_DTYPE_BYTES = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2}
GIB = float(1 << 30)


@dataclass(frozen=True)
class MemoryNeed:
    """What a version will take once loaded, in bytes."""

    weights: int
    kv: int

    @property
    def total(self) -> int:
        return self.weights + self.kv


@dataclass(frozen=True)
class MemoryRoom:
    """What the device can give, in bytes."""

    device: str  # "cpu" or "cuda:N"
    available: int  # free now (CPU: MemAvailable, or the cgroup's room when smaller)
    total: int


class InsufficientMemory(Exception):
    """The new version would not fit: the message says by how much and what to change."""


def weights_on_disk(path: str | Path) -> int:
    """Bytes of the weight files in a model folder (not its subfolders), or of the file itself."""
    root = Path(path)
    try:
        if root.is_file():
            return root.stat().st_size
        return sum(f.stat().st_size for f in root.iterdir() if f.suffix in _WEIGHT_SUFFIXES and f.is_file())
    except OSError:
        return 0  # unreadable here: the load itself will say why


def estimate(path: str | Path, dtype: str, kv_bytes: int) -> MemoryNeed:
    """Weights as loaded (float32 from a bf16 checkpoint doubles them) plus `kv_bytes`."""
    on_disk = weights_on_disk(path)
    source = _checkpoint_dtype(Path(path))
    scale = 1.0
    if dtype in _DTYPE_BYTES and source in _DTYPE_BYTES:
        scale = _DTYPE_BYTES[dtype] / _DTYPE_BYTES[source]
    return MemoryNeed(int(on_disk * scale), kv_bytes)


def room(device_memory: DeviceMemory | None, gpu_memory_utilization: float) -> MemoryRoom:
    """Free memory where the new version goes. On CUDA, from the running engine's report, under the
    utilization cap (memory this process's allocator holds free counts as free); on the CPU, from
    /proc/meminfo and the cgroup."""
    if device_memory is not None and device_memory.device.startswith("cuda"):
        cap = int(device_memory.total_bytes * gpu_memory_utilization)
        free = cap - device_memory.used_bytes + device_memory.reusable_bytes
        return MemoryRoom(device_memory.device, max(free, 0), device_memory.total_bytes)
    return host_room()


def check(ref: str, need: MemoryNeed, have: MemoryRoom, headroom: float) -> None:
    """Raise InsufficientMemory unless `need` fits in `have` with `headroom` x total left free."""
    keep = int(have.total * headroom)
    if need.total + keep <= have.available:
        return
    raise InsufficientMemory(
        f"{ref} needs about {need.total / GIB:.2f} GiB (weights {need.weights / GIB:.2f} GiB + KV cache "
        f"{need.kv / GIB:.2f} GiB) but {have.device} has {have.available / GIB:.2f} GiB free of "
        f"{have.total / GIB:.2f} GiB, {headroom:.0%} of it kept free; give the version a smaller "
        "kv_cache_memory or unload one first"
    )


def host_room() -> MemoryRoom:
    info = _meminfo()
    total = info.get("MemTotal", 0)
    available = info.get("MemAvailable", info.get("MemFree", 0))
    limit, usage = _cgroup()
    if limit is not None and limit < total:
        total = limit
        available = min(available, max(limit - (usage or 0), 0))
    return MemoryRoom("cpu", available, total)


def _meminfo() -> dict[str, int]:
    out = {}
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            key, _, rest = line.partition(":")
            parts = rest.split()
            if parts and parts[0].isdigit():
                out[key] = int(parts[0]) * (1024 if parts[1:] == ["kB"] else 1)
    except OSError:
        pass
    return out


def _cgroup() -> tuple[int | None, int | None]:
    for limit_path, usage_path in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                                   ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                                    "/sys/fs/cgroup/memory/memory.usage_in_bytes")):  # fmt: skip
        try:
            limit = Path(limit_path).read_text().strip()
            usage = Path(usage_path).read_text().strip()
        except OSError:
            continue
        if limit.isdigit():
            return int(limit), int(usage) if usage.isdigit() else None
    return None, None


def _checkpoint_dtype(path: Path) -> str | None:
    config = path / "config.json" if path.is_dir() else None
    if config is None or not config.is_file():
        return None
    try:
        data = json.loads(config.read_text())
    except (OSError, ValueError):
        return None
    value = data.get("torch_dtype") or data.get("dtype")
    return value if isinstance(value, str) else None


def return_freed_memory() -> bool:
    """Give the heap's free pages back to the system (glibc `malloc_trim`). An unloaded version's weights
    are many mid-sized allocations that glibc keeps in the process's heap after they are freed (its KV
    cache, one large mapping, goes by itself). False where there is no glibc."""
    try:
        trim = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return False
    trim(0)
    return True
